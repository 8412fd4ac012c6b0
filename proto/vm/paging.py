"""The demand-paging baseline: what unified memory does when the GPU is full.

Tensors live in one managed arena placed like the unconstrained run (a framework's caching
allocator over cudaMallocManaged). Residency is tracked in 2 MiB pages, least recently used
first, as the UM driver does. Before each op, if the pages it touches would push resident
bytes past the budget, the oldest pages it does not need are pushed to the host synchronously
(cuMemPrefetchAsync to the CPU, then a stream sync: the GPU stalls as it does on a real
eviction); the op's kernels then *fault* their missing pages back in: real faults, real
migration, no hint from us. Nothing here knows the network: that is the point of the baseline.

On the simulator the same page table drives synchronous copies between the device arena and a
host mirror, and evicted device bytes are poisoned, so a page the policy forgot to bring back
shows up as NaNs in tests.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import cuda
from proto.tape import Tape
from proto.vm import schedule
from proto.vm.executor import Executor
from proto.vm import um
from proto.vm.liveness import BudgetError, fmt_bytes
from proto.vm.pool import managed_bytes
from proto.vm.um import MANAGED_LIMIT, PAGE, check_managed_fits, prefetch_managed  # noqa: F401


class PageTable:
    """LRU residency of the pages of one arena under a byte budget (pure bookkeeping)."""

    def __init__(self, arena_bytes: int, budget: int, page_bytes: int = PAGE):
        # A NaN budget would compare False with everything: no page would ever be evicted.
        budget = _check.positive("budget", budget)
        page_bytes = _check.positive("page_bytes", page_bytes)
        self.page_bytes = page_bytes
        self.n_pages = -(-arena_bytes // page_bytes)
        # Whole pages only, except that a budget holding the whole arena holds its last,
        # partial page too: at 100% of the peak (the arena's size) nothing is evicted.
        self.max_resident = self.n_pages if budget >= arena_bytes else budget // page_bytes
        if self.max_resident == 0:
            raise BudgetError(f"budget {fmt_bytes(budget)} holds no page of {fmt_bytes(page_bytes)}")
        self.resident = np.zeros(self.n_pages, dtype=bool)
        self.last_use = np.full(self.n_pages, -1, dtype=np.int64)
        self.clock = 0
        self.evicted_pages = 0     # counters, for the experiment
        self.faulted_pages = 0

    def pages(self, ranges) -> np.ndarray:
        """Sorted page indices covering byte ranges [(offset, nbytes), ...]."""
        idx = [np.arange(off // self.page_bytes, (off + n - 1) // self.page_bytes + 1)
               for off, n in ranges if n > 0]
        return np.unique(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64)

    def touch(self, pages: np.ndarray) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Make `pages` resident: returns (page runs to evict first, page runs that will fault in)."""
        if len(pages) > self.max_resident:
            raise BudgetError(f"{len(pages)} pages needed at once, the budget holds {self.max_resident}")
        missing = pages[~self.resident[pages]]
        excess = int(self.resident.sum()) + len(missing) - self.max_resident
        evict = np.zeros(0, dtype=np.int64)
        if excess > 0:
            candidates = np.flatnonzero(self.resident)
            candidates = candidates[~np.isin(candidates, pages)]
            # oldest first; among equals the lowest address (stable sort)
            evict = np.sort(candidates[np.argsort(self.last_use[candidates], kind="stable")[:excess]])
            self.resident[evict] = False
        self.resident[missing] = True
        self.last_use[pages] = self.clock
        self.clock += 1
        self.evicted_pages += len(evict)
        self.faulted_pages += len(missing)
        return page_runs(evict), page_runs(missing)

    def reset(self) -> None:
        """Everything on the host (after host I/O, which may have moved pages)."""
        self.resident[:] = False


def run_bytes(runs, page_bytes: int, nbytes: int) -> list[tuple[int, int]]:
    """[(first, end)) page runs -> [lo, hi) byte ranges of an arena of `nbytes` (the last page
    may be partial)."""
    return [(first * page_bytes, min(end * page_bytes, nbytes)) for first, end in runs]


def page_runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """Sorted page indices -> [(first, end)) runs of consecutive pages."""
    if len(pages) == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(pages, breaks)]


# ---------------------------------------------------------------------------- backends
class _Pages:
    """Page runs of the table -> byte ranges moved by a um.py mover: evictions are pushed to
    the host and waited for (the GPU stalls, as on a real UM eviction); faults are left to
    the kernels on a GPU (real faults), copied back on the simulator."""

    def __init__(self, mem, page_bytes: int, stream):
        self.mem, self.page_bytes, self.stream = mem, page_bytes, stream
        self.nbytes = mem.arena.size

    def _spans(self, runs):
        return run_bytes(runs, self.page_bytes, self.nbytes)

    def evict(self, runs) -> None:
        for lo, hi in self._spans(runs):
            self.mem.push(lo, hi, self.stream)
            self.mem.gone(lo, hi)
        if runs and self.mem.real:
            self.stream.synchronize()

    def fault(self, runs) -> None:
        for lo, hi in self._spans(runs):
            self.mem.fault(lo, hi)

    def reset(self) -> None:
        """Everything to the host (a GPU after host I/O, which may have moved pages)."""
        if self.mem.real:
            self.evict([(0, -(-self.nbytes // self.page_bytes))])


class PagingExecutor(Executor):
    """The unconstrained schedule on managed memory, paged on demand under `budget` bytes.

    managed: real unified memory (default on a GPU); False: the simulator's copying pages.
    """

    def __init__(self, tape: Tape, budget: int, *, page_bytes: int = PAGE, managed: bool | None = None):
        base = schedule.plan(tape)    # the unconstrained placement: what the allocator would do
        managed = (not backend.SIMULATOR) if managed is None else managed
        if managed and backend.SIMULATOR:
            raise ValueError("managed=True needs a GPU; the simulator pages by copying")
        self.table = PageTable(base.arena_bytes, budget, page_bytes)
        self.budget = budget
        offsets = {name: off for name, off in base.persistent.items()}
        offsets.update({a.tensor: a.offset for _, _, a in base.actions() if a.kind == "alloc"})
        self._offsets = offsets
        self._op_pages = [self.table.pages([(offsets[n], tape.tensors[n].nbytes)
                                            for n in set(op.reads) | set(op.writes)])
                          for op in tape.ops]
        for op, pages in zip(tape.ops, self._op_pages):
            if len(pages) > self.table.max_resident:
                raise BudgetError(
                    f"budget {fmt_bytes(budget)} is too small for op {op.name!r} (layer "
                    f"{op.layer or '?'!r}): its tensors span {len(pages)} pages of "
                    f"{fmt_bytes(page_bytes)} = {fmt_bytes(len(pages) * page_bytes)}")
        if managed:
            check_managed_fits(base.arena_bytes)
        super().__init__(tape, base, managed=managed)
        mem = um.Managed(self.pool.arena) if managed else um.Mirrored(self.pool.arena)
        self.pages = _Pages(mem, page_bytes, self.compute)
        self.pages.reset()

    def capture(self, executor=None):
        raise TypeError("capture: demand paging decides on the host, before every op, which "
                        "pages to push out; a graph replays fixed work and cannot do that")

    def _before_op(self, i: int) -> None:
        # The eviction is queued on the compute stream (behind the ops that used those pages)
        # and waited for: compute stalls, as on a real UM eviction.
        evict, fault = self.table.touch(self._op_pages[i])
        self.pages.evict(evict)
        self.pages.fault(fault)

    def _touch(self, names) -> None:
        evict, fault = self.table.touch(self.table.pages(
            [(self._offsets[n], self.tape.tensors[n].nbytes) for n in names]))
        self.pages.evict(evict)
        self.pages.fault(fault)

    def _after_io(self) -> None:
        if self.pages.mem.real:   # host I/O may have moved pages: start over
            self.pages.reset()
            self.table.reset()

    def close(self) -> None:
        self.pages = None    # it holds the managed arena
        super().close()

    def moved_bytes(self) -> tuple[int, int]:
        """(bytes evicted, bytes faulted in) so far, in whole pages."""
        return self.table.evicted_pages * self.table.page_bytes, self.table.faulted_pages * self.table.page_bytes


# ---------------------------------------------------------------------------- measuring
def measure_link(nbytes: int = 256 << 20, reps: int = 3) -> dict[str, float]:
    """Host-link rates in GB/s: pinned copies each way, managed pages faulted in by a kernel,
    and managed pages prefetched each way (to the device; to the host, as an eviction). NaN
    on the simulator."""
    keys = ("pinned_h2d_gbps", "pinned_d2h_gbps", "fault_h2d_gbps", "prefetch_h2d_gbps",
            "evict_d2h_gbps")
    if backend.SIMULATOR:
        return {k: float("nan") for k in keys}
    check_managed_fits(nbytes)
    rates = _link_rates(nbytes, reps)
    cuda.synchronize()
    cuda.current_context().memory_manager.deallocations.clear()   # its buffers, now
    return rates


def _link_rates(nbytes: int, reps: int) -> dict[str, float]:
    from kernels import elementwise as ew
    n = nbytes // 4
    stream = cuda.stream()
    host = cuda.pinned_array(n, np.float32)
    dev = cuda.device_array(n, np.float32)
    managed = managed_bytes(nbytes).view(np.float32)
    managed.copy_to_device(np.ones(n, np.float32))
    ptr = int(managed.device_ctypes_pointer.value)

    def timed(fn, setup=None):
        best = float("inf")
        for _ in range(reps + 1):   # the first absorbs set-up costs (and JIT for the kernel)
            if setup:
                setup()
            stream.synchronize()
            t0, t1 = cuda.event(), cuda.event()
            t0.record(stream)
            fn()
            t1.record(stream)
            t1.synchronize()
            best = min(best, cuda.event_elapsed_time(t0, t1) * 1e-3)
        return nbytes / best / 1e9

    def to_host():
        prefetch_managed(ptr, nbytes, stream)

    def to_device():
        prefetch_managed(ptr, nbytes, stream, to_host=False)

    return {
        "pinned_h2d_gbps": timed(lambda: dev.copy_to_device(host, stream=stream)),
        "pinned_d2h_gbps": timed(lambda: dev.copy_to_host(host, stream=stream)),
        # every page starts on the host: the kernel faults each one in
        "fault_h2d_gbps": timed(lambda: ew.add(managed, managed, managed, stream=stream), to_host),
        "prefetch_h2d_gbps": timed(to_device, to_host),
        "evict_d2h_gbps": timed(to_host, to_device),
    }
