"""GPT-J's float64 reference (proto.models.reference.gptj_logits) and its rotary embedding:
the rotary against its definition and its defining property (scores depend on relative
position only), the configuration and weight checks, and the whole model against
transformers' GPTJForCausalLM at a small configuration of the same architecture (where
PyTorch and transformers are installed: the GPU machine's lane)."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto.models import reference
from proto.models.gptj import GPTJConfig, load_state_dict, random_state_dict, rotary

SMALL = GPTJConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=32, rotary_dim=8)


def test_rotary_turns_the_first_pair_by_the_position_in_radians():
    """Pair 0's frequency is 10000^0 = 1: position p multiplies x0 + i x1 by e^(i p)."""
    x = np.zeros((1, 16))
    x[0, :2] = [0.6, -0.8]
    for p in (0, 1, 5):
        z = complex(0.6, -0.8) * complex(math.cos(p), math.sin(p))
        np.testing.assert_allclose(rotary(x, [p], 8)[0, :2], [z.real, z.imag], atol=1e-15)


@given(seed=st.integers(0, 2**16), shift=st.integers(-50, 50), rot=st.sampled_from([2, 8, 16]))
def test_rotary_scores_depend_only_on_relative_position(seed, shift, rot):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, 16))
    p, p2 = rng.integers(60, 200, 2)
    before = rotary(q, [p], rot) @ rotary(k, [p2], rot).T
    after = rotary(q, [p + shift], rot) @ rotary(k, [p2 + shift], rot).T
    np.testing.assert_allclose(after, before, rtol=1e-9, atol=1e-9)
    x = rotary(q, [p], rot)[0]
    pairs = lambda v: np.hypot(v[:rot:2], v[1:rot:2])      # each pair keeps its length
    np.testing.assert_allclose(pairs(x), pairs(q[0]), rtol=1e-12)
    np.testing.assert_array_equal(x[rot:], q[0, rot:])      # past rotary_dim: untouched


def test_config_and_weights_are_checked():
    with pytest.raises(ValueError, match="rotary_dim"):
        GPTJConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=9, n_positions=8, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim"):
        GPTJConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=9, n_positions=8, rotary_dim=18)
    sd = random_state_dict(SMALL)
    bad = dict(sd, **{"lm_head.bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="lm_head.bias.*shape"):
        load_state_dict(SMALL, bad)
    with pytest.raises(ValueError, match="missing"):
        load_state_dict(SMALL, {k: v for k, v in sd.items() if "q_proj" not in k})


def test_the_reference_is_causal_and_uses_the_head_bias():
    sd = random_state_dict(SMALL, seed=1)
    tokens = np.random.default_rng(2).integers(0, SMALL.vocab_size, (2, 6))
    full = reference.gptj_logits(SMALL, sd, tokens)
    np.testing.assert_allclose(reference.gptj_logits(SMALL, sd, tokens[:, :4]), full[:, :4],
                               rtol=1e-12, atol=1e-12)   # later tokens change nothing before
    no_bias = dict(sd, **{"lm_head.bias": np.zeros_like(sd["lm_head.bias"])})
    np.testing.assert_allclose(full - reference.gptj_logits(SMALL, no_bias, tokens),
                               np.broadcast_to(sd["lm_head.bias"], full.shape), atol=1e-9)


def test_the_reference_matches_transformers_gptj():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTJConfig(vocab_size=SMALL.vocab_size, n_positions=SMALL.n_positions,
                                  n_embd=SMALL.n_embd, n_layer=SMALL.n_layer,
                                  n_head=SMALL.n_head, rotary_dim=SMALL.rotary_dim,
                                  activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                  attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPTJForCausalLM(cfg).eval()
    sd = random_state_dict(SMALL, seed=3)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()},
                                                strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in missing)
    tokens = np.random.default_rng(4).integers(0, SMALL.vocab_size, (2, 12))
    with torch.no_grad():
        got = model(torch.from_numpy(tokens)).logits.double().numpy()
    want = reference.gptj_logits(SMALL, sd, tokens)
    # float32 sums of at most 4 * 64 terms against float64: 1e-4 of the logits' scale
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
