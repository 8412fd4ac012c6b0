"""GPT-2 decode-step kernels on the GPU: check every variant, then time them against the
memory-bandwidth floor (dev/notes/decode.md records the runs).

    PYTHONUNBUFFERED=1 python3 -m dev.bench.bench_decode [--quick] 2>&1 | tee $OUT/bench.txt

Shapes: M = 5 rows (beam 5) against GPT-2 small's decode GEMMs (768x2304 qkv, 768x768 attention
projection, 768x3072 fc, 3072x768 MLP projection with their epilogues, the tied 768x50257 head
as trans_b, the same in [K, N] layout), the same with layer norm fused, and decode attention
(B=5, H=12, hd=64, a 1024-position cache) at several positions. Every variant is first run
on fresh random data with a NaN-poisoned output and compared with the float64 reference
(and run twice: bitwise equal), then timed.

Timing: each op is captured R times in one CUDA graph (torch.cuda.CUDAGraph; the Numba
kernels launch on its capture stream), R rotating copies of the weights or caches whose total
is at least 2.5x the L2, so every launch reads from HBM as in a model step. Time per op =
replay time / R: the kernels plus the graph's per-node gaps, what a step pays. The same
graphs under torch.profiler give the kernels' own time. Fractions are bytes (weights +
activations, or live K/V) / time over the device-to-device copy bandwidth measured here.
Writes $OUT/bench_decode.json when OUT is set.
"""
from __future__ import annotations

import json
import math
import re
import os
import sys
import time

import numpy as np

from proto.device import backend, timing
from proto.device.backend import cuda, jit, launch
from kernels import _check
from kernels import attention as A
from kernels import gemm as G
from kernels import layernorm as LN

RNG = np.random.default_rng(12345)
M, D, V = 5, 768, 50257
L2_BYTES = 60 << 20
LOG: dict = {"device": None, "gemm": [], "attention": [], "layernorm": [], "errors": []}


def log_error(what: str, exc: BaseException) -> None:
    msg = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print("ERROR", msg)
    LOG["errors"].append(msg)


# ---------------------------------------------------------------------------- timing
torch = None  # imported by main(): graphs and the profiler come from it (GPU machine only)


def _numba_stream():
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


GRAPHS_OK = [True]  # cleared when capture fails once: then eager timing (and the profiler)


def _profile_kernels_us(run) -> float | None:
    """Sum of the GPU kernels' own durations while `run()` executes (torch.profiler)."""
    try:
        from torch.profiler import ProfilerActivity, profile as tprofile
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        total, by_name = 0.0, {}
        for evt in prof.events():
            if "CUDA" in str(getattr(evt, "device_type", "")):
                us = evt.time_range.elapsed_us()
                total += us
                found = re.findall(r"[a-z_]+_kernel", evt.name)
                name = found[-1] if found else evt.name[:40]
                by_name[name] = by_name.get(name, 0.0) + us
        LOG.setdefault("profiles", []).append(by_name)
        print("   kernels:", {k: round(v, 1) for k, v in by_name.items()})
        return total or None
    except Exception as exc:  # noqa: BLE001  (the profiler is a bonus)
        log_error("profiler", exc)
        return None


def graph_time_us(fns, samples: int = 7, replays: int = 5, profile: bool = False):
    """(median us per op, (p10, p90), kernel-only us per op or None) of `fns` (each takes a
    Numba stream and launches one op) captured in order into one graph and replayed. If
    capture fails, the same launched eagerly back to back (host overhead included)."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up outside the capture (workspaces, first calls)
        s = _numba_stream()
        for fn in fns:
            fn(s)
    torch.cuda.synchronize()
    g = None
    if GRAPHS_OK[0]:
        try:
            g = torch.cuda.CUDAGraph()
            with cuda.defer_cleanup(), torch.cuda.graph(g, capture_error_mode="thread_local"):
                s = _numba_stream()
                for fn in fns:
                    fn(s)
            g.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            log_error("graph capture (falling back to eager timing)", exc)
            GRAPHS_OK[0] = False
            g = None
            torch.cuda.synchronize()

    def run_once():
        if g is not None:
            g.replay()
        else:
            s0 = _numba_stream()
            for fn in fns:
                fn(s0)

    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run_once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    kernel_us = None
    if profile:
        total = _profile_kernels_us(run_once)
        kernel_us = total / len(fns) if total else None
    g = None  # frees the graph
    t = np.asarray(times)
    spread = (float(np.percentile(t, 10)), float(np.percentile(t, 90)))
    return float(np.median(t)), spread, kernel_us


def read_bandwidth_GBps(nbytes: int = 1 << 30) -> float:
    x = torch.randn(nbytes // 4, device="cuda")
    for _ in range(20):
        x.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        x.sum()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    del x
    return nbytes / (float(np.median(times)) * 1e-3) / 1e9


@jit("void(float32[::1])", writes=("x",))
def noop_kernel(x):
    if cuda.grid(1) == 0:
        x[0] += np.float32(1.0)


# ---------------------------------------------------------------------------- GEMM cases
GEMM_SHAPES = [  # name, K, N, trans_b, bias, act, accumulate
    ("qkv", D, 3 * D, False, True, None, False),
    ("attn_proj", D, D, False, True, None, True),
    ("fc", D, 4 * D, False, True, "gelu", False),
    ("mlp_proj", 4 * D, D, False, True, None, True),
    ("head", D, V, True, False, None, False),
    ("head_nn", D, V, False, False, None, False),
]
# First the untried ones: fewer, longer batches of loads a block (all of K = 768 in one or
# two), so a whole-K block waits one or two memory round trips instead of three (ptxas: no
# spills at these register bounds).
NN_VARIANTS = [(8, 4, 2, 12, 2), (8, 4, 1, 12, 3), (8, 4, 1, 24, 2),
               (8, 1, 2, 8, 3), (8, 1, 2, 4, 4), (8, 1, 4, 4, 3), (8, 1, 2, 16, 2),
               (8, 4, 1, 16, 2), (8, 4, 2, 8, 3), (8, 2, 2, 8, 3)]
NT_VARIANTS = [(8, 2, 12, 2), (8, 2, 8, 3), (8, 1, 24, 3), (4, 2, 8, 6), (8, 2, 16, 2)]
TARGETS = [1, 264, 528, 1 << 20]  # 1: split only where K > SPAN_MAX; 1<<20: one batch a block
NT_GRID = [None, 1 << 20]        # persistent (one wave) or a block per column tile


def _gemm_bytes(K, N, bias, accumulate, ln=False):
    return 4 * (K * N + M * K + M * N * (2 if accumulate else 1) + (N if bias else 0)
                + ((2 * N + M * N) if ln else 0))


class GemmShape:
    def __init__(self, name, K, N, trans_b, bias, act, accumulate):
        self.name, self.K, self.N, self.trans_b = name, K, N, trans_b
        self.bias, self.act, self.accumulate = bias, act, accumulate
        wshape = (N, K) if trans_b else (K, N)
        w = RNG.standard_normal(wshape, dtype=np.float32) * np.float32(1 / math.sqrt(K))
        self.w_host = w
        nbytes = 4 * K * N
        self.copies = max(1, min(64, math.ceil(2.5 * L2_BYTES / nbytes)))
        self.w = [cuda.to_device(w) for _ in range(self.copies)]
        self.x = [cuda.to_device(RNG.standard_normal((M, K), dtype=np.float32))
                  for _ in range(self.copies)]
        self.out = [cuda.to_device(RNG.standard_normal((M, N), dtype=np.float32))
                    for _ in range(self.copies)]
        self.b = cuda.to_device(RNG.standard_normal(N, dtype=np.float32)) if bias else None
        self.gamma = cuda.to_device(1 + 0.1 * RNG.standard_normal(N, dtype=np.float32))
        self.beta = cuda.to_device(0.1 * RNG.standard_normal(N, dtype=np.float32))
        self.y = [cuda.device_array((M, N), np.float32) for _ in range(self.copies)]

    def call(self, dk, i, stream, target=None, grid_cap=None, ln=False):
        a3 = self.x[i].reshape(1, M, self.K)
        b3 = self.w[i].reshape(1, *self.w[i].shape)
        o3 = self.out[i].reshape(1, M, self.N)
        bias = self.b if self.bias else self.w[i].reshape(self.w[i].size)
        ln_out = (self.gamma, self.beta, 1e-5, self.y[i].reshape(1, M, self.N)) if ln else None
        G.decode(dk, a3, b3, o3, bias, int(self.bias), G.ACTS[self.act], int(self.accumulate),
                 0, stream, ln_out, target_blocks=target, grid_cap=grid_cap)

    def check(self, dk, target=None, grid_cap=None, ln=False) -> float:
        """Max error against the float64 reference on fresh x, bias, old out (NaN-poisoned
        when not accumulating); raises if a second run differs in any bit."""
        x = RNG.standard_normal((M, self.K), dtype=np.float32)
        old = RNG.standard_normal((M, self.N), dtype=np.float32)
        bias = RNG.standard_normal(self.N, dtype=np.float32) if self.bias else None
        self.x[0].copy_to_device(x)
        if bias is not None:
            self.b.copy_to_device(bias)
        results, ys = [], []
        for _ in range(2):
            self.out[0].copy_to_device(old if self.accumulate else np.full_like(old, np.nan))
            self.y[0].copy_to_device(np.full_like(old, np.nan))
            self.call(dk, 0, 0, target, grid_cap, ln)
            results.append(self.out[0].copy_to_host())
            ys.append(self.y[0].copy_to_host())
        if not (np.array_equal(results[0], results[1], equal_nan=True)
                and (not ln or np.array_equal(ys[0], ys[1]))):
            raise AssertionError("two runs differ: not deterministic")
        want = G.gemm_ref(x, self.w_host, bias, self.act, trans_b=self.trans_b,
                          old=old if self.accumulate else None)
        if ln:
            want_y = LN.layernorm_ref(want, self.gamma.copy_to_host(), self.beta.copy_to_host())
            if not np.all(np.abs(ys[0] - want_y) <= 1e-4 + 1e-4 * np.abs(want_y)):
                raise AssertionError(f"ln_out max error {np.nanmax(np.abs(ys[0] - want_y)):.3g}")
        err = np.abs(results[0] - want)
        tol = 1e-5 + 2e-7 * self.K + 1e-4 * np.abs(want)
        if not np.all(err <= tol):  # NaN (an unwritten element) fails here too
            raise AssertionError(f"max error {np.nanmax(err):.3g}, "
                                 f"{int(np.sum(~(err <= tol)))} elements out of tolerance")
        return float(err.max())


def bench_gemm(shape: GemmShape, dk, copy_GBps, target=None, grid_cap=None, ln=False,
               profile=False):
    label = f"{shape.name}{'+ln_out' if ln else ''}"
    cfg = dk.config
    try:
        err = shape.check(dk, target, grid_cap, ln)
        fns = [lambda s, i=i: shape.call(dk, i, s, target, grid_cap, ln)
               for i in range(shape.copies)]
        us, spread, kernel_us = graph_time_us(fns, profile=profile)
    except Exception as exc:  # noqa: BLE001
        log_error(f"gemm {label} {cfg} target={target} grid_cap={grid_cap}", exc)
        return None
    k_len = shape.K
    blocks, splits, span = G.decode_plan(dk, 1, shape.N, k_len, target, grid_cap)
    nbytes = _gemm_bytes(shape.K, shape.N, shape.bias, shape.accumulate, ln)
    frac = nbytes / (us * 1e-6) / 1e9 / copy_GBps
    row = dict(shape=label, K=shape.K, N=shape.N, config=list(cfg), target=target,
               grid_cap=grid_cap, blocks=blocks, splits=splits, span=span, us=round(us, 3),
               p10=round(spread[0], 3), p90=round(spread[1], 3),
               kernel_us=None if kernel_us is None else round(kernel_us, 3), bytes=nbytes,
               fraction=round(frac, 4), max_err=err, copies=shape.copies)
    LOG["gemm"].append(row)
    print(f"gemm {label:14s} {str(cfg):22s} tgt={str(target):8s} cap={str(grid_cap):8s} "
          f"grid={blocks}x{splits} span={span:4d}  {us:8.2f} us  [{spread[0]:.2f}, "
          f"{spread[1]:.2f}]  kern={kernel_us if kernel_us is None else round(kernel_us, 2)}"
          f"  frac={frac:.3f}")
    return row


def bench_torch_gemm(shape: GemmShape, copy_GBps):
    """torch (cuBLAS, TF32 off) on the same rotating weights: out = x @ W (+ bias)."""
    try:
        ws = [torch.as_tensor(w, device="cuda") for w in shape.w]
        xs = [torch.as_tensor(x, device="cuda") for x in shape.x]
        outs = [torch.as_tensor(o, device="cuda") for o in shape.out]
        bias = torch.as_tensor(shape.b, device="cuda") if shape.bias else None

        def op(i):
            w = ws[i].t() if shape.trans_b else ws[i]
            if bias is not None:
                torch.addmm(bias, xs[i], w, out=outs[i])
            else:
                torch.matmul(xs[i], w, out=outs[i])
        fns = [lambda s, i=i: op(i) for i in range(shape.copies)]
        us, spread, _ = graph_time_us(fns)
    except Exception as exc:  # noqa: BLE001
        log_error(f"torch gemm {shape.name}", exc)
        return None
    nbytes = _gemm_bytes(shape.K, shape.N, shape.bias, False)
    frac = nbytes / (us * 1e-6) / 1e9 / copy_GBps
    LOG["gemm"].append(dict(shape=shape.name, config="torch", us=round(us, 3),
                            fraction=round(frac, 4)))
    print(f"gemm {shape.name:14s} {'torch (matmul only)':22s} {'':30s}   {us:8.2f} us  "
          f"[{spread[0]:.2f}, {spread[1]:.2f}]  frac={frac:.3f}")


# ---------------------------------------------------------------------------- attention
B_ATT, H_ATT, HD, TMAX = 5, 12, 64, 1024
ATT_VARIANTS = [(2, 8, 8), (2, 4, 8), (2, 8, 4), (2, 4, 4), (2, 2, 8)]


def launch_attention(variant, qkv, k, v, pos, out, rows, target, stream) -> None:
    """One decode step (T = 1) of attention `variant` as `kernels.attention.attention` would
    launch it, but with the variant and the split target given: the kernel, then the combine
    where the cache is split."""
    B, H, Tmax, hd = k.shape
    _, splits, span = A._plan(B, H, 1, Tmax, hd, variant, target)
    part_o = backend.empty((B * H, 1, splits, hd), np.float32, "attention.partials")
    part_ml = backend.empty((B * H, 1, splits, 2), np.float32, "attention.stats")
    launch(variant.kernel, (B * H, 1, splits), variant.threads,
           (qkv, k, v, pos, out, np.int32(span), part_o, part_ml, rows), stream)
    if splits > 1:
        launch(A.attention_combine_kernels[np.dtype(out.dtype)], (B * H, 1),
               _check.warp_threads(hd), (pos, np.int32(Tmax), np.int32(span), part_o, part_ml,
                                         out), stream)


class AttentionCase:
    def __init__(self):
        C = H_ATT * HD
        self.C = C
        self.cache_bytes = 2 * B_ATT * H_ATT * TMAX * HD * 4
        self.copies = max(1, min(16, math.ceil(2.5 * L2_BYTES / self.cache_bytes)))
        self.k_host = RNG.standard_normal((B_ATT, H_ATT, TMAX, HD), dtype=np.float32)
        self.v_host = RNG.standard_normal((B_ATT, H_ATT, TMAX, HD), dtype=np.float32)
        self.k = [cuda.to_device(self.k_host) for _ in range(self.copies)]
        self.v = [cuda.to_device(self.v_host) for _ in range(self.copies)]
        self.qkv = [cuda.to_device(RNG.standard_normal((B_ATT, 1, 3 * C), dtype=np.float32))
                    for _ in range(self.copies)]
        self.out = [cuda.device_array((B_ATT, 1, C), np.float32) for _ in range(self.copies)]
        self.pos = cuda.to_device(np.array([0], np.int32))
        self.no_rows = cuda.to_device(np.zeros((1, 1), np.int32))   # (never read)
        # the row-table variant's table: every position in its own sequence's row, so its
        # result is the plain variant's and only the table's cost differs
        self.rows = cuda.to_device(np.repeat(np.arange(B_ATT, dtype=np.int32)[:, None], TMAX, 1))

    def call(self, variant, i, stream, target):
        launch_attention(variant, self.qkv[i], self.k[i], self.v[i], self.pos, self.out[i],
                         self.rows if variant.use_rows else self.no_rows, target, stream)

    def check(self, variant, pos, target) -> float:
        qkv = RNG.standard_normal((B_ATT, 1, 3 * self.C), dtype=np.float32)
        self.qkv[0].copy_to_device(qkv)
        self.pos.copy_to_device(np.array([pos], np.int32))
        results = []
        for _ in range(2):
            self.k[0].copy_to_device(self.k_host)
            self.v[0].copy_to_device(self.v_host)
            self.out[0].copy_to_device(np.full((B_ATT, 1, self.C), np.nan, np.float32))
            self.call(variant, 0, 0, target)
            results.append(self.out[0].copy_to_host())
        if not np.array_equal(results[0], results[1], equal_nan=True):
            raise AssertionError("two runs differ: not deterministic")
        want, want_k, want_v = A.attention_ref(qkv, self.k_host, self.v_host, pos, H_ATT)
        if not (np.array_equal(self.k[0].copy_to_host(), want_k)
                and np.array_equal(self.v[0].copy_to_host(), want_v)):
            raise AssertionError("cache write differs")
        err = np.abs(results[0] - want)
        if not np.all(err <= 1e-5 + 1e-4 * np.abs(want)):
            raise AssertionError(f"max error {np.nanmax(err):.3g}")
        for i in range(self.copies):  # restore the caches the timing reads
            self.k[i].copy_to_device(self.k_host)
            self.v[i].copy_to_device(self.v_host)
        return float(err.max())


def bench_attention(case: AttentionCase, variant, pos, target, copy_GBps, profile=False):
    rows = " rows" if variant.use_rows else ""
    label = f"{variant.config}{rows} pos={pos} target={target}"
    try:
        err = case.check(variant, pos, target)
        case.pos.copy_to_device(np.array([pos], np.int32))
        fns = [lambda s, i=i: case.call(variant, i, s, target) for i in range(case.copies)]
        us, spread, kernel_us = graph_time_us(fns, profile=profile)
    except Exception as exc:  # noqa: BLE001
        log_error(f"attention {label}", exc)
        return None
    _, splits, span = A._plan(B_ATT, H_ATT, 1, TMAX, HD, variant, target)
    kv = 2 * B_ATT * H_ATT * (pos + 1) * HD * 4
    frac = kv / (us * 1e-6) / 1e9 / copy_GBps
    LOG["attention"].append(dict(config=list(variant.config), rows=variant.use_rows,
                                 pos=pos, target=target,
                                 splits=splits, span=span, us=round(us, 3),
                                 p10=round(spread[0], 3), p90=round(spread[1], 3),
                                 kernel_us=None if kernel_us is None else round(kernel_us, 3),
                                 kv_bytes=kv, fraction=round(frac, 4), max_err=err))
    print(f"attention {str(variant.config) + rows:17s} pos={pos:5d} target={str(target):5s} "
          f"splits={splits:3d} "
          f"span={span:4d}  {us:8.2f} us [{spread[0]:.2f}, {spread[1]:.2f}] "
          f"kern={kernel_us if kernel_us is None else round(kernel_us, 2)}  frac={frac:.3f}")


# ---------------------------------------------------------------------------- a whole step
class StepCase:
    """GPT-2 small's decode step (12 layers, beam 5, one token, KV cache of 1024 at `pos`)
    through the public launchers, wired as a model would with the fused layer norms:
    layernorm once (layer 0's ln_1), then per layer qkv GEMM, attention, attention
    projection (+ residual, ln_2 fused via ln_out), fc (+ GELU), MLP projection
    (+ residual, the next ln_1 or ln_f via ln_out); the tied head last."""

    def __init__(self, n_layer=12):
        C, H = D, H_ATT
        self.L = n_layer
        r = lambda *shape, scale=1.0: (RNG.standard_normal(shape, dtype=np.float32)  # noqa: E731
                                       * np.float32(scale))
        self.host = []
        for _ in range(n_layer):
            self.host.append(dict(
                g1=1 + r(C, scale=0.1), b1=r(C, scale=0.1), wqkv=r(C, 3 * C, scale=C ** -0.5),
                bqkv=r(3 * C, scale=0.1), wproj=r(C, C, scale=C ** -0.5), bproj=r(C, scale=0.1),
                g2=1 + r(C, scale=0.1), b2=r(C, scale=0.1), wfc=r(C, 4 * C, scale=C ** -0.5),
                bfc=r(4 * C, scale=0.1), wmp=r(4 * C, C, scale=(4 * C) ** -0.5),
                bmp=r(C, scale=0.1)))
        self.gf, self.bf = 1 + r(C, scale=0.1), r(C, scale=0.1)
        self.wte = r(V, C, scale=C ** -0.5)
        self.dev = [{k: cuda.to_device(v) for k, v in layer.items()} for layer in self.host]
        self.dgf, self.dbf, self.dwte = (cuda.to_device(a) for a in (self.gf, self.bf, self.wte))
        self.k_host = [r(M, H, TMAX, HD) for _ in range(n_layer)]
        self.v_host = [r(M, H, TMAX, HD) for _ in range(n_layer)]
        self.k = [cuda.to_device(a) for a in self.k_host]
        self.v = [cuda.to_device(a) for a in self.v_host]
        self.x0 = r(M, C)
        self.x = cuda.to_device(self.x0)
        self.ln = cuda.device_array((M, C), np.float32)
        self.qkv = cuda.device_array((M, 3 * C), np.float32)
        self.att = cuda.device_array((M, C), np.float32)
        self.h = cuda.device_array((M, 4 * C), np.float32)
        self.logits = cuda.device_array((M, V), np.float32)
        self.pos = cuda.to_device(np.array([0], np.int32))

    def body(self, s):
        C = D
        d = self.dev
        LN.layernorm(self.x, d[0]["g1"], d[0]["b1"], self.ln, eps=1e-5, stream=s)
        for i in range(self.L):
            w = d[i]
            nxt = (d[i + 1]["g1"], d[i + 1]["b1"]) if i + 1 < self.L else (self.dgf, self.dbf)
            G.gemm(self.ln, w["wqkv"], self.qkv, bias=w["bqkv"], stream=s)
            A.attention(self.qkv.reshape(M, 1, 3 * C), self.k[i], self.v[i], self.pos,
                        self.att.reshape(M, 1, C), n_head=H_ATT, stream=s)
            G.gemm(self.att, w["wproj"], self.x, bias=w["bproj"], accumulate=True,
                   ln_out=(w["g2"], w["b2"], 1e-5, self.ln), stream=s)
            G.gemm(self.ln, w["wfc"], self.h, bias=w["bfc"], act="gelu", stream=s)
            G.gemm(self.h, w["wmp"], self.x, bias=w["bmp"], accumulate=True,
                   ln_out=(*nxt, 1e-5, self.ln), stream=s)
        G.gemm(self.ln, self.dwte, self.logits, trans_b=True, stream=s)

    def reference(self, pos):
        """float64-ish reference of one step (the kernels' references, chained)."""
        x = self.x0.astype(np.float64)
        ln = LN.layernorm_ref(x, self.host[0]["g1"], self.host[0]["b1"])
        for i, w in enumerate(self.host):
            qkv = G.gemm_ref(ln, w["wqkv"], w["bqkv"])
            att, _, _ = A.attention_ref(qkv.reshape(M, 1, 3 * D), self.k_host[i], self.v_host[i],
                                        pos, H_ATT)
            x = G.gemm_ref(att.reshape(M, D), w["wproj"], w["bproj"], old=x).astype(np.float64)
            ln = LN.layernorm_ref(x, w["g2"], w["b2"])
            h = G.gemm_ref(ln, w["wfc"], w["bfc"], "gelu")
            x = G.gemm_ref(h, w["wmp"], w["bmp"], old=x).astype(np.float64)
            g, b = (self.host[i + 1]["g1"], self.host[i + 1]["b1"]) if i + 1 < self.L \
                else (self.gf, self.bf)
            ln = LN.layernorm_ref(x, g, b)
        return G.gemm_ref(ln, self.wte, trans_b=True)

    def nodes(self) -> int:
        class Count:
            n = 0

            def record_launch(self, *args, **kwargs):
                Count.n += 1

            def record_alloc(self, shape, dtype, name, owner):
                return cuda.device_array(shape, dtype)
        backend.set_recorder(Count())
        try:
            self.body(0)
        finally:
            backend.set_recorder(None)
        return Count.n


def bench_step(copy_GBps, pos=512):
    case = StepCase()
    case.pos.copy_to_device(np.array([pos], np.int32))
    try:
        n_nodes = case.nodes()
    except Exception as exc:  # noqa: BLE001
        log_error("step node count", exc)
        n_nodes = None
    try:
        case.body(0)
        got = case.logits.copy_to_host()
        want = case.reference(pos)
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        print(f"step check: relative error {rel:.2e}")
        if not rel < 1e-4:
            raise AssertionError(f"step relative error {rel:.2e}")
        us, spread, kern = graph_time_us([case.body], samples=9, replays=3, profile=True)
    except Exception as exc:  # noqa: BLE001
        log_error("step", exc)
        return
    weights = 4 * (case.L * (D * 3 * D + D * D + 2 * D * 4 * D) + V * D)
    kv = case.L * 2 * M * H_ATT * (pos + 1) * HD * 4
    floor_us = (weights + kv) / (copy_GBps * 1e9) * 1e6
    LOG["step"] = dict(pos=pos, us=us, p10=spread[0], p90=spread[1], kernel_us=kern,
                       nodes=n_nodes, weight_bytes=weights, kv_bytes=kv, floor_us=floor_us,
                       over_floor=us / floor_us, rel_err=rel)
    print(f"STEP 12 layers pos {pos}: {us:.1f} us [{spread[0]:.1f}, {spread[1]:.1f}], kernels "
          f"{kern}, {n_nodes} nodes; floor {floor_us:.1f} us -> {us / floor_us:.2f}x floor")


# ---------------------------------------------------------------------------- main
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", "230"))  # stop sweeping past this


def main(quick: bool = False) -> None:
    global torch
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t_start = time.time()
    dev = cuda.get_current_device()
    LOG["device"] = backend.describe()
    print(f"device {backend.describe()}, SMs {dev.MULTIPROCESSOR_COUNT}, torch {torch.__version__}")
    copy_GBps = timing.copy_bandwidth_GBps(1 << 30, warmup=20)  # warm-up: clocks up first
    read_GBps = read_bandwidth_GBps()
    LOG.update(copy_GBps=copy_GBps, read_GBps=read_GBps)
    print(f"copy bandwidth {copy_GBps:.0f} GB/s (read + written); "
          f"torch sum read {read_GBps:.0f} GB/s")

    # Per-node floor: a graph of tiny kernels.
    x = cuda.to_device(np.zeros(1, np.float32))
    try:
        us, _, kern = graph_time_us([lambda s: launch(noop_kernel, 1, 32, (x,), s)] * 100,
                                    profile=True)
        LOG["noop_node_us"] = us
        print(f"graph node floor (1-thread kernel): {us:.2f} us per node, kernel {kern}")
    except Exception as exc:  # noqa: BLE001
        log_error("noop graph", exc)

    shapes = {s[0]: GemmShape(*s) for s in GEMM_SHAPES}
    print(f"setup {time.time() - t_start:.0f} s")
    # Defaults first, with the profiler (kernel-only time), then torch, then the variants.
    for name, shape in shapes.items():  # the kernel gemm() picks for the shape
        bench_gemm(shape, G.pick_decode(shape.trans_b, 1, shape.N), copy_GBps, profile=True)
    for name in ("attn_proj", "mlp_proj"):
        bench_gemm(shapes[name], G.pick_decode(False, 1, shapes[name].N), copy_GBps, ln=True,
                   profile=True)
    for shape in shapes.values():
        bench_torch_gemm(shape, copy_GBps)
    # Standalone layer norm: 5 x 768.
    xl = cuda.to_device(RNG.standard_normal((M, D), dtype=np.float32))
    ol = cuda.device_array((M, D), np.float32)
    try:
        gamma, beta = shapes["attn_proj"].gamma, shapes["attn_proj"].beta   # (D,)
        us, _, kern = graph_time_us(
            [lambda s: LN.layernorm(xl, gamma, beta, ol, stream=s)] * 50, profile=True)
        LOG["layernorm"].append(dict(shape=f"{M}x{D}", us=us, kernel_us=kern))
        print(f"layernorm {M}x{D}: {us:.2f} us per launch in a graph (kernel {kern})")
    except Exception as exc:  # noqa: BLE001
        log_error("layernorm", exc)
    print(f"defaults done {time.time() - t_start:.0f} s")

    att = AttentionCase()
    for pos in (512, 100, 1023):
        bench_attention(att, A.SMALL, pos, None, copy_GBps, profile=(pos == 512))
    # the WHILE graph's variant (a table of rows): what the table costs a call
    bench_attention(att, A.kernel_for(HD, rows=True), 512, None, copy_GBps, profile=True)
    print(f"attention defaults done {time.time() - t_start:.0f} s")
    bench_step(copy_GBps)
    print(f"step done {time.time() - t_start:.0f} s")
    if quick:
        return

    def nt(dk):
        for cap in NT_GRID:
            bench_gemm(shapes["head"], dk, copy_GBps, grid_cap=cap)

    def attention(variant):
        for target in (512, 1024, 2048, 4096):
            bench_attention(att, variant, 512, target, copy_GBps)

    def nn(dk):
        for name in ("qkv", "attn_proj", "fc", "mlp_proj"):
            for target in TARGETS:
                bench_gemm(shapes[name], dk, copy_GBps, target=target)
        bench_gemm(shapes["head_nn"], dk, copy_GBps)

    for kind, make, configs, bench in (("nn", G.make_decode_nn, NN_VARIANTS, nn),
                                       ("nt", G.make_decode_nt, NT_VARIANTS, nt),
                                       ("attention", A.make_attention, ATT_VARIANTS, attention)):
        for cfg in configs:   # each variant compiled, then swept, until the time budget
            if time.time() - t_start > BUDGET_S:
                print("time budget reached")
                return
            try:
                variant = make(*cfg)
            except Exception as exc:  # noqa: BLE001
                log_error(f"compile {kind} {cfg}", exc)
                continue
            bench(variant)
            print(f"{kind} {cfg} done {time.time() - t_start:.0f} s")


def summary() -> None:
    print("\n==== best per GEMM shape (fraction of copy bandwidth) ====")
    best = {}
    for r in LOG["gemm"]:
        if r.get("config") == "torch":
            continue
        if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
            best[r["shape"]] = r
    torch_us = {r["shape"]: r["us"] for r in LOG["gemm"] if r.get("config") == "torch"}
    for name, r in best.items():
        print(f"{name:14s} {str(r['config']):22s} tgt={str(r['target']):8s} "
              f"cap={str(r['grid_cap']):8s}"
              f" grid={r['blocks']}x{r['splits']}  {r['us']:8.2f} us  frac={r['fraction']:.3f}"
              f"  torch={torch_us.get(name)}")
    if LOG["attention"]:
        r = min((r for r in LOG["attention"] if r["pos"] == 512 and not r["rows"]),
                key=lambda r: r["us"])
        print(f"attention pos 512 best {r['config']} target={r['target']}: {r['us']:.2f} us, "
              f"frac={r['fraction']:.3f}")
    if "step" in LOG:
        st = LOG["step"]
        print(f"step: {st['us']:.1f} us, {st['nodes']} nodes, floor {st['floor_us']:.1f} us, "
              f"{st['over_floor']:.2f}x")
    print(f"copy {LOG.get('copy_GBps', 0):.0f} GB/s, read {LOG.get('read_GBps', 0):.0f} GB/s, "
          f"node floor {LOG.get('noop_node_us')}")
    print(f"errors: {len(LOG['errors'])}")
    for e in LOG["errors"]:
        print("  ", e)


if __name__ == "__main__":
    try:
        main(quick="--quick" in sys.argv)
    finally:
        summary()
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "bench_decode.json"), "w") as f:
                json.dump(LOG, f, indent=1, default=str)
