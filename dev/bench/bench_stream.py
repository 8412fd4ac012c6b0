"""How close can one kernel come to the bandwidth floor on a decode GEMM's weight? GPU only.

    PYTHONUNBUFFERED=1 python3 -m dev.bench.bench_stream 2>&1 | tee $OUT/stream.txt

GPT-2 small's per-layer decode GEMMs read 2.4-9.5 MB of weight each with M = 5 rows, and the
library's kernels take 5-9 us for what the copy bandwidth moves in 0.6-2.3 us
(dev/notes/decode.md). Whether that gap is the GEMM's own work or the cost of reading a
few megabytes in one launch at all is measured here, on the same grid of weight tiles
(BN columns x KS rows a block, 256 threads, tiles of whole 16-byte rows):

  stream  the block copies its tile into shared memory with cp.async (`kernels._cpasync`:
          every byte in flight at once, no registers held) and waits; no arithmetic. No
          kernel that reads the weight once in one launch can beat this.
  cp      the same copy, then the product of the 5 rows of x (staged in shared memory) with
          the tile from shared memory; partial sums out[split, m, n] (no reduction over
          the K splits: KS = K gives the whole product).
  reg     the block's weights loaded into registers first, every load issued before the
          first product (as many bytes in flight as registers allow), then the same product.

beside `kernels.gemm.gemm` on the same shape (complete: its K-split reduction included).
Each kernel's partial sums are checked against float64 NumPy first (summed over the splits
on the host). Time: bench_decode.graph_time_us, R launches in one CUDA graph over R copies of
the weight totalling >= 2.5x the L2, so every launch reads HBM as a step's layers do; the
median of 7 samples with p10-p90. Fraction = weight bytes / time / copy bandwidth.
"""
from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from proto.device import backend, timing
from proto.device.backend import cuda, jit
from kernels import _cpasync
from kernels._reduce import shfl_xor

M = 5             # rows of x (beam 5)
_u = np.uint32    # 32-bit index math: Numba's signed 64-bit indices made the first version of
                  # these kernels instruction-bound (a 6 us product of 30k FMAs a block)
_ZERO = np.float32(0.0)
_ALIGN = None if backend.SIMULATOR else 16   # cp.async needs 16-byte aligned shared rows
if not backend.SIMULATOR:
    THREADS = 256
    TILES = [(8, 768), (64, 96), (64, 48)]   # (BN, KS): whole K in 8 columns; 2-D tiles
    SHAPES = [("qkv", 768, 2304), ("attn_proj", 768, 768), ("fc", 768, 3072),
              ("mlp_proj", 3072, 768)]
else:   # each simulated thread is a Python thread: small blocks, the same code
    THREADS = 32
    TILES = [(8, 16), (16, 8)]
    SHAPES = [("small", 32, 48)]
MODES = ("stream", "cp", "reg")
_ARGS = "void(float32[::1], float32[::1], float32[::1], int32, int32)"


def make(BN: int, KS: int, mode: str):
    """The kernel of one tile shape and mode: (x (M*K,), w (K*N,), out (splits*M*N,), K, N),
    grid (N // BN, K // KS), THREADS threads. Needs N % BN == 0, K % KS == 0 and 16-byte
    aligned rows (N % 4 == 0), which `tile_ok` checks."""
    groups = THREADS // BN           # row groups: a thread takes column t % BN, rows g + groups*j
    rows = KS // groups              # rows a thread multiplies
    chunks = KS * BN // 4            # 16-byte copies a tile
    per = chunks // THREADS
    xs_n, ws_n = M * KS, (KS * BN if mode != "reg" else 4)
    shuffle = BN < 32                # lanes 32/BN apart share a column inside a warp
    red_groups = THREADS // 32 if shuffle else groups
    red_n = red_groups * M * BN
    outs = -(-M * BN // THREADS)
    if chunks % THREADS or KS % groups or BN % 4:
        raise ValueError(f"tile {BN}x{KS}: {THREADS} threads must split its 16-byte copies and rows")
    uBN, uKS = _u(BN), _u(KS)

    @jit(_ARGS, writes=("out",))
    def weight_tile_kernel(x, w, out, k_len, n_cols):
        ws = cuda.shared.array(ws_n, np.float32, alignment=_ALIGN)
        xs = cuda.shared.array(xs_n, np.float32, alignment=_ALIGN)
        red = cuda.shared.array(red_n, np.float32)
        uK, uN = _u(k_len), _u(n_cols)
        t = _u(cuda.threadIdx.x)
        n0 = _u(cuda.blockIdx.x) * uBN
        split = _u(cuda.blockIdx.y)
        k0 = split * uKS
        col = t % uBN
        g = t // uBN
        wr = cuda.local.array(rows, np.float32)
        if mode == "reg":
            for j in range(rows):
                wr[j] = w[(k0 + g + _u(j * groups)) * uN + n0 + col]
        else:
            for i in range(per):
                c = t + _u(i * THREADS)
                row = c // _u(BN // 4)
                part = c - row * _u(BN // 4)
                _cpasync.copy16(ws, row * uBN + part * _u(4), w,
                                (k0 + row) * uN + n0 + part * _u(4))
        if mode == "stream":
            _cpasync.wait_all()
            cuda.syncthreads()
            if t == _u(0):   # one value, so the copies cannot be optimized away
                out[split * _u(M) * uN + n0] = ws[0] + ws[_u(KS * BN - 1)]
            return
        for i in range(-(-xs_n // THREADS)):
            c = t + _u(i * THREADS)
            if c < _u(xs_n):
                m = c // uKS
                xs[c] = x[m * uK + k0 + c - m * uKS]
        if mode == "cp":
            _cpasync.wait_all()
        cuda.syncthreads()
        acc = cuda.local.array(M, np.float32)
        for m in range(M):
            acc[m] = _ZERO
        for j in range(rows):
            k = g + _u(j * groups)
            wv = wr[j] if mode == "reg" else ws[k * uBN + col]
            for m in range(M):
                acc[m] += xs[_u(m * KS) + k] * wv
        if shuffle:   # sum the lanes of a warp that share this column, then one lane a warp
            off = BN
            while off < 32:
                for m in range(M):
                    acc[m] += shfl_xor(acc[m], off)
                off *= 2
            slot = t // _u(32)
            writes = (t % _u(32)) < uBN
        else:
            slot = g
            writes = True
        if writes:
            for m in range(M):
                red[(slot * _u(M) + _u(m)) * uBN + col] = acc[m]
        cuda.syncthreads()
        for i in range(outs):
            o = t + _u(i * THREADS)
            if o < _u(M * BN):
                s = _ZERO
                for r in range(red_groups):
                    s += red[_u(r * M * BN) + o]
                m = o // uBN
                out[(split * _u(M) + m) * uN + n0 + o - m * uBN] = s

    return weight_tile_kernel


KERNELS = {(BN, KS, mode): make(BN, KS, mode) for BN, KS in TILES for mode in MODES}


def tile_ok(BN: int, KS: int, K: int, N: int) -> bool:
    return N % BN == 0 and K % KS == 0 and N % 4 == 0


def launch(BN, KS, mode, x, w, out, stream=0):
    """x (M, K), w (K, N) device arrays (w 16-byte aligned), out (K // KS * M * N,)."""
    K, N = w.shape
    if not tile_ok(BN, KS, K, N):
        raise ValueError(f"tile {BN}x{KS} does not divide the weight {K}x{N}")
    if out.shape != ((K // KS) * M * N,):
        raise ValueError(f"out: expected ({(K // KS) * M * N},), got {out.shape}")
    backend.launch(KERNELS[(BN, KS, mode)], (N // BN, K // KS), THREADS,
                   (backend.reshaped(x, (M * K,)), backend.reshaped(w, (K * N,)), out,
                    np.int32(K), np.int32(N)), stream)


def product(BN, KS, mode, x_host, w_host) -> np.ndarray:
    """The kernel's partial sums, summed over the splits on the host (for the checks)."""
    K, N = w_host.shape
    out = cuda.device_array(((K // KS) * M * N,), np.float32)
    out[:] = np.float32(np.nan)
    launch(BN, KS, mode, cuda.to_device(x_host), cuda.to_device(w_host), out)
    return out.copy_to_host().reshape(K // KS, M, N).astype(np.float64).sum(0)


def main() -> None:
    from dev.bench import bench_decode as bd
    from kernels import gemm as G
    import torch
    bd.torch = torch
    t0 = time.time()
    copy_GBps = timing.copy_bandwidth_GBps(1 << 30, warmup=20)
    print(f"device {backend.describe()}, copy {copy_GBps:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for name, K, N in SHAPES:
        nbytes = 4 * K * N
        floor = nbytes / (copy_GBps * 1e3)
        R = max(8, math.ceil(2.5 * bd.L2_BYTES / nbytes))
        x_host = rng.standard_normal((M, K), dtype=np.float32)
        w_host = rng.standard_normal((K, N), dtype=np.float32)
        want = x_host.astype(np.float64) @ w_host.astype(np.float64)
        x = cuda.to_device(x_host)
        w = [cuda.to_device(w_host) for _ in range(R)]
        lib_out = [cuda.device_array((M, N), np.float32) for _ in range(R)]

        def report(kind, us, spread, kern, err):
            rows.append(dict(shape=name, K=K, N=N, kernel=kind, us=us, p10=spread[0],
                             p90=spread[1], kernel_us=kern, floor_us=floor,
                             fraction=floor / us, max_err=err))
            print(f"{name:9s} {kind:22s} {us:6.2f} us (p10-p90 {spread[0]:.2f}-{spread[1]:.2f}),"
                  f" kernel {kern or float('nan'):5.2f}, {floor / us:.2f} of copy bandwidth"
                  + (f", max err {err:.1e}" if err is not None else ""), flush=True)
        G.gemm(x, w[0], lib_out[0])
        err = float(np.abs(lib_out[0].copy_to_host() - want).max())
        us, spread, kern = bd.graph_time_us(
            [lambda s, i=i: G.gemm(x, w[i], lib_out[i], stream=s) for i in range(R)], profile=True)
        report("library gemm()", us, spread, kern, err)
        for BN, KS in TILES:
            if not tile_ok(BN, KS, K, N):
                continue
            parts = [cuda.device_array(((K // KS) * M * N,), np.float32) for _ in range(R)]
            for mode in MODES:
                kind = f"{mode} {BN}x{KS} ({N // BN * (K // KS)} blocks)"
                try:
                    err = None
                    if mode != "stream":
                        err = float(np.abs(product(BN, KS, mode, x_host, w_host) - want).max())
                        if not err < 1e-3 * math.sqrt(K):
                            raise AssertionError(f"max error {err:.2e}")
                    us, spread, kern = bd.graph_time_us(
                        [lambda s, i=i: launch(BN, KS, mode, x, w[i], parts[i], s)
                         for i in range(R)], profile=True)
                    report(kind, us, spread, kern, err)
                except Exception as exc:  # noqa: BLE001
                    print(f"ERROR {name} {kind}: {type(exc).__name__}: {exc}", flush=True)
                    rows.append(dict(shape=name, kernel=kind, error=str(exc)))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_stream.json"), "w") as f:
            json.dump(dict(device=backend.describe(), copy_GBps=copy_GBps, rows=rows,
                           seconds=time.time() - t0), f, indent=1)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
    # torch.profiler's CUPTI beside Numba's CUDA context aborts the interpreter's teardown
    # ("double free or corruption", seen on the H200): everything is written; leave now.
    os._exit(0)
