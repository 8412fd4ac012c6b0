"""GPT-J decode in plain PyTorch, as PtGraph runs it: one CUDA graph per length, each step
attending to its live prefix, float16 with tensor cores (PyTorch's defaults for float16
matmuls). The gptj experiment's PyTorch baseline (`gptj_ours_over_torch_graph_step`).

Same weights, by Hugging Face's names (a dict of torch tensors: our device arrays viewed
through the CUDA array interface, no copy); a static KV cache (L, B, H, Tmax, hd); the
length a Python int baked into each captured graph. Per layer, as a user writes GPT-J:
layer norm; q, k, v projections (no bias); the rotary embedding of the first rotary_dim
dimensions of each head of q and k ("rotate every two", the angles in float32 from a table
made once, as transformers makes it); this step's k, v into the cache; scaled dot-product
attention over the prefix; the output projection; the MLP (fc_in, tanh GELU, fc_out) from
the same layer norm; both added to the residual. Then ln_f and the untied head with bias.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from experiments import common
from experiments.torch_gpt2 import TorchCache, to_numba, to_torch
from proto.device import backend
from proto.models import generate
from proto.models.gptj import LN_EPS, GPTJConfig


class TorchGPTJ:
    """GPT-J decode steps over a static KV cache for `batch` sequences of up to `max_len`."""

    def __init__(self, config: GPTJConfig, weights: dict, *, batch: int, max_len: int):
        any_weight = next(iter(weights.values()))
        self.config, self.batch, self.max_len = config, batch, max_len
        self.w = weights
        self.dtype, device = any_weight.dtype, any_weight.device
        H, hd, R = config.n_head, config.head_dim, config.rotary_dim
        shape = (config.n_layer, batch, H, max_len, hd)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float32, device=device) / R)
        angles = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv_freq
        self.sin, self.cos = torch.sin(angles), torch.cos(angles)   # (Tmax, R / 2) float32

    def _rotate(self, x, p: int):
        """x (B, H, hd): its first rotary_dim dims turned by position p's angles."""
        R = self.config.rotary_dim
        rot = x[..., :R].float()
        even, odd = rot[..., 0::2], rot[..., 1::2]
        sin, cos = self.sin[p], self.cos[p]
        turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return torch.cat((turned.flatten(-2).to(x.dtype), x[..., R:]), dim=-1)

    @torch.no_grad()
    def decode_at(self, tokens, length: int, out) -> None:
        """One decode step at position length-1 over the live prefix: tokens (B,) int64;
        logits (B, V) written into `out`. `length` is a Python int: one graph per length."""
        c, w = self.config, self.w
        B, C, H, hd = tokens.shape[0], c.n_embd, c.n_head, c.head_dim
        p = length - 1
        x = w["transformer.wte.weight"][tokens]                          # (B, C)
        for i in range(c.n_layer):
            n = f"transformer.h.{i}."
            h = F.layer_norm(x, (C,), w[n + "ln_1.weight"], w[n + "ln_1.bias"], LN_EPS)
            q, k, v = (F.linear(h, w[n + f"attn.{t}_proj.weight"]).view(B, H, hd) for t in "qkv")
            q, k = self._rotate(q, p), self._rotate(k, p)
            self.k[i][:, :, p] = k
            self.v[i][:, :, p] = v
            att = F.scaled_dot_product_attention(q[:, :, None], self.k[i][:, :, :length],
                                                 self.v[i][:, :, :length])   # (B, H, 1, hd)
            mlp = F.linear(F.gelu(F.linear(h, w[n + "mlp.fc_in.weight"], w[n + "mlp.fc_in.bias"]),
                                  approximate="tanh"),
                           w[n + "mlp.fc_out.weight"], w[n + "mlp.fc_out.bias"])
            x = x + F.linear(att.reshape(B, C), w[n + "attn.out_proj.weight"]) + mlp
        x = F.layer_norm(x, (C,), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"],
                         LN_EPS)
        out.copy_(F.linear(x, w["lm_head.weight"], w["lm_head.bias"]))


class PerLengthGPTJ:
    """PtGraph's whole generation for proto.models.generate.beam_search: TorchGPTJ's decode
    step per length, replayed from its CUDA graph where `capture(length)` made one (eager
    otherwise, and for the prompt, a token at a time). Tokens are copied into a static
    tensor before a replay and the logits come back in a static one (viewed by Numba, no
    copy); the beam reorder gathers the live prefix of the static cache (index_select, a
    fresh tensor) and copies it back, eagerly, as Hugging Face's `_reorder_cache` does.
    `pool`: "private" (PyTorch's default: a pool per graph) or "shared" (one
    graph_pool_handle for every graph, as vLLM and torch.compile share theirs)."""

    def __init__(self, config: GPTJConfig, weights: dict, *, batch: int, max_len: int,
                 pool: str):
        if pool not in ("private", "shared"):
            raise ValueError(f"pool: expected 'private' or 'shared', got {pool!r}")
        self.model = TorchGPTJ(config, weights, batch=batch, max_len=max_len)
        self.config, self.batch, self.max_len, self.pool = config, batch, max_len, pool
        # (generate checks the logits' dtype)
        self.dtype = np.dtype({torch.float16: np.float16, torch.float32: np.float32}[
            self.model.dtype])
        device = self.model.k.device
        self.inputs = generate.DecodeInputs.allocate(batch)
        self.caches = (TorchCache(self), TorchCache(self))   # (reorders come to _reorder)
        self._tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self._logits = torch.zeros((batch, config.vocab_size), dtype=self.model.dtype,
                                   device=device)
        # Made once: a view costs ~10 us, and a replay is the step being timed. The search
        # passes its own token buffer at every decode step (torch_gpt2.TorchDecoder alike).
        self._logits_numba = to_numba(self._logits.view(batch, 1, -1))
        self._tokens_view = (self.inputs.tokens, to_torch(self.inputs.tokens))
        self._handle = torch.cuda.graph_pool_handle() if pool == "shared" else None
        self.graphs: dict = {}
        self._length = 0   # live positions in the cache (host mirror)

    def capture(self, length: int) -> None:
        """The graph of `length` (capture the largest first: see torch_gpt2.PerLengthDecoder)."""
        self.graphs[length], _ = common.torch_cuda_graph(
            lambda: self.model.decode_at(self._tokens, length, self._logits), pool=self._handle)

    def step(self, tokens, pos, cache):
        """generate's step: tokens (B, T) Numba int32 -> Numba logits (B, 1, V) of the last."""
        held, view = self._tokens_view
        rows = view if tokens is held and not backend.SIMULATOR else to_torch(tokens)
        for t in range(rows.shape[1]):
            self._length += 1
            self._tokens.copy_(rows[:, t])   # (int32 into int64)
            if self._length in self.graphs:
                self.graphs[self._length].replay()
            else:
                self.model.decode_at(self._tokens, self._length, self._logits)
        if backend.SIMULATOR:   # (to_numba copies there: a fresh copy of these logits)
            return to_numba(self._logits.view(self.batch, 1, -1))
        return self._logits_numba

    def _reorder(self, index) -> None:
        parents, n = to_torch(index).long().to(self._tokens.device), self._length
        for cache in (self.model.k, self.model.v):           # (L, B, H, Tmax, hd)
            cache[:, :, :, :n].copy_(cache[:, :, :, :n].index_select(1, parents))

    def beam_search(self, prompt, *, max_new_tokens: int):
        self._length = 0
        return generate.beam_search(self, prompt, beam=self.batch, max_new_tokens=max_new_tokens,
                                    step=self.step, caches=self.caches, inputs=self.inputs)

    def close(self) -> None:
        if self.graphs:
            torch.cuda.synchronize()
            for graph in self.graphs.values():
                graph.reset()
        self.graphs, self.model = {}, None
