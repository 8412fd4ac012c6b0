"""Budgeted device memory: one arena, blocks at planned offsets, a hard byte budget.

The schedule knows every block's lifetime before the step runs, so offsets are planned once
(proto.graph.plan.place: the same greedy interval packing that places a graph's temporaries)
and the pool only hands out views. Going past the budget is an error, never a silent cudaMalloc: a policy
must make room first (evict, release, free).
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import cuda
from proto.tape import TensorSpec
from proto.device.backend import ALIGN, align_up
from proto.vm.liveness import fmt_bytes


class OutOfBudget(MemoryError):
    """An allocation would pass the pool's byte budget."""


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
        # A NaN budget would compare False with everything and enforce nothing.
        budget = _check.positive("budget", budget)
        capacity = _check.integer("capacity", capacity, at_least=0)
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
        if self.arena is None:
            raise RuntimeError(f"{spec.name}: the pool is closed (its arena was given back)")
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
