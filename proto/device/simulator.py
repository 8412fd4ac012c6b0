"""Numba's CUDA simulator, made correct and fast enough to test on: `install()` (called by
proto.device.backend when it chooses the simulator) replaces four of its internals.

The simulator runs a kernel block by block, each CUDA thread a Python thread, and the kernel
body as plain Python. Its semantics are kept here; what changes is what it costs around
the kernel's own code, which took most of a simulated step's time:

- shared arrays: created under a lock (the simulator's own creation races);
- threads: a pool of Python threads runs block after block (starting a thread cost about
  150 us, and a simulated GPT-2 step starts thousands);
- barriers: each thread reports its arrival and its end under a condition variable, and
  the block waits on it (the simulator polled every thread in a loop that held the
  interpreter lock, more than half the time of a simulated beam search);
- device functions: their modules' `cuda` name points at the launch's fake module for the
  whole launch (the simulator swapped it at every call, with two locks).

Nothing here runs on a GPU.
"""
from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np


def install() -> None:
    _lock_shared_arrays()
    _pooled_blocks()
    _device_calls_without_swaps()
    # A thread that reaches a barrier hands the interpreter on at once (Python's default
    # switch interval of 5 ms made barrier-heavy kernels about 8x slower).
    sys.setswitchinterval(1e-4)


def _lock_shared_arrays() -> None:
    """The simulator creates a block's `cuda.shared.array` on first use without a lock, so two
    of its threads can each get a private copy: an occasional wrong result in any kernel that
    shares data through shared memory. Serialize the creation (keyed, like the simulator, by
    the calling source line)."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    unlocked, lock = FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: as the simulator does
            return unlocked(self, shape, dtype, alignment)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            if key not in self._allocations:
                self._allocations[key] = np.empty(shape, dtype)
            return self._allocations[key]

    FakeCUDAShared.array = array


def _pooled_blocks() -> None:
    """Blocks run on pooled threads, and barriers are reported rather than polled. The
    semantics are the simulator's: every live thread of the block must reach a barrier
    before any passes it, a thread that ends releases a barrier the others wait at, and a
    thread's exception aborts the block and is raised with the thread's indices."""
    from numba.cuda.simulator import kernel as sim
    from numba.cuda.simulator.kernelapi import Dim3

    idle: list = []   # pooled threads waiting for a block

    class PooledThread(sim.BlockThread):
        """A simulated CUDA thread that runs one block's kernel after another."""

        def __init__(self):
            threading.Thread.__init__(self, daemon=True)
            self.syncthreads_event, self.assigned = threading.Event(), threading.Event()
            self.kernel = None
            self.start()

        def assign(self, block, grid_point, point, kernel) -> None:
            x, y, _ = block._block_dim   # (the simulator's normalized 3-D block)
            self._manager, self.blockIdx, self.threadIdx = block, Dim3(*grid_point), Dim3(*point)
            self.thread_id = point[0] + x * (point[1] + y * point[2])
            self.exception, self.abort, self.syncthreads_blocked = None, False, False
            self.debug = block._debug
            self.__dict__.pop("warp_phase", None)   # (kernels._reduce's, per block)
            self.syncthreads_event.clear()
            self.kernel = kernel
            self.assigned.set()

        def run(self):
            while True:
                self.assigned.wait()
                self.assigned.clear()
                try:
                    if self.debug:
                        np.seterr(divide="raise")
                    self.kernel()
                except Exception as e:   # (as BlockThread.run reports it)
                    where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                    msg = f"{where}: {e}" if str(e) else where
                    self.exception = (type(e)(msg), sys.exc_info()[2])
                finally:
                    block, self.kernel = self._manager, None
                    with block.changed:
                        block.live -= 1
                        if self.exception and block.failed is None:
                            block.failed = self
                        block.changed.notify()

        def syncthreads(self):
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads call")
            block = self._manager
            with block.changed:
                self.syncthreads_blocked = True
                block.waiting.append(self)
                block.changed.notify()
            self.syncthreads_event.wait()
            self.syncthreads_event.clear()
            if self.abort:
                raise RuntimeError("abort flag set on syncthreads clear")

    def run_block(block, grid_point, *args):
        block.changed, block.waiting, block.failed = threading.Condition(), [], None
        points = list(np.ndindex(*block._block_dim))
        while len(idle) < len(points):
            idle.append(PooledThread())
        threads = [idle.pop() for _ in points]
        block.live = len(threads)

        def kernel():
            block._f(*args)
        for t, point in zip(threads, points):
            t.assign(block, grid_point, point, kernel)
        with block.changed:
            while True:
                block.changed.wait_for(
                    lambda: block.failed is not None or len(block.waiting) == block.live)
                if block.failed is not None or block.live == 0:
                    break
                for t in block.waiting:   # every live thread is at the barrier
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                block.waiting = []
        if block.failed is None:
            idle.extend(threads)
            return
        # As the simulator: abort the others and do not wait for them; they leave the pool.
        for t in threads:
            t.abort, t.syncthreads_blocked = True, False
            t.syncthreads_event.set()
        exc, tb = block.failed.exception
        raise exc.with_traceback(tb)

    sim.BlockManager.run = run_block


def _device_calls_without_swaps() -> None:
    """At every call of a device function the simulator points the `cuda` name of that
    function's module at the launch's fake module and back (two locks, a reference count).
    Here the modules of the device functions called so far are swapped once for a whole
    launch, and a call inside it is a plain Python call."""
    from numba.cuda.simulator import kernel as sim
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    modules: dict = {}   # id(module globals) -> a device function of that module
    held: set = set()    # the modules swapped for the running launch
    push, call = sim._push_kernel_context, sim.FakeCUDAKernel.__call__

    @contextlib.contextmanager
    def push_and_swap(fake_cuda):
        with push(fake_cuda), contextlib.ExitStack() as swaps:
            for gid, fn in list(modules.items()):
                swaps.enter_context(swapped_cuda_module(fn, fake_cuda))
                held.add(gid)
            try:
                yield
            finally:
                held.clear()

    def device_call(kernel, *args):
        if kernel._device or sim._kernel_context:
            gid = id(kernel.fn.__globals__)
            if gid in held:
                return kernel.fn(*args)
            modules.setdefault(gid, kernel.fn)   # (swapped from the next launch on)
        return call(kernel, *args)

    sim._push_kernel_context = push_and_swap
    sim.FakeCUDAKernel.__call__ = device_call
