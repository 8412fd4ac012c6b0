"""Record a function's kernel launches once, replay them as one graph.

Why graphs. An eager kernel launch costs the host 5-30 us (Python, Numba's argument
flattening, the driver), while a small decode-step kernel runs for a few microseconds, so a
step of hundreds of kernels is bound by the CPU. A CUDA graph is the list of launches (and
copies) with their dependencies, handed to the driver once: *instantiation* validates it and
prepares every launch, and from then on one ``cuGraphLaunch`` replays all of it for about
1 us per kernel. What a graph freezes is everything a launch is made of: the kernels, grid and
block sizes, and every argument, including the device address of every array. Replaying
therefore reruns the same arithmetic on the same buffers; new data must be placed where the
graph looks (proto.binding) and new shapes need new graphs or kernels that read their length
on the device (proto.shapes).

The layers, each small:
  description   plain data: a list of `Node`s (`KernelLaunch`, `Copy`, and `Conditional`: an
                IF or WHILE on a device flag whose body is a description itself; see
                proto.control) and, for each, the earlier nodes it waits for. Recorded, not run: inside `record()` every
                `proto.backend.launch` and every `copy` appends a node (see "Streams" below).
  executors     turn a description into something that runs (proto.executors): the CUDA
                executor builds and instantiates a real CUDA graph; the walk executor launches
                node by node, which is what the simulator (no graphs) can do.
  binding       how each replay's inputs reach the graph: copy | patch | alias (proto.binding).
  capture       `GraphedFunction`: the state machine warm-up -> record -> replay below.

Capture is a state machine (as tinygrad's TinyJit and torch.cuda.graphs):
  WARM-UP  run the function eagerly first. Kernels get loaded into the context, and anything
           the function allocates or initialises on its first call (a cached workspace, a
           lazily built table) happens now, outside the graph. PyTorch warms up for the same
           reason: a graph must never record a one-off first-call path.
  RECORD   run the function again with the launch hook pointed at a recorder: nothing runs,
           every launch becomes a node that reads and writes the *placeholders* (the inputs
           passed at capture). The description then goes to an executor, once.
  REPLAY   check the inputs (names, device, dtype, shape, layout) before anything moves,
           bind them, launch. Outputs are the arrays the function returned while recording
           (`graphed.outputs`): a replay writes into them again.

Usage:
    graphed = capture(step, inputs={"x": x_placeholder}, binding="copy")
    stats = graphed.replay(x=x_new)        # -> ReplayStats(bytes copied, host bind time)
    y = graphed.outputs                    # what `step` returned, refreshed by every replay
    graphed.close()                        # or: with capture(...) as graphed: ...

Every array a node references is kept alive by the description until `close()`; closing
destroys the executable graph and drops those references, so the buffers are freed.

Streams. A graph is not a list but a DAG: each node names the nodes it must wait for, and
nodes with no path between them may run at once (a copy engine moving data while the SMs
compute). Recording turns stream order and events into those edges, as CUDA's own stream
capture does: a node launched on stream S waits for the previous node on S;
``record_event(e, S)`` remembers S's last node, and ``wait_event(e, T)`` makes T's next node
wait for it too. So code written for several streams and events (proto.vm's swap schedule:
compute, device-to-host and host-to-device streams) records into one graph whose branches
overlap exactly as the streams did. Work on a single stream records as a chain. `races()`
checks a description the way a race detector would: any two nodes that touch the same bytes,
one writing, must be ordered by a path of edges.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from typing import Callable, ClassVar

import numpy as np

from proto import backend
from proto.backend import is_device_array
from proto.binding import (MODES, Binder, ReplayStats, check_disjoint, check_inputs,
                           device_copy, extent, input_slots)
from proto.executors import EXECUTORS, default_executor


# ------------------------------------------------------------------------- the description
@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One operation of a graph. `args` lists what it touches, in argument-slot order; the
    device arrays among them are what binding can rebind. Executors dispatch on `kind`."""
    args: tuple
    kind: ClassVar[str] = "node"

    def array_args(self) -> list[tuple[int, object]]:
        return [(i, a) for i, a in enumerate(self.args) if is_device_array(a)]


@dataclasses.dataclass(frozen=True, eq=False)
class KernelLaunch(Node):
    """``kernel[griddim, blockdim, stream, sharedmem](*args)`` with dims as 3-tuples."""
    kernel: object = None  # a Numba dispatcher with one eager signature
    griddim: tuple = (1, 1, 1)
    blockdim: tuple = (1, 1, 1)
    sharedmem: int = 0
    kind: ClassVar[str] = "kernel"

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)


@dataclasses.dataclass(frozen=True, eq=False)
class Copy(Node):
    """``dst[...] = src``; args = (dst, src), equal shapes and dtypes, C-contiguous. Device to
    device, or one side a pinned host array (a swap out to host memory or back in)."""
    kind: ClassVar[str] = "copy"

    @property
    def direction(self) -> str:
        dst, src = self.args
        return {(True, True): "D2D", (True, False): "H2D", (False, True): "D2H"}[
            (is_device_array(dst), is_device_array(src))]


@dataclasses.dataclass(frozen=True, eq=False)
class Conditional(Node):
    """IF (`loop` False) or WHILE (`loop` True) on a device flag: `body`, a GraphDescription,
    runs once if, or again and again while, flag[0] != 0, as read when the node starts (and,
    for WHILE, after every pass: the body is what changes the flag). args = (flag,), a
    1-element int32 device array. Recorded by proto.control."""
    body: "GraphDescription" = None
    loop: bool = False
    kind: ClassVar[str] = "conditional"

    @property
    def name(self) -> str:
        return "while" if self.loop else "if"

    def touched(self) -> list:
        """Every device array the node or its body reaches (for race checks)."""
        out = [self.args[0]]
        for node in self.body.nodes:
            out += node.touched() if node.kind == "conditional" else [a for _, a in node.array_args()]
        return out


def _after_previous(j: int) -> tuple:
    """Node j's dependencies on one stream: the node before it."""
    return (j - 1,) if j else ()


@dataclasses.dataclass
class GraphDescription:
    """The nodes in recording order and, per node, the indices of earlier nodes it waits for.
    Without `deps` each node waits for the one before: one stream's order."""
    nodes: list
    deps: list | None = None

    def __post_init__(self):
        if self.deps is None:
            self.deps = [_after_previous(j) for j in range(len(self.nodes))]
        if len(self.deps) != len(self.nodes):
            raise ValueError(f"deps: expected one tuple per node ({len(self.nodes)}), got {len(self.deps)}")
        for j, deps in enumerate(self.deps):
            if any(not 0 <= d < j for d in deps):
                raise ValueError(f"deps[{j}] = {deps}: a node can only wait for earlier nodes")

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def is_chain(self) -> bool:
        """True when every node waits for exactly the one before (nothing runs concurrently)."""
        return all(deps == _after_previous(j) for j, deps in enumerate(self.deps))

    def summary(self) -> str:
        """One line per node: what a student would print to see what was recorded. Wait
        lists are shown where they differ from "the node before"."""
        lines = []
        for j, (node, deps) in enumerate(zip(self.nodes, self.deps)):
            arrays = ", ".join(f"{i}:{np.dtype(a.dtype)}{tuple(a.shape)}" for i, a in node.array_args())
            what = {"kernel": lambda: f"{node.name} grid={node.griddim} block={node.blockdim}",
                    "copy": lambda: f"copy {node.direction}",
                    "conditional": lambda: f"{node.name} flag[0] != 0: {len(node.body)} nodes"}[node.kind]()
            after = "" if deps == _after_previous(j) else f"  after {list(deps)}"
            lines.append(f"{j:4d} {what}  [{arrays}]{after}")
            if node.kind == "conditional":
                lines += ["     | " + line for line in node.body.summary().splitlines()]
        return "\n".join(lines)

    @property
    def has_conditionals(self) -> bool:
        return any(node.kind == "conditional" for node in self.nodes)


def races(description: GraphDescription) -> list[tuple[int, int]]:
    """Pairs of nodes (i < j) that touch overlapping bytes, at least one of them writing, with
    no path of dependencies between them: on a GPU they may run at once or in either order.
    A kernel counts as writing every array it takes (a launch does not say which it only
    reads); a copy reads `src` and writes `dst`; a conditional node counts as one node writing
    everything its body touches (check a body itself with races(node.body)). An empty list
    means the DAG is race-free."""
    ancestors = []   # bit d of ancestors[j]: node d must finish before node j starts
    for deps in description.deps:
        mask = 0
        for d in deps:
            mask |= ancestors[d] | (1 << d)
        ancestors.append(mask)
    accesses = []    # (lo, hi, node, writes), swept in address order
    for j, node in enumerate(description.nodes):
        if node.kind == "copy":
            dst, src = node.args
            accesses += [(*extent(dst), j, True), (*extent(src), j, False)]
        elif node.kind == "conditional":
            accesses += [(*extent(a), j, True) for a in node.touched()]
        else:
            accesses += [(*extent(a), j, True) for _, a in node.array_args()]
    accesses.sort(key=lambda a: a[0])
    found, open_ = set(), []
    for lo, hi, j, writes in accesses:
        open_ = [a for a in open_ if a[1] > lo]
        for _, _, i, other_writes in open_:
            a, b = min(i, j), max(i, j)
            if a != b and (writes or other_writes) and not (ancestors[b] >> a) & 1:
                found.add((a, b))
        open_.append((lo, hi, j, writes))
    return sorted(found)


def kernel_name(kernel) -> str:
    """A Numba dispatcher's Python function name (simulator kernels keep it as `fn`)."""
    return getattr(getattr(kernel, "py_func", None) or getattr(kernel, "fn", None), "__name__",
                   type(kernel).__name__)


def _dim3(dim) -> tuple:
    dim = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return tuple(int(d) for d in dim) + (1,) * (3 - len(dim))


def _stream_key(stream):
    """Streams are told apart by identity; 0 and None are the default stream."""
    return 0 if stream is None or isinstance(stream, int) else id(stream)


class Recorder:
    """Collects nodes and their dependencies; `proto.backend.launch` calls `record_launch`
    while it is active, `copy`, `record_event` and `wait_event` the rest."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.deps: list[tuple[int, ...]] = []
        self._waits: dict = {}    # stream key -> nodes its next node waits for
        self._events: dict = {}   # id(event) -> (event, nodes its last record captured)

    def _append(self, node: Node, stream) -> None:
        key = _stream_key(stream)
        self.deps.append(tuple(sorted(self._waits.get(key, ()))))
        self._waits[key] = (len(self.nodes),)
        self.nodes.append(node)

    def record_launch(self, kernel, griddim, blockdim, args, sharedmem=0, stream=0) -> None:
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(f"record: kernel {kernel_name(kernel)} argument {i} "
                                "is a host NumPy array: Numba would copy it at every eager launch, "
                                "which a graph cannot record; pass a device array")
        self._append(KernelLaunch(tuple(args), kernel, _dim3(griddim), _dim3(blockdim),
                                  int(sharedmem)), stream)

    def record_copy(self, dst, src, stream=0) -> None:
        self._append(Copy((dst, src)), stream)

    def record_conditional(self, flag, body: "GraphDescription", loop: bool) -> None:
        self._append(Conditional((flag,), body, loop), 0)

    def record_event(self, event, stream=0) -> None:
        self._events[id(event)] = (event, self._waits.get(_stream_key(stream), ()))

    def wait_event(self, event, stream=0) -> None:
        if id(event) not in self._events:
            raise ValueError("wait_event: the event was not recorded earlier in this graph; a "
                             "graph can only wait for work inside it")
        key = _stream_key(stream)
        self._waits[key] = tuple(set(self._waits.get(key, ())) | set(self._events[id(event)][1]))

    def description(self) -> "GraphDescription":
        return GraphDescription(list(self.nodes), list(self.deps))


_recorders: list[Recorder] = []


@contextlib.contextmanager
def record():
    """Inside the block, launches, `copy` calls and events are recorded, not run. Yields the
    Recorder; ``recorder.description()`` afterwards."""
    recorder = Recorder()
    _recorders.append(recorder)
    try:
        with backend.recording(recorder):
            yield recorder
    finally:
        _recorders.pop()


def recording() -> bool:
    """True inside `record()`: code that would do eager work (host math) must refuse."""
    return bool(_recorders)


def record_conditional(flag, body: Callable[[], None], *, loop: bool) -> None:
    """While recording: record `body()` into a description of its own and append one
    Conditional node (IF, or WHILE when `loop`) on `flag`. proto.control is the front end."""
    with record() as inner:
        body()
    if not inner.nodes:
        raise ValueError(f"{'while_loop' if loop else 'if_then'}: the body launched no kernels "
                         "and made no copies")
    _recorders[-1].record_conditional(flag, inner.description(), loop)


def require_eager(what: str) -> None:
    """Raise inside `record()`: `what` computes on the host, so it would run once, now, and
    never at a replay; the graph would silently skip it."""
    if _recorders:
        raise RuntimeError(f"record: {what} computes on the host and cannot be recorded into a "
                           "graph; use device kernels")


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
    if _recorders:
        _recorders[-1].record_copy(dst, src, stream)
    else:
        device_copy(dst, src, stream)


def record_event(event, stream=0) -> None:
    """``event.record(stream)``, or while recording: later waits on `event` wait for the
    nodes recorded on `stream` so far."""
    if _recorders:
        _recorders[-1].record_event(event, stream)
    else:
        event.record(stream)


def wait_event(event, stream=0) -> None:
    """``event.wait(stream)``, or while recording: the next node on `stream` waits for what
    `event` captured."""
    if _recorders:
        _recorders[-1].wait_event(event, stream)
    else:
        event.wait(stream)


# ------------------------------------------------------------------------- capture
class Phase(enum.Enum):
    WARMUP = "warm-up"
    RECORD = "record"
    REPLAY = "replay"
    CLOSED = "closed"


class GraphedFunction:
    """`fn(**inputs)` as a graph: call it to step through warm-up, record, replay.

    `placeholders` maps input name -> the device array recorded into the graph; `binding` is
    one of proto.binding.MODES; `executor` "cuda" (default on a GPU) or "walk" (the
    simulator's). `fn` takes the inputs as keyword arguments and launches through
    proto.backend.launch / proto.graph.copy; what it returns becomes `outputs`.
    """

    def __init__(self, fn: Callable, placeholders: dict, *, binding: str = "copy",
                 executor: str | None = None, warmup: int = 1):
        if binding not in MODES:
            raise ValueError(f"binding: expected one of {MODES}, got {binding!r}")
        executor = executor or default_executor()
        if executor not in EXECUTORS:
            raise ValueError(f"executor: expected one of {sorted(EXECUTORS)}, got {executor!r}")
        check_inputs(placeholders, placeholders, where="placeholders")
        check_disjoint(placeholders)
        self.fn, self.placeholders = fn, dict(placeholders)
        self.binding, self.executor = binding, executor
        self.phase = Phase.WARMUP if warmup > 0 else Phase.RECORD
        self._warmups_left = warmup
        self.description: GraphDescription | None = None
        self.outputs = None
        self.stats = ReplayStats()  # accumulated over replays
        self.slots = []  # patch binding: which (node, argument) reads which input
        self._executable = self._binder = None

    def __call__(self, **inputs) -> ReplayStats:
        if self.phase is Phase.WARMUP:
            # WARM-UP: eager run; kernels load and first-call allocations happen outside the graph.
            check_inputs(self.placeholders, inputs, where="warm-up")
            self.fn(**inputs)
            backend.synchronize()
            self._warmups_left -= 1
            if self._warmups_left == 0:
                self.phase = Phase.RECORD
            return ReplayStats()
        if self.phase is Phase.RECORD:
            # RECORD: launches become nodes on the placeholders; nothing runs until the replay below.
            self._record()
            self.phase = Phase.REPLAY
        # REPLAY (also right after recording, which ran nothing)
        return self.replay(**inputs)

    def _record(self) -> None:
        with record() as recorder:
            self.outputs = self.fn(**self.placeholders)
        if not recorder.nodes:
            raise ValueError("record: the function launched no kernels and made no copies")
        self.description = recorder.description()
        if self.binding == "patch" and self.description.has_conditionals:
            raise ValueError("binding 'patch' rewrites top-level nodes only, and a conditional "
                             "body may read the inputs too; use 'copy' or 'alias'")
        if self.binding == "patch":
            self.slots = input_slots([[(i, *extent(a)) for i, a in node.array_args()]
                                 for node in self.description.nodes],
                                     {name: extent(a) for name, a in self.placeholders.items()})
        self._executable = EXECUTORS[self.executor](self.description.nodes, self.description.deps)
        self._binder = Binder(self.binding, self.placeholders, self.slots, self._executable)

    def replay(self, **inputs) -> ReplayStats:
        """Check, bind, launch; returns this replay's stats (also added to `self.stats`)."""
        if self.phase is not Phase.REPLAY:
            raise RuntimeError(f"replay: the graph is in phase {self.phase.value!r}; "
                               "capture() (or calling it until recorded) comes first")
        t0 = time.perf_counter()
        check_inputs(self.placeholders, inputs)
        moved = self._binder.bind(inputs)
        bind_s = time.perf_counter() - t0
        self._executable.launch()
        stats = ReplayStats(1, moved, bind_s)
        self.stats += stats
        return stats

    @property
    def memory_bytes(self) -> int | None:
        """Device memory the executable graph took at instantiation (None: unmeasurable)."""
        return None if self._executable is None else self._executable.memory_bytes

    def close(self) -> None:
        """Destroy the executable and drop every buffer reference the graph holds."""
        if self._executable is not None:
            backend.synchronize()  # a replay in flight must finish before its graph goes
            self._executable.close()
        self._executable = self._binder = self.description = self.outputs = None
        self.placeholders, self.slots, self.fn = {}, [], None
        self.phase = Phase.CLOSED

    def __enter__(self) -> "GraphedFunction":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def capture(fn: Callable, inputs: dict, *, binding: str = "copy", executor: str | None = None,
            warmup: int = 1) -> GraphedFunction:
    """Warm up `fn` on `inputs`, record it with `inputs` as placeholders, instantiate.

    Returns a GraphedFunction ready to `replay(**inputs)`; its stats start at zero.
    """
    graphed = GraphedFunction(fn, inputs, binding=binding, executor=executor, warmup=warmup)
    try:
        for _ in range(warmup + 1):
            graphed(**inputs)
    except BaseException:
        graphed.close()
        raise
    graphed.stats = ReplayStats()
    return graphed
