"""SGD with momentum, PyTorch semantics (torch.optim.SGD, dampening 0, not Nesterov):

    g = grad + weight_decay * param
    v = momentum * v + g          (PyTorch starts v at g; starting at 0 is the same)
    param -= lr * v
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit, launch


def sgd_ref(param, grad, velocity, *, lr, momentum, weight_decay=0.0):
    """-> (new_param, new_velocity), float32."""
    g = grad.astype(np.float64) + weight_decay * param.astype(np.float64)
    v = momentum * velocity.astype(np.float64) + g
    return (param - lr * v).astype(np.float32), v.astype(np.float32)


@jit("void(float32[::1], float32[::1], float32[::1], float32, float32, float32)",
     writes=("param", "velocity"))
def sgd_kernel(param, grad, velocity, lr, momentum, weight_decay):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, param.size, stride):
        p = param[i]
        v = momentum * velocity[i] + (grad[i] + weight_decay * p)
        velocity[i] = v
        param[i] = p - lr * v


def sgd_step(param, grad, velocity, *, lr, momentum, weight_decay=0.0, stream=0):
    """Update `param` and `velocity` in place from `grad` (all the same shape, three separate
    arrays: an overlap is refused at launch). lr, momentum, weight_decay: finite, >= 0."""
    for name, arr in (("param", param), ("grad", grad), ("velocity", velocity)):
        _check.device_array(name, arr)
    _check.same_shape([("param", param), ("grad", grad), ("velocity", velocity)])
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        _check.number(name, value, at_least=0)
    blocks, threads = _check.grid_stride_launch(param.size)
    launch(sgd_kernel, blocks, threads,
           (param.reshape(param.size), grad.reshape(grad.size), velocity.reshape(velocity.size),
            np.float32(lr), np.float32(momentum), np.float32(weight_decay)), stream)


def sgd_flops(n: int) -> float:
    return 4.0 * n
