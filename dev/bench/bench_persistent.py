"""Does one launch per layer pay? GPT-2 small's four decode GEMMs as phases of one persistent
kernel with grid barriers, against the same phases launched one by one, on the GPU.

    PYTHONUNBUFFERED=1 python3 -m dev.bench.bench_persistent 2>&1 | tee $OUT/persistent.txt

A decode step is a chain of short kernels whose fixed cost (launch, graph node, prologue, a
memory round trip or two before the first byte arrives) is most of their time
(dev/notes/decode.md): the per-layer GEMMs move 2.4-9.5 MB each in 5-9 us. A persistent
kernel keeps its blocks resident and replaces each launch by a grid barrier (every block
counts in on a device counter and waits until all have). Whether a barrier costs less than a
launch, and whether the GEMMs stream faster when each is a phase of one launch, is measured
here before any model is rewired.

The chain (M = 5 rows, beam 5): per layer l, qkv = x @ Wqkv[l] (768 x 2304); p = qkv[:, :768]
@ Wproj[l] (768 x 768; the attention's place, its input a stand-in); h = p @ Wfc[l]
(768 x 3072); x = gelu(h) @ Wmp[l] (3072 x 768). No bias, residual or layer norm: those move
few bytes, but where they would sit (a layer norm needs whole rows, a barrier more) is what
a model kernel must still solve. Every phase splits K into SPAN-row slices and writes its
partial sums; the next phase sums them in split order as it stages its input (deterministic,
no atomics on data), applying GELU where the chain has it.

One kernel, `persistent_chain_kernel`, runs phases [p_lo, p_hi): with one phase a launch it
has no barrier at all, so the comparison of the configurations below is launches against
barriers, the GEMM code the same:

  per_launch_1       48 launches of one phase each (12 layers x 4 GEMMs)
  per_launch_4_*     12 launches of 4 phases, 3 barriers each
  per_launch_48_*    1 launch of 48 phases, 47 barriers
                     (_ahead: a phase's first weights loaded before its barrier; _after: after)
  empty_*            the same launches and barriers with no GEMM work (what the structure
                     itself costs)
  production         the library's decode GEMMs (`kernels.gemm.gemm`) on the same shapes
                     and weights, with today's bias and GELU epilogues

The barrier spins on an L2 load of its counter for a bounded time and then counts an error
instead of hanging; the grid is never larger than the blocks the device holds at once
(`max_cooperative_grid_blocks`), so every block is resident. Time: the whole chain captured in
one CUDA graph, replayed (bench_decode.graph_time_us); the 12 layers' 340 MB of weights are
5.6x the L2, so every phase reads HBM. Each configuration is first checked against a float64
NumPy chain (relative error < 1e-4, two runs bitwise equal, no barrier timeouts).
"""
from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

from proto.device import backend, timing
from proto.device.backend import cuda, jit, launch
from kernels import _check
from kernels._lastblock import count_in
from kernels.elementwise import gelu_f32, gelu_ref

M, D, LAYERS = 5, 768, 12
KINDS = 4                       # phases a layer: qkv, proj, fc, mlp_proj
if not backend.SIMULATOR:
    COLS, ROW_LANES, SPAN = 32, 8, 192   # 256 threads: a lane a column, a warp a row lane
else:   # each simulated thread is a Python thread: smaller blocks, the same code
    COLS, ROW_LANES, SPAN = 4, 2, 16
THREADS = COLS * ROW_LANES
ROWS_PER_LANE = SPAN // ROW_LANES   # a lane's weight loads of one item, all issued at once
XS_SIZE = M * SPAN                  # shared: the staged input rows of one item
RED_SIZE = ROW_LANES * M * COLS     # shared: the row lanes' partial sums
COUNTERS = 64                   # barrier counters [0, 62), the end count 62, timeouts 63
DONE, TIMEOUTS = COUNTERS - 2, COUNTERS - 1
SPIN_LIMIT = 1 << 22            # polls (each after a 100 ns sleep) before a barrier gives up
_ZERO = np.float32(0.0)
_u = np.uint32   # 32-bit index math (fewer registers than Numba's default 64-bit)


def shapes(d: int = D):
    """(K, N) of the four GEMMs of a layer for model width d."""
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]


def splits(d: int = D):
    """K splits of each phase's output: K / SPAN."""
    return [k // SPAN for k, _ in shapes(d)]


def _make_phase(K: int, N: int, s_in: int, gelu_in: bool):
    """The device functions of one GEMM phase: out[s, m, n] = sum over rows k of K split s
    of stage(a)[m, k] * w[k, n], where stage(a)[m, k] = (gelu of) sum over the s_in input
    partials a[:, m, k] in order. Work items (column tile, split) go round-robin to the
    blocks. `load` issues a lane's ROWS_PER_LANE weight loads of an item into registers;
    weights are nobody's output, so a persistent kernel may issue the next phase's before
    the barrier that waits for this phase's outputs. `run` expects the block's first item
    loaded and loads each next one as soon as the last is multiplied."""
    n_tiles = N // COLS
    items = n_tiles * (K // SPAN)

    @cuda.jit(device=True)
    def load(w, item, wv):
        if item < _u(items):
            r = _u(cuda.threadIdx.x) // _u(COLS)
            k_lo = item // _u(n_tiles) * _u(SPAN)
            n = item % _u(n_tiles) * _u(COLS) + _u(cuda.threadIdx.x) % _u(COLS)
            for u in range(ROWS_PER_LANE):
                wv[u] = w[k_lo + r + _u(u * ROW_LANES), n]

    @cuda.jit(device=True)
    def run(a, w, out, vb, nvb, xs, red, wv, acc):
        tid = _u(cuda.threadIdx.x)
        c = tid % _u(COLS)
        r = tid // _u(COLS)
        item = _u(vb)
        while item < _u(items):
            tile = item % _u(n_tiles)
            split = item // _u(n_tiles)
            k_lo = split * _u(SPAN)
            for idx in range(tid, _u(M * SPAN), _u(THREADS)):
                m = idx // _u(SPAN)
                kk = idx % _u(SPAN)
                v = _ZERO
                for s in range(s_in):   # written by other blocks of this launch: via L2
                    v += backend.ldcg(a, (_u(s), _u(m), _u(k_lo + kk)))
                xs[idx] = gelu_f32(v) if gelu_in else v
            cuda.syncthreads()
            for m in range(M):
                acc[m] = _ZERO
            for u in range(ROWS_PER_LANE):
                for m in range(M):
                    acc[m] += xs[m * SPAN + r + u * ROW_LANES] * wv[u]
            load(w, item + _u(nvb), wv)   # the block's next item, if any: in flight from here
            for m in range(M):
                red[(r * M + m) * COLS + c] = acc[m]
            cuda.syncthreads()
            for idx in range(tid, M * COLS, THREADS):
                m = idx // COLS
                cc = idx % COLS
                v = _ZERO
                for rr in range(ROW_LANES):
                    v += red[(rr * M + m) * COLS + cc]
                out[split, m, tile * COLS + cc] = v
            cuda.syncthreads()   # xs and red are rewritten by the next item
            item += _u(nvb)

    return load, run


@cuda.jit(device=True)
def grid_barrier(counters, at, nblocks):
    """Every block: publish its writes, count in at counters[at], wait until all
    nblocks have (polling L2; after SPIN_LIMIT polls it counts a timeout and goes on)."""
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.atomic.add(counters, at, 1)
        spins = 0
        while backend.ldcg(counters, at) < nblocks:
            spins += 1
            if spins > SPIN_LIMIT:
                cuda.atomic.add(counters, TIMEOUTS, 1)
                break
            cuda.nanosleep(100)
        cuda.threadfence()
    cuda.syncthreads()


@functools.cache
def _build(d: int = D):
    (kq, nq), (kp, np_), (kf, nf), (km, nm) = shapes(d)
    sq, sp, sf, sm = splits(d)
    load_qkv, run_qkv = _make_phase(kq, nq, sm, False)     # input: mlp_proj's partials
    load_proj, run_proj = _make_phase(kp, np_, sq, False)  # input: qkv's first d columns
    load_fc, run_fc = _make_phase(kf, nf, sp, False)
    load_mlp, run_mlp = _make_phase(km, nm, sf, True)      # gelu(fc) staged

    @cuda.jit(device=True)
    def load(p, wq, wp, wf, wm, vb, wv):
        """Phase p's weights of the block's first item, into wv."""
        layer, kind = p // KINDS, p % KINDS
        if kind == 0:
            load_qkv(wq[layer], _u(vb), wv)
        elif kind == 1:
            load_proj(wp[layer], _u(vb), wv)
        elif kind == 2:
            load_fc(wf[layer], _u(vb), wv)
        else:
            load_mlp(wm[layer], _u(vb), wv)

    @jit("void(float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], "
         "float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], "
         "int32[::1], int32, int32, int32, int32)",
         writes=("xp", "qp", "pp", "hp", "counters"),
         launch_bounds=(THREADS, 4))   # 64 registers, no spills (ptxas, sm_90): 4 blocks an SM
    def persistent_chain_kernel(xp, qp, pp, hp, wq, wp, wf, wm, counters, p_lo, p_hi, work,
                                ahead):
        """Phases p_lo..p_hi-1 of the chain (phase p: layer p // 4, GEMM p % 4), a grid
        barrier between two; `work` 0 skips the GEMMs (the structure's own cost). `ahead` 1:
        a phase's first weights are loaded before the barrier in front of it, 0: after."""
        xs = cuda.shared.array(XS_SIZE, np.float32)
        red = cuda.shared.array(RED_SIZE, np.float32)
        wv = cuda.local.array(ROWS_PER_LANE, np.float32)
        acc = cuda.local.array(M, np.float32)
        flag = cuda.shared.array(1, np.int32)
        vb, nvb = cuda.blockIdx.x, cuda.gridDim.x
        if work:
            load(p_lo, wq, wp, wf, wm, vb, wv)
        for p in range(p_lo, p_hi):
            if p > p_lo:
                grid_barrier(counters, p - p_lo - 1, nvb)
                if work and not ahead:
                    load(p, wq, wp, wf, wm, vb, wv)
            if work:
                layer, kind = p // KINDS, p % KINDS
                if kind == 0:
                    run_qkv(xp, wq[layer], qp, vb, nvb, xs, red, wv, acc)
                elif kind == 1:
                    run_proj(qp, wp[layer], pp, vb, nvb, xs, red, wv, acc)
                elif kind == 2:
                    run_fc(pp, wf[layer], hp, vb, nvb, xs, red, wv, acc)
                else:
                    run_mlp(hp, wm[layer], xp, vb, nvb, xs, red, wv, acc)
                if ahead and p + 1 < p_hi:
                    load(p + 1, wq, wp, wf, wm, vb, wv)
        # The last block out (every other one is past every barrier) resets the barrier
        # counters for the next launch; count_in resets its own.
        if p_hi - p_lo > 1 and count_in(counters, DONE, nvb, flag):
            for i in range(cuda.threadIdx.x, p_hi - p_lo - 1, cuda.blockDim.x):
                counters[i] = 0

    return persistent_chain_kernel


_build(D)   # GPT-2 small's kernel, compiled at import (kernels.compile_check sees it)


class Chain:
    """Weights, activations and the float64 reference of an n-layer chain of width d."""

    def __init__(self, n_layer: int = LAYERS, d: int = D, seed: int = 12345):
        rng = np.random.default_rng(seed)
        self.L, self.d = n_layer, d
        self.kernel = _build(d)
        self.w_host = [np.stack([(rng.standard_normal((k, n), dtype=np.float32)
                                  * np.float32(k ** -0.5 * (2.0 if i == 3 else 1.0)))
                                 for _ in range(n_layer)]) for i, (k, n) in enumerate(shapes(d))]
        self.w = [cuda.to_device(w) for w in self.w_host]
        self.x0 = rng.standard_normal((M, d), dtype=np.float32)
        sq, sp, sf, sm = splits(d)
        # each phase's output partials: x (mlp_proj's), qkv, proj, fc
        self.parts = [cuda.to_device(np.zeros((s, M, n), np.float32))
                      for s, n in ((sm, d), (sq, 3 * d), (sp, d), (sf, 4 * d))]
        self.counters = cuda.to_device(np.zeros(COUNTERS, np.int32))
        self.reset()

    def reset(self) -> None:
        """x's partials: split 0 holds x0, the others zero."""
        xp = np.zeros(self.parts[0].shape, np.float32)
        xp[0] = self.x0
        self.parts[0].copy_to_device(xp)

    def reference(self) -> np.ndarray:
        x = self.x0.astype(np.float64)
        wq, wp, wf, wm = self.w_host
        for layer in range(self.L):
            qkv = x @ wq[layer]
            p = qkv[:, :self.d] @ wp[layer]
            h = p @ wf[layer]
            x = gelu_ref(h) @ wm[layer]
        return x

    def result(self) -> np.ndarray:
        return self.parts[0].copy_to_host().astype(np.float64).sum(axis=0)

    def launches(self, per_launch: int, grid: int, work: bool = True, ahead: bool = True):
        """The launch functions (each takes a stream) of the whole chain, `per_launch`
        phases a launch; `ahead`: each phase's weights loaded before its barrier."""
        phases = self.L * KINDS
        xp, qp, pp, hp = self.parts
        wq, wp, wf, wm = self.w

        def one(lo, hi):
            return lambda s: launch(self.kernel, grid, THREADS,
                                    (xp, qp, pp, hp, wq, wp, wf, wm, self.counters,
                                     np.int32(lo), np.int32(hi), np.int32(work),
                                     np.int32(ahead)), s)
        return [one(lo, min(lo + per_launch, phases)) for lo in range(0, phases, per_launch)]

    def run(self, per_launch: int, grid: int, ahead: bool = True) -> np.ndarray:
        self.reset()
        for fn in self.launches(per_launch, grid, ahead=ahead):
            fn(0)
        backend.synchronize()
        return self.result()

    def timeouts(self) -> int:
        return int(self.counters.copy_to_host()[TIMEOUTS])


def check(chain: Chain, per_launch: int, grid: int, ahead: bool = True) -> float:
    """Relative error against the float64 chain; raises on a barrier timeout, a bitwise
    difference between two runs, or an error of 1e-4 or more."""
    got = chain.run(per_launch, grid, ahead)
    again = chain.run(per_launch, grid, ahead)
    if chain.timeouts():
        raise RuntimeError(f"{chain.timeouts()} barrier timeouts (per_launch={per_launch}, "
                           f"grid={grid})")
    if not np.array_equal(got, again):
        raise AssertionError("two runs differ")
    want = chain.reference()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not rel < 1e-4:
        raise AssertionError(f"relative error {rel:.2e} (per_launch={per_launch}, grid={grid})")
    return rel


def main() -> None:
    from dev.bench import bench_decode as bd
    from kernels import gemm as G
    import torch
    bd.torch = torch
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    copy_GBps = timing.copy_bandwidth_GBps(1 << 30, warmup=20)
    chain = Chain()
    cap = _check.resident_blocks(chain.kernel, THREADS)
    weight_bytes = sum(w.nbytes for w in chain.w_host)
    floor_us = weight_bytes / (copy_GBps * 1e9) * 1e6
    rows = []
    print(f"device {backend.describe()}, copy {copy_GBps:.0f} GB/s; resident blocks {cap}; "
          f"weights {weight_bytes / 1e6:.1f} MB, "
          f"floor {floor_us:.1f} us")
    sms = _check.sm_count()
    grids = sorted({g for g in (sms, 2 * sms, 3 * sms, 4 * sms) if g <= cap})
    phases = chain.L * KINDS
    for grid in grids:
        configs = [(1, True, True), (1, False, True)] + [
            (per_launch, work, ahead) for per_launch in (KINDS, phases)
            for work, ahead in ((True, True), (True, False), (False, True))]
        for per_launch, work, ahead in configs:
            name = (f"{'' if work else 'empty_'}per_launch_{per_launch}"
                    + ("" if per_launch == 1 or not work else "_ahead" if ahead else "_after"))
            try:
                rel = check(chain, per_launch, grid, ahead) if work else None
                fns = chain.launches(per_launch, grid, work, ahead)
                us, spread, kern = bd.graph_time_us(fns, samples=9, replays=5,
                                                    profile=work)
                us *= len(fns)   # graph_time_us: per function
                if chain.timeouts():
                    raise RuntimeError(f"{chain.timeouts()} barrier timeouts while timed")
            except Exception as exc:  # noqa: BLE001
                print(f"ERROR grid {grid} {name}: {type(exc).__name__}: {exc}")
                rows.append(dict(grid=grid, config=name, error=str(exc)))
                continue
            n_launch = -(-phases // per_launch)
            row = dict(grid=grid, config=name, launches=n_launch, barriers=phases - n_launch,
                       us_per_step=us, p10=spread[0] * n_launch, p90=spread[1] * n_launch,
                       us_per_layer=us / chain.L, over_floor=us / floor_us if work else None,
                       rel_err=rel)
            rows.append(row)
            print(f"grid {grid:4d} {name:22s} {us:8.1f} us a step ({us / chain.L:6.2f} a layer)"
                  + (f", {us / floor_us:.2f}x the weights' floor, rel err {rel:.1e}"
                     if work else ""), flush=True)
    # The library's GEMMs on the same shapes and weights (bias zero, GELU after fc).
    x = cuda.to_device(chain.x0)
    bufs = {n: cuda.device_array((M, n), np.float32) for n in (D, 3 * D, 4 * D)}
    att = cuda.to_device(chain.x0)
    bias = {n: cuda.to_device(np.zeros(n, np.float32)) for n in (D, 3 * D, 4 * D)}

    def layer_fn(layer):
        wq, wp, wf, wm = (w[layer] for w in chain.w)

        def fn(s):
            G.gemm(x, wq, bufs[3 * D], bias=bias[3 * D], stream=s)
            G.gemm(att, wp, bufs[D], bias=bias[D], accumulate=True, stream=s)
            G.gemm(bufs[D], wf, bufs[4 * D], bias=bias[4 * D], act="gelu", stream=s)
            G.gemm(bufs[4 * D], wm, x, bias=bias[D], accumulate=True, stream=s)
        return fn
    try:
        us, spread, kern = bd.graph_time_us([layer_fn(i) for i in range(chain.L)], samples=9,
                                            replays=5, profile=True)
        rows.append(dict(config="production", us_per_step=us * chain.L, us_per_layer=us,
                         p10=spread[0] * chain.L, p90=spread[1] * chain.L,
                         over_floor=us * chain.L / floor_us))
        print(f"production gemm()       {us * chain.L:8.1f} us a step ({us:6.2f} a layer), "
              f"{us * chain.L / floor_us:.2f}x the weights' floor")
    except Exception as exc:  # noqa: BLE001
        print(f"ERROR production: {type(exc).__name__}: {exc}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_persistent.json"), "w") as f:
            json.dump(dict(device=backend.describe(), copy_GBps=copy_GBps, floor_us=floor_us,
                           weight_bytes=weight_bytes, resident_blocks=cap, rows=rows,
                           seconds=time.time() - t0), f, indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
