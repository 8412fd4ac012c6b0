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

import ctypes
import inspect
import math
import os
import sys
import weakref

import numpy as np

from proto.device.memo import PerObject

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
        raise RuntimeError("numba was imported before proto.device.backend chose the simulator; "
                           "import proto.device.backend first or set NUMBA_ENABLE_CUDASIM=1")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from numba import cuda  # noqa: E402  (must follow the environment set-up above)

from proto.device import launcher  # noqa: E402  (imports numba too)


if SIMULATOR:
    from proto.device import simulator
    simulator.install()
else:
    # Numba warns at every launch of fewer than 128 blocks (building a warning object and
    # going through the warnings registry each time). The decode kernels launch small grids
    # on purpose (5 rows, 60 heads): the warning costs host time in every eager step and
    # buries the experiments' logs, and it says nothing our kernels' docs do not.
    from numba.cuda.core import config as _numba_config
    _numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

if SIMULATOR:
    def ldcg(array, index):
        """A plain load: the simulator has no caches (and Numba's simulator no cache hints)."""
        return array[index]
else:
    # ld.global.cg: a load served by L2, never by the SM's own L1. L1 is not coherent across
    # SMs, so a block that reads what other blocks of the same launch wrote (after their
    # threadfence and an atomic count) reads it this way.
    ldcg = cuda.ldcg

if SIMULATOR:   # (the simulator's libdevice declares these but computes nothing)
    def rintf(v):
        return np.float32(np.rint(v))

    def fast_cosf(v):
        return np.float32(math.cos(v))

    def fast_sinf(v):
        return np.float32(math.sin(v))
else:
    # float32 round-to-nearest, and the hardware's approximate cosine and sine (within
    # 2^-21.4 on [-pi, pi]; libdevice's accurate cosf and sinf carry a float64 path for huge
    # arguments, and no kernel here computes in float64)
    from numba.cuda import libdevice as _libdevice
    rintf, fast_cosf, fast_sinf = _libdevice.rintf, _libdevice.fast_cosf, _libdevice.fast_sinf

if os.environ.get("PROTO_QUIET") != "1":
    print(f"[proto] backend: {NAME}", file=sys.stderr)


# Every kernel's (python function, signature) pairs, so kernels.compile_check can compile them all
# for a real GPU even on a machine without one.
KERNEL_SIGNATURES: list[tuple[object, str]] = []
# ... and the launch bounds a kernel was declared with (threads, blocks an SM) and its cap on
# registers a thread, for kernels.registers, which compiles them as the GPU does.
LAUNCH_BOUNDS: dict[object, tuple] = {}
MAX_REGISTERS: dict[object, int] = {}
# cuda.jit options that only steer the GPU's code generation (registers per thread).
_GPU_CODEGEN_OPTIONS = ("max_registers", "launch_bounds")


def _code_version() -> str:
    """A digest of every file a kernel's code can come from: the kernels themselves and the
    device layer (intrinsics such as `ldcg`). Computed once per process."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        import hashlib
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        digest = hashlib.sha256()
        for folder in ("kernels", os.path.join("proto", "device")):
            for name in sorted(os.listdir(os.path.join(root, folder))):
                if name.endswith(".py"):
                    with open(os.path.join(root, folder, name), "rb") as f:
                        digest.update(name.encode() + b"\0" + f.read())
        _CODE_VERSION = digest.hexdigest()
    return _CODE_VERSION


_CODE_VERSION = None


def closure_digest(pyfunc) -> str:
    """A digest of what `pyfunc`'s closure holds that names it the same in every process: the
    part of a cached kernel's key that Numba computes by pickling the closure's contents.

    Numba's pickle of an intrinsic (``@intrinsic``: kernels._ptx's PTX wrappers) carries a
    uuid drawn afresh in each process, and so does that of any device function whose closure
    holds one; a kernel made by a factory that closes over them (the tensor-core GEMMs, the
    tiled GEMMs' cp.async, the convolutions' device functions) got a new key in every
    process and compiled again in each: about 30 kernels, a minute or more of every child
    process of an experiment. Here a function (plain, a device function, an intrinsic's
    definition) is named by its module, qualified name, bytecode and options, and the digest
    of its own closure, recursively; any other value by its pickle. What a named function
    calls through its globals is in `_code_version`, as Numba's own key leaves it out."""
    import hashlib
    import types
    from numba.cuda.dispatcher import CUDADispatcher
    from numba.cuda.extending import _Intrinsic
    from numba.cuda.serialize import dumps

    def named(obj, seen) -> bytes:
        if isinstance(obj, CUDADispatcher):
            return b"device:" + repr(sorted(obj.targetoptions.items())).encode() + \
                function(obj.py_func, seen)
        if isinstance(obj, _Intrinsic):
            return b"intrinsic:" + obj._name.encode() + function(obj._defn, seen)
        if isinstance(obj, types.FunctionType):
            return function(obj, seen)
        if isinstance(obj, (tuple, list)):
            return type(obj).__name__.encode() + b"(" + b",".join(named(x, seen) for x in obj) \
                + b")"
        return dumps(obj)

    def function(fn, seen) -> bytes:
        if id(fn) in seen:   # (a closure that reaches itself)
            return b"<again:" + fn.__qualname__.encode() + b">"
        seen = seen | {id(fn)}
        cells = [named(c.cell_contents, seen) for c in fn.__closure__ or ()]
        return b"|".join([fn.__module__.encode(), fn.__qualname__.encode(),
                          fn.__code__.co_code, b"[" + b",".join(cells) + b"]"])

    return hashlib.sha256(function(pyfunc, frozenset())).hexdigest()


def _compiled(pyfunc, signatures, options):
    """`cuda.jit(signatures, **options)(pyfunc)` with Numba's on-disk cache (``__pycache__``
    beside the source), so that a fresh process loads the kernels instead of compiling them
    again: a child process of the memory experiment, a sanitizer's run, a test file. Importing
    every kernel compiles for about a minute; loading them takes seconds.

    Numba keys a cached kernel by its own bytecode, closure values and signature. Its key
    leaves out two things that change the code here, so the key gets them too: the
    decorator's options (one factory line makes kernels that differ only in launch bounds)
    and the source of every kernel module (a kernel's device functions live in other files,
    whose edits Numba's key would miss). And its closure values are hashed as
    `closure_digest` says, not by their pickle, which differs from process to process where
    the closure holds an intrinsic."""
    import hashlib

    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class KernelCache(CUDACache):
        def _index_key(self, sig, codegen):   # (numba-cuda's, the closure's digest replaced)
            ours = (repr(sorted(options.items())), _code_version())
            try:
                digest = closure_digest(pyfunc)
            except Exception as exc:   # a closure value it cannot name: Numba's own key,
                import warnings        # which is right, only not the same in every process
                warnings.warn(f"{pyfunc.__qualname__}: closure_digest failed ({exc!r}); "
                              f"its cache key is Numba's", RuntimeWarning, stacklevel=2)
                return super()._index_key(sig, codegen) + ours
            return (sig, codegen.magic_tuple(), numba_cuda.__version__,
                    (hashlib.sha256(pyfunc.__code__.co_code).hexdigest(), digest)) + ours

    kernel = cuda.jit(**options)(pyfunc)     # no signature yet: nothing compiled
    if os.path.isfile(pyfunc.__code__.co_filename):   # (a kernel made from a string, as
        kernel._cache = KernelCache(pyfunc)  # predication's are, has no file to cache beside)
    for sig in signatures:
        kernel.compile(sig)
    kernel.disable_compile()
    return kernel


def jit(signature, *, writes=(), in_place=(), early_launch=False, **options):
    """`cuda.jit(signature)`: the one kernel decorator of this project.

    Kernels get an eager signature (one fixed argument layout, which the graph layer relies
    on). With ``PROTO_BACKEND=ptx`` compilation is deferred, because eager compilation
    needs a driver; `kernels.compile_check` then compiles every registered signature to PTX.

    `writes` names the parameters the kernel writes; `in_place` lists (output, input) pairs
    that may be the very same array (an elementwise kernel whose thread reads and writes one
    element). Every launch checks that no written array overlaps another argument except as
    `in_place` allows (`check_writes`), and graph passes (race checks, the memory planner)
    read which arguments a node writes from here.

    `early_launch`: the kernel calls kernels._pdl.wait() before it touches anything another
    kernel writes, so a graph may start it while its predecessor runs (kernels/_pdl.py).
    """
    signatures = [signature] if isinstance(signature, str) else list(signature)
    if SIMULATOR:   # register limits mean nothing to the simulator, which rejects them
        options = {k: v for k, v in options.items() if k not in _GPU_CODEGEN_OPTIONS}

    def decorate(pyfunc):
        params = tuple(inspect.signature(pyfunc).parameters)
        named = set(writes) | {n for pair in in_place for n in pair}
        if named - set(params):
            raise ValueError(f"jit({pyfunc.__name__}): writes/in_place name unknown parameters "
                             f"{sorted(named - set(params))}; parameters are {list(params)}")
        if any(out not in writes for out, _ in in_place):
            raise ValueError(f"jit({pyfunc.__name__}): in_place pairs start with a written parameter")
        KERNEL_SIGNATURES.extend((pyfunc, sig) for sig in signatures)
        bounds = options.get("launch_bounds")
        if bounds is not None:
            LAUNCH_BOUNDS[pyfunc] = tuple(bounds) if isinstance(bounds, (tuple, list)) else (bounds,)
        if options.get("max_registers") is not None:
            MAX_REGISTERS[pyfunc] = int(options["max_registers"])
        if PTX_ONLY:
            kernel = cuda.jit(**options)(pyfunc)
        elif SIMULATOR:
            kernel = cuda.jit(signatures, **options)(pyfunc)
        else:
            kernel = _compiled(pyfunc, signatures, options)
        kernel.params = params
        kernel.writes = tuple(params.index(w) for w in writes)
        kernel.in_place = frozenset((params.index(o), params.index(i)) for o, i in in_place)
        kernel.source = (pyfunc, signatures, options, tuple(writes), tuple(in_place))
        kernel.early_launch = bool(early_launch)
        return kernel

    return decorate


FLOAT_TYPES = ("float32", "float16")   # the storage dtypes a floating kernel comes in


def jit_per_dtype(signature: str, *, dtypes=FLOAT_TYPES, **kw):
    """`jit` once per storage dtype from one kernel source: `signature` writes the dtype as
    ``{t}``; returns {np.dtype: kernel}. Each kernel keeps one eager signature (what the
    launcher, the graph layer and predication rely on); the launcher picks by its arrays'
    dtype. A kernel that loads into float32 locals and stores what it computes computes in
    float32 whatever it stores (Numba converts on each load and store)."""
    def decorate(pyfunc):
        return {np.dtype(t): jit(signature.format(t=t), **kw)(pyfunc) for t in dtypes}
    return decorate


_predicated: dict = {}


def predicated(kernel):
    """The kernel's predicated twin (Grape's predication): ``twin[grid, block](pred, *args)``
    runs the kernel only where the 1-element int32 device array `pred` holds a non-zero
    value, read on the device; otherwise every thread returns at once and nothing is written.

    One mechanism for every kernel: the twin is built once, from the kernel's Python source,
    as a kernel that tests `pred` and calls the original as a device function. It has the
    same writes (and in-place pairs) and one eager signature, ``pred`` first."""
    twin = _predicated.get(id(kernel))
    if twin is not None:
        return twin
    source = getattr(kernel, "source", None)
    if source is None:
        raise TypeError(f"predicated: {kernel_name(kernel)} was not made by proto.device.backend.jit")
    pyfunc, signatures, options, writes, in_place = source
    if len(signatures) != 1:
        raise TypeError(f"predicated: {pyfunc.__name__} has {len(signatures)} signatures; "
                        "graph kernels have one")
    if "pred" in kernel.params:
        raise ValueError(f"predicated: {pyfunc.__name__} already has a parameter named 'pred'")
    body = cuda.jit(device=True)(pyfunc)
    params = ", ".join(kernel.params)
    name = f"predicated_{pyfunc.__name__}"
    namespace = {"body": body}
    exec(f"def {name}(pred, {params}):\n    if pred[0] != 0:\n        body({params})\n",
         namespace)
    fn = namespace[name]
    fn.__module__, fn.__qualname__ = pyfunc.__module__, name
    signature = signatures[0].replace("void(", "void(int32[::1], ", 1)
    twin = jit(signature, writes=writes, in_place=in_place, **options)(fn)
    twin.predicate_of = kernel
    _predicated[id(kernel)] = twin
    return twin


def written_args(kernel) -> tuple[int, ...] | None:
    """Indices of the arguments `kernel` writes, or None when it does not say (then every
    array argument must be assumed written)."""
    writes = getattr(kernel, "writes", None)
    return writes if writes else None


def check_writes(kernel, args) -> None:
    """Raise ValueError, naming both arguments, if an array the kernel writes overlaps any
    other array argument in device memory, except an exact `in_place` pair. Runs before
    every launch: a partial overlap is a silently wrong answer, not a GPU fault."""
    writes = getattr(kernel, "writes", ())
    if not writes:
        return
    spans = {i: extent(a) for i, a in enumerate(args) if is_device_array(a)}
    names = kernel.params
    for w in writes:
        lo, hi = spans[w]
        for i, (ilo, ihi) in spans.items():
            if i == w or not (lo < ihi and ilo < hi):
                continue
            pair = (w, i) in kernel.in_place or (i, w) in kernel.in_place
            if pair and (lo, hi) == (ilo, ihi) and tuple(args[w].strides) == tuple(args[i].strides):
                continue
            raise ValueError(f"{kernel_name(kernel)}: output {names[w]!r} (bytes [{lo:#x}, "
                             f"{hi:#x})) overlaps argument {names[i]!r} (bytes [{ilo:#x}, "
                             f"{ihi:#x})): the kernel would read what it is overwriting; pass "
                             "separate buffers" + (" or the same array" if pair else ""))


def kernel_name(kernel) -> str:
    """A Numba dispatcher's Python function name (simulator kernels keep it as `fn`)."""
    return getattr(getattr(kernel, "py_func", None) or getattr(kernel, "fn", None), "__name__",
                   type(kernel).__name__)


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
_recorder = None   # what intercepts launches and allocations; set by proto.graph.record


def set_recorder(recorder) -> None:
    """Point `launch` and `empty` at `recorder` (None: run eagerly). Only proto.graph.record,
    which keeps the stack of nested recordings, calls this."""
    global _recorder
    _recorder = recorder


def launch(kernel, griddim, blockdim, args, stream=0, sharedmem=0):
    """Launch `kernel[griddim, blockdim, stream, sharedmem](*args)`, or record it.

    `kernel` is a Numba dispatcher with eager signatures; `args` a tuple of device arrays
    and scalars. Launchers validate their inputs before calling this; the overlap of written
    arrays with other arguments is checked here, once for every kernel (`check_writes`).
    """
    args = tuple(args)
    check_writes(kernel, args)
    if _recorder is not None:
        _recorder.record_launch(kernel, griddim, blockdim, args, sharedmem, stream)
    elif SIMULATOR:
        kernel[griddim, blockdim, stream, sharedmem](*args)
    else:   # the same parameters as Numba's launch, without its per-launch work
        launcher.launch(kernel, griddim, blockdim, args, stream, sharedmem)


ALIGN = 256  # cudaMalloc's alignment: every block starts where a kernel expects it to


def persistent_zeros(size: int, dtype):
    """A zeroed device array made without a host copy (cuMemsetD8), so also while a graph is
    being recorded, where host<->device copies are refused: for state that lives beside
    every graph and that its kernels keep consistent (kernels._lastblock's counters), never
    for a graph's data."""
    arr = cuda.device_array(size, dtype)
    if SIMULATOR:   # (the simulator's device arrays are host memory)
        arr[:] = 0
    else:
        from numba.cuda.cudadrv import driver
        driver.device_memset(arr, 0, arr.nbytes)   # synchronous
    return arr


class _Reservation:
    """A reserved range of device virtual addresses with no memory behind it; released when
    the last array over it goes."""

    def __init__(self, nbytes: int):
        from cuda.bindings import driver
        err, self.ptr = driver.cuMemAddressReserve(nbytes, 0, 0, 0)
        if int(err):
            raise RuntimeError(f"cuMemAddressReserve({nbytes}): {err!r}")
        self.nbytes = nbytes
        self._release = driver.cuMemAddressFree   # (held: no import at interpreter exit)

    def __del__(self):
        self._release(self.ptr, self.nbytes)


_provisional = None   # the largest reservation made so far, as a byte array over it
_PROVISIONAL_GRANULE = 2 << 20   # (reservations are made in whole 2 MiB pages)


def provisional_memory(nbytes: int):
    """A byte array of at least `nbytes` device addresses for temporaries that a recording
    only names, never touches, before the memory planner moves them into an arena. On a GPU
    no memory backs it (a reserved virtual address range, cuMemAddressReserve), so recording
    a graph takes no device memory: allocating and freeing a provisional buffer per graph
    cost the driver memory that never came back. One range serves every recording (a new,
    larger one when a recording needs more). On the simulator: host memory."""
    global _provisional
    if SIMULATOR:
        return cuda.device_array(max(nbytes, 1), np.uint8)
    if _provisional is None or _provisional.size < nbytes:
        size = align_up(max(nbytes, 1), _PROVISIONAL_GRANULE)
        owner = _Reservation(size)
        _provisional = cuda.from_cuda_array_interface(
            {"shape": (size,), "typestr": "|u1", "data": (int(owner.ptr), False),
             "version": 3}, owner=owner, sync=False)
    return _provisional


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class Layout:
    """Shape, C-contiguous strides and dtype: what `view_at` needs to make an array."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        strides, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))


# name -> (device bytes, {(shape, dtype): view of them}); kernel scratch in the first,
# per owner in the second
_eager_buffers: dict = {}
_eager_owned: "weakref.WeakKeyDictionary" = None
_VIEWS_PER_BUFFER = 16


def empty(shape, dtype, name: str, owner=None):
    """A device array for a temporary of one step: the allocation hook (beside `launch`).

    Eagerly: a view of a buffer kept per (`owner`, `name`), grown when a larger shape asks,
    so an eager step allocates nothing after its first call and its result stays valid
    until the owner's next step (kernel scratch passes no owner: it dies inside one
    launcher call). While recording a graph (proto.graph): a buffer of the description,
    which the memory planner places in the arena the graph's owner shares between its
    graphs (the same `name` gets the same address in every graph). `name` must be unique
    among the temporaries one step allocates.
    """
    global _eager_owned
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    if not isinstance(name, str) or not name:
        raise ValueError(f"empty: name: expected a non-empty string, got {name!r}")
    if any(s < 0 for s in shape):
        raise ValueError(f"empty({name!r}): shape {shape} has a negative dimension")
    if _recorder is not None:
        return _recorder.record_alloc(shape, dtype, name, owner)
    if owner is None:
        table = _eager_buffers
    else:
        if _eager_owned is None:
            _eager_owned = weakref.WeakKeyDictionary()
        table = _eager_owned.setdefault(owner, {})
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)   # (np.prod costs more than the rest)
    held = table.get(name)
    if held is None or held[0].size < nbytes:
        held = table[name] = (cuda.device_array(nbytes, np.uint8), {})
    buf, views = held
    # The same view object every step: making a device array costs host time at every
    # launch of an eager step (and Numba's argument handling starts over for a new object).
    view = views.get((shape, dtype))
    if view is None:
        if len(views) >= _VIEWS_PER_BUFFER:   # shapes that vary call after call (prefill)
            views.clear()
        view = views[(shape, dtype)] = view_at(buf, 0, Layout(shape, dtype))
    return view


def settled_free_memory() -> tuple[int, int]:
    """(free device bytes, bytes Numba's live allocations hold), once every dropped buffer is
    really freed: garbage collected, the GPU idle, and Numba's queued frees flushed (it frees
    in batches). What a reading of memory taken must start from; GPU only."""
    import gc
    gc.collect()
    synchronize()
    ctx = cuda.current_context()
    ctx.memory_manager.deallocations.clear()
    live = sum(m.size for m in ctx.memory_manager.allocations.values())
    return ctx.get_memory_info()[0], live


def scratch_bytes() -> int:
    """Device bytes that launchers hold as their own scratch (`empty` without an owner,
    eagerly: split-K partials and the like), outside any caller's arena or pool. A memory
    policy that budgets its tensors does not count these; experiments report them."""
    return sum(buf.size for buf, _ in _eager_buffers.values())


def address(arr) -> int:
    """Device address of the array's first element (the simulator's is a host address). A
    host NumPy array (pinned, for copies) gives its host address: with unified addressing
    the driver tells the two apart."""
    if isinstance(arr, np.ndarray):
        return arr.ctypes.data
    if SIMULATOR:
        return arr._ary.__array_interface__["data"][0]
    return arr.device_ctypes_pointer.value or 0


_extents = PerObject()
_views = PerObject()   # reshaped's and rows' views, by shape or ("rows", lo, hi)


def extent(arr) -> tuple[int, int]:
    """[lo, hi) byte range the array's elements occupy, strides (even negative) included; an
    empty array occupies no bytes. Remembered per array object."""
    return _extents.get(arr, None, lambda: _extent(arr))


def reshaped(arr, shape: tuple):
    """arr.reshape(*shape), the same view object for the same array and shape (making a
    device array costs host time at every eager launch)."""
    return _views.get(arr, tuple(shape), lambda: arr.reshape(*shape))


def leading(arr, n: int):
    """arr[:n], the same view object for the same array and n: a dynamic-shape step slices
    its buffers to the served rows at every replay, and a new view each time costs the
    slicing and misses every per-object cache after it (its extent, its launch parameters)."""
    return _views.get(arr, ("rows", 0, n), lambda: arr[:n])   # (rows', inlined: per replay)


def rows(arr, lo: int, hi: int):
    """arr[lo:hi], the same view object for the same array and bounds (see `leading`)."""
    return _views.get(arr, ("rows", lo, hi), lambda: arr[lo:hi])


def _extent(arr) -> tuple[int, int]:
    lo = hi = address(arr)
    if any(n == 0 for n in arr.shape):
        return lo, lo
    for n, s in zip(arr.shape, arr.strides):
        reach = (n - 1) * s
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + arr.dtype.itemsize


def is_device_array(x) -> bool:
    """True for a Numba device array (real or simulated); False for NumPy and anything else."""
    return cuda.devicearray.is_cuda_ndarray(x)


def view_at(base, offset: int, like):
    """An array shaped and strided like `like`, starting `offset` bytes into the device
    array `base`: how a graph's argument is moved onto other memory (patch binding, the
    memory planner's arena)."""
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.ndarray(like.shape, like.dtype, buffer=base._ary, offset=offset,
                                        strides=like.strides))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(like.shape, like.strides, like.dtype, gpu_data=base.gpu_data.view(offset))


def device_copy(dst, src, stream=0, *, prefix: tuple[int, int] | None = None) -> int:
    """Copy equal-shaped C-contiguous arrays, queued on `stream` (0: the default stream, which
    every kernel and graph of this project runs on unless told otherwise). Device to device,
    or one side a host array: pinned, so the copy is asynchronous. Returns the bytes copied.

    prefix=(axis, n): only the elements whose index along `axis` is below n (a KV cache's live
    positions): one strided copy of prod(shape[:axis]) rows. Device to device only.

    A device-to-device copy on a GPU is one driver call (cuMemcpyDtoDAsync, or
    cuMemcpy2DAsync for a prefix), a few microseconds of host time, as a framework issues
    it; Numba's copy_to_device costs tens."""
    if is_device_array(dst) and is_device_array(src):
        if not (dst.is_c_contiguous() and src.is_c_contiguous()) or dst.shape != src.shape \
                or dst.dtype != src.dtype:
            raise ValueError(f"device_copy: expected equal C-contiguous arrays, got dst "
                             f"{dst.dtype} {dst.shape} and src {src.dtype} {src.shape}")
    if prefix is not None:
        if not (is_device_array(dst) and is_device_array(src)):
            raise TypeError("device_copy: a prefix copy is device to device")
        width, height, pitch = prefix_rows(src, *prefix)
        if SIMULATOR:
            index = (slice(None),) * prefix[0] + (slice(0, prefix[1]),)
            dst._ary[index] = src._ary[index]
        else:
            _raw_copy(address(dst), address(src), width, height, pitch, stream)
        return width * height
    if not SIMULATOR and is_device_array(dst) and is_device_array(src):
        _raw_copy(address(dst), address(src), src.nbytes, 1, src.nbytes, stream)
        return src.nbytes
    if not SIMULATOR and isinstance(stream, int):
        stream = cuda.default_stream()
    if is_device_array(dst):
        dst.copy_to_device(src, stream=stream)
    else:
        src.copy_to_host(dst, stream=stream)
    return src.nbytes


def prefix_rows(arr, axis: int, n: int) -> tuple[int, int, int]:
    """(bytes per row, rows, row pitch) of `arr[..., :n, ...]` (n along `axis`) in a
    C-contiguous array: the rows are the index combinations before `axis`."""
    shape = tuple(arr.shape)
    if not 0 <= axis < len(shape):
        raise ValueError(f"prefix: axis {axis} is outside an array of {len(shape)} dimensions")
    if not 0 <= n <= shape[axis]:
        raise ValueError(f"prefix: length {n} is outside [0, {shape[axis]}] along axis {axis}")
    inner = math.prod(shape[axis + 1:]) * arr.dtype.itemsize   # Python ints: no overflow
    return n * inner, math.prod(shape[:axis]), shape[axis] * inner


def driver_stream(stream):
    """A driver CUstream for `stream`: 0 or None (the legacy default stream every kernel and
    graph here runs on) or a Numba stream (its handle a driver object or a ctypes pointer)."""
    from cuda.bindings import driver
    if not stream:
        return driver.CUstream(0)
    handle = getattr(stream.handle, "value", stream.handle)
    return driver.CUstream(int(handle or 0))


def _raw_copy(dst: int, src: int, width: int, height: int, pitch: int, stream) -> None:
    """`height` rows of `width` bytes, `pitch` bytes apart in both, device to device."""
    from cuda.bindings import driver
    if width == 0 or height == 0:
        return
    hstream = driver_stream(stream)
    if height == 1 or width == pitch:   # one contiguous run
        (err,) = driver.cuMemcpyDtoDAsync(dst, src, width * height, hstream)
    else:
        p = driver.CUDA_MEMCPY2D()
        p.srcMemoryType = p.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice, p.dstDevice = src, dst
        p.srcPitch = p.dstPitch = pitch
        p.WidthInBytes, p.Height = width, height
        (err,) = driver.cuMemcpy2DAsync(p, hstream)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"device copy of {height} x {width} bytes failed: {err}")
