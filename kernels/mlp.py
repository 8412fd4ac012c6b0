"""A transformer MLP update in two launches: out += GELU(x @ w1 + b1) @ w2 + b2.

GPT-2's decode step runs its MLP as a chain of kernels, and at these sizes each kernel is a
phase that every block of the GPU must finish before the next starts: a few microseconds
whatever its bytes (dev/notes/decode.md). Through kernels.gemm the MLP takes three (fc
with GELU; the projection's split-K partials; their reduction). Here the two products are
one kernel:

  fused   block b owns C hidden columns. It computes them whole (GELU(x W1[:, cols] + b1),
          the full K of fc) and at once multiplies them by the C rows of W2 they meet,
          writing a partial (M x D) of the projection. Nothing waits between the two
          products but the block's own barrier. Every weight the block reads (C columns of
          W1, C rows of W2: 96 KB at GPT-2 small's 768 x 3072) is loaded into registers
          before the early-launch wait (weights are nobody's output), so the MLP's bytes
          are in flight while the kernel before it finishes.
  sum     out = (sum of the H / C partials, in order) + out + b2: SUM_COLS outputs a block,
          SUM_GROUPS row groups of threads each summing every SUM_GROUPS-th partial, then
          the groups in order through shared memory (deterministic, no atomics).

On the H200 the two launches took 11.3 us for GPT-2 small's MLP of 5 rows, against 17.7 for
the three of kernels.gemm (results/h200/profiles/bench_mlp_6b28e61.txt).

  ln_out  the residual the sum writes is spread over its blocks (32 outputs each), so no
          block holds a whole row to normalize. With ln_out (the next layer's ln_1, or
          ln_f) the sum's blocks count themselves in per row once their outputs are
          written, and each row's last block reads the row back through L2 and normalizes
          it (`sum_ln_kernel`, kernels._lastblock), instead of a layernorm launch after the
          sum (4.6 us a layer in GPT-2 small's step on the H200: the ln_2 A/B,
          results/h200/profiles/ab_ln_out_step_863f0b2.txt). Timed against that launch by
          `python3 -m dev.ab.ab_mlp_ln_step`.

Registers hold D / 8 weights a thread at C = 16 (96 at D = 768, 128 registers, 2 blocks an
SM, the whole grid resident at once), so the fused kernel takes widths up to MAX_WIDTH; other
shapes (and more than 8 rows) run kernels.gemm's fc and projection instead (`fuses`).

The partials are H / C x M x D floats, 2.95 MB at GPT-2 small's beam of 5: the largest
temporary of the step, so the planned arena's peak (where kernels.gemm's split-K held 0.25
MB). Two ways to halve them were timed in the step on the H200 (dev.ab.ab_mlp_step, 539 us
at C = 16, 586 through kernels.gemm): C = 32 (214 registers, one block an SM) 606 us; and
blocks of two teams of 256 threads, each doing a C = 16 block's work and the second adding
its partial to the first's in shared memory (116 registers, one block of 512 an SM) 560 us,
its kernel 17.9 us under ncu against 12.4. Both lose to C = 16, so C stays 16 and the
partials stay 2.95 MB (results/h200/profiles/ab_mlp_step_c3c1ebc.txt, ab_step_8b3630b.txt).
"""
from __future__ import annotations

import functools

import numpy as np

from kernels import _check, _pdl, gemm
from kernels._lastblock import count_in, launch_counters
from kernels._reduce import block_layernorm_row, load_ln_params, shfl_xor
from kernels.elementwise import gelu_f32
from proto.device import backend
from proto.device.backend import cuda, jit, launch

_u = np.uint32    # 32-bit index math (see kernels.gemm)
_ZERO = np.float32(0.0)
MAX_ROWS = 8
if not backend.SIMULATOR:
    THREADS = 256
    C = 16           # hidden columns a fused block owns
    # Blocks an SM the registers must allow (launch bounds), by C: the grid is one wave.
    # C = 32 halves the partials (1.47 MB at GPT-2 small) at 214 registers, 96 blocks, and
    # makes the step 12% slower (dev.ab.ab_mlp_step).
    BLOCKS_PER_SM = {16: 2, 32: 1}
    MAX_WIDTH = 768  # D: the weights a thread holds in registers grow as D * C / 128
else:   # each simulated thread is a Python thread: small blocks, the same code
    THREADS = 32
    C = 8
    BLOCKS_PER_SM = {}
    MAX_WIDTH = 128
WARPS = THREADS // 32
SUM_COLS = 32             # output elements a sum block covers (one warp's worth)
SUM_GROUPS = THREADS // SUM_COLS


def fuses(m_rows: int, d: int, h: int) -> bool:
    """Whether `mlp` runs the fused kernel for x (m_rows, d) and w1 (d, h)."""
    return (m_rows <= MAX_ROWS and d <= MAX_WIDTH and d % THREADS == 0
            and h % (C * SUM_GROUPS) == 0 and d * h < 2**32)   # (uint32 offsets)


@functools.cache
def fused_kernel(m_rows: int, d: int, h: int, c: int):
    """The fused kernel for M = m_rows, D = d, H = h, c hidden columns a block (compile-time:
    the weights of a thread and the rows it multiplies are register arrays): (x (M*D,),
    w1 (D*H,), b1 (H,), w2 (H*D,), part (H/c*M*D,)), grid (H // c,), THREADS threads."""
    M, D, H, C = m_rows, d, h, c
    GROUPS = THREADS // C          # thread t: hidden column t % C, K rows t // C + GROUPS * j
    rows_a = D // GROUPS           # W1 rows a thread multiplies
    per_b = D // THREADS           # output columns a thread takes in the second product
    blocks = BLOCKS_PER_SM.get(C)
    bounds = {"launch_bounds": (THREADS, blocks)} if blocks else {}
    uC, uD, uH = _u(C), _u(D), _u(H)
    xs_n, red_n, hs_n, w2r_n = M * D, WARPS * M * C, M * C, C * per_b   # array sizes

    @jit("void(float32[::1], float32[::1], float32[::1], float32[::1], float32[::1])",
         writes=("part",), early_launch=True, **bounds)
    def fused_mlp_kernel(x, w1, b1, w2, part):
        xs = cuda.shared.array(xs_n, np.float32)     # x, the MLP's (normalized) input
        red = cuda.shared.array(red_n, np.float32)   # a warp's sums per (row, column)
        hs = cuda.shared.array(hs_n, np.float32)     # GELU(fc), this block's columns
        w1r = cuda.local.array(rows_a, np.float32)   # [j]
        w2r = cuda.local.array(w2r_n, np.float32)    # [c * per_b + i]
        acc = cuda.local.array(M, np.float32)
        t = _u(cuda.threadIdx.x)
        c0 = _u(cuda.blockIdx.x) * uC
        col, g = t % uC, t // uC
        # Every weight of the block, before the wait: weights are nobody's output.
        for j in range(rows_a):
            w1r[j] = w1[(g + _u(j * GROUPS)) * uH + c0 + col]
        for c in range(C):
            for i in range(per_b):
                w2r[c * per_b + i] = w2[(c0 + _u(c)) * uD + t + _u(i * THREADS)]
        _pdl.wait()   # (early launch: the weights above are nobody's output; x is)
        _pdl.launch_dependents()
        for i in range(-(-xs_n // THREADS)):
            e = t + _u(i * THREADS)
            if e < _u(xs_n):
                xs[e] = x[e]
        cuda.syncthreads()
        for m in range(M):
            acc[m] = _ZERO
        for j in range(rows_a):
            k = g + _u(j * GROUPS)
            for m in range(M):
                acc[m] += xs[_u(m * D) + k] * w1r[j]
        off = C   # lanes C apart in a warp hold the same column: butterfly them together
        while off < 32:
            for m in range(M):
                acc[m] += shfl_xor(acc[m], off)
            off *= 2
        lane, warp = t % _u(32), t // _u(32)
        if lane < uC:
            for m in range(M):
                red[(warp * _u(M) + _u(m)) * uC + lane] = acc[m]
        cuda.syncthreads()
        for i in range(-(-hs_n // THREADS)):
            e = t + _u(i * THREADS)   # e = m * C + c
            if e < _u(hs_n):
                v = _ZERO
                for w in range(WARPS):   # the warps in order
                    v += red[_u(w * M * C) + e]
                hs[e] = gelu_f32(v + b1[c0 + e % uC])
        cuda.syncthreads()
        for i in range(per_b):
            n = t + _u(i * THREADS)
            for m in range(M):
                v = _ZERO
                for c in range(C):
                    v += hs[_u(m * C + c)] * w2r[c * per_b + i]
                part[(_u(cuda.blockIdx.x) * _u(M) + _u(m)) * uD + n] = v

    return fused_mlp_kernel


@functools.cache
def _summer(per: int):
    """The sum's work after the wait, as one inlined device function (per = partials a row
    group adds, compile-time, so its loads stay in registers): out[e] = (sum of the
    partials in order) + out[e] + b2[e % d] for this block's SUM_COLS outputs below n_out."""

    @cuda.jit(device=True, inline="always")
    def sum_block(part, out, b2, ud, red, vals):
        t = _u(cuda.threadIdx.x)
        n_out = _u(out.shape[0])
        cl, rg = t % _u(SUM_COLS), t // _u(SUM_COLS)
        e = _u(cuda.blockIdx.x) * _u(SUM_COLS) + cl
        ee = min(e, n_out - _u(1))   # past the end, re-read the last element (never stored)
        for j in range(per):         # every load first, then the sum in order
            vals[j] = part[(rg + _u(j * SUM_GROUPS)) * n_out + ee]
        v = _ZERO
        for j in range(per):
            v += vals[j]
        red[t] = v
        cuda.syncthreads()
        if rg == _u(0) and e < n_out:
            s = _ZERO
            for r in range(SUM_GROUPS):
                s += red[_u(r * SUM_COLS) + cl]
            out[e] = (s + out[e]) + b2[e % ud]

    return sum_block


@functools.cache
def sum_kernel(parts: int):
    """out[e] = (sum over p of part[p * n_out + e], p in order) + out[e] + b2[e % d] for
    e < n_out: grid (ceil(n_out / SUM_COLS),), THREADS threads; `parts` a multiple of
    SUM_GROUPS."""
    per = parts // SUM_GROUPS
    sum_block = _summer(per)

    @jit("void(float32[::1], float32[::1], float32[::1], int32)", writes=("out",),
         early_launch=True)
    def mlp_sum_kernel(part, out, b2, d):
        red = cuda.shared.array(THREADS, np.float32)
        vals = cuda.local.array(per, np.float32)
        _pdl.wait()   # (early launch: the partials and out are earlier kernels' outputs)
        _pdl.launch_dependents()
        sum_block(part, out, b2, _u(d), red, vals)

    return mlp_sum_kernel


LN_VALS = -(-MAX_WIDTH // THREADS)   # a row's values a thread holds in the layer norm
LN_GB = 2 * LN_VALS                  # ... and its gamma and beta (a constant for local.array)


@functools.cache
def sum_ln_kernel(parts: int):
    """`sum_kernel` and then y = layernorm(out) * gamma + beta, row by row, in the same
    launch: a row's blocks (d / SUM_COLS of them: every block's outputs lie in one row) count
    themselves in on counters[row] once their outputs are written, and the row's last block
    reads the whole row back through L2 and normalizes it (kernels._lastblock). Five rows,
    five last blocks at once; the layer norm's own launch goes. Extra arguments: gamma,
    beta (d,), eps, y (M, d), counters (at least M, zero)."""
    per = parts // SUM_GROUPS
    sum_block = _summer(per)

    @jit("void(float32[::1], float32[::1], float32[::1], int32, float32[::1], float32[::1], "
         "float32, float32[:, ::1], int32[::1])", writes=("out", "y", "counters"),
         early_launch=True)
    def mlp_sum_ln_kernel(part, out, b2, d, gamma, beta, eps, y, counters):
        red = cuda.shared.array(THREADS, np.float32)
        flag = cuda.shared.array(1, np.int32)
        vals = cuda.local.array(per, np.float32)
        xv = cuda.local.array(LN_VALS, np.float32)
        gb = cuda.local.array(LN_GB, np.float32)
        t, ud = _u(cuda.threadIdx.x), _u(d)
        row = _u(cuda.blockIdx.x) * _u(SUM_COLS) // ud   # every output of the block's row
        load_ln_params(gamma, beta, gb, LN_VALS, d)   # (nobody's output: before the wait)
        _pdl.wait()   # (early launch: the partials and out are earlier kernels' outputs)
        _pdl.launch_dependents()
        sum_block(part, out, b2, ud, red, vals)
        if count_in(counters, row, ud // _u(SUM_COLS), flag):
            for c in range(LN_VALS):   # past d, re-read the row's last value (never used)
                xv[c] = backend.ldcg(out, row * ud + min(t + _u(c * THREADS), ud - _u(1)))
            block_layernorm_row(xv, LN_VALS, d, gb, eps, y[row])

    return mlp_sum_ln_kernel


def mlp(x, w1, b1, w2, b2, out, *, ln_out=None, stream=0) -> None:
    """out += GELU(x @ w1 + b1) @ w2 + b2 (GPT-2's tanh GELU): x, out (M, D); w1 (D, H),
    b1 (H,), w2 (H, D), b2 (D,). `out` must not overlap the others. Two launches where
    `fuses` says so, else kernels.gemm's fc (into scratch) and accumulating projection.

    ln_out=(gamma, beta, eps, y): also y = layernorm(out) * gamma + beta, the next layer's
    input layer norm: in the sum's launch where the MLP fuses (its rows' last blocks), else
    in the projection's reduction (kernels.gemm's ln_out). y (M, D) overlaps nothing."""
    _check.device_array("x", x, ndim=2)
    m_rows, d = x.shape
    _check.device_array("w1", w1, ndim=2)
    if w1.shape[0] != d:
        raise ValueError(f"w1: expected ({d}, H) for x of width {d}, got {tuple(w1.shape)}")
    h = w1.shape[1]
    _check.device_array("b1", b1, shape=(h,))
    _check.device_array("w2", w2, shape=(h, d))
    _check.device_array("b2", b2, shape=(d,))
    _check.device_array("out", out, shape=(m_rows, d))
    inputs = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    outputs = {"out": out}
    if ln_out is not None:
        gamma, beta, eps, y = ln_out = _check.ln_out(ln_out, (m_rows, d))
        inputs.update(gamma=gamma, beta=beta)
        outputs["y"] = y
    _check.separate(outputs, inputs)
    if not fuses(m_rows, d, h):
        hidden = backend.empty((m_rows, h), np.float32, "mlp.hidden")
        gemm.gemm(x, w1, hidden, bias=b1, act="gelu", stream=stream)
        gemm.gemm(hidden, w2, out, bias=b2, accumulate=True, ln_out=ln_out, stream=stream)
        return
    flat = backend.reshaped
    part = backend.empty((h // C * m_rows * d,), np.float32, "mlp.partials")
    launch(fused_kernel(m_rows, d, h, C), h // C, THREADS,
           (flat(x, (m_rows * d,)), flat(w1, (d * h,)), b1, flat(w2, (h * d,)), part), stream)
    sums = (part, flat(out, (m_rows * d,)), b2, np.int32(d))
    if ln_out is None:
        launch(sum_kernel(h // C), -(-(m_rows * d) // SUM_COLS), THREADS, sums, stream)
    else:
        launch(sum_ln_kernel(h // C), m_rows * d // SUM_COLS, THREADS,
               (*sums, gamma, beta, np.float32(eps), y, launch_counters(m_rows)), stream)


if not backend.SIMULATOR:   # GPT-2 small's beam-5 step, compiled at import (compile_check)
    GPT2_SMALL = (fused_kernel(5, 768, 3072, C), sum_kernel(3072 // C),
                  sum_ln_kernel(3072 // C))
