"""Greedy and beam search against the reference searches (proto.models.reference).

The search logic runs over a stand-in step (HistoryStep) whose logits are the float64
reference model's; one end-to-end case runs the device model itself."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from proto.device.backend import cuda
from proto.models import generate, reference
from proto.models.gpt2 import GPT2, GPT2Config, KVCache, random_state_dict
from tests.test_gpt2 import gpt2_configs

# A reference decision closer than this may legitimately go the other way in float32 (scores
# agree to ~1e-5 here); such examples are discarded rather than compared token by token.
TOKEN_MARGIN = 1e-3


class HistoryStep:
    """A stand-in step: the float64 reference model over a token history kept in the cache.

    Token p of sequence b lives in cache.k[0][b, 0, p, 0], so a beam reorder must carry a
    beam's whole history along (gather_batch over every cache array) for the logits to come
    out right. The search's own kernels (argmax, log-softmax, score add, top-k, reorder) run
    for real; the step itself costs no simulated launches, which keeps these tests fast (the
    device model's step is checked against the reference in test_gpt2). Like a graphed step
    it is called with the search's buffers; it records them.
    """

    def __init__(self, logits_fn):
        self.logits_fn, self.calls = logits_fn, []

    def __call__(self, tokens, pos, cache):
        self.calls.append((tokens, pos))
        new, p = tokens.copy_to_host(), int(pos.copy_to_host()[0])
        history = cache.k[0].copy_to_host()  # (B, 1, max_len, 1)
        history[:, 0, p:p + new.shape[1], 0] = new
        cache.k[0].copy_to_device(history)
        seqs = history[:, 0, :p + new.shape[1], 0].astype(np.int64)
        return cuda.to_device(self.logits_fn(seqs)[:, -new.shape[1]:].astype(np.float32))


def _search_setup(config, seed, prompt_shape):
    """The reference model's logits, a HistoryStep over them, and a model stand-in whose
    one-layer, one-wide cache config keeps the reorder to two small gathers."""
    sd = random_state_dict(config, seed)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_shape)
    logits_fn = lambda tokens: reference.gpt2_logits(config, sd, tokens)  # noqa: E731
    cache_config = GPT2Config(n_layer=1, n_embd=1, n_head=1, vocab_size=config.vocab_size,
                              n_positions=config.n_positions)
    return prompt, logits_fn, HistoryStep(logits_fn), SimpleNamespace(config=cache_config)


def _eos_of_rank(logits_fn, prompt_row, rank):
    """The token ranked `rank` after the prompt (None for no eos): rank 0 ends at once, rank 1
    leaves a finished hypothesis that live beams must beat."""
    if rank is None:
        return None
    return int(np.argsort(-logits_fn(prompt_row[None])[0, -1], kind="stable")[rank])


@settings(max_examples=8)
@given(config=gpt2_configs(), batch=st.integers(1, 2), prompt_len=st.integers(1, 3),
       new=st.integers(1, 4), eos_rank=st.sampled_from([None, 0, 1]), timed=st.booleans(),
       seed=st.integers(0, 2**16))
def test_greedy_matches_reference(config, batch, prompt_len, new, eos_rank, timed, seed):
    prompt, logits_fn, step, model = _search_setup(config, seed, (batch, prompt_len))
    eos = _eos_of_rank(logits_fn, prompt[0], eos_rank)
    want = reference.greedy(logits_fn, prompt, new, eos)
    assume(want.margin > TOKEN_MARGIN)
    got = generate.greedy(model, prompt, max_new_tokens=new, eos=eos, step=step, timed=timed)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    generated = want.tokens.shape[1] - prompt_len
    assert got.times.steps == generated and got.times.synchronized == timed
    assert min(got.times.per_token_ms().values()) >= 0.0
    search_calls = step.calls[-generated:]  # after the prefill every step reuses the same buffers
    assert all(t is search_calls[0][0] and p is search_calls[0][1] for t, p in search_calls)


@settings(max_examples=8)
@given(config=gpt2_configs(), beam=st.integers(1, 5), prompt_len=st.integers(1, 3),
       new=st.integers(1, 3), eos_rank=st.sampled_from([None, 0, 1, 2]),
       seed=st.integers(0, 2**16))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_beam_search_matches_reference(config, beam, prompt_len, new, eos_rank, seed):
    prompt, logits_fn, step, model = _search_setup(config, seed, (prompt_len,))
    eos = _eos_of_rank(logits_fn, prompt, eos_rank)
    want = reference.beam(logits_fn, prompt, beam, new, eos)
    assume(want.margin > TOKEN_MARGIN)
    got = generate.beam_search(model, prompt, beam=beam, max_new_tokens=new, eos=eos, step=step)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.score == pytest.approx(want.score, abs=1e-4)  # float32 sums of <= 3 log-probs


def test_beam_search_ranks_twice_the_beam_width_of_candidates():
    """Which candidates a step examines (top 2 * beam) decides the result here: after the
    prompt, eos ranks third, so with beam 2 only a search that looks at more than two
    candidates finishes on it; every continuation after that is worse. A Markov table of
    logits (row = last token), checked against the reference's independent restatement."""
    V, eos = 5, 4
    table = np.zeros((V, V))                      # after tokens 1..4: uniform, all bad
    table[0] = [-3.0, -1.0, -1.1, -3.0, -1.2]     # after the prompt: 1, 2, eos, ...
    logits_fn = lambda tokens: table[tokens]      # noqa: E731
    cache_config = GPT2Config(n_layer=1, n_embd=1, n_head=1, vocab_size=V, n_positions=8)
    model = SimpleNamespace(config=cache_config)
    want = reference.beam(logits_fn, [0], 2, 3, eos)
    assert want.tokens.tolist() == [0, eos]       # what ranking 4 candidates finds
    got = generate.beam_search(model, [0], beam=2, max_new_tokens=3, eos=eos,
                               step=HistoryStep(logits_fn))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.score == pytest.approx(want.score, abs=1e-5)


def test_beam_of_one_is_greedy():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    prompt, logits_fn, step, model = _search_setup(config, 3, (2,))
    beam = generate.beam_search(model, prompt, beam=1, max_new_tokens=3, step=step)
    greedy = generate.greedy(model, prompt[None], max_new_tokens=3, step=step)
    np.testing.assert_array_equal(beam.tokens, greedy.tokens[0])
    lp = reference.log_softmax(logits_fn(beam.tokens[None])[0])  # (T, V)
    assert beam.score == pytest.approx(sum(lp[t - 1, beam.tokens[t]] for t in range(2, 5)),
                                       abs=1e-4)


def test_device_model_end_to_end():
    """The real GPT2.step under beam search, KV-cache reorders included (one tiny case:
    simulated steps are slow)."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    sd = random_state_dict(config, 5)
    logits_fn = lambda tokens: reference.gpt2_logits(config, sd, tokens)  # noqa: E731
    model = GPT2(config, sd, max_batch=2, max_tokens=1)
    prompt = np.array([3, 7])
    want = reference.beam(logits_fn, prompt, 2, 3)
    assert want.margin > TOKEN_MARGIN  # fixed case, checked once
    got = generate.beam_search(model, prompt, beam=2, max_new_tokens=3)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_generation_rejects_bad_arguments():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = GPT2(config, random_state_dict(config, 0), max_batch=2, max_tokens=2)
    with pytest.raises(ValueError, match=r"beam: expected an integer in 1\.\.8"):
        generate.beam_search(model, [1, 2], beam=9, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt: expected a non-empty 1-D"):
        generate.beam_search(model, [[1, 2]], beam=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt: token ids must lie in \[0, 11\)"):
        generate.greedy(model, [[1, 11]], max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds n_positions=8"):
        generate.greedy(model, [[1, 2, 3]], max_new_tokens=7)
    with pytest.raises(ValueError, match="eos: expected an id"):
        generate.greedy(model, [[1, 2]], max_new_tokens=2, eos=11)
    with pytest.raises(ValueError, match="max_new_tokens: expected a positive"):
        generate.greedy(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="caches: expected batch 2"):
        generate.beam_search(model, [1, 2], beam=2, max_new_tokens=2,
                             caches=(KVCache(config, 1, 4), KVCache(config, 1, 4)))


def test_arguments_are_checked_before_any_cache_is_allocated(monkeypatch):
    """Wrong types name the argument; a batch or prompt past the model's limits is refused
    before caches are allocated (not by the model step, after them)."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = GPT2(config, random_state_dict(config, 0), max_batch=2, max_tokens=2)

    def no_cache(*args, **kwargs):
        raise AssertionError("a cache was allocated before the arguments were checked")

    monkeypatch.setattr(generate, "KVCache", no_cache)
    cases = [
        (dict(prompt=[[1, 2]], max_new_tokens=2, eos="3"), r"eos: expected an id in \[0, 11\)"),
        (dict(prompt=[[1, 2]], max_new_tokens=2, eos=True), "eos: expected an id"),
        (dict(prompt=[[1, 2]], max_new_tokens=-1), "max_new_tokens: expected a positive integer"),
        (dict(prompt=[[1, 2]], max_new_tokens=1.5), "max_new_tokens: expected a positive integer"),
        (dict(prompt=[[1, 2]], max_new_tokens=True), "max_new_tokens: expected a positive integer"),
        (dict(prompt=[[1.0, 2.0]], max_new_tokens=2), "prompt: expected a non-empty 2-D integer"),
        (dict(prompt=[[1, 2], [3]], max_new_tokens=2), "prompt: expected a 2-D integer array"),
        (dict(prompt=[[1, -1]], max_new_tokens=2), r"prompt: token ids must lie in \[0, 11\)"),
        (dict(prompt=[[1, 2]] * 3, max_new_tokens=2), "batch 3 exceeds the model's max_batch=2"),
        (dict(prompt=[[1, 2, 3, 4]], max_new_tokens=2), "prefill of 3 tokens exceeds the "
                                                         "model's max_tokens=2"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            generate.greedy(model, **kwargs)
    with pytest.raises(ValueError, match="batch 3 exceeds the model's max_batch=2"):
        generate.beam_search(model, [1, 2], beam=3, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"beam: expected an integer in 1\.\.8"):
        generate.beam_search(model, [1, 2], beam=True, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"inputs: expected tokens \(1, 1\)"):
        generate.greedy(model, [[1, 2]], max_new_tokens=2, inputs=generate.DecodeInputs.allocate(2))


@pytest.mark.parametrize("rows", ["all", "one"])
def test_non_finite_logits_are_an_error_not_an_eos(rows):
    """NaN logits rank as -inf, so argmax would pick token 0 (here also eos) and stop as if
    the model had finished; top-k would go on with -inf scores. Both searches say so."""
    V = 6

    def logits_fn(tokens):
        out = np.zeros((*tokens.shape, V))
        out[..., 3] = 1.0
        if rows == "all":
            out[:] = np.nan
        else:
            out[0, -1] = np.nan                    # one row of the batch (or the first beam)
        return out

    model = SimpleNamespace(config=GPT2Config(n_layer=1, n_embd=1, n_head=1, vocab_size=V,
                                              n_positions=8))
    with pytest.raises(FloatingPointError, match="row 0 at step 0 have no finite maximum"):
        generate.greedy(model, [[1], [2]], max_new_tokens=3, eos=0, step=HistoryStep(logits_fn))
    with pytest.raises(FloatingPointError, match="beam_search: step 0: top-4 candidate"):
        generate.beam_search(model, [1], beam=2, max_new_tokens=3, eos=0,
                             step=HistoryStep(logits_fn))


def test_a_step_that_breaks_its_contract_is_named():
    model = SimpleNamespace(config=GPT2Config(n_layer=1, n_embd=1, n_head=1, vocab_size=6,
                                              n_positions=8))

    def wrong_vocab(tokens, pos, cache):
        return cuda.to_device(np.zeros((tokens.shape[0], 1, 5), np.float32))

    with pytest.raises(ValueError, match=r"step: expected float32 logits of shape \(2, 1, 6\)"):
        generate.greedy(model, [[1], [2]], max_new_tokens=2, step=wrong_vocab)
    with pytest.raises(ValueError, match=r"step: expected float32 logits of shape \(2, 1, 6\)"):
        generate.beam_search(model, [1], beam=2, max_new_tokens=2, step=wrong_vocab)


def test_caches_that_are_not_caches_are_named():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8)
    model = GPT2(config, random_state_dict(config, 0), max_batch=2, max_tokens=2)
    with pytest.raises(ValueError, match="caches: expected KVCache objects, got str"):
        generate.greedy(model, [[1, 2]], max_new_tokens=2, cache="cache")
