"""What a memory policy must know about a tape before anything runs.

Persistent tensors (inputs, parameters, their gradients, optimizer state) live across steps.
Every other tensor is *transient*: it is born when an op first writes it and dies after its
last use. Between two uses far apart a tensor may leave the device: that interval is a `Gap`.
A persistent tensor also has a *wrap* gap, from its last use in one step to its first use in
the next; spending it on the host makes the tensor live there between steps (the optimizer
state of most layers, say). AutoVM's game is choosing which gaps to spend on the host (or on
recomputation) so the step fits a byte budget.

Budgets that cannot work are refused here, before any launch, with the op and the bytes it needs.
"""
from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

from proto.device.backend import align_up
from proto.tape import Tape


PERSISTENT_KINDS = frozenset({"input", "param", "grad", "state"})


class BudgetError(ValueError):
    """The budget cannot run this step under the policy asked for (raised before any launch)."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


class Gap(NamedTuple):
    """Tensor `tensor` is used by op `after`, then not again until op `before`.

    A *wrap* gap belongs to a persistent tensor: from its last use in one step to its first
    use in the next, so `before` counts on into the next step (first use + number of ops).
    """
    tensor: str
    after: int
    before: int
    nbytes: int
    wrap: bool = False

    @property
    def length(self) -> int:
        return self.before - self.after

    def covers(self, i: int, n_ops: int) -> bool:
        """True if op i (of this step) runs while the gap is open."""
        return self.after < i < self.before or (self.wrap and i < self.before - n_ops)


class Liveness:
    """Uses, lifetimes and gaps of a tape's tensors.

    `extra_reads` adds reads that are not on the tape: a recomputation placed just before op b
    reads its producer's inputs there (recompute.py uses it to re-derive gaps).
    """

    def __init__(self, tape: Tape, extra_reads: dict[str, frozenset[int]] | None = None):
        self.tape = tape
        self.n_ops = n = len(tape.ops)
        self.reads = [frozenset(op.reads) for op in tape.ops]
        self.writes = [frozenset(op.writes) for op in tape.ops]
        self.extra_reads = {k: frozenset(v) for k, v in (extra_reads or {}).items() if v}
        self.persistent = tuple(name for name, t in tape.tensors.items() if t.kind in PERSISTENT_KINDS)
        self.persistent_bytes = sum(self.nbytes(name) for name in self.persistent)
        uses: dict[str, list[int]] = {name: [] for name in tape.tensors}
        for i in range(n):
            for name in self.reads[i] | self.writes[i]:
                uses[name].append(i)
        for name, extra in self.extra_reads.items():
            uses[name] = sorted(set(uses[name]) | extra)
        for name, u in uses.items():
            if not u or name in self.persistent:
                continue
            if name not in self.writes[u[0]]:
                raise ValueError(f"tensor {name!r} ({tape.tensors[name].kind}) is read by op "
                                 f"{tape.ops[u[0]].name!r} before any op writes it")
            if name in self.reads[u[0]]:
                raise ValueError(f"op {tape.ops[u[0]].name!r} reads and writes {name!r} at its "
                                 "first use: it would read uninitialized memory")
        self.uses = {name: u for name, u in uses.items() if u}   # every tensor some op touches
        # A transient whose last use writes it is a result of the step (the loss, say): it stays
        # resident until the step ends so the caller can read it. Workspaces are scratch an op
        # writes for itself: never results.
        self.outputs = frozenset(name for name, u in self.uses.items()
                                 if name not in self.persistent and name in self.writes[u[-1]]
                                 and tape.tensors[name].kind != "workspace")

    def nbytes(self, name: str) -> int:
        """Bytes a tensor takes in the arena: its size rounded up to the allocation alignment."""
        return align_up(self.tape.tensors[name].nbytes)

    def first(self, name: str) -> int:
        return 0 if name in self.persistent else self.uses[name][0]

    def last(self, name: str) -> int:
        if name in self.persistent or name in self.outputs:
            return self.n_ops - 1
        return self.uses[name][-1]

    def reads_at(self, name: str, i: int) -> bool:
        return name in self.reads[i] or i in self.extra_reads.get(name, ())

    @functools.cached_property
    def _write_ops(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, ws in enumerate(self.writes):
            for name in ws:
                out.setdefault(name, []).append(i)
        return out

    def written_between(self, name: str, lo: int, hi: int) -> bool:
        """Does some op in [lo, hi] write `name`?"""
        ops = self._write_ops.get(name, [])
        k = bisect.bisect_left(ops, lo)
        return k < len(ops) and ops[k] <= hi

    def last_write(self, name: str, lo: int, hi: int) -> int | None:
        """The last op in [lo, hi] that writes `name` (None: none does)."""
        ops = self._write_ops.get(name, [])
        k = bisect.bisect_right(ops, hi)
        return ops[k - 1] if k and ops[k - 1] >= lo else None

    @functools.cached_property
    def gaps(self) -> tuple[Gap, ...]:
        """Every interval between consecutive uses with at least one op between them whose
        closing use reads the tensor (a closing write-only use would make the copy pointless
        and a partial write would make dropping it wrong, so such tensors simply stay); and for
        each persistent tensor some op uses, its wrap gap across the step boundary (whose
        closing use may be a plain write: then nothing needs to come back)."""
        out = []
        for name, u in self.uses.items():
            for a, b in zip(u, u[1:]):
                if b - a >= 2 and self.reads_at(name, b):
                    out.append(Gap(name, a, b, self.nbytes(name)))
            if name in self.persistent:
                out.append(Gap(name, u[-1], u[0] + self.n_ops, self.nbytes(name), wrap=True))
        return tuple(out)

    def op_tensors(self, i: int) -> frozenset[str]:
        return self.reads[i] | self.writes[i]

    def working_set(self, i: int) -> int:
        """Bytes of the tensors op i reads and writes: all of them must be resident while it runs."""
        return sum(self.nbytes(name) for name in self.op_tensors(i))

    @functools.cached_property
    def live_bytes(self) -> list[int]:
        """Resident bytes during each op when nothing is ever moved out (the unconstrained run)."""
        diff = [0] * (self.n_ops + 1)
        for name in self.uses:
            if name not in self.persistent:
                diff[self.first(name)] += self.nbytes(name)
                diff[self.last(name) + 1] -= self.nbytes(name)
        out, acc = [], self.persistent_bytes
        for i in range(self.n_ops):
            acc += diff[i]
            out.append(acc)
        return out

    @property
    def peak(self) -> int:
        return max(self.live_bytes, default=self.persistent_bytes)

    @functools.cached_property
    def floor_bytes(self) -> list[int]:
        """Bytes that must be resident during each op even if every gap is spent off the device."""
        out = list(self.live_bytes)
        for g in self.gaps:
            for i in range(self.n_ops):
                if g.covers(i, self.n_ops):
                    out[i] -= g.nbytes
        return out

    @property
    def min_budget(self) -> int:
        """The smallest budget any schedule could run in (packing may need a little more)."""
        return max(max(self.floor_bytes, default=0),
                   max(map(self.working_set, range(self.n_ops)), default=0))

    def budget_between(self, frac: float) -> int:
        """The budget `frac` of the way from the smallest possible one to the unconstrained peak."""
        if not 0 <= frac <= 1:   # also NaN
            raise ValueError(f"frac: expected a number in [0, 1], got {frac!r}")
        return int(self.min_budget + frac * max(self.peak - self.min_budget, 0))

    def check_budget(self, budget: int) -> None:
        """Raise BudgetError if no schedule can run the step within `budget` bytes."""
        for i, op in enumerate(self.tape.ops):
            if self.working_set(i) > budget:
                raise BudgetError(
                    f"budget {fmt_bytes(budget)} is too small for op {op.name!r} (layer "
                    f"{op.layer or '?'!r}): the tensors it reads and writes take "
                    f"{fmt_bytes(self.working_set(i))}, which must all be on the device at once")
        worst = max(range(self.n_ops), key=self.floor_bytes.__getitem__, default=None)
        if worst is not None and self.floor_bytes[worst] > budget:
            op = self.tape.ops[worst]
            raise BudgetError(
                f"budget {fmt_bytes(budget)} is too small at op {op.name!r} (layer "
                f"{op.layer or '?'!r}): {fmt_bytes(self.floor_bytes[worst])} must be resident "
                "there (its own tensors, the step's outputs and tensors no schedule can move)")
