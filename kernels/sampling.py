"""Row-wise argmax and top-k (k <= 8) for greedy and beam-search decoding.

Beam search ranks beams*vocab scores in one row (R=1, V=5*50257), which one block would scan
alone while the rest of the GPU idles. So every call is two launches whose configuration
depends only on (R, V), never on the data (one CUDA graph serves every step):

  1. `topk_blocks_kernels`, grid (NB, R): each thread loads a batch of 8 elements of a strided
     slice of its row into registers; each warp takes its top k of them in k rounds (every
     lane's best, then the warp's best by a shuffle butterfly, which its lane gives up),
     carrying it from batch to batch; the warps' top k meet in shared memory for k more
     rounds, giving k candidates per block in a cached workspace (R, NB, KMAX).
  2. `topk_merge_kernel`, grid (R,): one block merges a row's NB*k candidates the same way.

Order: values descending, ties to the lower index (as a stable sort). NaN ranks as -inf.
`argmax` is top-1 through the same two launches.

The workspace is allocated on the first call for a given (R, NB) and kept for the process
(graph nodes bake its address in), so warm up before any stream capture, and do not run two
top-k calls with the same R and V concurrently on different streams.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check, softmax
from kernels._lastblock import count_in, launch_counters
from kernels._reduce import FULL_MASK, converged_syncthreads
from proto.device import backend
from proto.device.backend import cuda, jit, jit_per_dtype, launch

KMAX = 8                  # local arrays are sized by this; k is a runtime argument up to it
MAX_THREADS = 256         # shared merge slots are sized for this many threads
THREADS = 256             # threads per block, at most (tests lower it to reach several blocks)
PER_THREAD = 8            # stage 1 gives each thread at least this many elements to scan ...
PREFETCH = softmax.PREFETCH   # ... loading this many before ranking the first
MAX_BLOCKS = 256          # ... in at most this many blocks per row (about one per SM on an H200)
MAX_WARPS = MAX_THREADS // 32    # a block's warps: their top k meet in shared memory ...
WARP_RESULTS = MAX_WARPS * KMAX  # ... in this many slots ...
BLOCK_SLOTS = WARP_RESULTS // 32   # ... which fill this many of each lane's
NEG_INF = np.float32(-np.inf)
SENTINEL = np.int32(2**31 - 1)  # index of an empty slot: loses every tie against a real index


# ---------------------------------------------------------------------------- references
def _nan_as_neg_inf(x: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(x), -np.inf, x).astype(np.float32)


def argmax_ref(x: np.ndarray) -> np.ndarray:
    return np.argmax(_nan_as_neg_inf(x), axis=1).astype(np.int32)


def topk_ref(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values (R, k) descending, indices (R, k) int32); ties -> lower index (stable sort)."""
    x = _nan_as_neg_inf(x)
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x, order, axis=1), order.astype(np.int32)


# ---------------------------------------------------------------------------- device helpers
# A thread holds a batch of candidates in registers (PREFETCH slots of value and index, loaded
# at once) and, in lanes q < k, the q-th entry of its warp's running top k (the "carry"). A
# warp's top k is k rounds of: each lane's best slot, the warp's best by a shuffle
# butterfly, the lane that holds it empties that slot. No thread keeps a sorted list: a list
# indexed by a loop variable lives in local memory, and inserting into it was a chain of
# dependent local loads and stores (beam_topk_kernels measured 40 us for 1 MB of logits).
@cuda.jit(device=True)
def _better(v, i, w, j):
    """(v, i) ranks before (w, j): larger value, or equal value and lower index. (Bitwise,
    not `or`/`and`: no branches, so a warp's butterfly steps do not split and rejoin.)"""
    return (v > w) | ((v == w) & (i < j))


if backend.SIMULATOR:   # the simulator's threads are never a warp: through shared memory
    from kernels._reduce import warp_lanes

    @cuda.jit(device=True)
    def _warp_best(v, i):
        """Stand-in for the shuffle butterfly below: every thread of the block must call it
        together (kernels._reduce.warp_lanes)."""
        values, indices = warp_lanes(v, i)
        for w, j in zip(values, indices):
            if _better(np.float32(w), np.int32(j), v, i):
                v, i = np.float32(w), np.int32(j)
        return v, i
else:
    @cuda.jit(device=True)
    def _warp_best(v, i):
        """The best (v, i) of the warp in _better's order, to every lane: xor butterfly."""
        off = 16
        while off > 0:
            w = cuda.shfl_xor_sync(FULL_MASK, v, off)
            j = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if _better(w, j, v, i):
                v, i = w, j
            off >>= 1
        return v, i


@cuda.jit(device=True)
def _warp_topk(vals, idxs, cv, ci, k):
    """The top k of the warp's slots (vals/idxs of every lane) and carries (cv, ci): returns
    this lane's new carry, the q-th best in lane q < k, empty in the others. Empties the
    slots it takes. Indices are distinct except empty ones (-inf, SENTINEL), which rank last
    and which every lane may empty alike. Every lane of the warp must call it (the
    simulator's stand-in: every thread of the block)."""
    lane = cuda.threadIdx.x % 32
    nv, ni = NEG_INF, SENTINEL
    for q in range(k):
        v, i = cv, ci
        for s in range(vals.shape[0]):   # a constant: the loop unrolls, slots stay registers
            if _better(vals[s], idxs[s], v, i):
                v, i = vals[s], idxs[s]
        v, i = _warp_best(v, i)
        for s in range(vals.shape[0]):
            if idxs[s] == i:
                vals[s], idxs[s] = NEG_INF, SENTINEL
        if ci == i:
            cv, ci = NEG_INF, SENTINEL
        if lane == q:
            nv, ni = v, i
    return nv, ni


@cuda.jit(device=True)
def _block_topk(cv, ci, k, out_v, out_i):
    """The block's top k from every warp's carry (its top k, lane q holding the q-th), into
    out_v/out_i[:k]: the warps' k entries through shared memory, then one more warp round,
    which every warp runs alike (one barrier; no second one to hand a result around). Every
    thread must call it."""
    sh_v = cuda.shared.array(WARP_RESULTS, np.float32)
    sh_i = cuda.shared.array(WARP_RESULTS, np.int32)
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    if lane < k:
        sh_v[warp * k + lane] = cv
        sh_i[warp * k + lane] = ci
    converged_syncthreads()
    n = (cuda.blockDim.x + 31) // 32 * k
    vals = cuda.local.array(BLOCK_SLOTS, np.float32)
    idxs = cuda.local.array(BLOCK_SLOTS, np.int32)
    for s in range(BLOCK_SLOTS):
        e = lane + 32 * s
        vals[s], idxs[s] = (sh_v[e], sh_i[e]) if e < n else (NEG_INF, SENTINEL)
    v, i = _warp_topk(vals, idxs, NEG_INF, SENTINEL, k)
    if cuda.threadIdx.x < k:
        out_v[cuda.threadIdx.x] = v
        out_i[cuda.threadIdx.x] = i


# ---------------------------------------------------------------------------- kernels
@jit_per_dtype("void({t}[:, ::1], int32, float32[:, :, ::1], int32[:, :, ::1])",
               writes=("cand_v", "cand_i"))
def topk_blocks_kernels(x, k, cand_v, cand_i):
    """Grid (NB, R). Block `blk` of row r ranks x[r, blk*T + tid :: NB*T] into cand[r, blk, :k]."""
    r = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    vals = cuda.local.array(PREFETCH, np.float32)   # (softmax.load_ahead)
    idxs = cuda.local.array(PREFETCH, np.int32)
    cv, ci = NEG_INF, SENTINEL
    stride = cuda.gridDim.x * cuda.blockDim.x
    n = x.shape[1]
    # The loop runs over the block's first element, not the thread's, so every thread of the
    # block makes the same trips (the warp rounds shuffle across all lanes).
    for base in range(blk * cuda.blockDim.x, n, stride * PREFETCH):
        first = base + cuda.threadIdx.x
        softmax.load_ahead(x, r, first, stride, n, vals)
        for q in range(PREFETCH):
            c = first + q * stride
            idxs[q] = c if c < n else SENTINEL
            if vals[q] != vals[q]:  # NaN ranks as -inf
                vals[q] = NEG_INF
        cv, ci = _warp_topk(vals, idxs, cv, ci, k)
    _block_topk(cv, ci, k, cand_v[r, blk], cand_i[r, blk])


@cuda.jit(device=True)
def _merge_candidates(cand_v, cand_i, r, k):
    """This warp's carry over its share of row r's NB*k candidates (cand (R, NB, KMAX), read
    through L2: in beam_topk other blocks of the launch wrote them), PREFETCH a thread at a
    time, loaded before the first is ranked; the caller's _block_topk then merges the warps'."""
    vals = cuda.local.array(PREFETCH, np.float32)
    idxs = cuda.local.array(PREFETCH, np.int32)
    cv, ci = NEG_INF, SENTINEL
    n = cand_v.shape[1] * k
    step = cuda.blockDim.x
    for base in range(0, n, step * PREFETCH):   # the same trips in every thread, as above
        for q in range(PREFETCH):
            e = base + q * step + cuda.threadIdx.x
            blk = min(e, n - 1) // k
            at = (np.int32(r), np.int32(blk), np.int32(min(e, n - 1) - blk * k))
            vals[q], idxs[q] = backend.ldcg(cand_v, at), backend.ldcg(cand_i, at)
            if e >= n:   # (re-read the last, unused)
                vals[q], idxs[q] = NEG_INF, SENTINEL
        cv, ci = _warp_topk(vals, idxs, cv, ci, k)
    return cv, ci


@jit("void(float32[:, :, ::1], int32[:, :, ::1], int32, float32[:, ::1], int32[:, ::1])",
     writes=("values", "indices"))
def topk_merge_kernel(cand_v, cand_i, k, values, indices):
    """Grid (R,). Merges the NB*k block candidates of row r into values/indices[r, :k]."""
    r = cuda.blockIdx.x
    cv, ci = _merge_candidates(cand_v, cand_i, r, k)
    _block_topk(cv, ci, k, values[r], indices[r])


# ---------------------------------------------------------------------------- launchers
def _stage1_config(V: int) -> tuple[int, int]:
    """(blocks per row, threads per block) for a row of V elements."""
    threads = min(THREADS, _check.warp_threads(math.ceil(V / PER_THREAD)))
    return min(MAX_BLOCKS, math.ceil(V / (threads * PER_THREAD))), threads


_workspace: dict[tuple[int, int], tuple] = {}


def _candidates(R: int, nb: int):
    """Cached stage-1 output (cand_v, cand_i, argmax values) for R rows of nb blocks."""
    key = (R, nb)
    if key not in _workspace:
        _workspace[key] = (cuda.device_array((R, nb, KMAX), np.float32),
                           cuda.device_array((R, nb, KMAX), np.int32),
                           cuda.device_array((R, 1), np.float32))
    return _workspace[key]


def _launch_topk(x, k: int, values, indices, stream) -> None:
    R, V = x.shape
    nb, threads = _stage1_config(V)
    cand_v, cand_i, _ = _candidates(R, nb)
    launch(topk_blocks_kernels[np.dtype(x.dtype)], (nb, R), threads,
           (x, np.int32(k), cand_v, cand_i), stream)
    launch(topk_merge_kernel, R, min(THREADS, _check.warp_threads(nb * k)),
           (cand_v, cand_i, np.int32(k), values, indices), stream)


def _check_x(x, name: str = "x") -> tuple[int, int]:
    """x (R, V): float32, or float16 logits (ranked as their float32 values)."""
    _check.device_array(name, x, dtype=_check.float_dtype(name, x), ndim=2)
    if x.shape[0] > 65535:   # rows are the stage-1 grid's y dimension
        raise ValueError(f"{name}: {x.shape[0]} rows exceed the grid limit 65535")
    return x.shape


def topk(x, k: int, values, indices, *, stream=0) -> None:
    """values/indices[r] = the k largest entries of x[r] (R, V), descending, ties -> lower index.

    x (R, V) float32 or float16, at most 65535 rows; values (R, k) float32; indices (R, k)
    int32; 1 <= k <= min(8, V).
    """
    R, V = _check_x(x)
    k = _check.positive("k", k, at_most=min(KMAX, V))
    _check.device_array("values", values, shape=(R, k))
    _check.device_array("indices", indices, dtype=np.int32, shape=(R, k))
    _check.separate({"values": values, "indices": indices}, {"x": x})   # two launches
    _launch_topk(x, k, values, indices, stream)


def argmax(x, out, *, stream=0) -> None:
    """out[r] = index of the largest entry of x[r] (R, V); ties -> lower index. out (R,) int32."""
    R, V = _check_x(x)
    _check.device_array("out", out, dtype=np.int32, shape=(R,))
    _check.separate({"out": out}, {"x": x})   # two launches
    _, _, scratch_values = _candidates(R, _stage1_config(V)[0])
    _launch_topk(x, 1, scratch_values, backend.reshaped(out, (R, 1)), stream)


# ---------------------------------------------------------------------------- a beam step's top-k
def beam_topk_ref(logits: np.ndarray, scores: np.ndarray, k: int):
    """The top k of log_softmax(logits) + scores over all beams and tokens (one row of
    beams * vocab, flat index b * V + token), as topk_ref orders them."""
    from kernels.softmax import log_softmax_ref
    flat = (log_softmax_ref(logits) + np.asarray(scores, np.float32)).reshape(1, -1)
    return topk_ref(flat.astype(np.float32), k)


@jit_per_dtype("void({t}[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1], int32, "
               "float32[:, :, ::1], int32[:, :, ::1], int32[::1], float32[:, ::1], "
               "int32[:, ::1])",
               writes=("cand_v", "cand_i", "counters", "values", "indices"))
def beam_topk_kernels(x, scores, part_m, part_s, k, cand_v, cand_i, counters, values, indices):
    """Grid (spans, R), after softmax.log_softmax_partials_kernels: block (i, row) ranks
    (x[row, j] - shift[row]) + scores[row] over span i of the row (the log-softmax and the
    beam's running score, the same float32 operations as log_softmax then adding the score)
    into k candidates of flat index row * V + j, at cand[0, row * spans + i]; the launch's
    last block merges every block's candidates into values/indices[0, :k]
    (kernels._lastblock)."""
    flag = cuda.shared.array(1, np.int32)
    i, row = cuda.blockIdx.x, cuda.blockIdx.y
    R, V = x.shape
    spans = part_m.shape[1]
    shift = softmax.row_shift(part_m, part_s, row)
    score = scores[row, 0]
    lo, hi = softmax.span_bounds(V, spans, i)
    vals = cuda.local.array(PREFETCH, np.float32)   # (softmax.load_ahead)
    idxs = cuda.local.array(PREFETCH, np.int32)
    cv, ci = NEG_INF, SENTINEL
    step = cuda.blockDim.x
    for base in range(lo, hi, step * PREFETCH):   # the same trips in every thread
        first = base + cuda.threadIdx.x
        softmax.load_ahead(x, row, first, step, hi, vals)
        for q in range(PREFETCH):
            j = first + q * step
            v = (vals[q] - shift) + score
            vals[q] = NEG_INF if v != v or j >= hi else v   # NaN ranks as -inf
            idxs[q] = row * V + j if j < hi else SENTINEL
        cv, ci = _warp_topk(vals, idxs, cv, ci, k)
    _block_topk(cv, ci, k, cand_v[0, row * spans + i], cand_i[0, row * spans + i])
    if count_in(counters, 0, cuda.gridDim.x * cuda.gridDim.y, flag):
        cv, ci = _merge_candidates(cand_v, cand_i, 0, k)
        _block_topk(cv, ci, k, values[0], indices[0])


def beam_topk(logits, scores, k: int, values, indices, *, stream=0) -> None:
    """values/indices[0] = the k best continuations of a beam-search step: the top k of
    log_softmax(logits[b]) + scores[b] over every beam b and token (flat index b * V +
    token), descending, ties to the lower index, NaN as -inf. Two launches: the rows' span
    partials (max, sum of exp), then one that ranks each span and merges (topk's order,
    log_softmax's arithmetic), instead of log_softmax, adding the scores and topk (five).

    logits (R, V) float32, or float16 (a half-precision model's: each loaded into float32,
    every operation after as for float32), at most 65535 rows; scores (R, 1) float32;
    values (1, k) float32; indices (1, k) int32; 1 <= k <= min(8, R * V)."""
    R, V = _check_x(logits, "logits")
    _check.device_array("scores", scores, shape=(R, 1))
    k = _check.positive("k", k, at_most=min(KMAX, R * V))
    _check.device_array("values", values, shape=(1, k))
    _check.device_array("indices", indices, dtype=np.int32, shape=(1, k))
    _check.separate({"values": values, "indices": indices}, {"logits": logits, "scores": scores})
    if R * V > 2**31 - 1:
        raise ValueError(f"logits: {R} x {V} candidates exceed int32 indices")
    spans = -(-V // softmax.SPAN)
    part_m = backend.empty((R, spans), np.float32, "beam_topk.max")
    part_s = backend.empty((R, spans), np.float32, "beam_topk.sumexp")
    # every row's spans as one row of candidates: the last block merges them as topk does
    cand_v = backend.empty((1, R * spans, KMAX), np.float32, "beam_topk.cand_v")
    cand_i = backend.empty((1, R * spans, KMAX), np.int32, "beam_topk.cand_i")
    threads = softmax.SPLIT_THREADS
    dtype = np.dtype(logits.dtype)
    launch(softmax.log_softmax_partials_kernels[dtype], (spans, R), threads,
           (logits, part_m, part_s), stream)
    launch(beam_topk_kernels[dtype], (spans, R), threads,
           (logits, scores, part_m, part_s, np.int32(k), cand_v, cand_i, launch_counters(1),
            values, indices), stream)


# ---------------------------------------------------------------------------- a search's score check
def check_scores_ref(values: np.ndarray, floor: float) -> bool:
    """True when some score is not finite or not above `floor` (a search must not go on)."""
    values = np.asarray(values, np.float64)
    return bool((~np.isfinite(values) | (values <= floor)).any())


@jit("void(float32[:, ::1], float32, int32[::1])", writes=("bad",))
def check_scores_kernel(values, floor, bad):
    i = cuda.grid(1)
    if i < values.size:
        v = values[i // values.shape[1], i % values.shape[1]]
        if not (math.isfinite(v) and v > floor):
            bad[0] = 1


def check_scores(values, floor: float, bad, *, stream=0) -> None:
    """bad[0] := 1 if any of `values` (R, k) is not finite or not above `floor`; otherwise
    bad is left as it was (so one flag gathers every step of a generation on the device)."""
    _check.device_array("values", values, ndim=2)
    _check.device_array("bad", bad, dtype=np.int32, shape=(1,))
    floor = _check.number("floor", floor)
    launch(check_scores_kernel, max(1, (values.size + 255) // 256), 256,
           (values, np.float32(floor), bad), stream)


# ---------------------------------------------------------------------------- greedy on the device
# What the host does after each greedy step (proto.models.generate.greedy), done on the GPU so
# the whole generation can be one graph (proto.models.search_loop): record the step's tokens,
# mark sequences that produced EOS, advance the position, and decide whether to go on.
# state = [steps done, max new tokens, eos id or -1]. State lives on the device, so a step
# index outside `out` cannot be rejected before the launch: the kernel then writes nothing,
# stops the loop (flag 0) and sets state[0] = STEP_ERROR for the host to see.
STEP_ERROR = -1


def greedy_advance_ref(tokens, done, state):
    """(emitted (B,), done', steps done', go on?) for next tokens (B,) and done flags (B,)."""
    t, limit, eos = (int(v) for v in state)
    emitted = np.where(done != 0, eos, tokens).astype(np.int32)
    done = ((done != 0) | ((eos >= 0) & (emitted == eos))).astype(np.int32)
    go = t + 1 < limit and not (eos >= 0 and done.all())
    return emitted, done, t + 1, go


@jit("void(int32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32[::1], int32[::1])",
     writes=("pos", "out", "done", "state", "flag"))
def greedy_advance_kernel(tokens, pos, out, done, state, flag):
    """One block: out[:, t] = the step's tokens (eos once a sequence is done), done |= eos
    seen, then (thread 0) pos += 1, state[0] = t + 1, flag = go on. The next step reads tokens
    unchanged, as the host loop feeds the argmax back. t outside [0, capacity): only
    flag = 0 and state[0] = STEP_ERROR. A thread per sequence, each loading its row before
    storing: one thread walking the rows would load each after the previous row's stores,
    which it cannot move the loads above (one memory round trip a row)."""
    live = cuda.shared.array(1, np.int32)   # 1 once some sequence is not done
    tid = cuda.threadIdx.x
    t, limit, eos = state[0], state[1], state[2]   # (every thread, before thread 0 writes)
    if tid == 0:
        live[0] = 0
    cuda.syncthreads()
    ok = 0 <= t < out.shape[1]
    if ok:
        for b in range(tid, tokens.shape[0], cuda.blockDim.x):
            was, tok = done[b], tokens[b, 0]
            if was != 0:
                tok = eos
            now = was != 0 or (eos >= 0 and tok == eos)
            if now and was == 0:
                done[b] = 1
            out[b, t] = tok
            if not now:
                live[0] = 1   # (every writer writes 1)
    cuda.syncthreads()
    if tid != 0:
        return
    if not ok:
        state[0] = STEP_ERROR
        flag[0] = 0
        return
    state[0] = t + 1
    pos[0] += 1
    flag[0] = 1 if t + 1 < limit and not (eos >= 0 and live[0] == 0) else 0


def greedy_advance(tokens, pos, out, done, state, flag, *, stream=0) -> None:
    """See greedy_advance_kernel. tokens (B, 1), out (B, capacity), done (B,), state (3,),
    pos and flag (1,): int32 device arrays."""
    _check.device_array("tokens", tokens, dtype=np.int32, shape=(None, 1))
    B = tokens.shape[0]
    _check.device_array("out", out, dtype=np.int32, shape=(B, None))
    _check.device_array("done", done, dtype=np.int32, shape=(B,))
    _check.device_array("state", state, dtype=np.int32, shape=(3,))
    for name, a in (("pos", pos), ("flag", flag)):
        _check.device_array(name, a, dtype=np.int32, shape=(1,))
    # one block: a thread per sequence up to 256 (32 on the simulator), then a stride
    threads = min(_check.warp_threads(B), 32 if backend.SIMULATOR else 256)
    launch(greedy_advance_kernel, 1, threads, (tokens, pos, out, done, state, flag), stream)


# ---------------------------------------------------------------------------- beam search on the device
# The host's choice of beams (proto.models.generate.beam_search), on the GPU, in two launches:
# `beam_choose` (one thread: walk the top-k candidates in rank order) and `beam_histories`
# (every thread: copy the chosen beams' token histories, and the best finished one).
# state = [steps done, max new tokens, eos id or -1, history length, live beams];
# best_meta = [slot a finished hypothesis came from this step or -1, its last token, its length].
# Device-side guards, as greedy_advance's: a history length with no room left for a token
# stops the loop with state[0] = STEP_ERROR and nothing else written; a candidate whose index
# names no beam (indices from a row other than beams x vocab) is skipped, never followed.
BEAM_DEAD = np.float32(-1e30)   # generate.DEAD: an empty slot's score


def beam_choose_ref(values, indices, vocab, beam, state, best):
    """(parents, tokens, scores, live, new best score, (src, tok) of a new best finished or
    None, go on?) for one row of top-k candidates, as generate.beam_search chooses."""
    t, limit, eos, length, _ = (int(v) for v in state)
    parents, tokens, scores, new_best = [], [], [], None
    for value, index in zip(values, indices):
        b, tok = divmod(int(index), vocab)
        if tok == eos:
            if value > best:
                best, new_best = np.float32(value), (b, tok)
        elif len(parents) < beam:
            parents.append(b)
            tokens.append(tok)
            scores.append(value)
    live = len(parents)
    dead = beam - live
    scores = np.array(scores + [BEAM_DEAD] * dead, np.float32)
    go = t + 1 < limit and live > 0 and not best >= scores[0]
    return (np.array(parents + [0] * dead, np.int32), np.array(tokens + [0] * dead, np.int32),
            scores, live, best, new_best, go)


@jit("void(float32[:, ::1], int32[:, ::1], int32, int32, float32[:, ::1], int32[:, ::1], "
     "int32[::1], float32[::1], int32[::1], int32[::1], int32[::1], int32[::1], float32, "
     "int32[::1])",
     writes=("scores", "tokens", "parents", "best", "best_meta", "state", "pos", "flag", "bad"))
def beam_choose_kernel(values, indices, vocab, capacity, scores, tokens, parents, best, best_meta,
                       state, pos, flag, floor, bad):
    if cuda.grid(1) != 0:
        return
    # Every load before the first store: a load after a store to an array the compiler
    # cannot prove distinct waits for it, one memory round trip per candidate.
    vals = cuda.local.array(KMAX, np.float32)
    idxs = cuda.local.array(KMAX, np.int32)
    k = values.shape[1]   # (at most KMAX: checked at launch)
    for r in range(KMAX):
        rr = min(r, k - 1)
        vals[r] = values[0, rr]
        idxs[r] = indices[0, rr]
    beam = scores.shape[0]
    t, limit, eos, length = state[0], state[1], state[2], state[3]
    top = best[0]
    for r in range(KMAX):   # check_scores_kernel's rule, on the candidates already loaded
        if r < k and not (math.isfinite(vals[r]) and vals[r] > floor):
            bad[0] = 1
    best_meta[0] = -1
    if length < 0 or length >= capacity:
        state[0] = STEP_ERROR
        flag[0] = 0
        return
    n = 0
    first = BEAM_DEAD   # the score chosen first (scores[0, 0] once any is chosen)
    for r in range(KMAX):
        index = idxs[r]
        if r >= k or index < 0 or index >= beam * vocab:
            continue
        b = index // vocab
        tok = index - b * vocab
        if tok == eos:
            if vals[r] > top:
                top = vals[r]
                best[0] = top
                best_meta[0] = b
                best_meta[1] = tok
                best_meta[2] = length + 1
        elif n < beam:
            parents[n] = b
            tokens[n, 0] = tok
            scores[n, 0] = vals[r]
            if n == 0:
                first = vals[r]
            n += 1
    for j in range(n, beam):
        parents[j] = 0
        tokens[j, 0] = 0
        scores[j, 0] = BEAM_DEAD
    state[0] = t + 1
    state[3] = length + 1
    state[4] = n
    pos[0] += 1
    flag[0] = 1 if t + 1 < limit and n > 0 and not top >= first else 0


@jit("void(int32[:, ::1], int32[:, ::1], int32[::1], int32[:, ::1], int32[::1], int32[::1], "
     "int32[::1])", writes=("dst", "best_hist"))
def beam_histories_kernel(src, dst, parents, tokens, best_hist, best_meta, state):
    """dst[j] = src[parents[j]] + [tokens[j]]; the best finished one likewise into best_hist.
    Runs after beam_choose (length = state[3] - 1 is the histories' length before it).
    Nothing is written when beam_choose stopped on an error; a parent that names no row of
    src gives a row of -1 (never an out-of-bounds read)."""
    length = state[3] - 1
    if state[0] == STEP_ERROR or length < 0 or length >= dst.shape[1]:
        return
    start, stride = cuda.grid(1), cuda.gridsize(1)
    beam = dst.shape[0]
    for e in range(start, (beam + 1) * (length + 1), stride):
        j = e // (length + 1)
        i = e - j * (length + 1)
        row = parents[j] if j < beam else best_meta[0]
        if j == beam and row < 0:
            continue                         # no new best finished hypothesis this step
        if i == length:
            v = tokens[j, 0] if j < beam else best_meta[1]
        elif 0 <= row < src.shape[0]:
            v = src[row, i]
        else:
            v = np.int32(-1)                 # names no beam: visible, never read out of bounds
        if j < beam:
            dst[j, i] = v
        else:
            best_hist[i] = v


def beam_advance(values, indices, vocab: int, scores, tokens, parents, hist_src, hist_dst,
                 best, best_hist, best_meta, state, pos, flag, *, floor: float, bad,
                 stream=0) -> None:
    """One beam-search choice on the device (see beam_choose_kernel, beam_histories_kernel):
    candidates values/indices (1, k) -> next scores (beam, 1), tokens (beam, 1), parents
    (beam,); histories hist_src -> hist_dst (beam, capacity); best finished score best (1,),
    its tokens best_hist (capacity,), best_meta (3,); state (5,), pos and flag (1,). And
    check_scores on the candidates, in the same launch: bad[0] (1,) := 1 if one is not
    finite or not above `floor`, else left as it was."""
    _check.device_array("values", values, shape=(1, None))
    k = values.shape[1]
    if k > KMAX:
        raise ValueError(f"values: {k} candidates, at most {KMAX} (topk's limit)")
    _check.device_array("indices", indices, dtype=np.int32, shape=(1, k))
    _check.device_array("scores", scores, shape=(None, 1))
    beam = scores.shape[0]
    _check.device_array("tokens", tokens, dtype=np.int32, shape=(beam, 1))
    _check.device_array("parents", parents, dtype=np.int32, shape=(beam,))
    _check.device_array("hist_src", hist_src, dtype=np.int32, shape=(beam, None))
    cap = hist_src.shape[1]
    _check.device_array("hist_dst", hist_dst, dtype=np.int32, shape=(beam, cap))
    _check.device_array("best", best, shape=(1,))
    _check.device_array("best_hist", best_hist, dtype=np.int32, shape=(cap,))
    _check.device_array("best_meta", best_meta, dtype=np.int32, shape=(3,))
    _check.device_array("state", state, dtype=np.int32, shape=(5,))
    for name, a in (("pos", pos), ("flag", flag), ("bad", bad)):
        _check.device_array(name, a, dtype=np.int32, shape=(1,))
    vocab = _check.positive("vocab", vocab, at_most=(2**31 - 1) // beam)
    floor = _check.number("floor", floor)
    _check.separate(dict(scores=scores, tokens=tokens, parents=parents, hist_dst=hist_dst,
                         best=best, best_hist=best_hist, best_meta=best_meta, state=state,
                         pos=pos, flag=flag, bad=bad),
                    dict(values=values, indices=indices, hist_src=hist_src))   # two launches
    launch(beam_choose_kernel, 1, 1, (values, indices, np.int32(vocab), np.int32(cap), scores,
                                      tokens, parents, best, best_meta, state, pos, flag,
                                      np.float32(floor), bad), stream)
    blocks, threads = _check.grid_stride_launch((beam + 1) * cap)
    launch(beam_histories_kernel, blocks, threads,
           (hist_src, hist_dst, parents, tokens, best_hist, best_meta, state), stream)


# ---------------------------------------------------------------------------- check, then time
if __name__ == "__main__":
    from proto.device.timing import bench

    rng = np.random.default_rng(0)
    for R, V, k in ((1, 5 * 50257, 5), (5, 50257, 1), (1, 5 * 50257, 8)):
        x = rng.standard_normal((R, V)).astype(np.float32)
        dx = cuda.to_device(x)
        vals, idx = cuda.device_array((R, k), np.float32), cuda.device_array((R, k), np.int32)
        topk(dx, k, vals, idx)
        want_v, want_i = topk_ref(x, k)
        assert np.array_equal(idx.copy_to_host(), want_i), "topk indices differ"
        assert np.array_equal(vals.copy_to_host(), want_v), "topk values differ"
        t = bench(lambda: topk(dx, k, vals, idx), reps=50)
        print(f"topk R={R} V={V} k={k}: {t.median_us:.1f} us (p10 {t.p10_ms * 1e3:.1f}, "
              f"p90 {t.p90_ms * 1e3:.1f}), {R * V * 4 / t.median_ms / 1e6:.0f} GB/s read")
