"""Token (+ position) embedding: out[b, t] = wte[tokens[b, t]] (+ wpe[pos0 + t]).

One block per (t, b) row, threads along C (coalesced rows of the tables). The first position
comes from a device int32 (1,) array, so one launch configuration (and one captured CUDA
graph) serves every decoding step. Ids outside the tables cannot be rejected before the
launch (they live on the device), so such rows are written as NaN: visible, and never an
out-of-bounds read.

Optional `ln_out=(gamma, beta, eps, y)`: the block also writes y = layernorm(row) from the
values still in its registers (GPT-2's first layer norm: no launch of its own).

Tables and outputs are float32 or float16 (one dtype a launch): the sum and the layer norm are
float32 either way, and float16 outputs are rounded once, as they are stored (y normalizes
the float32 sum, not the rounded out).
"""
from __future__ import annotations

import numpy as np

from kernels import _check, layernorm
from kernels._reduce import block_layernorm_row, load_ln_params
from proto.device import backend
from proto.device.backend import cuda, jit_per_dtype, launch

MAX_THREADS = 256 if not backend.SIMULATOR else 32
LN_COLS = 8   # row values a thread holds for the fused layer norm: C <= LN_COLS * MAX_THREADS
_GB = 2 * LN_COLS   # (local array sizes must be plain constants)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------- reference
def embed_ref(tokens, wte, wpe=None, pos0: int = 0) -> np.ndarray:
    tokens = np.asarray(tokens)
    vocab, width = wte.shape
    out = np.full((*tokens.shape, width), np.nan, np.float32)
    for (b, t), tok in np.ndenumerate(tokens):
        p = pos0 + t
        if not 0 <= tok < vocab or (wpe is not None and not 0 <= p < wpe.shape[0]):
            continue
        row = wte[tok].astype(np.float64)
        out[b, t] = row + wpe[p] if wpe is not None else row
    return out


# ---------------------------------------------------------------------------- kernel
@cuda.jit(device=True)
def _entry(wte, wpe, tok, p, j, bad, has_wpe):
    """Element j of a row: wte[tok, j] (+ wpe[p, j]), NaN for a bad id or position."""
    if bad:
        return _NAN
    e = np.float32(wte[tok, j])   # (float32 before the add: a float16 sum would round twice)
    return e + np.float32(wpe[p, j]) if has_wpe else e


@jit_per_dtype("void(int32[:, ::1], {t}[:, ::1], {t}[:, :, ::1], {t}[:, ::1], int32[::1], int32, "
               "int32, {t}[::1], {t}[::1], float32, {t}[:, :, ::1], int32)", writes=("out", "y"))
def embed_kernels(tokens, wte, out, wpe, pos0, has_wpe, has_pos0, gamma, beta, eps, y, has_ln):
    xv = cuda.local.array(LN_COLS, np.float32)
    gb = cuda.local.array(_GB, np.float32)   # the layer norm's gamma, beta
    t, b = cuda.blockIdx.x, cuda.blockIdx.y
    n, tid, nt = out.shape[2], cuda.threadIdx.x, cuda.blockDim.x
    if has_ln:   # loads first: each would otherwise wait for the stores before it
        load_ln_params(gamma, beta, gb, LN_COLS, n)
    tok = tokens[b, t]
    p = t + (pos0[0] if has_pos0 else 0)
    bad = tok < 0 or tok >= wte.shape[0] or (has_wpe and (p < 0 or p >= wpe.shape[0]))
    for c in range(LN_COLS):   # (has_ln: n <= LN_COLS * blockDim, checked at launch)
        j = tid + c * nt
        xv[c] = _entry(wte, wpe, tok, p, j, bad, has_wpe) if j < n else _ZERO
    for c in range(LN_COLS):
        j = tid + c * nt
        if j < n:
            out[b, t, j] = xv[c]
    for j in range(tid + LN_COLS * nt, n, nt):   # rows wider than the registers hold
        out[b, t, j] = _entry(wte, wpe, tok, p, j, bad, has_wpe)
    if has_ln:   # uniform over the block: the barriers inside are safe
        block_layernorm_row(xv, LN_COLS, n, gb, eps, y[b, t])


# ---------------------------------------------------------------------------- launcher
def _threads(width: int, ln: bool) -> int:
    """Threads a row: one a column up to MAX_THREADS; whole warps with the layer norm (its
    reductions shuffle)."""
    threads = min(MAX_THREADS, width)
    return _check.warp_threads(threads) if ln else threads


def fuses_layernorm(width: int) -> bool:
    """Whether `embed` can write ln_out for rows of `width` (else run layernorm after it)."""
    return width <= LN_COLS * _threads(width, True)


def embed(tokens, wte, out, *, wpe=None, pos0=None, ln_out=None, stream=0):
    """out (B, T, C) = wte[tokens] (+ wpe[pos0 + t] when wpe (P, C) is given; pos0 a device
    int32 (1,), default position 0). tokens: device int32 (B, T); the tables, out and ln_out
    of one dtype, float32 or float16. Ids or positions outside the tables give NaN rows.
    ln_out=(gamma, beta, eps, y): also y (B, T, C) = layernorm(out) row by row, gamma and
    beta (C,), y overlapping nothing: in the same launch where C fits its registers
    (`fuses_layernorm`), else by kernels.layernorm right after."""
    _check.device_array("tokens", tokens, dtype=np.int32, ndim=2)
    dtype = _check.float_dtype("wte", wte)
    _check.device_array("wte", wte, dtype=dtype, ndim=2)
    batch, steps = tokens.shape
    width = wte.shape[1]
    _check.device_array("out", out, dtype=dtype, shape=(batch, steps, width))
    if wpe is not None:
        _check.device_array("wpe", wpe, dtype=dtype, shape=(None, width))
    if pos0 is not None:
        if wpe is None:
            raise ValueError("pos0: given without wpe (positions index the wpe table)")
        _check.device_array("pos0", pos0, dtype=np.int32, shape=(1,))
    if batch > 65535:
        raise ValueError(f"tokens: batch {batch} exceeds the grid limit 65535")
    threads = _threads(width, ln_out is not None)
    if ln_out is None:   # placeholders, never touched (has_ln is 0): y a scratch element
        gamma = beta = backend.reshaped(wte, (wte.size,))
        eps, y = 1.0, backend.empty((1, 1, 1), dtype, "embed.no_ln")
    else:
        gamma, beta, eps, y = _check.ln_out(ln_out, (batch, steps, width), dtype)
        if not fuses_layernorm(width):   # rows wider than the registers hold: two launches
            embed(tokens, wte, out, wpe=wpe, pos0=pos0, stream=stream)
            rows = batch * steps
            layernorm.layernorm(backend.reshaped(out, (rows, width)), gamma, beta,
                                backend.reshaped(y, (rows, width)), eps=float(eps),
                                stream=stream)
            return
    # Unused tables are replaced by ones of the right type, never read (flags are 0).
    args = (tokens, wte, out, wte if wpe is None else wpe,
            backend.reshaped(tokens, (tokens.size,)) if pos0 is None else pos0,
            int(wpe is not None), int(pos0 is not None), gamma, beta, np.float32(eps), y,
            int(ln_out is not None))
    launch(embed_kernels[dtype], (steps, batch), threads, args, stream)
