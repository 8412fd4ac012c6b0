"""Wav2Vec2ForCTC's configuration, its weight names and random weights: what a PyTorch
baseline and the data need of the model, without the kernels (proto.models.wav2vec2 is the
model on them), so that a process measuring transformers loads none of ours."""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check   # (argument checks: no kernel)

POS_CONV_G = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original0"
POS_CONV_V = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original1"
# torch's older weight_norm names the same two tensors so; they load under the names above
_OLD_NAMES = {"wav2vec2.encoder.pos_conv_embed.conv.weight_g": POS_CONV_G,
              "wav2vec2.encoder.pos_conv_embed.conv.weight_v": POS_CONV_V}


@dataclasses.dataclass(frozen=True)
class Wav2Vec2Config:
    """wav2vec2-base's sizes by default (transformers' Wav2Vec2Config names in comments)."""
    conv_dim: tuple = (512,) * 7                  # conv_dim
    conv_kernel: tuple = (10, 3, 3, 3, 3, 2, 2)   # conv_kernel
    conv_stride: tuple = (5, 2, 2, 2, 2, 2, 2)    # conv_stride
    hidden: int = 768                             # hidden_size
    layers: int = 12                              # num_hidden_layers
    heads: int = 12                               # num_attention_heads
    ffn: int = 3072                               # intermediate_size
    vocab: int = 32                               # vocab_size
    pos_kernel: int = 128                         # num_conv_pos_embeddings
    pos_groups: int = 16                          # num_conv_pos_embedding_groups
    eps: float = 1e-5                             # layer_norm_eps
    blank: int = 0                                # pad_token_id: CTC's blank
    ctc_reduction: str = "sum"                    # ctc_loss_reduction
    zero_infinity: bool = False                   # ctc_zero_infinity

    def __post_init__(self):
        if not len(self.conv_dim) == len(self.conv_kernel) == len(self.conv_stride) >= 1:
            raise ValueError("conv_dim, conv_kernel, conv_stride: expected one entry per "
                             "feature-encoder layer each")
        if self.hidden % self.heads or self.hidden % self.pos_groups:
            raise ValueError(f"hidden {self.hidden}: expected a multiple of heads "
                             f"({self.heads}) and of pos_groups ({self.pos_groups})")
        if self.ctc_reduction not in ("sum", "mean"):
            raise ValueError(f"ctc_reduction: expected 'sum' or 'mean', got {self.ctc_reduction!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def frames(self, samples: int) -> int:
        """Frames the feature encoder makes of `samples` (0 if too short for one)."""
        n = int(samples)
        for k, s in zip(self.conv_kernel, self.conv_stride):
            if n < k:
                return 0
            n = (n - k) // s + 1
        return n

    def samples(self, frames: int) -> int:
        """The fewest samples that make `frames` frames (the waveform length a batch padded
        to that many frames has: a frame needs the samples its receptive field covers)."""
        n = _check.positive("frames", frames)
        for k, s in reversed(list(zip(self.conv_kernel, self.conv_stride))):
            n = (n - 1) * s + k
        return n

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter, in Hugging Face's names, in the order the flat buffer keeps."""
        shapes, c_in = {}, 1
        fe = "wav2vec2.feature_extractor.conv_layers"
        for i, (c, k) in enumerate(zip(self.conv_dim, self.conv_kernel)):
            shapes[f"{fe}.{i}.conv.weight"] = (c, c_in, k)
            if i == 0:
                shapes[f"{fe}.0.layer_norm.weight"] = (c,)
                shapes[f"{fe}.0.layer_norm.bias"] = (c,)
            c_in = c
        d, fp = self.hidden, "wav2vec2.feature_projection"
        shapes[f"{fp}.layer_norm.weight"] = shapes[f"{fp}.layer_norm.bias"] = (c_in,)
        shapes[f"{fp}.projection.weight"], shapes[f"{fp}.projection.bias"] = (d, c_in), (d,)
        shapes[POS_CONV_G] = (1, 1, self.pos_kernel)
        shapes[POS_CONV_V] = (d, d // self.pos_groups, self.pos_kernel)
        shapes["wav2vec2.encoder.pos_conv_embed.conv.bias"] = (d,)
        shapes["wav2vec2.encoder.layer_norm.weight"] = (d,)
        shapes["wav2vec2.encoder.layer_norm.bias"] = (d,)
        for i in range(self.layers):
            p = f"wav2vec2.encoder.layers.{i}"
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{p}.attention.{proj}.weight"] = (d, d)
                shapes[f"{p}.attention.{proj}.bias"] = (d,)
            shapes[f"{p}.layer_norm.weight"] = shapes[f"{p}.layer_norm.bias"] = (d,)
            shapes[f"{p}.feed_forward.intermediate_dense.weight"] = (self.ffn, d)
            shapes[f"{p}.feed_forward.intermediate_dense.bias"] = (self.ffn,)
            shapes[f"{p}.feed_forward.output_dense.weight"] = (d, self.ffn)
            shapes[f"{p}.feed_forward.output_dense.bias"] = (d,)
            shapes[f"{p}.final_layer_norm.weight"] = shapes[f"{p}.final_layer_norm.bias"] = (d,)
        shapes["lm_head.weight"], shapes["lm_head.bias"] = (self.vocab, d), (self.vocab,)
        return shapes


BASE = Wav2Vec2Config()
# A small model of the same architecture: tests on the simulator, and parity with transformers.
TINY = Wav2Vec2Config(conv_dim=(8, 8), conv_kernel=(4, 2), conv_stride=(2, 2), hidden=8,
                      layers=2, heads=2, ffn=16, vocab=6, pos_kernel=4, pos_groups=2)


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """torch.optim.AdamW's arguments (its defaults, but for the learning rate)."""
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01


def _ignored(key: str) -> bool:
    # present when SpecAugment is configured on; unused with it off
    return key == "wav2vec2.masked_spec_embed"


def random_state_dict(config: Wav2Vec2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights: matrices and convolutions N(0, 1/fan_in) (fan_in = the
    product of the input axes), norm gains 1 + N(0, 0.1^2), biases N(0, 0.1^2), the weight
    norm's g about the norm of its v (so the effective weight is unit-scale per tap)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in config.param_shapes().items():
        if key == POS_CONV_G:
            continue
        if len(shape) >= 2:
            fan_in = int(np.prod(shape[1:]))
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
        elif key.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        out[key] = value.astype(np.float32)
    v = out[POS_CONV_V].astype(np.float64)
    norms = np.sqrt((v ** 2).sum(axis=(0, 1), keepdims=True))
    out[POS_CONV_G] = (norms * (1.0 + 0.1 * rng.standard_normal(norms.shape))).astype(np.float32)
    return {k: out[k] for k in config.param_shapes()}
