"""GPT-J (Wang and Komatsuzaki, 2021), as Hugging Face's GPTJForCausalLM names and computes it:
the configuration, the weights by their names, and the rotary position embedding.

A block: one layer norm feeds attention and the MLP side by side, and both add to the
residual (x + attn(ln(x)) + mlp(ln(x))). Attention projects q, k, v and its output without
bias; the first `rotary_dim` dimensions of each head's q and k are rotated by their position
(`rotary`), the rest pass through. The MLP is fc_in, gelu_new (GPT-2's tanh GELU), fc_out,
with biases. The head is untied from the embedding and has a bias. No position table.

GPT-J-6B is GPTJConfig(n_layer=28, n_embd=4096, n_head=16, vocab_size=50400,
n_positions=2048, rotary_dim=64). The float64 reference is proto.models.reference.gptj_logits.

    model = GPTJ(config, state_dict, max_batch=5, max_tokens=8)        # float16 by default
    cache = KVCache(config, batch=5, max_len=1024, dtype=model.dtype)
    logits = model.step(tokens, pos, cache)        # (B, T, V) of model.dtype

The device model stores weights, activations, the KV cache and logits in its `dtype`
(float16, as GPT-J-6B runs; float32 too) and computes every sum in float32. A step is
GPT-2's protocol (proto.models.gpt2): temporaries by name through `backend.empty`, the
position a device int32 read on the device, no host sync, so a graph records it as it is.
Per layer: ln_1 (the previous layer's fc_out writes it where its rows fit the fused layer
norm, else a layer norm launch); q, k and v (against the three weights stacked (3C, C) at
load) and fc_in with its bias and GELU, both products of ln_1's rows, as one
(`gemm.gemm_two_outputs`); the rotary embedding in place, attention over the cache; then
the output projection and fc_out added into the residual as one product over both
(`gemm.gemm_sum`), with fc_out's bias. On tensor cores each pair is one launch that streams
both weights (235 and 168 MB), so no product pays a launch's ramp and tail alone: the
projection's 33 MB took about half its time in them. Products of more than 8 rows (a
prefill of B * T > 8 tokens) run in chunks of 8 rows: the half-precision GEMMs are the
decode kernels.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check, attention, embedding, gemm, rotary as rotary_kernel
from proto.device.backend import cuda, empty, is_device_array, reshaped
from proto.models import (checked_device_params, checked_params, model_dtype, on_device_as,
                          random_device_params, random_params)
from proto.models.kv_cache import KVCache, check_step

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


def random_device_state_dict(config: GPTJConfig, seed: int = 0, dtype=np.float16) -> dict:
    """random_state_dict's laws drawn on the device in `dtype` (proto.models.random_device_params):
    GPT-J-6B's 12 GB of float16 without a host round trip. Other values than random_state_dict's."""
    return random_device_params(param_shapes(config), seed, dtype,
                                embeddings={"transformer.wte.weight"}, fan_in_axis=1)


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


@dataclasses.dataclass(frozen=True)
class _Layer:
    ln_1_w: object
    ln_1_b: object
    qkv_w: object      # (3C, C): q_proj, k_proj, v_proj stacked
    out_w: object      # (C, C)
    fc_in_w: object    # (F, C)
    fc_in_b: object
    fc_out_w: object   # (C, F)
    fc_out_b: object


class GPTJ:
    """GPT-J forward over `max_batch` sequences of up to `max_tokens` new tokens a step."""

    def __init__(self, config: GPTJConfig, state_dict, *, max_batch: int, max_tokens: int,
                 dtype=np.float16, allow_nonfinite: bool = False):
        self.dtype = model_dtype(dtype)
        self.config = config
        self.max_batch = _check.positive("max_batch", max_batch)
        self.max_tokens = _check.positive("max_tokens", max_tokens, at_most=config.n_positions)
        w = self._device_weights(config, state_dict, allow_nonfinite)
        C = config.n_embd

        def stacked(i):   # q, k, v one (3C, C) weight: one GEMM (device to device copies)
            qkv = cuda.device_array((3 * C, C), self.dtype)
            for j, n in enumerate("qkv"):
                qkv[j * C:(j + 1) * C].copy_to_device(
                    w[f"transformer.h.{i}.attn.{n}_proj.weight"])
            return qkv
        self.wte = w["transformer.wte.weight"]
        self.ln_f_w, self.ln_f_b = w["transformer.ln_f.weight"], w["transformer.ln_f.bias"]
        self.head_w, self.head_b = w["lm_head.weight"], w["lm_head.bias"]
        self.layers = [
            _Layer(*(w[f"transformer.h.{i}.{n}"] for n in ("ln_1.weight", "ln_1.bias")),
                   stacked(i), w[f"transformer.h.{i}.attn.out_proj.weight"],
                   *(w[f"transformer.h.{i}.mlp.{n}"] for n in (
                       "fc_in.weight", "fc_in.bias", "fc_out.weight", "fc_out.bias")))
            for i in range(config.n_layer)]

    def _device_weights(self, config, state_dict, allow_nonfinite: bool) -> dict:
        """Every weight on the device in the model's dtype, by name. Device arrays of that
        dtype (say random_device_state_dict's, or a torch model's wrapped by
        numba.cuda.as_cuda_array) are taken as they are, with no host round trip; host
        arrays are checked (load_state_dict), converted and copied."""
        if state_dict and all(is_device_array(v) for v in state_dict.values()):
            return checked_device_params(param_shapes(config), state_dict, self.dtype,
                                         what="GPT-J", ignored=_is_buffer)
        return on_device_as(load_state_dict(config, state_dict, allow_nonfinite=allow_nonfinite),
                            self.dtype, "GPT-J")

    def decode_read_bytes(self, batch: int, length: int) -> tuple[int, int]:
        """(weight bytes, KV-cache bytes) a decode step of `batch` sequences at `length` live
        positions reads at least once: every weight, and every layer's live K and V."""
        arrays = [self.wte, self.ln_f_w, self.ln_f_b, self.head_w, self.head_b]
        arrays += [getattr(layer, f.name) for layer in self.layers
                   for f in dataclasses.fields(layer)]
        weights = sum(a.nbytes for a in arrays) - self.wte.nbytes + \
            self.wte.nbytes // self.wte.shape[0] * batch   # (the embedding: a row a sequence)
        c = self.config
        return int(weights), 2 * c.n_layer * batch * length * c.n_embd * self.dtype.itemsize

    def _empty(self, name: str, *shape):
        return empty(shape, self.dtype, name, owner=self)

    @staticmethod
    def _gemm(a, w, out, **kw):
        """out = a @ w.T (+ ...): Hugging Face's Linear weights are (out, in)."""
        gemm.gemm(a, w, out, trans_b=True, **kw)

    def step(self, tokens, pos, cache: KVCache, stream=0):
        """Run T new tokens of B sequences; return their logits.

        tokens: device int32 (B, T), B <= max_batch, T <= max_tokens, values in [0, vocab).
        pos:    device int32 (1,): absolute position of tokens[:, 0]; read on the device.
        cache:  KVCache of this config, batch B and the model's dtype; positions pos..pos+T-1
                are written, 0..pos-1 read. The caller keeps pos + T <= cache.max_len.
        Returns device (B, T, V) logits of the model's dtype, overwritten by the next step.
        """
        B, T = check_step(tokens, pos, cache, config=self.config, max_batch=self.max_batch,
                          max_tokens=self.max_tokens, dtype=self.dtype)
        c = self.config
        C, V, F, N = c.n_embd, c.vocab_size, c.inner, B * T
        x = self._empty("x", B, T, C)               # the residual stream, updated in place
        x2 = reshaped(x, (N, C))
        # Every layer norm rides on the launch that writes the residual it normalizes where
        # that launch can: ln_1 of the first layer on the embedding, each next ln_1 and ln_f
        # on the block's last product (gemm fuses it into its split-K reduction or runs
        # it right after).
        first, ln = self.layers[0], self._empty("ln_1", N, C)
        embedding.embed(tokens, self.wte, x, stream=stream,
                        ln_out=(first.ln_1_w, first.ln_1_b, LN_EPS, reshaped(ln, (B, T, C))))
        after = [(L.ln_1_w, L.ln_1_b) for L in self.layers[1:]] + [(self.ln_f_w, self.ln_f_b)]
        for i, (L, (gamma, beta)) in enumerate(zip(self.layers, after)):
            qkv = self._empty(f"h{i}.qkv", B, T, 3 * C)
            h = self._empty(f"h{i}.fc_in", N, F)   # attention and the MLP both read ln(x)
            gemm.gemm_two_outputs(ln, L.qkv_w, reshaped(qkv, (N, 3 * C)), L.fc_in_w, h,
                                  bias2=L.fc_in_b, act2="gelu", stream=stream)
            rotary_kernel.rotary(qkv, pos, n_head=c.n_head, rotary_dim=c.rotary_dim,
                                 stream=stream)
            att = self._empty(f"h{i}.att", B, T, C)
            attention.attention(qkv, cache.k[i], cache.v[i], pos, att, n_head=c.n_head,
                                rows=cache.rows, stream=stream)
            ln = self._empty(f"h{i}.ln_next", N, C)   # the next ln_1, after the last ln_f
            # both branches add into the residual: x += att @ W_out.T + h @ W_fc_out.T + b
            gemm.gemm_sum(reshaped(att, (N, C)), L.out_w, h, L.fc_out_w, x2, bias=L.fc_out_b,
                          accumulate=True, ln_out=(gamma, beta, LN_EPS, ln), stream=stream)
        logits = self._empty("logits", B, T, V)
        self._gemm(ln, self.head_w, reshaped(logits, (N, V)), bias=self.head_b, stream=stream)
        return logits
