"""Budgeted device memory: one arena, blocks at planned offsets, a hard byte budget.

The schedule knows every block's lifetime before the step runs, so offsets are planned once
(`place`, a greedy interval packing in the manner of tinygrad's memory planner) and the pool
only hands out views. Going past the budget is an error, never a silent cudaMalloc: a policy
must make room first (evict, release, free).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proto import backend
from proto.backend import cuda
from proto.tape import TensorSpec
from proto.vm.liveness import ALIGN, align_up, fmt_bytes


class OutOfBudget(MemoryError):
    """An allocation would pass the pool's byte budget."""


@dataclasses.dataclass(frozen=True)
class Block:
    """`nbytes` held from the start of op `first` to the end of op `last` (inclusive)."""
    key: object
    first: int
    last: int
    nbytes: int


def _fit(blocks: list[Block], align: int, best: bool) -> tuple[dict[object, int], int]:
    """Place blocks in the given order, each in a hole clear of the placed blocks it meets in
    time: the lowest such hole (first fit) or the tightest one (best fit)."""
    offsets: dict[object, int] = {}
    placed: list[tuple[Block, int]] = []
    arena = 0
    for blk in blocks:
        size = align_up(blk.nbytes, align)
        busy = sorted((off, off + align_up(other.nbytes, align)) for other, off in placed
                      if other.first <= blk.last and blk.first <= other.last)
        holes, cursor = [], 0
        for start, end in busy:
            if start - cursor >= size:
                holes.append((start - cursor, cursor))
            cursor = max(cursor, end)
        top = cursor                       # above every busy block: always fits
        if holes and best:
            offset = min(holes)[1]
        elif holes:
            offset = holes[0][1]
        else:
            offset = top
        offsets[blk.key] = offset
        placed.append((blk, offset))
        arena = max(arena, offset + size)
    return offsets, arena


def place(blocks: list[Block], align: int = ALIGN) -> tuple[dict[object, int], int]:
    """Offsets such that blocks alive during a common op never overlap; returns (offsets, arena bytes).

    Greedy placement in a few orders (largest first, longest-lived first, most byte-ops
    first, earliest first), each by first fit and by best fit; the smallest arena wins. Not
    optimal (that problem is NP-hard) but tight on layer-ordered nets.
    """
    orders = (lambda b: (-b.nbytes, b.first, b.last),
              lambda b: (-(b.last - b.first), -b.nbytes, b.first),
              lambda b: (-(b.last - b.first + 1) * b.nbytes, b.first),
              lambda b: (b.first, -b.nbytes, b.last))
    return min((_fit(sorted(blocks, key=order), align, best) for order in orders for best in (False, True)),
               key=lambda result: result[1])


def managed_bytes(nbytes: int):
    """`nbytes` of managed memory seen as a plain device array of bytes.

    numba's ManagedNDArray is also a NumPy array, and NumPy's slicing and reshaping drop its
    device pointer; a DeviceNDArray over the same buffer slices like any device array (and
    keeps the buffer alive through `gpu_data`)."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    owner = cuda.managed_array(nbytes, dtype=np.uint8)
    return DeviceNDArray((nbytes,), (1,), np.uint8, gpu_data=owner.gpu_data)


class DevicePool:
    """A device arena of `capacity` bytes (at most `budget`), handing out typed views.

    `alloc` refuses anything that would pass `budget` or the arena's end; `free` gives bytes
    back. On the simulator freed bytes are poisoned with NaNs, so a schedule that reads a tensor
    after its memory went to another one fails loudly in tests instead of passing by luck.
    """

    def __init__(self, budget: int, capacity: int, *, managed: bool = False):
        if capacity > budget:
            raise OutOfBudget(f"arena of {fmt_bytes(capacity)} passes the budget {fmt_bytes(budget)}")
        self.budget, self.capacity = int(budget), int(capacity)
        size = max(self.capacity, ALIGN)
        self.arena = managed_bytes(size) if managed and not backend.SIMULATOR else cuda.device_array(size, np.uint8)
        self.live: dict[str, tuple[int, int]] = {}   # name -> (offset, nbytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._views: dict[tuple, object] = {}        # views are cached: they cost ~30 us to make

    def view(self, spec: TensorSpec, offset: int):
        key = (offset, spec.shape, np.dtype(spec.dtype).str)
        v = self._views.get(key)
        if v is None:
            if offset < 0 or offset % ALIGN or offset + spec.nbytes > self.capacity:
                raise OutOfBudget(f"{spec.name}: block [{offset}, {offset + spec.nbytes}) is "
                                  f"outside the arena of {self.capacity} bytes")
            raw = self.arena[offset:offset + spec.nbytes]
            v = self._views[key] = raw.view(spec.dtype).reshape(spec.shape)
        return v

    def alloc(self, spec: TensorSpec, offset: int):
        if spec.name in self.live:
            raise ValueError(f"{spec.name}: already allocated in the pool")
        nbytes = align_up(spec.nbytes)
        if self.live_bytes + nbytes > self.budget:
            raise OutOfBudget(f"allocating {spec.name} ({fmt_bytes(nbytes)}) would hold "
                              f"{fmt_bytes(self.live_bytes + nbytes)}, past the budget "
                              f"{fmt_bytes(self.budget)}: make room first")
        v = self.view(spec, offset)
        self.live[spec.name] = (offset, nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return v

    def free(self, name: str) -> None:
        offset, nbytes = self.live.pop(name)
        self.live_bytes -= nbytes
        if backend.SIMULATOR:
            end = min(offset + nbytes, self.capacity)
            self.arena[offset:end] = 0xFF   # float32 0xFFFFFFFF is a NaN

    def close(self) -> None:
        self.live.clear()
        self._views.clear()
        self.arena = None
