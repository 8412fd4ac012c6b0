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
them: alloc, prefetch and recompute bring a tensor's pages in; evict and discard send them to
the host on the D2H stream, and they count until compute has waited for that stream: a
release waits for its eviction and, the stream being FIFO, for everything sent before it; the
step's end waits for the rest.

Dead pages. A tensor's pages stay resident after its last use (free, drop, or the step's end
for its outputs): the next tensor placed in that range reuses them as they are, where
discarding them and populating fresh pages would cost a driver call each way for every
tensor. They count against the budget like any other. Only when an action would bring in
more pages than the budget holds does the ledger pick dead pages to discard first, those
dead longest first (`dropped`, for the executor to discard on the compute stream before the
action); `filled` are the pages an alloc must populate because no dead page was there.
Since dead pages outlive a step, a step starts where the last one ended: the check walks
steps until the state at a step's start repeats, so every later step is one it checked
(else, which no plan has needed so far, each step starts by discarding every dead page).

Run strict before any launch it raises BudgetError where the plan would pass the budget's
pages; the executor runs it again alongside the steps, so `peak_pages` is what they counted.
A plan that fits by bytes may not fit by pages (rounding, copies in flight):
`plan_for_pages` in managed.py re-plans under a smaller byte budget when that happens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proto.graph.plan import Block, place
from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.liveness import BudgetError, Liveness, fmt_bytes
from proto.vm.paging import PageTable, page_runs
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

    MAX_CHECKED_STEPS = 4   # steps walked before a repeating start state; else no carry-over

    def __init__(self, tape: Tape, lay: Layout, budget: int):
        self.tape = tape
        self.table = PageTable(lay.arena_bytes, budget, lay.page_bytes)   # checks budget, page size
        self.budget, self.max_pages = budget, self.table.max_resident
        self._pages = {name: self.table.pages([(off, tape.tensors[name].nbytes)])
                       for name, off in lay.offsets.items()}
        self._fixed = self.table.pages([(0, lay.fixed_bytes)])
        n = self.table.n_pages
        self.held = np.zeros(n, dtype=np.int64)   # live tensors on each page
        self.dead = np.zeros(n, dtype=bool)       # resident, no live tensor: reusable, droppable
        self.died = np.zeros(n, dtype=np.int64)   # when each dead page died (oldest dropped first)
        self.clock = 0
        self.carry = True          # dead pages outlive the step (decided by check)
        self.sending: list[str] = []   # pushed on the D2H stream, not yet waited for
        self.dropped: list[tuple[int, int]] = []   # page runs the last action discards first
        self.filled: list[tuple[int, int]] = []    # page runs the last alloc populates
        self.strict = False
        self.peak_pages = 0
        self.where = "at the start of the step"

    @property
    def resident_pages(self) -> int:
        return int(np.count_nonzero((self.held > 0) | self.dead))

    def reset(self) -> None:
        """A fresh arena: nothing resident, nothing dead (start() brings the fixed tensors)."""
        self.held[:] = 0
        self.dead[:] = False
        self.sending.clear()

    def start(self) -> list[tuple[int, int]]:
        """A step begins: the fixed tensors resident, the previous step's outputs dead; the
        page runs to discard first (every dead page, where dead pages do not carry over)."""
        self.dead |= self.held > 0
        self.held[:] = 0
        self.held[self._fixed] = 1
        self.dead[self._fixed] = False
        self.sending.clear()
        self.dropped = [] if self.carry else page_runs(np.flatnonzero(self.dead))
        if not self.carry:
            self.dead[:] = False
        self.where = "at the start of the step"
        self._note()
        return self.dropped

    def check(self, plan: Plan, strict: bool = True) -> int:
        """Walk `plan` over steps from a fresh arena until a step starts as an earlier one did;
        the most pages it keeps resident (strict: BudgetError past the budget). Leaves the
        ledger fresh, for the executor's steps."""
        self.strict = strict
        try:
            for self.carry in (True, False):
                self.reset()
                seen, peak = [], 0
                for _ in range(self.MAX_CHECKED_STEPS):
                    self.peak_pages = 0
                    self.start()
                    # what a step does depends on which pages are dead and the order they
                    # died in (the oldest are dropped first), not on when
                    dead = np.flatnonzero(self.dead)
                    order = dead[np.argsort(self.died[dead], kind="stable")]
                    state = (self.held.tobytes(), order.tobytes())
                    if state in seen:
                        break
                    seen.append(state)
                    walk(plan, self)
                    self.drain()
                    peak = max(peak, self.peak_pages)
                else:
                    continue   # no repeat: check again without carry-over
                break
        finally:
            self.strict = False
            self.reset()
        self.peak_pages = 0
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
        self.dropped, self.filled = [], []
        self.clock += 1
        super().visit(act, at)

    def _bring_in(self, name: str) -> np.ndarray:
        """`name`'s pages resident and live, room made for those that were not; returns
        those that were not (no live or dead tensor left them resident)."""
        pages = self._pages[name]
        new = pages[~self.dead[pages] & (self.held[pages] == 0)]
        self._make_room(len(new), pages)
        self.held[pages] += 1
        self.dead[pages] = False
        self._note()
        return new

    def alloc(self, act: Action, at: At) -> None:
        self.filled = page_runs(self._bring_in(act.tensor))

    recompute = alloc

    def prefetch(self, act: Action, at: At) -> None:
        self._bring_in(act.tensor)

    def _make_room(self, coming: int, keep: np.ndarray) -> None:
        """Discard the oldest dead pages (none of `keep`) so `coming` more pages fit."""
        excess = self.resident_pages + coming - self.max_pages
        if excess <= 0:
            return
        dead = np.flatnonzero(self.dead)
        dead = dead[~np.isin(dead, keep)]
        gone = np.sort(dead[np.argsort(self.died[dead], kind="stable")[:excess]])
        self.dead[gone] = False
        self.dropped = page_runs(gone)

    def free(self, act: Action, at: At) -> None:
        pages = self._pages[act.tensor]
        self.held[pages] -= 1
        died = pages[self.held[pages] == 0]
        self.dead[died] = True
        self.died[died] = self.clock

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
