"""The "last block reduces" pattern: blocks of one launch that each produce a part of a
result count themselves in on a device counter, and the block that arrives last combines the
parts, in the same launch (as CUDA's threadFenceReduction sample does). It saves the second
launch (a graph node and a kernel's fixed cost) that a separate combining kernel costs.
It pays only when the combine is small: the last block works alone, after every other
block, behind a threadfence and an atomic. For beam search's candidates (`kernels.sampling`)
that is a few hundred values; for GPT-2's split-K GEMM with its layer norm and for split
attention it measured slower on the H200 than a second launch whose blocks share the work
(dev/notes/decode.md), so those keep their second launch.

Why it is correct: every block makes its writes visible device-wide (threadfence) before it
counts in with an atomic add; the block that sees the count reach the total is therefore
after every part in memory order, and it reads the parts through L2 (`proto.device.backend.ldcg`),
because its SM's L1 is not coherent with the other SMs' writes. The combining order is fixed
by the data (split 0, 1, ...), never by which block came last: results are deterministic.

The counters live in one persistent device array (`launch_counters`): the last block resets
its counter, so each launch leaves them at zero for the next. Launches that share them must
run one after another; kernels declare the array written, so the graph layer's race check
refuses two launches that could run at once.
"""
from __future__ import annotations

import numpy as np

from proto.device import backend
from proto.device.backend import cuda

COUNTERS = 4096
# Every counter array ever handed out (graphs keep their addresses). The first is made at
# import, beside the kernels' compilation, so that no measurement of the memory a graph
# takes (experiments/graph_memory.py) sees it appear.
_counters: list = [] if backend.PTX_ONLY else [backend.persistent_zeros(COUNTERS, np.int32)]


def launch_counters(n: int):
    """A device int32 array of at least n counters, all zero between launches. Never freed:
    a graph holds its address."""
    if _counters[-1].size < n:
        _counters.append(backend.persistent_zeros(n, np.int32))
    return _counters[-1]


@cuda.jit(device=True)
def count_in(counters, at, total, flag):
    """Every thread of the block: make this block's global writes visible, then count the
    block in at counters[at]; returns whether it was the last of `total` (the counter is then
    back at zero). `flag`: a shared int32 array of 1. Ends with a barrier, so the caller may
    reuse `flag` and shared memory at once."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        last = cuda.atomic.add(counters, at, 1) == np.int32(total) - np.int32(1)
        if last:
            counters[at] = 0
        flag[0] = 1 if last else 0
    cuda.syncthreads()
    last = flag[0] != 0
    cuda.syncthreads()
    return last
