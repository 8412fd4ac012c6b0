"""Where each tensor lives in a managed arena, and how many of its pages a plan keeps resident.

Layout. On managed memory a tensor keeps one virtual address range all step while its pages
move, so ranges are placed like the unconstrained run's (the same blocks as lower.py, each
transient held from its first use to its last, packed by proto.graph.plan.place): a range is
never reused while its tensor lives, even while its pages are on the host. What moves owns
whole pages: every transient and every homed tensor starts on a page boundary and is rounded
up to whole pages, so pushing it to the host frees exactly its pages and never drags a
neighbour's bytes along (on the simulator, never poisons a neighbour). Persistent tensors that
never move are packed densely in one region at the start: they may share pages with each
other, as they are always resident. The price is up to one page of slack per moving tensor.

Accounting. The GPU is shared, so the budget is emulated: `PageLedger` walks the plan (a
walk.py visitor, like the checker) and counts resident pages as the managed executor moves
them: alloc, prefetch and recompute bring a tensor's pages in; free and drop give them back
at once (in compute-stream order); evict and discard send them to the host on the D2H
stream, and they count until compute has waited for that stream: a release waits for its
eviction and, the stream being FIFO, for everything sent before it; the step's end waits
for the rest. Run strict before any launch it raises BudgetError where the plan would pass the
budget's pages; the executor runs it again alongside the step to keep `peak_pages` honest.
A plan that fits by bytes may not fit by pages (rounding, discards still in flight):
`plan_for_pages` in managed.py re-plans under a smaller byte budget when that happens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proto.graph.plan import Block, place
from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.liveness import BudgetError, Liveness, fmt_bytes
from proto.vm.paging import PageTable
from proto.vm.walk import At, Visitor, walk


@dataclasses.dataclass(frozen=True)
class Layout:
    offsets: dict[str, int]   # every tensor an op uses -> its byte offset in the arena
    arena_bytes: int
    fixed_bytes: int          # [0, fixed_bytes): the persistent tensors that never move
    page_bytes: int


def layout(tape: Tape, plan: Plan, page_bytes: int) -> Layout:
    """The managed arena for `plan`: fixed tensors packed densely, movers page-aligned."""
    live = Liveness(tape)
    last = max(live.n_ops - 1, 0)
    fixed = [Block(name, 0, last, live.nbytes(name)) for name in plan.persistent]
    offsets, fixed_bytes = place(fixed)
    movers = [Block(name, 0, last, live.nbytes(name)) for name in plan.homed]
    movers += [Block(name, live.first(name), live.last(name), live.nbytes(name))
               for name in live.uses if name not in live.persistent]
    region = [(Block("(fixed tensors)", 0, last, fixed_bytes), 0)] if fixed_bytes else []
    moving, arena = place(movers, align=page_bytes, fixed=region)
    offsets.update(moving)
    return Layout(offsets, max(arena, fixed_bytes), fixed_bytes, page_bytes)


class PageLedger(Visitor):
    """Resident pages of a managed arena as a plan's actions move its tensors (see above)."""

    def __init__(self, tape: Tape, lay: Layout, budget: int):
        self.tape = tape
        self.table = PageTable(lay.arena_bytes, budget, lay.page_bytes)   # checks budget, page size
        self.budget, self.max_pages = budget, self.table.max_resident
        self._pages = {name: self.table.pages([(off, tape.tensors[name].nbytes)])
                       for name, off in lay.offsets.items()}
        self._fixed = self.table.pages([(0, lay.fixed_bytes)])
        self.held = np.zeros(self.table.n_pages, dtype=np.int64)
        self.sending: list[str] = []   # pushed on the D2H stream, not yet waited for
        self.strict = False
        self.peak_pages = 0
        self.where = "at the start of the step"

    @property
    def resident_pages(self) -> int:
        return int(np.count_nonzero(self.held))

    def start(self) -> None:
        """A step begins: the fixed tensors resident, everything else away."""
        self.held[:] = 0
        self.held[self._fixed] += 1
        self.sending.clear()
        self.where = "at the start of the step"
        self._note()

    def check(self, plan: Plan, strict: bool = True) -> int:
        """Walk `plan`; the most pages it keeps resident (strict: BudgetError past the budget)."""
        self.strict = strict
        try:
            self.start()
            walk(plan, self)
            self.drain()
        finally:
            self.strict = False
        peak, self.peak_pages = self.peak_pages, 0
        return peak

    def _note(self) -> None:
        now = self.resident_pages
        self.peak_pages = max(self.peak_pages, now)
        if self.strict and now > self.max_pages:
            page = self.table.page_bytes
            raise BudgetError(
                f"budget {fmt_bytes(self.budget)} holds {self.max_pages} pages of "
                f"{fmt_bytes(page)}; {self.where}, following the plan would make {now} pages "
                f"({fmt_bytes(now * page)}) resident: moving tensors take whole pages, and "
                "what is sent to the host counts until compute waits for it")

    # -- the plan's actions -----------------------------------------------------------------
    def visit(self, act: Action, at: At) -> None:
        self.where = (f"at the end, {act.kind} {act.tensor}" if at.slot == "end" else
                      f"{at.slot} op {at.op} ({self.tape.ops[at.op].name}), {act.kind} {act.tensor}")
        super().visit(act, at)

    def alloc(self, act: Action, at: At) -> None:
        self.held[self._pages[act.tensor]] += 1
        self._note()

    prefetch = recompute = alloc

    def free(self, act: Action, at: At) -> None:
        self.held[self._pages[act.tensor]] -= 1

    drop = free

    def evict(self, act: Action, at: At) -> None:
        self.sending.append(act.tensor)

    discard = evict

    def release(self, act: Action, at: At) -> None:
        if act.tensor in self.sending:     # else an earlier release already waited past it
            self._arrived_home(self.sending.index(act.tensor) + 1)

    def drain(self) -> None:
        """Compute waited for everything sent to the host (the end of a step)."""
        self._arrived_home(len(self.sending))

    def _arrived_home(self, k: int) -> None:
        for name in self.sending[:k]:
            self.held[self._pages[name]] -= 1
        del self.sending[:k]
