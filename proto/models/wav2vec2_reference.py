"""Wav2Vec2ForCTC's loss in float64 NumPy, written from the definitions alone (no kernel, no
kernel reference): the truth the device model's forward is checked against, and, through
finite differences of this function, its backward.

Slow by design (loops where they read like the math); meant for the tiny configurations of
the tests.
"""
from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def conv1d(x, w, b=None, *, stride=1, pad=0, groups=1):
    """x (B, C, L), w (K, C/groups, k) -> (B, K, (L + 2 pad - k) // stride + 1)."""
    B, C, L = x.shape
    K, cg, k = w.shape
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    n = (L + 2 * pad - k) // stride + 1
    kg = K // groups
    out = np.zeros((B, K, n))
    for g in range(groups):
        xs = x[:, g * cg:(g + 1) * cg]
        for r in range(k):
            taps = xs[:, :, r:r + stride * (n - 1) + 1:stride]          # (B, cg, n)
            out[:, g * kg:(g + 1) * kg] += np.einsum("kc,bcn->bkn", w[g * kg:(g + 1) * kg, :, r], taps)
    return out if b is None else out + b[None, :, None]


def ctc_nll(logp, label, blank):
    """-log p(label | logp (T, V)) by the forward recursion over the label with blanks."""
    ext = [blank]
    for c in label:
        ext += [int(c), blank]
    S, T = len(ext), logp.shape[0]
    alpha = np.full(S, -np.inf)
    alpha[0] = logp[0, blank]
    if S > 1:
        alpha[1] = logp[0, ext[1]]
    for t in range(1, T):
        prev = alpha.copy()
        for s in range(S):
            terms = [prev[s]] + ([prev[s - 1]] if s >= 1 else [])
            if s >= 2 and ext[s] != blank and ext[s] != ext[s - 2]:
                terms.append(prev[s - 2])
            alpha[s] = np.logaddexp.reduce(terms) + logp[t, ext[s]]
    return -np.logaddexp.reduce(alpha[-2:] if S > 1 else alpha[-1:])


def loss_and_logits(config, params: dict, waveform, frames, labels, label_lengths):
    """(reduced CTC loss, logits (B, T, V)) of `params` (Hugging Face names, float64) on one
    batch, as transformers' Wav2Vec2ForCTC computes them with an attention mask whose
    per-sample frames are `frames`."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    cfg = config
    x = np.asarray(waveform, np.float64)[:, None, :]
    fe = "wav2vec2.feature_extractor.conv_layers"
    for i, s in enumerate(cfg.conv_stride):
        x = conv1d(x, p[f"{fe}.{i}.conv.weight"], stride=s)
        if i == 0:   # GroupNorm with one group per channel: each channel over time
            mean = x.mean(-1, keepdims=True)
            var = ((x - mean) ** 2).mean(-1, keepdims=True)
            x = ((x - mean) / np.sqrt(var + cfg.eps) * p[f"{fe}.0.layer_norm.weight"][:, None]
                 + p[f"{fe}.0.layer_norm.bias"][:, None])
        x = gelu(x)
    B, _, T = x.shape
    fp = "wav2vec2.feature_projection"
    h = layer_norm(x.transpose(0, 2, 1), p[f"{fp}.layer_norm.weight"], p[f"{fp}.layer_norm.bias"], cfg.eps)
    h = h @ p[f"{fp}.projection.weight"].T + p[f"{fp}.projection.bias"]
    valid = np.arange(T)[None, :] < np.asarray(frames)[:, None]          # (B, T)
    h = h * valid[:, :, None]
    pc = "wav2vec2.encoder.pos_conv_embed.conv"
    v, g = p[f"{pc}.parametrizations.weight.original1"], p[f"{pc}.parametrizations.weight.original0"]
    w = g * v / np.sqrt((v ** 2).sum(axis=(0, 1), keepdims=True))
    pos = conv1d(h.transpose(0, 2, 1), w, p[f"{pc}.bias"], pad=cfg.pos_kernel // 2,
                 groups=cfg.pos_groups)
    if cfg.pos_kernel % 2 == 0:
        pos = pos[:, :, :-1]
    h = h + gelu(pos).transpose(0, 2, 1)
    h = layer_norm(h, p["wav2vec2.encoder.layer_norm.weight"], p["wav2vec2.encoder.layer_norm.bias"], cfg.eps)
    H, hd = cfg.heads, cfg.hidden // cfg.heads
    mask = np.where(valid, 0.0, -np.inf)[:, None, None, :]               # keys past the length
    for i in range(cfg.layers):
        q = f"wav2vec2.encoder.layers.{i}"
        a = f"{q}.attention"

        def proj(name, x):
            return x @ p[f"{a}.{name}.weight"].T + p[f"{a}.{name}.bias"]

        def heads(x):
            return x.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        qs, ks, vs = heads(proj("q_proj", h)), heads(proj("k_proj", h)), heads(proj("v_proj", h))
        scores = qs @ ks.transpose(0, 1, 3, 2) * hd ** -0.5 + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        att = (probs @ vs).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        h = layer_norm(h + proj("out_proj", att), p[f"{q}.layer_norm.weight"],
                       p[f"{q}.layer_norm.bias"], cfg.eps)
        f = f"{q}.feed_forward"
        ff = gelu(h @ p[f"{f}.intermediate_dense.weight"].T + p[f"{f}.intermediate_dense.bias"])
        ff = ff @ p[f"{f}.output_dense.weight"].T + p[f"{f}.output_dense.bias"]
        h = layer_norm(h + ff, p[f"{q}.final_layer_norm.weight"], p[f"{q}.final_layer_norm.bias"], cfg.eps)
    logits = h @ p["lm_head.weight"].T + p["lm_head.bias"]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    losses = []
    for b in range(B):
        nll = ctc_nll(logp[b, :frames[b]], np.asarray(labels[b][:label_lengths[b]]), cfg.blank)
        if cfg.zero_infinity and not np.isfinite(nll):
            nll = 0.0
        losses.append(nll / max(int(label_lengths[b]), 1) if cfg.ctc_reduction == "mean" else nll)
    losses = np.array(losses)
    return (losses.mean() if cfg.ctc_reduction == "mean" else losses.sum()), logits
