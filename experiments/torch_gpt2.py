"""GPT-2 decode in plain PyTorch with a static KV cache: the PyTorch baselines of end_to_end
and graph_memory.

Same weights (our state dict, Hugging Face names), float32 with TF32 off, and a static cache
as Hugging Face's StaticCache keeps it: k, v of every layer preallocated as (L, B, H, Tmax, hd),
this step's keys and values written at `pos` by index_copy_ with `pos` a device tensor, and
attention over the whole cache masked beyond each query's position. Nothing depends on pos
on the host, so one CUDA graph serves every length. Two ways to run a decode step:

  eager   TorchGPT2.forward, op by op;
  graph   torch.cuda.CUDAGraph of the T = 1 forward on static token/position tensors. Before
          each replay the inputs are copied into the static tensors (`static.copy_(x)`), and
          in beam search the reordered cache (index_select's fresh result, as Hugging Face's
          `_reorder_cache`) is copied into the static cache: the standard PyTorch way, the
          "PtGraph" baseline.

`PerLengthDecoder` is PtGraph as Grape measured it: one CUDA graph per length, each step
attending to its live prefix ``k[..., :length]`` with the length a Python int baked into the
graph, and its memory pool private per graph (PyTorch's default) or shared by all
(``graph_pool_handle``, as vLLM and torch.compile do).

`TorchDecoder` plugs into proto.models.generate: tokens and position arrive as Numba device
arrays (viewed as torch tensors through the CUDA array interface, no copy) and the logits go
back as a Numba view, so the search's own kernels run unchanged and only the model step and
its input preparation differ from ours. Numba and PyTorch both use the legacy default stream,
so their work stays ordered. `check_logits` asserts that this model and proto.models.gpt2
agree.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from experiments import common
from proto.device import backend
from proto.device.backend import cuda
from proto.models import generate
from proto.models.gpt2 import LN_EPS, GPT2Config, KVCache, load_state_dict


class TorchGPT2:
    """GPT-2 forward over a static KV cache for `batch` sequences of up to `max_len` positions."""

    def __init__(self, config: GPT2Config, state_dict, *, batch: int, max_len: int,
                 device: str = "cuda"):
        common.no_tf32()
        self.config, self.batch, self.max_len = config, batch, max_len
        p = {k: torch.from_numpy(v).to(device) for k, v in load_state_dict(config, state_dict).items()}
        self.wte, self.wpe = p["transformer.wte.weight"], p["transformer.wpe.weight"]
        self.ln_f = (p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
        self.layers = [{name: p[f"transformer.h.{i}.{name}"] for name in (
            "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")}
            for i in range(config.n_layer)]
        H, hd = config.n_head, config.head_dim
        shape = (config.n_layer, batch, H, max_len, hd)
        self.k = torch.zeros(shape, device=device)  # (L, B, H, Tmax, hd)
        self.v = torch.zeros(shape, device=device)
        self._arange = torch.arange(max_len, device=device)

    @torch.no_grad()
    def forward(self, tokens, pos):
        """tokens (B, T) int64, pos (1,) int64 device tensor -> logits (B, T, V).

        Writes this step's k, v at pos..pos+T-1; query t attends to cache positions
        0..pos+t (the rest of the static cache is masked out)."""
        B, T = tokens.shape
        C, H, hd = self.config.n_embd, self.config.n_head, self.config.head_dim
        positions = pos + self._arange[:T]                            # (T,)
        x = self.wte[tokens] + self.wpe[positions]                     # (B, T, C)
        mask = self._arange[None, :] <= positions[:, None]             # (T, Tmax)
        for l, w in enumerate(self.layers):
            h = F.layer_norm(x, (C,), w["ln_1.weight"], w["ln_1.bias"], LN_EPS)
            qkv = torch.addmm(w["attn.c_attn.bias"], h.view(B * T, C), w["attn.c_attn.weight"])
            q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
            self.k[l].index_copy_(2, positions, k)
            self.v[l].index_copy_(2, positions, v)
            att = F.scaled_dot_product_attention(q, self.k[l], self.v[l], attn_mask=mask)
            att = att.transpose(1, 2).reshape(B * T, C)                # (B*T, C)
            x = x + torch.addmm(w["attn.c_proj.bias"], att, w["attn.c_proj.weight"]).view(B, T, C)
            h = F.layer_norm(x, (C,), w["ln_2.weight"], w["ln_2.bias"], LN_EPS)
            h = F.gelu(torch.addmm(w["mlp.c_fc.bias"], h.view(B * T, C), w["mlp.c_fc.weight"]),
                       approximate="tanh")
            x = x + torch.addmm(w["mlp.c_proj.bias"], h, w["mlp.c_proj.weight"]).view(B, T, C)
        x = F.layer_norm(x, (C,), *self.ln_f, LN_EPS)
        return x @ self.wte.T                                          # tied head, (B, T, V)

    @torch.no_grad()
    def decode_at(self, tokens, length: int, out) -> None:
        """One decode step (T = 1) at position length-1 attending to the live prefix only:
        tokens (B, 1) int64; logits (B, V) written into `out`. `length` is a Python int, so a
        captured graph bakes it in: one graph per length."""
        B, C, H, hd = tokens.shape[0], self.config.n_embd, self.config.n_head, self.config.head_dim
        p = length - 1
        x = self.wte[tokens[:, 0]] + self.wpe[p]                        # (B, C)
        for l, w in enumerate(self.layers):
            h = F.layer_norm(x, (C,), w["ln_1.weight"], w["ln_1.bias"], LN_EPS)
            qkv = torch.addmm(w["attn.c_attn.bias"], h, w["attn.c_attn.weight"])
            q, k, v = qkv.view(B, 3, H, hd).unbind(1)                   # each (B, H, hd)
            self.k[l][:, :, p] = k
            self.v[l][:, :, p] = v
            att = F.scaled_dot_product_attention(q[:, :, None], self.k[l][:, :, :length],
                                                 self.v[l][:, :, :length])  # (B, H, 1, hd)
            x = x + torch.addmm(w["attn.c_proj.bias"], att.reshape(B, C), w["attn.c_proj.weight"])
            h = F.layer_norm(x, (C,), w["ln_2.weight"], w["ln_2.bias"], LN_EPS)
            h = F.gelu(torch.addmm(w["mlp.c_fc.bias"], h, w["mlp.c_fc.weight"]), approximate="tanh")
            x = x + torch.addmm(w["mlp.c_proj.bias"], h, w["mlp.c_proj.weight"])
        x = F.layer_norm(x, (C,), *self.ln_f, LN_EPS)
        torch.matmul(x, self.wte.T, out=out)                           # tied head


# ------------------------------------------------------------------------- Numba <-> torch
def to_torch(x):
    """A torch view of a Numba device array (a host copy on the simulator, torch on CPU)."""
    if backend.SIMULATOR:
        return torch.from_numpy(x.copy_to_host())
    return torch.as_tensor(x, device="cuda")


def to_numba(t):
    """A Numba view of a torch tensor (a device copy on the simulator)."""
    if backend.SIMULATOR:
        return cuda.to_device(t.numpy())
    return cuda.as_cuda_array(t, sync=False)  # same (legacy default) stream: no sync needed


class TorchCache:
    """What the search sees of the cache: it lives in the model; reorders go through it."""

    def __init__(self, owner):   # a TorchDecoder, or torch_gptj.PerLengthGPTJ
        self.owner, self.batch, self.max_len = owner, owner.batch, owner.max_len

    def reorder_into(self, index, dst, stream=0, length=None) -> None:
        self.owner._reorder(index)   # the whole cache: `length` lives on our device, not torch's


class TorchDecoder:
    """A proto.models.generate step around TorchGPT2, eager or CUDA-graphed (see module doc)."""

    def __init__(self, config: GPT2Config, state_dict, *, batch: int, max_len: int,
                 graphed: bool, device: str = "cuda"):
        self.config, self.batch, self.max_len, self.graphed = config, batch, max_len, graphed
        self.model = TorchGPT2(config, state_dict, batch=batch, max_len=max_len, device=device)
        self.inputs = generate.DecodeInputs.allocate(batch)
        self.caches = (TorchCache(self), TorchCache(self))
        self._fresh = None  # graph: the reordered cache waiting to be copied into the static one
        self._logits = None  # eager: keeps the returned logits' memory alive
        # torch views of the search's fixed input buffers, made once (the views cost ~10 us)
        self._views = {id(x): (x, to_torch(x)) for x in (self.inputs.tokens, self.inputs.pos)}
        if graphed:
            self._capture(device)

    def _capture(self, device: str) -> None:
        B = self.batch
        self._tokens = torch.zeros((B, 1), dtype=torch.int64, device=device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph, self._static_logits = common.torch_cuda_graph(
            lambda: self.model.forward(self._tokens, self._pos))
        self._logits_numba = to_numba(self._static_logits.view(B, 1, -1))

    def step(self, tokens, pos, cache):
        """generate's step: tokens (B, T), pos (1,) Numba device int32 -> Numba logits (B, T, V)."""
        if self.graphed and tokens.shape[1] == 1:
            self._tokens.copy_(self._torch(tokens))  # PtGraph: inputs copied into static tensors
            self._pos.copy_(self._torch(pos))
            if self._fresh is not None:
                self.model.k.copy_(self._fresh[0])
                self.model.v.copy_(self._fresh[1])
                self._fresh = None
            self.graph.replay()
            return self._logits_numba
        self._logits = self.model.forward(self._torch(tokens).long(), self._torch(pos).long())
        return to_numba(self._logits)

    def _torch(self, x):
        held, view = self._views.get(id(x), (None, None))
        return view if held is x and not backend.SIMULATOR else to_torch(x)

    def _reorder(self, index) -> None:
        parents = to_torch(index).long()
        if self.graphed:  # fresh tensors, copied into the static cache by the next step
            self._fresh = (self.model.k.index_select(1, parents),
                           self.model.v.index_select(1, parents))
        else:
            self.model.k = self.model.k.index_select(1, parents)
            self.model.v = self.model.v.index_select(1, parents)

    def beam_search(self, prompt, *, max_new_tokens: int, timed: bool = False):
        return generate.beam_search(self, prompt, beam=self.batch, max_new_tokens=max_new_tokens,
                                    step=self.step, caches=self.caches, inputs=self.inputs,
                                    timed=timed)

    def replayer(self, position: int):
        """A zero-argument replay of the graph at `position` (idempotent), for timing."""
        self._pos.fill_(position)
        return self.graph.replay

    def close(self) -> None:
        if self.graphed:
            torch.cuda.synchronize()
            self.graph.reset()
        self.model = self._fresh = self._logits = None


class PerLengthDecoder(TorchDecoder):
    """PtGraph in real PyTorch (see the module doc): the eager TorchDecoder, whose decode
    steps replay the graph of their length instead. Tokens are copied into a static tensor
    before a replay; the beam reorder gathers the live prefix (index_select, a fresh tensor)
    and copies it back into the static cache, eagerly. `pool`: "private" or "shared"."""

    def __init__(self, config: GPT2Config, state_dict, *, batch: int, max_len: int, pool: str):
        if pool not in ("private", "shared"):
            raise ValueError(f"pool: expected 'private' or 'shared', got {pool!r}")
        super().__init__(config, state_dict, batch=batch, max_len=max_len, graphed=False)
        self.pool = pool
        self._tokens = torch.zeros((batch, 1), dtype=torch.int64, device="cuda")
        self._static_logits = torch.zeros((batch, config.vocab_size), device="cuda")
        self._logits_numba = to_numba(self._static_logits.view(batch, 1, -1))
        self._handle = torch.cuda.graph_pool_handle() if pool == "shared" else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._length = 0     # live positions in the cache (host mirror)

    def capture(self, length: int) -> None:
        """The graph of `length`. Capture the largest length first, as vLLM captures its
        batch sizes: with a shared pool, a later capture reuses the blocks earlier ones freed,
        and a smaller graph fits in a larger one's. Every tensor a graph allocates is dead at
        its end (the logits go to a static tensor, the cache is static), so graphs sharing a
        pool may replay in any order."""
        self.graphs[length], _ = common.torch_cuda_graph(
            lambda: self.model.decode_at(self._tokens, length, self._static_logits),
            pool=self._handle)

    def step(self, tokens, pos, cache):
        """generate's step: a prefill runs eagerly; a decode step replays its length's graph."""
        T = tokens.shape[1]
        if T == 1 and self._length + 1 in self.graphs:
            self._length += 1
            self._tokens.copy_(self._torch(tokens))
            self.graphs[self._length].replay()
            return self._logits_numba
        self._length += T
        return super().step(tokens, pos, cache)

    def _reorder(self, index) -> None:
        parents, n = to_torch(index).long(), self._length
        for cache in (self.model.k, self.model.v):           # (L, B, H, Tmax, hd)
            cache[:, :, :, :n].copy_(cache[:, :, :, :n].index_select(1, parents))

    def beam_search(self, prompt, *, max_new_tokens: int, timed: bool = False):
        self._length = 0
        return super().beam_search(prompt, max_new_tokens=max_new_tokens, timed=timed)

    def close(self) -> None:
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs = {}
        super().close()


def check_logits(model, state_dict, steps: int = 3, seed: int = 0) -> float:
    """Assert that TorchGPT2 (eager, and graphed for the decode steps) gives our GPT2's
    logits: a prefill of model.max_tokens tokens, then `steps` decode steps. Returns the
    largest difference relative to the largest logit.

    Tolerance: both are float32; ours sums in a different order (split-K gemms, online
    softmax), and errors grow with depth: 1e-3 of the logits' scale (seen: ~1e-5)."""
    config, B, prompt_len = model.config, model.max_batch, model.max_tokens
    max_len = prompt_len + steps
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, config.vocab_size, (B, max_len)).astype(np.int32)
    ours_cache = KVCache(config, B, max_len)
    torch_eager = TorchDecoder(config, state_dict, batch=B, max_len=max_len, graphed=False)
    torch_graph = TorchDecoder(config, state_dict, batch=B, max_len=max_len, graphed=True)
    worst = 0.0
    try:
        for start, T in [(0, prompt_len)] + [(prompt_len + i, 1) for i in range(steps)]:
            tokens = cuda.to_device(np.ascontiguousarray(seq[:, start:start + T]))
            pos = cuda.to_device(np.array([start], np.int32))
            want = model.step(tokens, pos, ours_cache).copy_to_host()
            for dec in (torch_eager, torch_graph):
                got = dec.step(tokens, pos, dec.caches[0]).copy_to_host()
                scale = float(np.abs(want).max())
                err = float(np.abs(got - want).max()) / scale
                worst = max(worst, err)
                assert err <= 1e-3, (f"PyTorch GPT-2 ({'graph' if dec.graphed else 'eager'}) "
                                     f"differs from ours at position {start}: max |diff| = "
                                     f"{err:.2e} of the logits' scale")
    finally:
        torch_eager.close()
        torch_graph.close()
    return worst
