"""GPT-2-style decoder with a KV cache.

    model = GPT2(config, state_dict, max_batch=5, max_tokens=8)
    cache = KVCache(config, batch=5, max_len=64)
    logits = model.step(tokens, pos, cache)          # (B, T, V), valid until the next step

A step launches kernels and allocates its temporaries through ``proto.device.backend.empty`` under
names unique within the step ("h3.att", "logits"): eagerly those are buffers kept per name,
and while a graph records the step they become buffers the memory planner places (one arena
shared by every graph of the model, the same address for a name in each). The step makes no
host sync and reads no device value on the host, so a graph recorder can capture it as it
is. The position is a device int32 (1,) array that the embedding and attention kernels read
on the device: one captured step serves every position.

Weights: a Hugging Face `GPT2LMHeadModel.state_dict()` as NumPy arrays. Conv1D stores its
weight [in, out], so every projection is `x @ W + b` with no transpose; the output head is
tied to the token embedding (`lm_head.weight`, when present, must equal `transformer.wte`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check, attention, embedding, gemm, mlp, self_attention
from proto.device.backend import empty, reshaped
from proto.models import checked_params, model_dtype, on_device_as, random_params
from proto.models.kv_cache import KVCache, check_step

LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    n_positions: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _check.positive(field.name, getattr(self, field.name))
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head: must divide n_embd={self.n_embd}, got {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def param_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by its Hugging Face name."""
    C, V, P = config.n_embd, config.vocab_size, config.n_positions
    shapes = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (P, C)}
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (C, 4 * C), p + "mlp.c_fc.bias": (4 * C,),
            p + "mlp.c_proj.weight": (4 * C, C), p + "mlp.c_proj.bias": (C,),
        })
    shapes.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)})
    return shapes


def _is_buffer(key: str) -> bool:
    # Older transformers save the causal mask of each attention layer; it holds no weights.
    return key.endswith((".attn.bias", ".attn.masked_bias"))


def load_state_dict(config: GPT2Config, state_dict, *,
                    allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
    """Checked float32 weights (see proto.models.checked_params); rejects an untied head."""
    shapes = param_shapes(config)
    params = checked_params(shapes, state_dict, what="GPT-2",
                            ignored=lambda k: k == "lm_head.weight" or _is_buffer(k),
                            allow_nonfinite=allow_nonfinite)
    if "lm_head.weight" in state_dict:
        head = np.asarray(state_dict["lm_head.weight"])
        if head.shape != shapes["transformer.wte.weight"] or not np.array_equal(
                head, params["transformer.wte.weight"]):
            raise ValueError("GPT-2 state_dict['lm_head.weight']: expected it tied to "
                             "transformer.wte.weight (equal values); an untied head is not supported")
    return params


def random_state_dict(config: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights that keep activations unit-scale at every size (proto.models.random_params;
    Conv1D weights are (in, out))."""
    return random_params(param_shapes(config), seed,
                         embeddings={"transformer.wte.weight", "transformer.wpe.weight"},
                         fan_in_axis=0)


# The four projections' weights: Conv1D's (in, out) in float32, where the fused kernels and
# the [K, N] decode kernels read them so; transposed to Linear's (out, in) in half precision,
# where only a trans_b product runs on tensor cores (gemm.make_decode_mma)
_PROJECTIONS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                "mlp.c_proj.weight")


@dataclasses.dataclass(frozen=True)
class _Layer:
    ln_1_w: object
    ln_1_b: object
    attn_w: object
    attn_b: object
    attn_proj_w: object
    attn_proj_b: object
    ln_2_w: object
    ln_2_b: object
    fc_w: object
    fc_b: object
    mlp_proj_w: object
    mlp_proj_b: object


class GPT2:
    """GPT-2 forward over `max_batch` sequences of up to `max_tokens` new tokens per step."""

    def __init__(self, config: GPT2Config, state_dict, *, max_batch: int, max_tokens: int,
                 dtype=np.float32, allow_nonfinite: bool = False):
        self.dtype = model_dtype(dtype)
        params = load_state_dict(config, state_dict, allow_nonfinite=allow_nonfinite)
        self.config = config
        self.max_batch = _check.positive("max_batch", max_batch)
        self.max_tokens = _check.positive("max_tokens", max_tokens, at_most=config.n_positions)
        if self.dtype != np.float32:   # (out, in): every decode product trans_b, see _half_step
            params = {k: np.ascontiguousarray(v.T) if k.endswith(_PROJECTIONS) else v
                      for k, v in params.items()}
        w = on_device_as(params, self.dtype, "GPT-2")
        self.wte, self.wpe = w["transformer.wte.weight"], w["transformer.wpe.weight"]
        self.ln_f_w, self.ln_f_b = w["transformer.ln_f.weight"], w["transformer.ln_f.bias"]
        self.layers = [
            _Layer(*(w[f"transformer.h.{i}.{name}"] for name in (
                "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")))
            for i in range(config.n_layer)]

    def decode_read_bytes(self, batch: int, length: int) -> tuple[int, int]:
        """(weight bytes, KV-cache bytes) a decode step of `batch` sequences at `length` live
        positions must read at least once: every weight (the tied embedding counts once: the
        output head reads all of it) but one position row of wpe, and every layer's live K
        and V. What a bandwidth floor for the step counts."""
        arrays = [self.wte, self.ln_f_w, self.ln_f_b]
        arrays += [getattr(layer, f.name) for layer in self.layers
                   for f in dataclasses.fields(layer)]
        weights = sum(a.nbytes for a in arrays) + self.wpe.nbytes // self.wpe.shape[0]
        c = self.config
        return int(weights), 2 * c.n_layer * batch * length * c.n_embd * self.dtype.itemsize

    def _empty(self, name: str, *shape):
        return empty(shape, self.dtype, name, owner=self)

    def step(self, tokens, pos, cache: KVCache, stream=0):
        """Run T new tokens of B sequences; return their logits.

        tokens: device int32 (B, T), B <= max_batch, T <= max_tokens, values in [0, vocab).
        pos:    device int32 (1,): absolute position of tokens[:, 0]; read on the device.
        cache:  KVCache with batch B; positions pos..pos+T-1 are written, 0..pos-1 are read.
                The caller keeps pos + T <= cache.max_len (the step never reads pos on the host).
        Returns device (B, T, V) logits of the model's dtype, overwritten by the model's next
        step: logits[:, -1] are the next-token scores. For T = 1 it reshapes to a contiguous
        (B, V).
        """
        B, T = check_step(tokens, pos, cache, config=self.config, max_batch=self.max_batch,
                          max_tokens=self.max_tokens, dtype=self.dtype)
        if self.dtype != np.float32:
            return self._half_step(tokens, pos, cache, B, T, stream)
        C, V, N = self.config.n_embd, self.config.vocab_size, B * T
        x = self._empty("x", B, T, C)               # the residual stream, updated in place
        x2 = reshaped(x, (N, C))   # (the same view object step after step)
        # Every layer norm rides on the launch that writes the residual it normalizes: the
        # first ln_1 on the embedding, ln_2 on the attention projection (in its split-K
        # reduction), the next layer's ln_1 and finally ln_f on the MLP (in its sum's launch:
        # each row's last block, kernels.mlp). ln_1 holds the rows the next qkv reads.
        first, ln_1 = self.layers[0], self._empty("ln_1", N, C)
        embedding.embed(tokens, self.wte, x, wpe=self.wpe, pos0=pos, stream=stream,
                        ln_out=(first.ln_1_w, first.ln_1_b, LN_EPS, reshaped(ln_1, (B, T, C))))
        # the layer norm each layer's MLP writes: the next layer's ln_1, after the last ln_f
        after = [(L.ln_1_w, L.ln_1_b) for L in self.layers[1:]] + [(self.ln_f_w, self.ln_f_b)]
        for i, (L, (gamma, beta)) in enumerate(zip(self.layers, after)):
            att = self._empty(f"h{i}.att", B, T, C)
            self_attention.self_attention(reshaped(ln_1, (B, T, C)), L.attn_w, L.attn_b,
                                          cache.k[i], cache.v[i], pos, att, rows=cache.rows,
                                          n_head=self.config.n_head, stream=stream)
            # x += att @ W + b (the residual add fused), then ln = ln_2(x)
            ln = self._empty(f"h{i}.ln_2", N, C)
            gemm.gemm(reshaped(att, (N, C)), L.attn_proj_w, x2, bias=L.attn_proj_b,
                      accumulate=True, ln_out=(L.ln_2_w, L.ln_2_b, LN_EPS, ln), stream=stream)
            ln_1 = self._empty(f"h{i}.ln_next", N, C)
            mlp.mlp(ln, L.fc_w, L.fc_b, L.mlp_proj_w, L.mlp_proj_b, x2,
                    ln_out=(gamma, beta, LN_EPS, ln_1), stream=stream)
        logits = self._empty("logits", B, T, V)
        gemm.gemm(ln_1, self.wte, reshaped(logits, (N, V)), trans_b=True,   # the tied head,
                  stream=stream)                                            # ln_f(x) in
        return logits

    def _half_step(self, tokens, pos, cache: KVCache, B: int, T: int, stream):
        """`step` in half precision: the same layers on the kernels that store float16 (the
        decode GEMMs, attention over the live prefix, the embedding), products and sums in
        float32. The float32 step's fused MLP and fused qkv-attention kernels are float32
        only; here the MLP is two GEMMs (the first with GELU) and qkv a GEMM before
        attention, as in GPT-J, each against its weight stored (out, in): a trans_b product,
        which runs on tensor cores (about 1.7x the SIMT [K, N] kernel's rate on GPT-J's
        shapes, dev/notes/half_precision.md)."""
        C, V, N = self.config.n_embd, self.config.vocab_size, B * T
        x = self._empty("x", B, T, C)
        x2 = reshaped(x, (N, C))
        first, ln = self.layers[0], self._empty("ln_1", N, C)
        embedding.embed(tokens, self.wte, x, wpe=self.wpe, pos0=pos, stream=stream,
                        ln_out=(first.ln_1_w, first.ln_1_b, LN_EPS, reshaped(ln, (B, T, C))))
        after = [(L.ln_1_w, L.ln_1_b) for L in self.layers[1:]] + [(self.ln_f_w, self.ln_f_b)]
        for i, (L, (gamma, beta)) in enumerate(zip(self.layers, after)):
            qkv = self._empty(f"h{i}.qkv", B, T, 3 * C)
            gemm.gemm(ln, L.attn_w, reshaped(qkv, (N, 3 * C)), bias=L.attn_b, trans_b=True,
                      stream=stream)
            att = self._empty(f"h{i}.att", B, T, C)
            attention.attention(qkv, cache.k[i], cache.v[i], pos, att, n_head=self.config.n_head,
                                rows=cache.rows, stream=stream)
            ln_2 = self._empty(f"h{i}.ln_2", N, C)
            gemm.gemm(reshaped(att, (N, C)), L.attn_proj_w, x2, bias=L.attn_proj_b, trans_b=True,
                      accumulate=True, ln_out=(L.ln_2_w, L.ln_2_b, LN_EPS, ln_2), stream=stream)
            h = self._empty(f"h{i}.fc", N, 4 * C)
            gemm.gemm(ln_2, L.fc_w, h, bias=L.fc_b, act="gelu", trans_b=True, stream=stream)
            ln = self._empty(f"h{i}.ln_next", N, C)
            gemm.gemm(h, L.mlp_proj_w, x2, bias=L.mlp_proj_b, accumulate=True, trans_b=True,
                      ln_out=(gamma, beta, LN_EPS, ln), stream=stream)
        logits = self._empty("logits", B, T, V)
        gemm.gemm(ln, self.wte, reshaped(logits, (N, V)), trans_b=True, stream=stream)
        return logits
