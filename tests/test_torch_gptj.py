"""The gptj experiment's PyTorch baseline (experiments.torch_gptj) is GPT-J: its decode steps,
one token at a time from position 0, give the float64 reference's logits (float32 on the
CPU; where PyTorch is installed: the GPU machine's lane)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from experiments.torch_gptj import TorchGPTJ   # noqa: E402
from proto.models import reference            # noqa: E402
from proto.models.gptj import GPTJConfig, random_state_dict   # noqa: E402

CONFIG = GPTJConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=29, n_positions=8, rotary_dim=8)


def test_decode_steps_match_the_reference():
    sd = random_state_dict(CONFIG, seed=3)
    weights = {k: torch.from_numpy(v) for k, v in sd.items()}
    seq = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 5))
    model = TorchGPTJ(CONFIG, weights, batch=2, max_len=8)
    want = reference.gptj_logits(CONFIG, sd, seq)
    out = torch.empty(2, CONFIG.vocab_size)
    for t in range(seq.shape[1]):
        model.decode_at(torch.from_numpy(seq[:, t]), t + 1, out)
        np.testing.assert_allclose(out.numpy(), want[:, t], atol=2e-4, rtol=2e-4)


def test_ptgraph_beam_search_is_the_reference_search():
    """PerLengthGPTJ under generate.beam_search (prompt a token at a time, the live prefix
    reordered in place) picks the reference search's tokens. Eager steps here (no graph
    captured: the CPU has none); the GPU lane's gptj experiment replays the graphs."""
    from experiments.torch_gptj import PerLengthGPTJ
    sd = random_state_dict(CONFIG, seed=5)
    logits_fn = lambda tokens: reference.gptj_logits(CONFIG, sd, tokens)  # noqa: E731
    prompt = np.array([3, 7, 1])
    want = reference.beam(logits_fn, prompt, 2, 4)
    from proto.device import backend
    device = "cpu" if backend.SIMULATOR else "cuda"   # (where the search's arrays live)
    dec = PerLengthGPTJ(CONFIG, {k: torch.from_numpy(v).to(device) for k, v in sd.items()},
                        batch=2, max_len=8, pool="private")
    got = dec.beam_search(prompt, max_new_tokens=4)
    np.testing.assert_array_equal(got.tokens, want.tokens)
