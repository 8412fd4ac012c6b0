"""ReLU forward and backward, elementwise over any contiguous float32 shape.

VGG runs ReLU in place (as torchvision's ReLU(inplace=True)), so backward reads the ReLU
*output*: y > 0 exactly where the input was > 0.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit, launch


# ---------------------------------------------------------------------------- references
def relu_ref(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0).astype(np.float32)


def relu_bwd_ref(y: np.ndarray, dy: np.ndarray) -> np.ndarray:
    return np.where(y > 0, dy, 0).astype(np.float32)


# ---------------------------------------------------------------------------- kernels
@jit("void(float32[::1], float32[::1])", writes=("out",), in_place=(("out", "x"),))
def relu_kernel(x, out):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, x.size, stride):
        v = x[i]
        # Not max(v, 0): on the GPU that is fmaxf, which turns NaN into 0 (NumPy keeps it).
        out[i] = np.float32(0.0) if v < np.float32(0.0) else v


@jit("void(float32[::1], float32[::1], float32[::1])", writes=("dx",), in_place=(("dx", "dy"),))
def relu_bwd_kernel(y, dy, dx):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, y.size, stride):
        dx[i] = dy[i] if y[i] > 0.0 else np.float32(0.0)


# ---------------------------------------------------------------------------- launchers
def relu(x, out, *, stream=0):
    """out = max(x, 0); `out` may be `x` (in place)."""
    _check.device_array("x", x)
    _check.device_array("out", out)
    _check.same_shape([("x", x), ("out", out)])
    blocks, threads = _check.grid_stride_launch(x.size)
    launch(relu_kernel, blocks, threads, (x.reshape(x.size), out.reshape(out.size)), stream)


def relu_bwd(y, dy, dx, *, stream=0):
    """dx = dy where y > 0, else 0. `y` is the ReLU output (or input); `dx` may be `dy`."""
    for name, arr in (("y", y), ("dy", dy), ("dx", dx)):
        _check.device_array(name, arr)
    _check.same_shape([("y", y), ("dy", dy), ("dx", dx)])
    blocks, threads = _check.grid_stride_launch(y.size)
    launch(relu_bwd_kernel, blocks, threads,
           (y.reshape(y.size), dy.reshape(dy.size), dx.reshape(dx.size)), stream)


def relu_flops(n: int) -> float:
    return float(n)
