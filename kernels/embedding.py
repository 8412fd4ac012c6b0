"""Token (+ position) embedding: out[b, t] = wte[tokens[b, t]] (+ wpe[pos0 + t]).

One block per (t, b) row, threads along C (coalesced rows of the tables). The first position
comes from a device int32 (1,) array, so one launch configuration (and one captured CUDA
graph) serves every decoding step. Ids outside the tables cannot be rejected before the
launch (they live on the device), so such rows are written as NaN: visible, and never an
out-of-bounds read.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto import backend
from proto.backend import cuda, jit, launch

MAX_THREADS = 256 if not backend.SIMULATOR else 32
_NAN = np.float32(np.nan)


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
    return wte[tok, j] + wpe[p, j] if has_wpe else wte[tok, j]


@jit("void(int32[:, ::1], float32[:, ::1], float32[:, :, ::1], float32[:, ::1], int32[::1], "
     "int32, int32)", writes=("out",))
def embed_kernel(tokens, wte, out, wpe, pos0, has_wpe, has_pos0):
    t, b = cuda.blockIdx.x, cuda.blockIdx.y
    tok = tokens[b, t]
    p = t + (pos0[0] if has_pos0 else 0)
    bad = tok < 0 or tok >= wte.shape[0] or (has_wpe and (p < 0 or p >= wpe.shape[0]))
    for j in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        out[b, t, j] = _entry(wte, wpe, tok, p, j, bad, has_wpe)


# ---------------------------------------------------------------------------- launcher
def embed(tokens, wte, out, *, wpe=None, pos0=None, stream=0):
    """out (B, T, C) = wte[tokens] (+ wpe[pos0 + t] when wpe (P, C) is given; pos0 a device
    int32 (1,), default position 0). tokens: device int32 (B, T). Ids or positions outside
    the tables give NaN rows."""
    _check.device_array("tokens", tokens, dtype=np.int32, ndim=2)
    _check.device_array("wte", wte, ndim=2)
    batch, steps = tokens.shape
    width = wte.shape[1]
    _check.device_array("out", out, shape=(batch, steps, width))
    if wpe is not None:
        _check.device_array("wpe", wpe, shape=(None, width))
    if pos0 is not None:
        if wpe is None:
            raise ValueError("pos0: given without wpe (positions index the wpe table)")
        _check.device_array("pos0", pos0, dtype=np.int32, shape=(1,))
    if batch > 65535:
        raise ValueError(f"tokens: batch {batch} exceeds the grid limit 65535")
    # Unused tables are replaced by ones of the right type, never read (flags are 0).
    args = (tokens, wte, out, wte if wpe is None else wpe,
            backend.reshaped(tokens, (tokens.size,)) if pos0 is None else pos0,
            int(wpe is not None), int(pos0 is not None))
    launch(embed_kernel, (steps, batch), min(MAX_THREADS, width), args, stream)
