"""LSTM cell pointwise step (PyTorch's gate order i, f, g, o); the gate GEMMs are kernels.gemm.

    gates = x @ W_ih.T + b_ih + h @ W_hh.T + b_hh            (B, 4H), computed by the caller
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

One grid-stride launch over (B, H): each thread reads its four gates and c, writes c' and h'.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.backend import cuda, jit, launch

THREADS = 256
HALF = np.float32(0.5)


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


@jit("void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1])",
     writes=("h_out", "c_out"), in_place=(("c_out", "c_prev"),))
def lstm_cell_kernel(gates, c_prev, h_out, c_out):
    B, H = c_prev.shape
    for e in range(cuda.grid(1), B * H, cuda.gridsize(1)):
        b = e // H
        j = e - b * H
        i = _sigmoid(gates[b, j])
        f = _sigmoid(gates[b, H + j])
        g = math.tanh(gates[b, 2 * H + j])
        o = _sigmoid(gates[b, 3 * H + j])
        c = f * c_prev[b, j] + i * g
        c_out[b, j] = c
        h_out[b, j] = o * math.tanh(c)


# ---------------------------------------------------------------------------- launcher
def lstm_cell(gates, c_prev, h_out, c_out, *, stream=0) -> None:
    """c_out = sigmoid(f)*c_prev + sigmoid(i)*tanh(g), h_out = sigmoid(o)*tanh(c_out).

    gates (B, 4H) in PyTorch order i | f | g | o; c_prev, h_out, c_out (B, H). c_out may be
    c_prev (in place: each element is read and written by one thread); no other overlap of
    an output with any argument is allowed (checked at launch, proto.backend.check_writes).
    """
    _check.device_array("c_prev", c_prev, ndim=2)
    B, H = c_prev.shape
    _check.device_array("gates", gates, shape=(B, 4 * H))
    _check.device_array("h_out", h_out, shape=(B, H))
    _check.device_array("c_out", c_out, shape=(B, H))
    launch(lstm_cell_kernel, min(math.ceil(B * H / THREADS), 1024), THREADS,
           (gates, c_prev, h_out, c_out), stream)
