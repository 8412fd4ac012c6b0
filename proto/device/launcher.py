"""A kernel's flat parameters, and eager launches that skip Numba's per-launch work (GPU only).

A kernel's parameters are not its Python arguments. Numba flattens each array argument into
``meminfo, parent, nitems, itemsize, data, shape..., strides...`` (5 + 2*ndim parameters,
meminfo and parent always 0) and each scalar into one ctypes value of its declared type
(``_Kernel._prepare_args`` in numba-cuda's dispatcher). This module builds the same list, for
two users:

* graphs (proto.graph.cuda) keep a node's flat list and the position of each array's data
  pointer in it: that position is the slot patch binding rewrites;
* eager launches (proto.device.backend.launch on a GPU). Numba's ``kernel[grid, block](*args)``
  types every argument to pick an overload, looks up the current context twice and flattens
  every array again, at every launch: about 70 us of host time for a kernel of nine 3-D
  arrays on the H200, against 12 us for cuda.core's launch of parameters already flat. Our
  kernels have one eager signature each (proto.device.backend.jit), an array object's address,
  shape and strides never change, and an eager step passes the same array objects step after
  step (proto.device.backend.empty), so the overload, the compiled function and each array's flat
  parameters are worked out once and remembered.

The checks Numba's typing makes are kept: an array argument must have the signature's dtype
and number of dimensions, and be C-contiguous where the signature says so; a TypeError names
the argument otherwise. An argument Numba would copy in from the host (a NumPy array where the
signature has an array) is left to Numba's own launch.

proto.device.backend imports this module once it has chosen the device (this one imports numba);
it imports nothing of the runtime but proto.device.memo, so the launch path runs one way:
backend.launch -> launcher -> cuda.core.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
from numba.core import types
from numba.cuda.cudadrv.devicearray import is_cuda_ndarray

from proto.device.memo import PerObject

DATA_SLOT = 4   # in an array's flat parameters: meminfo, parent, nitems, itemsize, data, ...

_SCALARS = {types.float32: ctypes.c_float, types.float64: ctypes.c_double}


class _HostArray(Exception):
    """An array parameter got something that is not a device array (Numba would copy it)."""


class Kernel:
    """One eager-signature kernel, ready to flatten arguments and launch."""

    def __init__(self, dispatcher):
        overloads = list(dispatcher.overloads.values())
        name = dispatcher.py_func.__name__
        if len(overloads) != 1:
            raise TypeError(f"kernel {name}: expected exactly one eager signature "
                            f"(proto.device.backend.jit), found {len(overloads)}")
        compiled = overloads[0]
        self.name, self.compiled = name, compiled
        self.cukernel = compiled._codelibrary.get_cufunc().kernel   # cuda.core Kernel
        self.types = tuple(compiled.argument_types)
        # per parameter: None for an array, else the ctypes constructor of its scalar type
        # (ctypes.c_int32 for int32, as Numba makes them), or False: Numba's own conversion
        self.scalars = tuple(
            None if isinstance(ty, types.Array)
            else getattr(ctypes, f"c_{ty}") if isinstance(ty, types.Integer)
            else _SCALARS.get(ty, False) for ty in self.types)
        # Numba's own launch where it does more than pass parameters: debug builds check an
        # error code after the launch, extensions rewrite arguments.
        self.numba_only = bool(getattr(compiled, "debug", False)) or \
            bool(dispatcher.targetoptions.get("extensions"))

    def _array(self, i: int, ty, value) -> tuple:
        if not is_cuda_ndarray(value):
            raise _HostArray(i)
        # remembered per array object and parameter type (the check depends on the type)
        return _array_params.get(value, ty, lambda: self._checked_array(i, ty, value))

    def _checked_array(self, i: int, ty, value) -> tuple:
        # What Numba's launch reads, for every kind of device array (plain, mapped, managed)
        shim = value._strided_memory_view_shim
        layout = shim._layout
        want = (str(ty.dtype), ty.ndim)
        got = (str(np.dtype(shim.dtype)), len(shim.shape))
        if want != got or (ty.layout == "C" and not layout.is_contiguous_c):
            raise TypeError(f"kernel {self.name} argument {i}: expected {ty}, got {got[0]} "
                            f"{got[1]}-d array with strides {tuple(layout.strides_in_bytes)}")
        return (0, 0, shim.size, shim.dtype.itemsize, shim.ptr, *shim.shape,
                *layout.strides_in_bytes)

    def flatten(self, args) -> tuple[list, dict]:
        """(flat parameter list, {argument index: position of its data pointer})."""
        if len(args) != len(self.types):
            raise TypeError(f"kernel {self.name}: expected {len(self.types)} arguments, "
                            f"got {len(args)}")
        flat, data_slots = [], {}
        for i, (ty, scalar, value) in enumerate(zip(self.types, self.scalars, args)):
            if scalar is None:
                data_slots[i] = len(flat) + DATA_SLOT
                flat.extend(self._array(i, ty, value))
            elif scalar:
                flat.append(scalar(value))
            else:   # (booleans, records, tuples: as Numba does it)
                self.compiled._prepare_args(ty, value, 0, [], flat)
        return flat, data_slots


_kernels: dict = {}
_array_params = PerObject()
_configs: dict = {}
_core: dict = {}   # cuda.core's launch and LaunchConfig, the default stream: loaded on first use
_thread = threading.local()   # .ready: Numba made its context current in this thread


def kernel(dispatcher) -> Kernel:
    """The Kernel of an eager-signature dispatcher, made once."""
    k = _kernels.get(dispatcher)
    if k is None:
        k = _kernels[dispatcher] = Kernel(dispatcher)
    return k


def flatten(dispatcher, args) -> tuple[object, list, dict]:
    """(cuda.core Kernel, flat parameter list, {argument index: position of its data pointer})
    for a graph node. A host array where the signature has a device array is a TypeError."""
    k = kernel(dispatcher)
    try:
        flat, data_slots = k.flatten(args)
    except _HostArray as host:
        i = host.args[0]
        raise TypeError(f"kernel {k.name} argument {i}: expected a device array, got "
                        f"{type(args[i]).__name__}") from None
    return k.cukernel, flat, data_slots


def _load_core() -> dict:
    from cuda.core import LaunchConfig, launch as core_launch
    from numba.cuda.cudadrv import devices, driver
    _core.update(launch=core_launch, LaunchConfig=LaunchConfig, context=devices.get_context,
                 to_stream=driver._to_core_stream, default=driver._to_core_stream(0))
    return _core


def _dims(d):
    return tuple(int(v) for v in d) if isinstance(d, (tuple, list)) else int(d)


def _config(core, griddim, blockdim, sharedmem):
    """The LaunchConfig of these dimensions, made once: launchers pass the same ints and
    tuples launch after launch (a list, unhashable, gets a new one each time)."""
    key = (griddim, blockdim, sharedmem)
    try:
        return _configs[key]
    except (KeyError, TypeError):
        config = core["LaunchConfig"](grid=_dims(griddim), block=_dims(blockdim),
                                      shmem_size=int(sharedmem))
    if not isinstance(griddim, list) and not isinstance(blockdim, list):
        _configs[key] = config
    return config


def launch(dispatcher, griddim, blockdim, args, stream=0, sharedmem=0) -> None:
    """`dispatcher[griddim, blockdim, stream, sharedmem](*args)`: the same parameters, through
    cuda.core's launch."""
    k = kernel(dispatcher)
    if not k.numba_only:
        try:
            flat, _ = k.flatten(args)
        except _HostArray:
            pass
        else:
            core = _core or _load_core()
            if not getattr(_thread, "ready", False):
                # Numba's launch makes its context current in the calling thread at every
                # launch (two lookups); once per thread is enough.
                core["context"]()
                _thread.ready = True
            on = core["default"] if not stream else core["to_stream"](stream)
            core["launch"](on, _config(core, griddim, blockdim, sharedmem), k.cukernel, *flat)
            return
    dispatcher[griddim, blockdim, stream, sharedmem](*args)
