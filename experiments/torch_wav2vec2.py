"""Wav2Vec2 CTC training in PyTorch: transformers' eager step, and PtGraph's per-length graphs.

  hf_model(config, state_dict)   transformers' Wav2Vec2ForCTC of our config, our weights,
                                 dropout, LayerDrop and SpecAugment off, eager attention
  HFTrainer                      its training step as a user writes it: forward with the
                                 attention mask and labels (-100 past each label), loss.backward(),
                                 torch.optim.AdamW.step(); float32, or float16 autocast with a
                                 GradScaler. `prepare` is its data loader's part (collated host
                                 tensors, pinned, as transformers' Trainer's DataLoader hands
                                 them); `step` copies them to the GPU and trains
  TorchWav2Vec2                  the same network in plain torch ops that a CUDA graph can
                                 capture. transformers' forward cannot be captured with an
                                 attention mask: it zeroes padded frames by boolean indexing
                                 (a nonzero(), which waits for the GPU) and its CTC loss
                                 masked_selects the labels; a user graphing Wav2Vec2 rewrites
                                 those lines, as this does (a multiply by the mask; the loss
                                 outside the graph)
  PtGraphTrainer                 PtGraph: per encoder length, the forward and backward of
                                 TorchWav2Vec2 up to the logits as graphs of their own
                                 (torch.cuda.make_graphed_callables, what PyTorch offers for
                                 training graphs), captured into a private memory pool each or
                                 one pool shared by all lengths; the CTC loss (its lengths
                                 are read on the host) and AdamW run eagerly between them

The weights are the same values every method starts from (Hugging Face names).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from proto.models.wav2vec2_config import POS_CONV_G, POS_CONV_V, AdamWConfig, Wav2Vec2Config


def hf_config(config: Wav2Vec2Config):
    import transformers
    return transformers.Wav2Vec2Config(
        vocab_size=config.vocab, hidden_size=config.hidden, num_hidden_layers=config.layers,
        num_attention_heads=config.heads, intermediate_size=config.ffn, hidden_act="gelu",
        conv_dim=config.conv_dim, conv_kernel=config.conv_kernel, conv_stride=config.conv_stride,
        conv_bias=False, feat_extract_norm="group", feat_extract_activation="gelu",
        num_conv_pos_embeddings=config.pos_kernel,
        num_conv_pos_embedding_groups=config.pos_groups, do_stable_layer_norm=False,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        pad_token_id=config.blank, ctc_loss_reduction=config.ctc_reduction,
        ctc_zero_infinity=config.zero_infinity, layer_norm_eps=config.eps)


def hf_model(config: Wav2Vec2Config, state_dict: dict, device="cuda"):
    """transformers' Wav2Vec2ForCTC with `state_dict` (NumPy, our names), in training mode."""
    import transformers
    model = transformers.Wav2Vec2ForCTC(hf_config(config))
    model.config._attn_implementation = "eager"
    own = model.state_dict()
    weights = {}
    for key in own:
        ours = {"wav2vec2.encoder.pos_conv_embed.conv.weight_g": POS_CONV_G,
                "wav2vec2.encoder.pos_conv_embed.conv.weight_v": POS_CONV_V}.get(key, key)
        if ours in state_dict:
            weights[key] = torch.from_numpy(np.asarray(state_dict[ours]))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"Wav2Vec2 weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return model.to(device).train()


def loaded(tensors: dict, device) -> dict:
    """What a data loader hands a training step: the batch's host tensors, pinned where the
    step runs on a GPU (DataLoader(pin_memory=True), transformers' Trainer's default), so
    that the step's copies to the device are DMA, asynchronous to the host."""
    if torch.device(device).type != "cuda":
        return tensors
    return {k: v.pin_memory() for k, v in tensors.items()}


def _adamw(params, opt: AdamWConfig, **kw):
    return torch.optim.AdamW(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                             weight_decay=opt.weight_decay, **kw)


def prepare_state(params, opt) -> None:
    """Gradients and AdamW's moments allocated now, zero, as ours are from the start (torch
    makes them at the first backward and step): what a method keeps is then its own, not
    the optimizer's. The state is what AdamW's first step would make."""
    for p in params:
        p.grad = torch.zeros_like(p)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p)}


def hf_inputs(config: Wav2Vec2Config, batch, device="cuda") -> dict:
    """transformers' arguments for a timit.Batch: the attention mask covers each sample's
    samples; labels past each length are -100 (ignored)."""
    B, L = batch.waveform.shape
    mask = np.zeros((B, L), np.int64)
    for r, f in enumerate(batch.frames):
        mask[r, :config.samples(int(f))] = 1
    S = batch.labels.shape[1]
    labels = np.where(np.arange(S)[None] < batch.label_lengths[:, None], batch.labels, -100)
    return {"input_values": torch.from_numpy(batch.waveform).to(device),
            "attention_mask": torch.from_numpy(mask).to(device),
            "labels": torch.from_numpy(labels.astype(np.int64)).to(device)}


class HFTrainer:
    """transformers' training step, eager: float32, or float16 autocast with a GradScaler."""

    def __init__(self, config: Wav2Vec2Config, state_dict: dict, opt: AdamWConfig = AdamWConfig(),
                 *, amp: bool = False, device="cuda"):
        self.config, self.device, self.amp = config, device, amp
        self.model = hf_model(config, state_dict, device)
        self.opt = _adamw(self.model.parameters(), opt)
        prepare_state(self.model.parameters(), self.opt)
        self.scaler = torch.amp.GradScaler("cuda") if amp else None

    def prepare(self, batch) -> dict:
        """The data loader's part of a step: transformers' inputs on the host, pinned."""
        return loaded(hf_inputs(self.config, batch, "cpu"), self.device)

    def step(self, inputs: dict) -> float:
        """One training step on `prepare`'s inputs; the loss."""
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
        self.opt.zero_grad(set_to_none=False)
        if self.amp:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = self.model(**inputs).loss
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss = self.model(**inputs).loss
            loss.backward()
            self.opt.step()
        return loss.item()

    def close(self) -> None:
        self.model = self.opt = None


class TorchWav2Vec2(torch.nn.Module):
    """Wav2Vec2ForCTC's network up to the logits in capturable torch ops, on transformers'
    modules (so its weights are the model's own): `forward(input_values, frame_mask)` with
    frame_mask (B, T) float, 1 for each sample's frames."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf
        self.config = hf.config

    def forward(self, input_values, frame_mask):
        w = self.hf.wav2vec2
        x = w.feature_extractor(input_values)                  # (B, C, T)
        h, _ = w.feature_projection(x.transpose(1, 2))
        h = h * frame_mask[:, :, None]
        enc = w.encoder
        h = h + enc.pos_conv_embed(h)
        h = enc.layer_norm(h)
        B, T, d = h.shape
        H = self.config.num_attention_heads
        bias = (1.0 - frame_mask)[:, None, None, :] * torch.finfo(h.dtype).min
        for layer in enc.layers:
            a = layer.attention

            def heads(t):
                return t.view(B, T, H, d // H).transpose(1, 2)
            q, k, v = heads(a.q_proj(h)), heads(a.k_proj(h)), heads(a.v_proj(h))
            scores = torch.matmul(q, k.transpose(2, 3)) * a.scaling + bias
            att = torch.matmul(scores.softmax(-1), v).transpose(1, 2).reshape(B, T, d)
            h = layer.layer_norm(h + a.out_proj(att))
            h = layer.final_layer_norm(h + layer.feed_forward(h))
        return self.hf.lm_head(h)


class _Forward(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, input_values, frame_mask):
        return self.net(input_values, frame_mask)


def frame_mask(config: Wav2Vec2Config, batch, device="cuda"):
    T = batch.length
    return torch.from_numpy((np.arange(T)[None] < batch.frames[:, None]).astype(np.float32)).to(device)


def ctc(config: Wav2Vec2Config, logits, batch, dtype=torch.float32):
    """transformers' CTC loss on the logits (log-softmax in `dtype`, transformers' float32;
    blank = pad token)."""
    log_probs = F.log_softmax(logits, dim=-1, dtype=dtype).transpose(0, 1)
    labels = torch.from_numpy(batch.labels.astype(np.int64)).to(logits.device)
    return F.ctc_loss(log_probs, labels, batch.frames.tolist(), batch.label_lengths.tolist(),
                      blank=config.blank, reduction=config.ctc_reduction,
                      zero_infinity=config.zero_infinity)


def exact_model(config: Wav2Vec2Config, state_dict: dict, device="cuda") -> TorchWav2Vec2:
    """transformers' modules in float64 (the capturable rewrite, equal to its logits): the
    exact loss that float32 losses are measured against (`exact_loss`)."""
    return TorchWav2Vec2(hf_model(config, state_dict, device)).double()


def exact_loss(net64: TorchWav2Vec2, config: Wav2Vec2Config, batch, device="cuda") -> float:
    """The loss of `batch` in float64 throughout, the CTC loss too (transformers' own loss
    takes its log-softmax in float32 whatever the model's dtype), no gradient."""
    x = torch.from_numpy(batch.waveform).to(device, torch.float64)
    with torch.no_grad():
        logits = net64(x, frame_mask(config, batch, device).double())
        return ctc(config, logits, batch, dtype=torch.float64).item()


class PtGraphTrainer:
    """PtGraph's per-length training graphs (see the module doc). `pool`: "private" (each
    length's graphs their own memory pool, PyTorch's default) or "shared" (one pool for all
    lengths, captured largest first)."""

    def __init__(self, config: Wav2Vec2Config, state_dict: dict, opt: AdamWConfig = AdamWConfig(),
                 *, batch: int, pool: str, device="cuda"):
        if pool not in ("private", "shared"):
            raise ValueError(f"pool: expected 'private' or 'shared', got {pool!r}")
        self.config, self.batch, self.device = config, batch, device
        self.net = TorchWav2Vec2(hf_model(config, state_dict, device))
        self.opt = _adamw(self.net.parameters(), opt)
        prepare_state(self.net.parameters(), self.opt)
        self.pool = torch.cuda.graph_pool_handle() if pool == "shared" else None
        self.graphed: dict = {}     # frames -> (graphed callable, static inputs)

    def build(self, lengths, after_each=None) -> None:
        """Capture every length's forward and backward graphs, largest first."""
        for n, T in enumerate(sorted({int(t) for t in lengths}, reverse=True), 1):
            L = self.config.samples(T)
            x = torch.zeros(self.batch, L, device=self.device)
            m = torch.ones(self.batch, T, device=self.device)
            kw = {} if self.pool is None else {"pool": self.pool}
            # (make_graphed_callables replaces a module's forward: a wrapper per length, its
            # parameters the network's own, keeps the network's forward for the next capture)
            fn = torch.cuda.make_graphed_callables(_Forward(self.net), (x, m),
                                                   num_warmup_iters=3, **kw)
            self.graphed[T] = fn
            if after_each is not None:
                after_each(n)
        self.opt.zero_grad(set_to_none=False)   # (the warm-up's gradients are not a step)

    def prepare(self, batch) -> tuple:
        """The data loader's part of a step: the waveform and frame mask on the host, pinned
        (the batch itself for the loss's lengths)."""
        return batch, loaded({"waveform": torch.from_numpy(batch.waveform),
                              "mask": frame_mask(self.config, batch, "cpu")}, self.device)

    def step(self, prepared: tuple) -> float:
        """One training step on `prepare`'s inputs; the loss."""
        batch, host = prepared
        fn = self.graphed[batch.length]
        self.opt.zero_grad(set_to_none=False)
        logits = fn(host["waveform"].to(self.device, non_blocking=True),
                    host["mask"].to(self.device, non_blocking=True))
        loss = ctc(self.config, logits, batch)
        loss.backward()
        self.opt.step()
        return loss.item()

    def close(self) -> None:
        self.graphed = {}
        self.net = self.opt = None
