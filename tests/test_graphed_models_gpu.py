"""Graphed decode on a real GPU: the simulator lane's properties on the real GPT-2 and LSTM,
with real CUDA graphs (and the walk executor, the eager-launch reference), at larger sizes.
The GPT-2 path adds no values atomically (its split reductions count blocks atomically and
sum in a fixed order), so a replay computes exactly what eager launches compute: tokens and
logits are compared bitwise.

    PYTHONPATH=. python3 -m pytest -q tests/test_graphed_models_gpu.py
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.gptj import GPTJ, GPTJConfig, random_state_dict as gptj_weights
from proto.models.graphed import GraphedDecoder, GraphedLSTM, lstm_greedy
from proto.models.lstm import LSTMConfig, LSTMLM, LSTMState, random_state_dict as lstm_weights
from tests.helpers import dev
from tests.test_graphed_models import (COMBOS, check_beam_search, check_decoder_step_logits,
                                       check_greedy)

pytestmark = pytest.mark.gpu


@st.composite
def gpt2_configs(draw):
    n_head = draw(st.sampled_from([1, 2, 4]))
    return GPT2Config(n_layer=draw(st.integers(1, 3)),
                      n_embd=n_head * draw(st.sampled_from([8, 24, 64])), n_head=n_head,
                      vocab_size=draw(st.integers(50, 1000)), n_positions=64)


def _model(config, seed, batch):
    return GPT2(config, random_state_dict(config, seed), max_batch=batch, max_tokens=8)


@settings(max_examples=1)
@pytest.mark.parametrize("executor,build_all", [("cuda", False), ("cuda", True), ("walk", False)])
@given(config=gpt2_configs(), beam=st.integers(1, 5), prompt_len=st.integers(1, 6),
       new=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_real_gpt2_beam_search_for_every_binding_and_strategy(executor, build_all, config, beam,
                                                              prompt_len, new, seed):
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_len)
    check_beam_search(_model(config, seed, beam), prompt, beam, new, executor=executor,
                      build_all=build_all)


@settings(max_examples=1)
@given(config=gpt2_configs(), batch=st.integers(1, 4), prompt_len=st.integers(1, 6),
       new=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_real_gpt2_greedy_for_every_binding_and_strategy(config, batch, prompt_len, new, seed):
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, prompt_len))
    check_greedy(_model(config, seed, batch), prompt, new, executor="cuda")


@settings(max_examples=1)
@given(config=gpt2_configs(), beam=st.integers(2, 5), new=st.integers(2, 9),
       seed=st.integers(0, 2**16))
def test_real_gpt2_step_logits_for_every_binding_and_strategy(config, beam, new, seed):
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, 3)
    check_decoder_step_logits(_model(config, seed, beam), prompt, beam, new, combos=COMBOS,
                           executor="cuda")


def test_per_length_graphs_cost_driver_memory_one_device_graph_does_not():
    """exact: a graph per length, each holding its own driver memory (~3 KiB a kernel node
    on the H200); device: one graph per cache set plus one reorder graph per direction, each
    reading 0 or one 2 MiB driver chunk (cuMemGetInfo's granularity, seen on the H200: 4 MiB
    for the four). Graphs freed by earlier tests leave memory the driver reuses, so the
    per-length bound is loose: 1 KiB a node."""
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=512)
    model = _model(config, 0, 5)
    with GraphedDecoder(model, batch=5, max_len=512, binding="copy", strategy="exact",
                     build_all=True) as exact, \
            GraphedDecoder(model, batch=5, max_len=512, binding="alias", strategy="device",
                        build_all=True) as device:
        assert exact.num_graphs == 512 and device.num_graphs == 2
        assert exact.num_nodes == 512 * device.num_nodes // 2
        assert device.memory_bytes <= (device.num_graphs + device.num_reorder_graphs) * (2 << 20)
        assert exact.memory_bytes >= 1024 * exact.num_nodes


@settings(max_examples=1)
@given(n_layer=st.integers(1, 3), n_hidden=st.integers(8, 200), vocab=st.integers(20, 2000),
       batch=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_graphed_lstm_for_every_binding_and_strategy(n_layer, n_hidden, vocab, batch, seed):
    config = LSTMConfig(n_layer, 32, n_hidden, vocab)
    model = LSTMLM(config, lstm_weights(config, seed), max_batch=8)
    prompt = np.random.default_rng(seed).integers(0, vocab, (batch, 3))
    state = LSTMState(config, batch)
    want = lstm_greedy(lambda t: model.step(t, state), dev(np.zeros(batch, np.int32)), prompt, 5,
                       vocab=vocab)
    for binding, strategy in COMBOS:
        g = GraphedLSTM(model, max_batch=8, binding=binding, strategy=strategy, executor="cuda")
        got = lstm_greedy(lambda t: g.step(t, batch), g.tokens, prompt, 5, vocab=vocab)
        np.testing.assert_array_equal(got, want, err_msg=f"{binding} {strategy}")
        g.close()


@pytest.mark.parametrize("shared", [None, 2])
def test_real_gptj_in_half_precision_for_every_binding_and_strategy(shared):
    """GPT-J in float16 (head dim 64 on the plain kernels, head dim 256 on the wide ones)
    with real CUDA graphs: beam tokens and a step's logits bit for bit as eager, in every
    binding and shape strategy; then per-length graphs on the tape with shared executables."""
    for n_head, hd in ((4, 64), (2, 256)):
        config = GPTJConfig(n_layer=2, n_embd=n_head * hd, n_head=n_head, vocab_size=700,
                            n_positions=64, rotary_dim=hd // 4)
        model = GPTJ(config, gptj_weights(config, hd), max_batch=5, max_tokens=8)
        prompt = np.random.default_rng(hd).integers(0, config.vocab_size, 4)
        if shared is None:
            check_decoder_step_logits(model, prompt, 5, 6, combos=COMBOS, executor="cuda")
            continue
        want = generate.beam_search(model, prompt, beam=5, max_new_tokens=12)
        with GraphedDecoder(model, batch=5, max_len=16, binding="alias", strategy="exact",
                            shared_executables=shared, build_all=True) as g:
            got = g.beam_search(prompt, max_new_tokens=12)
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.score == want.score and g.shared.instantiations == shared


@pytest.mark.parametrize("binding", ["copy", "alias"])
def test_planner_tape_and_shared_executables_change_no_bit(binding):
    """Per-length graphs with private buffers, with the planner and tape, and with one
    executable retargeted by executable update, or two used in turn: the same tokens, score
    and step logits, bit for bit, as eager."""
    config = GPT2Config(n_layer=3, n_embd=128, n_head=4, vocab_size=1000, n_positions=64)
    model = _model(config, 11, 5)
    prompt = np.array([5, 9, 2, 7, 1])
    want = generate.beam_search(model, prompt, beam=5, max_new_tokens=20)
    memory = {}
    for planned, shared in ((False, None), (True, None), (True, 1), (True, 2)):
        with GraphedDecoder(model, batch=5, max_len=24, binding=binding, strategy="exact",
                         planned=planned, shared_executables=shared, build_all=True) as g:
            got = g.beam_search(prompt, max_new_tokens=20)
            np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"{planned} {shared}")
            assert got.score == want.score
            memory[planned, shared] = (g.arena_bytes, g.private_bytes)
            if shared:
                assert g.shared.instantiations == shared and g.shared.updates >= 20 - shared
    check_decoder_step_logits(model, prompt, 5, 6, combos=[(binding, "exact")], executor="cuda")
    (_, private), (arena, none) = memory[False, None], memory[True, None]
    assert none == 0 and arena > 0 and private >= 24 * arena   # 24 graphs' private buffers


def test_gpt2_small_decode_arena_is_within_ten_percent_of_the_peak():
    """The planner on GPT-2 small's decode step (12 layers, d=768, vocab 50257, beam 5)."""
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    model = _model(config, 0, 5)
    with GraphedDecoder(model, batch=5, max_len=1024, binding="alias", strategy="device",
                     build_all=True) as g:
        plan = g.tape.plans[0]
        assert plan.arena_bytes <= 1.10 * plan.peak_live_bytes, plan.summary()
        assert plan.arena_bytes < plan.total_bytes / 2


def test_torch_baseline_is_the_same_model():
    """experiments/torch_gpt2: same logits as ours, and its beam search (eager and CUDA
    graph) finds our tokens."""
    pytest.importorskip("torch")
    from experiments.torch_gpt2 import TorchDecoder, check_logits
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    sd = random_state_dict(config, 3)
    model = GPT2(config, sd, max_batch=5, max_tokens=4)
    assert check_logits(model, sd) <= 1e-3
    prompt = np.array([5, 9, 2, 7, 1])
    want = generate.beam_search(model, prompt, beam=5, max_new_tokens=8)
    for graphed in (False, True):
        dec = TorchDecoder(config, sd, batch=5, max_len=12, graphed=graphed)
        got = dec.beam_search(prompt, max_new_tokens=8)
        np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=f"graphed={graphed}")
        dec.close()


def test_early_launch_gives_the_same_search(monkeypatch):
    """Programmatic dependent launch (PROTO_EARLY_LAUNCH=on, kernels/_pdl.py): the decode
    GEMMs and attention start while their predecessor runs, loading weights, and wait on
    the device before touching its outputs. Graphed beam search (per-step graphs and the
    whole search in one WHILE graph) must still give eager's tokens, and the graphs must
    really hold programmatic edges."""
    from proto.graph import cuda as graph_cuda
    from proto.models.search_loop import BeamLoop
    monkeypatch.setenv("PROTO_EARLY_LAUNCH", "on")
    config = GPT2Config(n_layer=3, n_embd=256, n_head=4, vocab_size=2000, n_positions=64)
    model = _model(config, 7, 5)
    prompt = np.random.default_rng(7).integers(0, config.vocab_size, 4)
    want = generate.beam_search(model, prompt, beam=5, max_new_tokens=20)
    early = []
    real = graph_cuda._launches_early
    monkeypatch.setattr(graph_cuda, "_launches_early",
                        lambda *a: early.append(real(*a)) or early[-1])
    check_beam_search(model, prompt, 5, 20, executor="cuda", combos=[("alias", "device")])
    with BeamLoop(model, beam=5, max_len=len(prompt) + 20) as loop:
        got = loop.generate(prompt, max_new_tokens=20)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert sum(early) >= 4 * config.n_layer   # (3 GEMMs and attention a layer at least)
