"""LSTM cell pointwise step (PyTorch's gate order i, f, g, o); the gate GEMMs are kernels.gemm.

    gates = x @ W_ih.T + b_ih + h @ W_hh.T + b_hh            (B, 4H), computed by the caller
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

One grid-stride launch over (B, H): each thread reads its four gates and c, writes c' and h'.
The gates may also arrive as the K-split partial products of the two gate GEMMs, (S, B, 4H),
with the biases apart (`biases`): the cell sums them in order as it loads them, so the GEMMs
need no reduction launch of their own (proto.models.lstm.LSTMLM's `sum_in_cell`).
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import cuda, jit, launch, reshaped

THREADS = 256
HALF = np.float32(0.5)
_u = np.uint32
ZERO = np.float32(0.0)
# Partials a thread loads per gate before adding any (all its loads in flight at once: one
# memory round trip per chunk, not one per partial); the simulator pays per loop pass.
CHUNK = 2 if backend.SIMULATOR else 8
_VALS = 4 * CHUNK   # (a local array's size must be a module constant)
MAX_BIASES = 2


# ---------------------------------------------------------------------------- reference
def lstm_cell_ref(gates: np.ndarray, c_prev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(h', c') in float64, returned as float32."""
    g64 = gates.astype(np.float64)
    i, f, g, o = np.split(g64, 4, axis=1)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))  # noqa: E731
    c = sig(f) * c_prev.astype(np.float64) + sig(i) * np.tanh(g)
    return (sig(o) * np.tanh(c)).astype(np.float32), c.astype(np.float32)


# ---------------------------------------------------------------------------- kernel
@cuda.jit(device=True)
def _sigmoid(z):
    # The tanh form cannot overflow (1 / (1 + exp(-z)) takes exp of up to +88 and beyond).
    return HALF * math.tanh(HALF * z) + HALF


@jit("void(float32[:, :, ::1], float32[::1], float32[::1], int32, float32[:, ::1], "
     "float32[:, ::1], float32[:, ::1])",
     writes=("h_out", "c_out"), in_place=(("c_out", "c_prev"),))
def lstm_cell_kernel(gates, bias_a, bias_b, n_bias, c_prev, h_out, c_out):
    """gates (S, B, 4H): the gates are ((gates[0] + ... + gates[S-1]) + bias_a) + bias_b
    (the biases as n_bias says), summed in that order; then the cell. Each chunk's loads
    are issued before any is added."""
    vals = cuda.local.array(_VALS, np.float32)
    gate = cuda.local.array(4, np.float32)
    S, B, H = gates.shape[0], c_prev.shape[0], c_prev.shape[1]
    for e in range(cuda.grid(1), B * H, cuda.gridsize(1)):
        # unsigned indices: no negative-index wraparound test on each of the loads
        b, j = _u(e // H), _u(e % H)
        for q in range(4):
            gate[q] = ZERO
        for s0 in range(0, S, CHUNK):
            for q in range(4):
                for u in range(CHUNK):
                    if s0 + u < S:
                        vals[q * CHUNK + u] = gates[_u(s0 + u), b, _u(q * H) + j]
            for q in range(4):
                for u in range(CHUNK):
                    if s0 + u < S:
                        gate[q] += vals[q * CHUNK + u]
        for q in range(4):
            if n_bias > 0:
                gate[q] += bias_a[_u(q * H) + j]
            if n_bias > 1:
                gate[q] += bias_b[_u(q * H) + j]
        i = _sigmoid(gate[0])
        f = _sigmoid(gate[1])
        g = math.tanh(gate[2])
        o = _sigmoid(gate[3])
        c = f * c_prev[b, j] + i * g
        c_out[b, j] = c
        h_out[b, j] = o * math.tanh(c)


# ---------------------------------------------------------------------------- launcher
def lstm_cell(gates, c_prev, h_out, c_out, *, biases=(), stream=0) -> None:
    """c_out = sigmoid(f)*c_prev + sigmoid(i)*tanh(g), h_out = sigmoid(o)*tanh(c_out).

    gates (B, 4H) in PyTorch order i | f | g | o, or (S, B, 4H): S partial sums of the gates
    (the K splits of the gate GEMMs), added in order, then each of `biases` (at most two
    (4H,) arrays, e.g. b_ih, b_hh) in order. c_prev, h_out, c_out (B, H). c_out may be
    c_prev (in place: each element is read and written by one thread); no other overlap of
    an output with any argument is allowed (checked at launch, proto.device.backend.check_writes).
    """
    _check.device_array("c_prev", c_prev, ndim=2)
    B, H = c_prev.shape
    if getattr(gates, "ndim", 2) == 3:
        _check.device_array("gates", gates, shape=(None, B, 4 * H))
        part = gates
    else:
        _check.device_array("gates", gates, shape=(B, 4 * H))
        part = reshaped(gates, (1, B, 4 * H))
    _check.device_array("h_out", h_out, shape=(B, H))
    _check.device_array("c_out", c_out, shape=(B, H))
    biases = tuple(biases)
    if len(biases) > MAX_BIASES:
        raise ValueError(f"biases: at most {MAX_BIASES}, got {len(biases)}")
    for n, bias in enumerate(biases):
        _check.device_array(f"biases[{n}]", bias, shape=(4 * H,))
    # placeholders never read: a view of the gates, which no kernel writes
    unused = reshaped(part, (part.size,))
    bias_a, bias_b = (*biases, unused, unused)[:2]
    launch(lstm_cell_kernel, min(math.ceil(B * H / THREADS), 1024), THREADS,
           (part, bias_a, bias_b, np.int32(len(biases)), c_prev, h_out, c_out), stream)
