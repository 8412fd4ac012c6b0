"""Our GPT-2 and LSTM against PyTorch models loaded from their own state_dict (GPU lane).

PyTorch runs on the CPU in float32 (no TF32, no device-dependent kernels), ours on the GPU;
the tokens are compared through proto.models.reference's searches driven by the torch
model's logits, so the search rules are the same on both sides.
"""
import numpy as np
import pytest

from proto.models import generate, reference
from proto.models.gpt2 import GPT2, GPT2Config, KVCache
from proto.models.lstm import LSTMConfig, LSTMLM, LSTMState
from tests.helpers import dev

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# both sides float32 with different summation orders; logits are ~1-10 in size
LOGIT_TOL = dict(atol=1e-3, rtol=1e-3)
TOKEN_MARGIN = 1e-3  # reference decisions closer than this may differ between the two


def _numpy_state(module) -> dict:
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


def _hf_gpt2(n_embd=64, n_head=4):
    config = GPT2Config(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=100, n_positions=64)
    hf_config = transformers.GPT2Config(n_layer=2, n_embd=n_embd, n_head=n_head,
                                        vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    # HF's init (std 0.02, zero biases, unit gains) gives near-flat logits and would hide a
    # dropped bias; perturb every parameter (the tied head is one parameter with wte).
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return config, hf


def _torch_logits(model):
    def logits_fn(tokens):
        with torch.no_grad():
            return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.double().numpy()
    return logits_fn


def _prompt_with_margin(search, vocab, shape, tries=20):
    """A prompt whose reference search has no near-tie decision (deterministic choice)."""
    rng = np.random.default_rng(0)
    for _ in range(tries):
        prompt = rng.integers(0, vocab, shape)
        want = search(prompt)
        if want.margin > TOKEN_MARGIN:
            return prompt, want
    raise AssertionError("no prompt without near-tie decisions; lower TOKEN_MARGIN?")


@pytest.mark.parametrize("n_embd,n_head", [(64, 4), (768, 12)])
def test_gpt2_logits_match_transformers(n_embd, n_head):
    """At width 768 the decode steps (3 rows) take kernels.mlp's fused MLP and the layer
    norms fused into the qkv and head GEMMs' staging; the 15-row prefill takes the
    unfused path (gemm's fc and projection, a layernorm launch before each)."""
    config, hf = _hf_gpt2(n_embd, n_head)
    model = GPT2(config, _numpy_state(hf), max_batch=3, max_tokens=5)
    seq = np.random.default_rng(1).integers(0, 100, (3, 9))
    want = _torch_logits(hf)(seq)  # (3, 9, 100)
    cache = KVCache(config, 3, 16)
    prefill = model.step(dev(seq[:, :5].astype(np.int32)), dev(np.array([0], np.int32)), cache)
    np.testing.assert_allclose(prefill.copy_to_host(), want[:, :5], **LOGIT_TOL)
    for t in range(5, 9):
        logits = model.step(dev(seq[:, t:t + 1].astype(np.int32)),
                            dev(np.array([t], np.int32)), cache)
        np.testing.assert_allclose(logits.copy_to_host()[:, 0], want[:, t], **LOGIT_TOL)


def test_gpt2_greedy_and_beam_tokens_match_transformers():
    config, hf = _hf_gpt2()
    logits_fn = _torch_logits(hf)
    model = GPT2(config, _numpy_state(hf), max_batch=5, max_tokens=4)

    prompt, want = _prompt_with_margin(lambda p: reference.greedy(logits_fn, p, 12), 100, (2, 5))
    got = generate.greedy(model, prompt, max_new_tokens=12, timed=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)

    prompt, want = _prompt_with_margin(lambda p: reference.beam(logits_fn, p, 5, 10), 100, (5,))
    got = generate.beam_search(model, prompt, beam=5, max_new_tokens=10)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.score == pytest.approx(want.score, abs=1e-3)

    # an eos that ranks second after the prompt: finished hypotheses must compete with live ones
    eos = int(np.argsort(-logits_fn(prompt[None])[0, -1])[1])
    want = reference.beam(logits_fn, prompt, 5, 10, eos)
    if want.margin > TOKEN_MARGIN:
        got = generate.beam_search(model, prompt, beam=5, max_new_tokens=10, eos=eos)
        np.testing.assert_array_equal(got.tokens, want.tokens)


class TorchLSTMLM(torch.nn.Module):
    def __init__(self, vocab, n_embd, n_hidden, n_layer):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, n_embd)
        self.lstm = torch.nn.LSTM(n_embd, n_hidden, num_layers=n_layer, batch_first=True)
        self.decoder = torch.nn.Linear(n_hidden, vocab)

    def forward(self, tokens):
        out, (h, c) = self.lstm(self.embedding(tokens))
        return self.decoder(out), h, c


def test_lstm_matches_torch():
    torch.manual_seed(0)
    net = TorchLSTMLM(vocab=100, n_embd=32, n_hidden=48, n_layer=2).eval()
    config = LSTMConfig(n_layer=2, n_embd=32, n_hidden=48, vocab_size=100)
    seq = np.random.default_rng(2).integers(0, 100, (3, 6))
    with torch.no_grad():
        want, h, c = (t.numpy() for t in net(torch.as_tensor(seq)))
    model = LSTMLM(config, _numpy_state(net), max_batch=4)
    state = LSTMState(config, 3)
    for t in range(6):
        logits = model.step(dev(seq[:, t].astype(np.int32)), state)
        np.testing.assert_allclose(logits.copy_to_host(), want[:, t], **LOGIT_TOL)
    for k in range(2):
        np.testing.assert_allclose(state.h[k].copy_to_host(), h[k], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(state.c[k].copy_to_host(), c[k], atol=1e-4, rtol=1e-4)


def test_hugging_face_generate_with_our_weights_searches_by_our_rules():
    """end_to_end's Hugging Face baselines: our state dict loads whole into GPT2LMHeadModel,
    and its generate (beam 5, no eos) returns the tokens our search rules give (on the CPU,
    away from float32 near-ties; the compiled variant needs a GPU and runs in end_to_end)."""
    from experiments.hf_gpt2 import HFBeamSearch
    from proto.models.gpt2 import random_state_dict
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    state = random_state_dict(config, seed=0)
    search = HFBeamSearch(config, state, beam=5, compiled=False, device="cpu")
    logits_fn = lambda tokens: reference.gpt2_logits(config, state, np.asarray(tokens))  # noqa: E731
    prompt, want = _prompt_with_margin(lambda p: reference.beam(logits_fn, p, 5, 12), 100, (5,))
    np.testing.assert_array_equal(search.generate(prompt, 12), want.tokens)


def test_hugging_face_child_process_returns_what_the_search_gives_and_reports_its_death():
    """end_to_end runs the Hugging Face baselines in a child process (HFChild): it returns
    the in-process search's tokens; a child that does not answer in time is stopped, and one
    that dies raises with its exit status."""
    from experiments.hf_gpt2 import HFBeamSearch, HFChild
    from proto.models.gpt2 import random_state_dict
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=16)
    state = random_state_dict(config, seed=1)
    prompt = np.array([3, 7, 1], np.int32)
    want = HFBeamSearch(config, state, beam=3, compiled=False, device="cpu").generate(prompt, 4)
    child = HFChild(config, state, beam=3, compiled=False, device="cpu")
    try:
        np.testing.assert_array_equal(child.generate(prompt, 4), want)
        child.timeout_s = 1e-3   # no search answers that fast: the child is stopped
        with pytest.raises(RuntimeError, match=r"gave no answer in 0.001 s; it was stopped"):
            child.generate(prompt, 12)
    finally:
        child.close()
    child = HFChild(config, state, beam=3, compiled=False, device="cpu")
    try:
        child._proc.kill()
        with pytest.raises(RuntimeError, match=r"child process died \(exit status -9, signal 9\)"):
            child.generate(prompt, 4)
    finally:
        child.close()


def test_ptgraph_per_length_graphs_give_the_float64_reference_logits():
    """PerLengthDecoder, the PtGraph baseline of the memory figure: a prefill, then decode
    steps each replaying the graph of its length (the live prefix baked in), against the
    float64 reference over the whole sequence; with a shared pool and with private ones."""
    from experiments.torch_gpt2 import PerLengthDecoder
    from proto.models.gpt2 import random_state_dict
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=16)
    state_dict = random_state_dict(config, seed=7)
    B, T0, steps = 3, 4, 5
    seq = np.random.default_rng(8).integers(0, config.vocab_size, (B, T0 + steps)).astype(np.int32)
    want = reference.gpt2_logits(config, state_dict, seq)           # (B, T, V) float64
    for pool in ("shared", "private"):
        dec = PerLengthDecoder(config, state_dict, batch=B, max_len=T0 + steps, pool=pool)
        try:
            for length in reversed(range(T0 + 1, T0 + steps + 1)):   # largest first, as
                dec.capture(length)          # the memory figure captures; replayed ascending
            pos = dev(np.zeros(1, np.int32))
            dec.step(dev(seq[:, :T0]), pos, dec.caches[0])            # the prefill, eager
            for t in range(T0, T0 + steps):
                pos.copy_to_device(np.array([t], np.int32))
                got = dec.step(dev(seq[:, t:t + 1]), pos, dec.caches[0]).copy_to_host()
                np.testing.assert_allclose(got[:, 0], want[:, t], **LOGIT_TOL,
                                           err_msg=f"{pool} pool, position {t}")
            assert len(dec.graphs) == steps
        finally:
            dec.close()
