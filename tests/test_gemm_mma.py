"""The tensor-core float16 decode kernel (kernels.gemm.make_decode_mma), one product and two
(MMA_PAIR), against float64 on the same float16 values: every epilogue, K split or whole,
rows 1..8, columns that are no multiple of its 16-column tile, batches; what `gemm` routes to
it; and that it writes nothing outside out. On the simulator the kernel runs its one-warp
geometry with kernels._mma's Python stand-ins (the fragment layout as PTX defines it); GPT-J's
full shapes run on a GPU only (gpu marker).

The bound. Each product of two float16 values is exact in float32. mma.sync adds a k-step's
16 products to the accumulator with its significands aligned to the largest and truncated,
not rounded (Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores",
2021): each addition may lose up to one float32 ulp, 2 U32 relative, where round to nearest
loses U32. So a sum of K products, then the splits, old and bias, is off by at most
2 (K + 4) U32 (sum |a||b| + |old| + |bias|): twice the SIMT kernels' bound
(tests/test_gemm.py). The activation and the one float16 rounding add what they add there.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import gemm as G
from proto.device import backend
from tests.helpers import dev, launches_of
from tests.test_gemm import U16, U32, _assert_within, _half_result, _halves

# (the simulator runs a Python thread a lane and a barrier a multiply: smaller draws there)
SIM = backend.SIMULATOR


def _bound(a, b, bias, old):
    """(float64 a @ b.T + old + bias, its bound before the activation): 2 (K + 4) U32."""
    a64, b64 = a.astype(np.float64), np.swapaxes(b.astype(np.float64), -1, -2)
    v, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    for extra in (old, bias):
        if extra is not None:
            v, mag = v + extra.astype(np.float64), mag + np.abs(extra.astype(np.float64))
    return v, 2 * (a64.shape[-1] + 4) * U32 * mag


@given(m=st.integers(1, G.DECODE_MAX_M), n=st.integers(1, 40 if SIM else 100),
       chunks=st.integers(1, 6 if SIM else 24),
       batch=st.sampled_from([1, 2]), act=st.sampled_from([None, "gelu", "relu"]),
       has_bias=st.booleans(), accumulate=st.booleans(),
       target=st.sampled_from([None, 1, 64, 4096]), seed=st.integers(0, 2**16))
def test_tensor_core_decode_matches_float64(m, n, chunks, batch, act, has_bias, accumulate,
                                            target, seed):
    """Any M <= 8, any N, K in whole chunks of 32, K split over 1 or more blocks (the
    `target` grid), every epilogue: within the bound above; out (B, M, N) all written."""
    rng = np.random.default_rng(seed)
    k = chunks * G.MMA_CHUNK
    a, b = _halves(rng, batch, m, k), _halves(rng, batch, n, k)
    old, bias = _halves(rng, batch, m, n), _halves(rng, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    bias_arg = dev(bias) if has_bias else backend.reshaped(dev(b), (b.size,))
    G.decode(G.MMA_HALF, dev(a), dev(b), out, bias_arg, int(has_bias), G.ACTS[act],
             int(accumulate), 0, 0, target_blocks=target)
    v, e = _bound(a, b, bias, old if accumulate else None)
    want, e = _half_result(v, e, act)
    got = out.copy_to_host()
    _assert_within(got, want, e + U16 * np.abs(want) + 2.0 ** -25)


@pytest.mark.parametrize("target", [None, 1, 10**6])
def test_tensor_core_plan_covers_k_in_whole_batches(target):
    """The plan's splits: spans of whole batches of loads covering K exactly, at most one
    split per warp's batch, a block per 16-column tile."""
    for n, k in [(4096, 4096), (16384, 4096), (4096, 16384), (50400, 4096), (17, 32)]:
        blocks, splits, span = G.decode_plan(G.MMA_HALF, 1, n, k, target)
        assert blocks == -(-n // 16) and span % G.MMA_HALF.k_step == 0
        assert (splits - 1) * span < k <= splits * span
        assert splits <= max(1, k // (G.MMA_HALF.k_step * G.MMA_HALF.config[1]))


def test_tensor_core_plan_keeps_k_whole_for_short_products_that_fill_the_sms(monkeypatch):
    """By default K stays whole (no reduction launch) where K <= MMA_WHOLE_K and the column
    tiles alone give each SM a block: GPT-2 small's qkv and fc (144 and 192 tiles, K 768) on
    an H100's 132 SMs; its attention projection (48 tiles) and MLP projection (K 3072) still
    split, and so does any plan given a target. (The GPU's constants: the simulator keeps
    MMA_WHOLE_K at 0, so its tiny shapes take the split path.)"""
    monkeypatch.setattr(G, "MMA_WHOLE_K", 1024)
    monkeypatch.setattr(G._check, "sm_count", lambda: 132)
    monkeypatch.setattr(G._check, "resident_blocks", lambda kernel, threads: 4 * 132)
    splits = lambda n, k, target=None: G.decode_plan(G.MMA_HALF, 1, n, k, target)[1]  # noqa
    assert splits(2304, 768) == 1 and splits(3072, 768) == 1
    assert splits(768, 768) > 1 and splits(768, 3072) > 1
    assert splits(2304, 768, target=4 * 132) > 1
    assert splits(2304, 1056) > 1   # K past MMA_WHOLE_K


def test_gemm_routes_float16_trans_b_to_tensor_cores_where_they_fit(monkeypatch):
    """float16 trans_b with K a multiple of 32 takes the tensor-core kernel; K = 40 (no whole
    chunk) and a 2-byte-offset view of b (no 16-byte loads) take the SIMT kernel; both
    right."""
    rng = np.random.default_rng(0)
    seen = launches_of(monkeypatch, G)
    for k, offset in [(64, 0), (40, 0), (64, 1)]:
        a = _halves(rng, 5, k)
        flat = _halves(rng, 24 * k + offset)
        b = flat[offset:].reshape(24, k)
        db = backend.view_at(dev(flat), 2 * offset, dev(b)) if offset else dev(b)
        out = dev(np.full((5, 24), np.nan, np.float16))
        seen.clear()
        G.gemm(dev(a), db, out, trans_b=True)
        mma = k % 32 == 0 and not offset
        assert (G.MMA_HALF.kernel in seen) == mma, (k, offset)
        v, e = _bound(a, b, None, None)
        _assert_within(out.copy_to_host(), v, e + U16 * np.abs(v) + 2.0 ** -25)


def test_tensor_core_decode_writes_nothing_past_out():
    """out as the leading rows of a larger buffer whose rest holds a pattern: a 5-row product
    over 40 columns (its 16-column tiles and 8-row fragments overhang both) leaves the
    pattern as it was."""
    rng = np.random.default_rng(1)
    m, n, k = 5, 40, 96
    a, b = _halves(rng, 1, m, k), _halves(rng, 1, n, k)
    whole = np.full((1, m + 3, n), 7.0, np.float16)
    dwhole = dev(whole)
    flat = backend.reshaped(dwhole, (whole.size,))
    out = backend.reshaped(backend.view_at(flat, 0, dev(np.zeros(m * n, np.float16))),
                           (1, m, n))
    bias_arg = backend.reshaped(dev(b), (b.size,))
    G.decode(G.MMA_HALF, dev(a), dev(b), out, bias_arg, 0, 0, 0, 0, 0)
    got = dwhole.copy_to_host()
    assert np.all(got[0, m:] == 7.0)
    v, e = _bound(a, b, None, None)
    _assert_within(got[:, :m], v, e + U16 * np.abs(v) + 2.0 ** -25)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,act,bias,accumulate", [
    (4096, 12288, None, False, False), (4096, 4096, None, False, True),
    (4096, 16384, "gelu", True, False), (16384, 4096, None, True, True),
    (4096, 50400, None, True, False)])
def test_gptj_decode_shapes_are_deterministic_and_right(k, n, act, bias, accumulate):
    """GPT-J-6B's five decode products (beam 5) through gemm: within the bound, and three
    runs bit-identical (the warps' and splits' sums in a fixed order)."""
    rng = np.random.default_rng(k + n)
    a, w, old = _halves(rng, 5, k), _halves(rng, n, k), _halves(rng, 5, n)
    bv = _halves(rng, n) if bias else None
    da, dw, db = dev(a), dev(w), None if bv is None else dev(bv)
    runs = []
    for _ in range(3):
        out = dev(old if accumulate else np.full_like(old, np.nan))
        G.gemm(da, dw, out, bias=db, act=act, trans_b=True, accumulate=accumulate)
        runs.append(out.copy_to_host())
    v, e = _bound(a, w, bv, old if accumulate else None)
    want, e = _half_result(v, e, act)
    _assert_within(runs[0], want, e + U16 * np.abs(want) + 2.0 ** -25)
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


# ---------------------------------------------------------------- two products, one launch
@given(m=st.integers(1, G.DECODE_MAX_M), n=st.integers(1, 60),
       chunks1=st.integers(1, 4 if SIM else 12), chunks2=st.integers(1, 4 if SIM else 12), has_bias=st.booleans(), accumulate=st.booleans(),
       target=st.sampled_from([None, 1, 7, 4096]), seed=st.integers(0, 2**16))
def test_pair_kernel_sums_both_products_over_one_k(m, n, chunks1, chunks2, has_bias,
                                                   accumulate, target, seed):
    """MMA_PAIR: out = a @ b.T + a2 @ b2.T (+ old, bias) over K1 + K2, its splits (the
    `target` grid: one, a few that cut K1's end, one a batch of loads) crossing from the
    first product into the second anywhere: within the bound above on K1 + K2."""
    rng = np.random.default_rng(seed)
    k1, k2 = chunks1 * G.MMA_CHUNK, chunks2 * G.MMA_CHUNK
    a, b = _halves(rng, 1, m, k1), _halves(rng, 1, n, k1)
    a2, b2 = _halves(rng, 1, m, k2), _halves(rng, 1, n, k2)
    old, bias = _halves(rng, 1, m, n), _halves(rng, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    bias_arg = dev(bias) if has_bias else backend.reshaped(dev(b), (b.size,))
    G.decode(G.MMA_PAIR, dev(a), dev(b), out, bias_arg, int(has_bias), 0, int(accumulate),
             0, 0, target_blocks=target, second=(dev(a2), dev(b2)))
    v, e = _bound(np.concatenate([a, a2], -1), np.concatenate([b, b2], -1), bias,
                  old if accumulate else None)
    _assert_within(out.copy_to_host(), v, e + U16 * np.abs(v) + 2.0 ** -25)


@pytest.mark.gpu
def test_gptj_residual_products_are_one_launch_deterministic_and_right(monkeypatch):
    """GPT-J-6B's attention projection (4096 -> 4096) and fc_out (16384 -> 4096), beam 5,
    through gemm_sum with the bias, the residual and the next layer norm: one tensor-core
    launch reads both weights (then the split-K reduction and the layer norm); within the
    bound on K = 20480; y the layer norm of the stored rows; three runs bit-identical."""
    from kernels.layernorm import layernorm_ref
    rng = np.random.default_rng(7)
    seen = launches_of(monkeypatch, G)
    att, w_out = _halves(rng, 5, 4096), (0.02 * _halves(rng, 4096, 4096)).astype(np.float16)
    h, w_fc = _halves(rng, 5, 16384), (0.02 * _halves(rng, 4096, 16384)).astype(np.float16)
    old, bias = _halves(rng, 5, 4096), _halves(rng, 4096)
    gamma, beta = _halves(rng, 4096), _halves(rng, 4096)
    ops = [dev(x) for x in (att, w_out, h, w_fc)]
    runs = []
    for _ in range(3):
        out, y = dev(old), dev(np.full((5, 4096), np.nan, np.float16))
        seen.clear()
        G.gemm_sum(*ops, out, bias=dev(bias), accumulate=True,
                   ln_out=(dev(gamma), dev(beta), 1e-5, y))
        assert seen.count(G.MMA_PAIR.kernel) == 1 and G.MMA_HALF.kernel not in seen
        runs.append((out.copy_to_host(), y.copy_to_host()))
    v, e = _bound(np.concatenate([att, h], -1)[None], np.concatenate([w_out, w_fc], -1)[None],
                  bias, old[None])
    _assert_within(runs[0][0][None], v, e + U16 * np.abs(v) + 2.0 ** -25)
    # (y normalizes the stored float16 rows: float32 statistics, one float16 rounding)
    want_y = layernorm_ref(runs[0][0].astype(np.float64), gamma.astype(np.float64),
                           beta.astype(np.float64))
    np.testing.assert_allclose(runs[0][1], want_y, rtol=4 * U16, atol=4 * U16)
    for out_r, y_r in runs[1:]:
        np.testing.assert_array_equal(out_r, runs[0][0])
        np.testing.assert_array_equal(y_r, runs[0][1])


def test_gptj_block_launches_each_pair_once_a_layer(monkeypatch):
    """A float16 GPT-J decode step: every layer's qkv and fc_in are one MMA_OUTS launch, its
    attention projection and fc_out one MMA_PAIR launch (the model's operands are 16-byte
    aligned, K a multiple of 32); the head is the one plain product."""
    from proto.models.gptj import GPTJ, GPTJConfig, random_state_dict
    from proto.models.kv_cache import KVCache
    config = GPTJConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=16,
                        rotary_dim=8)
    model = GPTJ(config, random_state_dict(config, seed=1), max_batch=2, max_tokens=1)
    cache = KVCache(config, batch=2, max_len=8, dtype=model.dtype)
    seen = launches_of(monkeypatch, G)
    model.step(dev(np.array([[1], [2]], np.int32)), dev(np.zeros(1, np.int32)), cache)
    assert seen.count(G.MMA_PAIR.kernel) == seen.count(G.MMA_OUTS.kernel) == config.n_layer
    assert seen.count(G.MMA_HALF.kernel) == 1


@pytest.mark.gpu
def test_gptj_projections_of_ln_are_one_launch_deterministic_and_right(monkeypatch):
    """GPT-J-6B's qkv (4096 -> 12288) and fc_in (4096 -> 16384, bias, GELU), beam 5, through
    gemm_two_outputs: one MMA_OUTS launch; each output within its product's bound; three
    runs bit-identical."""
    rng = np.random.default_rng(8)
    seen = launches_of(monkeypatch, G)
    x = _halves(rng, 5, 4096)
    w_qkv = (0.02 * _halves(rng, 12288, 4096)).astype(np.float16)
    w_fc, bias = (0.02 * _halves(rng, 16384, 4096)).astype(np.float16), _halves(rng, 16384)
    ops = [dev(v) for v in (x, w_qkv, w_fc, bias)]
    runs = []
    for _ in range(3):
        qkv, h = dev(np.full((5, 12288), np.nan, np.float16)), dev(np.full((5, 16384), np.nan,
                                                                           np.float16))
        seen.clear()
        G.gemm_two_outputs(ops[0], ops[1], qkv, ops[2], h, bias2=ops[3], act2="gelu")
        assert seen == [G.MMA_OUTS.kernel]
        runs.append((qkv.copy_to_host(), h.copy_to_host()))
    for got, w, b, act in ((runs[0][0], w_qkv, None, None), (runs[0][1], w_fc, bias, "gelu")):
        v, e = _bound(x[None], w[None], b, None)
        want, e = _half_result(v, e, act)
        _assert_within(got[None], want, e + U16 * np.abs(want) + 2.0 ** -25)
    for qkv_r, h_r in runs[1:]:
        np.testing.assert_array_equal(qkv_r, runs[0][0])
        np.testing.assert_array_equal(h_r, runs[0][1])
