"""Wav2Vec2ForCTC training on the kernels: the loss against a float64 NumPy model written from
the definitions, every gradient against finite differences of that model, the graphed step
(forward and backward phases) against the eager one bit for bit, and transformers' model."""
import dataclasses

import numpy as np
import pytest

from experiments import timit
from proto.device import backend
from proto.models import wav2vec2 as w2v
from proto.models import wav2vec2_reference as ref
from tests.helpers import dev

CFG = w2v.TINY


def _batch(cfg, frames=(6, 4), seed=0, label_lengths=(2, 1)):
    """A padded batch: sample b has frames[b] frames, the batch config.samples(max) samples."""
    rng = np.random.default_rng(seed)
    waves = [timit.normalize(rng.standard_normal(cfg.samples(f))) for f in frames]
    texts = [rng.integers(1, cfg.vocab, n).astype(np.int32) for n in label_lengths]
    (b,) = timit.make_batches(cfg, waves, texts, batch=len(frames), seed=seed)
    return b


def _device(b: timit.Batch):
    return dev(b.waveform), dev(b.frames), dev(b.labels), dev(b.label_lengths)


def test_frames_and_samples_invert_each_other():
    for cfg in (w2v.BASE, CFG):
        for T in (1, 2, 7, 65, 199):
            L = cfg.samples(T)
            assert cfg.frames(L) == T and cfg.frames(L - 1) == T - 1
    assert w2v.BASE.samples(199) == 63760   # about 4 s at 16 kHz


def test_loss_and_every_gradient_match_the_float64_model():
    """The loss equals the float64 model's; for every parameter tensor, <grad, u> along a
    random unit direction u equals the central difference of the float64 loss along u: the
    whole backward (and that no gradient is left unwritten) checked against the forward's
    definition."""
    cfg = dataclasses.replace(CFG, layers=1)
    state = w2v.random_state_dict(cfg, seed=2)
    b = _batch(cfg, seed=3)
    model = w2v.Wav2Vec2ForCTC(cfg, state)
    loss = model.train_step(*_device(b), update=False).copy_to_host()[0]
    want, _ = ref.loss_and_logits(cfg, state, b.waveform, b.frames, b.labels, b.label_lengths)
    assert np.isfinite(want) and want > 0
    # float32 through ~40 ops of unit-scale data: a few 1e-6 relative; 1e-4 leaves room
    assert abs(loss - want) <= 1e-4 * abs(want), (loss, want)
    grads = model.grads.to_host()
    rng = np.random.default_rng(4)
    h = 1e-4

    def loss_at(params):
        return ref.loss_and_logits(cfg, params, b.waveform, b.frames, b.labels,
                                   b.label_lengths)[0]
    base = {k: v.astype(np.float64) for k, v in state.items()}
    for name in state:
        u = rng.standard_normal(state[name].shape)
        u /= np.linalg.norm(u)
        plus, minus = dict(base), dict(base)
        plus[name], minus[name] = base[name] + h * u, base[name] - h * u
        fd = (loss_at(plus) - loss_at(minus)) / (2 * h)
        got = float((grads[name].astype(np.float64) * u).sum())
        # fd's truncation error is O(h^2) (~1e-8 here); the float32 gradient's error is a few
        # 1e-6 of the gradient's norm
        scale = np.linalg.norm(grads[name]) + 1e-3
        assert abs(got - fd) <= 1e-4 * scale, (name, got, fd)


@pytest.mark.slow   # (about a minute on the simulator)
def test_graphed_phases_equal_eager_steps_bit_for_bit():
    """Two AdamW steps, eager and through GraphedTraining (a two-phase graph per length on
    one tape, the batch written into the placeholders): identical weights."""
    cfg = dataclasses.replace(CFG, layers=1)
    state = w2v.random_state_dict(cfg, seed=5)
    batches = [_batch(cfg, frames=f, seed=s) for s, f in enumerate([(6, 4), (5, 5)])]
    eager = w2v.Wav2Vec2ForCTC(cfg, state)
    losses = [eager.train_step(*_device(b)).copy_to_host()[0] for b in batches]
    graphed = w2v.Wav2Vec2ForCTC(cfg, state)
    with w2v.GraphedTraining(graphed, batch=2, max_frames=6, max_label=2) as g:
        g.build([b.length for b in batches])
        assert g.num_graphs == 2 and g.graphs[6].phases == ("forward", "backward")
        assert g.private_bytes == 0 and g.arena_bytes > 0
        for b, want in zip(batches, losses):
            assert g.step(b).copy_to_host()[0] == want
        with pytest.raises(KeyError, match="no graph for 3 frames"):
            g.step(_batch(cfg, frames=(3, 2)))
    got, want = graphed.params.to_host(), eager.params.to_host()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_load_state_dict_replaces_the_weights_and_keeps_the_optimizer():
    """A model loaded with another's weights after that one's step computes the same loss
    bit for bit; its own step count and moments stay; a bad state dict changes nothing."""
    cfg = dataclasses.replace(CFG, layers=1)
    a = w2v.Wav2Vec2ForCTC(cfg, w2v.random_state_dict(cfg, seed=1))
    b = w2v.Wav2Vec2ForCTC(cfg, w2v.random_state_dict(cfg, seed=2))
    first, second = _batch(cfg, seed=0), _batch(cfg, frames=(5, 5), seed=1)
    a.train_step(*_device(first))
    trained = a.params.to_host()
    b.load_state_dict(trained)
    for name, value in b.params.to_host().items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)
    assert b.step_count.copy_to_host()[0] == 0
    assert all(not v.any() for v in b.m.to_host().values())
    want = a.train_step(*_device(second), update=False).copy_to_host()[0]
    assert b.train_step(*_device(second), update=False).copy_to_host()[0] == want
    broken = dict(trained)
    broken.pop("lm_head.bias")
    with pytest.raises(ValueError, match="lm_head.bias"):
        b.load_state_dict(broken)
    np.testing.assert_array_equal(b.params.to_host()["lm_head.weight"], trained["lm_head.weight"])


def test_packed_groups_are_one_array_and_every_name_keeps_its_tensor():
    """FlatParams lays a packed group's tensors back to back where its first name falls (a
    layer's q, k and v weights are then one (3d, d) matrix); every name still reads and
    writes its own tensor, the rest stay on 256-byte boundaries, a group not packed is
    refused by name."""
    shapes = {"a": (3,), "w.q": (2, 5), "b.q": (5,), "w.k": (2, 5), "b.k": (5,), "c": (7,)}
    host = {n: np.arange(np.prod(s), dtype=np.float32).reshape(s) + 100 * i
            for i, (n, s) in enumerate(shapes.items())}
    f = w2v.FlatParams(shapes, host, packed=(("w.q", "w.k"), ("b.q", "b.k")))
    np.testing.assert_array_equal(f.group(["w.q", "w.k"]).copy_to_host().reshape(4, 5),
                                  np.concatenate([host["w.q"], host["w.k"]]))
    np.testing.assert_array_equal(f.group(["b.q", "b.k"]).copy_to_host(),
                                  np.concatenate([host["b.q"], host["b.k"]]))
    for name, value in f.to_host().items():
        np.testing.assert_array_equal(value, host[name], err_msg=name)
        np.testing.assert_array_equal(f[name].copy_to_host(), host[name], err_msg=name)
    assert all(f.offsets[n] % f.ALIGN == 0 for n in ("a", "w.q", "b.q", "c"))
    with pytest.raises(ValueError, match="not a packed group"):
        f.group(["w.q", "b.q"])
    model = w2v.Wav2Vec2ForCTC(CFG, w2v.random_state_dict(CFG, seed=3))
    w, b = model._qkv(model.params, 1)
    state = model.params.to_host()
    a = "wav2vec2.encoder.layers.1.attention"
    np.testing.assert_array_equal(w.copy_to_host(), np.concatenate(
        [state[f"{a}.{x}_proj.weight"] for x in "qkv"]))
    np.testing.assert_array_equal(b.copy_to_host(), np.concatenate(
        [state[f"{a}.{x}_proj.bias"] for x in "qkv"]))


def test_bad_batches_are_refused_before_any_launch():
    model = w2v.Wav2Vec2ForCTC(CFG, w2v.random_state_dict(CFG))
    wave, frames, labels, lengths = _device(_batch(CFG))
    with pytest.raises(ValueError, match="waveform: 27 samples is not a whole number"):
        model.train_step(dev(np.zeros((2, 27), np.float32)), frames, labels, lengths)
    with pytest.raises(TypeError, match="frames"):
        model.train_step(wave, dev(np.zeros(2, np.int64)), labels, lengths)
    with pytest.raises(ValueError, match="labels: expected 2 rows"):
        model.train_step(wave, frames, dev(np.zeros((3, 2), np.int32)), lengths)
    with pytest.raises(ValueError, match="missing"):
        w2v.Wav2Vec2ForCTC(CFG, {})


def test_synthetic_epoch_spreads_like_timit():
    batches = timit.synthetic_epoch(w2v.BASE, steps=60, seed=1)
    lengths = [b.length for b in batches]
    assert len(batches) == 60 and 65 <= min(lengths) and max(lengths) <= 199
    for b in batches:
        assert b.waveform.shape == (8, w2v.BASE.samples(b.length))
        assert (b.label_lengths >= 1).all() and (b.label_lengths <= b.frames // 2).all()
        for r in range(8):   # each waveform is its frames' samples, zero after
            n = w2v.BASE.samples(int(b.frames[r]))
            assert not b.waveform[r, n:].any() and b.waveform[r, n - 1] != 0


# A larger model of the same architecture for the GPU lane (two minutes a step on the
# simulator): three feature-encoder layers with wav2vec2-base's first kernel and stride
MID = w2v.Wav2Vec2Config(conv_dim=(16, 16, 16), conv_kernel=(10, 3, 3), conv_stride=(5, 2, 2),
                         hidden=32, layers=2, heads=4, ffn=64, vocab=12, pos_kernel=8,
                         pos_groups=4)


def test_transformers_state_dict_and_loss_match():
    """transformers' Wav2Vec2ForCTC of the same config (float64, CPU): its state dict loads
    unchanged, and its loss and every gradient match ours (tiny on the simulator, MID on a
    GPU)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from experiments import torch_wav2vec2 as tw
    cfg, frames, labels = ((CFG, (6, 4), (2, 1)) if backend.SIMULATOR else
                           (MID, (12, 9), (4, 3)))
    torch.manual_seed(0)
    hf = transformers.Wav2Vec2ForCTC(tw.hf_config(cfg)).double()
    hf.config._attn_implementation = "eager"
    hf.train()
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    b = _batch(cfg, frames=frames, seed=7, label_lengths=labels)
    model = w2v.Wav2Vec2ForCTC(cfg, state)
    loss = model.train_step(*_device(b), update=False).copy_to_host()[0]
    inputs = tw.hf_inputs(cfg, b, device="cpu")
    inputs["input_values"] = inputs["input_values"].double()
    out = hf(**inputs)
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    # Errors relative to each tensor's largest gradient: transformers' own float32 run is
    # within 1.3e-6 of its float64 one at the tiny size, and so are we (3.9e-6 at MID, on the
    # simulator); 1e-5 leaves room. A
    # gradient that is zero in exact arithmetic (k_proj's bias: softmax ignores a shift) is
    # rounding noise in both, held to 1e-7 of the model's largest gradient.
    grads = model.grads.to_host()
    want = {w2v._OLD_NAMES.get(n, n): p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(want) == set(grads)
    largest = max(np.abs(g).max() for g in want.values())
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=0,
                                   atol=1e-5 * np.abs(g).max() + 1e-7 * largest, err_msg=name)


@pytest.mark.slow   # (about two minutes on the simulator)
def test_a_table_that_transposes_and_folds_keeps_graphed_equal_to_eager(monkeypatch):
    """A tile table that sends every tiled product of the step through the NT route and
    folds every split K (kernels.tuning's via_nt and fold): the graphed phases still equal
    the eager steps bit for bit (the transposes' scratch on the tape, the counters beside
    it), both routes are taken, and the loss is the untuned step's to float32 rounding."""
    from kernels import gemm as G, tuning
    from kernels._tile import Tiles
    cfg = dataclasses.replace(CFG, layers=1, hidden=16, ffn=64)   # (K up to 64: splits)
    state = w2v.random_state_dict(cfg, seed=7)
    batches = [_batch(cfg, frames=f, seed=s) for s, f in enumerate([(8, 6), (7, 7)])]
    untuned = w2v.Wav2Vec2ForCTC(cfg, state).train_step(*_device(batches[0]),
                                                        update=False).copy_to_host()[0]
    mma = Tiles(16, 32, 8, 2, 4, True)
    dims = (8, 16, 32, 64)   # (every product's m, n and k within a factor of 2 of one)
    monkeypatch.setattr(G, "TUNED", tuple(
        (at, (m, n, k), tuning.GemmChoice(mma, 0, False, True, True))
        for at in ((False, False), (False, True), (True, False))
        for m in dims for n in dims for k in dims))
    # Two K steps a split, the simulator's span: the GPU's (eight) would leave K <= 64
    # whole, so that no launch folds (as the GPU lane found)
    monkeypatch.setattr(G, "MIN_SPAN_STEPS", 2)
    folded, transposed = [], []   # (the model transposes activations of its own too)
    real_kernel, real_as_nt = G.tiled_kernel, G._as_nt
    monkeypatch.setattr(G, "tiled_kernel", lambda *a: (folded.append(a[-1]), real_kernel(*a))[1])
    monkeypatch.setattr(G, "_as_nt", lambda a, b, ta, tb, s: (transposed.append((ta, tb)),
                                                              real_as_nt(a, b, ta, tb, s))[1])
    eager = w2v.Wav2Vec2ForCTC(cfg, state)
    losses = [eager.train_step(*_device(b)).copy_to_host()[0] for b in batches]
    assert any(folded) and {(1, 0), (0, 0)} <= set(transposed)   # weight and data gradients
    assert abs(losses[0] - untuned) <= 1e-5 * abs(untuned)
    graphed = w2v.Wav2Vec2ForCTC(cfg, state)
    with w2v.GraphedTraining(graphed, batch=2, max_frames=8, max_label=2) as g:
        g.build([b.length for b in batches])
        for b, want in zip(batches, losses):
            assert g.step(b).copy_to_host()[0] == want
    got, want = graphed.params.to_host(), eager.params.to_host()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
