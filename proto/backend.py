"""Which device runs the kernels: a real CUDA GPU or Numba's CUDA simulator.

This is the only module that decides. It must be imported before ``numba`` (every
``kernels``/``proto`` module imports ``cuda`` from here), because Numba reads
``NUMBA_ENABLE_CUDASIM`` once, at import.

Choice, in order:
  1. ``PROTO_BACKEND=sim`` or ``PROTO_BACKEND=cuda`` forces one (tests force ``sim``);
     ``PROTO_BACKEND=ptx`` compiles for a real GPU with no GPU present (``kernels.compile_check``);
  2. ``NUMBA_ENABLE_CUDASIM=1`` already set means the simulator;
  3. otherwise CUDA if the driver library loads and reports a device, else the simulator.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import numpy as np

# numba-cuda 0.30.4 calls np.row_stack, which NumPy 2.5 removed; vstack is the same function.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack


def _driver_has_device() -> bool:
    """True if libcuda loads and sees at least one device. Never imports numba."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


def _choose() -> str:
    forced = os.environ.get("PROTO_BACKEND", "").strip().lower()
    if forced not in ("", "sim", "cuda", "ptx"):
        raise ValueError(f"PROTO_BACKEND must be 'sim', 'cuda' or 'ptx', got {forced!r}")
    if forced in ("cuda", "ptx") and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise RuntimeError("PROTO_BACKEND=cuda conflicts with NUMBA_ENABLE_CUDASIM=1")
    if forced:
        return forced
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "sim"
    return "cuda" if _driver_has_device() else "sim"


NAME = _choose()
SIMULATOR = NAME == "sim"
PTX_ONLY = NAME == "ptx"  # real CUDA compiler, no device: kernels are checked, never launched
if SIMULATOR:
    if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise RuntimeError("numba was imported before proto.backend chose the simulator; "
                           "import proto.backend first or set NUMBA_ENABLE_CUDASIM=1")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from numba import cuda  # noqa: E402  (must follow the environment set-up above)


def _lock_simulated_shared_arrays() -> None:
    """The simulator creates a block's `cuda.shared.array` on first use without a lock, so two
    of its threads can each get a private copy: an occasional wrong result in any kernel that
    shares data through shared memory. Serialize the creation (keyed, like the simulator, by
    the calling source line)."""
    import threading

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


if SIMULATOR:
    _lock_simulated_shared_arrays()

if os.environ.get("PROTO_QUIET") != "1":
    print(f"[proto] backend: {NAME}", file=sys.stderr)


# Every kernel's (python function, signature) pairs, so kernels.compile_check can compile them all
# for a real GPU even on a machine without one.
KERNEL_SIGNATURES: list[tuple[object, str]] = []
# cuda.jit options that only steer the GPU's code generation (registers per thread).
_GPU_CODEGEN_OPTIONS = ("max_registers", "launch_bounds")


def jit(signature, **options):
    """`cuda.jit(signature)`: the one kernel decorator of this project.

    Kernels get an eager signature (one fixed argument layout, which the graph layer relies
    on). With ``PROTO_BACKEND=ptx`` compilation is deferred, because eager compilation
    needs a driver; `kernels.compile_check` then compiles every registered signature to PTX.
    """
    signatures = [signature] if isinstance(signature, str) else list(signature)
    if SIMULATOR:   # register limits mean nothing to the simulator, which rejects them
        options = {k: v for k, v in options.items() if k not in _GPU_CODEGEN_OPTIONS}

    def decorate(pyfunc):
        KERNEL_SIGNATURES.extend((pyfunc, sig) for sig in signatures)
        if PTX_ONLY:
            return cuda.jit(**options)(pyfunc)
        return cuda.jit(signatures, **options)(pyfunc)

    return decorate


def device_name() -> str:
    """Short device name for results folders: 'h200', 'sim', ..."""
    if SIMULATOR:
        return "sim"
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    for short in ("H200", "H100", "A100", "L40S", "L4", "A10", "T4", "V100"):
        if short in name:
            return short.lower()
    return name.lower().replace("nvidia", "").strip().replace(" ", "-")


def describe() -> str:
    """Human-readable device line for logs and CSV rows."""
    if SIMULATOR:
        return "Numba CUDA simulator (timings are not meaningful)"
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    return f"{name} (cc {dev.compute_capability[0]}.{dev.compute_capability[1]})"


def synchronize() -> None:
    cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Launch hook. Every kernel launcher in kernels/ launches through `launch`, so a recorder
# (proto.graph) can intercept launches and turn them into graph nodes instead of running them.
# ---------------------------------------------------------------------------------------------
_recorders: list = []


def launch(kernel, griddim, blockdim, args, stream=0, sharedmem=0):
    """Launch `kernel[griddim, blockdim, stream, sharedmem](*args)`, or record it.

    `kernel` is a Numba dispatcher with eager signatures; `args` a tuple of device arrays
    and scalars. Launchers validate their inputs before calling this.
    """
    if _recorders:
        _recorders[-1].record_launch(kernel, griddim, blockdim, tuple(args), sharedmem, stream)
        return
    kernel[griddim, blockdim, stream, sharedmem](*args)


@contextlib.contextmanager
def recording(recorder):
    """Route every `launch` inside the block to `recorder.record_launch` instead of the GPU."""
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.pop()


def address(arr) -> int:
    """Device address of the array's first element (the simulator's is a host address). A
    host NumPy array (pinned, for copies) gives its host address: with unified addressing
    the driver tells the two apart."""
    if isinstance(arr, np.ndarray):
        return arr.ctypes.data
    if SIMULATOR:
        return arr._ary.__array_interface__["data"][0]
    return arr.device_ctypes_pointer.value or 0


def extent(arr) -> tuple[int, int]:
    """[lo, hi) byte range the array's elements occupy, strides (even negative) included."""
    lo = hi = address(arr)
    for n, s in zip(arr.shape, arr.strides):
        reach = (n - 1) * s
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + arr.dtype.itemsize


def is_device_array(x) -> bool:
    """True for a Numba device array (real or simulated); False for NumPy and anything else."""
    return cuda.devicearray.is_cuda_ndarray(x)
