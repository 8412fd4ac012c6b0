"""The graph description: plain data at the bottom of the graph layer.

A description is what recording a function produces (proto.graph.record) and what every
later pass reads: the race check below, the memory planner (proto.graph.plan), the binders
(proto.graph.binding) and the executors (proto.graph.walk, proto.graph.cuda). It holds

  nodes    in recording order: `KernelLaunch`, `Copy`, and `Conditional` (an IF or WHILE on a
           device flag whose body is a description itself);
  deps     per node, the indices of the earlier nodes it waits for. Nodes with no path of
           dependencies between them may run at once (a copy engine moving data while the SMs
           compute); work recorded on one stream is a chain;
  buffers  the temporaries the function allocated through `proto.device.backend.empty` while it was
           recorded: each has a key that names it in every graph of its owner, a size, and
           the memory it occupies now (private memory until the planner places it).

Nothing here runs anything or knows an executor: passes and executors dispatch on the node
classes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from proto.device.backend import extent, is_device_array, kernel_name, written_args


# ------------------------------------------------------------------------- nodes
@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One operation of a graph. `args` lists what it touches, in argument-slot order; the
    device arrays among them are what binding and planning can move."""
    args: tuple

    def array_args(self) -> list[tuple[int, object]]:
        return [(i, a) for i, a in enumerate(self.args) if is_device_array(a)]

    def accesses(self) -> list[tuple[object, bool]]:
        """(array, writes) for every device array the node touches."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class KernelLaunch(Node):
    """``kernel[griddim, blockdim, stream, sharedmem](*args)`` with dims as 3-tuples."""
    kernel: object = None  # a Numba dispatcher with one eager signature
    griddim: tuple = (1, 1, 1)
    blockdim: tuple = (1, 1, 1)
    sharedmem: int = 0

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)

    def accesses(self) -> list[tuple[object, bool]]:
        # A kernel that does not declare what it writes (proto.device.backend.jit's `writes`) is
        # taken to write every array it is given.
        writes = written_args(self.kernel)
        return [(a, writes is None or i in writes) for i, a in self.array_args()]

    def describe(self) -> str:
        return f"{self.name} grid={self.griddim} block={self.blockdim}"


@dataclasses.dataclass(frozen=True, eq=False)
class Copy(Node):
    """``dst[...] = src``; args = (dst, src), equal shapes and dtypes, C-contiguous. Device to
    device, or one side a pinned host array (a swap out to host memory or back in)."""

    @property
    def direction(self) -> str:
        dst, src = self.args
        return {(True, True): "D2D", (True, False): "H2D", (False, True): "D2H"}[
            (is_device_array(dst), is_device_array(src))]

    def accesses(self) -> list[tuple[object, bool]]:
        dst, src = self.args
        return [(dst, True), (src, False)]

    def describe(self) -> str:
        return f"copy {self.direction}"


@dataclasses.dataclass(frozen=True, eq=False)
class Conditional(Node):
    """IF (`loop` False) or WHILE (`loop` True) on a device flag: `body`, a Description,
    runs once if, or again and again while, flag[0] != 0, as read when the node starts (and,
    for WHILE, after every pass: the body is what changes the flag). args = (flag,), a
    1-element int32 device array. `max_passes` bounds a WHILE: past it the loop stops and
    the host is told (proto.graph.record.while_loop)."""
    body: "Description" = None
    loop: bool = False
    max_passes: int = 0
    passes: object = None   # WHILE: device int32 (2,): passes made, and 1 if the bound stopped it

    @property
    def name(self) -> str:
        return "while" if self.loop else "if"

    def accesses(self) -> list[tuple[object, bool]]:
        out = [(self.args[0], False)] + ([(self.passes, True)] if self.passes is not None else [])
        for node in self.body.nodes:
            out += node.accesses()
        return out

    def describe(self) -> str:
        return f"{self.name} flag[0] != 0: {len(self.body)} nodes"


def after_previous(j: int) -> tuple:
    """Node j's dependencies on one stream: the node before it."""
    return (j - 1,) if j else ()


# ------------------------------------------------------------------------- buffers
@dataclasses.dataclass(eq=False)
class Buffer:
    """A temporary allocated while recording (proto.device.backend.empty). `key` is (owner tag,
    name, occurrence): the same key names the same logical tensor in every graph of one
    owner, which is what lets the memory tape give it one address everywhere. `array` is the
    flat byte array it occupies now."""
    key: tuple
    nbytes: int
    array: object

    @property
    def name(self) -> str:
        _, name, k = self.key
        return name if k == 0 else f"{name}#{k}"


# ------------------------------------------------------------------------- the description
@dataclasses.dataclass
class Description:
    """The nodes in recording order and, per node, the indices of earlier nodes it waits for.
    Without `deps` each node waits for the one before: one stream's order."""
    nodes: list
    deps: list | None = None
    buffers: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.deps is None:
            self.deps = [after_previous(j) for j in range(len(self.nodes))]
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
        return all(deps == after_previous(j) for j, deps in enumerate(self.deps))

    @property
    def has_conditionals(self) -> bool:
        return any(isinstance(node, Conditional) for node in self.nodes)

    def count_nodes(self) -> int:
        """Nodes at every depth (a conditional's body counted too)."""
        return sum(1 + (node.body.count_nodes() if isinstance(node, Conditional) else 0)
                   for node in self.nodes)

    def count_kernels(self) -> int:
        """Kernel launches at every depth, a conditional's body counted once (so a WHILE
        body's count is its launches a pass)."""
        return sum(node.body.count_kernels() if isinstance(node, Conditional)
                   else isinstance(node, KernelLaunch) for node in self.nodes)

    def summary(self) -> str:
        """One line per node: what a student would print to see what was recorded. Wait
        lists are shown where they differ from "the node before"."""
        lines = []
        for j, (node, deps) in enumerate(zip(self.nodes, self.deps)):
            arrays = ", ".join(f"{i}:{np.dtype(a.dtype)}{tuple(a.shape)}" for i, a in node.array_args())
            after = "" if deps == after_previous(j) else f"  after {list(deps)}"
            lines.append(f"{j:4d} {node.describe()}  [{arrays}]{after}")
            if isinstance(node, Conditional):
                lines += ["     | " + line for line in node.body.summary().splitlines()]
        return "\n".join(lines)


def segment(description: Description, lo: int, hi: int) -> Description:
    """Top-level nodes [lo, hi) as a description of their own, their waits renumbered (a
    wait on a node before `lo` is dropped: the segment starts after the one before it has
    finished). Buffers stay with the whole description."""
    deps = [tuple(d - lo for d in waits if d >= lo) for waits in description.deps[lo:hi]]
    return Description(description.nodes[lo:hi], deps)


def ancestors(deps: list) -> list[int]:
    """Per node, a bit mask of every node that must finish before it starts."""
    masks = []
    for waits in deps:
        mask = 0
        for d in waits:
            mask |= masks[d] | (1 << d)
        masks.append(mask)
    return masks


def races(description: Description) -> list[tuple[int, int]]:
    """Pairs of nodes (i < j) that touch overlapping bytes, at least one of them writing, with
    no path of dependencies between them: on a GPU they may run at once or in either order.
    A kernel writes the arguments its `jit` declares (every array, if it declares none); a
    copy reads `src` and writes `dst`; a conditional node touches what its body touches
    (check a body itself with races(node.body)). An empty list means the DAG is race-free."""
    before = ancestors(description.deps)
    accesses = []    # (lo, hi, node, writes), swept in address order
    for j, node in enumerate(description.nodes):
        accesses += [(*extent(a), j, writes) for a, writes in node.accesses()]
    accesses.sort(key=lambda a: a[0])
    found, open_ = set(), []
    for lo, hi, j, writes in accesses:
        open_ = [a for a in open_ if a[1] > lo]
        for _, _, i, other_writes in open_:
            a, b = min(i, j), max(i, j)
            if a != b and (writes or other_writes) and not (before[b] >> a) & 1:
                found.add((a, b))
        open_.append((lo, hi, j, writes))
    return sorted(found)
