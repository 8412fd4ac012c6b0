"""Whole generations as one graph (proto.models.search_loop): the device-side search kernels
against their NumPy references, and greedy and beam generations against the host loops
(generate.greedy, generate.beam_search), on the stand-in decoder and on the real GPT-2."""
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from kernels import sampling
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.gptj import GPTJ, GPTJConfig, random_state_dict as gptj_weights
from proto.models.kv_cache import KVCache
from proto.models.search_loop import BeamLoop, GreedyLoop
from tests.helpers import dev
from tests.test_graphed_models import HistoryDecoder, small_configs


@example(B=37, t=2, limit=8, eos=1, seed=5)   # more sequences than the block's threads
@example(B=33, t=0, limit=8, eos=3, seed=0)
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


@pytest.mark.parametrize("last_token, go", [(1, 0), (2, 1)])
def test_greedy_advance_sees_a_live_sequence_past_the_first_threads(last_token, go):
    """40 sequences, every one done but the last (beyond the block's first 32 threads): the
    loop goes on exactly when the last one did not just produce eos (1)."""
    B = 40
    tokens = np.full((B, 1), 2, np.int32)
    tokens[-1] = last_token
    done = np.ones(B, np.int32)
    done[-1] = 0
    d = dict(tokens=dev(tokens), pos=dev(np.array([3], np.int32)), out=dev(np.zeros((B, 4), np.int32)),
             done=dev(done), state=dev(np.array([1, 4, 1], np.int32)), flag=dev(np.array([9], np.int32)))
    sampling.greedy_advance(*(d[n] for n in ("tokens", "pos", "out", "done", "state", "flag")))
    assert d["flag"].copy_to_host()[0] == go
    assert d["out"].copy_to_host()[:, 1].tolist() == [1] * (B - 1) + [last_token]
    assert d["done"].copy_to_host()[-1] == 1 - go


@given(config=small_configs(), batch=st.integers(1, 3), prompt_len=st.integers(1, 3),
       new=st.integers(1, 4), seed=st.integers(0, 2**16), use_eos=st.booleans())
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
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


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
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


@given(beam=st.integers(1, 5), vocab=st.integers(4, 9), t=st.integers(0, 5), limit=st.integers(1, 7),
       eos=st.integers(-1, 3), best=st.sampled_from([-np.inf, -3.0, -1.0]), seed=st.integers(0, 2**16),
       floor=st.sampled_from([-1e30, -2.0]))
def test_beam_advance_matches_reference(beam, vocab, t, limit, eos, best, seed, floor):
    rng = np.random.default_rng(seed)
    k = generate.topk_width(beam)
    length, cap = 3 + t, 12
    # top-k candidates as sampling.topk gives them: scores descending, distinct (beam, token)
    indices = rng.choice(beam * vocab, size=k, replace=False).astype(np.int32)
    values = np.sort(rng.uniform(-4, 0, k).astype(np.float32))[::-1].copy()
    hist = rng.integers(0, vocab, (beam, cap)).astype(np.int32)
    state = np.array([t, limit, eos, length, beam], np.int32)
    d = {name: dev(a) for name, a in dict(
        values=values[None], indices=indices[None], scores=np.zeros((beam, 1), np.float32),
        tokens=np.zeros((beam, 1), np.int32), parents=np.zeros(beam, np.int32), hist_src=hist,
        hist_dst=np.zeros_like(hist), best=np.array([best], np.float32),
        best_hist=np.full(cap, -7, np.int32), best_meta=np.array([5, 5, 2], np.int32),
        state=state, pos=np.array([9], np.int32), flag=np.array([7], np.int32),
        bad=np.array([0], np.int32)).items()}
    sampling.beam_advance(d["values"], d["indices"], vocab, d["scores"], d["tokens"], d["parents"],
                          d["hist_src"], d["hist_dst"], d["best"], d["best_hist"], d["best_meta"],
                          d["state"], d["pos"], d["flag"], floor=floor, bad=d["bad"])
    # the candidates' check (check_scores's rule) rides in the same launch
    assert bool(d["bad"].copy_to_host()[0]) == sampling.check_scores_ref(values, floor)
    parents, tokens, scores, live, new_best, src, go = sampling.beam_choose_ref(
        values, indices, vocab, beam, state, np.float32(best))
    np.testing.assert_array_equal(d["parents"].copy_to_host(), parents)
    np.testing.assert_array_equal(d["tokens"].copy_to_host()[:, 0], tokens)
    np.testing.assert_array_equal(d["scores"].copy_to_host()[:, 0], scores)
    assert d["state"].copy_to_host().tolist() == [t + 1, limit, eos, length + 1, live]
    assert d["best"].copy_to_host()[0] == new_best and d["flag"].copy_to_host()[0] == int(go)
    assert d["pos"].copy_to_host()[0] == 10
    got_hist = d["hist_dst"].copy_to_host()
    for j in range(beam):
        np.testing.assert_array_equal(got_hist[j, :length], hist[parents[j], :length])
        assert got_hist[j, length] == tokens[j]
    meta, best_hist = d["best_meta"].copy_to_host(), d["best_hist"].copy_to_host()
    if src is None:
        assert meta[0] == -1 and (best_hist == -7).all()
    else:
        assert meta.tolist() == [src[0], src[1], length + 1]
        np.testing.assert_array_equal(best_hist[:length + 1], list(hist[src[0], :length]) + [src[1]])


@given(config=small_configs(), beam=st.integers(1, 3), prompt_len=st.integers(1, 3),
       new=st.integers(1, 4), seed=st.integers(0, 2**16), eos_pick=st.integers(-1, 2))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_one_graph_beam_search_is_the_host_search(config, beam, prompt_len, new, seed, eos_pick):
    model = HistoryDecoder(config, beam, config.n_positions)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, prompt_len).astype(np.int32)
    plain = generate.beam_search(model, prompt, beam=beam, max_new_tokens=new)
    # eos: none, or a token of the plain result (so some hypotheses finish early)
    eos = None if eos_pick < 0 or len(plain.tokens) <= prompt_len + eos_pick \
        else int(plain.tokens[prompt_len + eos_pick])
    with BeamLoop(model, beam=beam, max_len=config.n_positions) as loop:
        for budget in (new, 1):
            want = generate.beam_search(model, prompt, beam=beam, max_new_tokens=budget, eos=eos)
            got = loop.generate(prompt, max_new_tokens=budget, eos=eos)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.score == want.score and got.times.steps == want.times.steps


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_real_gpt2_beam_search_in_one_graph_matches_eager():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    model = GPT2(config, random_state_dict(config, seed=4), max_batch=3, max_tokens=8)
    prompt = np.array([3, 1], np.int32)
    want = generate.beam_search(model, prompt, beam=3, max_new_tokens=3)
    with BeamLoop(model, beam=3, max_len=8) as loop:
        got = loop.generate(prompt, max_new_tokens=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    # The WHILE graph reads the cache through the beams' row table (attention's row-table
    # kernel), the eager search moves the cache (the plain kernel): the same sums in
    # another order, so the score agrees to float32 rounding, not bit for bit.
    assert got.score == pytest.approx(want.score, rel=1e-5)


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_real_gptj_half_precision_beam_search_in_one_graph_matches_eager():
    """GPT-J in float16 in one WHILE graph: the eager search over a KVCache pair of float16
    (the same row-table attention the loop runs) gives the same tokens and score, bit for
    bit."""
    config = GPTJConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=13, n_positions=8,
                        rotary_dim=4)
    model = GPTJ(config, gptj_weights(config, seed=4), max_batch=3, max_tokens=8)
    prompt = np.array([3, 1], np.int32)
    pair = KVCache.pair(config, 3, 8, dtype=np.float16)
    want = generate.beam_search(model, prompt, beam=3, max_new_tokens=3, caches=pair)
    with BeamLoop(model, beam=3, max_len=8) as loop:
        assert loop.cache.dtype == np.float16
        got = loop.generate(prompt, max_new_tokens=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.score == want.score


@pytest.mark.parametrize("control,unroll", [("predicated", 1), ("predicated", 3), ("host", 16)])
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_every_control_generates_what_the_host_search_does(control, unroll):
    """WHILE node, predicated unroll (a K that divides the passes and one that does not) and
    the host loop: tokens, steps and beam scores equal the eager searches'."""
    config = GPT2Config(n_layer=1, n_embd=2, n_head=1, vocab_size=11, n_positions=8)
    model = HistoryDecoder(config, 3, 8)
    prompt = np.array([[4, 1], [2, 9], [7, 7]], np.int32)
    with GreedyLoop(model, batch=3, max_len=8, control=control, unroll=unroll) as loop:
        for new, eos in ((5, None), (4, 3)):
            want = generate.greedy(model, prompt, max_new_tokens=new, eos=eos)
            got = loop.generate(prompt, max_new_tokens=new, eos=eos)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.times.steps == want.times.steps
    with BeamLoop(model, beam=3, max_len=8, control=control, unroll=unroll) as loop:
        for new in (5, 4):          # two steps a pass: ending on the first or the second
            want = generate.beam_search(model, prompt[0], beam=3, max_new_tokens=new)
            got = loop.generate(prompt[0], max_new_tokens=new)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.score == want.score and got.times.steps == want.times.steps


def test_non_finite_scores_stop_a_device_search_with_an_error():
    """NaN weights (loaded on purpose) give NaN logits: the device searches say so, as the host
    searches do, instead of returning tokens chosen from garbage."""
    config = GPT2Config(n_layer=1, n_embd=4, n_head=1, vocab_size=11, n_positions=8)
    sd = random_state_dict(config, seed=1)
    sd["transformer.ln_f.bias"][:] = np.nan
    model = GPT2(config, sd, max_batch=2, max_tokens=8, allow_nonfinite=True)
    with GreedyLoop(model, batch=2, max_len=8) as loop:
        with pytest.raises(FloatingPointError, match="not all finite"):
            loop.generate(np.array([[1, 2], [3, 4]], np.int32), max_new_tokens=2)
    with BeamLoop(model, beam=2, max_len=8) as loop:
        with pytest.raises(FloatingPointError, match="not all finite"):
            loop.generate(np.array([1, 2], np.int32), max_new_tokens=2)


@given(rows=st.integers(1, 3), k=st.integers(1, 4), seed=st.integers(0, 2**16),
       poison=st.sampled_from([None, np.nan, np.inf, -np.inf, -2e30]))
def test_check_scores_matches_reference(rows, k, seed, poison):
    values = np.random.default_rng(seed).uniform(-5, 5, (rows, k)).astype(np.float32)
    if poison is not None:
        values[rows - 1, k - 1] = poison
    bad = dev(np.zeros(1, np.int32))
    sampling.check_scores(dev(values), -1e30, bad)
    assert bool(bad.copy_to_host()[0]) == sampling.check_scores_ref(values, -1e30)
    assert bool(bad.copy_to_host()[0]) == (poison is not None)
