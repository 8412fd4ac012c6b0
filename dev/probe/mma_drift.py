"""How far a float32 GEMM on tensor cores (3xTF32) drifts from the exact sum, by a NumPy model
of the H100's mma.m16n8k8 TF32 instruction: every product exact, every term truncated toward
zero below the largest one's 25th fraction bit, the sum rounded toward zero to float32
(MMA-Sim's model, Xie et al. 2025; kernels._tf32's simulator runs the same rule one output
at a time). CPU only, a few seconds.

    python -m dev.probe.mma_drift

For K = 768 and 3072, normal and positive operands, three ways to sum K: `chain` (the
running sum through the instruction, each k step's three mma adding to it: the tensor tiles
before the fix, and CUTLASS's OpMultiplyAddFastF32), `fresh` (each k step's three mma into a
zero accumulator, added to the running sum in float32: kernels._tf32._mma3) and `ffma`
(float32 multiply-adds rounded to nearest, as cuBLAS's SIMT kernels). Errors are in units of
u = 2**-24 times sum |a||b|: the mean signed toward zero (the drift) and the root mean square.
"""
from __future__ import annotations

import numpy as np


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 to TF32, to nearest, ties away (cvt.rna.tf32.f32)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def toward_zero32(s: np.ndarray) -> np.ndarray:
    f = s.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(s)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def mma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """D = A B + C by the model: a (M, 8) and b (8, N) TF32 values, c (M, N) float32."""
    terms = np.concatenate([c.astype(np.float64)[..., None],
                            a.astype(np.float64)[:, None, :] * b.astype(np.float64).T[None]], -1)
    exponent = np.where(terms == 0, -9999, np.frexp(terms)[1] - 1)
    quantum = np.ldexp(1.0, exponent.max(-1, keepdims=True) - 25)
    return toward_zero32((np.trunc(terms / quantum) * quantum).sum(-1))


def gemm(a: np.ndarray, b: np.ndarray, way: str) -> np.ndarray:
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(0, a.shape[1], 8):
        x, y = a[:, k:k + 8], b[k:k + 8]
        if way == "ffma":
            for j in range(x.shape[1]):
                acc = (acc + x[:, j:j + 1].astype(np.float64) * y[j:j + 1]).astype(np.float32)
            continue
        xb, yb = tf32(x), tf32(y)
        xs, ys = tf32(x - xb), tf32(y - yb)
        d = acc if way == "chain" else np.zeros_like(acc)
        d = mma(xb, yb, mma(xb, ys, mma(xs, yb, d)))   # the smallest first, as _mma3
        acc = d if way == "chain" else (acc + d).astype(np.float32)
    return acc


def main() -> None:
    rng = np.random.default_rng(0)
    u = 2.0 ** -24
    for k in (768, 3072):
        for kind in ("normal", "positive"):
            if kind == "normal":
                a, b = rng.standard_normal((48, k)), rng.standard_normal((k, 48))
            else:
                a, b = rng.uniform(0.5, 1, (48, k)), rng.uniform(0.5, 1, (k, 48))
            a, b = a.astype(np.float32), b.astype(np.float32)
            exact = a.astype(np.float64) @ b.astype(np.float64)
            size = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
            for way in ("chain", "fresh", "ffma"):
                err = (gemm(a, b, way) - exact) / size
                drift = float(np.mean(err * np.sign(exact))) / u
                rms = float(np.sqrt(np.mean(err ** 2))) / u
                print(f"K {k:5d} {kind:8s} {way:6s} drift {drift:8.2f} u   rms {rms:7.2f} u")


if __name__ == "__main__":
    main()
