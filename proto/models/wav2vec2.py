"""Wav2Vec2 for CTC, trained on the kernels: forward, CTC loss, backward and AdamW, float32.

The architecture and the weight names are Hugging Face's `Wav2Vec2ForCTC` (wav2vec2-base:
`feat_extract_norm="group"`, post-norm encoder), so a `state_dict()` of it loads unchanged:

    waveform (B, L)
      feature encoder   7 conv1d (no bias), the first followed by a GroupNorm of one group per
                        channel, each by exact GELU                    -> (B, 512, T) frames
      projection        transpose to (B, T, 512), LayerNorm, Linear 512 -> 768
      padding           frames past each sample's length set to 0 (what transformers does
                        with an attention mask)
      positional conv   grouped conv1d (kernel 128, padding 64, 16 groups, weight norm over
                        the tap axis, bias), the last frame dropped, GELU; added to the input
      encoder           LayerNorm, then 12 post-norm layers: x = LN(x + attn(x));
                        x = LN(x + W2 gelu(W1 x)); attention masks keys past each length
      CTC head          Linear 768 -> vocab, then CTC loss (blank = pad token 0)

Dropout, LayerDrop and SpecAugment are off: a deterministic step, as a training run with
them at 0. The optimizer is torch.optim.AdamW over every parameter.

A training step is one function, `train_step`, written once for both ways of running it:
eagerly, kernel by kernel, and recorded as a graph (proto.graph) whose two phases, the
forward with the loss and the backward with the update (`proto.graph.phase`), are replayed
apart. Everything the forward saves for the backward is a temporary of the step
(`backend.empty(..., owner=self)`), so the memory planner sees the forward write and the
backward read of each and keeps its bytes between them.

Parameters, their gradients and AdamW's two moments each live in one flat device buffer
(`FlatParams`), a view per name: one launch updates every parameter.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check, adamw, conv1d, ctc, groupnorm, layernorm, layout
from kernels import elementwise as ew
from kernels import seq_attention
from kernels.linear import linear, linear_bwd_data, linear_bwd_weight
from proto.device.backend import cuda, empty, reshaped
from proto import shapes
from proto.graph import Tape, capture, phase
from proto.models import checked_params
from proto.models.wav2vec2_config import (  # noqa: F401 (the model's names, re-exported)
    _OLD_NAMES, BASE, POS_CONV_G, POS_CONV_V, TINY, AdamWConfig, Wav2Vec2Config, _ignored,
    random_state_dict)


class FlatParams:
    """Named tensors in one flat float32 device buffer (each at a 256-byte boundary), a view
    per name: parameters, their gradients and AdamW's moments share this layout, so one
    launch walks all of them. `packed`: groups of names laid back to back, with no padding
    between them, where the group's first name falls, so that `group(names)` is one array
    (Wav2Vec2's q, k and v weights: one (3d, d) matrix, one GEMM)."""

    ALIGN = 64  # float32 elements

    def __init__(self, shapes: dict[str, tuple[int, ...]], host: dict | None = None,
                 packed: tuple[tuple[str, ...], ...] = ()):
        self.shapes, self.packed = dict(shapes), tuple(tuple(g) for g in packed)
        leads = {group[0]: group for group in packed}
        later = {name for group in packed for name in group[1:]}
        self.offsets, n = {}, 0
        for name in self.shapes:
            if name in later:
                continue
            for member in leads.get(name, (name,)):
                self.offsets[member] = n
                n += math.prod(self.shapes[member])
            n = -(-n // self.ALIGN) * self.ALIGN
        self.flat = cuda.to_device(self._flat(host or {}, n))
        self.views = {name: self._view(self.flat, name) for name in self.shapes}

    def _view(self, flat, name: str):
        lo, shape = self.offsets[name], self.shapes[name]
        return flat[lo:lo + math.prod(shape)].reshape(shape)

    def group(self, names) -> object:
        """The 1-D view over a packed group's tensors, in the group's order."""
        if tuple(names) not in self.packed:
            raise ValueError(f"names: {list(names)} are not a packed group of this buffer")
        lo = self.offsets[names[0]]
        return self.flat[lo:lo + sum(math.prod(self.shapes[n]) for n in names)]

    def _flat(self, host: dict, n: int) -> np.ndarray:
        flat = np.zeros(max(n, 1), np.float32)
        for name, value in host.items():
            lo = self.offsets[name]
            flat[lo:lo + value.size] = value.ravel()
        return flat

    def load(self, host: dict) -> None:
        """Overwrite the buffer with `host` ({name: array}, every name; the padding zero)."""
        self.flat.copy_to_device(self._flat(host, self.flat.size))

    def __getitem__(self, name: str):
        return self.views[name]

    def to_host(self) -> dict[str, np.ndarray]:
        flat = self.flat.copy_to_host()
        return {name: self._view(flat, name) for name in self.shapes}


class Wav2Vec2ForCTC:
    """The model's parameters and optimizer state on the device, and its training step.

        model = Wav2Vec2ForCTC(BASE, state_dict)            # transformers' names
        loss = model.train_step(waveform, frames, labels, label_lengths)   # device arrays
        model.params.to_host()                               # the trained weights

    `train_step`'s arguments: waveform (B, L) float32 (each sample's audio, zero-padded to
    L = config.samples(T) for the batch's longest T frames), frames (B,) int32 (each
    sample's frames, config.frames of its unpadded length), labels (B, S) int32 padded,
    label_lengths (B,) int32. It returns the (1,) device array of the reduced loss."""

    name = "wav2vec2"

    def __init__(self, config: Wav2Vec2Config, state_dict, optimizer: AdamWConfig = AdamWConfig()):
        shapes = config.param_shapes()
        self.config, self.optimizer = config, optimizer
        # each layer's q, k and v weights back to back, and their biases: one projection
        qkv = [tuple(f"wav2vec2.encoder.layers.{i}.attention.{x}_proj.{kind}" for x in "qkv")
               for i in range(config.layers) for kind in ("weight", "bias")]
        self.params = FlatParams(shapes, self._checked(state_dict), packed=qkv)
        self.grads, self.m, self.v = (FlatParams(shapes, packed=qkv) for _ in range(3))
        # each layer's projection as one (weight, bias), in the weights and the gradients:
        # views made once (each device-array view costs host time in every eager step)
        self.qkv_params = [self._qkv(self.params, i) for i in range(config.layers)]
        self.qkv_grads = [self._qkv(self.grads, i) for i in range(config.layers)]
        self.step_count = cuda.to_device(np.zeros(1, np.int32))   # AdamW's t, on the device

    def _checked(self, state_dict) -> dict[str, np.ndarray]:
        state = {_OLD_NAMES.get(k, k): v for k, v in state_dict.items()}
        return checked_params(self.config.param_shapes(), state, what="Wav2Vec2ForCTC",
                              ignored=_ignored)

    def load_state_dict(self, state_dict) -> None:
        """Replace the weights (transformers' names, checked as the constructor checks
        them); gradients, AdamW's moments and step count stay: to go on from weights
        another run holds, or to take a step from the weights another implementation has."""
        self.params.load(self._checked(state_dict))

    # ------------------------------------------------------------------ the step
    def check_batch(self, waveform, frames, labels, label_lengths) -> tuple[int, int, int]:
        """(B, L, T): the batch's size, samples and frames; ValueError/TypeError naming the
        argument before any launch."""
        cfg = self.config
        _check.device_array("waveform", waveform, ndim=2)
        B, L = waveform.shape
        T = cfg.frames(L)
        if T < 1 or cfg.samples(T) != L:
            raise ValueError(f"waveform: {L} samples is not a whole number of frames; pad the "
                             f"batch to config.samples(frames) (e.g. {cfg.samples(max(T, 1))})")
        _check.device_array("frames", frames, dtype=np.int32, shape=(B,))
        _check.device_array("labels", labels, dtype=np.int32, ndim=2)
        if labels.shape[0] != B:
            raise ValueError(f"labels: expected {B} rows (the batch), got {labels.shape[0]}")
        _check.device_array("label_lengths", label_lengths, dtype=np.int32, shape=(B,))
        return B, L, T

    def train_step(self, waveform, frames, labels, label_lengths, *, update: bool = True):
        """Forward, CTC loss, phase "backward": backward and (if `update`) AdamW. Returns
        the loss (1,) on the device; the gradients are in `self.grads`."""
        B, L, T = self.check_batch(waveform, frames, labels, label_lengths)
        phase("forward")
        saved = self._forward(waveform, frames, B, T)
        V = self.config.vocab
        losses = empty((B,), np.float32, "ctc.losses", owner=self)
        loss = empty((1,), np.float32, "ctc.loss", owner=self)
        dlogits = empty((B, T, V), np.float32, "ctc.dlogits", owner=self)
        ctc.ctc_loss(saved["logits"], frames, labels, label_lengths, losses, loss, dlogits,
                     blank=self.config.blank, reduction=self.config.ctc_reduction,
                     zero_infinity=self.config.zero_infinity)
        phase("backward")
        self._backward(saved, reshaped(dlogits, (B * T, V)), frames, B, T)
        if update:
            o = self.optimizer
            adamw.adamw_advance(self.step_count)
            adamw.adamw_step(self.params.flat, self.grads.flat, self.m.flat, self.v.flat,
                             self.step_count, lr=o.lr, beta1=o.beta1, beta2=o.beta2,
                             eps=o.eps, weight_decay=o.weight_decay)
        return loss

    # ------------------------------------------------------------------ forward
    def _t(self, shape, name):
        return empty(shape, np.float32, name, owner=self)

    def _qkv(self, buffer: FlatParams, i: int):
        """Layer i's q, k and v projections as one, in `buffer` (the weights or their
        gradients): the (3d, d) weight and the (3d,) bias, packed back to back."""
        d, a = self.config.hidden, f"wav2vec2.encoder.layers.{i}.attention"
        return (buffer.group([f"{a}.{x}_proj.weight" for x in "qkv"]).reshape(3 * d, d),
                buffer.group([f"{a}.{x}_proj.bias" for x in "qkv"]))

    def _forward(self, waveform, frames, B: int, T: int) -> dict:
        cfg, p, t = self.config, self.params, self._t
        s = {}                                   # what the backward reads, by name
        fe = "wav2vec2.feature_extractor.conv_layers"
        a, n = reshaped(waveform, (B, 1, waveform.shape[1])), waveform.shape[1]
        for i, (c, k, st) in enumerate(zip(cfg.conv_dim, cfg.conv_kernel, cfg.conv_stride)):
            n = (n - k) // st + 1
            s[f"fe{i}.in"] = a
            out = s[f"fe{i}.conv"] = t((B, c, n), f"fe{i}.conv")
            conv1d.conv1d(a, p[f"{fe}.{i}.conv.weight"], None, out, stride=st)
            if i == 0:
                normed = s["fe0.norm"] = t((B, c, n), "fe0.norm")
                groupnorm.groupnorm(out, p[f"{fe}.0.layer_norm.weight"],
                                    p[f"{fe}.0.layer_norm.bias"], normed, groups=c, eps=cfg.eps)
                out = normed
            a = t((B, c, n), f"fe{i}.act")
            ew.gelu_erf(out, a)
        C, d = cfg.conv_dim[-1], cfg.hidden
        feat = s["fp.in"] = t((B, T, C), "fp.in")
        layout.transpose_last2(a, feat)
        fp = "wav2vec2.feature_projection"
        ln = s["fp.ln"] = t((B * T, C), "fp.ln")
        layernorm.layernorm(reshaped(feat, (B * T, C)), p[f"{fp}.layer_norm.weight"],
                            p[f"{fp}.layer_norm.bias"], ln, eps=cfg.eps)
        hid = t((B * T, d), "fp.out")
        linear(ln, p[f"{fp}.projection.weight"], p[f"{fp}.projection.bias"], hid)
        layout.zero_frames(reshaped(hid, (B, T, d)), frames)
        # positional convolution, channels first
        hid_t = s["pos.in"] = t((B, d, T), "pos.in")
        layout.transpose_last2(reshaped(hid, (B, T, d)), hid_t)
        w = s["pos.weight"] = t(p[POS_CONV_V].shape, "pos.weight")
        conv1d.weight_norm(p[POS_CONV_V], p[POS_CONV_G], w)
        pc = s["pos.conv"] = t((B, d, T), "pos.conv")
        conv1d.conv1d_grouped(hid_t, w, p["wav2vec2.encoder.pos_conv_embed.conv.bias"], pc,
                              groups=cfg.pos_groups, pad=cfg.pos_kernel // 2)
        pa = t((B, d, T), "pos.act")
        ew.gelu_erf(pc, pa)
        pos = t((B, T, d), "pos.out")
        layout.transpose_last2(pa, pos)
        x = s["enc.in"] = t((B * T, d), "enc.in")
        ew.add(hid, reshaped(pos, (B * T, d)), x)
        h = s["enc.ln"] = t((B * T, d), "enc.ln")
        layernorm.layernorm(x, p["wav2vec2.encoder.layer_norm.weight"],
                            p["wav2vec2.encoder.layer_norm.bias"], h, eps=cfg.eps)
        for i in range(cfg.layers):
            h = self._layer_forward(i, h, frames, B, T, s)
        s["head.in"] = h
        logits = s["logits"] = t((B, T, cfg.vocab), "logits")
        linear(h, p["lm_head.weight"], p["lm_head.bias"], reshaped(logits, (B * T, cfg.vocab)))
        return s

    def _layer_forward(self, i: int, h, frames, B: int, T: int, s: dict):
        cfg, p, t = self.config, self.params, self._t
        d, pre, q = cfg.hidden, f"wav2vec2.encoder.layers.{i}", f"l{i}."
        s[q + "in"] = h
        qkv = s[q + "qkv"] = t((B * T, 3 * d), q + "qkv")   # q, k, v side by side
        linear(h, *self.qkv_params[i], qkv)
        probs = s[q + "probs"] = t((B, cfg.heads, T, T), q + "probs")
        att = s[q + "att"] = t((B * T, d), q + "att")
        seq_attention.seq_attention(reshaped(qkv, (B, T, 3 * d)), frames,
                                    reshaped(att, (B, T, d)), probs, heads=cfg.heads,
                                    scale=cfg.head_dim ** -0.5)
        r1 = s[q + "r1"] = t((B * T, d), q + "r1")
        linear(att, p[f"{pre}.attention.out_proj.weight"], p[f"{pre}.attention.out_proj.bias"], r1)
        ew.add(r1, h, r1)
        h1 = s[q + "h1"] = t((B * T, d), q + "h1")
        layernorm.layernorm(r1, p[f"{pre}.layer_norm.weight"], p[f"{pre}.layer_norm.bias"], h1,
                            eps=cfg.eps)
        f1 = s[q + "f1"] = t((B * T, cfg.ffn), q + "f1")
        ff = f"{pre}.feed_forward"
        linear(h1, p[f"{ff}.intermediate_dense.weight"], p[f"{ff}.intermediate_dense.bias"], f1)
        g1 = s[q + "g1"] = t((B * T, cfg.ffn), q + "g1")
        ew.gelu_erf(f1, g1)
        r2 = s[q + "r2"] = t((B * T, d), q + "r2")
        linear(g1, p[f"{ff}.output_dense.weight"], p[f"{ff}.output_dense.bias"], r2)
        ew.add(r2, h1, r2)
        out = t((B * T, d), q + "out")
        layernorm.layernorm(r2, p[f"{pre}.final_layer_norm.weight"],
                            p[f"{pre}.final_layer_norm.bias"], out, eps=cfg.eps)
        return out

    # ------------------------------------------------------------------ backward
    def _backward(self, s: dict, dlogits, frames, B: int, T: int) -> None:
        cfg, p, g, t = self.config, self.params, self.grads, self._t
        d = cfg.hidden
        dh = t((B * T, d), "d.enc")
        top = self._layer_output(cfg.layers - 1, s)
        linear_bwd_data(dlogits, p["lm_head.weight"], dh)
        linear_bwd_weight(top, dlogits, g["lm_head.weight"], g["lm_head.bias"])
        for i in reversed(range(cfg.layers)):
            dh = self._layer_backward(i, dh, B, T, s)
        # encoder layer norm, then the sum of the projection and the positional conv
        dx = t((B * T, d), "d.enc.in")
        layernorm.layernorm_bwd(s["enc.in"], p["wav2vec2.encoder.layer_norm.weight"], dh, dx,
                                g["wav2vec2.encoder.layer_norm.weight"],
                                g["wav2vec2.encoder.layer_norm.bias"], eps=cfg.eps)
        dpa = t((B, d, T), "d.pos.act")
        layout.transpose_last2(reshaped(dx, (B, T, d)), dpa)
        dpc = t((B, d, T), "d.pos.conv")
        ew.gelu_erf_bwd(s["pos.conv"], dpa, dpc)
        dhid_t = t((B, d, T), "d.pos.in")
        pad = cfg.pos_kernel // 2
        conv1d.conv1d_grouped_bwd_data(dpc, s["pos.weight"], dhid_t, groups=cfg.pos_groups, pad=pad)
        dw = t(p[POS_CONV_V].shape, "d.pos.weight")
        conv1d.conv1d_grouped_bwd_weight(s["pos.in"], dpc, dw,
                                         g["wav2vec2.encoder.pos_conv_embed.conv.bias"],
                                         groups=cfg.pos_groups, pad=pad)
        conv1d.weight_norm_bwd(p[POS_CONV_V], p[POS_CONV_G], dw, g[POS_CONV_V], g[POS_CONV_G])
        dhid = t((B * T, d), "d.fp.out")
        layout.transpose_last2(dhid_t, reshaped(dhid, (B, T, d)))
        ew.add(dhid, dx, dhid)
        layout.zero_frames(reshaped(dhid, (B, T, d)), frames)   # the padding's zeros are constants
        fp, C = "wav2vec2.feature_projection", cfg.conv_dim[-1]
        dln = t((B * T, C), "d.fp.ln")
        linear_bwd_data(dhid, p[f"{fp}.projection.weight"], dln)
        linear_bwd_weight(s["fp.ln"], dhid, g[f"{fp}.projection.weight"], g[f"{fp}.projection.bias"])
        dfeat = t((B * T, C), "d.fp.in")
        layernorm.layernorm_bwd(reshaped(s["fp.in"], (B * T, C)), p[f"{fp}.layer_norm.weight"],
                                dln, dfeat, g[f"{fp}.layer_norm.weight"],
                                g[f"{fp}.layer_norm.bias"], eps=cfg.eps)
        da = t((B, C, T), f"d.fe{len(cfg.conv_dim) - 1}.act")
        layout.transpose_last2(reshaped(dfeat, (B, T, C)), da)
        self._feature_encoder_backward(s, da, B)

    def _layer_output(self, i: int, s: dict):
        """Layer i's output: the next layer's saved input, or (the last layer) what the head
        read, kept for the head's weight gradient."""
        return s[f"l{i + 1}.in"] if i + 1 < self.config.layers else s["head.in"]

    def _layer_backward(self, i: int, dout, B: int, T: int, s: dict):
        cfg, p, g, t = self.config, self.params, self.grads, self._t
        d, pre, q = cfg.hidden, f"wav2vec2.encoder.layers.{i}", f"l{i}."
        ff = f"{pre}.feed_forward"
        dr2 = t((B * T, d), q + "d.r2")
        layernorm.layernorm_bwd(s[q + "r2"], p[f"{pre}.final_layer_norm.weight"], dout, dr2,
                                g[f"{pre}.final_layer_norm.weight"],
                                g[f"{pre}.final_layer_norm.bias"], eps=cfg.eps)
        dg1 = t((B * T, cfg.ffn), q + "d.g1")
        linear_bwd_data(dr2, p[f"{ff}.output_dense.weight"], dg1)
        linear_bwd_weight(s[q + "g1"], dr2, g[f"{ff}.output_dense.weight"],
                          g[f"{ff}.output_dense.bias"])
        ew.gelu_erf_bwd(s[q + "f1"], dg1, dg1)
        dh1 = t((B * T, d), q + "d.h1")
        linear_bwd_data(dg1, p[f"{ff}.intermediate_dense.weight"], dh1)
        linear_bwd_weight(s[q + "h1"], dg1, g[f"{ff}.intermediate_dense.weight"],
                          g[f"{ff}.intermediate_dense.bias"])
        ew.add(dh1, dr2, dh1)
        dr1 = t((B * T, d), q + "d.r1")
        layernorm.layernorm_bwd(s[q + "r1"], p[f"{pre}.layer_norm.weight"], dh1, dr1,
                                g[f"{pre}.layer_norm.weight"], g[f"{pre}.layer_norm.bias"],
                                eps=cfg.eps)
        datt = t((B * T, d), q + "d.att")
        att = f"{pre}.attention"
        linear_bwd_data(dr1, p[f"{att}.out_proj.weight"], datt)
        linear_bwd_weight(s[q + "att"], dr1, g[f"{att}.out_proj.weight"], g[f"{att}.out_proj.bias"])
        dqkv = t((B * T, 3 * d), q + "d.qkv")
        seq_attention.seq_attention_bwd(reshaped(s[q + "qkv"], (B, T, 3 * d)), s[q + "probs"],
                                        reshaped(datt, (B, T, d)),
                                        reshaped(dqkv, (B, T, 3 * d)),
                                        heads=cfg.heads, scale=cfg.head_dim ** -0.5)
        din = t((B * T, d), q + "d.in")   # din = dr1 + dqkv @ W_qkv (q, k, v's in one sum)
        linear_bwd_data(dqkv, self.qkv_params[i][0], din)
        linear_bwd_weight(s[q + "in"], dqkv, *self.qkv_grads[i])
        ew.add(din, dr1, din)
        return din

    def _feature_encoder_backward(self, s: dict, da, B: int) -> None:
        cfg, p, g, t = self.config, self.params, self.grads, self._t
        fe = "wav2vec2.feature_extractor.conv_layers"
        for i in reversed(range(len(cfg.conv_dim))):
            pre = s["fe0.norm"] if i == 0 else s[f"fe{i}.conv"]
            dpre = t(pre.shape, f"d.fe{i}.pre")
            ew.gelu_erf_bwd(pre, da, dpre)
            dconv = dpre
            if i == 0:
                dconv = t(pre.shape, "d.fe0.conv")
                groupnorm.groupnorm_bwd(s["fe0.conv"], p[f"{fe}.0.layer_norm.weight"], dpre,
                                        dconv, g[f"{fe}.0.layer_norm.weight"],
                                        g[f"{fe}.0.layer_norm.bias"], groups=cfg.conv_dim[0],
                                        eps=cfg.eps)
            x = s[f"fe{i}.in"]
            conv1d.conv1d_bwd_weight(x, dconv, g[f"{fe}.{i}.conv.weight"], None,
                                     stride=cfg.conv_stride[i])
            if i > 0:   # (the waveform needs no gradient)
                da = t(x.shape, f"d.fe{i - 1}.act")
                conv1d.conv1d_bwd_data(dconv, p[f"{fe}.{i}.conv.weight"], da,
                                       stride=cfg.conv_stride[i])


# --------------------------------------------------------------------------- graphed training
class GraphedTraining:
    """Grape's dynamic-shape training: a two-phase graph (forward with the loss, backward with
    the update) of `model.train_step` per frame count, all on one memory tape.

        g = GraphedTraining(model, batch=8, max_frames=199, max_label=100)
        g.build(lengths)             # every length the epoch will serve, largest first
        loss = g.step(batch)         # experiments.timit.Batch: written into the
                                     # placeholders, forward replayed, then backward
        g.num_graphs, g.memory_bytes, g.arena_bytes, g.private_bytes
        g.close()

    Inputs are bound by alias: the batch is written straight into the placeholders every
    graph records on. One waveform buffer holds every length's batch at its start (a length's
    placeholder is its (B, samples) prefix), and the frames, labels and label lengths are one
    buffer each, so the data loader's one write serves whichever graph replays next.

    planned=True places every length's temporaries, the activations the backward reads
    included, on the tape: its arena is what the largest length needs. planned=False gives
    each graph private buffers, what per-length graphs without a planner hold."""

    def __init__(self, model: Wav2Vec2ForCTC, *, batch: int, max_frames: int, max_label: int,
                 planned: bool = True):
        cfg = model.config
        self.model, self.batch = model, _check.positive("batch", batch)
        self.max_frames = _check.positive("max_frames", max_frames)
        self.max_label = _check.positive("max_label", max_label)
        self.tape = Tape(model.name) if planned else None
        self.wave = cuda.to_device(np.zeros(batch * cfg.samples(max_frames), np.float32))
        self.frames = cuda.to_device(np.zeros(batch, np.int32))
        self.labels = cuda.to_device(np.zeros((batch, max_label), np.int32))
        self.label_lengths = cuda.to_device(np.zeros(batch, np.int32))
        self._labels_host = np.zeros((batch, max_label), np.int32)
        # a graph per frame count, built only for the lengths asked (build), on one tape
        self.shapes = shapes.ShapeDispatcher(self._capture, strategy="exact",
                                             max_length=max_frames, dynamic=(),
                                             largest_first=False)
        self.closed = False

    @property
    def graphs(self) -> dict:
        """Frame count -> its two-phase graph, for the lengths built so far."""
        return self.shapes.graphs

    def placeholders(self, frames: int) -> dict:
        L = self.model.config.samples(frames)
        return {"waveform": reshaped(self.wave[:self.batch * L], (self.batch, L)),
                "frames": self.frames, "labels": self.labels, "label_lengths": self.label_lengths}

    def build(self, lengths, after_each=None) -> None:
        """Capture the graphs of these frame counts not built yet, largest first (a tape's
        arena is sized by its first graph); `after_each(graphs built)` after each."""
        self._require_open("build")
        for T in sorted({int(t) for t in lengths}, reverse=True):
            if T in self.graphs:
                continue
            if not 1 <= T <= self.max_frames:
                raise ValueError(f"lengths: {T} frames outside 1..max_frames={self.max_frames}")
            if self.graphs and T > max(self.graphs) and self.tape is not None:
                raise ValueError(f"lengths: {T} frames is longer than the graphs built on this "
                                 f"tape ({max(self.graphs)}); build the longest first")
            self.shapes.graph(T)
            if after_each is not None:
                after_each(len(self.graphs))

    def _capture(self, frames: int):
        return capture(self.model.train_step, self.placeholders(frames), binding="alias",
                             warmup=0, planned=self.tape is not None, tape=self.tape)

    def write(self, batch) -> int:
        """Write a host batch (experiments.timit.Batch) into the placeholders; its length."""
        T = batch.length
        if batch.waveform.shape != (self.batch, self.model.config.samples(T)):
            raise ValueError(f"batch.waveform: expected shape {(self.batch, self.model.config.samples(T))} "
                             f"for {T} frames, got {batch.waveform.shape}")
        if batch.labels.shape[1] > self.max_label:
            raise ValueError(f"batch.labels: {batch.labels.shape[1]} labels exceed "
                             f"max_label={self.max_label}")
        self.placeholders(T)["waveform"].copy_to_device(np.ascontiguousarray(batch.waveform))
        self.frames.copy_to_device(batch.frames.astype(np.int32))
        self._labels_host[:] = 0
        self._labels_host[:, :batch.labels.shape[1]] = batch.labels
        self.labels.copy_to_device(self._labels_host)
        self.label_lengths.copy_to_device(batch.label_lengths.astype(np.int32))
        return T

    def step(self, batch):
        """One training step on `batch` through its length's graphs; the loss (1,) on the
        device (valid until the next step)."""
        self._require_open("step")
        T = self.write(batch)
        if T not in self.graphs:
            raise KeyError(f"step: no graph for {T} frames; build() every length first")
        g = self.graphs[T]
        loss = g.replay(phase="forward", **g.placeholders)
        g.replay(phase="backward")
        return loss

    @property
    def num_graphs(self) -> int:
        return self.shapes.num_graphs

    @property
    def memory_bytes(self) -> int | None:
        """Driver memory of every graph's executables (None on the simulator)."""
        return self.shapes.memory_bytes

    @property
    def arena_bytes(self) -> int:
        return self.tape.arena_bytes if self.tape is not None else 0

    @property
    def private_bytes(self) -> int:
        return sum(g.private_bytes for g in self.graphs.values())

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: this GraphedTraining is closed")

    def close(self) -> None:
        self.shapes.close()
        if self.tape is not None:
            self.tape.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
