"""Fully connected layer, PyTorch layout (weight (O, I)), forward and backward, on kernels.gemm.

    forward          y  = x @ W.T + b          gemm(x, W, y, bias=b, trans_b=True)  (+ fused ReLU)
    backward-data    dx = dy @ W               gemm(dy, W, dx)
    backward-weight  dW = dy.T @ x             gemm(dy, x, dW, trans_a=True)
                     db = dy summed over rows  kernels.layout.column_sum (split over rows,
                                               summed in order)
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from kernels.gemm import gemm
from kernels.layout import column_sum


# ---------------------------------------------------------------------------- references
def linear_ref(x, w, b=None, *, relu=False) -> np.ndarray:
    y = x.astype(np.float64) @ w.astype(np.float64).T
    y = y if b is None else y + b
    return (np.maximum(y, 0) if relu else y).astype(np.float32)


def linear_bwd_ref(x, w, dy):
    """-> (dx, dw, db)."""
    dy64 = dy.astype(np.float64)
    return ((dy64 @ w.astype(np.float64)).astype(np.float32),
            (dy64.T @ x.astype(np.float64)).astype(np.float32),
            dy64.sum(axis=0).astype(np.float32))


# ---------------------------------------------------------------------------- launchers
def _check_weight(name: str, w, x_features: int, name_x: str) -> int:
    _check.device_array(name, w, ndim=2)
    if w.shape[1] != x_features:
        raise ValueError(f"{name}: expected (O, {x_features}) to match {name_x}, got {tuple(w.shape)}")
    return w.shape[0]


def linear(x, w, b, out, *, relu=False, stream=0):
    """out (B, O) = x (B, I) @ w (O, I).T + b (O,) (b may be None), then max(., 0) if `relu`."""
    _check.device_array("x", x, ndim=2)
    O = _check_weight("w", w, x.shape[1], "x")
    _check.device_array("out", out, shape=(x.shape[0], O))
    relu = _check.flag("relu", relu)
    gemm(x, w, out, bias=b, act="relu" if relu else None, trans_b=True, stream=stream)


def linear_bwd_data(dy, w, dx, *, stream=0):
    """dx (B, I) = dy (B, O) @ w (O, I)."""
    _check.device_array("dx", dx, ndim=2)
    O = _check_weight("w", w, dx.shape[1], "dx")
    _check.device_array("dy", dy, shape=(dx.shape[0], O))
    gemm(dy, w, dx, stream=stream)


def linear_bwd_weight(x, dy, dw, db, *, stream=0):
    """dw (O, I) = dy.T @ x and db (O,) = column sums of dy (db may be None); overwritten."""
    _check.device_array("x", x, ndim=2)
    O = _check_weight("dw", dw, x.shape[1], "x")
    _check.device_array("dy", dy, shape=(x.shape[0], O))
    if db is not None:
        _check.device_array("db", db, shape=(O,))
    _check.separate({"dw": dw, "db": db}, {"x": x, "dy": dy})   # two launches: check both
    gemm(dy, x, dw, trans_a=True, stream=stream)
    if db is not None:
        column_sum(dy, db, stream=stream)


def linear_flops(B: int, I: int, O: int) -> float:
    return 2.0 * B * I * O
