"""The cost model: the step time a plan should take, from op times and the link alone."""
from __future__ import annotations

from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.timeline import Link
from proto.vm.walk import At, Visitor, walk


def estimate_seconds(tape: Tape, plan: Plan, op_seconds, link: Link = Link()) -> float:
    """Step time the plan should take: ops run back to back on the compute stream except where
    it waits for a copy; each copy stream serves its copies in issue order, a prefetch starting
    once the compute work before it is done (as the executor orders them)."""
    clock = _Clock(tape, op_seconds, link)
    walk(plan, clock)
    return clock.compute


class _Clock(Visitor):
    """When the compute stream and each copy stream are next free, as the plan runs."""

    def __init__(self, tape: Tape, op_seconds, link: Link):
        self.tape, self.op_seconds, self.link = tape, op_seconds, link
        self.compute = self.d2h_free = self.h2d_free = 0.0
        self.evicted: dict[str, float] = {}   # when each eviction's copy is done
        self.arrived: dict[str, float] = {}   # when each prefetch lands

    def _nbytes(self, act: Action) -> int:
        return self.tape.tensors[act.tensor].nbytes

    def op(self, i: int) -> None:
        self.compute += self.op_seconds[i]

    def recompute(self, act: Action, at: At) -> None:
        self.compute += self.op_seconds[act.producer]

    def evict(self, act: Action, at: At) -> None:
        self.d2h_free = self.evicted[act.tensor] = (max(self.d2h_free, self.compute)
                                                    + self._nbytes(act) / self.link.d2h)

    def release(self, act: Action, at: At) -> None:
        self.compute = max(self.compute, self.evicted[act.tensor])

    def prefetch(self, act: Action, at: At) -> None:
        self.h2d_free = self.arrived[act.tensor] = (max(self.h2d_free, self.compute)
                                                    + self._nbytes(act) / self.link.h2d)

    def wait(self, act: Action, at: At) -> None:
        self.compute = max(self.compute, self.arrived[act.tensor])
