"""LSTM language model (embedding -> torch.nn.LSTM layers -> linear decoder), one token a step.

    model = LSTMLM(config, state_dict, max_batch=8)
    state = LSTMState(config, batch=8)               # h, c per layer, zeros
    logits = model.step(tokens, state)               # (B, V), valid until the next step

Like GPT2.step, a step launches kernels and takes its temporaries from
``proto.device.backend.empty`` (named, so the memory planner can place them when a graph records
the step). The state is updated in place, so the same step (and graph) runs again on its
own output.

Weights: the `state_dict()` of a PyTorch module with `embedding` (nn.Embedding), `lstm`
(nn.LSTM, gates in PyTorch's order i, f, g, o) and `decoder` (nn.Linear), as NumPy arrays.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kernels import _check, embedding, gemm, lstm
from proto.device.backend import cuda, empty, reshaped, rows
from proto.models import checked_params, zeros


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
    n_layer: int
    n_embd: int      # embedding size = input size of the first LSTM layer
    n_hidden: int
    vocab_size: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _check.positive(field.name, getattr(self, field.name))


def param_shapes(config: LSTMConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by its PyTorch name."""
    E, H, V = config.n_embd, config.n_hidden, config.vocab_size
    shapes = {"embedding.weight": (V, E)}
    for k in range(config.n_layer):
        shapes.update({
            f"lstm.weight_ih_l{k}": (4 * H, E if k == 0 else H),
            f"lstm.weight_hh_l{k}": (4 * H, H),
            f"lstm.bias_ih_l{k}": (4 * H,), f"lstm.bias_hh_l{k}": (4 * H,)})
    shapes.update({"decoder.weight": (V, H), "decoder.bias": (V,)})
    return shapes


def load_state_dict(config: LSTMConfig, state_dict, *,
                    allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
    return checked_params(param_shapes(config), state_dict, what="LSTM",
                          allow_nonfinite=allow_nonfinite)


def random_state_dict(config: LSTMConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Gate weights N(0, 1/fan_in) (gates unit-scale), biases N(0, 0.1^2); embedding and
    decoder N(0, 1), so logits spread like sqrt(n_hidden)*|h| and argmax is well separated."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in param_shapes(config).items():
        if key in ("embedding.weight", "decoder.weight"):
            value = rng.standard_normal(shape)
        elif len(shape) == 2:  # (4H, in)
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        else:
            value = 0.1 * rng.standard_normal(shape)
        out[key] = value.astype(np.float32)
    return out




class LSTMState:
    """Hidden and cell state of every layer: `h[k]`, `c[k]` device float32 (B, n_hidden)."""

    def __init__(self, config: LSTMConfig, batch: int):
        self.config, self.batch = config, _check.positive("batch", batch)
        self.h = [zeros((batch, config.n_hidden)) for _ in range(config.n_layer)]
        self.c = [zeros((batch, config.n_hidden)) for _ in range(config.n_layer)]

    def arrays(self) -> list:
        """Every batch-first device array of the state (what a beam reorder must move)."""
        return self.h + self.c


class LSTMLM:
    """The LSTM LM's step. Two variants, off until their A/B (dev.ab.ab_lstm_tiles) runs on
    a GPU, read only here:

    sum_in_cell   the gate GEMMs write their K-split partial products and the cell sums them
                  with both biases (kernels.lstm), instead of each GEMM summing its own splits
                  in a reduction launch (4 of the step's 15 launches a token at 2 layers);
    skinny_tiles  the tiled GEMMs of 9..32 rows take kernels.gemm's skinny tiles.
    """

    def __init__(self, config: LSTMConfig, state_dict, *, max_batch: int,
                 allow_nonfinite: bool = False, sum_in_cell: bool = False,
                 skinny_tiles: bool = False):
        params = load_state_dict(config, state_dict, allow_nonfinite=allow_nonfinite)
        self.config = config
        self.sum_in_cell = _check.flag("sum_in_cell", sum_in_cell)
        self.skinny = _check.flag("skinny_tiles", skinny_tiles)
        self.max_batch = _check.positive("max_batch", max_batch)
        w = {k: cuda.to_device(v) for k, v in params.items()}
        self.embedding = w["embedding.weight"]
        self.layers = [tuple(w[f"lstm.{name}_l{k}"] for name in (
            "weight_ih", "bias_ih", "weight_hh", "bias_hh")) for k in range(config.n_layer)]
        self.decoder_w, self.decoder_b = w["decoder.weight"], w["decoder.bias"]

    def step(self, tokens, state: LSTMState, stream=0):
        """Advance every sequence by one token; return the next-token logits.

        tokens: device int32 (B,), B <= max_batch, values in [0, vocab).
        state:  LSTMState of batch B, read and updated in place (h, c of every layer).
        Returns device float32 (B, V) logits, overwritten by the model's next step.
        """
        _check.device_array("tokens", tokens, dtype=np.int32, ndim=1)
        B = _check.positive("tokens.shape[0] (batch)", tokens.shape[0], at_most=self.max_batch)
        if not isinstance(state, LSTMState) or state.config != self.config or state.batch != B:
            raise ValueError(f"state: expected an LSTMState of this model's config with batch {B}")
        E, H, V = self.config.n_embd, self.config.n_hidden, self.config.vocab_size
        x = empty((B, E), np.float32, "x", owner=self)
        embedding.embed(reshaped(tokens, (B, 1)), self.embedding, reshaped(x, (B, 1, E)),
                        stream=stream)   # (views made once: the same objects every step)
        for k, (w_ih, b_ih, w_hh, b_hh) in enumerate(self.layers):
            # gates = x @ W_ih.T + b_ih + h @ W_hh.T + b_hh
            if self.sum_in_cell:   # both products' K splits, summed by the cell, biases too
                s_x = gemm.split_count(B, 4 * H, x.shape[1], trans_b=True, skinny=self.skinny)
                s_h = gemm.split_count(B, 4 * H, H, trans_b=True, skinny=self.skinny)
                part = empty((s_x + s_h, B, 4 * H), np.float32, f"l{k}.gate_partials",
                             owner=self)
                gemm.split_products(x, w_ih, rows(part, 0, s_x), trans_b=True, stream=stream,
                                    skinny=self.skinny)
                gemm.split_products(state.h[k], w_hh, rows(part, s_x, s_x + s_h),
                                    trans_b=True, stream=stream, skinny=self.skinny)
                lstm.lstm_cell(part, state.c[k], state.h[k], state.c[k], biases=(b_ih, b_hh),
                               stream=stream)
            else:   # the second gemm accumulating, each gemm reducing its own splits
                gates = empty((B, 4 * H), np.float32, f"l{k}.gates", owner=self)
                gemm.gemm(x, w_ih, gates, bias=b_ih, trans_b=True, stream=stream,
                          skinny=self.skinny)
                gemm.gemm(state.h[k], w_hh, gates, bias=b_hh, trans_b=True, accumulate=True,
                          stream=stream, skinny=self.skinny)
                lstm.lstm_cell(gates, state.c[k], state.h[k], state.c[k], stream=stream)
            x = state.h[k]  # (B, H): the next layer's input
        logits = empty((B, V), np.float32, "logits", owner=self)
        gemm.gemm(x, self.decoder_w, logits, bias=self.decoder_b, trans_b=True, stream=stream,
                  skinny=self.skinny)
        return logits
