"""Graphed decode (proto.models.graphed) gives the eager result: every binding mode, shape
strategy and executor (walk on the simulator), greedy and beam tokens, step logits.

A simulated GPT-2 step costs ~1.5 s (each simulated thread is a Python thread), so the full
binding x strategy matrix runs on `HistoryDecoder`, a stand-in with GPT2.step's contract and
one one-block kernel per cache array: it writes this step's token into every cache array at
`pos` (all heads and dims) and hashes each sequence's whole cached history and position into
its logits. A wrong reorder, a stale or unbound cache, a wrong position or a lost re-pad
changes the tokens. The real GPT2 runs the two graphed set-ups the end_to_end experiment
times; tests/test_graphed_models_gpu.py runs the whole matrix on the real model and CUDA graphs.
"""
import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from proto import shapes
from proto.device.backend import cuda, empty, jit, launch
from proto.graph.binding import MODES
from proto.graph.walk import WalkExecutor
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, KVCache, random_state_dict
from proto.models.gptj import GPTJ, GPTJConfig, random_state_dict as gptj_random_state_dict
from proto.models.graphed import GraphedDecoder, GraphedLSTM, lstm_greedy
from proto.models.lstm import LSTMConfig, LSTMLM, LSTMState
from tests.helpers import dev

COMBOS = [(b, s) for b in MODES for s in shapes.STRATEGIES]


# ---------------------------------------------------------------------------- stand-in model
@jit("void(int32[:, ::1], int32[::1], float32[:, :, :, ::1], float32[:, ::1], float32, int32, "
     "int32[:, ::1], int32)")
def history_cache_kernel(tokens, pos, cache, acc, salt, first, rows, use_rows):
    """Thread b: cache[b, :, pos+t, :] = (token+1) * salt * (1+h+d); acc[b, t] (+)= the
    position-weighted sum of the cache up to pos+t (NaN when the step does not fit), earlier
    positions p < pos read from row rows[b, p] when `use_rows` (KVCache.pair)."""
    b = cuda.grid(1)
    if b >= tokens.shape[0]:
        return
    T, H, Tmax, hd = tokens.shape[1], cache.shape[1], cache.shape[2], cache.shape[3]
    p0 = pos[0]
    ok = 0 <= p0 and p0 + T <= Tmax
    for t in range(T):
        if ok:
            for h in range(H):
                for d in range(hd):
                    cache[b, h, p0 + t, d] = (tokens[b, t] + 1) * salt * (1 + h + d)
    for t in range(T):
        s = np.float32(math.nan)
        if ok:
            s = np.float32(0.0)
            for p in range(p0 + t + 1):
                row = rows[b, p] if use_rows and p < p0 else b
                for h in range(H):
                    for d in range(hd):
                        s += cache[row, h, p, d] * np.float32(0.01 * (p + 1))
        acc[b, t] = s if first else acc[b, t] + s


@jit("void(float32[:, ::1], int32[::1], float32[:, :, ::1])")
def history_logits_kernel(acc, pos, logits):
    b = cuda.grid(1)
    if b < logits.shape[0]:
        for t in range(logits.shape[1]):
            for v in range(logits.shape[2]):
                logits[b, t, v] = 3.0 * math.sin(acc[b, t] * (v + 1) * 0.731 + (pos[0] + t) * 0.1)


class HistoryDecoder:
    """GPT2.step's contract (temporaries from `empty`, pos read on the device), 2L + 1 tiny
    kernels."""

    def __init__(self, config: GPT2Config, max_batch: int, max_tokens: int):
        self.config, self.max_batch = config, max_batch

    def step(self, tokens, pos, cache, stream=0):
        B, T = tokens.shape
        V = self.config.vocab_size
        acc = empty((B, T), np.float32, "acc", owner=self)
        rows = getattr(cache, "rows", None)
        rows_arg = empty((1, 1), np.int32, "no_rows", owner=self) if rows is None else rows
        for j, array in enumerate(cache.arrays()):
            launch(history_cache_kernel, 1, 32,
                   (tokens, pos, array, acc, np.float32(j + 1), np.int32(j == 0), rows_arg,
                    np.int32(rows is not None)), stream)
        logits = empty((B, T, V), np.float32, "logits", owner=self)
        launch(history_logits_kernel, 1, 32, (acc, pos, logits), stream)
        return logits


@st.composite
def small_configs(draw):
    n_head = draw(st.integers(1, 2))
    return GPT2Config(n_layer=draw(st.integers(1, 2)), n_embd=n_head * draw(st.integers(1, 2)),
                      n_head=n_head, vocab_size=draw(st.integers(11, 23)), n_positions=8)


# ---------------------------------------------------------------------------- the matrix
def check_beam_search(model, prompt, beam: int, new: int, executor=None, combos=COMBOS,
                      build_all=False):
    """Every (binding, strategy): graphed beam search = eager; binding bytes and graph counts
    as designed. Graphs built lazily (the largest first, then each on first use) run twice
    (the second run replays every graph); built up front (largest first), once."""
    want = generate.beam_search(model, prompt, beam=beam, max_new_tokens=new)
    config, need = model.config, len(prompt) + new - 1
    for binding, strategy in combos:
        with GraphedDecoder(model, batch=beam, max_len=need, binding=binding, strategy=strategy,
                         executor=executor, build_all=build_all) as g:
            for run in range(1 if build_all else 2):
                got = g.beam_search(prompt, max_new_tokens=new)
                where = f"{binding} {strategy} run {run}"
                np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=where)
                assert got.score == pytest.approx(want.score, abs=1e-5), where
            steps, keys = got.times.steps, g.keys
            lengths = range(len(prompt), len(prompt) + steps)  # context length at each step
            if build_all:
                assert g.num_graphs == (2 if binding == "alias" else 1) * len(keys), where
                assert g.stats().replays == steps, where  # nothing was built during the search
            elif binding == "alias":  # steps alternate cache sets A, B, A, ...: graphs per set
                assert g.num_graphs == sum(len({shapes.key_for(n, keys) for n in lengths[i::2]}
                                               | ({keys[-1]} if lengths[i::2] else set()))
                                           for i in (0, 1)), where
            else:
                assert g.num_graphs == len({shapes.key_for(n, keys) for n in lengths}
                                           | {keys[-1]}), where
            stats = g.stats()
            if binding != "copy":
                assert stats.bytes_copied == 0, where
            else:   # every step copies its tokens (int32), the position (unless the graph
                # bakes it) and the KV cache's live prefix: the positions before the step, k
                # and v of every layer, as a framework user slices them
                first = len(prompt) - 1     # the prompt's other tokens are the prefill
                per_run = sum(4 * beam + (0 if strategy == "exact" else 4)
                              + 2 * config.n_layer * beam * config.n_embd * 4 * p
                              for p in range(first, first + steps))
                assert stats.bytes_copied == per_run * stats.replays // steps, where


def check_greedy(model, prompt, new: int, executor=None, combos=COMBOS, build_all=False):
    """Every (binding, strategy): graphed greedy = eager; the argmax writes the next tokens
    (alias: into the placeholder itself), copy binding moves only tokens and position."""
    want = generate.greedy(model, prompt, max_new_tokens=new)
    B, T0 = prompt.shape
    for binding, strategy in combos:
        with GraphedDecoder(model, batch=B, max_len=T0 + new - 1, binding=binding,
                         strategy=strategy, executor=executor, build_all=build_all) as g:
            for run in range(1 if build_all else 2):
                got = g.greedy(prompt, max_new_tokens=new)
                np.testing.assert_array_equal(got.tokens, want.tokens,
                                              err_msg=f"{binding} {strategy} run {run}")
            stats = g.stats()
            assert stats.replays >= new  # every step of the last run is a replay
            per_replay = {"alias": 0, "patch": 0,
                          "copy": 4 * B + (4 if strategy != "exact" else 0)}[binding]
            assert stats.bytes_copied == stats.replays * per_replay


# One example each: a simulated search step costs ~0.5 s, the matrix is 9 set-ups.
@settings(max_examples=1)
@given(config=small_configs(), beam=st.integers(2, 3), prompt_len=st.integers(1, 3),
       new=st.integers(3, 4), seed=st.integers(0, 2**16))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_every_binding_and_strategy_gives_the_eager_beam_search(config, beam, prompt_len, new,
                                                                 seed):
    model = HistoryDecoder(config, max_batch=beam, max_tokens=prompt_len)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_len)
    check_beam_search(model, prompt, beam, new)


@settings(max_examples=1)
@given(config=small_configs(), batch=st.integers(1, 2), prompt_len=st.integers(1, 3),
       new=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_every_binding_and_strategy_gives_the_eager_greedy_tokens(config, batch, prompt_len,
                                                                  new, seed):
    model = HistoryDecoder(config, max_batch=batch, max_tokens=prompt_len)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, prompt_len))
    check_greedy(model, prompt, new, build_all=True)


def test_graphs_built_up_front_are_captured_largest_first_and_reused():
    config = GPT2Config(n_layer=1, n_embd=2, n_head=1, vocab_size=13, n_positions=8)
    model = HistoryDecoder(config, max_batch=2, max_tokens=2)
    prompt = np.array([4, 9])
    want = generate.beam_search(model, prompt, beam=2, max_new_tokens=3)
    with GraphedDecoder(model, batch=2, max_len=4, binding="alias", strategy="bucket",
                     build_all=True) as g:
        assert g.num_graphs == 2 * 3  # buckets 1, 2, 4 for each cache set
        assert list(g.graphed.dispatchers[0].graphs) == [4, 2, 1]  # largest first
        got = g.beam_search(prompt, max_new_tokens=3)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert g.num_graphs == 6 and g.stats().bytes_copied == 0
        assert g.stats().replays == 3  # no graph was built during the search
        assert g.repad_bytes > 0  # lengths 2 -> 3 crossed from bucket 2 into 4
        # two cache sets a capacity (1, 2, 4): K and V of 1 layer, 2 beams, 1 head of 2 floats
        assert g.cache_bytes == sum(2 * 2 * 1 * 2 * 1 * cap * 2 * 4 for cap in (1, 2, 4))


# ---------------------------------------------------------------------------- the real GPT-2
def check_decoder_step_logits(model, prompt, beam: int, new: int, combos, executor=None,
                           tol=None):
    """Beam search tokens as eager, then one more decode step from the search's final state:
    its logits equal the eager step's on a copy of the same cache (bitwise by default: the
    same kernels run; `tol` where replays may reorder float sums)."""
    config = model.config
    need = len(prompt) + new
    want = generate.beam_search(model, prompt, beam=beam, max_new_tokens=new)
    rng = np.random.default_rng(0)
    for binding, strategy in combos:
        with GraphedDecoder(model, batch=beam, max_len=need, binding=binding, strategy=strategy,
                         executor=executor) as g:
            got = g.beam_search(prompt, max_new_tokens=new)
            np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"{binding} {strategy}")
            # the search ended at position need-1, on cache set `last` (steps alternate)
            last = g.caches[(new - 1) % 2]
            g._position = need - 1
            g.inputs.tokens.copy_to_device(rng.integers(0, config.vocab_size, (beam, 1),
                                                        dtype=np.int32))
            g.inputs.pos.copy_to_device(np.array([need - 1], np.int32))
            # eager runs on a copy of the live cache, at the capacity the step will use (bucket:
            # it may grow), so both attentions split the cache alike: bitwise equal logits
            live = last if binding != "copy" else g._sets[g._capacity][0]  # copy: static S
            eager_cache = KVCache(config, beam, g._capacity_for(need), g.dtype)
            for src, dst in zip(live.arrays(), eager_cache.arrays()):
                grown = np.zeros(dst.shape, dst.dtype)
                grown[:, :, :src.shape[2]] = src.copy_to_host()
                dst.copy_to_device(grown)
            want_logits = model.step(g.inputs.tokens, g.inputs.pos, eager_cache).copy_to_host()
            got_logits = g.step(g.inputs.tokens, g.inputs.pos, last).copy_to_host()
            assert g.stats().replays >= 1
            if tol is None:
                np.testing.assert_array_equal(got_logits, want_logits)
            else:
                np.testing.assert_allclose(got_logits, want_logits, **tol)


def test_real_gpt2_graphed_beam_search_and_step_logits_equal_eager():
    """Grape's set-up (alias binding, one device-length graph per cache set) on the real
    model, graphs built on first use (warm-up, then record and replay). Six simulated model
    steps; the GPU lane runs every set-up on larger models."""
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    model = GPT2(config, random_state_dict(config, 7), max_batch=2, max_tokens=1)
    check_decoder_step_logits(model, np.array([3]), beam=2, new=2, combos=[("alias", "device")])


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_real_gptj_graphed_in_half_precision_equals_eager():
    """GPT-J in float16 (its KV cache, logits and rotary embedding read at the position on
    the device) through the same wrapper: Grape's set-up and per-length graphs on the memory
    tape, beam tokens and a step's logits bit for bit as eager."""
    config = GPTJConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=13, n_positions=8,
                        rotary_dim=4)
    model = GPTJ(config, gptj_random_state_dict(config, 7), max_batch=2, max_tokens=1)
    check_decoder_step_logits(model, np.array([3]), beam=2, new=2,
                              combos=[("alias", "device"), ("alias", "exact")])


# ---------------------------------------------------------------------------- bad input
def test_wrong_inputs_are_rejected_before_any_launch(monkeypatch):
    config = GPT2Config(n_layer=1, n_embd=2, n_head=1, vocab_size=11, n_positions=8)
    model = HistoryDecoder(config, max_batch=2, max_tokens=1)
    with pytest.raises(ValueError, match="binding: expected one of"):
        GraphedDecoder(model, batch=2, max_len=4, binding="share")
    with pytest.raises(ValueError, match="strategy: expected one of"):
        GraphedDecoder(model, batch=2, max_len=4, strategy="ragged")
    with pytest.raises(ValueError, match="max_len: expected at most 8"):
        GraphedDecoder(model, batch=2, max_len=9)
    g = GraphedDecoder(model, batch=2, max_len=3, binding="alias", strategy="device",
                    build_all=True)  # recorded: every decode call below would be a replay
    launched = []
    monkeypatch.setattr(WalkExecutor, "launch", lambda self: launched.append("replay"))
    monkeypatch.setattr(sys.modules[__name__], "launch", lambda *a: launched.append("eager"))
    tokens, pos, cache = g.inputs.tokens, g.inputs.pos, g.caches[0]
    with pytest.raises(TypeError, match="tokens: expected a device array"):
        g.step(np.zeros((2, 1), np.int32), pos, cache)
    with pytest.raises(TypeError, match="tokens: expected dtype int32, got float32"):
        g.step(dev(np.zeros((2, 1), np.float32)), pos, cache)
    with pytest.raises(ValueError, match=r"tokens: expected shape \(2, '\*'\), got \(3, 1\)"):
        g.step(dev(np.zeros((3, 1), np.int32)), pos, cache)
    with pytest.raises(ValueError, match="cache: expected one of this GraphedDecoder's"):
        g.step(tokens, pos, KVCache(config, 2, 3))
    with pytest.raises(ValueError, match="'tokens': alias binding needs the graph's placeholder"):
        g.step(dev(np.zeros((2, 1), np.int32)), pos, cache)
    with pytest.raises(ValueError, match="'pos': alias binding needs the graph's placeholder"):
        g.step(tokens, dev(np.zeros(1, np.int32)), cache)
    g._position = 3
    with pytest.raises(ValueError, match=r"position 3 \+ 1 new tokens exceeds max_len=3"):
        g.step(tokens, pos, cache)
    g._position = 1
    with pytest.raises(ValueError, match="a decode step takes 1 token per sequence, got 2"):
        g.step(dev(np.zeros((2, 2), np.int32)), pos, cache)
    g.reset(prompt_len=3)
    with pytest.raises(ValueError, match="expected the prefill's 2 tokens"):
        g.step(tokens, pos, cache)
    with pytest.raises(ValueError, match="dst: expected the other cache"):
        cache.reorder_into(dev(np.zeros(2, np.int32)), cache)
    assert launched == []
    g.close()


# ---------------------------------------------------------------------------- LSTM
@settings(max_examples=1)
@given(n_layer=st.integers(1, 2), n_hidden=st.integers(2, 5), vocab=st.integers(11, 20),
       batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_graphed_lstm_matches_eager_for_every_binding_and_strategy(n_layer, n_hidden, vocab,
                                                                   batch, seed):
    """Greedy tokens equal; a batch below max_batch leaves padding rows (bucket, device)
    that must not disturb the live rows."""
    from proto.models.lstm import random_state_dict as lstm_weights
    config = LSTMConfig(n_layer, 3, n_hidden, vocab)
    model = LSTMLM(config, lstm_weights(config, seed), max_batch=3)
    prompt = np.random.default_rng(seed).integers(0, vocab, (batch, 2))
    state = LSTMState(config, batch)
    want = lstm_greedy(lambda t: model.step(t, state), dev(np.zeros(batch, np.int32)), prompt, 1,
                       vocab=vocab)
    for binding, strategy in COMBOS:
        g = GraphedLSTM(model, max_batch=3, binding=binding, strategy=strategy)
        got = lstm_greedy(lambda t: g.step(t, batch), g.tokens, prompt, 1, vocab=vocab)
        np.testing.assert_array_equal(got, want, err_msg=f"{binding} {strategy}")
        assert g.num_graphs == len({shapes.key_for(batch, g.keys), 3})  # largest first
        assert g.stats().bytes_copied == (0 if binding != "copy" else
                                          g.stats().replays * 4 * shapes.key_for(
                                              batch, g.keys))
        g.close()


def test_graphed_lstm_with_the_sum_in_the_cell_matches_eager():
    """The gate partials are temporaries of the step (two views of one planned buffer): the
    graphs give eager's tokens, a batch below the graph's rows included."""
    from proto.models.lstm import random_state_dict as lstm_weights
    config = LSTMConfig(2, 3, 4, 13)
    model = LSTMLM(config, lstm_weights(config, 5), max_batch=3, sum_in_cell=True)
    prompt = np.random.default_rng(5).integers(0, 13, (2, 2))
    state = LSTMState(config, 2)
    want = lstm_greedy(lambda t: model.step(t, state), dev(np.zeros(2, np.int32)), prompt, 2,
                       vocab=13)
    for binding, strategy in (("alias", "exact"), ("copy", "bucket")):
        g = GraphedLSTM(model, max_batch=3, binding=binding, strategy=strategy)
        got = lstm_greedy(lambda t: g.step(t, 2), g.tokens, prompt, 2, vocab=13)
        np.testing.assert_array_equal(got, want, err_msg=f"{binding} {strategy}")
        g.close()
