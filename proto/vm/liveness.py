"""What a memory policy must know about a tape before anything runs.

Persistent tensors (inputs, parameters, their gradients, optimizer state) live across steps and
stay resident at fixed places. Every other tensor is *transient*: it is born when an op first
writes it and dies after its last use, and between two uses far apart it may leave the device.
That interval between consecutive uses is a `Gap`; AutoVM's whole game is choosing which gaps
to spend on the host (or on recomputation) so the step fits a byte budget.

Budgets that cannot work are refused here, before any launch, with the op and the bytes it needs.
"""
from __future__ import annotations

import dataclasses
import functools

from proto.tape import Tape

ALIGN = 256  # cudaMalloc's alignment: every block starts where a kernel expects it to


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align

PERSISTENT_KINDS = frozenset({"input", "param", "grad", "state"})


class BudgetError(ValueError):
    """The budget cannot run this step under the policy asked for (raised before any launch)."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


@dataclasses.dataclass(frozen=True)
class Gap:
    """Tensor `tensor` is used by op `after`, then not again until op `before` reads it."""
    tensor: str
    after: int
    before: int
    nbytes: int

    @property
    def length(self) -> int:
        return self.before - self.after


class Liveness:
    """Uses, lifetimes and gaps of a tape's tensors.

    `extra_reads` adds reads that are not on the tape: a recomputation placed just before op b
    reads its producer's inputs there (schedule.py uses it to re-derive gaps).
    """

    def __init__(self, tape: Tape, extra_reads: dict[str, frozenset[int]] | None = None):
        self.tape = tape
        self.n_ops = len(tape.ops)
        self.reads = [frozenset(op.reads) for op in tape.ops]
        self.writes = [frozenset(op.writes) for op in tape.ops]
        self.extra_reads = {k: frozenset(v) for k, v in (extra_reads or {}).items() if v}
        self.persistent = tuple(n for n, t in tape.tensors.items() if t.kind in PERSISTENT_KINDS)
        self.persistent_bytes = sum(self.nbytes(n) for n in self.persistent)
        uses: dict[str, list[int]] = {n: [] for n in tape.tensors if n not in self.persistent}
        for i in range(self.n_ops):
            for name in self.reads[i] | self.writes[i]:
                if name in uses:
                    uses[name].append(i)
        for name, extra in self.extra_reads.items():
            uses[name] = sorted(set(uses[name]) | extra)
        for name, u in uses.items():
            if u and name not in self.writes[u[0]]:
                op = tape.ops[u[0]]
                raise ValueError(f"tensor {name!r} ({tape.tensors[name].kind}) is read by op "
                                 f"{op.name!r} before any op writes it")
            if u and name in self.reads[u[0]]:
                raise ValueError(f"op {tape.ops[u[0]].name!r} reads and writes {name!r} at its "
                                 "first use: it would read uninitialized memory")
        self.uses = {n: u for n, u in uses.items() if u}   # transient tensors some op touches
        # A transient whose last use writes it is a result of the step (the loss, say): it stays
        # resident until the step ends so the caller can read it.
        self.outputs = frozenset(n for n, u in self.uses.items() if n in self.writes[u[-1]])

    def nbytes(self, name: str) -> int:
        """Bytes a tensor takes in the arena: its size rounded up to the allocation alignment."""
        return align_up(self.tape.tensors[name].nbytes)

    def first(self, name: str) -> int:
        return self.uses[name][0]

    def last(self, name: str) -> int:
        return self.n_ops - 1 if name in self.outputs else self.uses[name][-1]

    def reads_at(self, name: str, i: int) -> bool:
        return name in self.reads[i] or i in self.extra_reads.get(name, ())

    @functools.cached_property
    def gaps(self) -> tuple[Gap, ...]:
        """Every interval between consecutive uses with at least one op between them, whose
        closing use reads the tensor (a closing write-only use would make the copy pointless,
        and a partial write would make dropping it wrong, so such tensors simply stay)."""
        out = []
        for name, u in self.uses.items():
            for a, b in zip(u, u[1:]):
                if b - a >= 2 and self.reads_at(name, b):
                    out.append(Gap(name, a, b, self.nbytes(name)))
        return tuple(out)

    def op_tensors(self, i: int) -> frozenset[str]:
        return self.reads[i] | self.writes[i]

    def working_set(self, i: int) -> int:
        """Bytes op i reads and writes, plus the persistent tensors that never leave."""
        return self.persistent_bytes + sum(self.nbytes(n) for n in self.op_tensors(i)
                                           if n not in self.persistent)

    @functools.cached_property
    def live_bytes(self) -> list[int]:
        """Resident bytes during each op when nothing is ever moved out (the unconstrained run)."""
        diff = [0] * (self.n_ops + 1)
        for name in self.uses:
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
            for i in range(g.after + 1, g.before):
                out[i] -= g.nbytes
        return out

    def check_budget(self, budget: int) -> None:
        """Raise BudgetError if no schedule can run the step within `budget` bytes."""
        if budget < self.persistent_bytes:
            raise BudgetError(f"budget {fmt_bytes(budget)} is below the "
                              f"{fmt_bytes(self.persistent_bytes)} of parameters, gradients, "
                              "state and inputs, which stay resident")
        for i, op in enumerate(self.tape.ops):
            if self.working_set(i) > budget:
                raise BudgetError(
                    f"budget {fmt_bytes(budget)} is too small for op {op.name!r} (layer "
                    f"{op.layer or '?'!r}): it reads and writes "
                    f"{fmt_bytes(self.working_set(i) - self.persistent_bytes)} besides the "
                    f"{fmt_bytes(self.persistent_bytes)} that stay resident, so it needs at "
                    f"least {fmt_bytes(self.working_set(i))}")
        worst = max(range(self.n_ops), key=self.floor_bytes.__getitem__, default=None)
        if worst is not None and self.floor_bytes[worst] > budget:
            op = self.tape.ops[worst]
            raise BudgetError(
                f"budget {fmt_bytes(budget)} is too small at op {op.name!r} (layer "
                f"{op.layer or '?'!r}): {fmt_bytes(self.floor_bytes[worst])} must be resident "
                "there (its working set plus tensors used on both sides of it)")
