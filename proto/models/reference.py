"""NumPy float64 references: the models recomputed from scratch, and the searches over them.

The device models are tested against these. Each forward takes the whole sequence and no
cache, so a cache bug (wrong slot, wrong reorder) cannot hide in both. The searches are
written independently of proto.models.generate, following the same rules (documented there);
each also reports the smallest score gap behind any of its decisions, so a test knows when a
float32 model may legitimately choose differently.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from proto.models.gpt2 import LN_EPS, GPT2Config, load_state_dict as load_gpt2
from proto.models.gptj import GPTJConfig, load_state_dict as load_gptj, rotary
from proto.models.lstm import LSTMConfig, load_state_dict as load_lstm


def _layernorm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + LN_EPS) * gamma + beta


def _gelu(x):  # tanh approximation, as GPT-2 ("gelu_new")
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def gpt2_logits(config: GPT2Config, state_dict, tokens) -> np.ndarray:
    """Logits (B, T, V) float64 of token ids (B, T) at positions 0..T-1."""
    p = {k: v.astype(np.float64) for k, v in load_gpt2(config, state_dict).items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    H, hd = config.n_head, config.head_dim
    x = p["transformer.wte.weight"][tokens] + p["transformer.wpe.weight"][:T]  # (B, T, C)
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(config.n_layer):
        w = {k[len(f"transformer.h.{i}."):]: v for k, v in p.items()
             if k.startswith(f"transformer.h.{i}.")}
        h = _layernorm(x, w["ln_1.weight"], w["ln_1.bias"])
        qkv = h @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]  # (B, T, 3C)
        q, k, v = (a.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # (B, H, T, hd)
                   for a in np.split(qkv, 3, axis=-1))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -np.inf)
        att = np.exp(log_softmax(s)) @ v  # (B, H, T, hd)
        att = att.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + att @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]
        h = _layernorm(x, w["ln_2.weight"], w["ln_2.bias"])
        x = x + _gelu(h @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]) @ w["mlp.c_proj.weight"] \
            + w["mlp.c_proj.bias"]
    x = _layernorm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    return x @ p["transformer.wte.weight"].T


def gptj_logits(config: GPTJConfig, state_dict, tokens) -> np.ndarray:
    """Logits (B, T, V) float64 of token ids (B, T) at positions 0..T-1 (proto.models.gptj
    says how a block computes)."""
    p = {k: v.astype(np.float64) for k, v in load_gptj(config, state_dict).items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    H, hd, R = config.n_head, config.head_dim, config.rotary_dim
    x = p["transformer.wte.weight"][tokens]                   # (B, T, C)
    causal = np.tril(np.ones((T, T), dtype=bool))
    positions = np.arange(T)
    for i in range(config.n_layer):
        w = {k[len(f"transformer.h.{i}."):]: v for k, v in p.items()
             if k.startswith(f"transformer.h.{i}.")}
        h = _layernorm(x, w["ln_1.weight"], w["ln_1.bias"])
        q, k, v = (h @ w[f"attn.{n}_proj.weight"].T for n in "qkv")   # (B, T, C), no bias
        q, k, v = (a.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        q, k = rotary(q, positions, R), rotary(k, positions, R)      # (B, H, T, hd)
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd), -np.inf)
        att = (np.exp(log_softmax(s)) @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        mlp = _gelu(h @ w["mlp.fc_in.weight"].T + w["mlp.fc_in.bias"]) @ w["mlp.fc_out.weight"].T \
            + w["mlp.fc_out.bias"]
        x = x + att @ w["attn.out_proj.weight"].T + mlp              # one residual, both paths
    x = _layernorm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    return x @ p["lm_head.weight"].T + p["lm_head.bias"]


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def lstm_logits(config: LSTMConfig, state_dict, tokens, state=None):
    """Logits (B, T, V) float64 of token ids (B, T), and the final (h, c), each (L, B, H).

    `state` (h, c) continues a previous call; None starts from zeros, as torch.nn.LSTM.
    """
    p = {k: v.astype(np.float64) for k, v in load_lstm(config, state_dict).items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    L, H = config.n_layer, config.n_hidden
    h, c = (np.zeros((L, B, H)), np.zeros((L, B, H))) if state is None else \
        (np.array(state[0], np.float64), np.array(state[1], np.float64))
    logits = np.empty((B, T, config.vocab_size))
    for t in range(T):
        x = p["embedding.weight"][tokens[:, t]]  # (B, E)
        for k in range(L):
            gates = (x @ p[f"lstm.weight_ih_l{k}"].T + p[f"lstm.bias_ih_l{k}"]
                     + h[k] @ p[f"lstm.weight_hh_l{k}"].T + p[f"lstm.bias_hh_l{k}"])
            i, f, g, o = np.split(gates, 4, axis=-1)  # PyTorch gate order
            c[k] = _sigmoid(f) * c[k] + _sigmoid(i) * np.tanh(g)
            h[k] = _sigmoid(o) * np.tanh(c[k])
            x = h[k]
        logits[:, t] = x @ p["decoder.weight"].T + p["decoder.bias"]
    return logits, (h, c)


# ------------------------------------------------------------------------------ searches
@dataclasses.dataclass(frozen=True)
class SearchRef:
    tokens: np.ndarray  # greedy: (B, T0 + n); beam: (T0 + n,) the best sequence
    score: float        # beam: its summed log-probability; greedy: 0.0
    margin: float       # smallest score gap behind any decision (inf if none was close)


def _gap(sorted_desc: np.ndarray, upto: int) -> float:
    """Smallest gap between neighbours among the first upto+1 values."""
    top = sorted_desc[:upto + 1]
    return float(np.min(top[:-1] - top[1:])) if len(top) > 1 else math.inf


def greedy(logits_fn, prompt, max_new_tokens: int, eos: int | None = None) -> SearchRef:
    """Argmax decoding of `prompt` (B, T0); `logits_fn(tokens (B, T)) -> (B, T, V)`.

    A row that emitted `eos` is done and is padded with `eos`; decoding stops when every row is.
    """
    seqs = np.array(prompt, dtype=np.int64)
    done = np.zeros(len(seqs), dtype=bool)
    margin = math.inf
    for _ in range(max_new_tokens):
        last = logits_fn(seqs)[:, -1]  # (B, V)
        top2 = -np.sort(-last, axis=-1)[:, :2]
        margin = min(margin, float(np.min((top2[:, 0] - top2[:, 1])[~done])))
        nxt = np.argmax(last, axis=-1)
        if eos is not None:
            nxt = np.where(done, eos, nxt)
            done |= nxt == eos
        seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
        if eos is not None and done.all():
            break
    return SearchRef(seqs, 0.0, margin)


def beam(logits_fn, prompt, beam_width: int, max_new_tokens: int,
         eos: int | None = None) -> SearchRef:
    """Beam search from a 1-D prompt under the rules of proto.models.generate.beam_search,
    restated here rather than imported, so a change there shows up as a difference: each step
    ranks the top k = min(2 * beam_width, 8) candidates (room for an eos per beam; top-k
    returns at most 8), so beam_width is at most 8."""
    if not 1 <= beam_width <= 8:
        raise ValueError(f"beam_width: expected 1..8, got {beam_width}")
    k = min(2 * beam_width, 8)
    live = [list(prompt)]                  # live hypotheses, best first
    live_scores = [0.0]
    finished: list[tuple[float, list]] = []
    margin = math.inf
    for _ in range(max_new_tokens):
        lp = log_softmax(logits_fn(np.array(live))[:, -1])    # (live, V)
        cand = (np.array(live_scores)[:, None] + lp).ravel()  # flat index = beam * V + token
        order = np.argsort(-cand, kind="stable")               # ties: lower flat index first
        margin = min(margin, _gap(cand[order], k))
        V = lp.shape[1]
        nxt, nxt_scores = [], []
        for idx in order[:k]:
            b, tok = divmod(int(idx), V)
            if tok == eos:
                finished.append((float(cand[idx]), live[b] + [tok]))
            elif len(nxt) < beam_width:
                nxt.append(live[b] + [tok])
                nxt_scores.append(float(cand[idx]))
        live, live_scores = nxt, nxt_scores
        best_finished = max((s for s, _ in finished), default=-math.inf)
        if live and finished:  # a near-tie here decides whether the search stops
            margin = min(margin, abs(best_finished - live_scores[0]))
        if not live or best_finished >= live_scores[0]:
            break
    # the best of everything explored; ties go to the one found first (finished before live)
    hypotheses = finished + list(zip(live_scores, live))
    margin = min(margin, _gap(np.sort([s for s, _ in hypotheses])[::-1], 1))
    score, tokens = max(hypotheses, key=lambda st: st[0])
    return SearchRef(np.array(tokens), score, margin)
