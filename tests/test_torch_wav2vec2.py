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
    trainer = tw.HFTrainer(CFG, state, device="cpu")
    theirs = trainer.step(trainer.prepare(b))
    assert abs(ours - theirs) <= 1e-5 * abs(theirs)


def test_the_exact_loss_is_the_float64_ctc_of_the_float64_logits():
    """exact_loss: the network in float64 and the CTC loss in float64 too (transformers'
    own loss rounds its log-probabilities to float32 whatever the model's dtype, so it is
    within float32's rounding of the exact one, not equal): the float64 CTC restated from its
    definition (kernels.ctc.ctc_loss_ref) on the float64 logits gives the same loss, and
    transformers' own loss of the float64 model is that loss to float32's rounding."""
    from kernels.ctc import ctc_loss_ref
    state = w2v.random_state_dict(CFG, seed=15)
    b = _batch(CFG, seed=16)
    net64 = tw.exact_model(CFG, state, device="cpu")
    exact = tw.exact_loss(net64, CFG, b, device="cpu")
    x = torch.from_numpy(b.waveform).double()
    with torch.no_grad():
        logits = net64(x, tw.frame_mask(CFG, b, device="cpu").double()).numpy()
    want = ctc_loss_ref(logits, b.frames, b.labels, b.label_lengths, blank=CFG.blank,
                        reduction=CFG.ctc_reduction, zero_infinity=CFG.zero_infinity)[1]
    assert abs(exact - want) <= 1e-12 * abs(want)
    inputs = tw.hf_inputs(CFG, b, device="cpu")
    inputs["input_values"] = inputs["input_values"].double()
    with torch.no_grad():
        theirs = tw.hf_model(CFG, state, device="cpu").double()(**inputs).loss.item()
    # (the same loss, lengths, blank and reduction: only float32's rounding of the log-probs
    # and of the recursion over a few dozen frames apart, far below any other difference)
    assert abs(theirs - exact) <= 1e-5 * abs(exact)
