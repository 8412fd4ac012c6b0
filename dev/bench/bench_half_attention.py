"""A decode attention in float16 (beam 5, a 1024-position cache, the row table of beam
search): GPT-J-6B's (16 heads of 256) or GPT-2 small's (12 of 64). The strided kernel, the
16-byte-load kernels (a lane's 8 dims one load: GPT-J's grouped kernel, GPT-2's packed group
kernel, with and without the row table) over their geometries and split targets, and
PyTorch's scaled_dot_product_attention on the same live K and V (what PtGraph's step runs;
no row table), each checked against float64 and timed in a CUDA graph over rotating copies
of the caches (3x the L2), as a fraction of copy bandwidth over the live K and V.

    PYTHONPATH=. python3 -m dev.bench.bench_half_attention [--model gpt2] [POSITION ...]
                                                           (default gptj at 512)

GPU only. The H100 profile of GPT-J's step (results/h100/profiles/gptj_profile_5c4cb09.txt)
had the strided kernel at 85 us a layer at position 512 against cuDNN's flash kernel's 26.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from dev.bench import bench_decode as bd
from kernels import attention as A
from proto.device import backend
from proto.device.backend import cuda

B, TMAX = 5, 1024
HALF = np.float16
# (heads, head dim, the 16-byte-load variants to time: make one from a geometry)
MODELS = {
    "gptj": (16, 256, [lambda rows, g=g: A.make_attention(*g, use_rows=rows, dtype=HALF,
                                                          grouped=True)
                       for g in [(8, p, w, mb) for p, w, mb in
                                 [(4, 8, 3), (4, 8, 0), (2, 8, 0), (8, 8, 0), (8, 4, 0),
                                  (4, 4, 4), (2, 4, 0)]]]),
    "gpt2": (12, 64, [lambda rows, g=g: A.make_attention_groups(*g, dtype=HALF, use_rows=rows,
                                                                packed=True)
                      for g in [(8, 8, p, w, mb) for p, w, mb in
                                [(4, 4, 4), (2, 4, 0), (8, 4, 0), (4, 8, 0), (2, 8, 0),
                                 (4, 2, 0)]]]),
}
H, HD = MODELS["gptj"][:2]   # (main sets the model's)
TARGETS = [None, 512, 2048]


class Case:
    def __init__(self, rng):
        C = H * HD
        cache_bytes = 2 * B * H * TMAX * HD * 2
        self.copies = max(2, math.ceil(3 * bd.L2_BYTES / cache_bytes))
        self.k_host = rng.standard_normal((B, H, TMAX, HD)).astype(HALF)
        self.v_host = rng.standard_normal((B, H, TMAX, HD)).astype(HALF)
        self.qkv_host = rng.standard_normal((B, 1, 3 * C)).astype(HALF)
        self.k = [cuda.to_device(self.k_host) for _ in range(self.copies)]
        self.v = [cuda.to_device(self.v_host) for _ in range(self.copies)]
        self.qkv = [cuda.to_device(self.qkv_host) for _ in range(self.copies)]
        self.out = [cuda.device_array((B, 1, C), HALF) for _ in range(self.copies)]
        self.pos = cuda.to_device(np.array([0], np.int32))
        # every position in its own sequence's row: the plain result, the table's cost
        self.rows = cuda.to_device(np.repeat(np.arange(B, dtype=np.int32)[:, None], TMAX, 1))

    def call(self, variant, i, stream, target):
        bd.launch_attention(variant, self.qkv[i], self.k[i], self.v[i], self.pos, self.out[i],
                            self.rows, target, stream)

    def reference(self, pos):
        q = self.qkv_host.astype(np.float64).reshape(B, 3, H, HD)
        k = self.k_host.astype(np.float64)[:, :, :pos + 1].copy()
        v = self.v_host.astype(np.float64)[:, :, :pos + 1].copy()
        k[:, :, pos], v[:, :, pos] = q[:, 1], q[:, 2]
        s = np.einsum("bhd,bhpd->bhp", q[:, 0], k) / math.sqrt(HD)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhp,bhpd->bhd", p / p.sum(-1, keepdims=True), v).reshape(B, 1, H * HD)

    def check(self, variant, pos, target) -> float:
        self.pos.copy_to_device(np.array([pos], np.int32))
        self.k[0].copy_to_device(self.k_host)
        self.v[0].copy_to_device(self.v_host)
        self.out[0].copy_to_device(np.full((B, 1, H * HD), np.nan, HALF))
        self.call(variant, 0, 0, target)
        got = self.out[0].copy_to_host().astype(np.float64)
        want = self.reference(pos)
        err = float(np.nanmax(np.abs(got - want))) if not np.isnan(got).any() else math.inf
        if err > 4 * 2.0 ** -11 * np.abs(want).max() + 1e-3:
            raise AssertionError(f"max error {err:.3g}")
        return err


def time_ours(case, variant, pos, target, copy_GBps):
    label = f"{variant.config}{' rows' if variant.use_rows else ''} target={target}"
    try:
        err = case.check(variant, pos, target)
        case.pos.copy_to_device(np.array([pos], np.int32))
        fns = [lambda s, i=i: case.call(variant, i, s, target) for i in range(case.copies)]
        us, spread, _ = bd.graph_time_us(fns)
    except Exception as exc:  # noqa: BLE001
        print(f"ERROR {label}: {type(exc).__name__}: {exc}")
        return
    _, splits, span = A._plan(B, H, 1, TMAX, HD, variant, target)
    kv = 2 * B * H * (pos + 1) * HD * 2
    print(f"{label:40s} pos {pos:4d} splits {splits:3d} span {span:4d}  {us:7.2f} us "
          f"[{spread[0]:.2f}, {spread[1]:.2f}]  frac {kv / (us * 1e3) / copy_GBps:.3f}  "
          f"err {err:.2e}", flush=True)


def time_torch(pos, copy_GBps):
    torch = bd.torch
    F = torch.nn.functional
    copies = 3
    q = [torch.randn(B, H, 1, HD, device="cuda", dtype=torch.float16) for _ in range(copies)]
    kv = [(torch.randn(B, H, pos + 1, HD, device="cuda", dtype=torch.float16),
           torch.randn(B, H, pos + 1, HD, device="cuda", dtype=torch.float16))
          for _ in range(copies)]
    fns = [lambda s, i=i: F.scaled_dot_product_attention(q[i], *kv[i]) for i in range(copies)]
    us, spread, _ = bd.graph_time_us(fns)
    nbytes = 2 * B * H * (pos + 1) * HD * 2
    print(f"{'torch scaled_dot_product_attention':40s} pos {pos:4d}                        "
          f"{us:7.2f} us [{spread[0]:.2f}, {spread[1]:.2f}]  frac "
          f"{nbytes / (us * 1e3) / copy_GBps:.3f}", flush=True)


def main(model: str, positions: list[int]) -> None:
    import torch
    global H, HD
    H, HD, variants = MODELS[model]
    bd.torch = torch
    print(f"device: {backend.device_name()}  {model}  B {B}  H {H}  hd {HD}  Tmax {TMAX}  "
          f"float16")
    copy_GBps = bd.read_bandwidth_GBps()
    print(f"copy bandwidth {copy_GBps:.0f} GB/s")
    case = Case(np.random.default_rng(0))
    # (unaligned: the strided forms, which the 16-byte loads replace)
    strided = [A.kernel_for(HD, rows=rows, dtype=HALF) for rows in (True, False)]
    shipped = [A.kernel_for(HD, rows=rows, dtype=HALF, aligned=True) for rows in (True, False)]
    for pos in positions:
        time_torch(pos, copy_GBps)
        for variant in strided + shipped:
            time_ours(case, variant, pos, None, copy_GBps)
        for make in variants:
            for rows in (True, False):
                variant = make(rows)
                for target in TARGETS:
                    time_ours(case, variant, pos, target, copy_GBps)


if __name__ == "__main__":
    args = sys.argv[1:]
    name = "gptj"
    if args[:1] == ["--model"]:
        name, args = args[1], args[2:]
    if name not in MODELS:
        sys.exit(f"--model: one of {sorted(MODELS)}, got {name!r}")
    main(name, [int(a) for a in args] or [512])
