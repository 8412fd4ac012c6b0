"""Predication (Grape's): IF and WHILE run inside plain graphs by kernels that test a flag.

Conditional graph nodes (proto.graph.cuda) need a CUDA 12.4 driver. Grape had none and ran
data-dependent control flow by predication instead: every kernel inside a scope takes a device
predicate and returns at once when it is false (``proto.device.backend.predicated`` builds that twin
of any kernel), so the graph launches everything and the data decides what does work.

This module lowers a description's conditional nodes that way, as a pass over the same
description the conditional executor reads:

  IF f in scope s        a one-thread kernel writes s' = s AND f (read once, when the IF
                         starts, as a conditional node reads its flag), then the body's
                         kernels run predicated on s'; a device copy becomes a predicated
                         copy kernel (a memcpy node cannot test a flag).
  WHILE f at top level   the body is unrolled K = min(`unroll`, max_passes) times (a pass
                         past the bound never does work); each pass starts with a
                         kernel that snapshots s_pass = f AND (passes < max_passes) and counts
                         the pass, and the pass's kernels run predicated on s_pass, so a pass
                         that starts with f set completes even when the body clears f midway.
                         The host launches the K passes, reads f, and launches them again while
                         f is still set: one synchronization per K passes instead of one per
                         pass, and a pass after f fell costs only its early-exit launches.
  WHILE f inside a body  unrolled max_passes times (it must be at most K: the host cannot
                         relaunch an inner loop), plus a check that the bound held.

A loop that still has its flag set at its bound raises LoopBoundError after the launch that
hit it, as the other lowerings do.

`PredicatedExecutor` runs the result: straight stretches and unrolled loops, each a plain
description on the executor the caller picks (CUDA graphs, or the walk on the simulator).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check
from proto.device.backend import address, cuda, is_device_array, jit, predicated
from proto.graph.ir import Conditional, Copy, Description, KernelLaunch
from proto.graph.record import LoopBoundError

THREADS = 256
MAX_UNROLL = 1024   # passes of a loop body in one graph: each pass is a copy of every node


@jit("void(int32[::1], int32[::1], int32[::1])", writes=("scope",))
def and_scope_kernel(outer, flag, scope):
    """scope := outer AND flag (one thread)."""
    if cuda.grid(1) == 0:
        scope[0] = 1 if outer[0] != 0 and flag[0] != 0 else 0


@jit("void(int32[::1], int32[::1], int32[::1], int32[::1], int32)", writes=("scope", "passes"))
def pass_scope_kernel(outer, flag, scope, passes, max_passes):
    """The start of a WHILE pass: scope := outer AND flag AND passes < max_passes; a live pass
    is counted in passes[0]; a flag still set at the bound sets passes[1]."""
    if cuda.grid(1) == 0:
        live = outer[0] != 0 and flag[0] != 0
        if live and passes[0] >= max_passes:
            passes[1] = 1
            live = False
        if live:
            passes[0] += 1
        scope[0] = 1 if live else 0


@jit("void(int32[::1])", writes=("passes",))
def reset_passes_kernel(passes):
    if cuda.grid(1) == 0:
        passes[0] = 0
        passes[1] = 0


def _copy_kernel(word: str):
    @jit(f"void(int32[::1], {word}[::1], {word}[::1])", writes=("dst",))
    def copy_kernel(pred, dst, src):
        """dst[:] = src where pred[0] != 0: a device copy that can be predicated."""
        if pred[0] != 0:
            start, stride = cuda.grid(1), cuda.gridsize(1)
            for i in range(start, dst.size, stride):
                dst[i] = src[i]
    return copy_kernel


# Widest word first: a copy moved a byte per thread-step runs at a fraction of bandwidth
# (a KV-cache copy inside a predicated beam-search pass cost 0.5 ms a token that way).
COPY_KERNELS = {np.dtype(w): _copy_kernel(w) for w in ("uint64", "uint32", "uint8")}
COPY_BLOCKS = 2048   # enough resident threads to stream a large copy through every SM


def predicated_copy(scope, dst, src) -> KernelLaunch:
    """A device copy as a kernel launch predicated on `scope`, in the widest word that
    divides both addresses and the size."""
    nbytes = dst.nbytes
    for word, kernel in COPY_KERNELS.items():
        w = word.itemsize
        if nbytes % w == 0 and address(dst) % w == 0 and address(src) % w == 0:
            break
    n = nbytes // w
    blocks = max(1, min((n + THREADS - 1) // THREADS, COPY_BLOCKS))
    words = [a.reshape(a.size).view(np.uint8).view(word) for a in (dst, src)]
    return KernelLaunch((scope, *words), kernel, (blocks, 1, 1), (THREADS, 1, 1), 0)


def _one(kernel, args) -> KernelLaunch:
    return KernelLaunch(tuple(args), kernel, (1, 1, 1), (1, 1, 1), 0)


@dataclasses.dataclass
class Loop:
    """A top-level WHILE, lowered: `reset` once, then `passes_graph` (K predicated passes)
    again and again while `flag` is set."""
    flag: object
    passes: object        # device int32 (2,): passes made, bound hit
    max_passes: int
    reset: Description
    passes_graph: Description


class _Lowering:
    def __init__(self, unroll: int):
        self.unroll = unroll
        self.nested: list[Conditional] = []   # inner loops whose bound the host checks
        self.one = cuda.to_device(np.ones(1, np.int32))   # the scope of the whole graph

    def _scope(self):
        return cuda.device_array(1, np.int32)

    def nodes(self, nodes, scope) -> list:
        """`nodes` lowered into plain nodes predicated on `scope` (a chain)."""
        out = []
        for node in nodes:
            if isinstance(node, KernelLaunch):
                kernel, args = node.kernel, node.args
                if getattr(kernel, "predicate_of", None) is not None:   # already predicated
                    inner = self._scope()
                    out.append(_one(and_scope_kernel, (scope, args[0], inner)))
                    out.append(dataclasses.replace(node, args=(inner, *args[1:])))
                else:
                    out.append(dataclasses.replace(node, kernel=predicated(kernel),
                                                   args=(scope, *args)))
            elif isinstance(node, Copy):
                dst, src = node.args
                if not (is_device_array(dst) and is_device_array(src)):
                    raise ValueError("predication: a copy to or from the host cannot be "
                                     "predicated; record it outside the IF/WHILE")
                out.append(predicated_copy(scope, dst, src))
            elif isinstance(node, Conditional) and not node.loop:
                inner = self._scope()
                out.append(_one(and_scope_kernel, (scope, node.args[0], inner)))
                out += self.nodes(node.body.nodes, inner)
            elif isinstance(node, Conditional):
                if node.max_passes > self.unroll:
                    raise ValueError(f"predication: a WHILE inside an IF or WHILE body is unrolled "
                                     f"in full, so its max_passes ({node.max_passes}) must be at "
                                     f"most the unroll ({self.unroll})")
                self.nested.append(node)
                out.append(_one(reset_passes_kernel, (node.passes,)))
                out += self.passes(node, scope, node.max_passes + 1)
            else:
                raise NotImplementedError(f"predication: no rule for {type(node).__name__}")
        return out

    def passes(self, node: Conditional, scope, k: int) -> list:
        """k unrolled passes of WHILE `node` inside `scope`."""
        out = []
        for _ in range(k):
            live = self._scope()
            out.append(_one(pass_scope_kernel, (scope, node.args[0], live, node.passes,
                                                np.int32(node.max_passes))))
            out += self.nodes(node.body.nodes, live)
        return out


def lower(description: Description, unroll: int):
    """The description as a list of plain Descriptions (straight stretches) and Loops (top
    level WHILEs), every conditional replaced by predicated kernels; and the inner WHILE nodes
    whose bounds must be checked after a launch."""
    unroll = _check.positive("unroll", unroll, at_most=MAX_UNROLL)
    if not description.is_chain:
        raise ValueError("predication lowers single-stream descriptions (a chain); this one "
                         "was recorded on several streams")
    low = _Lowering(unroll)
    parts, straight = [], []
    for node in description.nodes:
        if isinstance(node, Conditional) and node.loop:
            if straight:
                parts.append(Description(straight))
                straight = []
            reset = Description([_one(reset_passes_kernel, (node.passes,))])
            unrolled = min(low.unroll, node.max_passes)
            parts.append(Loop(node.args[0], node.passes, node.max_passes, reset,
                              Description(low.passes(node, low.one, unrolled))))
        else:
            straight += low.nodes([node], low.one)
    if straight:
        parts.append(Description(straight))
    return parts, low.nested


def _check_bound(passes, max_passes: int) -> None:
    if passes.copy_to_host()[1]:
        raise LoopBoundError(f"while_loop: the flag was still set after max_passes={max_passes} "
                             "passes; the loop stopped there and the results are incomplete")


class PredicatedExecutor:
    """Run a description lowered by predication: `make(description)` builds the executor of
    each plain part (a CUDA graph, or the walk). A top-level loop is relaunched K passes at a
    time while its flag is set (the host reads the flag after each launch)."""

    memory_bytes = None

    def __init__(self, description: Description, make, unroll: int):
        parts, self._nested = lower(description, unroll)
        self._parts = []
        for part in parts:
            if isinstance(part, Loop):
                self._parts.append((part, make(part.reset), make(part.passes_graph)))
            else:
                self._parts.append(make(part))
        self.launches = 0     # launches of unrolled passes, summed over replays
        self.closed = False

    def launch(self) -> None:
        if self.closed:
            raise RuntimeError("launch: the executor is closed")
        for part in self._parts:
            if not isinstance(part, tuple):
                part.launch()
                continue
            loop, reset, passes = part
            reset.launch()
            while True:
                passes.launch()
                self.launches += 1
                if not loop.flag.copy_to_host()[0]:
                    break
                _check_bound(loop.passes, loop.max_passes)

    def finish(self) -> None:
        for node in self._nested:
            _check_bound(node.passes, node.max_passes)

    def prepare(self) -> None:
        """Nothing to get ready ahead: every part owns its executable."""

    def set_array_args(self, j: int, args: dict) -> None:
        raise NotImplementedError("patch binding needs one graph; predication splits it")

    def close(self) -> None:
        for part in self._parts:
            for exe in (part[1:] if isinstance(part, tuple) else (part,)):
                exe.close()
        self._parts, self.closed = [], True
