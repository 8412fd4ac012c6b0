"""GPT-J's float16 decode GEMMs (beam 5): the tensor-core kernel's and the SIMT trans_b
kernel's geometries against cuBLAS.

    PYTHONUNBUFFERED=1 python3 -m dev.bench.bench_half_decode 2>&1 | tee $OUT/half.txt

GPT-J holds its Linear weights (out, in), so every decode GEMM is trans_b. This sweeps, in
float16 on GPT-J's five shapes, M = 5 rows, with each shape's epilogue: first the
tensor-core kernel's geometries (make_decode_mma: warps a block along K, chunks of 32 a
warp's batch of loads, blocks an SM), MMA_HALF_CONFIG first; then the SIMT kernel's
(make_decode_nt: warps, columns a warp, K loads a lane a batch, blocks an SM; a batch of
loads must divide SPAN_MAX), float32's NT_CONFIG and float16's NT_HALF_CONFIG first. Each
is checked against the float64 reference within float16's bound first (twice the bound's
float32 part on tensor cores, whose additions truncate: tests/test_gemm_mma.py), then timed
in a CUDA graph over rotating weight copies (at least 2.5x the L2, so every launch reads
HBM), beside cuBLAS (torch, float16, tensor cores) on the same copies. Fractions: bytes over
time over the copy bandwidth measured here.
Writes $OUT/bench_half_decode.json when OUT is set.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

from dev.bench import bench_decode as bd
from kernels import gemm as G
from proto.device import backend, timing
from proto.device.backend import cuda

M, D, F, V = 5, 4096, 16384, 50400
RNG = np.random.default_rng(7)
SHAPES = [("qkv", D, 3 * D, False, False), ("out_proj", D, D, False, True),
          ("fc_in", D, F, True, False), ("fc_out", F, D, True, True), ("head", D, V, True, False)]
# (warps, columns a warp, K loads a lane a batch, blocks an SM); the first is the float32 one
NT_VARIANTS = [G.NT_CONFIG, G.NT_HALF_CONFIG, (8, 4, 8, 2), (8, 2, 12, 2), (8, 4, 12, 2),
               (8, 2, 24, 2), (8, 8, 6, 2)]
# the tensor-core kernel: (warps a block along K, chunks of 32 a warp's batch, blocks/SM)
MMA_VARIANTS = [G.MMA_HALF_CONFIG, (4, 2, 0), (4, 4, 0), (16, 2, 0), (8, 4, 0), (16, 1, 0),
                (32, 1, 0)]
GRID_CAPS = [None, 1 << 20]   # persistent (one wave of blocks) or a block per column tile
LOG: dict = {"device": None, "rows": [], "errors": []}
U16 = 2.0 ** -11


class HalfShape:
    def __init__(self, name, K, N, bias, accumulate):
        self.name, self.K, self.N, self.bias, self.accumulate = name, K, N, bias, accumulate
        w = (RNG.standard_normal((N, K), dtype=np.float32) / math.sqrt(K)).astype(np.float16)
        self.w_host = w
        self.copies = max(1, min(32, math.ceil(2.5 * bd.L2_BYTES / w.nbytes)))
        self.w = [cuda.to_device(w) for _ in range(self.copies)]
        self.x = [cuda.to_device(RNG.standard_normal((1, M, K)).astype(np.float16))
                  for _ in range(self.copies)]
        self.out = [cuda.to_device(np.zeros((1, M, N), np.float16)) for _ in range(self.copies)]
        self.b = cuda.to_device(RNG.standard_normal(N).astype(np.float16))

    def nbytes(self) -> int:
        return 2 * (self.K * self.N + M * self.K + M * self.N * (2 if self.accumulate else 1)
                    + (self.N if self.bias else 0))

    def call(self, dk, i, stream, grid_cap=None):
        w = self.w[i]
        bias = self.b if self.bias else w.reshape(w.size)
        G.decode(dk, self.x[i], w.reshape(1, *w.shape), self.out[i], bias, int(self.bias),
                 0, int(self.accumulate), 0, stream, None, grid_cap=grid_cap)

    def check(self, dk, grid_cap=None) -> float:
        """Max error over float16's bound (sums of K products in float32, one rounding at the
        store); raises where it exceeds 1 or two runs differ in a bit."""
        old = RNG.standard_normal((1, M, self.N)).astype(np.float16)
        runs = []
        for _ in range(2):
            self.out[0].copy_to_device(old if self.accumulate else np.full_like(old, np.nan))
            self.call(dk, 0, 0, grid_cap)
            runs.append(self.out[0].copy_to_host())
        if not np.array_equal(runs[0], runs[1], equal_nan=True):
            raise AssertionError("two runs differ: not deterministic")
        x = self.x[0].copy_to_host()[0].astype(np.float64)
        w = self.w_host.astype(np.float64)
        want = x @ w.T + (self.b.copy_to_host().astype(np.float64) if self.bias else 0)
        want = want + (old[0].astype(np.float64) if self.accumulate else 0)
        terms = np.abs(x) @ np.abs(w).T
        per_add = 2.0 ** (-23 if dk.config[0] == "mma" else -24)   # (truncating adds)
        bound = U16 * np.abs(want) + per_add * (self.K + 2) * terms + 2.0 ** -25
        ratio = np.abs(runs[0][0].astype(np.float64) - want) / bound
        if not np.all(ratio <= 1):   # (NaN, an unwritten element, fails too)
            raise AssertionError(f"error {np.nanmax(ratio):.3g} of the bound")
        return float(np.nanmax(ratio))


def bench(shape: HalfShape, dk, copy_GBps, grid_cap=None):
    try:
        ratio = shape.check(dk, grid_cap)
        us, spread, _ = bd.graph_time_us([lambda s, i=i: shape.call(dk, i, s, grid_cap)
                                          for i in range(shape.copies)])
    except Exception as exc:  # noqa: BLE001
        bd.log_error(f"{shape.name} {dk.config} cap={grid_cap}", exc)
        return
    blocks, splits, span = G.decode_plan(dk, 1, shape.N, shape.K, None, grid_cap)
    frac = shape.nbytes() / (us * 1e3) / copy_GBps
    LOG["rows"].append(dict(shape=shape.name, K=shape.K, N=shape.N, config=list(dk.config),
                            grid_cap=grid_cap, blocks=blocks, splits=splits, span=span,
                            us=round(us, 2), p10=round(spread[0], 2), p90=round(spread[1], 2),
                            fraction=round(frac, 4), error_over_bound=round(ratio, 3)))
    print(f"{shape.name:9s} {str(dk.config):22s} cap={str(grid_cap):8s} grid={blocks}x{splits} "
          f"{us:9.2f} us [{spread[0]:.2f}, {spread[1]:.2f}]  frac={frac:.3f}", flush=True)


def bench_cublas(shape: HalfShape, copy_GBps):
    torch = bd.torch
    try:
        ws = [torch.as_tensor(w, device="cuda") for w in shape.w]
        xs = [torch.as_tensor(x, device="cuda")[0] for x in shape.x]
        outs = [torch.as_tensor(o, device="cuda")[0] for o in shape.out]
        b = torch.as_tensor(shape.b, device="cuda")

        def op(i):   # what torch.nn.Linear runs (addmm with the bias), + the residual
            y = torch.nn.functional.linear(xs[i], ws[i], b if shape.bias else None)
            if shape.accumulate:
                outs[i].add_(y)
            else:
                outs[i].copy_(y)
        us, spread, _ = bd.graph_time_us([lambda s, i=i: op(i) for i in range(shape.copies)])
    except Exception as exc:  # noqa: BLE001
        bd.log_error(f"cublas {shape.name}", exc)
        return
    frac = shape.nbytes() / (us * 1e3) / copy_GBps
    LOG["rows"].append(dict(shape=shape.name, K=shape.K, N=shape.N, config="cublas",
                            us=round(us, 2), p10=round(spread[0], 2), p90=round(spread[1], 2),
                            fraction=round(frac, 4)))
    print(f"{shape.name:9s} {'cuBLAS (torch linear)':22s} {'':22s} {us:9.2f} us "
          f"[{spread[0]:.2f}, {spread[1]:.2f}]  frac={frac:.3f}", flush=True)


def main() -> None:
    import torch
    bd.torch = torch
    t0 = time.time()
    LOG["device"] = backend.describe()
    copy_GBps = timing.copy_bandwidth_GBps(1 << 30, warmup=20)
    LOG["copy_GBps"] = copy_GBps
    print(f"device {backend.describe()}, copy {copy_GBps:.0f} GB/s", flush=True)
    shapes = [HalfShape(*s) for s in SHAPES]
    for shape in shapes:
        bench_cublas(shape, copy_GBps)
    for cfg in MMA_VARIANTS:   # (first: the question this bench now asks)
        try:
            dk = G.make_decode_mma(*cfg)
        except Exception as exc:  # noqa: BLE001
            bd.log_error(f"compile make_decode_mma {cfg}", exc)
            continue
        for shape in shapes:
            bench(shape, dk, copy_GBps)
    for cfg in NT_VARIANTS:
        try:
            dk = G.make_decode_nt(*cfg, rows=M, dtype=np.float16)
        except Exception as exc:  # noqa: BLE001
            bd.log_error(f"compile make_decode_nt {cfg}", exc)
            continue
        for shape in shapes:
            for cap in GRID_CAPS:
                bench(shape, dk, copy_GBps, cap)
        print(f"{dk.config} done {time.time() - t0:.0f} s", flush=True)


def summary() -> None:
    print("\n==== best per shape (fraction of copy bandwidth) ====")
    for name, *_ in SHAPES:
        rows = [r for r in LOG["rows"] if r["shape"] == name]
        ours = [r for r in rows if r["config"] != "cublas"]
        cublas = next((r for r in rows if r["config"] == "cublas"), None)
        default = next((r for r in ours if tuple(r["config"]) == G.MMA_HALF.config), None)
        if ours:
            best = min(ours, key=lambda r: r["us"])
            print(f"{name:9s} best {best['config']} cap={best['grid_cap']} {best['us']} us "
                  f"frac={best['fraction']}; default {default and default['fraction']}; "
                  f"cuBLAS {cublas and cublas['fraction']}")
    print(f"errors: {len(LOG['errors'])}")
    for e in LOG["errors"]:
        print("  ", e)


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("bench_half_decode times a GPU: run it where CUDA is")
    try:
        main()
    finally:
        LOG["errors"] += bd.LOG["errors"]
        summary()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_half_decode.json"), "w") as f:
                json.dump(LOG, f, indent=1)
