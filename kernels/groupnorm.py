"""Group normalization of channels-first activations x (B, C, T), as torch.nn.GroupNorm(G, C)
with its affine: each (b, group)'s C/G channels times T steps normalized together, then a
scale and shift per channel,

    out[b, c, t] = (x[b, c, t] - mean[b, g]) * rstd[b, g] * gamma[c] + beta[c],  g = c // (C/G)

with the biased variance. Wav2Vec2's feature encoder normalizes its first convolution's 512
channels a group each (G = C = 512) over up to ~12800 steps, at batch 8: 4096 long groups.

A group's channels are consecutive, so a group is one contiguous run of C/G * T values: the
kernels view x as (B * G, C/G * T) rows and give each row a block. Two passes for the
statistics, as kernels.layernorm: the mean, then the mean of (x - mean)^2 (no E[x^2] -
mean^2 cancellation). A block's threads walk a channel's T steps (block_threads of T), so
groups of many short channels use their threads poorly; Wav2Vec2's are one long channel.

The backward recomputes the statistics from x. With xh = (x - mean) * rstd and
g = dy * gamma[c]:

    dx[b, c, t] = rstd * (g - mean_group(g) - xh * mean_group(g * xh))
    dgamma[c]   = sum over b, t of dy * xh,     dbeta[c] = sum over b, t of dy

The group's block sums each of its channels over t (block reductions): those are the
(b, c) partials of dgamma and dbeta, kept in a workspace, and the group's sums of g and
g * xh follow from them (sum over c of gamma[c] times them). A second launch adds the
partials over b in order. No atomics: the same bits every run.
"""
from __future__ import annotations


import numpy as np

from kernels import _check
from kernels._reduce import block_allreduce
from kernels.layernorm import MAX_THREADS, block_threads, row_stats, sum_partials
from proto.device import backend
from proto.device.backend import cuda, jit, launch

_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------- references
def _groupnorm_parts(x, groups: int, eps: float):
    """(xh, rstd) in float64: xh (B, C, T) normalized per group, rstd (B, C, 1) per channel."""
    x = np.asarray(x, np.float64)
    B, C, T = x.shape
    xg = x.reshape(B, groups, -1)
    mean = xg.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((xg - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xh = ((xg - mean) * rstd).reshape(B, C, T)
    return xh, np.repeat(rstd, C // groups, axis=1)


def groupnorm_ref(x, gamma, beta, *, groups: int, eps: float = 1e-5) -> np.ndarray:
    """torch.nn.GroupNorm(groups, C, eps)(x) for x (B, C, T), float64."""
    xh, _ = _groupnorm_parts(x, groups, eps)
    gamma, beta = (np.asarray(a, np.float64)[:, None] for a in (gamma, beta))
    return xh * gamma + beta


def groupnorm_bwd_ref(x, gamma, dy, *, groups: int, eps: float = 1e-5):
    """-> (dx (B, C, T), dgamma (C,), dbeta (C,)) of groupnorm_ref given dy = dL/dout,
    float64."""
    xh, rstd = _groupnorm_parts(x, groups, eps)
    dy = np.asarray(dy, np.float64)
    B, C, T = dy.shape
    g = dy * np.asarray(gamma, np.float64)[:, None]

    def group_mean(a):   # the mean over each (b, group), broadcast back to its elements
        m = a.reshape(B, groups, -1).mean(axis=-1, keepdims=True)
        return np.broadcast_to(m, (B, groups, C // groups * T)).reshape(B, C, T)

    dx = rstd * (g - group_mean(g) - xh * group_mean(g * xh))
    return dx, (dy * xh).sum(axis=(0, 2)), dy.sum(axis=(0, 2))


# ---------------------------------------------------------------------------- kernels
@jit("void(float32[:, ::1], float32[::1], float32[::1], float32[:, ::1], int32, float32)",
     writes=("out",), in_place=(("out", "x"),))
def groupnorm_kernel(x, gamma, beta, out, steps, eps):
    """A block a (b, group) row of x (B * G, C/G * steps); channel c0 + ci of the group is
    the row's ci-th run of `steps` values."""
    red = cuda.shared.array(64, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    cg = n // steps
    c0 = row % (gamma.shape[0] // cg) * cg
    mean, rstd = row_stats(x, row, n, red, eps)
    # Every element is read here and written by the same thread, after both reductions
    # (barriers every thread passes only once its statistics loads are done): out may be x.
    for ci in range(cg):
        gm = gamma[c0 + ci] * rstd
        bt = beta[c0 + ci]
        base = ci * steps
        for s in range(t, steps, step):
            out[row, base + s] = (x[row, base + s] - mean) * gm + bt


@jit("void(float32[:, ::1], float32[::1], float32[:, ::1], float32[:, ::1], float32[:, ::1], "
     "float32[:, ::1], int32, float32)", writes=("dx", "part_g", "part_b"))
def groupnorm_bwd_kernel(x, gamma, dy, dx, part_g, part_b, steps, eps):
    """A block a (b, group) row, as groupnorm_kernel. Per channel c of the group, the sums
    over t of dy * xh and dy (two block reductions, at alternating halves of red, so each
    reuse of a half follows a barrier after its last read) go to part_g[b, c], part_b[b, c];
    then dx from the group's sums of g and g * xh."""
    red = cuda.shared.array(64, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    cg = n // steps
    groups = gamma.shape[0] // cg
    b, c0 = row // groups, row % groups * cg
    inv_n = _ONE / np.float32(n)
    mean, rstd = row_stats(x, row, n, red, eps)
    s1 = _ZERO   # sum over the group of g = dy * gamma[c]
    s2 = _ZERO   # ... of g * xh
    for ci in range(cg):
        base = ci * steps
        a1 = _ZERO
        a2 = _ZERO
        for s in range(t, steps, step):
            d = dy[row, base + s]
            a1 += d
            a2 += d * ((x[row, base + s] - mean) * rstd)
        a1 = block_allreduce(a1, False, red, 0)
        a2 = block_allreduce(a2, False, red, 32)
        if t == 0:
            part_b[b, c0 + ci] = a1
            part_g[b, c0 + ci] = a2
        gm = gamma[c0 + ci]
        s1 += gm * a1
        s2 += gm * a2
    m1 = s1 * inv_n
    m2 = s2 * inv_n
    for ci in range(cg):
        gm = gamma[c0 + ci]
        base = ci * steps
        for s in range(t, steps, step):
            j = base + s
            xh = (x[row, j] - mean) * rstd
            dx[row, j] = rstd * (dy[row, j] * gm - m1 - xh * m2)


# ---------------------------------------------------------------------------- launchers
def _check_x(x, groups, eps) -> tuple[int, int, int, int, float]:
    """x (B, C, T) float32 with `groups` dividing C, and eps > 0: (B, C, T, G, eps)."""
    _check.device_array("x", x, ndim=3)
    B, C, T = x.shape
    G = _check.positive("groups", groups)
    if C % G:
        raise ValueError(f"groups: expected a divisor of x's {C} channels, got {G}")
    eps = _check.number("eps", eps, positive=True)
    if C // G * T > _INT32_MAX or B * G > _INT32_MAX:
        raise ValueError(f"x: shape {tuple(x.shape)} with {G} groups exceeds the kernels' "
                         f"int32 indices or grid")
    return B, C, T, G, eps


def groupnorm(x, gamma, beta, out, *, groups, eps=1e-5, stream=0):
    """out = GroupNorm(groups, C, eps)(x) with affine gamma, beta (C,); x, out (B, C, T),
    all float32, `groups` dividing C. out may be x (the very same array); any other overlap
    of out with an input is refused."""
    B, C, T, G, eps = _check_x(x, groups, eps)
    _check.device_array("gamma", gamma, shape=(C,))
    _check.device_array("beta", beta, shape=(C,))
    _check.device_array("out", out, shape=(B, C, T))
    rows = (B * G, C // G * T)
    launch(groupnorm_kernel, B * G, block_threads(T, MAX_THREADS),
           (backend.reshaped(x, rows), gamma, beta, backend.reshaped(out, rows), np.int32(T),
            np.float32(eps)), stream)


def groupnorm_bwd(x, gamma, dy, dx, dgamma, dbeta, *, groups, eps=1e-5, stream=0):
    """Gradients of out = groupnorm(x, gamma, beta) given dy = dL/dout: dx (B, C, T), and
    dgamma, dbeta (C,) summed over B and T (either may be None: not computed). x, dy, dx
    (B, C, T) and gamma (C,), all float32; the statistics are recomputed from x with the
    forward's groups and eps. Outputs are overwritten, and none may overlap an input or
    another output. Deterministic: the same bits every run."""
    B, C, T, G, eps = _check_x(x, groups, eps)
    _check.device_array("gamma", gamma, shape=(C,))
    _check.device_array("dy", dy, shape=(B, C, T))
    _check.device_array("dx", dx, shape=(B, C, T))
    for name, arr in (("dgamma", dgamma), ("dbeta", dbeta)):
        if arr is not None:
            _check.device_array(name, arr, shape=(C,))
    _check.separate({"dx": dx, "dgamma": dgamma, "dbeta": dbeta},
                    {"x": x, "gamma": gamma, "dy": dy})
    part_g = backend.empty((B, C), np.float32, "groupnorm_bwd.dgamma")
    part_b = backend.empty((B, C), np.float32, "groupnorm_bwd.dbeta")
    rows = (B * G, C // G * T)
    launch(groupnorm_bwd_kernel, B * G, block_threads(T, MAX_THREADS),
           (backend.reshaped(x, rows), gamma, backend.reshaped(dy, rows),
            backend.reshaped(dx, rows), part_g, part_b, np.int32(T), np.float32(eps)), stream)
    if dgamma is not None:
        sum_partials(part_g, dgamma, stream)
    if dbeta is not None:
        sum_partials(part_b, dbeta, stream)
