"""When copies can overlap compute: the timing model the planner chooses gaps by.

Ops take `op_seconds`, copies take bytes / link bandwidth on one FIFO stream per direction. An
eviction is released at the first op that starts after its copy should be done; a prefetch is
issued at the last op boundary from which it still arrives in time (or `lookahead` ops ahead).
Where the budget is tighter than that allows, a `Choice` widens its gap's window and compute
waits. Time and op indices of the next step continue past n (op i of the next step is n + i).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Literal

from kernels import _check
from proto.tape import Tape
from proto.vm.liveness import Gap, Liveness


@dataclasses.dataclass(frozen=True)
class Link:
    """Host-link bandwidth in bytes/s, per direction (pinned memory)."""
    h2d: float = 54e9     # measured on the H200 (pinned memory, both directions)
    d2h: float = 55e9

    def __post_init__(self):   # copy times divide by these: 0, NaN or inf would mislead
        for name in ("h2d", "d2h"):
            _check.number(f"Link.{name}", getattr(self, name), positive=True)


def estimate_op_seconds(tape: Tape, flops_per_s: float = 20e12, bytes_per_s: float = 3e12) -> list[float]:
    """A roofline guess per op, used when no measured profile is given."""
    out = []
    for op in tape.ops:
        nbytes = sum(tape.tensors[n].nbytes for n in set(op.reads) | set(op.writes))
        out.append(max(op.flops / flops_per_s, nbytes / bytes_per_s, 2e-6))
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    """How a chosen gap is spent, and the bounds that force its window wider than the timing
    model would make it (frozen: widening makes a new Choice, so no caller's copy changes)."""
    mode: Literal["offload", "recompute"]
    release_by: int     # release no later than before this op (forced when the budget is tight)
    prefetch_from: int  # prefetch no earlier than this op


def contains(window: tuple[int, int], i: int, n: int) -> bool:
    """Is op i of this step inside [release, prefetch) (which may run into the next step)?"""
    r, p = window
    return r <= i < p or r <= i + n < p


class Timeline:
    """Op start times of one tape (this step and the next) and, from them, the window each
    chosen gap spends off the device and the bytes resident during each op."""

    def __init__(self, tape: Tape, op_seconds, link: Link, lookahead: int | None,
                 host_copy: bool = True):
        self.tape, self.link, self.lookahead = tape, link, lookahead
        self.host_copy = host_copy
        self.n = n = len(tape.ops)
        self.op_seconds = list(op_seconds) if op_seconds is not None else estimate_op_seconds(tape)
        if len(self.op_seconds) != n:
            raise ValueError(f"op_seconds: expected {n} values (one per op), got {len(self.op_seconds)}")
        for i, s in enumerate(self.op_seconds):
            _check.number(f"op_seconds[{i}] ({tape.ops[i].name})", s, at_least=0)
        # start[i]: when op i begins, for this step and the next (i up to 2n)
        self.start = list(itertools.accumulate(self.op_seconds * 2, initial=0.0))
        # fitting asks again and again about the same tensors' choices
        self._dirty_memo: dict = {}

    def _release_op(self, g: Gap, d2h_free: float) -> tuple[int, float]:
        """The first op that starts after g's eviction (queued behind `d2h_free`) is done;
        at most the end of the step (n)."""
        done = max(self.start[g.after + 1], d2h_free) + g.nbytes / self.link.d2h
        return bisect.bisect_left(self.start, done, g.after + 1, min(g.before, self.n)), done

    def _prefetch_op(self, g: Gap, h2d_next: float, live: Liveness) -> tuple[int, float]:
        """The last op boundary from which g's prefetch (queued before one that starts at
        `h2d_next`) still lands before op g.before starts; or `lookahead` ops ahead. A wrap
        gap's prefetch happens in the step that uses it (from op n on)."""
        if not live.reads_at(g.tensor, g.before % self.n):
            return g.before, h2d_next          # the use overwrites it: nothing comes back
        lo = max(g.after + 1, self.n if g.wrap else 0)
        if self.lookahead is not None:
            p = max(g.before - self.lookahead, lo)
            return p, self.start[p]
        latest = min(self.start[g.before], h2d_next) - g.nbytes / self.link.h2d
        p = max(bisect.bisect_right(self.start, latest, lo, g.before + 1) - 1, lo)
        return p, min(self.start[p], latest)

    def natural_window(self, g: Gap, live: Liveness) -> tuple[int, int]:
        """Ops [release, prefetch) g would spend off the device with the copy streams to itself."""
        return self._release_op(g, 0.0)[0], self._prefetch_op(g, float("inf"), live)[0]

    def forced_wait(self, g: Gap, i: int, live: Liveness) -> float:
        """Seconds compute would wait if g had to be off the device during op i: for the
        eviction to finish before op i, and for the prefetch issued after op i to land."""
        wait = 0.0
        if g.after < i:
            wait += max(0.0, self.start[g.after + 1] + g.nbytes / self.link.d2h - self.start[i])
        if live.reads_at(g.tensor, g.before % self.n):
            after_i = i + 1 if i < g.before else i + self.n + 1
            wait += max(0.0, self.start[after_i] + g.nbytes / self.link.h2d - self.start[g.before])
        return wait

    def may_copy(self, live: Liveness, g: Gap) -> bool:
        """Whether g's eviction would copy, guessed before the other choices are known: the
        tensor is written in the step before g (anywhere in it, for a wrap gap), or the host
        keeps no copy at all."""
        if not self.host_copy:
            return True
        if g.wrap:
            return live.written_between(g.tensor, 0, self.n - 1)
        return live.written_between(g.tensor, live.first(g.tensor), g.after)

    def dirty(self, live: Liveness, chosen: dict[Gap, Choice]) -> set[Gap]:
        """Offloaded gaps whose eviction must copy: the tensor was written since it last came
        from the host (homed tensors start the step with a current host copy). Without a host
        copy (managed memory: a prefetch moves the pages, and the host keeps none), all."""
        if not self.host_copy:
            return {g for g, c in chosen.items() if c.mode == "offload"}
        out = set()
        by_tensor: dict[str, list[Gap]] = {}
        for g in chosen:
            by_tensor.setdefault(g.tensor, []).append(g)
        for name, gaps in by_tensor.items():
            key = (id(live), tuple(sorted((g.after, g.before, chosen[g].mode) for g in gaps)))
            hit = self._dirty_memo.get((name, key))
            if hit is None:
                hit = self._dirty_memo[(name, key)] = _dirty_chain(live, name, gaps, chosen)
            out.update(hit)
        return out

    def windows(self, live: Liveness, chosen: dict[Gap, Choice]) -> dict[Gap, tuple[int, int]]:
        """Ops [release, prefetch) during which each chosen gap holds no device memory, with
        evictions queued FIFO on one stream and prefetches on another."""
        offload = [g for g, c in chosen.items() if c.mode == "offload"]
        dirty = self.dirty(live, chosen)
        release, d2h_free = {}, 0.0
        for g in sorted(offload, key=lambda g: (g.after, g.tensor)):
            if g in dirty:
                release[g], d2h_free = self._release_op(g, d2h_free)
            else:
                release[g] = g.after + 1    # the host copy is current: free at once
        prefetch, h2d_next = {}, float("inf")
        for g in sorted(offload, key=lambda g: (-g.before, g.tensor)):
            prefetch[g], h2d_next = self._prefetch_op(g, h2d_next, live)
        out = {}
        for g, c in chosen.items():
            if c.mode == "recompute":
                out[g] = (g.after + 1, g.before)
            else:
                r = min(release[g], c.release_by)
                out[g] = (r, min(max(prefetch[g], c.prefetch_from, r), g.before))
        return out

    def link_seconds(self, live: Liveness, chosen: dict[Gap, Choice]) -> float:
        """Host-link time of the copies `chosen` implies (both directions run at once)."""
        dirty = self.dirty(live, chosen)
        d2h = sum(g.nbytes for g in dirty)
        h2d = sum(g.nbytes for g, c in chosen.items()
                  if c.mode == "offload" and live.reads_at(g.tensor, g.before % self.n))
        return max(d2h / self.link.d2h, h2d / self.link.h2d)

    def profile(self, live: Liveness, windows) -> list[int]:
        """Resident bytes during each op when each gap frees its window."""
        n = self.n
        diff = [0] * (2 * n + 1)
        for g, (r, p) in windows.items():
            if r < p:
                diff[r] += g.nbytes
                diff[p] -= g.nbytes
        freed = list(itertools.accumulate(diff))
        return [live.live_bytes[i] - freed[i] - freed[i + n] for i in range(n)]


def _dirty_chain(live: Liveness, name: str, gaps: list[Gap], chosen) -> list[Gap]:
    """Of one tensor's chosen gaps, those whose eviction must copy, walking them in order."""
    out, host_current, pos = [], name in live.persistent, 0
    for g in sorted(gaps, key=lambda g: g.after):
        if live.written_between(name, pos, g.after):
            host_current = False
        if chosen[g].mode == "recompute":
            host_current = False
        elif not host_current:
            out.append(g)
            host_current = True
        pos = g.before
    return out
