"""Recording: run a function with its launches, copies, events and allocations turned into a
description (proto.graph.ir) instead of work.

There is one stack of recordings. Inside ``record()`` every ``proto.device.backend.launch`` appends
a kernel node, every `copy` a copy node, every ``proto.device.backend.empty`` a buffer of the
description, and `while_loop` / `if_then` a conditional node whose body is recorded into a
description of its own. Nothing runs. Outside ``record()`` the same calls run eagerly, so a
model's step is written once and is both the eager code and what a graph records.

Streams. A graph is a DAG, and recording turns stream order and events into its edges, as
CUDA's own stream capture does: a node launched on stream S waits for the previous node on S;
``record_event(e, S)`` remembers S's last node, and ``wait_event(e, T)`` makes T's next node
wait for it too. So code written for several streams (proto.vm's swap schedule: compute,
device-to-host and host-to-device streams) records into one graph whose branches overlap
exactly as the streams did.

Data-dependent control flow. A CUDA graph replays fixed work, but generation is a loop whose
length the data decides. `while_loop(flag, body)` and `if_then(flag, body)` take a
1-element int32 device flag that a kernel of the body writes (non-zero: go on). Eagerly they
read the flag on the host each pass; recorded, they become one conditional node, which the
CUDA executor lowers to an IF/WHILE graph node and the walk executor runs by reading the
flag where the GPU would test it. Every WHILE has a bound on its passes: past it the loop
stops and the caller gets an error (from a device-side counter after a graph replay).

What cannot be recorded raises while recording, never at a replay: a host read or write of
device memory (``copy_to_host``, ``to_device``: it would run once, now, and every replay
would see stale data), host math (`require_eager`), a recording inside a recording.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import Layout, align_up, cuda, is_device_array, kernel_name, view_at
from proto.graph.ir import Buffer, Conditional, Copy, Description, KernelLaunch

_CHUNK = 64 << 20              # provisional addresses for a planned recording's temporaries


def _dim3(dim) -> tuple:
    dim = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(int(d) for d in dim) + (1,) * (3 - len(dim))


def _stream_key(stream):
    """Streams are told apart by identity; 0 and None are the default stream."""
    return 0 if stream is None or isinstance(stream, int) else id(stream)


class Recorder:
    """Collects nodes, their dependencies and (at the root) the buffers allocated."""

    def __init__(self, root: "Recorder | None" = None, private: bool = True):
        self.private = private    # temporaries each in their own allocation (kept: unplanned)
        self._chunk, self._used = None, 0   # else: carved from chunks the planner will drop
        self.nodes: list = []
        self.deps: list[tuple[int, ...]] = []
        self.root = root or self
        self.buffers: list[Buffer] = []           # the root's: allocations of the whole graph
        self._seen: Counter = Counter()           # (owner tag, name) -> allocations so far
        self._waits: dict = {}    # stream key -> nodes its next node waits for
        self._events: dict = {}   # id(event) -> (event, nodes its last record captured)
        self.phases: list[tuple[str, int]] = []   # (name, first node) of each `phase` marked

    def _append(self, node, stream) -> None:
        key = _stream_key(stream)
        self.deps.append(tuple(sorted(self._waits.get(key, ()))))
        self._waits[key] = (len(self.nodes),)
        self.nodes.append(node)

    # the hooks proto.device.backend calls
    def record_launch(self, kernel, griddim, blockdim, args, sharedmem=0, stream=0) -> None:
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"record: kernel {kernel_name(kernel)} argument {i} "
                                "is a host NumPy array: Numba would copy it at every eager launch, "
                                "which a graph cannot record; pass a device array")
        self._append(KernelLaunch(tuple(args), kernel, _dim3(griddim), _dim3(blockdim),
                                  int(sharedmem)), stream)

    def record_alloc(self, shape, dtype, name: str, owner):
        root = self.root
        tag = None if owner is None else id(owner)
        # The k-th allocation of a name in a graph (a step recorded twice, as a loop body
        # making two steps) is its own tensor, the same k-th one in every graph of the tape.
        k = root._seen[(tag, name)]
        root._seen[(tag, name)] += 1
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        base, offset = root._memory(max(nbytes, dtype.itemsize))
        root.buffers.append(Buffer((tag, name, k), nbytes, view_at(base, offset, Layout((max(nbytes, 1),), np.uint8))))
        return view_at(base, offset, Layout(shape, dtype))

    def _memory(self, nbytes: int):
        """(device array, byte offset) of an address for a temporary. Private: its own
        allocation, the graph's for good if it is not planned. Otherwise provisional
        addresses that no memory backs (proto.device.backend.provisional_memory): the planner
        (proto.graph.plan) moves every temporary into an arena before anything runs, so a
        planned recording allocates nothing."""
        if self.private:
            return cuda.device_array(nbytes, np.uint8), 0
        size = align_up(nbytes)
        if self._chunk is None or self._used + size > self._chunk.size:
            self._chunk = backend.provisional_memory(max(_CHUNK, size, 2 * self._used))
            self._used = 0   # (a new range: earlier temporaries keep theirs in the old one)
        offset, self._used = self._used, self._used + size
        return self._chunk, offset

    def record_copy(self, dst, src, stream=0) -> None:
        self._append(Copy((dst, src)), stream)

    def record_event(self, event, stream=0) -> None:
        self._events[id(event)] = (event, self._waits.get(_stream_key(stream), ()))

    def wait_event(self, event, stream=0) -> None:
        if id(event) not in self._events:
            raise ValueError("wait_event: the event was not recorded earlier in this graph; a "
                             "graph can only wait for work inside it")
        key = _stream_key(stream)
        self._waits[key] = tuple(set(self._waits.get(key, ())) | set(self._events[id(event)][1]))

    def description(self) -> Description:
        return Description(list(self.nodes), list(self.deps),
                           list(self.buffers) if self.root is self else [])


# ------------------------------------------------------------------------- the one stack
_stack: list[Recorder] = []


def _device_io_refused(what: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"record: {what} inside a recorded function would run once, now, and "
                           "every replay would see stale data; use proto.graph.copy (recorded) "
                           "or move it outside the function")
    return refuse


@contextlib.contextmanager
def _no_device_io():
    """While recording, host<->device transfers of Numba arrays raise."""
    if backend.SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        classes = [FakeCUDAArray]
    else:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        classes = [DeviceNDArray]
    saved = [(c, name, c.__dict__.get(name)) for c in classes
             for name in ("copy_to_host", "copy_to_device")] + [(cuda, "to_device", cuda.to_device)]
    for c, name, _ in saved:
        setattr(c, name, _device_io_refused(f"{name}()" if c is not cuda else "cuda.to_device()"))
    try:
        yield
    finally:
        for c, name, method in saved:
            if method is None:
                delattr(c, name)
            else:
                setattr(c, name, method)


@contextlib.contextmanager
def _push(recorder: Recorder):
    _stack.append(recorder)
    backend.set_recorder(recorder)
    try:
        if len(_stack) == 1:
            with _no_device_io():
                yield recorder
        else:
            yield recorder
    finally:
        _stack.pop()
        backend.set_recorder(_stack[-1] if _stack else None)


@contextlib.contextmanager
def record(private: bool = True):
    """Inside the block, launches, `copy` calls, events and allocations are recorded, not
    run. Yields the Recorder; ``recorder.description()`` afterwards. `private`: every
    temporary its own allocation (False when a planner will place them in an arena)."""
    if _stack:
        raise RuntimeError("record: already recording a graph; a recording (or a capture) "
                           "cannot be nested inside another")
    with _push(Recorder(private=private)) as recorder:
        yield recorder


def recording() -> bool:
    """True inside `record()`: code that would do eager work (host math) must refuse."""
    return bool(_stack)


def require_eager(what: str) -> None:
    """Raise inside `record()`: `what` computes on the host, so it would run once, now, and
    never at a replay; the graph would silently skip it."""
    if _stack:
        raise RuntimeError(f"record: {what} computes on the host and cannot be recorded into a "
                           "graph; use device kernels")


# ------------------------------------------------------------------------- copies and events
def copy(dst, src, stream=0) -> None:
    """dst[...] = src (same dtype and shape, C-contiguous), on `stream`; recordable. Device to
    device, or one side a host array (pinned, from cuda.pinned_array, for an async copy)."""
    for name, a in (("dst", dst), ("src", src)):
        if isinstance(a, np.ndarray):
            if not a.flags.c_contiguous:
                raise ValueError(f"copy: {name}: expected a C-contiguous array, strides {a.strides}")
        elif not is_device_array(a):
            raise TypeError(f"copy: {name}: expected a device or host array, got {type(a).__name__}")
        elif not a.is_c_contiguous():
            raise ValueError(f"copy: {name}: expected a C-contiguous array, strides {a.strides}")
    if not (is_device_array(dst) or is_device_array(src)):
        raise TypeError("copy: both arrays are on the host; use NumPy")
    if np.dtype(dst.dtype) != np.dtype(src.dtype) or tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy: dst is {np.dtype(dst.dtype)} {tuple(dst.shape)}, "
                         f"src is {np.dtype(src.dtype)} {tuple(src.shape)}: expected them equal")
    if is_device_array(dst) and is_device_array(src):
        (lo, hi), (slo, shi) = backend.extent(dst), backend.extent(src)
        if lo < shi and slo < hi:   # a DMA copy between overlapping bytes is undefined
            raise ValueError(f"copy: dst (bytes [{lo:#x}, {hi:#x})) overlaps src (bytes "
                             f"[{slo:#x}, {shi:#x}))")
    if _stack:
        _stack[-1].record_copy(dst, src, stream)
    else:
        backend.device_copy(dst, src, stream)


def record_event(event, stream=0) -> None:
    """``event.record(stream)``, or while recording: later waits on `event` wait for the
    nodes recorded on `stream` so far."""
    if _stack:
        _stack[-1].record_event(event, stream)
    else:
        event.record(stream)


def wait_event(event, stream=0) -> None:
    """``event.wait(stream)``, or while recording: the next node on `stream` waits for what
    `event` captured."""
    if _stack:
        _stack[-1].wait_event(event, stream)
    else:
        event.wait(stream)


# ------------------------------------------------------------------------- control flow
def check_flag(flag) -> None:
    if not is_device_array(flag):
        raise TypeError(f"flag: expected a 1-element int32 device array, got {type(flag).__name__}")
    if np.dtype(flag.dtype) != np.int32 or tuple(flag.shape) != (1,):
        raise ValueError(f"flag: expected a 1-element int32 device array, got "
                         f"{np.dtype(flag.dtype)} {tuple(flag.shape)}")


def read_flag(flag) -> bool:
    """flag[0] != 0, read on the host (waits for the work that writes it)."""
    return bool(flag.copy_to_host()[0])


class LoopBoundError(RuntimeError):
    """A WHILE loop's flag was still set after `max_passes` passes."""


def _check_body(body, what: str) -> None:
    if not callable(body):   # eagerly with the flag clear, it would never be called to fail
        raise TypeError(f"{what}: body: expected a function of no arguments, got "
                        f"{type(body).__name__}")


def _record_body(body: Callable[[], None], what: str) -> Description:
    parent = _stack[-1]
    with _push(Recorder(root=parent.root)) as inner:
        body()
    if not inner.nodes:
        raise ValueError(f"{what}: the body launched no kernels and made no copies")
    return inner.description()


def while_loop(flag, body: Callable[[], None], *, max_passes: int) -> int:
    """Run `body()` while flag[0] != 0 (tested before every pass); `body` must update the
    flag. At most `max_passes` passes, a bound the caller must give and can reason about
    (a generation's token budget): a flag still set after them raises LoopBoundError
    (eagerly at once; from a graph, after the replay that hit it). Eagerly returns the
    number of passes; recording returns 0 and runs nothing."""
    check_flag(flag)
    _check_body(body, "while_loop")
    max_passes = _check.positive("while_loop: max_passes", max_passes)
    if _stack:
        passes = cuda.device_array(2, np.int32)   # passes made, bound hit (the CUDA executor's)
        _stack[-1]._append(Conditional((flag,), _record_body(body, "while_loop"), loop=True,
                                       max_passes=max_passes, passes=passes), 0)
        return 0
    passes = 0
    while read_flag(flag):
        if passes == max_passes:
            raise LoopBoundError(f"while_loop: the flag is still set after max_passes="
                                 f"{max_passes} passes; the body must clear it (or raise the bound)")
        body()
        passes += 1
    return passes


def phase(name: str) -> None:
    """Begin the phase `name` of the graph being recorded: the nodes from here to the next
    phase (or the end) become an executable of their own, which the graph's owner replays
    apart (`Graph.replay(phase=...)`): a training step's forward, then its backward and
    update, as an autograd engine runs them. The memory planner still sees the whole step,
    so a tensor the forward saves for the backward keeps its bytes from its write in one
    phase to its last read in a later one. Nodes before the first mark form a phase
    "start". Eagerly it does nothing; inside an IF or WHILE body it is refused (a body is
    one node of its phase)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"phase: name: expected a non-empty string, got {name!r}")
    if not _stack:
        return
    recorder = _stack[-1]
    if recorder.root is not recorder:
        raise RuntimeError(f"phase({name!r}): inside an IF or WHILE body; a phase begins "
                           "between top-level nodes")
    if any(n == name for n, _ in recorder.phases):
        raise ValueError(f"phase({name!r}): this graph already has a phase of that name")
    recorder.phases.append((name, len(recorder.nodes)))


def if_then(flag, body: Callable[[], None]) -> bool:
    """Run `body()` once if flag[0] != 0. Eagerly: returns whether it ran."""
    check_flag(flag)
    _check_body(body, "if_then")
    if _stack:
        _stack[-1]._append(Conditional((flag,), _record_body(body, "if_then"), loop=False), 0)
        return False
    if read_flag(flag):
        body()
        return True
    return False
