"""Causal self-attention over a KV cache whose fill level `pos` lives in device memory.

`pos` is read on the device, so one launch configuration (and one CUDA graph) serves every
cache length: grids depend on (B, H, T, Tmax, hd), never on pos. One call is up to three
launches on one stream:

  1. `kv_write_kernel` copies this step's k, v from the fused qkv into the caches at
     pos..pos+T-1. A launch of its own, because blocks of one launch cannot wait for each
     other, and every query reads keys that other blocks write.
  2. `attention_kernel`, grid (B*H, T, S): block (bh, t, s) takes query t against the cache
     positions of split s, [s*span, (s+1)*span) clipped to [0, pos+t], NT positions (= the
     block's threads) per tile. K tiles pass through shared memory (coalesced loads, padded
     rows so the per-position dot products read distinct banks); the softmax is online over
     tiles (running max and sum, warp-shuffle reductions); then p @ V with threads over
     (position group, head dim), reading V coalesced.
  3. `attention_combine_kernel`, only when S > 1, merges each query's S partial
     (max, sum, output) triples. Decode (T = 1) has only B*H queries (GPT-2 beam search: 60),
     too few blocks to keep an H200 busy, so the cache is split over S blocks per query
     (flash-decoding); prefill has enough queries and runs with S = 1, where step 2 writes
     `out` itself.

Guard: pos is only known on the device. A step that does not fit (pos < 0 or
pos + T > Tmax) writes nothing to the caches and NaN to every output, so an overflow shows in
the result instead of corrupting memory. T > Tmax is rejected on the host.

The partial results of S > 1 live in a workspace allocated on the first call for a shape and
kept for the process (graph nodes bake its address in): warm up before any stream capture.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import warp_allreduce
from proto.backend import cuda, jit, launch

TILE = 128           # positions per tile = threads per block, at most (more when hd is larger)
MAX_HD = 256         # largest head dim; the block then has 256 threads
MAX_NT = 256         # most threads per block
TARGET_BLOCKS = 512  # decode splits the cache until the grid has about this many blocks
SLAB = 32            # head dims per K tile pass: one 128-byte row segment per warp load
UNROLL = 8           # K elements each thread loads before storing any (loads in flight)
TILE_SLOTS = MAX_NT * (SLAB + 1)  # K tile (NT, SLAB) padded to SLAB+1 columns: 33 KiB
# Hot-loop indices are uint32: Numba guards signed indices against Python's negative
# indexing (extra instructions per access); unsigned ones compile to plain offsets.
_u = np.uint32
NEG_INF = np.float32(-np.inf)
NAN = np.float32(np.nan)
ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------- references
def attention_ref(qkv, k_cache, v_cache, pos: int, n_head: int):
    """float64 reference. Returns (out (B, T, C), k_cache, v_cache) with the caches updated
    (copies; the inputs are untouched). Same guard as the kernels: a step that does not fit
    leaves the caches alone and gives NaN."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    Tmax = k_cache.shape[2]
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    if pos < 0 or pos + T > Tmax:
        return np.full((B, T, C), np.nan, np.float32), k_cache, v_cache
    heads = qkv.astype(np.float64).reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4)
    q, k, v = heads  # (B, H, T, hd) each
    k_cache[:, :, pos:pos + T] = k
    v_cache[:, :, pos:pos + T] = v
    kc, vc = k_cache[:, :, :pos + T].astype(np.float64), v_cache[:, :, :pos + T].astype(np.float64)
    scores = q @ kc.transpose(0, 1, 3, 2) / math.sqrt(hd)  # (B, H, T, pos+T)
    causal = np.arange(pos + T)[None, :] <= (pos + np.arange(T))[:, None]
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ vc  # (B, H, T, hd)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C).astype(np.float32), k_cache, v_cache


def gather_batch_ref(src: np.ndarray, index: np.ndarray) -> np.ndarray:
    return src[index]


# ---------------------------------------------------------------------------- reductions


@cuda.jit(device=True)
def _block_allreduce(v, red, use_max):
    """Max (use_max) or sum of v over the block, returned to every thread; red is a shared
    float32[32] scratch. blockDim.x a multiple of 32; every thread must call this."""
    lane = cuda.threadIdx.x & 31
    v = warp_allreduce(v, use_max)
    if lane == 0:
        red[cuda.threadIdx.x >> 5] = v
    cuda.syncthreads()
    v = NEG_INF if use_max else ZERO
    if lane < (cuda.blockDim.x >> 5):
        v = red[lane]
    v = warp_allreduce(v, use_max)  # every warp reduces the warp results: all threads get it
    cuda.syncthreads()  # red is reused by the next call
    return v


# ---------------------------------------------------------------------------- kernels
@jit("void(float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int32[::1])")
def kv_write_kernel(qkv, k_cache, v_cache, pos):
    """k/v_cache[b, h, pos + t, d] = k/v of qkv[b, t]; grid-stride over (B, T, C)."""
    B, T = qkv.shape[0], qkv.shape[1]
    H, Tmax, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    C = H * hd
    p0 = pos[0]
    if p0 < 0 or p0 + T > Tmax:
        return
    for e in range(cuda.grid(1), B * T * C, cuda.gridsize(1)):
        bt = e // C
        c = e - bt * C
        b = bt // T
        t = bt - b * T
        h = c // hd
        d = c - h * hd
        k_cache[b, h, p0 + t, d] = qkv[b, t, C + c]
        v_cache[b, h, p0 + t, d] = qkv[b, t, 2 * C + c]


@cuda.jit(device=True)
def _stage_k(tile, k_rows, c0, d0, width, n):
    """tile[r, c] = k_rows[c0 + r, d0 + c] for r < n, c < width, tile rows SLAB+1 apart.

    blockDim.x is a multiple of SLAB, so each thread keeps one column (its lane) and walks
    rows; a warp reads one 128-byte row segment. Each thread loads UNROLL elements before
    storing any, so that many loads are in flight (a store between loads would serialize
    them: the compiler cannot tell the shared tile and the cache apart)."""
    vals = cuda.local.array(UNROLL, np.float32)
    n = _u(n)  # all unsigned: a signed/unsigned comparison would go through float64
    col = _u(cuda.threadIdx.x) & _u(SLAB - 1)
    row_step = _u(cuda.blockDim.x) // _u(SLAB)
    col_ok = col < _u(width)
    for r0 in range(_u(cuda.threadIdx.x) // _u(SLAB), n, row_step * _u(UNROLL)):
        for u in range(UNROLL):
            r = _u(r0) + _u(u) * row_step
            v = ZERO
            if col_ok and r < n:
                v = k_rows[_u(c0) + r, _u(d0) + col]
            vals[u] = v
        for u in range(UNROLL):
            r = _u(r0) + _u(u) * row_step
            if r < n:
                tile[r * _u(SLAB + 1) + col] = vals[u]


_ATT_ARGS = ("float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int32[::1], "
             "float32[:, :, ::1], int32, float32[:, :, :, ::1], float32[:, :, :, ::1]")


@jit(f"void({_ATT_ARGS})")
def attention_kernel(qkv, k_cache, v_cache, pos, out, span, part_o, part_ml):
    """Grid (B*H, T, S), NT threads. Query t of head bh against split s of the cache. With
    S == 1 writes out[b, t, h*hd:(h+1)*hd]; otherwise the unnormalized output, running max
    and sum to part_o[bh, t, s], part_ml[bh, t, s] (S > 1)."""
    q_s = cuda.shared.array(MAX_HD, np.float32)        # this query, pre-scaled
    tile = cuda.shared.array(TILE_SLOTS, np.float32)   # K tile (NT, SLAB+1)
    p_s = cuda.shared.array(MAX_NT, np.float32)        # probabilities of the current tile
    acc_s = cuda.shared.array(MAX_NT, np.float32)      # per (group, dim) partial outputs
    red = cuda.shared.array(32, np.float32)
    T = qkv.shape[1]
    H, Tmax, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    bh = cuda.blockIdx.x
    b = bh // H
    h = bh - b * H
    t = cuda.blockIdx.y
    split = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    p0 = pos[0]
    # Every condition below is uniform over the block, so early returns skip no barrier.
    if p0 < 0 or p0 + T > Tmax:
        if cuda.gridDim.z == 1:
            for d in range(tid, hd, nt):
                out[b, t, h * hd + d] = NAN
        return  # (with S > 1 the combine kernel writes the NaN)
    lo = split * span
    hi = min(lo + span, p0 + t + 1)  # causal: positions 0..pos+t
    if lo >= hi:
        return  # this split lies wholly after the query; the combine kernel skips it
    scale = np.float32(1.0 / math.sqrt(hd))
    k_rows, v_rows = k_cache[b, h], v_cache[b, h]  # (Tmax, hd) each
    for d in range(tid, hd, nt):
        q_s[d] = qkv[b, t, h * hd + d] * scale
    groups = nt // hd  # p @ V: thread (g, d) sums positions g, g + groups, ... of a tile
    g = tid // hd
    d_own = tid - g * hd
    m = NEG_INF        # running max of the scores seen so far (uniform over the block)
    l_part = ZERO      # this thread's share of the running sum of exp(score - m)
    acc = ZERO         # thread (g, d_own)'s share of the output, scaled by exp(-m)
    cuda.syncthreads()
    for c0 in range(lo, hi, nt):
        n = min(nt, hi - c0)  # positions in this tile; thread tid scores position c0 + tid
        score = ZERO
        for d0 in range(0, hd, SLAB):
            width = min(SLAB, hd - d0)
            _stage_k(tile, k_rows, c0, d0, width, n)
            cuda.syncthreads()
            if tid < n:
                for c in range(_u(width)):
                    score += q_s[_u(d0) + c] * tile[_u(tid) * _u(SLAB + 1) + c]
            cuda.syncthreads()  # the tile is restaged next pass
        if tid >= n:
            score = NEG_INF
        m_new = max(m, _block_allreduce(score, red, True))
        alpha = math.exp(m - m_new)  # rescales what was summed under the old max
        p = ZERO
        if tid < n:
            p = math.exp(score - m_new)
        l_part = l_part * alpha + p
        p_s[tid] = p
        cuda.syncthreads()
        acc *= alpha
        if g < groups:
            for r in range(_u(g), _u(n), _u(groups)):
                acc += p_s[r] * v_rows[_u(c0) + r, _u(d_own)]
        cuda.syncthreads()  # p_s is rewritten next tile
        m = m_new
    total = _block_allreduce(l_part, red, False)
    if g < groups:
        acc_s[tid] = acc
    cuda.syncthreads()
    if tid < hd:
        o = ZERO
        for gg in range(groups):
            o += acc_s[gg * hd + tid]
        if cuda.gridDim.z == 1:
            out[b, t, h * hd + tid] = o / total
        else:
            part_o[bh, t, split, tid] = o
            if tid == 0:
                part_ml[bh, t, split, 0] = m
                part_ml[bh, t, split, 1] = total


@jit("void(int32[::1], int32, int32, float32[:, :, :, ::1], float32[:, :, :, ::1], "
     "float32[:, :, ::1])")
def attention_combine_kernel(pos, tmax, span, part_o, part_ml, out):
    """Grid (B*H, T), >= hd threads: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s
    over the splits s that hold positions <= pos + t. No barriers: each thread reads the few
    (m_s, l_s) itself."""
    H = part_o.shape[0] // out.shape[0]
    T, hd = out.shape[1], part_o.shape[3]
    bh = cuda.blockIdx.x
    b = bh // H
    h = bh - b * H
    t = cuda.blockIdx.y
    d = cuda.threadIdx.x
    if d >= hd:
        return
    p0 = pos[0]
    if p0 < 0 or p0 + T > tmax:
        out[b, t, h * hd + d] = NAN
        return
    used = (p0 + t) // span + 1
    top = NEG_INF
    for s in range(used):
        top = max(top, part_ml[bh, t, s, 0])
    o = ZERO
    total = ZERO
    for s in range(used):
        w = math.exp(part_ml[bh, t, s, 0] - top)
        o += w * part_o[bh, t, s, d]
        total += w * part_ml[bh, t, s, 1]
    out[b, t, h * hd + d] = o / total


@jit("void(float32[:, ::1], int32[::1], float32[:, ::1])")
def gather_batch_kernel(src, index, dst):
    """Grid (X, B): dst[b, :] = src[index[b], :]; NaN where index[b] is out of range."""
    b = cuda.blockIdx.y
    i = index[b]
    ok = 0 <= i < src.shape[0]
    for e in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, src.shape[1],
                   cuda.gridDim.x * cuda.blockDim.x):
        dst[b, e] = src[i, e] if ok else NAN


# ---------------------------------------------------------------------------- launchers
def _round_warp(n: int) -> int:
    return max(32, -(-n // 32) * 32)


def _plan(B: int, H: int, T: int, Tmax: int, hd: int) -> tuple[int, int, int]:
    """(threads NT, splits S, span) for one shape: static, so one graph serves every pos."""
    nt = max(_round_warp(hd), min(TILE, _round_warp(Tmax)))
    want = max(1, math.ceil(TARGET_BLOCKS / (B * H * T)))
    splits = min(math.ceil(Tmax / nt), want)
    span = math.ceil(math.ceil(Tmax / splits) / nt) * nt  # whole tiles per split
    return nt, math.ceil(Tmax / span), span


_workspace: dict[tuple, tuple] = {}


def _partials(B: int, H: int, T: int, splits: int, hd: int):
    """Cached (part_o, part_ml) for S > 1; tiny placeholders (never touched) for S == 1."""
    key = (B * H, T, splits, hd) if splits > 1 else (1, 1, 1, 1)
    if key not in _workspace:
        _workspace[key] = (cuda.device_array(key, np.float32),
                           cuda.device_array(key[:3] + (2,), np.float32))
    return _workspace[key]


def attention(qkv, k_cache, v_cache, pos, out, *, n_head, stream=0) -> None:
    """Causal attention of this step's T queries over the cache, after appending its k, v.

    qkv (B, T, 3C): fused q | k | v, head h at [h*hd:(h+1)*hd] of each; k_cache, v_cache
    (B, H, Tmax, hd) are updated in place at positions pos..pos+T-1; pos: device int32 (1,),
    read on the device; out (B, T, C). Query t (absolute position pos+t) attends to cache
    positions 0..pos+t with scale 1/sqrt(hd). pos < 0 or pos + T > Tmax (only checkable on
    the device) leaves the caches alone and writes NaN to out.
    """
    _check.device_array("qkv", qkv, ndim=3)
    B, T, C3 = qkv.shape
    n_head = _check.positive("n_head", n_head)
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv: last dim {C3} must be 3*C with C a multiple of n_head={n_head}")
    C = C3 // 3
    hd = C // n_head
    if hd > MAX_HD:
        raise ValueError(f"head dim C/n_head = {hd}: at most {MAX_HD} supported")
    _check.device_array("k_cache", k_cache, shape=(B, n_head, None, hd))
    Tmax = k_cache.shape[2]
    _check.device_array("v_cache", v_cache, shape=(B, n_head, Tmax, hd))
    _check.device_array("pos", pos, dtype=np.int32, shape=(1,))
    _check.device_array("out", out, shape=(B, T, C))
    if T > Tmax:
        raise ValueError(f"qkv: T={T} new positions exceed the cache size Tmax={Tmax}")
    # Outputs must not overlap what other blocks still read.
    _check.no_overlap({"qkv": qkv, "k_cache": k_cache, "v_cache": v_cache, "out": out},
                 (("out", "qkv"), ("out", "k_cache"), ("out", "v_cache"), ("k_cache", "qkv"),
                  ("v_cache", "qkv"), ("k_cache", "v_cache")))
    nt, splits, span = _plan(B, n_head, T, Tmax, hd)
    part_o, part_ml = _partials(B, n_head, T, splits, hd)
    n = B * T * C
    launch(kv_write_kernel, min(math.ceil(n / 256), 1024), 256, (qkv, k_cache, v_cache, pos),
           stream)
    launch(attention_kernel, (B * n_head, T, splits), nt,
           (qkv, k_cache, v_cache, pos, out, np.int32(span), part_o, part_ml), stream)
    if splits > 1:
        launch(attention_combine_kernel, (B * n_head, T), _round_warp(hd),
               (pos, np.int32(Tmax), np.int32(span), part_o, part_ml, out), stream)


def gather_batch(src, index, dst, *, stream=0) -> None:
    """dst[b] = src[index[b]] for b < B: src, dst (B, ...) float32, index device int32 (B,),
    read on the device (an out-of-range entry gives a NaN row). Beam search reorders its KV
    caches with this. dst must not overlap src: rows are read while others are written."""
    _check.device_array("src", src)
    B = src.shape[0]
    _check.device_array("index", index, dtype=np.int32, shape=(B,))
    _check.device_array("dst", dst, shape=tuple(src.shape))
    _check.no_overlap({"dst": dst, "src": src}, (("dst", "src"),))  # cannot work in place
    row = src.size // B
    threads = min(256, _round_warp(row))
    launch(gather_batch_kernel, (min(math.ceil(row / threads), 1024), B), threads,
           (src.reshape(B, row), index, dst.reshape(B, row)), stream)


# ---------------------------------------------------------------------------- check, then time
if __name__ == "__main__":
    from proto.timing import bench

    rng = np.random.default_rng(0)
    B, H, hd, Tmax = 5, 12, 64, 1024  # GPT-2 small beam search: 5 beams, 1024 positions
    C = H * hd
    caches = [rng.standard_normal((B, H, Tmax, hd)).astype(np.float32) for _ in range(2)]
    dk, dv = (cuda.to_device(c) for c in caches)
    for T, p in ((1, 0), (1, 511), (1, 1023), (5, 0), (1024, 0)):
        qkv = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
        dq, pos = cuda.to_device(qkv), cuda.to_device(np.array([p], np.int32))
        out = cuda.device_array((B, T, C), np.float32)
        attention(dq, dk, dv, pos, out, n_head=H)
        want, _, _ = attention_ref(qkv, dk.copy_to_host(), dv.copy_to_host(), p, H)
        err = float(np.abs(out.copy_to_host() - want).max())
        assert err < 1e-4, f"T={T} pos={p}: max error {err}"
        t = bench(lambda: attention(dq, dk, dv, pos, out, n_head=H), reps=50)
        kv_bytes = 2 * B * H * (p + T) * hd * 4
        print(f"attention B={B} H={H} hd={hd} T={T} pos={p} (splits {_plan(B, H, T, Tmax, hd)[1]}):"
              f" {t.median_us:.1f} us (p10 {t.p10_ms * 1e3:.1f}, p90 {t.p90_ms * 1e3:.1f}),"
              f" K+V {kv_bytes / t.median_ms / 1e6:.0f} GB/s, max error {err:.1e}")
    order = np.array([4, 0, 0, 2, 1], np.int32)
    index, dst = cuda.to_device(order), cuda.device_array_like(dk)
    gather_batch(dk, index, dst)
    assert np.array_equal(dst.copy_to_host(), dk.copy_to_host()[order]), "gather_batch differs"
    t = bench(lambda: gather_batch(dk, index, dst), reps=50)
    print(f"gather_batch {tuple(dk.shape)}: {t.median_us:.1f} us, "
          f"{2 * dk.nbytes / t.median_ms / 1e6:.0f} GB/s read + written")
