"""Unified (managed) memory primitives: the arena, byte ranges moved to and from the host.

Both policies that run on managed memory use these: the demand-paging baseline (paging.py)
and the AutoVM schedule on managed memory (managed.py). A range moves by cuMemPrefetchAsync
(cuda.bindings.driver); its virtual address never changes, only where its pages live.

    push(lo, hi, s)      pages to the host on stream s (prefetch to the CPU)
    gone(lo, hi)         the range's device copy must not be read again (a no-op on a GPU:
                         the pages already left; the simulator poisons them here)
    pull(lo, hi, s)      pages back to the device on stream s
    fault(lo, hi)        a kernel is about to touch the range (a GPU faults it in itself)
    drop(lo, hi, s)      the contents are dead: release the pages without copying
                         (cuMemDiscardBatchAsync where the driver has it, CUDA 13+;
                         otherwise pushed to the host, which moves dead bytes but frees them)
    populate(lo, hi, s)  fresh pages on the device before a first write (a prefetch of a
                         discarded range allocates without copying; the write would fault)

On the simulator there is no managed memory and no prefetch: `Mirrored` keeps a device arena
and a host mirror and copies synchronously; bytes that left the device are poisoned with
0xFF (a float32 NaN), so a plan or policy that forgot to bring something back shows NaNs.

The arena never asks for more than the GPU can give: `check_managed_fits` refuses anything
past half of the free memory, or MANAGED_LIMIT (oversubscribing managed memory on a
shared card can hang the machine). Half, not all: the same process still needs device memory
for its kernels, its pinned copies' staging and whatever else holds the card.
"""
from __future__ import annotations

import numpy as np

from proto.device.backend import cuda, driver_stream
from proto.vm.liveness import BudgetError, fmt_bytes
from proto.vm.pool import managed_bytes

PAGE = 2 << 20            # the UM driver's large-page (VA block) size
MANAGED_LIMIT = 64 << 30  # never ask for more managed memory than this, whatever the card


def check_managed_fits(nbytes: int) -> None:
    """Refuse managed allocations that could oversubscribe the card (which can hang the machine)."""
    free, total = cuda.current_context().get_memory_info()
    limit = min(MANAGED_LIMIT, free // 2)
    if nbytes > limit:
        raise BudgetError(f"managed arena of {fmt_bytes(nbytes)} refused: the limit is "
                          f"{fmt_bytes(limit)} (half of the {fmt_bytes(free)} free of "
                          f"{fmt_bytes(total)}, at most {fmt_bytes(MANAGED_LIMIT)})")


def prefetch_managed(ptr: int, nbytes: int, stream, to_host: bool = True) -> None:
    """cuMemPrefetchAsync of managed memory to the host (or this device) on `stream`.

    cuda-bindings 13 takes a CUmemLocation; 12.x took a device ordinal (CU_DEVICE_CPU = host)."""
    from cuda.bindings import driver
    hstream = driver_stream(stream)
    loc = driver.CUmemLocation()
    if to_host:
        loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        loc.id = 0
    else:
        loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = cuda.get_current_device().id
    try:
        (err,) = driver.cuMemPrefetchAsync(ptr, nbytes, loc, 0, hstream)
    except TypeError:   # cuda-bindings 12.x
        device = driver.CU_DEVICE_CPU if to_host else cuda.get_current_device().id
        (err,) = driver.cuMemPrefetchAsync(ptr, nbytes, device, hstream)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemPrefetchAsync({nbytes} bytes) failed: {err}")


def _discard(ptr: int, nbytes: int, stream) -> bool:
    """cuMemDiscardBatchAsync of one range; False where the bindings or driver lack it."""
    try:
        from cuda.bindings import driver
        fn = driver.cuMemDiscardBatchAsync
    except (ImportError, AttributeError):
        return False
    try:
        (err,) = fn([driver.CUdeviceptr(ptr)], [nbytes], 1, 0, driver_stream(stream))
    except (TypeError, RuntimeError):
        return False
    return err == driver.CUresult.CUDA_SUCCESS


class Managed:
    """A managed arena on a GPU; ranges move by prefetch."""

    real = True

    def __init__(self, arena):
        self.arena = arena
        self.ptr = int(arena.device_ctypes_pointer.value)
        self.can_discard: bool | None = None   # learnt at the first drop

    def push(self, lo, hi, stream) -> None:
        prefetch_managed(self.ptr + lo, hi - lo, stream)

    def gone(self, lo, hi) -> None:
        pass

    def pull(self, lo, hi, stream) -> None:
        prefetch_managed(self.ptr + lo, hi - lo, stream, to_host=False)

    def fault(self, lo, hi) -> None:
        pass

    def drop(self, lo, hi, stream) -> None:
        if self.can_discard is not False:
            self.can_discard = _discard(self.ptr + lo, hi - lo, stream)
        if not self.can_discard:
            self.push(lo, hi, stream)

    def populate(self, lo, hi, stream) -> None:
        self.pull(lo, hi, stream)


class Mirrored:
    """Simulator: a device arena and a host mirror, copied synchronously, poisoned when away."""

    real = False

    def __init__(self, arena):
        self.arena = arena
        self.host = arena.copy_to_host()

    def push(self, lo, hi, stream) -> None:
        self.host[lo:hi] = self.arena[lo:hi].copy_to_host()

    def gone(self, lo, hi) -> None:
        self.arena[lo:hi] = 0xFF      # float32 0xFFFFFFFF is a NaN: only a pull brings data back

    def pull(self, lo, hi, stream) -> None:
        self.arena[lo:hi].copy_to_device(np.ascontiguousarray(self.host[lo:hi]))

    def fault(self, lo, hi) -> None:
        self.pull(lo, hi, None)

    def drop(self, lo, hi, stream) -> None:
        self.gone(lo, hi)

    def populate(self, lo, hi, stream) -> None:
        pass


def managed_arena(nbytes: int, managed: bool):
    """(arena of `nbytes` bytes, its mover): managed memory on a GPU after the free-memory
    check, or a device arena with a host mirror (the simulator's, or managed=False)."""
    if managed:
        check_managed_fits(nbytes)
        arena = managed_bytes(nbytes)
        return arena, Managed(arena)
    arena = cuda.device_array(nbytes, np.uint8)
    return arena, Mirrored(arena)
