"""AutoVM on managed memory: the same plan, its moves done by prefetching unified memory.

Every tensor has its own range in one managed arena (residency.py: placed like the
unconstrained run, moving tensors page-aligned); its virtual address never changes, only where
its pages are. There is no pinned copy and no second device arena. The plan's actions become:

    evict X      D2H waits for compute (X is final), cuMemPrefetchAsync(X, CPU), record "evicted"
    release X    compute waits for "evicted": X's pages are off the GPU
    prefetch X   H2D waits for compute so far, cuMemPrefetchAsync(X, GPU), record "arrived"
    wait X       compute waits for "arrived"
    alloc X      X's first write: it reuses the dead pages of tensors placed there before;
                 pages that none left resident are populated by a prefetch to the GPU on
                 compute (a write would fault each page)
    free/drop X  X is dead: its pages stay resident for the next tensor placed there. Where an
                 action needs more pages than the budget holds, the ledger picks dead pages to
                 discard first: cuMemDiscardBatchAsync on compute (CUDA 13 drivers; older ones
                 push the dead bytes to the host instead)
    discard X    unlike the pool, not free: managed memory keeps one copy of each page, so "the
                 host copy is current" does not hold once X was prefetched; its pages travel to
                 the host like an eviction's, nobody waits for them, and they count as resident
                 until compute next waits on the D2H stream (see residency.py). Plans made for
                 managed memory (plan_for_pages: host_copy=False) have none: they evict and
                 release instead, so the planner sees when those pages are free
    recompute X  as alloc, then re-run X's producer

Hints. None in the step. cuMemAdvise is a synchronous host call, not stream-ordered, so it
cannot follow the plan inside a step. Preferred location (GPU) for the weights would only
matter if the driver evicted on its own, which it never does here (the budget is emulated and
the card is far from full); accessed-by (GPU) for homed tensors would turn a missing prefetch
into slow remote reads over the link instead of a fault the tests can see. The one hint that
pays is the discard of dead ranges above: no copy for bytes nobody will read.

Budget. The GPU is shared and cannot be oversubscribed, so the budget is emulated:
PageLedger (residency.py) counts resident 2 MiB pages as the actions move them and refuses,
before any launch, a plan whose pages would ever pass the budget; `peak_pages` is what the
step itself counted. `plan_for_pages` re-plans under a smaller byte budget until the pages fit.
The arena is the unconstrained placement's size and must fit the card (um.check_managed_fits).

No graph. cuMemPrefetchAsync cannot be captured: CUDA's graph node types (kernel, memcpy,
memset, host, event, semaphore, mem alloc/free, batch mem op, conditional, ... as listed by
cuda.bindings 13.5) have no prefetch node, and proto.graph records no such node either; so
this executor runs eagerly and `capture()` refuses.

On the simulator there is no managed memory: a device arena and a host mirror copy
synchronously (um.Mirrored), and bytes that left the device are poisoned with NaNs, so a plan
that forgot a prefetch shows NaNs in tests.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device import backend
from proto import graph
from proto.device.backend import align_up
from proto.tape import Tape
from proto.vm import schedule, um
from proto.vm.actions import Action, Plan
from proto.vm.liveness import BudgetError, fmt_bytes
from proto.vm.paging import run_bytes
from proto.vm.residency import Layout, PageLedger, layout
from proto.vm.runner import Replay, StepRunner
from proto.vm.um import PAGE
from proto.vm.walk import At


class ManagedExecutor(StepRunner):
    """Replays `plan` for `tape` on one managed arena, one `step()` per training step.

    budget: the emulated device budget, in bytes, that resident pages must stay within
    (default: the plan's). page_bytes: the page the budget is counted in (the UM driver's
    2 MiB). managed: real unified memory (default on a GPU); False: the simulator's mirror.
    Raises BudgetError before any launch if the plan would pass the budget in pages.
    """

    def __init__(self, tape: Tape, plan: Plan, *, budget: int | None = None,
                 page_bytes: int = PAGE, managed: bool | None = None):
        page_bytes = _check.positive("page_bytes", page_bytes)
        if budget is not None:   # a NaN would compare False with everything and enforce nothing
            budget = _check.positive("budget", budget)
        managed = (not backend.SIMULATOR) if managed is None else managed
        if not isinstance(managed, bool):
            raise ValueError(f"managed: expected True, False or None, got {managed!r}")
        if managed and backend.SIMULATOR:
            raise ValueError("managed: True needs a GPU; the simulator mirrors the arena by copying")
        super().__init__(tape, plan)   # checks the plan against the tape
        self.layout: Layout = layout(tape, plan, page_bytes)
        self.ledger = PageLedger(tape, self.layout, plan.budget if budget is None else budget)
        self.planned_peak_pages = self.ledger.check(plan)
        self.arena, self.mem = um.managed_arena(max(self.layout.arena_bytes, page_bytes), managed)
        self.views = {name: backend.view_at(self.arena, off, backend.Layout(
                          tape.tensors[name].shape, tape.tensors[name].dtype))
                      for name, off in self.layout.offsets.items()}
        self.current.update({name: self.views[name] for name in plan.persistent})
        self._io_in: set[str] = set()   # homed tensors host I/O brought to the device
        self._settle()

    @property
    def max_pages(self) -> int:
        return self.ledger.max_pages

    @property
    def peak_pages(self) -> int:
        """The most pages resident at once over the steps run so far (the ledger's count)."""
        return self.ledger.peak_pages

    def _span(self, name: str) -> tuple[int, int]:
        """X's byte range; a moving tensor's covers its whole pages (it owns them)."""
        lo = self.layout.offsets[name]
        size = self.tape.tensors[name].nbytes
        if name not in self.plan.persistent:
            size = align_up(size, self.layout.page_bytes)
        return lo, min(lo + size, self.arena.size)

    def _settle(self) -> None:
        """Fixed tensors on the device, homed ones on the host: where a step expects them."""
        for name in self.plan.homed:
            self.mem.push(*self._span(name), None)
            self.mem.gone(*self._span(name))
        if self.mem.real:
            if self.layout.fixed_bytes:
                self.mem.pull(0, self.layout.fixed_bytes, None)
            backend.synchronize()

    # -- host I/O -------------------------------------------------------------------------
    def _touch(self, names) -> None:
        for name in set(names) & set(self.plan.homed) - self._io_in:
            self.mem.pull(*self._span(name), None)
            self._io_in.add(name)

    def _after_io(self) -> None:
        for name in sorted(self._io_in):
            self.mem.push(*self._span(name), None)
            self.mem.gone(*self._span(name))
        self._io_in.clear()
        if self.mem.real:   # a host copy into managed memory may have moved fixed pages
            self._settle()

    def _write(self, name: str, value: np.ndarray) -> None:
        self.views[name].copy_to_device(value)

    def _read(self, name: str) -> np.ndarray:
        return self.views[name].copy_to_host()

    # -- the step ---------------------------------------------------------------------------
    def _start_step(self) -> None:
        for name in [n for n in self.current if n not in self.plan.persistent]:
            del self.current[name]   # the previous step's outputs: their pages are dead now
        self._drop(self.ledger.start())

    def _bytes(self, runs):
        return run_bytes(runs, self.layout.page_bytes, self.arena.size)

    def _drop(self, runs) -> None:
        """Discard dead pages, in order on the compute stream after their last use."""
        for lo, hi in self._bytes(runs):
            self.mem.drop(lo, hi, self.compute)

    def _end_step(self) -> None:
        # Discards are never released by the plan: the step ends once they are home too.
        drained = self._event("d2h drained")
        graph.record_event(drained, self.d2h)
        graph.wait_event(drained, self.compute)
        self.ledger.drain()

    def _replay(self, marks):
        return _ManagedReplay(self, marks)

    def capture(self, executor=None):
        raise TypeError("capture: the managed executor moves pages with cuMemPrefetchAsync, "
                        "which a CUDA graph cannot hold (there is no prefetch node); it runs "
                        "eagerly, step by step")

    def _release(self) -> None:
        self.views.clear()
        self.mem = self.arena = None


class _ManagedReplay(Replay):
    """The managed half of a step: prefetches of fixed ranges, page accounting alongside."""

    def __init__(self, ex: ManagedExecutor, marks):
        super().__init__(ex, marks)
        self._sent: set[str] = set()   # pushed to the host this step

    def visit(self, act: Action, at: At) -> None:
        self.ex.ledger.visit(act, at)   # the same accounting the check ran before launch:
        self.ex._drop(self.ex.ledger.dropped)   # it says which dead pages make room first
        super().visit(act, at)

    def alloc(self, act: Action, at: At) -> None:
        ex = self.ex
        for lo, hi in ex._bytes(ex.ledger.filled):   # pages no dead tensor left resident
            ex.mem.populate(lo, hi, ex.compute)
        ex.current[act.tensor] = ex.views[act.tensor]

    def free(self, act: Action, at: At) -> None:
        del self.ex.current[act.tensor]   # its pages stay, dead (the ledger counts them)

    drop = free

    def discard(self, act: Action, at: At) -> None:
        self.evict(act, at)   # one copy per page: the bytes travel, though nobody waits
        self._released(act, at)

    def _send_out(self, name: str) -> None:
        self.ex.mem.push(*self.ex._span(name), self.ex.d2h)
        self._sent.add(name)

    def _released(self, act: Action, at: At) -> None:
        self.ex.mem.gone(*self.ex._span(act.tensor))
        del self.ex.current[act.tensor]

    def _bring_in(self, act: Action) -> None:
        ex, name = self.ex, act.tensor
        if name in self._sent:   # never prefetch a range while it is still on its way out
            graph.wait_event(ex._event(name, "evicted"), ex.h2d)
        ex.mem.pull(*ex._span(name), ex.h2d)

    def _arrived(self, act: Action) -> None:
        self.ex.current[act.tensor] = self.ex.views[act.tensor]


def plan_for_pages(tape: Tape, budget: int, *, page_bytes: int = PAGE, **plan_kwargs) -> Plan:
    """`schedule.plan(tape, budget, host_copy=False, **plan_kwargs)`, re-planned under a
    smaller byte budget while its pages on managed memory would pass `budget` (page rounding).
    host_copy=False: managed memory keeps one copy of each page, so every tensor that leaves
    is copied and holds its pages until the copy is done; the planner then places a release
    where the pool's plan would discard the tensor and reuse its bytes at once (a discard's
    pages still on their way home would pass the budget: 3 GiB of VGG-19's at 50%).
    The plan keeps the byte budget it was made for; give `budget` to ManagedExecutor."""
    budget = _check.positive("budget", budget)
    page_bytes = _check.positive("page_bytes", page_bytes)
    plan_kwargs.setdefault("host_copy", False)
    target, too_small, too_many = budget, None, None   # byte budgets known to fail
    err, fewest = None, None
    for _ in range(16):
        try:
            p = schedule.plan(tape, target, **plan_kwargs)
        except BudgetError as exc:
            if too_many is None:
                raise                      # the budget itself cannot work, pages or not
            too_small, err = target, exc
        else:
            ledger = PageLedger(tape, layout(tape, p, page_bytes), budget)
            over = ledger.check(p, strict=False) - ledger.max_pages
            if over <= 0:
                return p
            too_many, err = target, None
            fewest = over if fewest is None else min(fewest, over)
            if too_small is None:          # drop the overflow, then bisect if that overshoots
                target = max(target - over * page_bytes, 1)
                continue
        target = (too_small + too_many) // 2
        if too_many - too_small <= 64:
            break
    detail = f"; a plan for {fmt_bytes(too_small)} cannot work ({err})" if err else ""
    raise BudgetError(f"budget {fmt_bytes(budget)}: the step fits in bytes but no plan found fits "
                      f"in pages of {fmt_bytes(page_bytes)} (the closest needs {fewest} pages more "
                      f"than the budget holds){detail}")
