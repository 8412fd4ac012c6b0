"""Greedy generation as one graph (proto.models.greedy_loop): the device-side bookkeeping
kernel against its NumPy reference, and whole generations against the host loop
(generate.greedy), on the stand-in decoder and on the real GPT-2."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import sampling
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.greedy_loop import GreedyLoop
from tests.helpers import dev
from tests.test_graphed_models import HistoryDecoder, small_configs


@given(B=st.integers(1, 5), t=st.integers(0, 6), limit=st.integers(1, 8),
       eos=st.integers(-1, 3), seed=st.integers(0, 2**16))
def test_greedy_advance_matches_reference(B, t, limit, eos, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, (B, 1)).astype(np.int32)
    done = rng.integers(0, 2, B).astype(np.int32)
    state = np.array([t, limit, eos], np.int32)
    d_tokens, d_pos, d_out = dev(tokens), dev(np.array([7], np.int32)), dev(np.zeros((B, 8), np.int32))
    d_done, d_state, d_flag = dev(done), dev(state), dev(np.array([9], np.int32))
    sampling.greedy_advance(d_tokens, d_pos, d_out, d_done, d_state, d_flag)
    emitted, want_done, steps, go = sampling.greedy_advance_ref(tokens[:, 0], done, state)
    np.testing.assert_array_equal(d_out.copy_to_host()[:, t], emitted)
    np.testing.assert_array_equal(d_done.copy_to_host(), want_done)
    assert d_state.copy_to_host().tolist() == [steps, limit, eos]
    assert d_pos.copy_to_host()[0] == 8 and d_flag.copy_to_host()[0] == int(go)
    np.testing.assert_array_equal(d_tokens.copy_to_host(), tokens)   # fed back unchanged


@given(config=small_configs(), batch=st.integers(1, 3), prompt_len=st.integers(1, 3),
       new=st.integers(1, 4), seed=st.integers(0, 2**16), use_eos=st.booleans())
def test_one_graph_generates_what_the_host_loop_does(config, batch, prompt_len, new, seed, use_eos):
    model = HistoryDecoder(config, batch, config.n_positions)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
    plain = generate.greedy(model, prompt, max_new_tokens=new)
    # An EOS the run really produces (its first generated token in row 0) stops it early.
    eos = int(plain.tokens[0, prompt_len]) if use_eos else None
    with GreedyLoop(model, batch=batch, max_len=config.n_positions) as loop:
        for budget in (new, 1):   # one graph, several runs with their own budget
            want = generate.greedy(model, prompt, max_new_tokens=budget, eos=eos)
            got = loop.generate(prompt, max_new_tokens=budget, eos=eos)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.times.steps == want.times.steps


def test_real_gpt2_in_one_graph_matches_eager_greedy():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    model = GPT2(config, random_state_dict(config, seed=3), max_batch=2, max_tokens=8)
    prompt = np.array([[1, 5], [7, 2]], np.int32)
    want = generate.greedy(model, prompt, max_new_tokens=3)
    with GreedyLoop(model, batch=2, max_len=8) as loop:
        np.testing.assert_array_equal(loop.generate(prompt, max_new_tokens=3).tokens, want.tokens)


def test_bad_runs_are_refused_before_any_launch():
    config = GPT2Config(n_layer=1, n_embd=2, n_head=1, vocab_size=11, n_positions=8)
    with GreedyLoop(HistoryDecoder(config, 2, 8), batch=2, max_len=5) as loop:
        with pytest.raises(ValueError, match="expected 2 rows"):
            loop.generate(np.zeros((3, 2), np.int32), max_new_tokens=2)
        with pytest.raises(ValueError, match="exceeds max_len=5"):
            loop.generate(np.zeros((2, 3), np.int32), max_new_tokens=4)
        with pytest.raises(ValueError, match="eos: expected an id"):
            loop.generate(np.zeros((2, 1), np.int32), max_new_tokens=2, eos=11)
