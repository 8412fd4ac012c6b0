"""GPT-J's device model (proto.models.gptj.GPTJ) against the float64 reference
(proto.models.reference.gptj_logits): float32 to float32's tolerance; float16 within a
first-order bound from one float16 rounding per stored activation; prefill + decode steps =
one long prefill; beam-search caches in float16; bad input refused before any launch."""
import numpy as np
import pytest

from proto.models import reference
from proto.models.gptj import GPTJ, GPTJConfig, random_state_dict
from proto.models.kv_cache import KVCache
from tests.helpers import dev

# (hd 16; rotary on half of each head)
SMALL = GPTJConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=30, n_positions=16,
                   rotary_dim=8)
# float32 model, float64 reference, unit-scale activations through 2 layers (as GPT-2's test)
LOGIT_TOL = dict(atol=2e-4, rtol=2e-4)
U16 = 2.0 ** -11
# float16: every activation the model stores is rounded once, relatively by at most U16:
# per layer ln_1, qkv, the rotated qkv, attention's output, the residual after the output
# projection, fc_in and the residual after fc_out (7), and the embedding, ln_f and the
# logits once. The random weights (N(0, 1/fan_in)) and the layer norms keep every
# activation unit-scale and every layer's gain about 1 (GELU's slope is at most 1.13,
# a softmax's weights sum to 1), so to first order the roundings' errors add: a logit is
# off by at most (7 L + 3) U16 of its row's scale (the logit itself, plus the row's rms for
# logits near 0), beside float32's own error (LOGIT_TOL).
ROUNDINGS = 7 * SMALL.n_layer + 3


def _sequence(seed, batch, length):
    return np.random.default_rng(seed).integers(0, SMALL.vocab_size, (batch, length))


def _run(model, seq, prompt, dtype):
    """Prefill `prompt` tokens then decode the rest one a step; every position's logits."""
    B, total = seq.shape
    cache = KVCache(SMALL, B, max_len=total + 1, dtype=dtype)   # a spare slot stays unread
    tok = lambda a: dev(np.ascontiguousarray(a, np.int32))   # noqa: E731
    out = [model.step(tok(seq[:, :prompt]), dev(np.zeros(1, np.int32)), cache).copy_to_host()]
    for t in range(prompt, total):
        out.append(model.step(tok(seq[:, t:t + 1]), dev(np.array([t], np.int32)),
                              cache).copy_to_host())
    return np.concatenate(out, axis=1)


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_float32_prefill_then_decode_matches_reference():
    sd = random_state_dict(SMALL, seed=1)
    seq = _sequence(1, 2, 5)
    model = GPTJ(SMALL, sd, max_batch=2, max_tokens=3, dtype=np.float32)
    got = _run(model, seq, 3, np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference.gptj_logits(SMALL, sd, seq), **LOGIT_TOL)


def test_float16_prefill_then_decode_within_the_rounding_bound():
    """Against the reference on the weights the model holds (rounded to float16); the
    greedy token agrees wherever the reference's top-2 margin exceeds twice the bound."""
    sd = random_state_dict(SMALL, seed=2)
    held = {k: v.astype(np.float16).astype(np.float32) for k, v in sd.items()}
    seq = _sequence(2, 2, 5)
    model = GPTJ(SMALL, sd, max_batch=2, max_tokens=3)
    assert model.dtype == np.float16
    got = _run(model, seq, 3, np.float16).astype(np.float64)
    want = reference.gptj_logits(SMALL, held, seq)
    rms = np.sqrt((want ** 2).mean(axis=-1, keepdims=True))
    bound = ROUNDINGS * U16 * (np.abs(want) + rms) + LOGIT_TOL["atol"] + \
        LOGIT_TOL["rtol"] * np.abs(want)
    err = np.abs(got - want) - bound
    assert np.all(err <= 0), float(err.max())
    top2 = np.sort(want, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * bound.max(axis=-1)
    assert clear.any()   # (the check below checks something)
    np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_float16_beam_caches_reorder_rows():
    a, b = KVCache.pair(SMALL, 2, 8, dtype=np.float16)
    assert a.data.dtype == np.float16 and a.data is b.data
    a.reorder_into(dev(np.array([1, 1], np.int32)), b, length=dev(np.array([3], np.int32)))
    assert (b.rows.copy_to_host()[:, :3] == 1).all()
    with pytest.raises(ValueError, match="same config, batch, max_len and dtype"):
        a.reorder_into(dev(np.array([0, 1], np.int32)), KVCache(SMALL, 2, 8))


def test_rejects_bad_input_before_any_launch():
    sd = random_state_dict(SMALL)
    with pytest.raises(TypeError, match="dtype: expected float32 or float16, got float64"):
        GPTJ(SMALL, sd, max_batch=1, max_tokens=1, dtype=np.float64)
    big = dict(sd, **{"lm_head.bias": np.full(SMALL.vocab_size, 1e6, np.float32)})
    with pytest.raises(ValueError, match="a weight exceeds float16's range"):
        GPTJ(SMALL, big, max_batch=1, max_tokens=1)
    model = GPTJ(SMALL, sd, max_batch=1, max_tokens=1)
    tokens, pos = dev(np.zeros((1, 1), np.int32)), dev(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="cache: expected a KVCache of this model's config, "
                                         "batch 1 and dtype float16"):
        model.step(tokens, pos, KVCache(SMALL, 1, 4))   # a float32 cache
    with pytest.raises(TypeError, match="dtype: expected float32 or float16"):
        KVCache(SMALL, 1, 4, dtype=np.int32)


TINY = GPTJConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=13, n_positions=8, rotary_dim=4)


def test_float32_beam_search_end_to_end():
    """The real GPTJ.step under generate.beam_search (a KVCache pair, reorders included)
    picks the reference search's tokens."""
    from proto.models import generate
    sd = random_state_dict(TINY, 5)
    logits_fn = lambda tokens: reference.gptj_logits(TINY, sd, tokens)  # noqa: E731
    prompt = np.array([3, 7])
    want = reference.beam(logits_fn, prompt, 2, 3)
    model = GPTJ(TINY, sd, max_batch=2, max_tokens=1, dtype=np.float32)
    got = generate.beam_search(model, prompt, beam=2, max_new_tokens=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_float16_greedy_picks_the_reference_token_wherever_the_choice_is_clear():
    """generate.greedy over the float16 model: at every step, the reference's logits on the
    prefix the model actually produced (the weights it holds) put the token it chose first
    wherever the top two differ by more than both logits' bounds (ROUNDINGS above)."""
    from proto.models import generate
    sd = {k: v.astype(np.float16).astype(np.float32)
          for k, v in random_state_dict(TINY, 6).items()}
    prompt, new = np.array([[3, 7], [1, 2]]), 5
    model = GPTJ(TINY, sd, max_batch=2, max_tokens=1)
    got = generate.greedy(model, prompt, max_new_tokens=new).tokens   # (2, 2 + new)
    ref = reference.gptj_logits(TINY, sd, got[:, :-1])[:, prompt.shape[1] - 1:]   # (2, new, V)
    rms = np.sqrt((ref ** 2).mean(axis=-1, keepdims=True))
    bound = ROUNDINGS * U16 * (np.abs(ref) + rms) + LOGIT_TOL["atol"] + \
        LOGIT_TOL["rtol"] * np.abs(ref)
    order = np.argsort(-ref, axis=-1, kind="stable")
    top, second = order[..., 0], order[..., 1]
    pick = lambda a, i: np.take_along_axis(a, i[..., None], -1)[..., 0]   # noqa: E731
    clear = pick(ref, top) - pick(ref, second) > pick(bound, top) + pick(bound, second)
    assert clear.sum() >= new   # (most decisions are clear: the check checks something)
    np.testing.assert_array_equal(got[:, prompt.shape[1]:][clear], top[clear])


def test_weights_made_on_the_device_load_without_a_host_copy():
    """random_device_state_dict's arrays are the model's own (no copy, no host round trip),
    but q, k and v, which it stacks into one weight by device-to-device copies; its laws
    are random_state_dict's (the standard deviations of a matrix and of the embedding)."""
    from proto.models.gptj import random_device_state_dict
    sd = random_device_state_dict(SMALL, seed=1)
    model = GPTJ(SMALL, sd, max_batch=1, max_tokens=1)
    assert model.wte is sd["transformer.wte.weight"] and model.head_w is sd["lm_head.weight"]
    C = SMALL.n_embd
    stacked = model.layers[1].qkv_w.copy_to_host()
    for j, n in enumerate("qkv"):
        np.testing.assert_array_equal(stacked[j * C:(j + 1) * C],
                                      sd[f"transformer.h.1.attn.{n}_proj.weight"].copy_to_host())
    fc_in = sd["transformer.h.0.mlp.fc_in.weight"].copy_to_host().astype(np.float64)
    assert abs(fc_in.std() * np.sqrt(C) - 1) < 5 * np.sqrt(2 / fc_in.size) + 2e-3
    wte = sd["transformer.wte.weight"].copy_to_host().astype(np.float64)
    assert abs(wte.std() - 1) < 5 * np.sqrt(2 / wte.size) + 2e-3
    logits = model.step(dev(np.array([[1]], np.int32)), dev(np.zeros(1, np.int32)),
                        KVCache(SMALL, 1, 2, dtype=np.float16)).copy_to_host()
    assert np.isfinite(logits).all()


def test_device_weights_are_checked_by_name_shape_and_dtype():
    from proto.models.gptj import random_device_state_dict
    sd = random_device_state_dict(SMALL, seed=1)
    with pytest.raises(TypeError, match=r"GPT-J state_dict\['transformer.wte.weight'\]: "
                                        "expected dtype float32, got float16"):
        GPTJ(SMALL, sd, max_batch=1, max_tokens=1, dtype=np.float32)
    bad = dict(sd, **{"lm_head.bias": dev(np.zeros(3, np.float16))})
    with pytest.raises(ValueError, match=r"lm_head.bias'\]: expected shape \(30,\)"):
        GPTJ(SMALL, bad, max_batch=1, max_tokens=1)
    missing = {k: v for k, v in sd.items() if k != "lm_head.bias"}
    with pytest.raises(ValueError, match="missing 1 key"):
        GPTJ(SMALL, missing, max_batch=1, max_tokens=1)
