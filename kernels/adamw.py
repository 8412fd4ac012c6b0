"""AdamW, PyTorch semantics (torch.optim.AdamW, amsgrad False, not maximize), with the step
count on the device:

    p *= 1 - lr * weight_decay
    m  = beta1 m + (1 - beta1) g
    v  = beta2 v + (1 - beta2) g^2
    p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The update runs inside a CUDA graph replayed every step, so t cannot be a launch argument (a
graph freezes its arguments): it lives in a (1,) int32 device array that `adamw_advance`
increments (one one-thread launch per optimizer step, before the update) and `adamw_step`
reads. Start it at 0; after k advances the update is the k-th. A t < 1 read on the device
makes every updated parameter NaN (m and v are still updated; they do not depend on t):
an optimizer that never advanced is loud, never a silent no-op. lr, the betas, eps and the
weight decay are launch arguments, frozen in a graph like any other.

Precision. Everything is float32. As in torch, the scalars 1 - beta1, 1 - beta2 and
1 - lr * weight_decay are formed in float64 on the host and rounded to float32 once (torch's
in-place ops round a Python scalar to the tensor's dtype). torch's bias corrections
1 - beta^t are float64 on the host; here they are float32 on the device, as
-expm1(t * log1p(-(1 - beta))): relative error a few float32 ulps (the tests bound the
update against float64 corrections to 2^-20 relative, for t up to 10^7). The direct
1 - powf(beta, t) would carry beta's own float32 rounding: 0.999f is 0.999 + 1.3e-8, which
makes 1 - 0.999f^1 off by 1.3e-5 relative.

Parameters, gradients and moments are one shape each, any C-contiguous shape (the model keeps
all its parameters in one flat buffer: one launch updates them all).
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit, launch, reshaped

_NAN, _ONE = np.float32(np.nan), np.float32(1.0)


# ---------------------------------------------------------------------------- reference
def adamw_ref(param, grad, m, v, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01):
    """One AdamW update at step count `step` (the value the device holds after advancing),
    in float64: -> (param, m, v), float64. A step < 1 gives NaN parameters."""
    p, g = np.asarray(param, np.float64), np.asarray(grad, np.float64)
    m = beta1 * np.asarray(m, np.float64) + (1.0 - beta1) * g
    v = beta2 * np.asarray(v, np.float64) + (1.0 - beta2) * g * g
    if step < 1:
        return np.full_like(p, np.nan), m, v
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    p = p * (1.0 - lr * weight_decay) - (lr / bc1) * m / (np.sqrt(v) / math.sqrt(bc2) + eps)
    return p, m, v


# ---------------------------------------------------------------------------- kernels
@jit("void(int32[::1])", writes=("step",))
def adamw_advance_kernel(step):
    if cuda.grid(1) == 0:
        step[0] = step[0] + 1


@cuda.jit(device=True)
def bias_correction(one_minus_beta, t):
    """1 - beta^t in float32, as -expm1(t log1p(-(1 - beta))): no cancellation, and beta
    enters only through 1 - beta (rounded once from float64 on the host). beta 0 (1 - beta
    rounds to 1 for any beta below 2^-25): 1, as float32 rounds 1 - beta^t for t >= 1."""
    if one_minus_beta >= _ONE:
        return _ONE
    return -math.expm1(t * math.log1p(-one_minus_beta))


@jit("void(float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], float32, "
     "float32, float32, float32, float32, float32, float32)",
     writes=("param", "m", "v"))
def adamw_kernel(param, grad, m, v, step, lr, beta1, omb1, beta2, omb2, eps, decay):
    """omb1, omb2: 1 - beta1, 1 - beta2; decay: 1 - lr * weight_decay."""
    t = step[0]
    tf = np.float32(t)
    bc1, bc2 = bias_correction(omb1, tf), bias_correction(omb2, tf)
    if t < 1:
        bc1 = bc2 = _NAN   # -> NaN step size and denominator -> NaN parameters
    step_size = lr / bc1
    sqrt_bc2 = math.sqrt(bc2)
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, param.size, stride):
        g = grad[i]
        mi = beta1 * m[i] + omb1 * g
        vi = beta2 * v[i] + omb2 * g * g
        p = param[i] * decay
        m[i] = mi
        v[i] = vi
        param[i] = p - step_size * (mi / (math.sqrt(vi) / sqrt_bc2 + eps))


# ---------------------------------------------------------------------------- launchers
def _check_step(step) -> None:
    _check.device_array("step", step, dtype=np.int32, shape=(1,))


def adamw_advance(step, *, stream=0):
    """step[0] += 1 on the device: once per optimizer step, before `adamw_step`."""
    _check_step(step)
    launch(adamw_advance_kernel, 1, 1, (step,), stream)


def adamw_step(param, grad, m, v, step, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.01, stream=0):
    """Update `param`, `m` (first moment) and `v` (second moment) in place from `grad`, at the
    step count held in `step` ((1,) int32 device array, read on the device; see the module
    doc). param, grad, m, v: float32 device arrays of one shape, four separate buffers (an
    overlap is refused before the launch). lr, eps, weight_decay: finite, >= 0; beta1,
    beta2: in [0, 1) (torch's ranges)."""
    for name, arr in (("param", param), ("grad", grad), ("m", m), ("v", v)):
        _check.device_array(name, arr)
    _check.same_shape([("param", param), ("grad", grad), ("m", m), ("v", v)])
    _check_step(step)
    lr = _check.number("lr", lr, at_least=0)
    eps = _check.number("eps", eps, at_least=0)
    weight_decay = _check.number("weight_decay", weight_decay, at_least=0)
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= _check.number(name, beta) < 1.0:
            raise ValueError(f"{name}: expected a number in [0, 1), got {beta!r}")
    beta1, beta2 = float(beta1), float(beta2)
    n = param.size
    blocks, threads = _check.grid_stride_launch(n)
    f32 = np.float32
    launch(adamw_kernel, blocks, threads,
           (reshaped(param, (n,)), reshaped(grad, (n,)), reshaped(m, (n,)), reshaped(v, (n,)),
            step, f32(lr), f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2),
            f32(eps), f32(1.0 - lr * weight_decay)), stream)


def adamw_flops(n: int) -> float:
    return 16.0 * n
