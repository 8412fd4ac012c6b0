"""Causal self-attention over a KV cache whose fill level `pos` lives in device memory.

`pos` is read on the device, so one launch configuration (and one CUDA graph) serves every
cache length: grids depend on (B, H, T, Tmax, hd), never on pos. One call is one or two
launches on one stream:

  1. `attention_kernel`, grid (B*H, T, S): block (bh, t, s) takes query t against the cache
     positions of split s, [s*span, (s+1)*span) clipped to [0, pos+t]. Each warp streams a
     few positions per batch (SMALL_CONFIG), its lanes along the head dim (a 128-byte row
     segment per load, every K and V load of the batch issued before any is used) and an
     online softmax of its own (running max, sum and output); the block then merges its
     warps in a fixed order. Keys and values of this step's tokens (positions
     pos..pos+T-1) are read from qkv itself, and block (bh, t, 0) writes token t's k, v into
     the caches: no other block reads those cache rows, so the cache write needs no launch
     of its own.
  2. `attention_combine_kernels`, only when S > 1, merges each query's S partial
     (max, sum, output) triples in split order, loading them all at once (before it knows
     pos: splits past the query are loaded and ignored), not one round trip each. Decode
     (T = 1) has only B*H queries (GPT-2 beam search: 60), too few blocks to keep an H200
     busy, so the cache is split over S blocks per query (flash-decoding); prefill has enough
     queries and runs with S = 1, where step 1 writes `out` itself. (Merging in each
     query's last block of step 1 instead saved the launch but lost on the H200: 18.4 us a
     GPT-2 small decode call against 15.3 for both launches.)

Where a split fits in shared memory whole (GPT-2's decode: 64 positions of head dim 64),
step 1 is `make_attention_tile`'s kernel instead: the split's K and V copied there before
the early-launch wait, then scores, softmax and P.V by the block as a small matrix product
(on the H200 12.8 us a launch at position 512 against 17.4, and 7% off GPT-2 small's step;
`attention(..., tile=False)` keeps the plain kernels). The paragraphs below describe the kernels that
serve the other shapes (prefill, longer splits, head dims past 64 or not a multiple of 4).

With `rows` (beam search without moving the cache, `reorder_rows`), step 1 is a variant
compiled to read each earlier position's row from the table; the plain variant has none of
that code (it cost 2.9 us a call when it was only switched off). A warp loads its next
batch's rows while the current batch's K and V are on their way, and the first batch's
beside pos, so no K or V load waits behind a load of the table. For head dims up to 64 it
is another kernel (`make_attention_groups`, a position to each group of lanes), which the
H200 measured faster with the table and slower without it (`_WITH_ROWS`).

Guard: pos is only known on the device. A step that does not fit (pos < 0 or
pos + T > Tmax) writes nothing to the caches and NaN to every output, so an overflow shows in
the result instead of corrupting memory. T > Tmax is rejected on the host.

The S > 1 partial results live in scratch from `proto.device.backend.empty`, read only by the
combine launch of the same call.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kernels import _check, _cpasync, _pdl
from kernels._mma import halves, ld16
from kernels._reduce import shfl_xor, warp_allreduce
from proto.device import backend
from proto.device.backend import cuda, jit, jit_per_dtype, launch

MAX_HD = 256  # largest head dim
if not backend.SIMULATOR:
    # (lanes' head dims / 32, positions per warp per batch, warps): head dims up to 64 keep
    # 4 positions x 2 dims of K and of V in flight per lane; larger head dims 2 positions.
    SMALL_CONFIG, LARGE_CONFIG = (2, 4, 8), (8, 2, 8)
    TARGET_BLOCKS = 1024  # decode splits the cache until the grid has about this many blocks
    COMBINE_CHUNK = 16    # splits whose partials a combine thread loads at once
    MAX_PARTS = 8         # partial sums of qkv the tile kernel adds as it loads
else:
    # Simulated threads cost ~0.1 ms each: one-warp blocks, a few positions per batch.
    SMALL_CONFIG, LARGE_CONFIG = (2, 2, 1), (8, 2, 1)
    TARGET_BLOCKS = 8
    COMBINE_CHUNK = 4
    MAX_PARTS = 4
# Hot-loop indices are uint32 where they index: Numba guards signed indices against Python's
# negative indexing (extra instructions per access); unsigned ones compile to plain offsets.
_u = np.uint32
NEG_INF = np.float32(-np.inf)
NAN = np.float32(np.nan)
ZERO = np.float32(0.0)
_ALIGN = None if backend.SIMULATOR else 16   # cp.async needs 16-byte aligned shared rows


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


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _empty_split(part_o, part_ml, bh, t, split, tid, hd):
    """Write an empty split's partials (max -inf, sum 0, output 0). The combine kernel loads
    every split before it knows which hold positions; these keep those loads defined."""
    for d in range(tid, hd, cuda.blockDim.x):
        part_o[bh, t, split, d] = ZERO
    if tid == 0:
        part_ml[bh, t, split, 0] = NEG_INF
        part_ml[bh, t, split, 1] = ZERO


@cuda.jit(device=True, inline="always")
def _projected(qkv, bias, row, col):
    """Element (row, col) of the qkv projection from its P = qkv.shape[0] partial sums
    (qkv (P, rows, 3C); `kernels.gemm.partials`), added in order, plus bias[col] when `bias`
    covers every column (else it is a placeholder): the order of gemm's split-K reduction.
    All P loads are issued before the first add (one memory round trip, not P)."""
    vals = cuda.local.array(MAX_PARTS, np.float32)
    n = qkv.shape[0]
    for s in range(MAX_PARTS):
        vals[s] = qkv[_u(s), row, col] if s < n else ZERO
    v = ZERO
    for s in range(MAX_PARTS):
        v += vals[s]   # (+0 past the last: no change)
    if bias.shape[0] == qkv.shape[2]:
        v += bias[col]
    return v


# qkv, k_cache, v_cache, pos, out, span, part_o, part_ml, rows: qkv, the caches and out in
# the storage dtype {t}, the splits' partials in float32
_ATT_ARGS = ("{t}[:, :, ::1], {t}[:, :, :, ::1], {t}[:, :, :, ::1], int32[::1], "
             "{t}[:, :, ::1], int32, float32[:, :, :, ::1], float32[:, :, :, ::1], "
             "int32[:, ::1]")


_NAN_WORDS = np.uint32(0x7E007E00)   # two float16 NaN


@cuda.jit(device=True, inline="always")
def _load_kv16(kw, vw, r, qkv, k_cache, v_cache, b, h, p, p0, row, ok, d0):
    """The 16-byte-load kernels' K and V of one position (`make_attention(grouped=True)`,
    `make_attention_groups(packed=True)`): this lane's 8 head dims from d0, one load each,
    into words r*4 .. r*4+3 of kw and vw, from cache row `row` below p0, else this step's
    token from qkv; NaN where not `ok` (a row outside the batch)."""
    T, H, Tmax, hd = qkv.shape[1], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    C = H * hd
    if p < p0:
        at = ((row * _u(H) + _u(h)) * _u(Tmax) + p) * _u(hd) + d0
        wk, wv = ld16(k_cache, at), ld16(v_cache, at)
    else:   # this step's token, from qkv
        at = (_u(b) * _u(T) + (p - _u(p0))) * _u(3 * C) + _u(C + h * hd) + d0
        wk, wv = ld16(qkv, at), ld16(qkv, at + _u(C))
    for e in range(4):
        kw[r * 4 + e] = wk[e] if ok else _NAN_WORDS
        vw[r * 4 + e] = wv[e] if ok else _NAN_WORDS


@cuda.jit(device=True, inline="always")
def _dot_kv16(q, kw, r):
    """q's 8 dims (float32) . the K words of position r (4 pairs of halves)."""
    partial = ZERO
    for e in range(4):
        k0, k1 = halves(kw[r * 4 + e])
        partial += q[2 * e] * k0
        partial += q[2 * e + 1] * k1
    return partial


@cuda.jit(device=True, inline="always")
def _add_kv16(acc, vw, r, pr):
    """acc's 8 dims += pr * the V words of position r."""
    for e in range(4):
        v0, v1 = halves(vw[r * 4 + e])
        acc[2 * e] += pr * v0
        acc[2 * e + 1] += pr * v1


def _att_signature(dtype, extra: str = "") -> str:
    return "void(" + _ATT_ARGS.format(t=np.dtype(dtype).name) + extra + ")"


class Variant(NamedTuple):
    """One compiled attention kernel and its geometry (see `make_attention`)."""
    kernel: object
    threads: int
    unit: int      # positions a block consumes per batch (warps x positions)
    max_hd: int
    config: tuple
    use_rows: bool = False
    dtype: np.dtype = np.dtype(np.float32)   # storage of qkv, the caches and out


def make_attention(slots: int, positions: int, warps: int, min_blocks: int = 0,
                   use_rows: bool = False, preload: int = 0, dtype=np.float32,
                   grouped: bool = False) -> Variant:
    """The attention kernel for head dims up to 32*slots: lane l of a warp holds head dims
    l, l+32, ..., and a warp takes `positions` cache positions per batch, loading all of
    their K and V (2 * positions * slots loads per lane) before using any. `min_blocks`:
    resident blocks per SM the registers must allow (launch bounds). `use_rows`: earlier
    positions are read from the rows that the `rows` table names (a compile-time choice:
    without it the kernel never touches `rows`). `preload`: up to this many of the split's
    cache positions have their K and V copied into shared memory by cp.async before the
    early-launch wait (see the kernel), so they fly while the predecessor finishes and hold
    no registers; the rest are loaded as without it. Needs head dims a multiple of 4.
    `dtype`: the storage of qkv, the caches and out (float32 or float16); scores, softmax and
    output are float32 whatever it is (each element converted as loaded, the output rounded
    once as stored).

    `grouped` (float16, slots 8): lane l holds head dims 8l .. 8l+7 instead of l, l+32, ...,
    so a K or V row is one 16-byte load a lane (kernels._mma.ld16) instead of eight 2-byte
    ones, kept as packed words (half the registers a position) and converted as used. The
    strided form spends most of its issue slots on loads and addresses at head dim 256 (GPT-J:
    85 us a layer at position 512 on the H100 against cuDNN's 26). Needs hd a multiple of 8
    and qkv and the caches 16-byte aligned (`attention` checks)."""
    if preload and use_rows:
        raise ValueError("make_attention: preload reads rows in place, not through a row table")
    if preload and np.dtype(dtype) != np.float32:
        raise ValueError("make_attention: preload copies float32 rows (cp.async, 16 bytes)")
    if grouped and (np.dtype(dtype) != np.float16 or slots != 8 or preload):
        raise ValueError("make_attention: grouped reads 8 float16 dims a lane (slots 8, no "
                         "preload)")
    unit = warps * positions
    kv_size = positions * slots
    width = 32 * slots            # head dims a warp covers
    red_o_size = warps * width
    ml_size = 2 * warps
    pre_size = max(1, preload * width)   # (preload) K, and V, of `preload` positions
    bounds = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}
    n_words = 4 * positions if grouped else 1   # (grouped) a batch's rows as packed halves
    float_size = 1 if grouped else kv_size

    @cuda.jit(device=True, inline="always")
    def dim(lane, i):
        """The head dim of a lane's i-th slot."""
        return 8 * lane + i if grouped else lane + 32 * i

    @jit(_att_signature(dtype), writes=("k_cache", "v_cache", "out", "part_o", "part_ml"),
         early_launch=True, **bounds)
    def attention_kernel(qkv, k_cache, v_cache, pos, out, span, part_o, part_ml, rows):
        """Grid (B*H, T, S), 32*warps threads. Query t of head bh against split s of the
        cache. With S == 1 writes out[b, t, h*hd:(h+1)*hd]; otherwise the unnormalized
        output, max and sum to part_o[bh, t, s], part_ml[bh, t, s]. With use_rows, cached
        position p of sequence b is in row rows[b, p] (see `attention`)."""
        red_ml = cuda.shared.array(ml_size, np.float32)     # per warp: max, then sum
        red_o = cuda.shared.array(red_o_size, np.float32)   # per warp: output (width)
        q = cuda.local.array(slots, np.float32)             # this lane's dims of q, scaled
        acc = cuda.local.array(slots, np.float32)           # ... of the output, times exp(-m)
        kv = cuda.local.array(float_size, np.float32)       # [r * slots + i] K of a batch
        vv = cuda.local.array(float_size, np.float32)       # ... and V
        kw = cuda.local.array(n_words, np.uint32)           # (grouped) [r * 4 + w] K words
        vw = cuda.local.array(n_words, np.uint32)           # ... and V
        sc = cuda.local.array(positions, np.float32)        # the batch's scores
        ahead = cuda.local.array(positions, np.int32)       # (rows) the batch's cache rows
        ks = cuda.shared.array(pre_size, np.float32, alignment=_ALIGN)  # (preload) [r*width+d]
        vs = cuda.shared.array(pre_size, np.float32, alignment=_ALIGN)
        T = qkv.shape[1]
        H, Tmax, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        C = H * hd
        bh = cuda.blockIdx.x
        b = bh // H
        h = bh - b * H
        t = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        lo = split * span
        n_pre = 0
        if preload:
            # Before the wait, pos may not be final; it only decides which rows to copy: the
            # split's rows below it, at most `preload`. A copied row is used after the wait
            # only if it lies below the final pos, and every such row was written by an
            # earlier step's launch, which has completed by now (under early launch every
            # kernel but the predecessor has, and an earlier step is many kernels back).
            # cp.async.cg reads L2, never a stale line of this SM's L1.
            n_pre = min(max(min(lo + span, pos[0], Tmax) - lo, 0), preload)   # in the cache
            quads = _u(hd // 4)
            row0 = (_u(b) * _u(H) + _u(h)) * _u(Tmax) + _u(lo)
            for q4 in range(tid, n_pre * (hd // 4), cuda.blockDim.x):
                r, c4 = _u(q4) // quads, _u(q4) % quads
                _cpasync.copy16(ks, r * _u(width) + c4 * _u(4), k_cache,
                                (row0 + r) * _u(hd) + c4 * _u(4))
                _cpasync.copy16(vs, r * _u(width) + c4 * _u(4), v_cache,
                                (row0 + r) * _u(hd) + c4 * _u(4))
        _pdl.wait()   # (early launch: q, pos and the cache are earlier kernels' outputs)
        _pdl.launch_dependents()
        # q first: its loads need no pos, so they overlap the load of pos.
        scale = np.float32(1.0) / math.sqrt(np.float32(hd))   # float32: no double math
        for i in range(slots):
            d = _u(min(dim(lane, i), hd - 1))
            q[i] = qkv[b, t, _u(h * hd) + d] * scale
            acc[i] = ZERO
        for i in range(slots):
            if dim(lane, i) >= hd:
                q[i] = ZERO  # past hd: q zero, so the clipped K loads add nothing
        if use_rows:   # the first batch's rows, loaded beside pos (their use waits on pos)
            for r in range(positions):
                ahead[r] = rows[b, _u(min(lo + warp * positions + r, Tmax - 1))]
        p0 = pos[0]
        if preload:   # the copies land before any thread reads them, or leaves the block
            _cpasync.wait_all()
            cuda.syncthreads()
        # Every condition below is uniform over the block, so early returns skip no barrier.
        if p0 < 0 or p0 + T > Tmax:
            if cuda.gridDim.z == 1:
                for d in range(tid, hd, cuda.blockDim.x):
                    out[b, t, h * hd + d] = NAN
            else:   # the combine kernel writes the NaN; it still loads this split
                _empty_split(part_o, part_ml, bh, t, split, tid, hd)
            return
        if split == 0:  # token t's k, v into the caches; attention reads them from qkv
            for d in range(tid, hd, cuda.blockDim.x):
                k_cache[b, h, p0 + t, d] = qkv[b, t, C + h * hd + d]
                v_cache[b, h, p0 + t, d] = qkv[b, t, 2 * C + h * hd + d]
        hi = min(lo + span, p0 + t + 1)  # causal: positions 0..pos+t
        if lo >= hi:   # wholly after the query (so S > 1): the combine kernel loads it and
            _empty_split(part_o, part_ml, bh, t, split, tid, hd)   # skips it: it must hold values
            return
        hd_last = _u(hd - 1)
        qk, qv = _u(C + h * hd), _u(2 * C + h * hd)  # this head's k, v columns in qkv
        m = NEG_INF    # this warp's running max (uniform over the warp)
        l_sum = ZERO   # its running sum of exp(score - m)
        B = k_cache.shape[0]
        for base in range(lo, hi, unit):  # the same trip count for every warp of the block
            first = base + warp * positions
            for r in range(positions):
                # Past hi, re-read position hi-1 (in bounds); its score is masked below.
                p = _u(min(first + r, hi - 1))
                row, ok = _u(b), True
                # (compiled out without use_rows; a position past hi is masked: any row will do)
                if use_rows and p < p0 and first + r < hi:
                    named = ahead[r]
                    ok = 0 <= named < B
                    row = _u(named if ok else b)
                if grouped:   # the lane's 8 dims of K and of V: one 16-byte load each
                    # (lanes past hd re-read the last 8)
                    _load_kv16(kw, vw, r, qkv, k_cache, v_cache, b, h, p, p0, row, ok,
                               _u(min(8 * lane, hd - 8)))
                    continue
                for i in range(slots):
                    d = _u(min(lane + 32 * i, hd_last))  # q is 0 on dims past hd
                    if preload and p < p0 and p - _u(lo) < _u(n_pre):   # copied: see above
                        kv[r * slots + i] = ks[(p - _u(lo)) * _u(width) + d]
                        vv[r * slots + i] = vs[(p - _u(lo)) * _u(width) + d]
                    elif p < p0:   # a row outside the cache: NaN
                        kv[r * slots + i] = k_cache[row, h, p, d] if ok else NAN
                        vv[r * slots + i] = v_cache[row, h, p, d] if ok else NAN
                    else:  # this step's token: from qkv (the cache row may be unwritten)
                        kv[r * slots + i] = qkv[b, _u(p - p0), qk + d]
                        vv[r * slots + i] = qkv[b, _u(p - p0), qv + d]
            if use_rows:   # the next batch's rows, loaded while this one's K and V arrive
                for r in range(positions):
                    ahead[r] = rows[b, _u(min(first + unit + r, Tmax - 1))]
            for r in range(positions):
                partial = ZERO
                if grouped:
                    partial = _dot_kv16(q, kw, r)
                else:
                    for i in range(slots):
                        partial += q[i] * kv[r * slots + i]
                sc[r] = warp_allreduce(partial, False)
            m_new = m
            for r in range(positions):
                if first + r < hi:
                    m_new = max(m_new, sc[r])
            if m_new > NEG_INF:
                alpha = math.exp(m - m_new)  # rescales what was summed under the old max
                l_sum *= alpha
                for i in range(slots):
                    acc[i] *= alpha
                for r in range(positions):
                    if first + r < hi:
                        pr = math.exp(sc[r] - m_new)
                        l_sum += pr
                        if grouped:
                            _add_kv16(acc, vw, r, pr)
                        else:
                            for i in range(slots):
                                acc[i] += pr * vv[r * slots + i]
                m = m_new
        # Merge the warps in order: o = sum_w exp(m_w - M) o_w, likewise the sums.
        if lane == 0:
            red_ml[warp] = m
            red_ml[warps + warp] = l_sum
        for i in range(slots):
            d = dim(lane, i)
            if d < hd:
                red_o[warp * width + d] = acc[i]
        cuda.syncthreads()
        for d in range(tid, hd, cuda.blockDim.x):
            top = NEG_INF
            for w in range(warps):
                top = max(top, red_ml[w])
            o = ZERO
            total = ZERO
            for w in range(warps):
                mw = red_ml[w]
                if mw > NEG_INF:  # a warp whose positions all lay past hi holds nothing
                    e = math.exp(mw - top)
                    o += e * red_o[w * width + d]
                    total += e * red_ml[warps + w]
            if cuda.gridDim.z == 1:
                out[b, t, h * hd + d] = o / total
            else:
                part_o[bh, t, split, d] = o
                if d == 0:
                    part_ml[bh, t, split, 0] = top
                    part_ml[bh, t, split, 1] = total

    return Variant(attention_kernel, 32 * warps, unit, width,
                   (slots, positions, warps, min_blocks) + (("grouped",) if grouped else ()),
                   use_rows, np.dtype(dtype))


# make_attention_groups' kernel repeats make_attention's start (the guard on pos, the cache
# write, the split's end) and end (the warps' merge) line for line. Moved into two shared
# device functions (_open_split, _close_split), the same registers by ptxas, the plain
# kernel took 18.4 us at position 512 instead of 14.7 and the row-table one 18.8 instead of
# 17.5 (H200, dev.bench.bench_decode's case, one process), so each kernel keeps its own copy.
def make_attention_groups(group: int, dims: int, positions: int, warps: int,
                          min_blocks: int = 0, dtype=np.float32, use_rows: bool = True,
                          packed: bool = False) -> Variant:
    """The row-table attention kernel (`make_attention(..., use_rows=True)`'s job) with a
    position to each group of `group` lanes (a power of two dividing 32): lane j of a group
    holds head dims j, j + group, ..., `dims` of them (so one load instruction reads `group`
    consecutive floats of a row), and a group takes
    `positions` positions a batch, loading all their K and V first. A score is a sum over
    the group's lanes (log2(group) shuffles, every group of the warp at once, where
    `make_attention` spends a 5-step butterfly on each position), and each group keeps its
    own online softmax of the positions it saw (one exponential a position, where every
    lane of `make_attention` computes every position's); the warp's groups are merged once,
    after the last batch. Same arguments, grid, guard, cache writes, partials and
    `min_blocks` and `dtype` as `make_attention`; head dims up to group * dims. `use_rows`
    as `make_attention`'s (float32 takes this kernel with the row table only: see
    `_WITH_ROWS`).

    `packed` (float16, dims 8): lane j of a group holds head dims 8j .. 8j+7 instead of j,
    j + group, ..., so a position's K or V row is one 16-byte load a lane (kernels._mma.ld16),
    kept as packed halves and converted as used, as `make_attention(grouped=True)` does past
    head dim 64; here 8 lanes cover GPT-2's 64, four positions to a warp at once. Needs hd a
    multiple of 8 and qkv and the caches 16-byte aligned (`attention` checks)."""
    if group & (group - 1) or not 1 <= group <= 32:
        raise ValueError(f"make_attention_groups: group {group} is not a power of two <= 32")
    if packed and (np.dtype(dtype) != np.float16 or dims != 8):
        raise ValueError("make_attention_groups: packed reads 8 float16 dims a lane (dims 8)")
    groups = 32 // group                       # groups a warp
    unit = warps * groups * positions          # positions a block consumes a batch
    width = group * dims                       # head dims a group covers
    kv_size = dims if packed else positions * dims   # (packed: the merge's partner acc)
    n_words = 4 * positions if packed else 1   # (packed) a batch's rows as packed halves
    red_o_size = warps * width
    ml_size = 2 * warps
    bounds = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}

    @cuda.jit(device=True, inline="always")
    def dim(j, i):
        """The head dim of lane j's i-th slot in its group."""
        return 8 * j + i if packed else j + group * i

    @cuda.jit(device=True)
    def merge(m, l_sum, acc, m2, l2, acc2):
        """(m, l_sum, acc) and a partner's (m2, l2, acc2): one online softmax state for both
        (acc updated in place). An empty state has m = -inf and holds nothing."""
        top = max(m, m2)
        e1 = ZERO if m == NEG_INF else math.exp(m - top)
        e2 = ZERO if m2 == NEG_INF else math.exp(m2 - top)
        for i in range(dims):
            acc[i] = acc[i] * e1 + acc2[i] * e2
        return top, l_sum * e1 + l2 * e2

    @jit(_att_signature(dtype), writes=("k_cache", "v_cache", "out", "part_o", "part_ml"),
         early_launch=True, **bounds)
    def attention_kernel(qkv, k_cache, v_cache, pos, out, span, part_o, part_ml, rows):
        """Grid (B*H, T, S), 32*warps threads: as `make_attention`'s kernel, a position to
        each group of lanes."""
        red_ml = cuda.shared.array(ml_size, np.float32)     # per warp: max, then sum
        red_o = cuda.shared.array(red_o_size, np.float32)   # per warp: output (width)
        q = cuda.local.array(dims, np.float32)              # this lane's dims of q, scaled
        acc = cuda.local.array(dims, np.float32)            # ... of the output, times exp(-m)
        kv = cuda.local.array(kv_size, np.float32)          # [r * dims + i] K of a batch
        vv = cuda.local.array(kv_size, np.float32)          # ... and V
        kw = cuda.local.array(n_words, np.uint32)           # (packed) [r * 4 + w] K words
        vw = cuda.local.array(n_words, np.uint32)           # ... and V
        sc = cuda.local.array(positions, np.float32)        # the group's scores of the batch
        ahead = cuda.local.array(positions, np.int32)       # the batch's cache rows
        T = qkv.shape[1]
        H, Tmax, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        B = k_cache.shape[0]
        C = H * hd
        bh, t, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        direct = cuda.gridDim.z == 1   # one split: the output itself
        b = bh // H
        h = bh - b * H
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        j, g = lane % group, lane // group     # dim lane within the group, group
        _pdl.wait()   # (early launch: q, pos and the cache are earlier kernels' outputs)
        _pdl.launch_dependents()
        scale = np.float32(1.0) / math.sqrt(np.float32(hd))   # float32: no double math
        hd_last = _u(hd - 1)
        for i in range(dims):
            d = _u(min(dim(j, i), hd_last))
            q[i] = qkv[b, t, _u(h * hd) + d] * scale
            acc[i] = ZERO
        for i in range(dims):
            if dim(j, i) >= hd:
                q[i] = ZERO  # past hd: q zero, so the clipped K loads add nothing
        lo = split * span
        me = (warp * groups + g) * positions    # this group's first position of a batch
        if use_rows:   # the first batch's rows, loaded beside pos (their use waits on pos)
            for r in range(positions):
                ahead[r] = rows[b, _u(min(lo + me + r, Tmax - 1))]
        p0 = pos[0]
        # Every condition below is uniform over the block, so early returns skip no barrier.
        if p0 < 0 or p0 + T > Tmax:
            if direct:
                for d in range(tid, hd, cuda.blockDim.x):
                    out[b, t, h * hd + d] = NAN
            else:   # the combine kernel writes the NaN; it still loads this split
                _empty_split(part_o, part_ml, bh, t, split, tid, hd)
            return
        if split == 0:  # token t's k, v into the caches; attention reads them from qkv
            for d in range(tid, hd, cuda.blockDim.x):
                k_cache[b, h, p0 + t, d] = qkv[b, t, C + h * hd + d]
                v_cache[b, h, p0 + t, d] = qkv[b, t, 2 * C + h * hd + d]
        hi = min(lo + span, p0 + t + 1)  # causal: positions 0..pos+t
        if lo >= hi:   # wholly after the query (so S > 1): the combine kernel loads it and
            _empty_split(part_o, part_ml, bh, t, split, tid, hd)   # skips it: it must hold values
            return
        qk, qv = _u(C + h * hd), _u(2 * C + h * hd)  # this head's k, v columns in qkv
        m = NEG_INF    # this group's running max
        l_sum = ZERO   # its running sum of exp(score - m)
        for base in range(lo, hi, unit):  # the same trip count for every warp of the block
            first = base + me
            for r in range(positions):
                # Past hi, re-read position hi-1 (in bounds); its score is masked below.
                p = _u(min(first + r, hi - 1))
                row, ok = _u(b), True
                # (compiled out without use_rows; a position past hi is masked: any row will do)
                if use_rows and p < p0 and first + r < hi:
                    named = ahead[r]
                    ok = 0 <= named < B
                    row = _u(named if ok else b)
                if packed:   # the lane's 8 dims of K and of V: one 16-byte load each
                    # (lanes past hd re-read the last 8)
                    _load_kv16(kw, vw, r, qkv, k_cache, v_cache, b, h, p, p0, row, ok,
                               _u(min(8 * j, hd - 8)))
                    continue
                for i in range(dims):
                    d = _u(min(j + group * i, hd_last))  # q is 0 on dims past hd
                    if p < p0:   # a row outside the cache: NaN
                        kv[r * dims + i] = k_cache[row, h, p, d] if ok else NAN
                        vv[r * dims + i] = v_cache[row, h, p, d] if ok else NAN
                    else:  # this step's token: from qkv (the cache row may be unwritten)
                        kv[r * dims + i] = qkv[b, _u(p - p0), qk + d]
                        vv[r * dims + i] = qkv[b, _u(p - p0), qv + d]
            if use_rows:   # the next batch's rows, loaded while this one's K and V arrive
                for r in range(positions):
                    ahead[r] = rows[b, _u(min(first + unit + r, Tmax - 1))]
            for r in range(positions):
                partial = ZERO
                if packed:
                    partial = _dot_kv16(q, kw, r)
                else:
                    for i in range(dims):
                        partial += q[i] * kv[r * dims + i]
                off = group // 2   # the group's sum, every group of the warp at once
                while off > 0:
                    partial += shfl_xor(partial, off)
                    off //= 2
                sc[r] = partial
            # A NaN score (a row outside the cache, or NaN data) must reach the output, also
            # when it is all a group saw: the max takes it, and NaN passes the test below.
            m_new = m
            for r in range(positions):
                if first + r < hi and not sc[r] <= m_new:
                    m_new = sc[r]
            if m_new != NEG_INF:
                alpha = math.exp(m - m_new)  # rescales what was summed under the old max
                l_sum *= alpha
                for i in range(dims):
                    acc[i] *= alpha
                for r in range(positions):
                    if first + r < hi:
                        pr = math.exp(sc[r] - m_new)
                        l_sum += pr
                        if packed:
                            _add_kv16(acc, vw, r, pr)
                        else:
                            for i in range(dims):
                                acc[i] += pr * vv[r * dims + i]
                m = m_new
        # The warp's groups into one state (a butterfly over the groups), then the warps
        # in order through shared memory: o = sum_w exp(m_w - M) o_w, likewise the sums.
        off = group
        while off < 32:
            m2 = shfl_xor(m, off)
            l2 = shfl_xor(l_sum, off)
            for i in range(dims):   # (kv is free now: it holds the partner's acc)
                kv[i] = shfl_xor(acc[i], off)
            m, l_sum = merge(m, l_sum, acc, m2, l2, kv)
            off *= 2
        if lane == 0:
            red_ml[warp] = m
            red_ml[warps + warp] = l_sum
        if g == 0:
            for i in range(dims):
                d = dim(j, i)
                if d < hd:
                    red_o[warp * width + d] = acc[i]
        cuda.syncthreads()
        for d in range(tid, hd, cuda.blockDim.x):
            top = NEG_INF
            for w in range(warps):
                top = max(top, red_ml[w])
            o = ZERO
            total = ZERO
            for w in range(warps):
                mw = red_ml[w]
                if mw != NEG_INF:  # a warp whose positions all lay past hi holds nothing
                    e = math.exp(mw - top)
                    o += e * red_o[w * width + d]
                    total += e * red_ml[warps + w]
            if direct:
                out[b, t, h * hd + d] = o / total
            else:
                part_o[bh, t, split, d] = o
                if d == 0:
                    part_ml[bh, t, split, 0] = top
                    part_ml[bh, t, split, 1] = total

    return Variant(attention_kernel, 32 * warps, unit, width,
                   ("groups", group, dims, positions, warps, min_blocks)
                   + (("packed",) if packed else ()), use_rows, np.dtype(dtype))


def make_attention_tile(capacity: int, warps: int, width: int, min_blocks: int = 0,
                        use_rows: bool = False) -> Variant:
    """The plain step's attention for splits of at most `capacity` positions, with the whole split
    in shared memory: a block copies its split's K and V there by cp.async before the
    early-launch wait (as `make_attention(..., preload=...)`), and after it computes from
    shared memory as a small matrix product, not a warp per position:

      scores   `threads // capacity` neighbouring lanes a position, each a strided share of the
               head dims (rows padded by 4 floats, so a warp's loads hit 32 banks), summed by
               log2 of them shuffles;
      softmax  the block's scores at once: one max, one exponential a position;
      P.V      a thread per (head dim, group of positions), the groups then summed in order.

    `make_attention`'s lanes-along-the-head-dim layout spends a 5-shuffle butterfly and an
    online-softmax update on every position in every warp (ncu at position 512: 6.7 million
    instructions a launch, the SMs 53% busy issuing, DRAM 27%). Same arguments, grid, guard,
    cache writes and partials as `make_attention`; head dims up to `width`, a multiple of 4
    (the copies are 16 bytes), cache rows 16-byte aligned (the caller checks); splits of at
    most `capacity` positions (the caller checks the plan's span). `use_rows`: earlier
    positions are read from the rows that the `rows` table names, as in `make_attention`
    (the table is final before the wait: the beam's reorder that writes it runs at least two
    kernels earlier, and only the predecessor may still run then); the split's entries are
    staged in shared memory first, a load a thread, so the copies do not hold them in
    registers."""
    threads = 32 * warps
    per_pos = threads // capacity     # lanes that share one position's score
    groups = threads // width         # position groups of the P.V product
    quads = width // 4                # 16-byte copies a row
    if per_pos * capacity != threads or per_pos & (per_pos - 1) or per_pos > 32:
        raise ValueError(f"make_attention_tile: {threads} threads do not split into {capacity} "
                         f"positions of a power of two <= 32 lanes each")
    if groups * width != threads or width % 32 or threads % quads or capacity % warps:
        raise ValueError(f"make_attention_tile: {threads} threads are not whole groups of "
                         f"width {width} (a multiple of 32), or {capacity} positions not "
                         f"whole rows of {warps} warps")
    stride = width + 4            # floats a shared row (16-byte aligned, banks shifted by 4)
    tile_size = capacity * stride
    copy_rows = threads // quads  # rows the block's copies cover a pass
    # Every loop below has a trip count known at compile time and uint32 indices: the
    # compiler unrolls them, and no index pays Numba's negative-index fix-up (with Python
    # ranges over runtime bounds the first draft executed as many instructions as the
    # kernel it replaced: 7.8 million a launch at position 512, ncu).
    bounds = {"launch_bounds": (threads, min_blocks)} if min_blocks else {}

    @jit(_att_signature(np.float32, ", float32[::1]"),
         writes=("k_cache", "v_cache", "out", "part_o", "part_ml"), early_launch=True, **bounds)
    def attention_tile_kernel(qkv, k_cache, v_cache, pos, out, span, part_o, part_ml, rows,
                              bias):
        """Grid (B*H, T, S), `threads` threads; as make_attention's kernel (without
        use_rows, `rows` is never read), but qkv is (P, B*T, 3C): P partial sums of the
        projection (P = 1: qkv itself), summed with `bias` as they load (`_projected`)."""
        ks = cuda.shared.array(tile_size, np.float32, alignment=_ALIGN)  # [r*stride+d]
        vs = cuda.shared.array(tile_size, np.float32, alignment=_ALIGN)
        qs = cuda.shared.array(width, np.float32)         # q, scaled
        sc = cuda.shared.array(capacity, np.float32)      # scores (-inf past the split's end)
        pe = cuda.shared.array(capacity, np.float32)      # exp(score - max)
        red = cuda.shared.array(threads, np.float32)      # [g*width+d] P.V of group g
        rs = cuda.shared.array(capacity, np.int32)        # (use_rows) the split's table rows
        T = out.shape[1]
        H, Tmax, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        C = H * hd
        bh = _u(cuda.blockIdx.x)
        b = bh // _u(H)
        h = bh - b * _u(H)
        t = _u(cuda.blockIdx.y)
        split = _u(cuda.blockIdx.z)
        tid = _u(cuda.threadIdx.x)
        lane, warp = tid % _u(32), tid // _u(32)
        B = k_cache.shape[0]
        # Bounds are signed (pos may be anything), indices uint32; the two never meet in a
        # comparison: Numba compares a signed with an unsigned 64-bit value in float64.
        lo = cuda.blockIdx.z * span
        qcol, kcol, vcol = h * _u(hd), _u(C) + h * _u(hd), _u(2 * C) + h * _u(hd)
        # Before the wait, as make_attention's preload: pos may not be final, it only picks
        # the rows to copy (the split's rows below it); rows at or past the final pos are
        # loaded again after the wait.
        n_pre = _u(min(max(min(lo + span, pos[0], Tmax) - lo, 0), capacity))
        c4 = tid % _u(quads)
        if use_rows:   # the split's rows of the table, a load a thread, then shared
            if tid < n_pre:
                rs[tid] = rows[b, _u(lo) + tid]
            cuda.syncthreads()
        for k in range(capacity // copy_rows):
            r = tid // _u(quads) + _u(k * copy_rows)
            if r < n_pre and c4 < _u(hd // 4):
                src = b
                if use_rows:   # (an entry outside 0..B-1 is copied from row b, NaN below)
                    named = rs[r]
                    src = _u(named) if 0 <= named < B else b
                at = (((src * _u(H) + h) * _u(Tmax)) + _u(lo) + r) * _u(hd) + c4 * _u(4)
                _cpasync.copy16(ks, r * _u(stride) + c4 * _u(4), k_cache, at)
                _cpasync.copy16(vs, r * _u(stride) + c4 * _u(4), v_cache, at)
        _pdl.wait()   # (early launch: q, pos and the cache are earlier kernels' outputs)
        _pdl.launch_dependents()
        scale = np.float32(1.0) / math.sqrt(np.float32(hd))
        row = b * _u(T) + t   # this query's row of qkv
        if tid < _u(hd):
            qs[tid] = _projected(qkv, bias, row, qcol + tid) * scale
        p0 = pos[0]
        _cpasync.wait_all()
        # A row the copies brought may be refilled below by another thread (if pos was
        # larger before the wait than after): every copy lands before any refill.
        cuda.syncthreads()
        # Every condition below is uniform over the block, so early returns skip no barrier.
        if p0 < 0 or p0 + T > Tmax:
            if cuda.gridDim.z == 1:
                if tid < _u(hd):
                    out[b, t, qcol + tid] = NAN
            else:
                _empty_split(part_o, part_ml, bh, t, split, tid, hd)
            return
        # Thread e < 2 hd takes element e of this step's (k | v) of head h below.
        if split == 0:   # token t's k, v into the caches
            for k in range(-(-2 * width // threads)):
                e = tid + _u(k * threads)
                if e < _u(2 * hd):
                    kv = e // _u(hd)
                    d = e - kv * _u(hd)
                    (v_cache if kv else k_cache)[b, h, _u(p0) + t, d] = \
                        _projected(qkv, bias, row, kcol + kv * _u(C) + d)
        hi = min(lo + span, p0 + cuda.blockIdx.y + 1)  # causal: positions 0..pos+t
        if lo >= hi:
            _empty_split(part_o, part_ml, bh, t, split, tid, hd)
            return
        n = _u(hi - lo)
        # This step's tokens 0..t in the split (their cache rows may be unwritten yet): from
        # qkv, one element a thread.
        for j in range(cuda.blockIdx.y + 1):
            if lo <= p0 + j < hi:
                r = _u(p0 + j - lo)
                for k in range(-(-2 * width // threads)):
                    e = tid + _u(k * threads)
                    if e < _u(2 * hd):
                        kv = e // _u(hd)
                        d = e - kv * _u(hd)
                        (vs if kv else ks)[r * _u(stride) + d] = _projected(
                            qkv, bias, b * _u(T) + _u(j), kcol + kv * _u(C) + d)
        p0 = _u(p0)   # (>= 0 past the guard)
        # The cache rows the copies did not bring, a warp a row: past them, or (rows) named
        # outside the cache, which give NaN.
        for k in range(capacity // warps):
            r = warp + _u(k * warps)
            p = _u(lo) + r
            if r < n and p < p0:
                src, ok = b, True
                if use_rows:
                    named = rows[b, p]
                    ok = 0 <= named < B
                    src = _u(named) if ok else b
                if not (r < n_pre and ok):
                    for j in range(width // 32):
                        d = lane + _u(32 * j)
                        if d < _u(hd):
                            ks[r * _u(stride) + d] = k_cache[src, h, p, d] if ok else NAN
                            vs[r * _u(stride) + d] = v_cache[src, h, p, d] if ok else NAN
        cuda.syncthreads()
        # Scores: lanes c = 0..per_pos-1 of position r take dims c, c + per_pos, ...
        r = tid // _u(per_pos)
        c = tid % _u(per_pos)
        s = ZERO
        if r < n:   # (rows past the split's positions hold nothing written: never read them)
            for j in range(width // per_pos):
                d = c + _u(j * per_pos)
                if d < _u(hd):
                    s += qs[d] * ks[r * _u(stride) + d]
        off = 1
        while off < per_pos:
            s += shfl_xor(s, off)
            off *= 2
        if c == 0:
            sc[r] = s if r < n else NEG_INF
        cuda.syncthreads()
        # Softmax: every warp finds the max (the same value), one thread a position its exp.
        m = NEG_INF
        for j in range((capacity + 31) // 32):
            i = lane + _u(32 * j)
            if i < _u(capacity):
                m = max(m, sc[i])
        m = warp_allreduce(m, True)
        if tid < _u(capacity):
            pe[tid] = math.exp(sc[tid] - m)   # 0 past the split's end
        cuda.syncthreads()
        total = ZERO
        for j in range((capacity + 31) // 32):
            i = lane + _u(32 * j)
            if i < _u(capacity):
                total += pe[i]
        total = warp_allreduce(total, False)
        # P.V: thread (g, d) sums positions g, g + groups, ... of head dim d.
        g = tid // _u(width)
        d = tid % _u(width)
        o = ZERO
        if d < _u(hd):
            for j in range(capacity // groups):
                i = g + _u(j * groups)
                if i < n:
                    o += pe[i] * vs[i * _u(stride) + d]
        red[tid] = o
        cuda.syncthreads()
        if tid < _u(hd):
            o = ZERO
            for k in range(groups):
                o += red[_u(k * width) + tid]
            if cuda.gridDim.z == 1:
                out[b, t, qcol + tid] = o / total
            else:
                part_o[bh, t, split, tid] = o
                if tid == 0:
                    part_ml[bh, t, split, 0] = m
                    part_ml[bh, t, split, 1] = total

    return Variant(attention_tile_kernel, threads, capacity, width,
                   ("tile", capacity, warps, width, min_blocks), use_rows)


SMALL = make_attention(*SMALL_CONFIG)
# The plain step's kernel with a split's K and V copied by cp.async before the early-launch
# wait: two batches of positions, a whole split at GPT-2 small's plan (64 positions, 32 KB).
SMALL_PRELOAD = make_attention(*SMALL_CONFIG, preload=2 * SMALL.unit)
# (SMALL_PRELOAD won its A/B, dev.ab.ab_attention_cp: 9 us a step less; `attention`'s
# preload=False picks SMALL wherever it would be used, for the test that compares the two)
# The plain step's kernel where a split fits in shared memory whole (GPT-2's decode: 64
# positions of head dim 64; 35 KB a block).
# (capacity, warps, width, blocks an SM the registers must allow: 40 registers. The
# row-table twin reading each copy's row from the table in global memory took 60 and spilled
# at 5 an SM; with the split's rows staged in shared memory first, 40 and no spill at 6. On
# the H200 at 6 an SM the WHILE token took 0.5516 ms against 0.5543 at 4: dev.ab.ab_attention_rows)
SMALL_TILE = make_attention_tile(*((64, 8, 64, 6) if not backend.SIMULATOR else (8, 1, 32)))
SMALL_TILE_ROWS = make_attention_tile(   # (the WHILE graph's)
    *((64, 8, 64, 6) if not backend.SIMULATOR else (8, 1, 32)), use_rows=True)
# (the tile won its A/B, dev.ab.ab_attention_tile, and so did its summing qkv's partials,
# dev.ab.ab_qkv_partials: both are the only path; `attention`'s tile=False keeps the plain
# kernels, for the tests that compare them)
LARGE = make_attention(*LARGE_CONFIG)
# The row-table variant of head dims up to 64 (GPT-2's; the WHILE graph's beam search) is
# `make_attention_groups`: 16 lanes x 4 dims, 2 positions a group a batch, so a lane has as
# many K and V loads in flight as SMALL_CONFIG's kernel, and 4 shuffles a score instead of
# 5 per position. 80 registers at 3 blocks an SM, no spill (at 4 an SM it spills). A/B on
# the H200 in one process (GPT-2 small, beam 5): the WHILE graph's token 0.700 ms against
# 0.722 with `make_attention`'s row-table kernel (bounded to 4 blocks an SM, which spilled
# 8 bytes); 0.7385 against 0.7596 on another machine. As the plain step's kernel it lost: 663 us a step at 3 blocks an SM, 630 at 4,
# against SMALL's 627, so the plain variant stays `make_attention`.
ROWS_GROUPS_CONFIG = (16, 4, 2, 8, 3) if not backend.SIMULATOR else (8, 8, 1, 1, 0)
# Half precision (GPT-J's KV cache): the plain and row-table kernels from the same sources;
# the tile and the preload copy float32 rows, and the step keeps its K and V in float32
# registers either way, so float16 takes the kernels they won against.
HALF = np.dtype(np.float16)
_PLAIN = {np.dtype(np.float32): (SMALL, LARGE),
          HALF: (make_attention(*SMALL_CONFIG, dtype=HALF), make_attention(*LARGE_CONFIG,
                                                                           dtype=HALF))}
_WITH_ROWS = {(v.config, v.dtype): (make_attention_groups(*ROWS_GROUPS_CONFIG, dtype=v.dtype)
                                    if v.config == SMALL.config else
                                    make_attention(*v.config, use_rows=True, dtype=v.dtype))
              for pair in _PLAIN.values() for v in pair}
assert all(_WITH_ROWS[(v.config, v.dtype)].max_hd >= v.max_hd
           for pair in _PLAIN.values() for v in pair)
# float16 past head dim 64 (GPT-J's 256), where qkv and the caches are 16-byte aligned: the
# grouped form, plain and with the row table; 4 positions a warp a batch, as many registers
# of K and V as the strided form's 2 (packed halves). Timed on the H100 with the row table
# at GPT-J's decode shape (results/h100/profiles/bench_half_attention_aa0562a.txt): 4 warps
# at 4 blocks an SM 26.8 us, 8 warps at 3 30.5, torch's scaled_dot_product_attention 27.1,
# the strided float16 kernel 93.2 (110 registers, 2 blocks an SM).
GROUPED_CONFIG = (8, 4, 4, 4) if not backend.SIMULATOR else (8, 2, 1)
_GROUPED = {rows: make_attention(*GROUPED_CONFIG, use_rows=rows, dtype=HALF, grouped=True)
            for rows in (False, True)}
# float16 up to head dim 64 (GPT-2's), aligned: the same 16-byte rows, 8 lanes a position
# (`make_attention_groups(packed=True)`), plain and with the row table; 4 positions a group a
# batch (64 a block of 4 warps). The strided form reads a 64-half row as two 2-byte loads a
# lane and sums each score over the whole warp; the float32 row-table kernel's 4 dims a lane
# became 8 halves in one load. Untimed on a GPU when it was chosen (dev.bench.
# bench_half_attention --model gpt2 times it against the strided kernels and torch's).
PACKED_CONFIG = (8, 8, 4, 4, 4) if not backend.SIMULATOR else (8, 8, 1, 1, 0)
_PACKED = {rows: make_attention_groups(*PACKED_CONFIG, dtype=HALF, use_rows=rows, packed=True)
           for rows in (False, True)}
attention_kernel = SMALL.kernel


@jit_per_dtype("void(int32[::1], int32, int32, float32[:, :, :, ::1], float32[:, :, :, ::1], "
               "{t}[:, :, ::1])", writes=("out",), early_launch=True)
def attention_combine_kernels(pos, tmax, span, part_o, part_ml, out):
    """Grid (B*H, T), >= hd threads: out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s
    over the splits s that hold positions <= pos + t, in split order. No barriers: each
    thread loads COMBINE_CHUNK splits' (m, l, o) at once, before it knows pos (splits past
    the query are loaded and ignored), then merges them online."""
    m_s = cuda.local.array(COMBINE_CHUNK, np.float32)
    l_s = cuda.local.array(COMBINE_CHUNK, np.float32)
    o_s = cuda.local.array(COMBINE_CHUNK, np.float32)
    H = part_o.shape[0] // out.shape[0]
    T, S, hd = out.shape[1], part_o.shape[2], part_o.shape[3]
    bh = cuda.blockIdx.x
    b = bh // H
    h = bh - b * H
    t = cuda.blockIdx.y
    d = cuda.threadIdx.x
    dc = _u(min(d, hd - 1))
    _pdl.wait()   # (early launch: pos and the partials are earlier kernels' outputs)
    _pdl.launch_dependents()
    p0 = pos[0]
    top = NEG_INF
    o = ZERO
    total = ZERO
    for s0 in range(0, S, COMBINE_CHUNK):
        for u in range(COMBINE_CHUNK):
            s = _u(min(s0 + u, S - 1))
            m_s[u] = part_ml[bh, t, s, 0]
            l_s[u] = part_ml[bh, t, s, 1]
            o_s[u] = part_o[bh, t, s, dc]
        used = (p0 + t) // span + 1  # splits holding positions 0..pos+t
        new_top = top
        for u in range(COMBINE_CHUNK):
            if s0 + u < used:
                new_top = max(new_top, m_s[u])
        if new_top > NEG_INF:
            scale = math.exp(top - new_top)
            o *= scale
            total *= scale
            for u in range(COMBINE_CHUNK):
                if s0 + u < used:
                    w = math.exp(m_s[u] - new_top)
                    o += w * o_s[u]
                    total += w * l_s[u]
            top = new_top
    if d < hd:
        bad = p0 < 0 or p0 + T > tmax
        out[b, t, h * hd + d] = NAN if bad else o / total


@jit_per_dtype("void({t}[:, :, :, ::1], int32[::1], int32[::1], int32, int32, "
               "{t}[:, :, :, ::1])", writes=("dst",))
def gather_batch_kernels(src, index, length, width, fixed, dst):
    """Grid (X, H, G * B) over (G, B, H, P * width) views: dst[g, b, h, :n * width] =
    src[g, index[b], h, :n * width] for every group g (the layers' K and V of a cache move
    in one launch), the first n of P positions, n = fixed if fixed >= 0 else length[0]
    (read on the device). An index or n out of range gives a whole NaN row."""
    B = dst.shape[1]
    g, b, h = cuda.blockIdx.z // B, cuda.blockIdx.z % B, cuda.blockIdx.y
    i = index[b]
    n = fixed if fixed >= 0 else length[0]
    row = dst.shape[3]
    ok = 0 <= i < B and 0 <= n and n * width <= row
    end = n * width if ok else row
    for e in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, end,
                   cuda.gridDim.x * cuda.blockDim.x):
        dst[g, b, h, e] = src[g, i, h, e] if ok else NAN


# ---------------------------------------------------------------------------- launchers
def kernel_for(hd: int, rows: bool = False, dtype=np.float32, aligned: bool = False) -> Variant:
    """The kernel variant `attention` launches for head dim hd, with or without a row table,
    for caches of `dtype`; `aligned`: qkv and the caches 16-byte aligned (float16 then reads
    a lane's 8 dims as one load: the packed group kernel up to head dim 64, the grouped
    form past it)."""
    small, large = _PLAIN[np.dtype(dtype)]
    if np.dtype(dtype) == HALF and hd % 8 == 0 and aligned:
        return _PACKED[rows] if hd <= _PACKED[rows].max_hd else _GROUPED[rows]
    plain = small if hd <= small.max_hd else large
    return _WITH_ROWS[(plain.config, plain.dtype)] if rows else plain


def _plan(B: int, H: int, T: int, Tmax: int, hd: int, variant: Variant | None = None,
          target_blocks: int | None = None) -> tuple[Variant, int, int]:
    """(kernel variant, splits S, span) for one shape: static, so one graph serves every pos.
    Splits of whole batches until B*H*T*S reaches the target (decode), none for prefill."""
    v = variant or kernel_for(hd)
    target = TARGET_BLOCKS if target_blocks is None else target_blocks
    want = max(1, -(-target // (B * H * T)))
    splits = min(-(-Tmax // v.unit), want)
    span = -(-(-(-Tmax // splits)) // v.unit) * v.unit  # whole batches per split
    return v, -(-Tmax // span), span


def _choose(B: int, H: int, T: int, k_cache, v_cache, rows, tile: bool = True,
            preload: bool = True, qkv=None) -> tuple[Variant, int, int]:
    """(kernel variant, splits, span) `attention` launches for validated arguments."""
    Tmax, hd = k_cache.shape[2], k_cache.shape[3]
    aligned = (hd % 4 == 0 and backend.address(k_cache) % 16 == 0
               and backend.address(v_cache) % 16 == 0)   # (cp.async copies 16 bytes)
    loads16 = aligned and qkv is not None and backend.address(qkv) % 16 == 0   # (grouped)
    # (the row-table kernel is planned by its own batch of positions)
    variant, splits, span = _plan(B, H, T, Tmax, hd,
                                  kernel_for(hd, rows is not None, k_cache.dtype, loads16))
    if (tile and aligned and hd <= SMALL_TILE.max_hd and span <= SMALL_TILE.unit
            and variant in (SMALL, _WITH_ROWS[(SMALL.config, SMALL.dtype)])):
        variant = SMALL_TILE_ROWS if rows is not None else SMALL_TILE   # the same plan
    elif variant is SMALL and preload and aligned:
        variant = SMALL_PRELOAD   # the same plan: its unit is SMALL's
    return variant, splits, span


def _is_tile(variant: Variant) -> bool:
    return variant.config[0] == "tile"


def _sums(variant: Variant, parts: int) -> bool:
    """Whether `variant` takes qkv as `parts` partial sums and a bias: the tile does."""
    return 1 <= parts <= MAX_PARTS and _is_tile(variant)


def takes_partials(k_cache, v_cache, T: int, rows=None, parts: int = 1,
                   tile: bool = True) -> bool:
    """Whether `attention` over these caches, T new tokens and `rows` takes qkv as `parts`
    partial sums of its projection and a bias (the tile kernel does, for splits of up to 64
    positions of head dims up to 64: GPT-2's decode); the caller then skips the projection's
    reduction (`kernels.gemm.partials`)."""
    B, H = k_cache.shape[0], k_cache.shape[1]
    return _sums(_choose(B, H, T, k_cache, v_cache, rows, tile)[0], parts)


def attention(qkv, k_cache, v_cache, pos, out, *, n_head, rows=None, qkv_bias=None,
              stream=0, tile: bool = True, preload: bool = True) -> None:
    """Causal attention of this step's T queries over the cache, after appending its k, v.

    qkv (B, T, 3C): fused q | k | v, head h at [h*hd:(h+1)*hd] of each; k_cache, v_cache
    (B, H, Tmax, hd) are updated in place at positions pos..pos+T-1; pos: device int32 (1,),
    read on the device; out (B, T, C). Query t (absolute position pos+t) attends to cache
    positions 0..pos+t with scale 1/sqrt(hd). pos < 0 or pos + T > Tmax (only checkable on
    the device) leaves the caches alone and writes NaN to out.

    rows (B, Tmax) int32, optional: sequence b's earlier positions p < pos are read from
    cache row rows[b, p] instead of row b (this step's are still written to row b). Beam
    search then reorders a table of rows (`reorder_rows`) instead of moving the cache: a
    hypothesis's prefix stays where it was written. A row outside 0..B-1 gives NaN.

    qkv (P, B, T, 3C) with qkv_bias (3C,): P partial sums of the projection
    (`kernels.gemm.partials`); q | k | v is their sum in order plus the bias, which the
    kernel adds as it loads them. Only where `takes_partials` says so (else ValueError).

    tile, preload: the variants that won their A/Bs, on by default; False keeps the kernels
    they replace (the tests compare the two bit for bit).

    qkv, the caches and out of one dtype, float32 or float16 (scores, softmax and the output
    in float32; float16 runs the plain and row-table kernels, neither tile nor preload).
    """
    dtype = _check.float_dtype("qkv", qkv)
    _check.device_array("qkv", qkv, dtype=dtype)
    if qkv.ndim not in (3, 4) or (qkv.ndim == 4) != (qkv_bias is not None):
        raise ValueError(f"qkv: expected (B, T, 3C), or (P, B, T, 3C) partial sums with "
                         f"qkv_bias, got shape {tuple(qkv.shape)} and qkv_bias "
                         f"{'given' if qkv_bias is not None else 'None'}")
    parts = qkv.shape[0] if qkv.ndim == 4 else 1
    B, T, C3 = qkv.shape[-3:]
    n_head = _check.positive("n_head", n_head)
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv: last dim {C3} must be 3*C with C a multiple of n_head={n_head}")
    C = C3 // 3
    hd = C // n_head
    if hd > MAX_HD:
        raise ValueError(f"head dim C/n_head = {hd}: at most {MAX_HD} supported")
    _check.device_array("k_cache", k_cache, dtype=dtype, shape=(B, n_head, None, hd))
    Tmax = k_cache.shape[2]
    _check.device_array("v_cache", v_cache, dtype=dtype, shape=(B, n_head, Tmax, hd))
    _check.device_array("pos", pos, dtype=np.int32, shape=(1,))
    _check.device_array("out", out, dtype=dtype, shape=(B, T, C))
    if T > Tmax:
        raise ValueError(f"qkv: T={T} new positions exceed the cache size Tmax={Tmax}")
    # Declared writes (k_cache, v_cache, out, partials) are checked against every other
    # argument at launch: outputs must not overlap what other blocks still read.
    if rows is None:   # a placeholder, never read
        rows_arg = backend.empty((1, 1), np.int32, "attention.no_rows")
    else:
        rows_arg = _check.device_array("rows", rows, dtype=np.int32, shape=(B, Tmax))
    variant, splits, span = _choose(B, n_head, T, k_cache, v_cache, rows, tile, preload, qkv)
    if qkv_bias is not None:
        _check.device_array("qkv_bias", qkv_bias, shape=(C3,))
        if not _sums(variant, parts):
            raise ValueError(f"qkv: {parts} partial sums need the tile kernel, which does not "
                             f"serve this shape (see attention.takes_partials)")
    if splits > 1:  # scratch of this call: the combine launch reads it
        part_o = backend.empty((B * n_head, T, splits, hd), np.float32, "attention.partials")
        part_ml = backend.empty((B * n_head, T, splits, 2), np.float32, "attention.stats")
    else:  # placeholders, never touched
        part_o = backend.empty((1, 1, 1, 1), np.float32, "attention.partials")
        part_ml = backend.empty((1, 1, 1, 2), np.float32, "attention.stats")
    args = (qkv, k_cache, v_cache, pos, out, np.int32(span), part_o, part_ml, rows_arg)
    if _is_tile(variant):   # qkv as (P, B*T, 3C), a bias or a placeholder (never read)
        bias = qkv_bias if qkv_bias is not None else backend.empty((1,), np.float32,
                                                                    "attention.no_bias")
        args = (backend.reshaped(qkv, (parts, B * T, C3)), *args[1:], bias)
    launch(variant.kernel, (B * n_head, T, splits), variant.threads, args, stream)
    if splits > 1:
        launch(attention_combine_kernels[dtype], (B * n_head, T), _check.warp_threads(hd),
               (pos, np.int32(Tmax), np.int32(span), part_o, part_ml, out), stream)


@jit("void(int32[:, ::1], int32[::1], int32[::1], int32[:, ::1])", writes=("dst",))
def reorder_rows_kernel(src, index, length, dst):
    """Grid over (B, Tmax) entries: dst[b, p] = src[index[b], p] for p < n = length[0], and
    dst[b, n] = b (the row the next step writes position n to). An index or n out of range
    gives -1 (attention then reads NaN)."""
    B, T = dst.shape
    n = length[0]
    for e in range(cuda.grid(1), B * T, cuda.gridsize(1)):
        b = e // T
        p = e - b * T
        i = index[b]
        if not (0 <= i < B and 0 <= n <= T):
            dst[b, p] = -1
        elif p < n:
            dst[b, p] = src[i, p]
        elif p == n:
            dst[b, p] = b


def reorder_rows_ref(src: np.ndarray, index: np.ndarray, n: int, before: np.ndarray):
    """`reorder_rows` on the host, dst starting as `before`."""
    B, T = src.shape
    out = before.copy()
    for b in range(B):
        if not (0 <= index[b] < B and 0 <= n <= T):
            out[b] = -1
            continue
        out[b, :n] = src[index[b], :n]
        if n < T:
            out[b, n] = b
    return out


def reorder_rows(src, index, dst, *, length, stream=0) -> None:
    """A beam-search reorder of row tables (see `attention`'s rows): hypothesis b continues
    hypothesis index[b], so its first n = length[0] positions (read on the device) are where
    index[b]'s are, and position n will be written to row b. src, dst (B, Tmax) int32, not
    overlapping; index (B,) int32. Entries of dst past n are left as they were."""
    _check.device_array("src", src, dtype=np.int32, ndim=2)
    B, T = src.shape
    _check.device_array("index", index, dtype=np.int32, shape=(B,))
    _check.device_array("dst", dst, dtype=np.int32, shape=(B, T))
    _check.device_array("length", length, dtype=np.int32, shape=(1,))
    blocks, threads = _check.grid_stride_launch(B * T)
    launch(reorder_rows_kernel, blocks, threads, (src, index, length, dst), stream)


def gather_batch(src, index, dst, *, length=None, stream=0) -> None:
    """dst[b] = src[index[b]] for b < B: src, dst (B, ...) float32 or float16 (one dtype),
    index device int32 (B,), read on the device (an out-of-range entry gives a NaN row).
    Beam search reorders its KV caches with this. dst must not overlap src (checked at
    launch): rows are read while others are written.

    With `length` (device int32 (1,), read on the device), src and dst are caches
    (..., B, H, T, hd) and only the live prefix moves: dst[..., b, :, :n] =
    src[..., index[b], :, :n], n = length[0]; the rest of dst is left as it was. Leading
    axes stack caches that move together (GPT-2's K and V of every layer: one launch). n
    outside 0..T gives NaN rows (every position)."""
    dtype = _check.float_dtype("src", src)
    _check.device_array("src", src, dtype=dtype)
    if length is None:   # one "position" per row, taken whole; `length` is never read
        B = src.shape[0]
        G, H, positions, width, fixed, length = 1, 1, 1, src.size // max(B, 1), 1, index
    else:
        if src.ndim < 4:
            raise ValueError(f"src: a live-prefix gather needs (..., B, H, T, hd) caches, got "
                             f"{src.ndim} dimensions")
        B, H, positions, width = src.shape[-4:]
        G, fixed = src.size // max(B * H * positions * width, 1), -1
        _check.device_array("length", length, dtype=np.int32, shape=(1,))
    _check.device_array("index", index, dtype=np.int32, shape=(B,))
    _check.device_array("dst", dst, dtype=dtype, shape=tuple(src.shape))
    row = positions * width
    threads = min(256, _check.warp_threads(row))
    # about 4096 blocks in all, however many caches are stacked: enough to keep every SM's
    # loads in flight, few enough that a short prefix does not launch thousands of idle ones
    blocks = max(1, min(math.ceil(row / threads), 4096 // (G * B * H)))
    if G * B > 65535:
        raise ValueError(f"src: {G} stacked caches of batch {B} exceed the grid's 65535")
    launch(gather_batch_kernels[dtype], (blocks, H, G * B), threads,
           (backend.reshaped(src, (G, B, H, row)), index, length, np.int32(width),
            np.int32(fixed), backend.reshaped(dst, (G, B, H, row))), stream)
