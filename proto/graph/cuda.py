"""The CUDA executor: a description lowered to a real CUDA graph (cuda.core).

It uses cuda.core's explicit graph-definition API (``GraphDefinition``: one node per
description node, with the edges the description recorded: a chain for work done on one
stream, a DAG whose branches overlap for work spread over streams and events), then
instantiates it. Instantiation is where the driver does the expensive work once: it checks
every node, copies each kernel's parameter block into its own memory and builds launch
descriptors, so that a replay is a single ``cuGraphLaunch`` however many kernels it holds.
Keeping each definition node's handle is what makes patching cheap: ``graph[node].update(...)``
rewrites one node's parameters inside the instantiated graph (cuGraphExecKernelNodeSetParams)
without instantiating again.

Executables cost device memory (the driver's copy of every node's parameters and launch
descriptors, a few KiB a kernel node, reserved in 2 MiB chunks). Graphs of one topology (the
per-length decode graphs of a model differ only in pointers) can share executables:
`SharedExecutables` keeps at most K of them and retargets one to another graph's definition
with ``cuGraphExecUpdate`` (cuda.core's ``Graph.update``) when that graph is launched: the
definitions stay on the host, the device holds K executables. An update takes effect at the
next launch and leaves launches in flight alone, so the host may retarget while the GPU runs.

Conditional nodes lower to CUDA's IF/WHILE nodes: the condition is a handle the driver owns,
so a one-thread kernel copies the device flag into it before the node and, for WHILE, again
after the last node of each pass of the body (the body is lowered into the node's own graph
the same way). That WHILE kernel also counts passes and stops the loop at its bound, setting a
device flag the host reads after the replay (`finish`). A driver without conditional nodes
(before CUDA 12.4) gets predication instead (proto.graph.predicate), with a warning;
`HostDrivenExecutor` (CUDA graphs for the stretches between conditional nodes, the host
reading each flag) is the third way, kept to compare.

A kernel node holds the kernel's flat parameters (proto.device.launcher.flatten: Numba's flattening
of each array into 5 + 2*ndim parameters) and where each array's ``data`` pointer sits in
them: that position is the slot patch binding rewrites.
"""
from __future__ import annotations

import collections
import contextlib
import os
import time
import warnings
from typing import NamedTuple

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import address, cuda
from proto.graph.ir import Conditional, Copy, Description, KernelLaunch
from proto.graph.predicate import PredicatedExecutor, reset_passes_kernel
from proto.graph.record import LoopBoundError
from proto.graph.walk import run_conditional
from proto.device.launcher import flatten as flatten_args


class _KernelParams(NamedTuple):
    config: object
    kernel: object  # cuda.core Kernel
    flat: list  # Numba's flattened parameters, rewritten in place by patch
    data_slots: dict  # argument index -> position of its data pointer in `flat`


def free_device_memory() -> int:
    return cuda.current_context().get_memory_info()[0]


def topology(description: Description) -> tuple:
    """What must match for one executable to be updated into another graph: node kinds and
    kernels, copy directions, and the edges (cuGraphExecUpdate's rules, kept strict)."""
    key = []
    for node, deps in zip(description.nodes, description.deps):
        key.append(("kernel", id(node.kernel), deps) if isinstance(node, KernelLaunch)
                   else ("copy", node.direction, deps))   # (conditionals are never shared)
    return tuple(key)


class _Lowered:
    """A description as a cuda.core GraphDefinition, with every node's handle and parameters
    and the pass counters of its WHILE nodes."""

    def __init__(self, description: Description):
        from cuda.core.graph import GraphDefinition
        cuda.current_context()  # Numba's primary context is the one cuda.core launches into
        self.definition = GraphDefinition()
        # The graph bakes the addresses of the description's arrays: it holds them, so none
        # is freed while the graph can still write it (predication's scope flags, say, are
        # referenced by nothing else).
        self.description = description
        # Every WHILE's pass counter starts each replay at zero, before anything else runs: a
        # loop inside an IF that does not run this time must not report last replay's count.
        self.loops = _loops(description)
        root = None
        for node in self.loops:
            root = (root or self.definition).launch(*_counter_reset(node.passes))
        self.handles, self.params = self._lower(self.definition, description, root)

    def _lower(self, target, description: Description, root=None) -> tuple[list, list]:
        """Add the description's nodes to `target` (the whole graph, or a conditional node's
        body), its roots after `root` if given; returns their node handles and parameters."""
        from cuda.core import LaunchConfig
        handles, all_params = [], []
        for node, waits in zip(description.nodes, description.deps):
            # A node is added from its first dependency (or the graph: a root); the other
            # dependencies become extra edges into its first graph node.
            parents = [handles[d] for d in waits]
            start = parents[0] if parents else (root or target)
            if isinstance(node, KernelLaunch):
                cukernel, flat, data_slots = flatten_args(node.kernel, node.args)
                config = LaunchConfig(grid=node.griddim, block=node.blockdim,
                                      shmem_size=node.sharedmem)
                if _launches_early(node, waits, description):
                    # a node of no dependencies, then one programmatic edge from its parent
                    first = handle = target.launch(config, cukernel, *flat)
                    _programmatic_edge(target, parents[0], handle)
                else:
                    first = handle = start.launch(config, cukernel, *flat)
                params = _KernelParams(config, cukernel, flat, data_slots)
            elif isinstance(node, Copy):  # device or pinned host addresses; the driver tells which
                dst, src = node.args
                params = [address(dst), address(src), dst.nbytes]
                first = handle = start.memcpy(*params)
            elif isinstance(node, Conditional):
                first, handle = self._lower_conditional(start, node)
                params = None   # bodies are not patched (capture refuses patch binding)
            else:
                raise NotImplementedError(f"CUDA executor: no lowering for {type(node).__name__}")
            for parent in parents[1:]:
                first.pred.add(parent)
            handles.append(handle)
            all_params.append(params)
        return handles, all_params

    def _lower_conditional(self, start, node: Conditional):
        """set-condition kernel -> IF/WHILE node; a WHILE body ends by setting it again.
        Returns (first graph node, the node successors wait for)."""
        flag = node.args[0]
        # Every handle belongs to the whole graph (allowed for a node at any depth), so a
        # nested IF or WHILE does not own one in the body that holds it.
        condition = self.definition.create_condition(default_value=0)
        handle = int(condition.handle)
        if node.loop:
            setter = start.launch(*_condition_launch("start", flag, node.passes, 0, handle))
            cond_node = setter.while_loop(condition)
            body = cond_node.body
        else:
            setter = start.launch(*_condition_launch("if", flag, None, 0, handle))
            cond_node = setter.if_then(condition)
            body = cond_node.then
        handles, _ = self._lower(body, node.body)
        if node.loop:   # after every node of the pass: the sinks of the body's DAG
            waited = {d for deps in node.body.deps for d in deps}
            sinks = [h for j, h in enumerate(handles) if j not in waited]
            tail = sinks[0] if len(sinks) == 1 else body.join(*sinks)
            tail.launch(*_condition_launch("continue", flag, node.passes, node.max_passes, handle))
        return setter, cond_node

    def close(self) -> None:
        # ... and lets the description's arrays go: closing a graph frees its buffers
        self.definition, self.description, self.handles, self.params = None, None, [], []


_early_launch_held_off = 0   # how many early_launch_off() scopes are open


def early_launch_switched_on() -> bool:
    """Programmatic dependent launch (kernels/_pdl.py) for the kernels that opted in: on
    unless PROTO_EARLY_LAUNCH=off or inside `early_launch_off()` (H200, GPT-2 small: the
    step 585 against 629 us, the WHILE graph's token 0.650 against 0.703 ms)."""
    value = os.environ.get("PROTO_EARLY_LAUNCH", "on")
    if value not in ("on", "off"):
        raise ValueError(f"PROTO_EARLY_LAUNCH: expected 'on' or 'off', got {value!r}")
    return value == "on" and not _early_launch_held_off


@contextlib.contextmanager
def early_launch_off():
    """Graphs lowered inside get plain edges only, whatever PROTO_EARLY_LAUNCH says: under
    early launch a kernel's profiled span starts while its predecessor runs and holds its
    wait, so a profile that wants each kernel's own time profiles such a graph."""
    global _early_launch_held_off
    _early_launch_held_off += 1
    try:
        yield
    finally:
        _early_launch_held_off -= 1


def _launches_early(node: KernelLaunch, waits, description: Description) -> bool:
    """A kernel that opted in to early launch, whose one dependency is a kernel: its edge can
    be programmatic (after a copy or a conditional node the plain edge stays)."""
    return (early_launch_switched_on() and getattr(node.kernel, "early_launch", False)
            and len(waits) == 1 and isinstance(description.nodes[waits[0]], KernelLaunch))


def _programmatic_edge(graph, parent, child) -> None:
    """parent -> child as a programmatic edge: child may launch once every block of parent
    has called launch_dependents (or exited); child's griddepcontrol.wait then waits for
    parent's completion (CUDA 12.3's edge data)."""
    from cuda.bindings import driver
    edge = driver.CUgraphEdgeData()
    edge.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    edge.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    add = getattr(driver, "cuGraphAddDependencies_v2", driver.cuGraphAddDependencies)
    err, = add(graph.handle, [parent.handle], [child.handle], [edge], 1)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphAddDependencies (programmatic edge): {err!r}")


def _loops(description: Description) -> list[Conditional]:
    """Every WHILE node of the description, at any depth."""
    out = []
    for node in description.nodes:
        if isinstance(node, Conditional):
            out += ([node] if node.loop else []) + _loops(node.body)
    return out


def _counter_reset(passes) -> tuple:
    """(config, kernel, *args) of the one-thread kernel that zeroes a WHILE's pass counter."""
    from cuda.core import LaunchConfig
    cukernel, flat, _ = flatten_args(reset_passes_kernel, (passes,))
    return (LaunchConfig(grid=1, block=1), cukernel, *flat)


def check_loops(loops) -> None:
    """Raise LoopBoundError if a WHILE of the last replay stopped at its bound (waits)."""
    for node in loops:
        made, hit = node.passes.copy_to_host()
        if hit:
            raise LoopBoundError(f"while_loop: the flag was still set after max_passes="
                                 f"{node.max_passes} passes; the loop stopped there and the "
                                 "results are incomplete")


def _instantiate(definition, stream) -> tuple[object, int]:
    """(executable, device bytes it took: the drop in free memory, in 2 MiB steps). The drop
    is device-wide, so another process that frees memory meanwhile makes it negative: it is
    kept as read (`_reading` refuses to report it), never clamped into a plausible 0."""
    free_before = free_device_memory()
    executable = definition.instantiate()
    executable.upload(stream)  # allocate the executable's resources now, not at replay 1
    stream.sync()
    return executable, free_before - free_device_memory()


def _reading(nbytes: int, what: str) -> int:
    """Driver memory as `_instantiate` read it, or RuntimeError where the reading is negative:
    free memory rose while the executable was made, so something else freed memory on the
    device and the reading says nothing about the graph."""
    if nbytes < 0:
        raise RuntimeError(f"{what}: free device memory rose by {-nbytes} bytes while the "
                           "executable was made (another process or thread freed memory); "
                           "measure graph memory in a process of its own "
                           "(experiments.isolate)")
    return nbytes


class CudaExecutor:
    """The description lowered to a CUDA graph: its own executable, or (with `shared`) one of
    a SharedExecutables pool's, retargeted to it when it is launched."""

    def __init__(self, description: Description, shared: "SharedExecutables | None" = None):
        from cuda.core import LEGACY_DEFAULT_STREAM
        if backend.SIMULATOR:
            raise RuntimeError("the CUDA executor needs a GPU; use the walk executor on the simulator")
        self._stream = LEGACY_DEFAULT_STREAM  # the stream Numba launches and copies use
        self._lowered = _Lowered(description)
        self._shared = shared
        self._drop = 0
        self._graph = None
        if shared is None:
            self._graph, self._drop = _instantiate(self._lowered.definition, self._stream)
        else:
            if description.has_conditionals:
                raise ValueError("shared executables: graphs with conditional nodes cannot be "
                                 "retargeted with executable update; give them their own")
            self.topology = topology(description)
        self.closed = False

    @property
    def memory_bytes(self) -> int:
        """Device memory this graph's own executable took (0 with a shared pool: the pool
        counts it)."""
        return _reading(self._drop, "memory_bytes")

    def launch(self) -> None:
        if self.closed:
            raise RuntimeError("launch: the graph is closed")
        graph = self._graph if self._shared is None else self._shared.acquire(self)
        graph.launch(self._stream)

    def prepare(self) -> None:
        """Make a shared executable hold this graph now (an update, if it held another), so
        that the next `launch` finds it ready: the host retargets while the GPU still runs
        what was launched before (an update leaves launches in flight alone)."""
        if self._shared is not None and not self.closed:
            self._shared.acquire(self)

    def finish(self) -> None:
        """After a replay: raise if one of its WHILE loops stopped at its bound (waits for
        the GPU; a no-op without loops)."""
        if self._lowered.loops:
            check_loops(self._lowered.loops)

    def set_array_args(self, j: int, args: dict) -> None:
        if self._shared is not None:
            raise ValueError("patch binding rewrites one executable; shared executables are "
                             "retargeted with executable update instead (use copy or alias)")
        handle, params = self._lowered.handles[j], self._lowered.params[j]
        if isinstance(params, _KernelParams):  # rewrite data pointers in the flat parameters
            for i, (base, offset) in args.items():
                params.flat[params.data_slots[i]] = address(base) + offset
            self._graph[handle].update(config=params.config, kernel=params.kernel,
                                       args=params.flat)
        else:  # copy node: [dst address, src address, size]
            for i, (base, offset) in args.items():
                params[i] = address(base) + offset
            dst, src, size = params
            self._graph[handle].update(dst=dst, src=src, size=size)

    def close(self) -> None:
        if self._graph is not None:
            self._graph.close()
        if self._shared is not None:
            self._shared.forget(self)
        self._graph = None
        self._lowered.close()
        self.closed = True


class SharedExecutables:
    """At most `capacity` executables shared by graphs of one topology; an LRU, retargeted
    with executable update on a miss. `capacity` 1: one executable for every length."""

    def __init__(self, capacity: int = 1):
        self.capacity = _check.positive("capacity", capacity)
        self._slots: collections.OrderedDict = collections.OrderedDict()  # executable -> holder
        self.instantiations = self.updates = self.update_failures = 0
        self.update_s = 0.0
        self._drop = 0

    def acquire(self, executor: CudaExecutor):
        """The executable to launch for `executor`, retargeted to it if it holds another graph."""
        for graph, (holder, top) in self._slots.items():
            if holder is executor:
                self._slots.move_to_end(graph)
                return graph
        victim = next((g for g, (_, top) in self._slots.items() if top == executor.topology), None)
        if victim is not None and len(self._slots) >= self.capacity:
            t0 = time.perf_counter()
            try:
                victim.update(executor._lowered.definition)
            except Exception:   # the driver refused this retarget: instantiate instead
                self.update_failures += 1
            else:
                self.update_s += time.perf_counter() - t0
                self.updates += 1
                self._slots[victim] = (executor, executor.topology)
                self._slots.move_to_end(victim)
                return victim
        if len(self._slots) >= self.capacity:   # full of other topologies: drop the oldest
            oldest, _ = self._slots.popitem(last=False)
            backend.synchronize()
            oldest.close()
        graph, nbytes = _instantiate(executor._lowered.definition, executor._stream)
        self.instantiations += 1
        self._drop += nbytes
        self._slots[graph] = (executor, executor.topology)
        return graph

    def forget(self, executor: CudaExecutor) -> None:
        """`executor` closes: an executable holding it stays, holding nothing."""
        for graph, (holder, top) in list(self._slots.items()):
            if holder is executor:
                self._slots[graph] = (None, top)

    @property
    def memory_bytes(self) -> int:
        """Device memory the pool's executables took when they were made."""
        return _reading(self._drop, "SharedExecutables.memory_bytes")

    @property
    def update_us_per_switch(self) -> float:
        return 1e6 * self.update_s / max(self.updates, 1)

    def close(self) -> None:
        backend.synchronize()
        for graph in self._slots:
            graph.close()
        self._slots.clear()


class HostDrivenExecutor:
    """Conditional nodes on a driver without them: CUDA graphs for the stretches between
    conditional nodes, the host reading each flag in between (as the eager loop would)."""

    memory_bytes = None

    def __init__(self, description: Description):
        nodes, deps = list(description.nodes), description.deps
        self._parts, start = [], 0
        # Parts run one after another on one stream, so a dependency on an earlier part
        # holds already; within a part the indices shift to the part's start.
        for j, node in enumerate(nodes + [None]):
            if node is not None and not isinstance(node, Conditional):
                continue
            if j > start:
                self._parts.append(CudaExecutor(Description(
                    nodes[start:j], [tuple(d - start for d in deps[i] if d >= start)
                                     for i in range(start, j)])))
            if node is not None:
                self._parts.append((node, make_cuda_executor(node.body)))
            start = j + 1
        self.closed = False

    def launch(self) -> None:
        for part in self._parts:
            if isinstance(part, tuple):
                run_conditional(*part)
            else:
                part.launch()

    def prepare(self) -> None:
        """Nothing to get ready ahead: every part owns its executable."""

    def finish(self) -> None:
        """Loops past their bound raised during `launch` (a body's own loops are checked
        after each pass that ran it: run_conditional)."""

    def set_array_args(self, j: int, args: dict) -> None:
        raise NotImplementedError("patch binding needs one graph; conditional nodes without "
                                  "driver support split it")

    def close(self) -> None:
        for part in self._parts or []:
            (part[1] if isinstance(part, tuple) else part).close()
        self._parts, self.closed = None, True


def conditional_nodes_supported() -> bool:
    """Conditional graph nodes (IF, WHILE) need a CUDA 12.4 driver or newer."""
    from cuda.bindings import driver
    err, version = driver.cuDriverGetVersion()
    return int(err) == 0 and version >= 12040


def conditional_nodes_switched_off() -> bool:
    """PROTO_CONDITIONAL_NODES=off: IF/WHILE run by predication even where the driver has
    conditional nodes. The sanitizer lane sets it: compute-sanitizer 2025.3 stops WHILE bodies
    of a few trivial kernels with an illegal address it attributes to nothing (memcheck,
    initcheck) and racecheck crashes on block-wide kernels in an IF nested in a WHILE
    (tests/conditional_repro.py), so under the tools the same kernels and graph logic run in
    plain graphs."""
    value = os.environ.get("PROTO_CONDITIONAL_NODES", "on")
    if value not in ("on", "off"):
        raise ValueError(f"PROTO_CONDITIONAL_NODES: expected 'on' or 'off', got {value!r}")
    return value == "off"


def make_cuda_executor(description: Description, shared: SharedExecutables | None = None,
                       unroll: int = 16):
    """The CUDA executor, or, for conditional nodes on a driver without them (or switched
    off), predication (proto.graph.predicate, with a warning: a WHILE then waits for the host
    every `unroll` passes)."""
    if description.has_conditionals:
        why = ("PROTO_CONDITIONAL_NODES=off" if conditional_nodes_switched_off() else
               None if conditional_nodes_supported() else
               "this CUDA driver has no conditional graph nodes (CUDA 12.4+)")
        if why:
            warnings.warn(f"{why}: IF/WHILE run by predication, the host relaunching a WHILE "
                          f"every {unroll} passes", RuntimeWarning, stacklevel=3)
            return PredicatedExecutor(description, CudaExecutor, unroll)
    return CudaExecutor(description, shared)


# ------------------------------------------------------------------------- condition kernels
_SET_CONDITION_SRC = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __device__ void proto_set_conditional(unsigned long long handle, unsigned int value) {
    cudaGraphSetConditional(handle, value);
}
"""
_set_conditional = None   # the declared CUDA C device function, made on first use


def _declare_set_conditional() -> None:
    global _set_conditional
    if _set_conditional is None:
        _set_conditional = cuda.declare_device("proto_set_conditional", "void(uint64, uint32)",
                                               abi="c", link=[cuda.CUSource(_SET_CONDITION_SRC)])


def set_if(flag, handle):
    """IF: handle := flag[0] != 0."""
    if cuda.grid(1) == 0:
        _set_conditional(handle, np.uint32(1 if flag[0] != 0 else 0))


def start_loop(flag, passes, handle):
    """Before a WHILE: passes := (0, 0); handle := flag[0] != 0."""
    if cuda.grid(1) == 0:
        passes[0] = 0
        passes[1] = 0
        _set_conditional(handle, np.uint32(1 if flag[0] != 0 else 0))


def continue_loop(flag, passes, max_passes, handle):
    """After each pass: passes[0] += 1; once it reaches the bound with the flag still set,
    passes[1] := 1 and the handle 0 (the loop stops there)."""
    if cuda.grid(1) == 0:
        made = passes[0] + 1
        passes[0] = made
        go = flag[0] != 0
        if go and made >= max_passes:
            passes[1] = 1
            go = False
        _set_conditional(handle, np.uint32(1 if go else 0))


CONDITION_KERNELS = {"if": (set_if, "void(int32[::1], uint64)"),
                     "start": (start_loop, "void(int32[::1], int32[::1], uint64)"),
                     "continue": (continue_loop, "void(int32[::1], int32[::1], int32, uint64)")}
_condition_kernels: dict = {}


def condition_kernels() -> dict:
    """The one-thread kernels that set a conditional node's handle from a device flag
    (CONDITION_KERNELS). ``cudaGraphSetConditional`` is a device-runtime builtin Numba cannot
    call directly, so a few lines of CUDA C wrap it (declare_device). Built on first use:
    GPU only."""
    if not _condition_kernels:
        _declare_set_conditional()
        _condition_kernels.update({name: cuda.jit(sig)(fn)
                                   for name, (fn, sig) in CONDITION_KERNELS.items()})
    return _condition_kernels


def compile_check(cc=(9, 0)) -> list[str]:
    """Compile the condition kernels and their CUDA C for compute capability `cc` with no
    GPU (`PROTO_BACKEND=ptx python -m proto.graph.compile_check`, beside kernels.compile_check);
    returns one line per failure."""
    from cuda.bindings import nvrtc
    failures = []
    _declare_set_conditional()
    for name, (fn, sig) in CONDITION_KERNELS.items():
        try:
            cuda.compile_ptx(fn, sig, cc=cc)
        except Exception as exc:   # report every failure, not just the first
            failures.append(f"proto.graph.cuda.{fn.__name__}{sig}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0]}")
    err, prog = nvrtc.nvrtcCreateProgram(_SET_CONDITION_SRC.encode(), b"set_conditional.cu", 0,
                                         [], [])
    options = [f"-arch=compute_{cc[0]}{cc[1]}".encode(), b"-rdc=true"]
    err, = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        failures.append(f"proto.graph.cuda set_conditional.cu: {log.decode(errors='replace').strip()}")
    nvrtc.nvrtcDestroyProgram(prog)
    return failures


def _condition_launch(which: str, flag, passes, max_passes: int, handle: int) -> tuple:
    """(config, kernel, *args) of one condition kernel."""
    from cuda.core import LaunchConfig
    args = {"if": (flag, handle), "start": (flag, passes, handle),
            "continue": (flag, passes, np.int32(max_passes), handle)}[which]
    cukernel, flat, _ = flatten_args(condition_kernels()[which], args)
    return (LaunchConfig(grid=1, block=1), cukernel, *flat)

