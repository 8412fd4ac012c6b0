"""What a plan is: per-op actions that move tensors on and off the device, as plain data.

    before[i]:  release   compute waits for an eviction's copy; its bytes are free again
                alloc     a tensor's first write this step, at a planned arena offset
                prefetch  host -> device on the H2D stream, once compute is done with the bytes
                wait      compute waits for a prefetch that op i (or a recompute) reads
                recompute re-run a cheap producer op instead of copying its output back
    after[i]:   evict     device -> pinned host on the D2H stream, after op i
                discard   the host copy is still current (nothing wrote the tensor since it
                          arrived): just free the device bytes, nothing to copy
                drop      forget a tensor that will be recomputed
                free      last use
    end:        release   evictions still in flight when the step ends

Persistent tensors whose wrap gap is spent on the host are *homed* there: each step prefetches
them before their first use and evicts them after their last (the momentum buffers, the big
classifier weights). The rest stay at fixed offsets.

Plain data, so that one interpreter (walk.py) can replay it for every reader: the checker
(check.py) without a GPU, the cost model (cost.py) with no more than op times and a link, and
the executor (executor.py) with streams and events.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

from proto.vm.liveness import Gap

if TYPE_CHECKING:
    from proto.vm.timeline import Link

ActionKind = Literal["alloc", "free", "evict", "discard", "release", "prefetch", "wait", "drop",
                     "recompute"]
KINDS: tuple[str, ...] = get_args(ActionKind)


@dataclasses.dataclass(frozen=True)
class Action:
    kind: ActionKind
    tensor: str
    offset: int = -1      # arena offset, for the actions that take memory (alloc, prefetch, recompute)
    producer: int = -1    # recompute: the op to re-run


@dataclasses.dataclass
class Plan:
    budget: int
    arena_bytes: int
    persistent: dict[str, int]          # name -> offset: resident at a fixed place all step
    homed: tuple[str, ...]              # persistent tensors that live on the host between steps
    before: list[list[Action]]
    after: list[list[Action]]
    end: list[Action]
    offloaded: list[Gap]                # gaps spent on the host
    recomputed: list[Gap]               # gaps spent dropped, then recomputed
    peak_bytes: int                     # the most bytes resident at any point
    d2h_bytes: int = 0                  # copied each step, each way
    h2d_bytes: int = 0

    def link_seconds(self, link: Link) -> float:
        """Time the host link needs for this plan's copies (the two directions run at once)."""
        return max(self.d2h_bytes / link.d2h, self.h2d_bytes / link.h2d)

    def actions(self):
        """(slot, op index, action) in execution order; slot is 'before', 'after' or 'end'."""
        for i, (pre, post) in enumerate(zip(self.before, self.after)):
            yield from (("before", i, a) for a in pre)
            yield from (("after", i, a) for a in post)
        yield from (("end", len(self.before), a) for a in self.end)


class PlanError(AssertionError):
    """A plan breaks one of the rules `validate` checks."""
