"""Matrix multiply with a fused epilogue: out = act(op(a) @ op(b) + bias), op(x) = x or x.T.

Two kernel families, chosen by `gemm` from the shapes:

- the tiled kernels (`TILED_KERNELS`, one per layout of a and b and tile shape), for any
  shape: a block computes a 64 x 64 output tile (TILE: 4 x 4 outputs a thread, K 16 rows a
  step), or 128 x 128 (WIDE_TILE: 8 x 8 a thread, twice the multiply-adds per shared load,
  K 8 rows a step) where those tiles alone make two blocks an SM (`tiled_tile`). Both
  stage op(a) and op(b) in double-buffered shared memory and multiply with the convolutions'
  register tile (kernels._tile), whose rows and columns are read as 16-byte shared loads;
  the next step's rows of K are loaded into registers while the current ones are multiplied
  (`_make_tiled(..., stages=n)` copies them by cp.async into a ring of n buffers instead,
  as cuBLAS's SIMT kernels do; `dev/bench/bench_train_gemm.py` measures it, and nothing
  takes it until that says so).
  The operands arrive flattened and are addressed with uint32 offsets (at most 2**32
  elements each, checked): a step whose tile lies inside the bounds, as nearly every step of
  a large product does, loads at constant steps with no per-element test (PTX: one add a
  load, where each load recomputed its 64-bit address behind two tests).
  Where the tiles alone make fewer blocks than two per SM (skinny products: an LSTM step's
  9..64 rows), K is split as in the decode path and the partial tiles are summed in order
  (`tiled_plan`, in whole K steps of the launched tile).
  Skinny tiles (`SKINNY`: 16 x 256 for M <= 16, 32 x 128 for M <= 32; the same 256 threads
  and 4 x 4 register tile, the same 4096 outputs a block): a 64-row tile computes, stages
  and splits 64 rows whatever M is, so a 9..16-row LSTM step wastes 3/4 of its
  multiply-adds and of its staging of op(a). They replace TILE only (`tiled_tile`; where
  WIDE_TILE fills the SMs, the product is none of the LSTM's that the A/B measures), and
  only where the caller asks (`gemm(..., skinny=True)`): off by default until
  dev.ab.ab_lstm_tiles measures them on the GPU.
  Where this GPU's measured table (kernels.tuning, kernels/tuned/<gpu>.json) has an
  entry near an unbatched product, `tiled` launches that entry's tile, staging and split
  instead, the 3xTF32 tensor-core tiles (Tiles(..., mma=True), kernels._tf32) among them;
  an entry may also say `via_nt`: the operands are first transposed into scratch so that
  the product reads both along K (NT), the layout whose tensor tiles ran at cuBLAS's time
  where the others took 1.3-2x it (`_as_nt`; the transposes cost a copy of each operand);
  or `fold`: a K-split launch whose last block per tile sums the splits' partials (in
  split order: the reduction launch's bits) and applies the epilogue, saving that launch
  (Wav2Vec2's step at 120 frames ran about 170 reductions, 1.5 ms).
- decode kernels, for M <= 8 rows (GPT-2 beam search: 5 beams against 768 x {768, 2304,
  3072}, 3072 x 768 and the tied 50257 x 768 output head). At most 8 FLOP per weight read:
  pure weight streaming, so the one goal is to keep every SM's share of the weight in
  flight. Every weight is read once, coalesced, and multiplied with all 8 (clipped) rows of
  op(a), staged in shared memory. `make_decode_nn` builds the [K, N] kernels (lanes along N,
  warps along K, a block sum through shared memory), `make_decode_nt` the trans_b one
  (lanes along K, a warp per few output columns, sums by warp shuffles), `make_decode_mma`
  float16's trans_b one on tensor cores (mma.sync by inline PTX, kernels/_mma.py: the SIMT
  kernels stop at half the copy rate on float16 weights, this one reaches 0.46-0.83 on
  GPT-J's shapes); `pick_decode`
  chooses among the geometries measured best on the H200 (dev/notes/decode.md). Grid:
  (column tiles, K splits, batch). 768 columns are only 12 tiles of 64, far too few blocks
  for 132 SMs, so K is split too: each block writes its partial sums to scratch and
  `gemm_splitk_reduce_kernels` adds them in split order (deterministic, no atomics) and
  applies the epilogue; 2304 and 3072 columns make enough 16-column tiles to stream the
  whole K in one launch, which applies the epilogue itself. (Summing the splits in the
  split kernel's last block per tile saved the launch but lost on the H200: the last
  block's serial sum and layer norm took longer than a second launch, whose blocks share
  the work: 14.8 us against 8.9 for the attention projection with its layer norm, and the
  split kernel needed 2 blocks an SM instead of 3.) Each block issues its first
  batch of weight loads before it stages op(a), and a persistent block the next tile's
  before it sums the last, so the weight's memory latency hides that work. Full batches
  load at constant offsets; only a last partial batch clips its indices.

Optional fused layer norm of the result (`ln_out=(gamma, beta, eps, y)`): y = layernorm(out)
row by row, after the update. GPT-2's residual GEMMs (attention and MLP projections,
accumulate=True) produce the residual stream that the next layer norm reads, so their split-K
reduction (`gemm_splitk_reduce_ln_kernels`, a block per row) normalizes the rows it has just
written: the layer norm costs no launch of its own. Outside the decode path `layernorm`
runs after the product instead.

(A layer norm of the input, `ln_in`, normalized the rows of a before the product, first in
every decode block after the early-launch wait and then as a launch of its own: GPT-2's
step took 537.7 us the first way and 531.4 the second on the H200, qkv alone 16.3 us against
11.0 under ncu (results/h200/profiles/ab_step_8b3630b.txt, decode_layer_ncu_8b3630b.txt.gz).
It went when the launches that write the residual took over every layer norm of the step:
the embedding's and the MLP sum's ln_out.)

2-D calls are 3-D calls with a batch of 1, so every kernel has one argument layout.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from kernels import _check, _cpasync, _pdl, layout, tuning
from kernels._lastblock import count_in, launch_counters
from kernels._tf32 import (first_place, k_major_place, k_run_stage, lane_stage, mma_tile,
                           split_staging, staged_stores)
from kernels._tile import TILE_ALIGN, Stage, Tiles, grid_place, register_tile, stager
from kernels._reduce import block_layernorm_row, load_ln_params, warp_allreduce
from kernels.elementwise import gelu_f32, gelu_ref
from proto.device import backend
from proto.device.backend import cuda, jit, jit_per_dtype, launch

ACTS = {None: 0, "gelu": 1, "relu": 2}
_ZERO = np.float32(0.0)

DECODE_MAX_M = 8  # rows of x multiplied with each weight load (the decode path's M limit)
M8 = DECODE_MAX_M
if not backend.SIMULATOR:
    # tiled: 64 x 64 outputs a block (256 threads, 4 x 4 each), K slices of 16; 128 x 128
    # (8 x 8 each, K slices of 8) where those alone make two blocks an SM
    TILE, WIDE_TILE = Tiles(64, 64, 16, 4, 4), Tiles(128, 128, 8, 8, 8)
    # skinny: 16 x 256 and 32 x 128 (256 threads, 4 x 4 each) for M <= 16 and M <= 32
    # (skinny=True)
    SKINNY = (Tiles(16, 256, 16, 4, 4), Tiles(32, 128, 16, 4, 4))
    MIN_SPAN_STEPS = 8   # tiled: K steps a split takes at least (tiled_min_span)
    SPAN_MAX = 768           # decode: most K rows one block covers (op(a) staged in shared)
    # Decode geometries, measured on the H200 (dev/notes/decode.md). [K, N]: (warps, row
    # groups per warp, columns per lane, rows per lane per batch, blocks per SM the registers
    # must allow); trans_b: (warps, columns per warp, K loads per lane per batch, blocks/SM).
    NN_SPLIT = (8, 1, 2, 8, 3)    # 64-column tiles, K split: N below ~2048 (768: 12 tiles)
    NN_COLUMNS = (8, 4, 2, 8, 3)  # 16-column tiles, whole K: one launch for N ~2048-8192
    NN_WIDE = (8, 1, 4, 4, 3)     # 128-column tiles, persistent: wider N (50257)
    NT_CONFIG = (8, 2, 8, 3)
    # float16's trans_b geometry: fewer warps a block, more blocks an SM, more loads a lane
    # in flight; 8 to 18% faster than float32's on GPT-J's five decode shapes (H200,
    # dev/bench/bench_half_decode.py), still 0.33-0.54 of copy bandwidth
    NT_HALF_CONFIG = (4, 4, 12, 4)
    # float16's trans_b on tensor cores (make_decode_mma): (warps a block along K, chunks of
    # 32 a warp's batch of loads, blocks/SM). On GPT-J's five decode shapes (H200,
    # bench_half_decode): 0.46-0.83 of copy bandwidth, 1.6-1.9x NT_HALF_CONFIG, 0.91-0.93 of
    # cuBLAS's speed; best of 7 geometries on qkv and fc_in, within 4% of the best on the rest
    MMA_HALF_CONFIG = (8, 2, 0)
    # ... two products over one K (gemm_sum): the second product's offsets take 72 registers
    # unbounded (3 blocks an SM), 64 and no spill bounded to the one-product kernel's 4
    MMA_PAIR_CONFIG = (8, 2, 4)
    # ... whole K, no reduction launch, where the column tiles alone give every SM a block
    # and K is at most this (GPT-2 small's qkv and fc in float16: 144 and 192 tiles over
    # K = 768): a split adds a launch to a product of a few MB, and float32's [K, N] kernel
    # measured whole K faster for the same two products (pick_decode's NN_COLS)
    MMA_WHOLE_K = 1024
    TARGET_BLOCKS = 2 * 132  # K splits until the grid has about this many blocks
    PARTIALS_TARGET = TARGET_BLOCKS   # ... for `partials` (switched by dev.ab.ab_qkv_partials)
    RED_CHUNK = 16           # partials a reduce thread loads before adding any
    LN_COLS = 4              # columns per thread of the fused layer norm
    LN_THREADS = 512         # ... and threads at most: N <= LN_COLS * LN_THREADS
    LN_WIDE_COLS, LN_WIDE_CHUNK = 8, 4   # ... and its wide rows' (N <= 4096)
else:
    # Each simulated thread is a Python thread (~0.1 ms each): the same code with smaller
    # blocks keeps tests fast, and a small K span makes tiny shapes take the split path.
    TILE, WIDE_TILE = Tiles(8, 8, 8, 2, 2), Tiles(16, 16, 8, 4, 4)
    # The GPU's thresholds (16 and 32 rows), so 9..32-row products reach them past the
    # decode path; a K step other than TILE's, so a plan made with TILE's shows; 32 threads.
    SKINNY = (Tiles(16, 32, 16, 4, 4), Tiles(32, 16, 16, 4, 4))
    MIN_SPAN_STEPS = 2
    SPAN_MAX = 64
    NN_SPLIT = (2, 2, 2, 2)
    NN_COLUMNS = (2, 4, 1, 2)
    NN_WIDE = (1, 1, 2, 2)
    NT_CONFIG = (1, 2, 2)
    NT_HALF_CONFIG = (1, 4, 2)
    # one warp a block: the simulator's mma16816 stand-in holds the block's barrier
    MMA_HALF_CONFIG = MMA_PAIR_CONFIG = (1, 2, 0)
    MMA_WHOLE_K = 0   # (every tile fills the simulator's 2 SMs: tiny shapes still split)
    TARGET_BLOCKS = 2
    PARTIALS_TARGET = TARGET_BLOCKS
    RED_CHUNK = 2
    LN_COLS = 2
    LN_THREADS = 64
    LN_WIDE_COLS, LN_WIDE_CHUNK = 4, 1
BM, BN, BK = TILE.bm, TILE.bn, TILE.bk   # the default tile's shape (tiled_plan takes a tile)
TILED_MIN_SPAN = MIN_SPAN_STEPS * TILE.bk   # (tiled_min_span(TILE))
_XS = M8 * SPAN_MAX


# ---------------------------------------------------------------------------- reference
def gemm_ref(a, b, bias=None, act=None, trans_a=False, trans_b=False, *, old=None) -> np.ndarray:
    """float64-accumulated reference; `old` is out's previous value (accumulate=True).
    (`ln_out` is layernorm_ref of the result: kernels.layernorm.)"""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    a64 = np.swapaxes(a64, -1, -2) if trans_a else a64
    b64 = np.swapaxes(b64, -1, -2) if trans_b else b64
    v = a64 @ b64
    if old is not None:
        v = v + old
    if bias is not None:
        v = v + np.asarray(bias, np.float64)
    if act == "gelu":
        return gelu_ref(v)
    if act == "relu":
        v = np.maximum(v, 0.0)
    return v.astype(np.float32)


# ---------------------------------------------------------------------------- device helpers
# Index arithmetic in the kernels is uint32 (`_u`): Numba guards every signed index against
# Python's negative indexing (3 extra instructions per access, and a fresh address register
# per access); unsigned indices compile to one base register plus immediate offsets.
# _BOUNDS: the bounds they are compared with are unsigned too. Numba widens unsigned
# arithmetic to uint64, and compares uint64 with a signed int64 (an array's shape) in float64:
# two conversions and a double compare per test (kernels.compile_check refuses float64).
_u = np.uint32


@cuda.jit(device=True)
def _act(v, act):
    if act == 1:
        v = gelu_f32(v)
    elif act == 2:
        v = max(v, _ZERO)
    return v


@cuda.jit(device=True)
def _finish(v, out, bz, m, n, bias, has_bias, act, accumulate):
    """The fused epilogue for one output element: (+ old) (+ bias), then act, then store."""
    if accumulate:
        v += out[bz, m, n]
    if has_bias:
        v += bias[n]
    out[bz, m, n] = _act(v, act)


@cuda.jit(device=True)
def _stage_x(xs, a, bz, k_lo, length, padded, m_rows, trans_a):
    """xs[m * SPAN_MAX + k] = op(a)[bz, m, k_lo + k] for k < length, zero for length <= k <
    padded (so the last, partial batch of loads needs no index clipping), rows m >= m_rows
    repeating the last one: the decode kernels then always multiply 8 rows and need no
    per-row branches (results of the extra rows are never stored). Each thread loads all 8
    rows of a column before storing any, so 8 reads are in flight."""
    vals = cuda.local.array(M8, np.float32)
    last = m_rows - 1
    for kk in range(_u(cuda.threadIdx.x), padded, _u(cuda.blockDim.x)):   # (see _BOUNDS)
        k = _u(k_lo + min(kk, length - _u(1)))
        for m in range(M8):
            mm = _u(min(m, last))
            vals[m] = a[bz, k, mm] if trans_a else a[bz, mm, k]
        for m in range(M8):
            xs[_u(m * SPAN_MAX) + kk] = vals[m] if kk < length else _ZERO


# Inlined in Numba's IR: as a separate device function a stager moved ptxas' register
# allocation (kernels.registers).
@cuda.jit(device=True, inline="always")
def _stage_input(xs, a, bz, k_lo, length, padded, m_rows, trans_a):
    """What a decode kernel does between issuing its first weight loads and its product: the
    early-launch wait (op(a) is an earlier kernel's output), op(a) staged into xs
    (`_stage_x`), a barrier."""
    _pdl.wait()
    _pdl.launch_dependents()
    _stage_x(xs, a, bz, k_lo, length, padded, m_rows, trans_a)
    cuda.syncthreads()


def _operand_loader(stage: Stage, k_first: bool):
    """A device function load(regs, src, at, r_step, k_step, row, k, rows, k_end, whole): a
    thread's staged elements of one operand, element i at (row + drs[i], k + dks[i]) of
    op(src) (`stage`), where src is the operand flattened and element (r, kk) of this batch
    lies at `at` + kk * ld + r if `k_first` else `at` + r * ld + kk (uint32 offsets; the
    caller passes at = the first element's offset, r_step and k_step = the offsets of one
    row and of one k further on). `whole`: every element of the block's step lies inside
    (rows, k_end), which the caller knows for the block at once, so the loads go out
    unchecked at constant offsets; otherwise each is checked and zero past the bounds."""
    drs, dks, count = stage.drs, stage.dks, len(stage.drs)

    @cuda.jit(device=True)
    def load(regs, src, at, r_step, k_step, row, k, rows, k_end, whole):
        if whole:
            for i in range(count):
                regs[i] = src[at + _u(drs[i]) * r_step + _u(dks[i]) * k_step]
        else:
            for i in range(count):
                r, kk = row + _u(drs[i]), k + _u(dks[i])
                v = _ZERO
                if r < rows and kk < k_end:
                    v = src[at + _u(drs[i]) * r_step + _u(dks[i]) * k_step]
                regs[i] = v
    return load


# ---------------------------------------------------------------------------- kernels
_ARGS = ("float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], float32[::1], "
         "int32, int32, int32")
# the tiled kernel: a and b flattened (uint32 offsets), out, bias, has_bias, act, accumulate
_TILED_ARGS = ("float32[::1], float32[::1], float32[:,:,::1], float32[::1], int32, int32, int32, "
               "float32[:,:,:,::1], int32, int32, int32, int32[::1]")
# a, b, out, bias, part, has_bias, act, accumulate, trans_a, direct, span: a, b, out and bias
# in the storage dtype {t}, the split-K partials in float32
_DECODE_ARGS = ("{t}[:,:,::1], {t}[:,:,::1], {t}[:,:,::1], {t}[::1], "
                "float32[:,:,:,::1], int32, int32, int32, int32, int32, int32")


def _decode_signature(dtype, extra: str = "") -> str:
    return "void(" + _DECODE_ARGS.format(t=np.dtype(dtype).name) + extra + ")"


def _async_stager(count: int, DR: int, DK: int, stride: int):
    """A device function issue(tile, dst, src, at, step, row, k, rows, k_end, whole): the
    `_operand_loader`'s elements copied by cp.async straight into the staged tile (element i
    to tile[dst + i * (DK * stride + DR)]), 4 bytes each so that the copies may transpose;
    an element past (rows, k_end) is zero-filled without reading src."""
    @cuda.jit(device=True)
    def issue(tile, dst, src, at, step, row, k, rows, k_end, whole):
        for i in range(count):
            r, kk = row + _u(i * DR), k + _u(i * DK)
            ok = whole or (r < rows and kk < k_end)
            _cpasync.copy4(tile, dst + _u(i * (DK * stride + DR)), src,
                           at + _u(i) * step if ok else _u(0), _u(4) if ok else _u(0))
    return issue


def _make_tiled(trans_a: bool, trans_b: bool, t: Tiles, stages: int = 0, fold: bool = False):
    """The tiled kernel for one layout of a and b and one tile shape (all compile-time: no
    per-element branch on the layout). Arguments: a, b, out, bias, has_bias, act,
    accumulate, part, direct, span, k_total, counters (touched only where `fold`); a 1-D
    block of t.threads.

    `fold`: a K-split launch sums its own partials: each block writes its split's partial
    tile, counts itself in on its tile's counter (kernels._lastblock), and the tile's last
    block adds the splits in split order and applies the epilogue, as
    gemm_splitk_reduce_kernels would in a launch of its own (same order: the same bits).

    `stages` 0: each K step's operands pass through registers, double-buffered in shared
    memory (the next step's loads issued before this step's multiply-adds). `stages` >= 2:
    they are copied by cp.async straight into a ring of `stages` shared buffers, so
    stages - 1 steps are in flight while one is multiplied, and no register holds a load
    (cuBLAS's SIMT kernels run 3 to 5 stages).

    A tensor-core tile (t.mma) staged through registers splits each operand into its two
    TF32 parts as it stores it, once, into shared tiles of twice the size; by cp.async the
    float32 lands as it is and every warp that reads a fragment splits it
    (kernels._tf32.mma_tile)."""
    TBM, TBN, TBK, TM, TN = t[:5]
    if stages == 1 or stages < 0:
        raise ValueError(f"stages: expected 0 (through registers) or at least 2, got {stages}")
    NT = t.threads
    if (TBM * TBK) % NT or (TBN * TBK) % NT:   # (stager checks the rest)
        raise ValueError(f"{t}: the tiled GEMM stages whole tiles: {NT} threads must divide them")
    A_PER, B_PER = TBM * TBK // NT, TBN * TBK // NT   # staged elements per thread
    BUFFERS = max(stages, 2)
    FOLD = bool(fold)
    a_place, A_DR, A_DK = stager(not trans_a, TBM, TBK, NT)  # a (M, K): contiguous along k
    b_place, B_DR, B_DK = stager(trans_b, TBN, TBK, NT)      # b (N, K) too; b (K, N) along n
    a_stage, b_stage = Stage.of(a_place, A_PER, A_DR, A_DK), Stage.of(b_place, B_PER, B_DR, B_DK)
    if t.mma and not stages:
        # Split once as staged, in fragment order (kernels._tf32.fragment_tile): a lane's
        # fragments are 16 contiguous bytes, so no padding. Fragment order spreads the rows
        # the stager gives a warp over too few banks (8-way conflicts where the operand is
        # contiguous along its rows, 2-way along k), so these tiles stage another way: a
        # lane's fragment words a thread, 16 bytes a store (lane_stage: a transposed, b
        # not), or runs of k from rows that land in 32 banks (k_run_stage).
        a_stage = (lane_stage("a", TBM, TBK, NT) if trans_a else
                   k_run_stage(TBM, TBK, NT)) or a_stage
        b_stage = (k_run_stage(TBN, TBK, NT) if trans_b else
                   lane_stage("b", TBN, TBK, NT)) or b_stage
        st = split_staging(t, BUFFERS, a_stage, b_stage)
        a_place, b_place = a_stage.place, b_stage.place
        multiply, row, col, place = st.multiply, st.row, st.col, st.place
        A_BUF, B_BUF, stores_a, stores_b = st.a_buf, st.b_buf, st.stores_a, st.stores_b
        a_first, b_first = st.a_first, st.b_first
        A_WORDS, B_WORDS, TILE_T = 2 * BUFFERS * A_BUF, 2 * BUFFERS * B_BUF, st.dtype
        BMP, BNP = TBM, TBN   # (cp.async's rows: unused here)
    else:
        # +8 columns (tensor cores): a warp's fragment reads (lanes t * stride + g apart) hit
        # 32 banks; +4 (SIMT): the transposed staging writes spread over the banks, and every
        # row stays 16-byte aligned for the register tile's 16-byte shared loads
        BMP, BNP = (TBM + 8, TBN + 8) if t.mma else (TBM + 4, TBN + 4)
        A_BUF, B_BUF = TBK * BMP, TBK * BNP
        A_WORDS, B_WORDS = BUFFERS * A_BUF, BUFFERS * B_BUF
        stores_a = staged_stores(tuple(i * (A_DK * BMP + A_DR) for i in range(A_PER)), None)
        stores_b = staged_stores(tuple(i * (B_DK * BNP + B_DR) for i in range(B_PER)), None)
        if t.mma:
            multiply, row, col, place = mma_tile(t, BMP, BNP)
        else:
            multiply, row, col = register_tile(t, BMP, BNP,
                                               rows_per_pass=2 if TBK % 2 == 0 else 1)
            place = grid_place(TBM // TM)
        a_first, b_first = first_place(k_major_place, BMP), first_place(k_major_place, BNP)
        TILE_T = np.float32

    load_a = _operand_loader(a_stage, k_first=trans_a)      # a (K, M) or (M, K)
    load_b = _operand_loader(b_stage, k_first=not trans_b)  # b (K, N) or (N, K)
    issue_a = _async_stager(A_PER, A_DR, A_DK, BMP)
    issue_b = _async_stager(B_PER, B_DR, B_DK, BNP)
    wait_oldest = _cpasync.wait_pending(max(stages - 2, 0))   # (stages >= 2 only)

    # Launch bounds (threads, blocks per SM) cap registers so that two wide blocks (64
    # accumulators a thread) or three of the others fit on an SM.
    MIN_BLOCKS = 2 if TM * TN >= 64 else 3
    @jit(f"void({_TILED_ARGS})", writes=("out", "part", "counters") if FOLD else ("out", "part"),
         launch_bounds=(NT, MIN_BLOCKS))
    def gemm_tiled_kernel(a, b, out, bias, has_bias, act, accumulate, part, direct, span,
                          k_total, counters):
        """Grid (N tiles, M tiles, batch x K splits). a and b are the operands flattened
        (op(a) is M x k_total, op(b) k_total x N, each batch after the last). Block
        (x, y, bz * S + s) multiplies K rows [s * span, (s + 1) * span) of its tile: with
        `direct` (S = 1) it applies the epilogue to out, else it writes part[bz, s] for
        gemm_splitk_reduce_kernels."""
        a_tile = cuda.shared.array(A_WORDS, TILE_T, alignment=TILE_ALIGN)  # op(a), k-major
        b_tile = cuda.shared.array(B_WORDS, TILE_T, alignment=TILE_ALIGN)  # op(b), k-major
        acc = cuda.local.array((TM, TN), np.float32)
        a_reg = cuda.local.array(TM, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        tid = _u(cuda.threadIdx.x)
        tx, ty = place(tid)   # (what row and col take)
        splits = part.shape[1]
        bz, split = _u(cuda.blockIdx.z // splits), cuda.blockIdx.z % splits
        m0, n0 = _u(cuda.blockIdx.y) * _u(TBM), _u(cuda.blockIdx.x) * _u(TBN)
        # Bounds as uint32, like the indices they are compared with: Numba compares an
        # unsigned with a signed 64-bit integer in float64 (a conversion and a double compare
        # per test).
        m_rows, n_cols, k_all = _u(out.shape[1]), _u(out.shape[2]), _u(k_total)
        k_lo = split * span   # (signed: mixing signed and unsigned in min() would give a float)
        k_len = min(k_total, k_lo + span)   # the bounds clip to it
        k_end = _u(k_len)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = _ZERO
        a_mm, a_kk = a_place(tid)   # this thread's first staged element of each tile
        b_nn, b_kk = b_place(tid)
        a_m, b_n = m0 + a_mm, n0 + b_nn
        a_at = a_first(a_mm, a_kk)   # ... and where it goes in the staged tiles
        b_at = b_first(b_nn, b_kk)
        # Offsets into the flattened operands: this batch's first element, and the offsets
        # of one more k and of one more row.
        a_base, b_base = bz * m_rows * k_all, bz * k_all * n_cols
        a_kstep = m_rows if trans_a else _u(1)
        b_kstep = _u(1) if trans_b else n_cols
        a_rstep = _u(1) if trans_a else k_all
        b_rstep = k_all if trans_b else _u(1)
        a_row = (a_base + a_m) if trans_a else (a_base + a_m * k_all)
        b_row = (b_base + b_n * k_all) if trans_b else (b_base + b_n)
        inside_a, inside_b = m0 + _u(TBM) <= m_rows, n0 + _u(TBN) <= n_cols
        if stages:
            a_step = _u(A_DK) * a_kstep + _u(A_DR) * a_rstep   # (the stager's elements:
            b_step = _u(B_DK) * b_kstep + _u(B_DR) * b_rstep   # a constant step apart)
            # The ring: steps 0 .. stages-2 issued, then step i waits for its own copies
            # (at most stages - 2 younger groups in flight), passes the barrier (every
            # thread's copies landed, every thread done with step i - 1), issues step
            # i + stages - 1 into step i - 1's buffer and multiplies. A group is committed
            # every step, empty or not, so the count of groups in flight stays exact.
            steps = (k_len - k_lo + TBK - 1) // TBK
            for i in range(stages - 1 + steps):
                if i >= stages - 1:
                    wait_oldest()
                    cuda.syncthreads()
                k0 = k_lo + i * TBK
                if k0 < k_len:
                    slot = _u(i % stages)
                    ka, kb = _u(k0) + a_kk, _u(k0) + b_kk
                    whole_k = _u(k0 + TBK) <= k_end
                    issue_a(a_tile, slot * _u(A_BUF) + a_at, a, a_row + ka * a_kstep,
                            a_step, a_m, ka, m_rows, k_end, inside_a and whole_k)
                    issue_b(b_tile, slot * _u(B_BUF) + b_at, b, b_row + kb * b_kstep,
                            b_step, b_n, kb, n_cols, k_end, inside_b and whole_k)
                _cpasync.commit()
                if i >= stages - 1:
                    now = _u((i - stages + 1) % stages)
                    multiply(acc, a_reg, b_reg, a_tile, b_tile, now * _u(A_BUF),
                             now * _u(B_BUF), tx, ty)
        else:
            # Step 0's loads, then each step stores the loads made during the step before and
            # issues its successor's before it multiplies: global memory latency overlaps the
            # arithmetic.
            a_next = cuda.local.array(A_PER, np.float32)
            b_next = cuda.local.array(B_PER, np.float32)
            ka, kb = _u(k_lo) + a_kk, _u(k_lo) + b_kk
            whole_k = _u(k_lo + TBK) <= k_end
            load_a(a_next, a, a_row + ka * a_kstep, a_rstep, a_kstep, a_m, ka, m_rows, k_end,
                   inside_a and whole_k)
            load_b(b_next, b, b_row + kb * b_kstep, b_rstep, b_kstep, b_n, kb, n_cols, k_end,
                   inside_b and whole_k)
            buf = _u(0)
            for k0 in range(k_lo, k_len, TBK):
                stores_a(a_tile, buf * _u(A_BUF) + a_at, a_next)
                stores_b(b_tile, buf * _u(B_BUF) + b_at, b_next)
                # One barrier per step: the next step fills the other buffer, and no thread can
                # refill this one before every thread has passed the next step's barrier.
                cuda.syncthreads()
                if k0 + TBK < k_len:
                    ka, kb = _u(k0 + TBK) + a_kk, _u(k0 + TBK) + b_kk
                    whole_k = _u(k0 + 2 * TBK) <= k_end
                    load_a(a_next, a, a_row + ka * a_kstep, a_rstep, a_kstep, a_m, ka, m_rows,
                           k_end, inside_a and whole_k)
                    load_b(b_next, b, b_row + kb * b_kstep, b_rstep, b_kstep, b_n, kb, n_cols,
                           k_end, inside_b and whole_k)
                multiply(acc, a_reg, b_reg, a_tile, b_tile, buf * _u(A_BUF),
                         buf * _u(B_BUF), tx, ty)
                buf = _u(1) - buf
        for i in range(TM):
            m = m0 + row(tx, i)
            for j in range(TN):
                n = n0 + col(ty, j)
                if m < m_rows and n < n_cols:
                    if direct:
                        _finish(acc[i, j], out, bz, m, n, bias, has_bias, act, accumulate)
                    else:
                        part[bz, _u(split), m, n] = acc[i, j]
        if FOLD and not direct:
            flag = cuda.shared.array(1, np.int32)
            tile = (bz * _u(cuda.gridDim.y) + _u(cuda.blockIdx.y)) * _u(cuda.gridDim.x) \
                + _u(cuda.blockIdx.x)
            if count_in(counters, tile, splits, flag):
                # Row by row of the thread's outputs: a split's TN loads of the row issued
                # together (through L2: other SMs wrote them), each output summed in split
                # order in acc (its products are in part by now)
                for i in range(TM):
                    m = m0 + row(tx, i)
                    if m < m_rows:
                        for j in range(TN):
                            acc[i, j] = _ZERO
                        for s in range(splits):
                            for j in range(TN):
                                n = n0 + col(ty, j)
                                if n < n_cols:
                                    acc[i, j] += backend.ldcg(part, (_u(bz), _u(s), _u(m), _u(n)))
                        for j in range(TN):
                            n = n0 + col(ty, j)
                            if n < n_cols:
                                _finish(acc[i, j], out, bz, m, n, bias, has_bias, act,
                                        accumulate)

    return gemm_tiled_kernel


# The tile choices measured on this kind of GPU (kernels.tuning), their kernels compiled
# here, at import, as the defaults are: never inside a stream capture or a memory reading.
TUNED = () if backend.SIMULATOR or backend.PTX_ONLY else tuning.table(backend.device_name()).gemm


@functools.cache
def tiled_kernel(trans_a: bool, trans_b: bool, t: Tiles, stages: int = 0, fold: bool = False):
    """The tiled kernel of a layout, tile shape, staging and split-K summing (`_make_tiled`):
    TILED_KERNELS' (compiled at import) or, for another, compiled on first use."""
    if not stages and not fold and (trans_a, trans_b, t) in TILED_KERNELS:
        return TILED_KERNELS[(trans_a, trans_b, t)]
    return _make_tiled(trans_a, trans_b, t, stages, fold)


# The counters argument of a tiled kernel that does not sum its own splits (never touched;
# its own array, so that no graph sees such a launch read the folding launches' counters)
_NO_COUNTERS = [] if backend.PTX_ONLY else [backend.persistent_zeros(1, np.int32)]


def tuned_kernels(entries) -> list[tuple]:
    """The tiled_kernel arguments a table's entries launch: the entry's layout, or NT where
    it transposes its operands first (`via_nt`)."""
    return list(dict.fromkeys(((False, True) if c.via_nt else at) + (c.tile, c.stages, c.fold)
                              for at, _, c in entries))


# One kernel per layout of a and b and tile shape: (trans_a, trans_b, tile) -> kernel
TILED_KERNELS = {(ta, tb, t): _make_tiled(ta, tb, t)
                 for t in (TILE, WIDE_TILE, *SKINNY) for ta in (False, True)
                 for tb in (False, True)}
for _args in tuned_kernels(TUNED):
    tiled_kernel(*_args)


class Decode(NamedTuple):
    """One compiled decode kernel and its geometry (see `make_decode_nn`/`make_decode_nt`)."""
    kernel: object
    threads: int
    tile: int       # output columns per block tile
    k_step: int     # K rows a block consumes per batch of loads
    trans_b: bool
    config: tuple
    rows: int = DECODE_MAX_M   # rows of x it multiplies (compile time; M <= rows; rows_variant)
    dtype: np.dtype = np.dtype(np.float32)   # storage of a, b, out, bias (dtype_variant)


def make_decode_nn(warps: int, groups: int, cols: int, unroll: int, min_blocks: int = 0,
                   rows: int = DECODE_MAX_M, dtype=np.float32):
    """The [K, N] decode kernel for one geometry. A warp's lanes form `groups` row groups of
    32/groups lanes on consecutive columns (groups=1: each warp load is one 128-byte row
    segment); a lane takes `cols` columns 32/groups apart and `unroll` rows per batch, so
    cols * unroll weight loads are in flight per lane. Block tile: warps*groups*unroll rows
    x cols*32/groups columns. `min_blocks`: resident blocks per SM the registers must allow.
    `rows`: the rows of x it multiplies, at most DECODE_MAX_M (compile time: a launch with
    fewer, M, leaves rows M.. to repeat row M - 1, multiplied and never stored). `dtype`:
    the storage of a, b, out and bias (float32 or float16); every product and sum is
    float32 (each element converted as it is loaded), the result rounded once as stored."""
    lane_cols = 32 // groups
    tile = cols * lane_cols
    row_groups = warps * groups
    step = row_groups * unroll
    red_size = row_groups * M8 * tile
    x_rows = rows     # (a name the kernels' own locals do not take)
    acc_size, wv_size = x_rows * cols, unroll * cols
    bounds = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}
    if SPAN_MAX % step:  # x is zero-padded to whole batches inside its SPAN_MAX slots
        raise ValueError(f"make_decode_nn: SPAN_MAX {SPAN_MAX} is not a multiple of {step}")
    if not 1 <= rows <= M8:
        raise ValueError(f"make_decode_nn: rows {rows} is not in 1..{M8}")

    @cuda.jit(device=True)
    def load(wv, b, bz, kb, k_hi, col):
        """wv[u, c] = b[bz, kb + u * row_groups, col[c]] (kb: this lane's first row). A full
        batch loads at constant offsets; the last, partial one clips its rows and zeroes
        what lies past k_hi."""
        if kb + _u(step - row_groups) < k_hi:
            for u in range(unroll):
                for c in range(cols):
                    wv[u * cols + c] = b[bz, kb + _u(u * row_groups), col[c]]
        else:
            for u in range(unroll):
                k = kb + _u(u * row_groups)
                kk = min(k, k_hi - _u(1))
                for c in range(cols):
                    v = b[bz, kk, col[c]]
                    wv[u * cols + c] = v if k < k_hi else _ZERO


    @jit(_decode_signature(dtype), writes=("out", "part"), early_launch=True, **bounds)
    def gemm_decode_nn_kernel(a, b, out, bias, part, has_bias, act, accumulate, trans_a,
                              direct, span):
        """Grid (column tiles, K splits, batch): out (B, M<=8, N) = op(a) (B, M, K) @
        b (B, K, N) over K rows [split * span, + span): the epilogue to out when `direct`,
        else the partial sums to part[bz, split]."""
        xs = cuda.shared.array(_XS, np.float32)        # (8, SPAN_MAX) op(a), this K range
        red = cuda.shared.array(red_size, np.float32)  # (row groups, 8, tile) partial sums
        acc = cuda.local.array(acc_size, np.float32)   # [m * cols + c]
        wv = cuda.local.array(wv_size, np.float32)     # [u * cols + c]
        col = cuda.local.array(cols, np.uint32)
        tid = _u(cuda.threadIdx.x)
        lane = tid % _u(32)
        j = lane % _u(lane_cols)
        rg = (tid // _u(32)) * _u(groups) + lane // _u(lane_cols)
        bz, split = _u(cuda.blockIdx.z), _u(cuda.blockIdx.y)
        # (see _BOUNDS)
        m_rows, n_cols, k_len = _u(out.shape[1]), _u(out.shape[2]), _u(b.shape[1])
        k_lo = split * _u(span)
        k_hi = _u(min(k_lo + _u(span), k_len))
        length = k_hi - k_lo
        n_tiles = (n_cols + tile - 1) // tile
        kb0 = k_lo + rg
        tile_i = cuda.blockIdx.x
        # First batch of weight loads before staging, so staging overlaps their latency.
        for c in range(cols):  # past the last column, re-read the last one; never stored
            col[c] = _u(min(_u(tile_i) * _u(tile) + j + _u(lane_cols * c), n_cols - _u(1)))
        load(wv, b, bz, kb0, k_hi, col)   # (weights: nobody's output, so before the wait)
        _stage_input(xs, a, bz, k_lo, length, (length + _u(step - 1)) // _u(step) * _u(step),
                     m_rows, trans_a)
        while tile_i < n_tiles:
            n0 = _u(tile_i) * _u(tile)
            for i in range(acc_size):
                acc[i] = _ZERO
            kb = kb0
            while kb < k_hi:
                r = kb - k_lo  # rows past k_hi: zero in xs and in wv
                for u in range(unroll):
                    for m in range(x_rows):
                        xm = xs[_u(m * SPAN_MAX + u * row_groups) + r]
                        for c in range(cols):
                            acc[m * cols + c] += xm * wv[u * cols + c]
                kb += _u(step)
                if kb < k_hi:
                    load(wv, b, bz, kb, k_hi, col)
            tile_i += cuda.gridDim.x
            if tile_i < n_tiles:  # the next tile's first loads fly during this tile's sums
                for c in range(cols):
                    col[c] = _u(min(_u(tile_i) * _u(tile) + j + _u(lane_cols * c),
                                    n_cols - _u(1)))
                load(wv, b, bz, kb0, k_hi, col)
            # Block sum over the row groups, in a fixed order; rows past m_rows are padding.
            for m in range(x_rows):
                if m < m_rows:
                    for c in range(cols):
                        red[(rg * _u(M8) + _u(m)) * _u(tile) + j + _u(lane_cols * c)] = \
                            acc[m * cols + c]
            cuda.syncthreads()
            for idx in range(tid, m_rows * tile, cuda.blockDim.x):
                m, jj = _u(idx // tile), _u(idx % tile)
                n = n0 + jj
                if n < n_cols:
                    v = _ZERO
                    for g in range(row_groups):
                        v += red[(_u(g * M8) + m) * _u(tile) + jj]
                    if direct:
                        _finish(v, out, bz, m, n, bias, has_bias, act, accumulate)
                    else:
                        part[bz, split, m, n] = v
            cuda.syncthreads()  # `red` is rewritten by the next tile

    return Decode(gemm_decode_nn_kernel, 32 * warps, tile, step, False,
                  ("nn", warps, groups, cols, unroll, min_blocks), x_rows, np.dtype(dtype))


def _warp_sums_store(acc_size: int, cols: int):
    """The trans_b kernels' epilogue for `acc_size` sums a lane, `cols` columns a warp (both
    compile-time, so acc stays in registers): each (m, c) summed over the warp's 32 lanes
    with shuffles (no barrier: the warps of a block stream independently), lane i storing
    the i-th result to out (`direct`) or to its split's partials. Rows past m_rows are
    padding: their reductions are skipped."""
    @cuda.jit(device=True, inline="always")
    def store(acc, lane, n_done, m_rows, n_cols, out, part, bz, split, bias, has_bias, act,
              accumulate, direct):
        for i in range(acc_size):
            if i // cols < m_rows:
                v = warp_allreduce(acc[i], False)
                n = n_done + _u(i % cols)
                if lane == _u(i) and n < n_cols:
                    m = _u(i // cols)
                    if direct:
                        _finish(v, out, bz, m, n, bias, has_bias, act, accumulate)
                    else:
                        part[bz, split, m, n] = v
    return store


def make_decode_nt(warps: int, cols: int, unroll: int, min_blocks: int = 0,
                   rows: int = DECODE_MAX_M, dtype=np.float32):
    """The trans_b decode kernel for one geometry: warp w of a block takes `cols` output
    columns (contiguous rows of b), its lanes along K with `unroll` loads per column per
    batch (cols * unroll in flight per lane), then sums across lanes by shuffles. Block
    tile: warps * cols columns. `rows` and `dtype` as in `make_decode_nn`."""
    tile = warps * cols
    step = 32 * unroll
    x_rows = rows     # (a name the kernels' own locals do not take)
    acc_size, wv_size = x_rows * cols, unroll * cols
    store = _warp_sums_store(acc_size, cols)
    if not 1 <= rows <= M8:
        raise ValueError(f"make_decode_nt: rows {rows} is not in 1..{M8}")
    bounds = {"launch_bounds": (32 * warps, min_blocks)} if min_blocks else {}
    if SPAN_MAX % step:  # x is zero-padded to whole batches inside its SPAN_MAX slots
        raise ValueError(f"make_decode_nt: SPAN_MAX {SPAN_MAX} is not a multiple of {step}")

    @cuda.jit(device=True)
    def load(wv, b, bz, k_lo, kb, length, rows):
        """wv[u, c] = b[bz, rows[c], k_lo + kb + u * 32] (kb: this lane's first k). A full
        batch loads at constant offsets; the last, partial one clips its k and zeroes what
        lies past length."""
        if kb + _u(step - 32) < length:
            for u in range(unroll):
                for c in range(cols):
                    wv[u * cols + c] = b[bz, rows[c], k_lo + kb + _u(32 * u)]
        else:
            for u in range(unroll):
                k = kb + _u(32 * u)
                kk = k_lo + min(k, length - _u(1))
                for c in range(cols):
                    v = b[bz, rows[c], kk]
                    wv[u * cols + c] = v if k < length else _ZERO


    @jit(_decode_signature(dtype), writes=("out", "part"), early_launch=True, **bounds)
    def gemm_decode_nt_kernel(a, b, out, bias, part, has_bias, act, accumulate, trans_a,
                              direct, span):
        """Grid (column tiles, K splits, batch): out (B, M<=8, N) = op(a) (B, M, K) @
        b (B, N, K).T over K rows [split * span, + span): the epilogue to out when
        `direct`, else the partial sums to part[bz, split]."""
        xs = cuda.shared.array(_XS, np.float32)  # (8, SPAN_MAX) op(a), this K range
        acc = cuda.local.array(acc_size, np.float32)  # [m * cols + c]
        wv = cuda.local.array(wv_size, np.float32)    # [u * cols + c]
        rows = cuda.local.array(cols, np.uint32)
        lane, warp = _u(cuda.threadIdx.x % 32), _u(cuda.threadIdx.x // 32)
        bz, split = _u(cuda.blockIdx.z), _u(cuda.blockIdx.y)
        # (see _BOUNDS)
        m_rows, n_cols, k_len = _u(out.shape[1]), _u(out.shape[2]), _u(b.shape[2])
        k_lo = split * _u(span)
        length = _u(min(k_lo + _u(span), k_len)) - k_lo
        n_tiles = (n_cols + tile - 1) // tile
        tile_i = cuda.blockIdx.x
        n0 = _u(tile_i) * _u(tile) + warp * _u(cols)
        for c in range(cols):  # past the last column, re-read the last row; never stored
            rows[c] = _u(min(n0 + _u(c), n_cols - _u(1)))
        load(wv, b, bz, k_lo, lane, length, rows)   # (weights: before the wait)
        _stage_input(xs, a, bz, k_lo, length, (length + _u(step - 1)) // _u(step) * _u(step),
                     m_rows, trans_a)
        while tile_i < n_tiles:
            for i in range(acc_size):
                acc[i] = _ZERO
            kb = _u(0)
            while kb < length:  # uniform over the block
                r = kb + lane  # k past length: zero in xs and in wv
                for u in range(unroll):
                    for m in range(x_rows):
                        xm = xs[_u(m * SPAN_MAX + 32 * u) + r]
                        for c in range(cols):
                            acc[m * cols + c] += xm * wv[u * cols + c]
                kb += _u(step)
                if kb < length:
                    load(wv, b, bz, k_lo, kb + lane, length, rows)
            n_done = n0
            tile_i += cuda.gridDim.x
            if tile_i < n_tiles:  # the next tile's first loads fly during this tile's sums
                n0 = _u(tile_i) * _u(tile) + warp * _u(cols)
                for c in range(cols):
                    rows[c] = _u(min(n0 + _u(c), n_cols - _u(1)))
                load(wv, b, bz, k_lo, lane, length, rows)
            store(acc, lane, n_done, m_rows, n_cols, out, part, bz, split, bias, has_bias, act,
                  accumulate, direct)

    return Decode(gemm_decode_nt_kernel, 32 * warps, tile, step, True,
                  ("nt", warps, cols, unroll, min_blocks), x_rows, np.dtype(dtype))


MMA_CHUNK = 32   # K elements a warp's two k-steps take (a lane's three 16-byte loads)
MMA_TILE = 16    # output columns a block: the rows of mma's A operand


@cuda.jit(device=True, inline="always")
def _mma_store(v, m, n, m_rows, n_cols, out, part, bz, split, bias, has_bias, act, accumulate,
               direct):
    """One of a lane's four results: the epilogue to out (`direct`) or the split's partial;
    padding rows and columns past the product are dropped."""
    if m < m_rows and n < n_cols:
        if direct:
            _finish(v, out, bz, m, n, bias, has_bias, act, accumulate)
        else:
            part[bz, split, m, n] = v


def make_decode_mma(warps_k: int, unroll: int, min_blocks: int = 0, pair: str | None = None):
    """The float16 trans_b decode kernel on tensor cores: out (B, M<=8, N) = a (B, M, K) @
    b (B, N, K).T, K a multiple of MMA_CHUNK, a and b 16-byte aligned (`mma_fits`).

    pair="k": out = a @ b.T + a2 @ b2.T, the two products' K (K1 + K2, each a multiple of
    MMA_CHUNK) one range that the splits cover as if b's and b2's rows were one row (and
    a's and a2's): a chunk below K1 reads a and b, one past it a2 and b2 (`gemm_sum`).
    pair="n": out = a @ b.T and out2 = act(a @ b2.T + bias): the column tiles of out, then
    out2's, one grid (`gemm_two_outputs`); the epilogue's flags are out2's, out's is plain;
    K whole (one split: no partials for two outputs). Without a pair, a2, b2 and out2 are
    placeholders the kernel never touches.

    One warp instruction (mma.sync m16n8k16, float16 products summed in float32) multiplies
    16 rows of b (16 output columns) by x^T, x the 8 rows of a (M real, the rest zero words).
    The SIMT kernel spends about 400 warp instructions on 3 KB of float16 weight (loads,
    conversions, 5 FMAs an element) and stops at half the copy rate; here 3 KB is 6 loads
    and 4 mma a warp. K is permuted inside each chunk of 32 so that every operand is one
    16-byte load a lane (a dot product does not care about K's order as long as a is read in
    the same one): lane (g, t) = (lane / 4, lane % 4) loads b's rows n0 + g and n0 + g + 8 and
    a's row g at k + 8t .. k + 8t + 7, and those four words feed the A and B fragments of two
    k-steps. A block is `warps_k` warps over one 16-column tile and the split's K range,
    each warp `unroll` chunks a batch, every load of the batch issued before its multiplies;
    the warps' sums meet in shared memory in warp order (deterministic). The first batch of
    weights is loaded before the early-launch wait; a is read after it, by coherent loads
    (an earlier kernel's output). Grid (column tiles, K splits, batch), as `decode` plans
    it (`decode_plan`): no staging of a in shared memory, so no SPAN_MAX bound on a split."""
    from kernels._mma import ld16, ldg16, mma16816
    if pair not in (None, "k", "n"):
        raise ValueError(f"pair: None, 'k' or 'n', got {pair!r}")
    two, outs = pair == "k", pair == "n"   # (constants: no branch where not paired)
    chunk = MMA_CHUNK * unroll       # K a warp's batch of loads covers
    step, words = chunk * warps_k, 4 * unroll
    bounds = {"launch_bounds": (32 * warps_k, min_blocks)} if min_blocks else {}
    zero = np.uint32(0)

    @cuda.jit(device=True, inline="always")
    def load_weights(wa, wb, b, w0, w1, b2, v0, v1, second, kc, length):
        """The batch of b's two rows at kc (flat offsets w0 + kc, w1 + kc) into wa and wb;
        with two products, of b2's (v0 + kc, v1 + kc) for chunks past K1 (`second`); chunks
        past length are left as they are (never multiplied)."""
        for u in range(unroll):
            kk = kc + MMA_CHUNK * u
            if kk < length:
                if two and kk >= second:
                    p, q = ldg16(b2, v0 + kk), ldg16(b2, v1 + kk)
                else:
                    p, q = ldg16(b, w0 + kk), ldg16(b, w1 + kk)
                for e in range(4):
                    wa[4 * u + e], wb[4 * u + e] = p[e], q[e]

    def gemm_decode_mma_kernel(a, b, out, bias, part, has_bias, act, accumulate, trans_a,
                               direct, span, a2, b2, out2):
        red = cuda.shared.array((warps_k, 32, 4), np.float32)
        wa = cuda.local.array(words, np.uint32)   # b's row n0 + g, chunk by chunk
        wb = cuda.local.array(words, np.uint32)   # b's row n0 + g + 8
        xa = cuda.local.array(words, np.uint32)   # a's row g
        lane, wk = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        g, t = lane >> 2, lane & 3
        bz, split = cuda.blockIdx.z, cuda.blockIdx.y
        tile = cuda.blockIdx.x
        if outs:   # (pair "n") out's column tiles, then out2's with its epilogue
            first = -(-out.shape[2] // MMA_TILE)
            if tile >= first:
                tile -= first
                b, out = b2, out2
            else:
                has_bias = act = 0
        m_rows, n_cols, k1 = out.shape[1], out.shape[2], b.shape[2]
        k2 = b2.shape[2] if two else 0
        k_len = k1 + k2
        k_lo = split * span
        length = min(k_lo + span, k_len) - k_lo
        second = k1 - k_lo   # (two) the split's first chunk of a2 and b2: K1, split-relative
        n0 = tile * MMA_TILE
        # flat offsets of this lane's first elements, a chunk kc of the split at + kc (the
        # second product's as if its K went on from K1); past the last column the last row
        # is re-read (never stored)
        r0 = bz * n_cols + min(n0 + g, n_cols - 1)
        r1 = bz * n_cols + min(n0 + g + 8, n_cols - 1)
        rx = bz * m_rows + min(g, m_rows - 1)
        lo = k_lo + 8 * t
        w0, w1, x0 = r0 * k1 + lo, r1 * k1 + lo, rx * k1 + lo
        v0, v1, y0 = r0 * k2 + lo - k1, r1 * k2 + lo - k1, rx * k2 + lo - k1
        real = g < m_rows   # x's rows past M: zero words
        kc = wk * chunk
        # (before the wait: no kernel writes b)
        load_weights(wa, wb, b, w0, w1, b2, v0, v1, second, kc, length)
        _pdl.wait()
        _pdl.launch_dependents()
        c0 = c1 = c2 = c3 = _ZERO
        while kc < length:   # (uniform over the warp: mma.sync needs every lane)
            for u in range(unroll):
                kk = kc + MMA_CHUNK * u
                if real and kk < length:
                    v = ld16(a2, y0 + kk) if two and kk >= second else ld16(a, x0 + kk)
                    for e in range(4):
                        xa[4 * u + e] = v[e]
                else:
                    for e in range(4):
                        xa[4 * u + e] = zero
            for u in range(unroll):
                if kc + MMA_CHUNK * u < length:
                    for s in range(2):   # k-step s: this lane's elements 4s .. 4s + 3
                        i = 4 * u + 2 * s
                        c0, c1, c2, c3 = mma16816(wa[i], wb[i], wa[i + 1], wb[i + 1],
                                                  xa[i], xa[i + 1], c0, c1, c2, c3)
            kc += step
            load_weights(wa, wb, b, w0, w1, b2, v0, v1, second, kc, length)   # in flight
        if warps_k > 1:
            red[wk, lane, 0], red[wk, lane, 1] = c0, c1
            red[wk, lane, 2], red[wk, lane, 3] = c2, c3
            cuda.syncthreads()
            if wk != 0:
                return
            for j in range(1, warps_k):
                c0 += red[j, lane, 0]
                c1 += red[j, lane, 1]
                c2 += red[j, lane, 2]
                c3 += red[j, lane, 3]
        # D[r][c]: r the tile's column of out (n0 + g, n0 + g + 8), c a's row (2t, 2t + 1)
        for i in range(4):   # c_i at out[2t + i % 2, n0 + g + 8 (i // 2)]
            v = c0 if i == 0 else c1 if i == 1 else c2 if i == 2 else c3
            _mma_store(v, 2 * t + i % 2, n0 + g + 8 * (i // 2), m_rows, n_cols, out, part,
                       bz, split, bias, has_bias, act, accumulate, direct)

    if pair:   # (a name of its own in profiles and the register table)
        gemm_decode_mma_kernel.__name__ += f"_pair_{pair}"
        gemm_decode_mma_kernel.__qualname__ += f"_pair_{pair}"
    kernel = jit(_decode_signature(np.float16, ", {t}[:,:,::1], {t}[:,:,::1], {t}[:,:,::1]"
                                   .format(t="float16")),
                 writes=("out", "part", "out2"), early_launch=True, **bounds)(
        gemm_decode_mma_kernel)
    return Decode(kernel, 32 * warps_k, MMA_TILE, chunk, True,
                  ("mma", warps_k, unroll, min_blocks) + ((("pair", pair),) if pair else ()),
                  DECODE_MAX_M, np.dtype(np.float16))


def mma_fits(a, b, trans_a: bool) -> bool:
    """Whether the tensor-core kernel can take this float16 product: a not transposed, K a
    multiple of MMA_CHUNK, a and b 16-byte aligned (every load is 16 bytes)."""
    # (extent: the arrays' byte ranges, remembered per array object: no driver call a launch)
    return (not trans_a and b.shape[2] % MMA_CHUNK == 0
            and backend.extent(a)[0] % 16 == 0 and backend.extent(b)[0] % 16 == 0)


@jit_per_dtype("void(float32[::1], int32, {t}[:,:,::1], {t}[::1], int32, int32, int32)",
               writes=("out",), early_launch=True)
def gemm_splitk_reduce_kernels(part, splits, out, bias, has_bias, act, accumulate):
    """out[bz, m, n] = epilogue(sum over s of part[bz, s, m, n]), s in order, `part` the
    (B, splits, M, N) partials flattened (uint32 offsets: a partial's address is one add
    from the last, where 4-D indexing multiplied four runtime strides a load). Grid (column
    blocks, row blocks): threads along n, each y index a row r = bz * M + m at a time
    (grid-stride), so a row's coordinates cost one 32-bit division a row, not the four 64-bit
    divisions an element of a flat grid-stride loop (about 300 instructions an element: the
    reductions ran instruction-bound, Wav2Vec2's at a third of copy bandwidth). Every load of
    an output (old value, bias, RED_CHUNK partials) is issued before any is used: one memory
    round trip per chunk, not one per partial."""
    vals = cuda.local.array(RED_CHUNK, np.float32)
    B, M, N = out.shape
    S = splits
    n_rows, n_cols = _u(B * M), _u(N)
    plane = _u(M) * n_cols   # one split's partials of a batch
    n = _u(cuda.blockIdx.x) * _u(cuda.blockDim.x) + _u(cuda.threadIdx.x)
    _pdl.wait()   # (early launch: everything it reads but the bias is an earlier output)
    _pdl.launch_dependents()
    if n >= n_cols:
        return
    bv = bias[n] if has_bias else _ZERO
    r = _u(cuda.blockIdx.y)
    while r < n_rows:
        bz, m = _u(r // _u(M)), _u(r % _u(M))
        at = _u(_u(_u(bz * _u(S)) * _u(M) + m) * n_cols + n)   # part[bz, 0, m, n]
        old = out[bz, m, n] if accumulate else _ZERO
        v = _ZERO
        for s0 in range(0, S, RED_CHUNK):
            # (predicated, not clamped: the addresses a plane apart, one 32-bit add each;
            # Numba widens uint32 arithmetic to 64 bits unless each result is cast back)
            for u in range(RED_CHUNK):
                if s0 + u < S:
                    vals[u] = part[at]
                at = _u(at + plane)
            for u in range(RED_CHUNK):
                if s0 + u < S:
                    v += vals[u]
        if accumulate:  # the same order as _finish: (sum + old) + bias
            v += old
        if has_bias:
            v += bv
        out[bz, m, n] = _act(v, act)
        r = _u(r + _u(cuda.gridDim.y))


def _make_reduce_ln(cols: int, chunk: int):
    """The split-K reduction with the row's layer norm, for rows of up to cols * LN_THREADS
    columns (a thread holds `cols` of them) summing `chunk` partials a value per round of
    loads: {dtype: kernel}."""
    vals_size, gb_size = cols * chunk, 2 * cols   # (local arrays: plain constants)

    @jit_per_dtype("void(float32[:,:,:,::1], {t}[:,:,::1], {t}[::1], int32, int32, int32, "
                   "{t}[::1], {t}[::1], float32, {t}[:,:,::1])", writes=("out", "y"),
                   launch_bounds=(LN_THREADS, 1), early_launch=True)
    def gemm_splitk_reduce_ln_kernels(part, out, bias, has_bias, act, accumulate, gamma, beta,
                                      eps, y):
        """Grid (B*M,), a block per output row: the split-K epilogue of
        `gemm_splitk_reduce_kernels` for the row, then y[row] = layernorm(out[row]) * gamma +
        beta from the values still in registers (`block_layernorm_row`). Columns tid +
        blockDim * c, c < cols: N <= cols * blockDim <= cols * LN_THREADS. Every load (old
        values, bias, gamma, beta, a chunk of partials) is issued before the first store."""
        vals = cuda.local.array(vals_size, np.float32)
        xv = cuda.local.array(cols, np.float32)
        old = cuda.local.array(cols, np.float32)
        bv = cuda.local.array(cols, np.float32)
        gb = cuda.local.array(gb_size, np.float32)
        B, S, M, N = part.shape
        n_cols = _u(N)   # (see _BOUNDS)
        bz, m = _u(cuda.blockIdx.x // M), _u(cuda.blockIdx.x % M)
        tid, nt = _u(cuda.threadIdx.x), _u(cuda.blockDim.x)
        last = _u(N - 1)
        load_ln_params(gamma, beta, gb, cols, N)
        _pdl.wait()   # (early launch: gamma and beta above are nobody's output; out, part are)
        _pdl.launch_dependents()
        for c in range(cols):  # past N, re-read column N-1 (never stored or counted)
            n = min(tid + nt * _u(c), last)
            old[c] = out[bz, m, n] if accumulate else _ZERO
            bv[c] = bias[n] if has_bias else _ZERO
            xv[c] = _ZERO
        for s0 in range(0, S, chunk):
            for c in range(cols):
                n = min(tid + nt * _u(c), last)
                for u in range(chunk):
                    vals[c * chunk + u] = part[bz, _u(min(s0 + u, S - 1)), m, n]
            for c in range(cols):
                for u in range(chunk):
                    if s0 + u < S:
                        xv[c] += vals[c * chunk + u]
        for c in range(cols):   # the same order as _finish: (sum + old) + bias, then act
            v = xv[c]
            if accumulate:
                v += old[c]
            if has_bias:
                v += bv[c]
            xv[c] = _act(v, act)
        for c in range(cols):
            n = tid + nt * _u(c)
            if n < n_cols:
                out[bz, m, n] = xv[c]
        block_layernorm_row(xv, cols, N, gb, eps, y[bz, m])

    return gemm_splitk_reduce_ln_kernels


# Rows up to LN_COLS * LN_THREADS (GPT-2's 768) sum RED_CHUNK partials a round; wider rows
# (GPT-J's 4096: its block's last product, gemm_sum, splits K in 3) hold LN_WIDE_COLS columns a
# thread, so fewer partials a round fit the registers
gemm_splitk_reduce_ln_kernels = _make_reduce_ln(LN_COLS, RED_CHUNK)
gemm_splitk_reduce_ln_wide_kernels = _make_reduce_ln(LN_WIDE_COLS, LN_WIDE_CHUNK)
LN_MAX_COLS = LN_WIDE_COLS * LN_THREADS   # the widest row a reduction normalizes


NN = make_decode_nn(*NN_SPLIT)
NN_COLS = make_decode_nn(*NN_COLUMNS)
NN_WIDE_K = make_decode_nn(*NN_WIDE)
NT = make_decode_nt(*NT_CONFIG)
NT_HALF = make_decode_nt(*NT_HALF_CONFIG, dtype=np.float16)
MMA_HALF = make_decode_mma(*MMA_HALF_CONFIG)   # (the simulator's: _mma's stand-ins)
MMA_PAIR = make_decode_mma(*MMA_PAIR_CONFIG, pair="k")
MMA_OUTS = make_decode_mma(*MMA_HALF_CONFIG, pair="n")
gemm_decode_nn_kernel = NN.kernel
gemm_decode_nt_kernel = NT.kernel


@functools.cache
def _variant(config: tuple, rows: int, dtype: np.dtype) -> Decode:
    kind, *geometry = config
    return (make_decode_nt if kind == "nt" else make_decode_nn)(*geometry, rows=rows,
                                                                dtype=dtype)


def rows_variant(dk: Decode, m_rows: int) -> Decode:
    """`dk`'s geometry compiled for exactly m_rows (<= DECODE_MAX_M) rows of x: a launch of
    5 rows then multiplies 5, where the 8-row kernel spent 3/8 of its multiply-adds and
    shared-memory loads on padding. Compiled on first use, once."""
    if dk.config[0] == "mma":   # (reads M at run time: rows past it are zero words)
        return dk
    return dk if dk.rows == m_rows else _variant(dk.config, m_rows, dk.dtype)


def dtype_variant(dk: Decode, dtype) -> Decode:
    """`dk`'s geometry and rows compiled for storage `dtype` (float32 or float16): the same
    source, its loads converting to float32. Compiled on first use, once."""
    dtype = np.dtype(dtype)
    if dk.dtype != dtype and dk.config[0] == "mma":
        raise TypeError(f"the tensor-core decode kernel is float16 only, not {dtype}")
    return dk if dk.dtype == dtype else _variant(dk.config, dk.rows, dtype)


if not backend.SIMULATOR:   # compiled at import (compile_check): GPT-2's beam of 5 (qkv's
    # partials, attention projection, head), and every half-precision geometry
    GPT2_BEAM = (rows_variant(NN, 5), rows_variant(NT, 5))
    HALF_GEOMETRIES = tuple(dtype_variant(dk, np.float16) for dk in (NN, NN_COLS, NN_WIDE_K)) \
        + (NT_HALF, MMA_HALF, MMA_PAIR, MMA_OUTS)


# ---------------------------------------------------------------------------- launcher
def pick_decode(trans_b: bool, batch: int, n_cols: int, dtype=np.float32) -> Decode:
    """The decode kernel for a shape and storage dtype (H200 measurements, dev/notes/decode.md):
    trans_b has one kernel a dtype (float32's NT; float16's MMA_HALF on tensor cores, NT_HALF
    where `decode` finds the product does not fit it, `mma_fits`);
    [K, N] takes 16-column tiles over the whole K when they alone give one to four blocks
    per SM (no split, so no reduction launch: GPT-2's 2304 and 3072 columns), 128-column
    persistent tiles when N is wide enough for two per SM, else 64-column tiles with K
    split (768 columns)."""
    if trans_b:
        if np.dtype(dtype) != np.float16:
            return NT
        return MMA_HALF
    sms = _check.sm_count()
    if -(-n_cols // NN_WIDE_K.tile) * batch >= 2 * sms:
        return NN_WIDE_K
    if sms <= -(-n_cols // NN_COLS.tile) * batch <= 4 * sms:
        return NN_COLS
    return NN


def decode_plan(dk: Decode, batch: int, n_cols: int, k_len: int,
                target_blocks: int | None = None, grid_cap: int | None = None):
    """(column-tile blocks, K splits, span) for a decode launch. Splits: enough for the
    grid to reach `target_blocks` (at most one batch of loads per block), never fewer than
    SPAN_MAX allows. Column tiles beyond `grid_cap` blocks (default: one wave of resident
    blocks) are looped over by the blocks (persistent), so op(a) is staged once per block."""
    if dk.config[0] == "mma":
        return _mma_plan(dk, batch, n_cols, k_len, target_blocks)
    target = target_blocks
    if target is None:  # the whole-K kernels split only where K exceeds SPAN_MAX (by
        # geometry, not identity: their rows_variant twins are other objects)
        target = 1 if dk.config in (NN_COLS.config, NN_WIDE_K.config) else TARGET_BLOCKS
    n_tiles = -(-n_cols // dk.tile)
    splits, span = _split_k(dk, k_len, -(-target // (n_tiles * batch)))
    return _column_blocks(dk, n_tiles, splits * batch, grid_cap), splits, span


def _mma_plan(dk: Decode, batch: int, n_cols: int, k_len: int, target_blocks: int | None):
    """(column tiles, K splits, span) for the tensor-core kernel: a block per 16-column tile
    (no persistence: nothing is staged to share), K split until the grid makes one wave of
    resident blocks (`target_blocks`, default) or each warp has one batch of loads left;
    by default K whole where it is at most MMA_WHOLE_K and the tiles alone fill the SMs."""
    n_tiles = -(-n_cols // dk.tile)
    if target_blocks is not None:
        target = target_blocks
    elif k_len <= MMA_WHOLE_K and n_tiles * batch >= _check.sm_count():
        target = 1
    else:
        target = _check.resident_blocks(dk.kernel, dk.threads)
    warps_k = dk.config[1]
    most = max(1, k_len // (dk.k_step * warps_k))
    splits = max(1, min(most, -(-target // (n_tiles * batch))))
    span = -(-(-(-k_len // splits)) // dk.k_step) * dk.k_step   # whole batches of loads
    return n_tiles, -(-k_len // span), span


def _column_blocks(dk: Decode, n_tiles: int, others: int, grid_cap: int | None = None) -> int:
    """Column-tile blocks for a grid of `others` (splits x batch) blocks a column tile: at
    most one wave of resident blocks (default), the rest looped over by the blocks."""
    cap = _check.resident_blocks(dk.kernel, dk.threads) if grid_cap is None else grid_cap
    return max(1, min(n_tiles, cap // others))


def _split_k(dk: Decode, k_len: int, want: int) -> tuple[int, int]:
    """(splits, span) of K: about `want` splits of whole batches of the kernel's loads, never
    more than one batch or fewer than SPAN_MAX rows allow."""
    step = min(dk.k_step, SPAN_MAX)
    splits = max(-(-k_len // SPAN_MAX), min(want, -(-k_len // step)))
    span = -(-(-(-k_len // splits)) // step) * step  # whole batches per split
    span = min(span, SPAN_MAX)
    return -(-k_len // span), span


def _partials(out, splits: int, direct: bool):
    """The split-K scratch (batch, splits, M, N) for `out`: scratch of this call only (the
    reduction right after reads it, nothing later); a placeholder no kernel touches when the
    kernel writes out directly."""
    shape = (1, 1, 1, 1) if direct else (out.shape[0], splits, *out.shape[1:])
    return backend.empty(shape, np.float32, "gemm.partials")


def _kept(part, splits: int):
    """A caller's partials buffer for a launch of `splits` K splits (the kernels index it by
    its own split count, so the two must agree)."""
    if part.shape[1] != splits:
        raise ValueError(f"part: expected {splits} splits (the K splits of gemm's launch, "
                         f"split_count), got {part.shape[1]}")
    return part


def _sum_partials(part, out, bias, has_bias, act, accumulate, stream) -> None:
    """out = epilogue(sum of the partials in split order): gemm_splitk_reduce_kernels, its
    columns across blocks of threads, rows over about 8 blocks an SM in all (the simulator:
    32 threads, one row block)."""
    if part.size >= 2**32:   # (the kernel's offsets are uint32)
        raise ValueError(f"part: {part.size} partials exceed the reduction's 2**32")
    rows, n_cols = out.shape[0] * out.shape[1], out.shape[2]
    threads = 32 if backend.SIMULATOR else 256
    col_blocks = -(-n_cols // threads)
    want = 1 if backend.SIMULATOR else 8 * _check.sm_count()
    row_blocks = max(1, min(rows, -(-want // col_blocks), 65535))
    launch(gemm_splitk_reduce_kernels[np.dtype(out.dtype)], (col_blocks, row_blocks), threads,
           (backend.reshaped(part, (part.size,)), np.int32(part.shape[1]), out, bias, has_bias,
            act, accumulate), stream)


def decode(dk: Decode, a, b, out, bias, has_bias, act, accumulate, trans_a, stream,
           ln_out=None, target_blocks=None, grid_cap=None, keep=None, second=None,
           outs=None) -> None:
    """Launch decode kernel `dk` and, when it splits K (or `ln_out` = (gamma, beta, eps, y)
    asks for the row-wise layer norm), the reduction, on validated 3-D arguments (`bias`
    a device array, a placeholder when has_bias is 0; y 3-D like out). With `keep` (batch,
    splits, M, N), the partials are written there and left for the caller: no reduction,
    out untouched. `second` = (a2, b2): dk is MMA_PAIR, and out is a @ b.T + a2 @ b2.T.
    `outs` = (b2, out2): dk is MMA_OUTS, out = a @ b.T and out2 the epilogue of a @ b2.T,
    K whole (no ln_out, no keep)."""
    batch, m_rows, n_cols = out.shape
    if dk.config[0] == "mma" and second is None and outs is None \
            and not mma_fits(a, b, trans_a):
        dk = NT_HALF
    dk = rows_variant(dtype_variant(dk, out.dtype), m_rows)
    k_len = b.shape[2] if dk.trans_b else b.shape[1]
    if second is not None:
        k_len += second[1].shape[2]
    if outs is None:
        blocks, splits, span = decode_plan(dk, batch, n_cols, k_len, target_blocks, grid_cap)
    else:   # one grid of both outputs' column tiles, K whole
        blocks = -(-n_cols // dk.tile) - (-outs[1].shape[2] // dk.tile)
        splits, span = 1, -(-k_len // dk.k_step) * dk.k_step
    direct = splits == 1 and ln_out is None and keep is None
    part = _partials(out, splits, direct) if keep is None else _kept(keep, splits)
    extra = ()
    if dk.config[0] == "mma":   # a2, b2, out2: placeholders where the kernel has no pair
        # (out2, a declared output, may overlap no argument: a placeholder of its own)
        no_out2 = None if outs else backend.empty((1, 1, 1), np.float16, "gemm.no_out2")
        extra = (*(second or (a, b)), no_out2) if outs is None else (a, *outs)
    launch(dk.kernel, (blocks, splits, batch), dk.threads,
           (a, b, out, bias, part, has_bias, act, accumulate, trans_a, int(direct),
            np.int32(span), *extra), stream)
    if direct or keep is not None:
        return
    if ln_out is None:
        _sum_partials(part, out, bias, has_bias, act, accumulate, stream)
    else:
        gamma, beta, eps, y = ln_out
        wide = n_cols > LN_COLS * LN_THREADS
        kernels, cols = (gemm_splitk_reduce_ln_wide_kernels, LN_WIDE_COLS) if wide \
            else (gemm_splitk_reduce_ln_kernels, LN_COLS)
        launch(kernels[np.dtype(out.dtype)], batch * m_rows, _check.warp_threads(-(-n_cols // cols)),
               (part, out, bias, has_bias, act, accumulate, gamma, beta, np.float32(eps), y),
               stream)


def partial_splits(n_cols: int, k_len: int) -> int:
    """The K splits `partials` takes for a decode product of N = n_cols, K = k_len: as many
    as the split kernel's plan gives when it must reduce (GPT-2 small's qkv, 768 x 2304: 6
    of 128 rows, 216 blocks)."""
    return _split_k(NN, k_len, -(-PARTIALS_TARGET // -(-n_cols // NN.tile)))[0]


def partials(a, b, part, *, stream=0) -> None:
    """part[s] = a @ b over K rows [s * span, (s + 1) * span), span = K / S rounded up to the
    split kernel's batch (`NN`), for S = part.shape[0]: the split-K partial products of a
    decode GEMM with no epilogue and no reduction launch, for a consumer that sums the S
    partials in order (and adds the bias) as it loads its operands: kernels.attention's tile
    does so for qkv, where the whole-K kernel needs 144 blocks to read 7 MB and takes about
    twice what the split kernel does (results/h200/profiles/stream_df1cd61.txt).

    a (M <= 8, K), b (K, N), part (S, M, N) device float32; S from `partial_splits` or any
    count whose span covers K in exactly S splits of at most SPAN_MAX rows."""
    _check.device_array("a", a, ndim=2)
    m_rows, k_len = a.shape
    _check.positive("a.shape[0] (rows)", m_rows, at_most=DECODE_MAX_M)
    _check.device_array("b", b, shape=(k_len, None))
    n_cols = b.shape[1]
    _check.device_array("part", part, shape=(None, m_rows, n_cols))
    splits = _check.positive("part.shape[0] (splits)", part.shape[0])
    got, span = _split_k(NN, k_len, splits)
    if got != splits:
        raise ValueError(f"part: {splits} splits of K={k_len} in whole batches of "
                         f"{NN.k_step} rows do not come out even (or exceed {SPAN_MAX} rows "
                         f"each); partial_splits({n_cols}, {k_len}) = "
                         f"{partial_splits(n_cols, k_len)}")
    a3, b3 = backend.reshaped(a, (1, m_rows, k_len)), backend.reshaped(b, (1, k_len, n_cols))
    part4 = backend.reshaped(part, (1, splits, m_rows, n_cols))
    # out: never written with direct = 0, but its shape gives M and N, and a declared output
    # may overlap no other argument
    out3 = backend.empty((1, m_rows, n_cols), np.float32, "gemm.partials.out")
    nn = rows_variant(NN, m_rows)
    blocks = _column_blocks(nn, -(-n_cols // nn.tile), splits)
    launch(nn.kernel, (blocks, splits, 1), nn.threads,   # (which refuses part overlapping a, b)
           (a3, b3, out3, backend.reshaped(b, (b.size,)), part4, 0, 0, 0, 0, 0,
            np.int32(span)), stream)


def split_count(m_rows: int, n_cols: int, k_len: int, *, trans_b: bool = False,
                skinny: bool = False) -> int:
    """The K splits that `gemm` launches for a 2-D product op(a) (m_rows, k_len) @ op(b)
    (k_len, n_cols), and so the partials `split_products` writes (at least 1)."""
    if m_rows <= DECODE_MAX_M:
        dk = rows_variant(pick_decode(trans_b, 1, n_cols), m_rows)
        return decode_plan(dk, 1, n_cols, k_len)[1]
    return tiled_launch_plan(1, m_rows, n_cols, k_len, skinny=skinny)[1]


def split_products(a, b, part, *, trans_b=False, stream=0, skinny=False) -> None:
    """part[s] = the product of K split s, op(a) @ op(b) over that split's rows of K: the
    launch `gemm` makes, with no epilogue and no reduction, for a consumer that sums the
    splits in order (and adds the bias) as it loads them. kernels.lstm's cell sums both gate
    GEMMs' partials so, where each GEMM would end in a reduction launch.

    a (M, K), op(b) (K, N): b (K, N), or (N, K) with trans_b; part (S, M, N) device float32,
    S = split_count(M, N, K, trans_b=trans_b, skinny=skinny). part may overlap neither a
    nor b. skinny: as `gemm`'s."""
    _check.device_array("a", a, ndim=2)
    m_rows, k_len = a.shape
    trans_b = _check.flag("trans_b", trans_b)
    _check.device_array("b", b, shape=(None, k_len) if trans_b else (k_len, None))
    n_cols = b.shape[0] if trans_b else b.shape[1]
    _check.device_array("part", part, shape=(None, m_rows, n_cols))   # (its splits: _kept)
    a3, b3 = backend.reshaped(a, (1, *a.shape)), backend.reshaped(b, (1, *b.shape))
    part4 = backend.reshaped(part, (1, *part.shape))
    # out: never written (the partials are kept), but its shape gives M and N, and a declared
    # output may overlap no other argument
    out3 = backend.empty((1, m_rows, n_cols), np.float32, "gemm.split_products.out")
    unused = backend.reshaped(b, (b.size,))   # the bias placeholder, never read
    if m_rows <= DECODE_MAX_M:
        decode(pick_decode(trans_b, 1, n_cols), a3, b3, out3, unused, 0, 0, 0, 0, stream,
               keep=part4)
    else:
        tiled(a3, b3, out3, unused, 0, 0, 0, 0, int(trans_b), stream, keep=part4,
              skinny=skinny)


def tiled_min_span(t: Tiles) -> int:
    """K rows a split of tile `t` takes at least, so that its partial tile is worth writing:
    MIN_SPAN_STEPS of its K steps."""
    return MIN_SPAN_STEPS * t.bk


def tiled_plan(t: Tiles, batch: int, m_rows: int, n_cols: int, k_len: int,
               target_blocks: int | None = None) -> tuple[int, int]:
    """(K splits, span) for the tiled kernel of tile `t`. Its tiles give few blocks for
    skinny products (an LSTM step: 9..64 rows against 4096 columns is 64 blocks of 64 x 64
    for 132 SMs), so K is split until the grid has about `target_blocks` (two resident
    blocks per SM), in whole K steps of t, each split at least tiled_min_span(t) rows."""
    target = 2 * _check.sm_count() if target_blocks is None else target_blocks
    tiles = -(-n_cols // t.bn) * -(-m_rows // t.bm) * batch
    splits = min(-(-target // tiles), k_len // tiled_min_span(t), 65535 // batch)
    if splits < 2:
        return 1, -(-k_len // t.bk) * t.bk
    span = -(-(-(-k_len // splits)) // t.bk) * t.bk    # whole K steps per split
    return -(-k_len // span), span


def tiled_tile(batch: int, m_rows: int, n_cols: int, skinny: bool = False) -> Tiles:
    """WIDE_TILE (8 x 8 outputs a thread: twice the multiply-adds per shared load and per
    staged element) where its tiles alone make two blocks an SM; else, with `skinny`, the
    first SKINNY tile of at least m_rows rows; else TILE."""
    wide = -(-m_rows // WIDE_TILE.bm) * -(-n_cols // WIDE_TILE.bn) * batch
    if wide >= 2 * _check.sm_count():
        return WIDE_TILE
    if skinny:
        for t in SKINNY:
            if m_rows <= t.bm:
                return t
    return TILE


def tiled_launch_plan(batch: int, m_rows: int, n_cols: int, k_len: int,
                      target_blocks: int | None = None, skinny: bool = False
                      ) -> tuple[Tiles, int, int]:
    """(tile, K splits, span) that `tiled` launches: WIDE_TILE whole, any other as
    `tiled_plan` splits it."""
    t = tiled_tile(batch, m_rows, n_cols, skinny)
    if t == WIDE_TILE:
        return t, 1, -(-k_len // t.bk) * t.bk
    return (t, *tiled_plan(t, batch, m_rows, n_cols, k_len, target_blocks))


def _as_nt(a, b, trans_a, trans_b, stream):
    """(a, b, 0, 1) for op(a) @ op(b) as an NT product: op(a) as (B, M, K) and op(b).T as
    (B, N, K), both contiguous along K, each transposed into scratch of this call where the
    caller's layout is the other one (kernels.layout.transpose_last2: exact copies, so the
    product's sums are those of the NT kernel on the same values)."""
    if trans_a:   # a (B, K, M)
        at = backend.empty((a.shape[0], a.shape[2], a.shape[1]), np.float32, "gemm.nt_a")
        layout.transpose_last2(a, at, stream=stream)
        a = at
    if not trans_b:   # b (B, K, N)
        bt = backend.empty((b.shape[0], b.shape[2], b.shape[1]), np.float32, "gemm.nt_b")
        layout.transpose_last2(b, bt, stream=stream)
        b = bt
    return a, b, 0, 1


def tiled(a, b, out, bias, has_bias, act, accumulate, trans_a, trans_b, stream,
          target_blocks=None, keep=None, skinny=False, tile: Tiles | None = None,
          stages: int = 0, via_nt: bool = False, fold: bool = False) -> None:
    """The tiled kernel on validated 3-D arguments, K split where `tiled_launch_plan` says,
    the partials then summed in split order (deterministic) by gemm_splitk_reduce_kernels;
    with `keep` (batch, splits, M, N) written there and left for the caller instead.
    `tile`, `stages`, `via_nt`, `fold`: launch this tile shape and staging instead
    (`_make_tiled`), K split as `tiled_plan` says for the tile, the operands first
    transposed to NT where `via_nt`, the partials summed by the GEMM's own last block per
    tile where `fold` (a bench comparing them; compiled on first use)."""
    batch, m_rows, n_cols = out.shape
    k_len = a.shape[1] if trans_a else a.shape[2]
    for name, x in (("a", a), ("b", b)):   # the kernel addresses them with uint32 offsets
        if x.size >= 2**32:
            raise ValueError(f"{name}: {x.size} elements exceed the tiled GEMM's 2**32")
    if tile is None and keep is None and target_blocks is None and batch == 1:
        # (not where a caller holds the partials: it sized them by split_count)
        tuned = tuning.gemm_choice(trans_a, trans_b, m_rows, n_cols, k_len, TUNED)
        if tuned is not None:
            tile, stages, whole, via_nt, fold = tuned
            target_blocks = 1 if whole else None
    if via_nt:
        a, b, trans_a, trans_b = _as_nt(a, b, trans_a, trans_b, stream)
    if tile is None:
        t, splits, span = tiled_launch_plan(batch, m_rows, n_cols, k_len, target_blocks, skinny)
    else:
        t, (splits, span) = tile, tiled_plan(tile, batch, m_rows, n_cols, k_len, target_blocks)
    direct = splits == 1 and keep is None
    fold = fold and not direct and keep is None
    part = _partials(out, splits, direct) if keep is None else _kept(keep, splits)
    grid = (-(-n_cols // t.bn), -(-m_rows // t.bm), batch * splits)
    counters = launch_counters(grid[0] * grid[1] * batch) if fold else _NO_COUNTERS[0]
    launch(tiled_kernel(bool(trans_a), bool(trans_b), t, stages, fold), grid, t.threads,
           (backend.reshaped(a, (a.size,)), backend.reshaped(b, (b.size,)), out, bias,
            has_bias, act, accumulate, part, int(direct), np.int32(span), np.int32(k_len),
            counters), stream)
    if not direct and keep is None and not fold:
        _sum_partials(part, out, bias, has_bias, act, accumulate, stream)


def gemm(a, b, out, *, bias=None, act=None, trans_a=False, trans_b=False, accumulate=False,
         ln_out=None, stream=0, skinny=False):
    """out = act(op(a) @ op(b) + bias), with out's old value added first when `accumulate`.

    2-D: op(a) (M, K), op(b) (K, N), out (M, N), bias (N,). 3-D: a leading batch dim on
    a, b and out. `out` must not overlap `a`, `b` or `bias` (other blocks still read them
    while one writes; checked at launch).

    ln_out=(gamma, beta, eps, y): also y = layernorm(out) over each row of the result,
    gamma and beta of shape (N,), y shaped like out and overlapping nothing. Fused into the
    split-K reduction for M <= 8 and N <= LN_MAX_COLS (4096 on a GPU); otherwise `layernorm` runs
    after.

    skinny: 9..32-row products on the tiled path take a SKINNY tile instead of TILE (off by
    default until its A/B, dev.ab.ab_lstm_tiles, runs on a GPU).

    a, b, out, bias (and ln_out's arrays) of one dtype: float32, or float16 (the decode
    kernels, sums and the epilogue in float32; a 2-D product of more than DECODE_MAX_M rows,
    a prefill's, runs DECODE_MAX_M rows a launch).
    """
    dtype = _check.float_dtype("a", a)
    _check.device_array("a", a, dtype=dtype)
    _check.device_array("b", b, dtype=dtype)
    _check.device_array("out", out, dtype=dtype)
    if a.ndim not in (2, 3) or b.ndim != a.ndim or out.ndim != a.ndim:
        raise ValueError(f"a, b, out: expected all 2-D or all 3-D, got shapes "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(out.shape)}")
    if act not in ACTS:
        raise ValueError(f"act: expected one of {list(ACTS)}, got {act!r}")
    trans_a, trans_b = _check.flag("trans_a", trans_a), _check.flag("trans_b", trans_b)
    accumulate, skinny = _check.flag("accumulate", accumulate), _check.flag("skinny", skinny)
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    lead = a_shape[:-2]  # () or (B,)
    m_rows, k_len = a_shape[::-1][:2] if trans_a else a_shape[-2:]
    k_b, n_cols = b_shape[::-1][:2] if trans_b else b_shape[-2:]
    if b_shape[:-2] != lead or k_b != k_len:
        raise ValueError(f"b: expected op(b) of shape ({k_len}, *) matching op(a) "
                         f"({m_rows}, {k_len}) with batch {lead}, got b {b_shape} "
                         f"trans_b={trans_b}")
    if tuple(out.shape) != (*lead, m_rows, n_cols):
        raise ValueError(f"out: expected shape {(*lead, m_rows, n_cols)}, got {tuple(out.shape)}")
    if dtype != np.float32 and m_rows > DECODE_MAX_M and (lead or trans_a):
        raise TypeError(f"a: batched or transposed {dtype} products take at most "
                        f"{DECODE_MAX_M} rows (the decode kernels; the tiled kernels are "
                        f"float32), got {m_rows}")
    batch = lead[0] if lead else 1
    if batch > 65535:
        raise ValueError(f"a: batch {batch} exceeds the grid limit 65535")
    if bias is not None:
        _check.device_array("bias", bias, dtype=dtype, shape=(n_cols,))
    bias_arg, has_bias = _bias_arg(bias, b)
    if ln_out is not None:
        ln_out = gamma, beta, eps, y = _check.ln_out(ln_out, tuple(out.shape), dtype)
        # y is written by the last launch only: refuse an overlap before the first.
        _check.no_overlap({"y": y, "a": a, "b": b, "out": out, "bias": bias_arg,
                           "gamma": gamma, "beta": beta},
                          [("y", other) for other in ("a", "b", "out", "bias", "gamma", "beta")])
    if dtype != np.float32 and m_rows > DECODE_MAX_M:   # (a prefill's rows) 8 at a time
        for r in range(0, m_rows, DECODE_MAX_M):
            rows = slice(r, min(r + DECODE_MAX_M, m_rows))
            gemm(a[rows], b, out[rows], bias=bias, act=act, accumulate=accumulate,
                 trans_b=trans_b, stream=stream,
                 ln_out=None if ln_out is None else (gamma, beta, eps, y[rows]))
        return
    flags = (ACTS[act], int(bool(accumulate)), int(bool(trans_a)))
    a3, b3, out3 = a, b, out
    if not lead:  # every kernel takes (B, ., .) arrays
        a3, b3, out3 = (backend.reshaped(x, (1, *x.shape)) for x in (a, b, out))
    dk = pick_decode(trans_b, batch, n_cols, out.dtype) if m_rows <= DECODE_MAX_M else None
    if dk is not None:
        _decode_then_ln(dk, a3, b3, out3, bias_arg, has_bias, *flags, stream, ln_out)
        return
    tiled(a3, b3, out3, bias_arg, has_bias, *flags, int(bool(trans_b)), stream, skinny=skinny)
    if ln_out is not None:  # not fused: normalize the rows of out afterwards
        _normalize_rows(out, ln_out, stream)


def _bias_arg(bias, b) -> tuple:
    """(bias, has_bias) as the kernels take them: a bias and 1, or, where there is none, a
    placeholder never read (a view of the weight b, which no kernel writes) and 0."""
    return (bias, 1) if bias is not None else (backend.reshaped(b, (b.size,)), 0)


def _decode_then_ln(dk: Decode, a3, b3, out3, bias, has_bias, act, accumulate, trans_a,
                    stream, ln_out, **kw) -> None:
    """`decode`, with a checked ln_out = (gamma, beta, eps, y) fused into its reduction where
    the rows fit the fused layer norm (N <= LN_MAX_COLS), else normalized after."""
    fused = None
    if ln_out is not None and out3.shape[2] <= LN_MAX_COLS:
        gamma, beta, eps, y = ln_out
        fused = (gamma, beta, float(eps), backend.reshaped(y, out3.shape))
    decode(dk, a3, b3, out3, bias, has_bias, act, accumulate, trans_a, stream, fused, **kw)
    if ln_out is not None and fused is None:
        _normalize_rows(out3, ln_out, stream)


def _normalize_rows(out, ln_out, stream) -> None:
    """y = layernorm(out) over each row: `ln_out` where no reduction launch fused it."""
    from kernels import layernorm
    gamma, beta, eps, y = ln_out
    n_cols = out.shape[out.ndim - 1]   # (the simulator's shapes take no negative index)
    rows = out.size // n_cols
    layernorm.layernorm(backend.reshaped(out, (rows, n_cols)), gamma, beta,
                        backend.reshaped(y, (rows, n_cols)), eps=float(eps), stream=stream)


def _mma_takes(dtype, m_rows: int, *products) -> bool:
    """Whether the tensor-core kernel takes these (a, b) products of `dtype` and m_rows rows
    as one launch of a pair: float16, a decode's rows, each product as `mma_fits` says."""
    return (dtype == np.float16 and m_rows <= DECODE_MAX_M
            and all(mma_fits(a, b, False) for a, b in products))


def gemm_sum(a, b, a2, b2, out, *, bias=None, accumulate=False, ln_out=None,
             stream=0) -> None:
    """out = a @ b.T + a2 @ b2.T + bias, with out's old value added first when `accumulate`
    (and ln_out as `gemm`'s): two products into one output, as GPT-J's block adds its
    attention's output projection and its MLP's second product into the residual.

    2-D, the weights (N, K) as a Linear stores them: a (M, K1), b (N, K1), a2 (M, K2),
    b2 (N, K2), out (M, N), bias (N,); one dtype. `out` must not overlap the others.

    Where the tensor-core kernel takes both products (float16, M <= DECODE_MAX_M, each K a
    multiple of MMA_CHUNK, every operand 16-byte aligned) it reads both as one product over
    K1 + K2 (MMA_PAIR): one launch, its K splits over both, one reduction. GPT-J's 33 MB
    output projection as a launch of its own spends about half its time in the launch's
    ramp and tail (cuBLAS's too); riding on the MLP's 134 MB it costs its bytes. Elsewhere
    two `gemm` calls, the first into out (stored: rounded to out's dtype), the second
    adding to it with the bias."""
    dtype = _check.float_dtype("a", a)
    m_rows, k1 = _check.device_array("a", a, dtype=dtype, ndim=2).shape
    n_cols = _check.device_array("b", b, dtype=dtype, shape=(None, k1)).shape[0]
    k2 = _check.device_array("a2", a2, dtype=dtype, shape=(m_rows, None)).shape[1]
    _check.device_array("b2", b2, dtype=dtype, shape=(n_cols, k2))
    _check.device_array("out", out, dtype=dtype, shape=(m_rows, n_cols))
    accumulate = _check.flag("accumulate", accumulate)
    if bias is not None:
        _check.device_array("bias", bias, dtype=dtype, shape=(n_cols,))
    if ln_out is not None:   # (y is written last: an overlap is refused before the first launch)
        ln_out = _check.ln_out(ln_out, tuple(out.shape), dtype)
        named = {"y": ln_out[3], "a": a, "b": b, "a2": a2, "b2": b2, "out": out}
        _check.no_overlap(named, [("y", other) for other in named if other != "y"])
    a3, b3, c3, d3, out3 = (backend.reshaped(x, (1, *x.shape)) for x in (a, b, a2, b2, out))
    if not _mma_takes(dtype, m_rows, (a3, b3), (c3, d3)):
        gemm(a, b, out, trans_b=True, accumulate=accumulate, stream=stream)
        gemm(a2, b2, out, bias=bias, trans_b=True, accumulate=True, ln_out=ln_out,
             stream=stream)
        return
    _decode_then_ln(MMA_PAIR, a3, b3, out3, *_bias_arg(bias, b), ACTS[None],
                    int(accumulate), 0, stream, ln_out, second=(c3, d3))


def gemm_two_outputs(a, b, out, b2, out2, *, bias2=None, act2=None, stream=0) -> None:
    """out = a @ b.T and out2 = act2(a @ b2.T + bias2): two products of one input, as GPT-J's
    block projects its normalized rows to q, k, v (no bias) and to the MLP (bias, GELU).

    2-D, the weights (N, K) as a Linear stores them: a (M, K), b (N1, K), out (M, N1),
    b2 (N2, K), out2 (M, N2), bias2 (N2,); one dtype. Neither output may overlap the others.

    Where the tensor-core kernel takes both (float16, M <= DECODE_MAX_M, K a multiple of
    MMA_CHUNK, every operand 16-byte aligned) one launch streams both weights (MMA_OUTS: out's
    column tiles then out2's, K whole): GPT-J's 100 MB qkv and 134 MB fc_in as one launch,
    whose ramp and tail are paid once. Elsewhere two `gemm` calls (the same sums)."""
    dtype = _check.float_dtype("a", a)
    m_rows, k_len = _check.device_array("a", a, dtype=dtype, ndim=2).shape
    n1 = _check.device_array("b", b, dtype=dtype, shape=(None, k_len)).shape[0]
    n2 = _check.device_array("b2", b2, dtype=dtype, shape=(None, k_len)).shape[0]
    _check.device_array("out", out, dtype=dtype, shape=(m_rows, n1))
    _check.device_array("out2", out2, dtype=dtype, shape=(m_rows, n2))
    if act2 not in ACTS:
        raise ValueError(f"act2: expected one of {list(ACTS)}, got {act2!r}")
    if bias2 is not None:
        _check.device_array("bias2", bias2, dtype=dtype, shape=(n2,))
    # (each output is written by its own launch where there are two: refuse before the first)
    named = {"out": out, "out2": out2, "a": a, "b": b, "b2": b2}
    if bias2 is not None:
        named["bias2"] = bias2
    _check.no_overlap(named, [(o, other) for o in ("out", "out2") for other in named
                              if other != o])
    a3, b3, c3, out3, out23 = (backend.reshaped(x, (1, *x.shape)) for x in (a, b, b2, out, out2))
    if not _mma_takes(dtype, m_rows, (a3, b3), (a3, c3)):
        gemm(a, b, out, trans_b=True, stream=stream)
        gemm(a, b2, out2, bias=bias2, act=act2, trans_b=True, stream=stream)
        return
    decode(MMA_OUTS, a3, b3, out3, *_bias_arg(bias2, b2), ACTS[act2], 0, 0, stream,
           outs=(c3, out23))
