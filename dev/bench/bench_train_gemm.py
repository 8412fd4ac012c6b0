"""Wav2Vec2's training GEMMs in float32: the tiled kernel's tile shapes, on SIMT cores and on
tensor cores (3xTF32), against cuBLAS.

    PYTHONUNBUFFERED=1 python3 -m dev.bench.bench_train_gemm 2>&1 | tee $OUT/train_gemm.txt
    python3 -m dev.bench.bench_train_gemm 120 199 --mma   # frame counts; tensor cores alone
    python3 -m dev.bench.bench_train_gemm 120 199 65 --mma --write   # kernels/tuned/<gpu>.json

Why: a Wav2Vec2 training step spends half its GPU time in the tiled GEMMs
(results/h200/profiles/wav2vec2_profile_04e0405.txt: 26 of 52 ms at 120 frames, against
about 17 for cuBLAS's), and the step's goal (1.3x transformers' eager step) needs them near
cuBLAS's speed. At batch 8 and 120 to 199 frames a product has 960 to 1592 rows against 768
or 3072 columns: too few 128 x 128 tiles for two blocks an SM, so `tiled_tile` gives the
64 x 64 tile (4 x 4 outputs a thread, half the multiply-adds per shared load of the wide
tile's 8 x 8) and `tiled_plan` splits K in two, a reduction launch each.

Per shape (a transformer layer's Linear forward, backward-data and backward-weight, as
kernels.linear calls them) and frame count: the library's choice, then every tile and
staging in VARIANTS whole (no K split) and split as `tiled_plan` splits it, and for the
products not already NT the tiles of VIA_NT run on operands first transposed to NT (the
transposes timed with the product), and the same tiles split with the partials summed by
the GEMM's last block per tile instead of a reduction launch ("fold", directly and via NT),
each checked against float64 first
(the float32 bound of a sum of K products: K * 2^-24 of sum |a||b|, twice for the splits'
sum), timed in a CUDA graph (median of 7 samples of 5 replays, p10 and p90), beside
torch.matmul in float32 with TF32 off on the same operands. TFLOP/s and the time over
cuBLAS's. GPU only.

Decision rule: with --write, per shape and frame count, the fastest variant replaces the
library's default (`gemm.tiled_launch_plan`, untuned) where it is more than MARGIN faster
and passed its float64 check: kernels/tuned/<gpu>.json, which `gemm.tiled` reads at import
(kernels.tuning, section gemm); then wav2vec2_train runs again to see what the step gains. The
"default" row is always the untuned choice, whatever the tuned file says.
"""
from __future__ import annotations

import sys

import numpy as np

from dev.bench import bench_decode as bd
from kernels import gemm as G
from kernels._tile import Tiles
from proto.device import backend
from proto.device.backend import cuda

B, D, F = 8, 768, 3072
FRAMES = (120,)   # the epoch's median batch (`python -m dev.bench.bench_train_gemm 120 199`)
# ((bm, bn, bk, tm, tn), stages): 8 x 8 outputs a thread on smaller tiles (more blocks than
# the wide tile, its multiply-adds per shared load), the library's two, and each staged
# through registers (0) or by cp.async in a ring of buffers (cuBLAS's SIMT kernels: 64 x 64
# tiles of 128 threads, 3 stages; 128 x 256, 4)
VARIANTS = [(G.TILE, 0), (G.WIDE_TILE, 0), (Tiles(64, 64, 8, 8, 8), 0),
            (Tiles(128, 64, 8, 8, 8), 0), (G.TILE, 3), (G.WIDE_TILE, 3),
            (Tiles(64, 64, 8, 4, 8), 4), (Tiles(128, 64, 8, 8, 8), 3),
            # on tensor cores, three TF32 products a float32 one (kernels._tf32): warp tiles
            # of 64 x 32 (8 x 8 accumulators a lane), 32 x 32 and 32 x 16; by cp.async the
            # operands split where each warp reads them, through registers (0) once, as
            # they are staged (bk 8 for the 128-wide tiles: both parts fit 48 KB)
            (Tiles(128, 128, 8, 8, 8, True), 3), (Tiles(128, 128, 8, 8, 8, True), 0),
            (Tiles(128, 64, 8, 8, 4, True), 0), (Tiles(128, 64, 16, 8, 4, True), 0),
            (Tiles(64, 128, 8, 4, 8, True), 0), (Tiles(64, 128, 16, 4, 8, True), 3),
            (Tiles(64, 64, 16, 4, 4, True), 0)]
# (At c1693fa on the H100 no product took a SIMT tile but the default, nor the 128 x 64 x 16
# or 64 x 64 x 16 tensor tiles by cp.async: --mma times the default and the tensor tiles
# alone, which keeps `tune` within its minutes now that it also times VIA_NT and fold.)


# The NT tensor tiles that ran at cuBLAS's time on NT products (H100, c1693fa: fc1 forward
# 129.3 us against 129.5) while the same tiles took 1.3-2x it on NN and TN: tried on the
# other layouts too, their operands first transposed into K-contiguous scratch
# (gemm._as_nt, `via_nt`), which costs a copy of each operand
VIA_NT = [(Tiles(128, 64, 16, 8, 4, True), 0), (Tiles(64, 128, 8, 4, 8, True), 0),
          (Tiles(128, 128, 8, 8, 8, True), 0), (Tiles(64, 64, 16, 4, 4, True), 0)]

MARGIN = 0.03   # --write: a variant replaces the default on a shape only if this much faster


def shapes(M: int):
    """(name, M, N, K, trans_a, trans_b) of one layer's Linear products at M = B x frames:
    the q, k and v projections (one product), the out projection and the two of the MLP."""
    out = []
    for name, i, o in (("qkv", D, 3 * D), ("out", D, D), ("fc1", D, F), ("fc2", F, D)):
        out += [(f"{name} fwd", M, o, i, False, True),      # x (M, I) @ W (O, I).T
                (f"{name} bwd_data", M, i, o, False, False),  # dy (M, O) @ W (O, I)
                (f"{name} bwd_weight", o, i, M, True, False)]  # dy (M, O).T @ x (M, I)
    return out


def operands(rng, M, N, K, trans_a, trans_b):
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    return a, b


def reference(a, b, trans_a, trans_b):
    """(op(a) @ op(b), |op(a)| @ |op(b)|, K) in float64: computed once a shape, every
    variant's result is checked against it."""
    a64 = a.astype(np.float64).T if trans_a else a.astype(np.float64)
    b64 = b.astype(np.float64).T if trans_b else b.astype(np.float64)
    return a64 @ b64, np.abs(a64) @ np.abs(b64), a64.shape[1]


def error_over_bound(got, ref, splits, mma=False) -> float:
    """The largest error against the float64 `reference` over its bound: (K + splits) *
    2^-24 of sum |a||b| for float32's multiply-adds; on tensor cores (`mma`) twice the K
    term (the additions truncate) plus 12 * 2^-24 for the split operands (kernels._tf32)."""
    want, mag, k = ref
    bound = ((2 * k + 12 if mma else k) + splits) * 2.0 ** -24 * mag + 1e-30
    return float(np.max(np.abs(got.astype(np.float64) - want) / bound))


def main() -> None:
    import torch
    bd.torch = torch
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device {backend.describe()}; torch {torch.__version__}, TF32 off", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    args = sys.argv[1:]
    only_mma = "--mma" in args   # the default (as routed) and the tensor-core tiles alone
    frames_list = [int(a) for a in args if not a.startswith("--")] or FRAMES
    for frames in frames_list:
        for name, M, N, K, ta, tb in shapes(B * frames):
            a, b = operands(rng, M, N, K, ta, tb)
            ref = reference(a, b, ta, tb)
            unwritten = np.full((M, N), np.nan, np.float32)   # (no variant checks another's)
            da, db = cuda.to_device(a), cuda.to_device(b)
            out = cuda.device_array((M, N), np.float32)
            a3, b3, out3 = (x.reshape(1, *x.shape) for x in (da, db, out))
            bias = db.reshape(db.size)
            flops = 2.0 * M * N * K
            ta_, tb_ = torch.as_tensor(da, device="cuda"), torch.as_tensor(db, device="cuda")
            to = torch.as_tensor(out, device="cuda")
            opa, opb = (ta_.T if ta else ta_), (tb_.T if tb else tb_)
            us, spread, _ = bd.graph_time_us([lambda s: torch.matmul(opa, opb, out=to)])
            cublas = us
            print(f"\n{name:16s} M={M} N={N} K={K}  cuBLAS {us:8.1f} us "
                  f"{flops / us / 1e6:6.1f} TFLOP/s", flush=True)
            default = G.tiled_launch_plan(1, M, N, K)   # (the untuned choice)
            whole = 1 if default[0] == G.WIDE_TILE else None
            def variant(t, stages, target, via_nt=False, fold=False):
                how = "split fold" if fold else "whole" if target == 1 else "split"
                return (f"{tuple(t)} s{stages} {how}{' via NT' if via_nt else ''}", t, stages,
                        target, via_nt, fold)
            not_nt = ta or not tb   # (the NT route: only for products not NT already)
            routes = (False, True) if not_nt else (False,)
            variants = [("default", default[0], 0, whole, False, False)]
            variants += [variant(t, stages, target) for t, stages in VARIANTS
                         for target in (1, None) if t.mma or not only_mma]
            variants += [variant(t, stages, target, True) for t, stages in VIA_NT
                         for target in (1, None) if not_nt]
            variants += [variant(t, stages, None, nt, True) for t, stages in VIA_NT
                         for nt in routes
                         if G.tiled_plan(t, 1, M, N, K)[0] > 1]   # (K split: a sum to fold)
            for label, t, stages, target, via_nt, fold in variants:
                try:
                    def call(s, t=t, stages=stages, target=target, via_nt=via_nt, fold=fold):
                        G.tiled(a3, b3, out3, bias, 0, 0, 0, int(ta), int(tb), s,
                                target_blocks=target, tile=t, stages=stages, via_nt=via_nt,
                                fold=fold)
                    out.copy_to_device(unwritten)
                    call(0)
                    splits = G.tiled_plan(t, 1, M, N, K, target)[0]
                    err = error_over_bound(out.copy_to_host(), ref, splits, mma=t.mma)
                    if not err <= 1:
                        raise AssertionError(f"error {err:.3g} of the bound")
                    us, spread, _ = bd.graph_time_us([call])
                except Exception as exc:  # noqa: BLE001
                    bd.log_error(f"{name} {frames} {label}", exc)
                    continue
                if label == "default":
                    label = f"default {tuple(default[0])} x{default[1]}"
                rows.append(dict(frames=frames, shape=name, variant=label, us=us,
                                 over_cublas=us / cublas, m=M, n=N, k=K, trans_a=ta,
                                 trans_b=tb, tile=t, stages=stages, whole=target == 1,
                                 via_nt=via_nt, fold=fold and splits > 1))
                print(f"  {label:47s} splits {splits:2d} {us:8.1f} us [{spread[0]:.1f}, "
                      f"{spread[1]:.1f}] {flops / us / 1e6:6.1f} TFLOP/s  "
                      f"{us / cublas:5.2f}x cuBLAS", flush=True)
        if "--write" in args:   # after each frame count: a run stopped early keeps those done
            write_tuned(rows)
    print("\n==== per frame count: the summed time of every shape, by variant, over cuBLAS's ====")
    for frames in frames_list:
        per = {}
        for r in rows:
            if r["frames"] == frames:
                key = "default" if r["variant"].startswith("default") else r["variant"]
                per.setdefault(key, []).append(r)
        n = len(shapes(1))
        for key, rs in sorted(per.items(), key=lambda kv: sum(r["us"] for r in kv[1])):
            if len(rs) == n:
                total = sum(r["us"] for r in rs)
                over = total / sum(r["us"] / r["over_cublas"] for r in rs)
                print(f"  T={frames} {key:36s} {total:9.1f} us  {over:5.2f}x cuBLAS")
        for how, keep in (("direct", lambda r: not r["via_nt"] and not r["fold"]),
                          ("any", lambda r: True)):
            best = sum(min(r["us"] for r in rows if r["frames"] == frames and r["shape"] == s
                           and keep(r)) for s, *_ in shapes(1))
            print(f"  T={frames} best tile per shape, {how:12s} {best:9.1f} us")
    print(f"errors: {len(bd.LOG['errors'])}")
    for e in bd.LOG["errors"]:
        print("  ", e)


def tuned_entries(rows: list[dict]) -> list[dict]:
    """For each shape and frame count, the fastest variant where it beats the default by
    more than MARGIN (every row here passed its float64 check): kernels.tuning's
    entries."""
    entries = []
    for key in dict.fromkeys((r["frames"], r["shape"]) for r in rows):
        rs = [r for r in rows if (r["frames"], r["shape"]) == key]
        default = [r for r in rs if r["variant"].startswith("default")]
        best = min(rs, key=lambda r: r["us"])
        if default and best["us"] < (1 - MARGIN) * default[0]["us"]:
            entries.append(dict(shape=best["shape"], trans_a=best["trans_a"],
                                trans_b=best["trans_b"], m=best["m"], n=best["n"],
                                k=best["k"], tile=list(best["tile"]), stages=best["stages"],
                                whole=best["whole"], via_nt=best["via_nt"],
                                fold=best["fold"],
                                us=round(best["us"], 1),
                                default_us=round(default[0]["us"], 1)))
    return entries


def write_tuned(rows: list[dict]) -> None:
    from kernels import tuning
    entries = tuned_entries(rows)
    path = tuning.write_section(backend.device_name(), "gemm", entries,
                                "python3 -m dev.bench.bench_train_gemm " + " ".join(sys.argv[1:]))
    print(f"wrote {len(entries)} gemm entries to {path}")

if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("bench_train_gemm times a GPU: run it where CUDA is")
    main()
