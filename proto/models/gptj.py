"""GPT-J (Wang and Komatsuzaki, 2021), as Hugging Face's GPTJForCausalLM names and computes it:
the configuration, the weights by their names, and the rotary position embedding.

A block: one layer norm feeds attention and the MLP side by side, and both add to the
residual (x + attn(ln(x)) + mlp(ln(x))). Attention projects q, k, v and its output without
bias; the first `rotary_dim` dimensions of each head's q and k are rotated by their position
(`rotary`), the rest pass through. The MLP is fc_in, gelu_new (GPT-2's tanh GELU), fc_out,
with biases. The head is untied from the embedding and has a bias. No position table.

GPT-J-6B is GPTJConfig(n_layer=28, n_embd=4096, n_head=16, vocab_size=50400,
n_positions=2048, rotary_dim=64). The float64 reference is proto.models.reference.gptj_logits;
the device model is still to come (its issue: half precision, the graph stack).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check
from proto.models import checked_params, random_params

LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class GPTJConfig:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int
    rotary_dim: int
    n_inner: int | None = None   # the MLP's width; None: 4 * n_embd

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                _check.positive(field.name, value)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head: must divide n_embd={self.n_embd}, got {self.n_head}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: expected an even number at most the head dim "
                             f"{self.head_dim}, got {self.rotary_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd


GPTJ_6B = GPTJConfig(n_layer=28, n_embd=4096, n_head=16, vocab_size=50400, n_positions=2048,
                     rotary_dim=64)


def param_shapes(config: GPTJConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by its Hugging Face name. Linear weights are
    (out features, in features), as torch.nn.Linear stores them."""
    C, V, F = config.n_embd, config.vocab_size, config.inner
    shapes = {"transformer.wte.weight": (V, C)}
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.q_proj.weight": (C, C), p + "attn.k_proj.weight": (C, C),
            p + "attn.v_proj.weight": (C, C), p + "attn.out_proj.weight": (C, C),
            p + "mlp.fc_in.weight": (F, C), p + "mlp.fc_in.bias": (F,),
            p + "mlp.fc_out.weight": (C, F), p + "mlp.fc_out.bias": (C,),
        })
    shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,),
                   "lm_head.weight": (V, C), "lm_head.bias": (V,)})
    return shapes


def _is_buffer(key: str) -> bool:
    # Older transformers save each attention layer's causal mask; it holds no weights.
    return key.endswith((".attn.bias", ".attn.masked_bias"))


def load_state_dict(config: GPTJConfig, state_dict, *,
                    allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
    """Checked float32 weights (see proto.models.checked_params)."""
    return checked_params(param_shapes(config), state_dict, what="GPT-J", ignored=_is_buffer,
                          allow_nonfinite=allow_nonfinite)


def random_state_dict(config: GPTJConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights that keep activations unit-scale at every size (proto.models.random_params;
    Linear weights are (out, in))."""
    return random_params(param_shapes(config), seed, embeddings={"transformer.wte.weight"},
                         fan_in_axis=1)


def rotary_angles(positions, rotary_dim: int) -> np.ndarray:
    """(len(positions), rotary_dim // 2) float64 angles: position p turns its pair i by
    p * 10000^(-2i / rotary_dim)."""
    inv_freq = 10000.0 ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return np.outer(np.asarray(positions, np.float64), inv_freq)


def rotary(x, positions, rotary_dim: int) -> np.ndarray:
    """GPT-J's rotary embedding of x (..., T, head_dim) at `positions` (T,), float64: each
    pair of adjacent dimensions (2i, 2i+1) below rotary_dim is rotated by its angle, as
    complex multiplication by e^(i angle); the dimensions from rotary_dim on pass through.
    (GPT-J pairs neighbours, "rotate every two"; GPT-NeoX and LLaMA pair i with i + d/2.)"""
    x = np.asarray(x, np.float64)
    theta = rotary_angles(positions, rotary_dim)            # (T, rotary_dim / 2)
    cos, sin = np.cos(theta), np.sin(theta)
    even, odd = x[..., :rotary_dim:2], x[..., 1:rotary_dim:2]
    out = x.copy()
    out[..., :rotary_dim:2] = even * cos - odd * sin
    out[..., 1:rotary_dim:2] = even * sin + odd * cos
    return out
