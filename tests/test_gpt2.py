"""GPT-2 decoder on the kernels against the NumPy float64 reference (proto.models.reference)."""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from proto.device import backend
from proto.device.backend import cuda
from proto.models import reference
from proto.models.gpt2 import GPT2, GPT2Config, KVCache, load_state_dict, random_state_dict
from tests.helpers import dev, split_counts

# float32 model, float64 reference, unit-scale activations through <= 2 layers: errors seen
# are ~1e-5 of logits of size ~sqrt(n_embd); this leaves 10x room.
LOGIT_TOL = dict(atol=2e-4, rtol=2e-4)


@st.composite
def gpt2_configs(draw, heads=(1, 2, 4)):
    """Tiny configs: 1-2 layers, n_embd 8..32 split into `heads`; vocab 11..50."""
    n_head = draw(st.sampled_from(heads))
    head_dim = draw(st.integers(-(-8 // n_head), 32 // n_head))
    return GPT2Config(n_layer=draw(st.integers(1, 2)), n_embd=n_head * head_dim,
                      n_head=n_head, vocab_size=draw(st.integers(11, 50)), n_positions=16)


def tokens_dev(tokens: np.ndarray):
    return dev(np.asarray(tokens, np.int32))


def pos_dev(p: int):
    return dev(np.array([p], np.int32))


# A simulated step of the smallest model takes ~1.5 s, and attention's cost grows with
# B * H * T blocks: few examples, at most 2 heads (kernels/attention's own tests cover more).
@settings(max_examples=3)
@example(config=GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=11, n_positions=16),
         batch=1, prompt_len=2, decode=1, seed=7)  # the drawn ones may all have one layer
@example(config=GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=11, n_positions=16),
         batch=2, prompt_len=1, decode=2, seed=3)  # the fused MLP (kernels.mlp.fuses), whose
                                                   # sum normalizes for ln_1 and then ln_f
@given(config=gpt2_configs(heads=(1, 2)), batch=st.integers(1, 2), prompt_len=st.integers(1, 3),
       decode=st.integers(1, 2), seed=st.integers(0, 2**16))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_prefill_then_decode_matches_reference(config, batch, prompt_len, decode, seed):
    """Prefill logits at every position, then each decode step's logits, equal the reference
    forward of the whole prefix: prefill + decode steps = one long prefill."""
    sd = random_state_dict(config, seed)
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, config.vocab_size, (batch, prompt_len + decode))
    want = reference.gpt2_logits(config, sd, seq)  # (B, T0 + n, V)
    model = GPT2(config, sd, max_batch=batch, max_tokens=prompt_len)
    cache = KVCache(config, batch, max_len=prompt_len + decode + 1)  # a spare slot stays unread
    logits = model.step(tokens_dev(seq[:, :prompt_len]), pos_dev(0), cache)
    np.testing.assert_allclose(logits.copy_to_host(), want[:, :prompt_len], **LOGIT_TOL)
    for t in range(prompt_len, prompt_len + decode):
        logits = model.step(tokens_dev(seq[:, t:t + 1]), pos_dev(t), cache)
        np.testing.assert_allclose(logits.copy_to_host()[:, 0], want[:, t], **LOGIT_TOL)


# float16: every activation the half-precision step stores is rounded once, relatively by at
# most U16: per layer ln_1, qkv, attention's output, the residual after the projection, ln_2,
# the MLP's hidden (after GELU) and the residual after it (7), and the embedding, ln_f and
# the logits once. Random weights and layer norms keep activations unit-scale and each
# layer's gain about 1, so to first order the roundings' errors add: a logit is off by at
# most (7 L + 3) U16 of its row's scale, beside float32's own error (LOGIT_TOL).
U16 = 2.0 ** -11
HALF = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=30, n_positions=16)


def test_float16_prefill_then_decode_within_the_rounding_bound():
    """Against the reference on the weights the model holds (rounded to float16); a prefill
    of 2 x 5 = 10 rows (more than the half-precision GEMMs take a launch) then two decode
    steps; the greedy token agrees wherever the reference's top-2 margin exceeds twice the
    bound."""
    sd = random_state_dict(HALF, seed=5)
    held = {k: v.astype(np.float16).astype(np.float32) for k, v in sd.items()}
    seq = np.random.default_rng(5).integers(0, HALF.vocab_size, (2, 7))
    model = GPT2(HALF, sd, max_batch=2, max_tokens=5, dtype=np.float16)
    cache = KVCache(HALF, 2, max_len=8, dtype=np.float16)
    out = [model.step(tokens_dev(seq[:, :5]), pos_dev(0), cache).copy_to_host()]
    for t in (5, 6):
        out.append(model.step(tokens_dev(seq[:, t:t + 1]), pos_dev(t), cache).copy_to_host())
    got = np.concatenate(out, axis=1)
    assert got.dtype == np.float16
    want = reference.gpt2_logits(HALF, held, seq)
    rms = np.sqrt((want ** 2).mean(axis=-1, keepdims=True))
    bound = (7 * HALF.n_layer + 3) * U16 * (np.abs(want) + rms) + LOGIT_TOL["atol"] + \
        LOGIT_TOL["rtol"] * np.abs(want)
    err = np.abs(got.astype(np.float64) - want) - bound
    assert np.all(err <= 0), float(err.max())
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * bound.max(axis=-1)
    assert clear.any()   # (the check below checks something)
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    with pytest.raises(ValueError, match="dtype"):   # a float32 cache for a float16 model
        model.step(tokens_dev(seq[:, :1]), pos_dev(0), KVCache(HALF, 2, max_len=8))


def test_float16_decode_products_are_trans_b_on_tensor_cores(monkeypatch):
    """In half precision every product of a decode step reads its weight (out, in): the
    trans_b kernel, the tensor-core one (gemm.make_decode_mma); the [K, N] decode kernels
    are SIMT only."""
    from kernels import gemm
    seen, real = [], gemm.decode
    monkeypatch.setattr(gemm, "decode", lambda dk, a, b, *rest, **kw: (
        seen.append((dk, gemm.mma_fits(a, b, rest[5]))), real(dk, a, b, *rest, **kw))[1])
    model = GPT2(HALF, random_state_dict(HALF, seed=2), max_batch=2, max_tokens=1,
                 dtype=np.float16)
    cache = KVCache(HALF, 2, max_len=4, dtype=np.float16)
    model.step(tokens_dev(np.array([[1], [2]])), pos_dev(0), cache)
    assert len(seen) == 4 * HALF.n_layer + 1   # qkv, projection, fc, MLP projection; head
    assert all(dk is gemm.MMA_HALF and fits for dk, fits in seen)


@pytest.mark.parametrize("most", [False, True], ids=["planned", "most_partials"])
def test_decode_sums_qkvs_partials_in_attention(most, monkeypatch):
    """Decode on the tile kernel: qkv's projection writes its K-split partials and attention
    sums them with the bias (the planned count, and the most the tile takes); the logits
    equal the reference's. (The whole-qkv path: tests/test_self_attention.py, tile=False.)"""
    from kernels import attention, gemm
    # (K must span two batches of the split kernel's loads: 8 rows simulated, 64 on a GPU)
    C, H = (32, 2) if backend.SIMULATOR else (128, 4)   # (head dims of 16 and 32: the tile's)
    config = GPT2Config(n_layer=1, n_embd=C, n_head=H, vocab_size=11, n_positions=8)
    if most:
        parts = max(s for s in split_counts(C, gemm.NN.k_step, gemm.SPAN_MAX)
                    if s <= attention.MAX_PARTS)
        monkeypatch.setattr(gemm, "partial_splits", lambda n, k: parts)   # (self_attention's)
    else:
        parts = gemm.partial_splits(3 * C, C)
    sd = random_state_dict(config, 5)
    seq = np.array([[3, 7, 1], [2, 9, 4]])
    want = reference.gpt2_logits(config, sd, seq)
    seen = []
    real = attention.attention
    monkeypatch.setattr(attention, "attention",
                        lambda qkv, *a, **k: seen.append(qkv.shape) or real(qkv, *a, **k))
    model = GPT2(config, sd, max_batch=2, max_tokens=2)
    cache = KVCache(config, 2, 4)
    model.step(tokens_dev(seq[:, :2]), pos_dev(0), cache)
    seen.clear()
    logits = model.step(tokens_dev(seq[:, 2:]), pos_dev(2), cache)
    np.testing.assert_allclose(logits.copy_to_host()[:, 0], want[:, 2], **LOGIT_TOL)
    assert seen == [(parts, 2, 1, 3 * C)]
    assert not most or parts > 1


def test_rows_too_wide_for_the_embeddings_layer_norm(monkeypatch):
    """Where the embedding cannot normalize its rows (wider than its registers hold), the
    first ln_1 is a layer norm launch of its own: the same logits. Simulated by refusing."""
    from kernels import embedding
    config = GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    sd = random_state_dict(config, 4)
    monkeypatch.setattr(embedding, "fuses_layernorm", lambda width: False)
    model = GPT2(config, sd, max_batch=1, max_tokens=2)
    logits = model.step(tokens_dev([[3, 7]]), pos_dev(0), KVCache(config, 1, 4))
    want = reference.gpt2_logits(config, sd, [[3, 7]])
    np.testing.assert_allclose(logits.copy_to_host(), want, **LOGIT_TOL)


def _address(array) -> int:
    return array.ctypes.data if backend.SIMULATOR else array.device_ctypes_pointer.value


def test_warm_step_allocates_nothing(monkeypatch):
    """After a warm-up (kernels may cache workspaces on first use), a step allocates no device
    memory and returns the same buffer: what a graph capture of `step` relies on."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=11, n_positions=8)
    sd = random_state_dict(config, 1)
    model = GPT2(config, sd, max_batch=1, max_tokens=1)
    cache = KVCache(config, 1, 4)
    tokens, pos = tokens_dev([[4]]), pos_dev(1)
    first = model.step(tokens_dev([[1]]), pos_dev(0), cache)

    def refuse(*args, **kwargs):
        raise AssertionError("device allocation inside GPT2.step")
    for name in ("device_array", "device_array_like", "to_device", "pinned_array",
                 "mapped_array", "managed_array"):
        monkeypatch.setattr(cuda, name, refuse, raising=False)
    second = model.step(tokens, pos, cache)
    monkeypatch.undo()
    assert _address(first) == _address(second)
    want = reference.gpt2_logits(config, sd, [[1, 4]])
    np.testing.assert_allclose(second.copy_to_host()[0], want[0, 1:], **LOGIT_TOL)


def test_warm_steps_launch_with_the_same_array_objects(monkeypatch):
    """Every launch of a warm eager step gets the very array objects the previous step's same
    launch got: byte ranges, argument checks and (on a GPU) flat parameters are remembered per
    array object, so a new view at every step would redo them all (and cost Numba's array
    construction on a GPU)."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = GPT2(config, random_state_dict(config, 2), max_batch=2, max_tokens=1)
    cache = KVCache(config, 2, 6)
    tokens = tokens_dev([[1], [2]])
    seen, check = [], backend.check_writes

    def record(kernel, args):   # every launch passes through the overlap check
        seen.append([a for a in args if backend.is_device_array(a)])
        check(kernel, args)

    model.step(tokens, pos_dev(0), cache)   # first use: buffers and views made
    monkeypatch.setattr(backend, "check_writes", record)
    steps, positions = [], [pos_dev(1), pos_dev(2)]   # the caller's, new at each step here
    for pos in positions:
        seen = []
        model.step(tokens, pos, cache)
        steps.append(seen)
    monkeypatch.undo()
    assert len(steps[0]) == len(steps[1]) > 0
    for i, (a, b) in enumerate(zip(*steps)):
        fresh = [j for j, (x, y) in enumerate(zip(a, b))
                 if x is not y and not (x is positions[0] and y is positions[1])]
        assert not fresh, f"launch {i}: arguments {fresh} are new array objects at every step"


def test_cache_reorder_moves_whole_beams():
    config = GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    src, dst = KVCache(config, 3, 5), KVCache(config, 3, 5)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(a.shape).astype(np.float32) for a in src.arrays()]
    for a, h in zip(src.arrays(), host):
        a.copy_to_device(h)
    index = np.array([2, 2, 0], np.int32)
    src.reorder_into(dev(index), dst)
    for a, h in zip(dst.arrays(), host):
        np.testing.assert_array_equal(a.copy_to_host(), h[index])
    with pytest.raises(ValueError, match="another KVCache"):
        src.reorder_into(dev(index), src)
    with pytest.raises(ValueError, match="same config"):
        src.reorder_into(dev(index), KVCache(config, 2, 5))


def test_loading_rejects_bad_state_dict():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    sd = random_state_dict(config, 0)
    load_state_dict(config, {**sd, "lm_head.weight": sd["transformer.wte.weight"],
                             "transformer.h.0.attn.bias": np.ones((1, 1, 8, 8))})  # HF extras
    missing = {k: v for k, v in sd.items() if k != "transformer.h.0.mlp.c_fc.bias"}
    with pytest.raises(ValueError, match=r"missing 1 key.*mlp\.c_fc\.bias"):
        GPT2(config, missing, max_batch=1, max_tokens=1)
    misshaped = {**sd, "transformer.h.0.attn.c_attn.weight": np.zeros((24, 8), np.float32)}
    with pytest.raises(ValueError, match=r"c_attn\.weight.*expected shape \(8, 24\), got \(24, 8\)"):
        load_state_dict(config, misshaped)
    with pytest.raises(ValueError, match=r"unexpected.*transformer\.h\.1\.ln_1\.weight"):
        load_state_dict(config, {**sd, "transformer.h.1.ln_1.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="tied"):
        load_state_dict(config, {**sd, "lm_head.weight": np.zeros((11, 8), np.float32)})
    with pytest.raises(ValueError, match="n_head"):
        GPT2Config(n_layer=1, n_embd=10, n_head=4, vocab_size=11, n_positions=8)


def test_step_rejects_bad_input_before_launch():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = GPT2(config, random_state_dict(config, 0), max_batch=2, max_tokens=2)
    cache = KVCache(config, 2, 4)
    with pytest.raises(TypeError, match="tokens: expected a device array"):
        model.step(np.zeros((2, 1), np.int32), pos_dev(0), cache)
    with pytest.raises(TypeError, match="tokens: expected dtype int32"):
        model.step(dev(np.zeros((2, 1), np.int64)), pos_dev(0), cache)
    with pytest.raises(ValueError, match=r"new tokens.*at most 2"):
        model.step(tokens_dev(np.zeros((2, 3))), pos_dev(0), cache)
    with pytest.raises(ValueError, match="pos: expected shape"):
        model.step(tokens_dev(np.zeros((2, 1))), dev(np.zeros(2, np.int32)), cache)
    with pytest.raises(ValueError, match="cache: expected a KVCache .* batch 1"):
        model.step(tokens_dev(np.zeros((1, 1))), pos_dev(0), cache)
