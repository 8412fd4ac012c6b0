"""Argument validation shared by every kernel launcher, and the launch geometry they share.

Launchers call these before any launch so bad input fails with a message that names the
argument and shows expected against actual, never as a wrong result or a GPU fault. The
geometry helpers (grid-stride grids, resident blocks, SM count) size grids to the device.
"""
from __future__ import annotations

import functools

import numpy as np

from proto.device.backend import FLOAT_TYPES, extent, is_device_array
from proto.device.memo import PerObject

_passed = PerObject()   # (dtype, shape, ndim) an array object has passed device_array with


def device_array(name: str, x, *, dtype=np.float32, shape=None, ndim=None):
    """Check that `x` is a C-contiguous device array of `dtype` (and `shape` if given).

    `shape` may hold None for a free dimension. Returns `x` for chaining. An array object
    that passed the same check before passes at once (its metadata cannot change; eager
    steps check the same arrays at every launch).
    """
    _passed.get(x, (np.dtype(dtype), None if shape is None else tuple(shape), ndim),
                lambda: _device_array(name, x, dtype, shape, ndim))
    return x


# The storage dtypes a floating kernel takes (backend.jit_per_dtype compiles one per dtype)
FLOATS = tuple(np.dtype(t) for t in FLOAT_TYPES)


def float_dtype(name: str, x) -> np.dtype:
    """The storage dtype of `x`, a device array of one of FLOATS: the kernel to launch. The
    launch's other arrays are then checked against it (`device_array(..., dtype=)`)."""
    if not is_device_array(x):
        device_array(name, x)   # (its message for a host array or another object)
    dtype = np.dtype(x.dtype)
    if dtype not in FLOATS:
        raise TypeError(f"{name}: expected dtype float32 or float16, got {dtype}")
    return dtype


def _device_array(name: str, x, dtype, shape, ndim) -> bool:
    if not is_device_array(x):
        kind = "a NumPy (host) array" if isinstance(x, np.ndarray) else type(x).__name__
        raise TypeError(f"{name}: expected a device array (numba.cuda.to_device), got {kind}")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {np.dtype(x.dtype)}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        ok = len(shape) == x.ndim and all(s is None or s == d for s, d in zip(shape, x.shape))
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    if not x.is_c_contiguous():
        raise ValueError(f"{name}: expected a C-contiguous array (strides {x.strides})")
    if x.size == 0:
        raise ValueError(f"{name}: empty array, shape {tuple(x.shape)}")
    return True


def _kind(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value, *, at_least: int | None = None, at_most: int | None = None) -> int:
    """`value` as a Python int: any integer type (NumPy's too), never a bool, a float or a
    string, within [at_least, at_most] where given. ValueError names the argument."""
    if not _is_integer(value):
        raise ValueError(f"{name}: expected an integer, got {_kind(value)}")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name}: expected an integer >= {at_least}, got {value}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name}: expected at most {at_most}, got {value}")
    return int(value)


def positive(name: str, value, *, at_most: int | None = None) -> int:
    """A positive integer of any integer type (np.int64 too; never a bool), as a Python int."""
    if not _is_integer(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {_kind(value)}")
    return integer(name, value, at_most=at_most)


def number(name: str, value, *, at_least: float | None = None, positive: bool = False) -> float:
    """A finite real number of any type (Python or NumPy, integer or float; never a bool),
    at least `at_least` (or > 0 if `positive`) where given, as a Python float."""
    kinds = (int, float, np.integer, np.floating)
    want = "a positive" if positive else "a finite"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds) \
            or not np.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected {want} number, got {_kind(value)}")
    if at_least is not None and value < at_least:
        raise ValueError(f"{name}: expected a number >= {at_least}, got {value!r}")
    return float(value)


def flag(name: str, value) -> bool:
    """A bool (Python's or NumPy's): a string such as "no" would otherwise read as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {_kind(value)}")
    return bool(value)


def _ln_params(what: str, gamma, beta, eps, n: int, dtype=np.float32) -> float:
    """Checks a fused layer norm's gamma and beta (n,) of `dtype` and eps (> 0), naming them
    after `what`; returns eps as a float."""
    device_array(f"{what} gamma", gamma, dtype=dtype, shape=(n,))
    device_array(f"{what} beta", beta, dtype=dtype, shape=(n,))
    if not (isinstance(eps, (float, int)) and eps > 0):
        raise ValueError(f"{what} eps: expected a positive number, got {eps!r}")
    return float(eps)


def ln_out(value, shape: tuple, dtype=np.float32) -> tuple:
    """A fused layer norm's (gamma, beta, eps, y) for rows of shape[-1] columns, y shaped
    `shape` (the output it normalizes), all of `dtype`; returns it checked, eps as a float."""
    if not (isinstance(value, tuple) and len(value) == 4):
        raise ValueError(f"ln_out: expected (gamma, beta, eps, y), got {value!r}")
    gamma, beta, eps, y = value
    eps = _ln_params("ln_out", gamma, beta, eps, shape[-1], dtype)
    device_array("ln_out y", y, dtype=dtype, shape=tuple(shape))
    return gamma, beta, eps, y


def same_shape(names_arrays) -> None:
    (n0, a0), *rest = names_arrays
    for n, a in rest:
        if tuple(a.shape) != tuple(a0.shape):
            raise ValueError(f"{n}: expected the shape of {n0} {tuple(a0.shape)}, got {tuple(a.shape)}")


@functools.cache
def resident_blocks(kernel, threads: int) -> int:
    """How many blocks of `kernel` (`threads` each) the whole device runs at once: one wave.
    2 on the simulator (one block at a time there; 2 still exercises grid strides)."""
    from proto.device.backend import SIMULATOR
    if SIMULATOR:
        return 2
    return next(iter(kernel.overloads.values())).max_cooperative_grid_blocks(threads)


@functools.cache
def sm_count() -> int:
    """The device's SMs (2 on the simulator)."""
    from proto.device.backend import SIMULATOR, cuda
    return 2 if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def warp_threads(n: int) -> int:
    """`n` threads rounded up to whole warps (at least one): what a block whose reductions
    shuffle across warps, or that gives a thread to each of `n` items, launches with."""
    return max(32, -(-n // 32) * 32)


def grid_stride_launch(n: int, threads: int = 256) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over `n` items: enough blocks to cover `n` on
    a GPU (at most 1024). The simulator pays per thread, not per item, so there one block of
    32 threads walks everything."""
    from proto.device.backend import SIMULATOR
    if SIMULATOR:
        return 1, 32
    return max(1, min((n + threads - 1) // threads, 1024)), threads



def separate(outputs: dict, others: dict) -> None:
    """Raise ValueError, naming both, if a named output overlaps another output or any array
    in `others`. For launchers of several kernels: proto.device.backend.launch checks each launch's
    own arguments, but an output of one launch can clobber an input of an earlier one (or
    another output), and all of it must be refused before the first launch."""
    named = {**others, **outputs}
    spans = {name: extent(arr) for name, arr in named.items() if is_device_array(arr)}
    for out in (name for name in outputs if name in spans):   # None: an absent output
        lo, hi = spans[out]
        for name, (ilo, ihi) in spans.items():
            if name != out and lo < ihi and ilo < hi:
                raise ValueError(f"output {out!r} (bytes [{lo:#x}, {hi:#x})) overlaps {name!r} "
                                 f"(bytes [{ilo:#x}, {ihi:#x})): pass separate buffers")


def no_overlap(named: dict, pairs) -> None:
    """Raise ValueError if any (name, name) pair of `named` device arrays shares memory
    (an output that must not alias an input)."""
    ranges = {name: extent(arr) for name, arr in named.items()}
    for a, b in pairs:
        if ranges[a][0] < ranges[b][1] and ranges[b][0] < ranges[a][1]:
            raise ValueError(f"{a} overlaps {b}: the kernel cannot run in place")
