"""Executors: run a graph description (proto.graph) again and again.

Both take the description's nodes and dependencies (GraphDescription.nodes, .deps) and
offer the same four things:
  ``launch()``                    run every node once, on the default stream;
  ``set_array_args(j, {i: (base, offset)})``
                                  from now on node j's argument i is the array that starts
                                  `offset` bytes into `base` (patch binding's one primitive);
  ``memory_bytes``                device memory the executable took (None where unmeasurable);
  ``close()``                     release it now, not whenever the garbage collector runs.

`CudaExecutor` lowers the description to a real CUDA graph. It uses cuda.core's explicit
graph-definition API (``GraphDefinition``: one node per description node, with the edges the
description recorded: a chain for work done on one stream, a DAG whose branches overlap for
work spread over streams and events), then instantiates it. Instantiation is where the
driver does the expensive work once: it checks every node, copies each kernel's parameter
block into its own memory and builds launch descriptors, so that a replay is a single
``cuGraphLaunch`` however many kernels it holds. Keeping each definition node's handle is
what makes patching cheap: ``graph[node].update(...)`` rewrites one node's parameters inside
the instantiated graph (cuGraphExecKernelNodeSetParams) without instantiating again.

Conditional nodes (proto.control) lower to CUDA's IF/WHILE nodes: the condition is a handle
the driver owns, so a one-thread kernel copies the device flag into it before the node and,
for WHILE, again after the last node of each pass of the body (the body is lowered into the
node's own graph the same way). A driver without conditional nodes (before CUDA 12.4) gets
`HostDrivenExecutor` instead, with a warning: CUDA graphs for the stretches between
conditional nodes, the host reading each flag.

A kernel's parameters are not its Python arguments. Numba flattens each array argument into
``meminfo, parent, nitems, itemsize, data, shape..., strides...`` (5 + 2*ndim parameters) and
each scalar into one typed value; the compiled kernel (``dispatcher.overloads[sig]``) does the
flattening in ``_prepare_args``. We keep that flat list per node and remember where each
array's ``data`` pointer sits in it: that position is the slot patch binding rewrites.

`WalkExecutor` walks the nodes in recording order (every dependency points backwards, so
that order respects them all) and launches each kernel through Numba as an ordinary eager
launch; at a conditional node it reads the flag from device memory. It is the executor on the
simulator (which has no graphs), and on a GPU the reference the CUDA executor is tested
against. Its patch swaps the argument array itself.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from proto import backend
from proto.backend import cuda, is_device_array
from proto.binding import address, device_copy, view_at

# Numba's flattened array argument: meminfo, parent, nitems, itemsize, then the data pointer.
_DATA_SLOT = 4


class WalkExecutor:
    """Launch the description node by node (simulator, or an eager reference on a GPU)."""

    memory_bytes = None

    def __init__(self, nodes, deps=None):
        self._nodes = list(nodes)
        self._args = [list(node.args) for node in self._nodes]  # what patch rewrites
        self._bodies = {j: WalkExecutor(node.body.nodes) for j, node in enumerate(self._nodes)
                        if node.kind == "conditional"}
        self.closed = False

    def launch(self) -> None:
        for j, (node, args) in enumerate(zip(self._nodes, self._args)):
            if node.kind == "kernel":
                node.kernel[node.griddim, node.blockdim, 0, node.sharedmem](*args)
            elif node.kind == "copy":
                device_copy(*args)
            elif node.kind == "conditional":  # the flag is read where the GPU would test it
                run_conditional(node, self._bodies[j])
            else:
                raise NotImplementedError(f"walk executor: no rule for {node.kind!r} nodes")

    def set_array_args(self, j: int, args: dict) -> None:
        for i, (base, offset) in args.items():
            self._args[j][i] = view_at(base, offset, self._args[j][i])

    def close(self) -> None:
        self._nodes, self._args, self.closed = [], [], True


def run_conditional(node, body) -> None:
    """An IF / WHILE node driven from the host: read the flag, launch the body's executor."""
    flag = node.args[0]
    if node.loop:
        while bool(flag.copy_to_host()[0]):
            body.launch()
    elif bool(flag.copy_to_host()[0]):
        body.launch()


def _compiled(kernel):
    """The one compiled overload of an eager-signature kernel (proto.backend.jit)."""
    overloads = list(kernel.overloads.values())
    if len(overloads) != 1:
        raise TypeError(f"kernel {kernel.py_func.__name__}: graphs need exactly one eager "
                        f"signature (proto.backend.jit), found {len(overloads)}")
    return overloads[0]


def flatten_args(kernel, args) -> tuple[object, list, dict]:
    """(cuda.core Kernel, flat parameter list, {argument index: position of its data pointer})."""
    compiled = _compiled(kernel)
    types = compiled.argument_types
    name = kernel.py_func.__name__
    if len(args) != len(types):
        raise TypeError(f"kernel {name}: expected {len(types)} arguments, got {len(args)}")
    flat, data_slots = [], {}
    for i, (ty, value) in enumerate(zip(types, args)):
        if is_device_array(value):
            want = (str(ty.dtype), ty.ndim)
            got = (str(np.dtype(value.dtype)), value.ndim)
            if want != got or (ty.layout == "C" and not value.is_c_contiguous()):
                raise TypeError(f"kernel {name} argument {i}: expected {ty}, got {got[0]} "
                                f"{got[1]}-d array with strides {tuple(value.strides)}")
            data_slots[i] = len(flat) + _DATA_SLOT
        compiled._prepare_args(ty, value, 0, [], flat)
    return compiled._codelibrary.get_cufunc().kernel, flat, data_slots


class _KernelParams(NamedTuple):
    config: object
    kernel: object  # cuda.core Kernel
    flat: list  # Numba's flattened parameters, rewritten in place by patch
    data_slots: dict  # argument index -> position of its data pointer in `flat`


def _free_device_memory() -> int:
    return cuda.current_context().get_memory_info()[0]


class CudaExecutor:
    """The description lowered to one instantiated CUDA graph (cuda.core)."""

    def __init__(self, nodes, deps):
        from cuda.core import LEGACY_DEFAULT_STREAM
        from cuda.core.graph import GraphDefinition

        if backend.SIMULATOR:
            raise RuntimeError("the CUDA executor needs a GPU; use the walk executor on the simulator")
        cuda.current_context()  # Numba's primary context is the one cuda.core launches into
        self._stream = LEGACY_DEFAULT_STREAM  # the stream Numba launches and copies use
        self._definition = GraphDefinition()
        self._handles, self._params = self._lower(self._definition, nodes, deps)
        free_before = _free_device_memory()
        self._graph = self._definition.instantiate()
        self._graph.upload(self._stream)  # allocate the executable's resources now, not at replay 1
        self._stream.sync()
        # The driver reserves memory in 2 MiB chunks: one graph measures 0, 2 or 4 MiB, but
        # summed over many graphs it matches the total (H200: 300 graphs, 45150 kernel nodes,
        # 134 MiB, about 3 KiB a node).
        self.memory_bytes = max(free_before - _free_device_memory(), 0)

    def _lower(self, target, nodes, deps) -> tuple[list, list]:
        """Add `nodes` to the graph definition `target` (the whole graph, or a conditional
        node's body); returns their node handles and parameters."""
        from cuda.core import LaunchConfig
        handles, all_params = [], []
        for node, waits in zip(nodes, deps):
            # A node is added from its first dependency (or the graph: a root); the other
            # dependencies become extra edges into its first graph node.
            parents = [handles[d] for d in waits]
            start = parents[0] if parents else target
            if node.kind == "kernel":
                cukernel, flat, data_slots = flatten_args(node.kernel, node.args)
                config = LaunchConfig(grid=node.griddim, block=node.blockdim,
                                      shmem_size=node.sharedmem)
                first = handle = start.launch(config, cukernel, *flat)
                params = _KernelParams(config, cukernel, flat, data_slots)
            elif node.kind == "copy":  # device or pinned host addresses; the driver tells which
                dst, src = node.args
                params = [address(dst), address(src), dst.nbytes]
                first = handle = start.memcpy(*params)
            elif node.kind == "conditional":
                first, handle = self._lower_conditional(target, start, node)
                params = None   # bodies are not patched (GraphedFunction refuses patch binding)
            else:
                raise NotImplementedError(f"CUDA executor: no lowering for {node.kind!r} nodes")
            for parent in parents[1:]:
                first.pred.add(parent)
            handles.append(handle)
            all_params.append(params)
        return handles, all_params

    def _lower_conditional(self, target, start, node):
        """set-condition kernel -> IF/WHILE node; a WHILE body ends by setting it again.
        Returns (first graph node, the node successors wait for)."""
        flag = node.args[0]
        condition = target.create_condition(default_value=0)
        setter = start.launch(*self._set_condition(flag, condition))
        if node.loop:
            cond_node = setter.while_loop(condition)
            body = cond_node.body
        else:
            cond_node = setter.if_then(condition)
            body = cond_node.then
        handles, _ = self._lower(body, node.body.nodes, node.body.deps)
        if node.loop:   # after every node of the pass: the sinks of the body's DAG
            waited = {d for deps in node.body.deps for d in deps}
            sinks = [h for j, h in enumerate(handles) if j not in waited]
            tail = sinks[0] if len(sinks) == 1 else body.join(*sinks)
            tail.launch(*self._set_condition(flag, condition))
        return setter, cond_node

    def _set_condition(self, flag, condition) -> tuple:
        """(config, kernel, *args) of the one-thread kernel copying flag[0] into `condition`."""
        from cuda.core import LaunchConfig
        cukernel, flat, _ = flatten_args(set_condition_kernel(), (flag, int(condition.handle)))
        return (LaunchConfig(grid=1, block=1), cukernel, *flat)

    @property
    def closed(self) -> bool:
        return self._graph is None

    def launch(self) -> None:
        self._graph.launch(self._stream)

    def set_array_args(self, j: int, args: dict) -> None:
        handle, params = self._handles[j], self._params[j]
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
        self._graph = self._definition = None
        self._handles, self._params = [], []


class HostDrivenExecutor:
    """Conditional nodes on a driver without them: CUDA graphs for the stretches between
    conditional nodes, the host reading each flag in between (as the eager loop would)."""

    memory_bytes = None

    def __init__(self, nodes, deps):
        nodes = list(nodes)
        self._parts, start = [], 0
        # Parts run one after another on one stream, so a dependency on an earlier part
        # holds already; within a part the indices shift to the part's start.
        for j, node in enumerate(nodes + [None]):
            if node is not None and node.kind != "conditional":
                continue
            if j > start:
                self._parts.append(CudaExecutor(
                    nodes[start:j], [tuple(d - start for d in deps[i] if d >= start)
                                     for i in range(start, j)]))
            if node is not None:
                self._parts.append((node, make_cuda_executor(node.body.nodes, node.body.deps)))
            start = j + 1

    @property
    def closed(self) -> bool:
        return self._parts is None

    def launch(self) -> None:
        for part in self._parts:
            if isinstance(part, tuple):
                run_conditional(*part)
            else:
                part.launch()

    def set_array_args(self, j: int, args: dict) -> None:
        raise NotImplementedError("patch binding needs one graph; conditional nodes without "
                                  "driver support split it")

    def close(self) -> None:
        for part in self._parts or []:
            (part[1] if isinstance(part, tuple) else part).close()
        self._parts = None


def conditional_nodes_supported() -> bool:
    """Conditional graph nodes (IF, WHILE) need a CUDA 12.4 driver or newer."""
    from cuda.bindings import driver
    err, version = driver.cuDriverGetVersion()
    return int(err) == 0 and version >= 12040


def make_cuda_executor(nodes, deps):
    """The CUDA executor, or, for conditional nodes on a driver without them, the host-driven
    fallback (with a warning: every pass then waits for the host)."""
    nodes = list(nodes)
    if any(node.kind == "conditional" for node in nodes) and not conditional_nodes_supported():
        warnings.warn("this CUDA driver has no conditional graph nodes (CUDA 12.4+): IF/WHILE "
                      "run as graph segments with the host reading each flag", RuntimeWarning,
                      stacklevel=3)
        return HostDrivenExecutor(nodes, deps)
    return CudaExecutor(nodes, deps)


_SET_CONDITION_SRC = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __device__ void proto_set_conditional(unsigned long long handle, unsigned int value) {
    cudaGraphSetConditional(handle, value);
}
"""
_set_condition_kernel = None


def set_condition_kernel():
    """`kernel(flag, handle)`: the condition `handle` := (flag[0] != 0), from one thread.
    ``cudaGraphSetConditional`` is a device-runtime builtin Numba cannot call directly, so a
    few lines of CUDA C wrap it (declare_device). Built on first use: GPU only."""
    global _set_condition_kernel
    if _set_condition_kernel is None:
        set_conditional = cuda.declare_device("proto_set_conditional", "void(uint64, uint32)",
                                              abi="c", link=[cuda.CUSource(_SET_CONDITION_SRC)])

        @cuda.jit("void(int32[::1], uint64)")
        def set_condition(flag, handle):
            if cuda.grid(1) == 0:
                set_conditional(handle, np.uint32(1 if flag[0] != 0 else 0))

        _set_condition_kernel = set_condition
    return _set_condition_kernel


EXECUTORS = {"walk": WalkExecutor, "cuda": make_cuda_executor}


def default_executor() -> str:
    return "walk" if backend.SIMULATOR else "cuda"
