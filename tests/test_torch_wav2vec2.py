"""The PyTorch side of the wav2vec2_train experiment, on the CPU where no GPU is: the
capturable network gives transformers' logits and loss, and transformers' trainer starts
from the loss our model computes on the same weights."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from experiments import torch_wav2vec2 as tw  # noqa: E402
from proto.models import wav2vec2 as w2v  # noqa: E402
from tests.test_wav2vec2 import _batch, _device  # noqa: E402

CFG = w2v.TINY


def test_the_capturable_network_gives_transformers_logits_and_loss():
    state = w2v.random_state_dict(CFG, seed=11)
    b = _batch(CFG, seed=12)
    hf = tw.hf_model(CFG, state, device="cpu").double()
    inputs = tw.hf_inputs(CFG, b, device="cpu")
    inputs["input_values"] = inputs["input_values"].double()
    out = hf(**inputs)
    net = tw.TorchWav2Vec2(hf)
    logits = net(inputs["input_values"], tw.frame_mask(CFG, b, device="cpu").double())
    # the padded frames' logits differ (transformers' are computed from zeroed frames too,
    # but nothing reads them); every sample's own frames agree to float64 rounding
    valid = torch.from_numpy(np.arange(b.length)[None] < b.frames[:, None])
    np.testing.assert_allclose(logits[valid].detach().numpy(), out.logits[valid].detach().numpy(),
                               rtol=1e-10, atol=1e-10)
    assert abs(tw.ctc(CFG, logits, b).item() - out.loss.item()) <= 1e-10 * abs(out.loss.item())


def test_transformers_trainer_starts_from_our_loss():
    state = w2v.random_state_dict(CFG, seed=13)
    b = _batch(CFG, seed=14)
    ours = w2v.Wav2Vec2ForCTC(CFG, state).train_step(*_device(b), update=False).copy_to_host()[0]
    theirs = tw.HFTrainer(CFG, state, device="cpu").step(b)
    assert abs(ours - theirs) <= 1e-5 * abs(theirs)
