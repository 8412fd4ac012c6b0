"""The one interpreter of a plan: visits its actions, and the ops between them, in execution order.

Every reader of a plan is a `Visitor` handed to `walk`: the checker (check.py), the cost model
(cost.py) and the executor (executor.py). They share the order here, so what the checker
passes and the cost model times is exactly what the executor runs.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from proto.vm.actions import KINDS, Action, Plan


@dataclasses.dataclass(frozen=True)
class At:
    """Where an action sits: before or after op `op`, or at the end of the step (op = n)."""
    slot: Literal["before", "after", "end"]
    op: int


class Visitor:
    """A reader of a plan. `walk` calls `op(i)` where op i runs, `ops_done()` after the last
    op's actions, and `visit(action, At)` for each action, which calls the method named after
    the action's kind. Those do nothing here: a visitor overrides the ones it has something
    to do for (and `visit`, to do something around every action)."""

    def visit(self, act: Action, at: At) -> None:
        # Only the known kinds name methods: a kind such as "op" must not reach Visitor.op.
        if act.kind in KINDS:
            getattr(self, act.kind)(act, at)
        else:
            self.unknown(act, at)

    def op(self, i: int) -> None:
        pass

    def ops_done(self) -> None:
        pass

    def unknown(self, act: Action, at: At) -> None:
        raise ValueError(f"unknown action {act.kind!r}")

    def alloc(self, act: Action, at: At) -> None:
        pass

    def free(self, act: Action, at: At) -> None:
        pass

    def evict(self, act: Action, at: At) -> None:
        pass

    def discard(self, act: Action, at: At) -> None:
        pass

    def release(self, act: Action, at: At) -> None:
        pass

    def prefetch(self, act: Action, at: At) -> None:
        pass

    def wait(self, act: Action, at: At) -> None:
        pass

    def drop(self, act: Action, at: At) -> None:
        pass

    def recompute(self, act: Action, at: At) -> None:
        pass


def walk(plan: Plan, visitor: Visitor) -> None:
    """Replay `plan` into `visitor`: each op's before-actions, the op, its after-actions; then
    the end's actions."""
    for i, (pre, post) in enumerate(zip(plan.before, plan.after)):
        for act in pre:
            visitor.visit(act, At("before", i))
        visitor.op(i)
        for act in post:
            visitor.visit(act, At("after", i))
    visitor.ops_done()
    for act in plan.end:
        visitor.visit(act, At("end", len(plan.before)))

