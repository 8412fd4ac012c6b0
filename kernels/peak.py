"""The device's achievable FP32 peak, measured: a loop of independent FMAs, no memory traffic.

Each thread keeps LANES independent accumulators (enough to cover the FMA latency) and runs
`iters` passes of ROUNDS `acc = acc * m + a` on each, then stores one sum so nothing is dead code.
The FLOPs are 2 x LANES x ROUNDS x iters per thread; `fma_peak_TFLOPs` times a launch that fills the
GPU several times over. A datasheet peak (SMs x lanes x 2 x clock) assumes the boost clock
holds; this is what kernels can actually reach.
"""
from __future__ import annotations

import numpy as np

from proto.device.backend import cuda, jit, launch

LANES = 8    # independent accumulators per thread
ROUNDS = 16  # FMAs on each per loop pass
THREADS = 256


@jit("void(float32[::1], int32)", writes=("out",))
def fma_loop_kernel(out, iters):
    i = cuda.grid(1)
    a0 = np.float32(i) * np.float32(1e-9)
    a1, a2, a3 = a0 + np.float32(1.0), a0 + np.float32(2.0), a0 + np.float32(3.0)
    a4, a5, a6, a7 = a0 + np.float32(4.0), a0 + np.float32(5.0), a0 + np.float32(6.0), \
        a0 + np.float32(7.0)
    m, c = np.float32(0.9999999), np.float32(1e-7)
    for _ in range(iters):
        for _ in range(ROUNDS):   # unrolled: the loop's own instructions are few beside them
            a0 = a0 * m + c
            a1 = a1 * m + c
            a2 = a2 * m + c
            a3 = a3 * m + c
            a4 = a4 * m + c
            a5 = a5 * m + c
            a6 = a6 * m + c
            a7 = a7 * m + c
    if i < out.size:
        out[i] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7


def fma_loop(out, blocks: int, iters: int, *, stream=0) -> float:
    """Launch the loop on `blocks` blocks of THREADS threads; returns the FLOPs it does."""
    launch(fma_loop_kernel, blocks, THREADS, (out, np.int32(iters)), stream)
    return 2.0 * LANES * ROUNDS * iters * blocks * THREADS
