"""Kernel speed: every kernel at GPT-2-sized shapes against a measured bound and PyTorch.

For each kernel (ours, and the same op in PyTorch when torch and a GPU are present), timed
with proto.device.timing.bench, L2 flushed before each run so data comes from HBM as in a model
step where other layers' weights evicted it:
  median_us  the op replayed inside a graph (proto.graph; torch.cuda.CUDAGraph for PyTorch),
             as a model step runs it: the kernel's own time plus the graph's per-node gaps.
             GPT-2's decode GEMMs and decode attention run once per copy of their weights
             (or caches) in one graph, as many copies as make 2.5x the L2, so every launch
             streams from HBM as a step's layers do, and the graph launch is amortised;
             other ops whose data is at least twice the L2 repeat 10 times in the graph.
  eager_us   one eager call from an idle GPU: adds the host's launch path (Python, argument
             checks, the driver), of the same order as a ~100 us kernel (on the H200 the
             decode GEMM took 226 us through gemm() and 108 us launched bare).
From median_us, the bytes the op must move (each input read once, each output written once;
decode attention: the live K and V, positions 0..pos) or the FLOPs it must do give the
fraction of the bound it reaches:
  memory-bound kernels   achieved GB/s over the device's copy bandwidth, measured here as a
                         device-to-device copy of 1 GiB (bytes read + written / time);
  compute-bound kernels  achieved FLOP/s over the FP32 peak measured by an FMA loop
                         (kernels.peak; the datasheet's SMs x lanes x 2 x clock is beside it).
The decode GEMMs are GPT-2 small's, 5 beams (M = 5) with their fused epilogues: qkv
(768x2304 + bias), attention projection (768x768 + bias + residual), fc (768x3072 + bias,
GELU), MLP projection (3072x768 + bias + residual) and the tied output head (x @ wte.T,
50257 columns; also in the [K, N] layout). Pure weight streaming: the summary's
`decode_gemm_min_fraction_of_bandwidth` is the worst of the five. GPT-J-6B's decode GEMMs
run in float16 against cuBLAS's float16 GEMMs (tensor cores, as PyTorch runs them by
default), as the model launches them: fused qkv (4096 x 12288) and fc_in (4096 x 16384,
bias, GELU) as one launch of two outputs (gemm.gemm_two_outputs, against one cuBLAS GEMM
over both weights stacked), the attention output and fc_out as one product into the
residual (4096 + 16384 -> 4096, bias: gemm.gemm_sum, against one cuBLAS GEMM over both
concatenated) and the untied head (4096 x 50400, bias), every weight (N, K) as Hugging
Face stores it (`gptj_decode_gemm_min_fraction_of_bandwidth`,
`gptj_decode_gemm_over_cublas_fp16_time`); the four products each alone beside them
(`gptj_products_alone_fractions`).
Beside them, the two as the
model runs them: the whole MLP (`mlp_decode`: kernels.mlp's fused kernel and its sum, which
writes the next layer norm's rows too, against PyTorch's addmm, GELU, addmm_ and layer_norm;
`decode_mlp_fraction_of_bandwidth`, `decode_mlp_us`), and qkv with attention
(`self_attention_decode`: kernels.self_attention, whose tile sums qkv's K-split partials,
against PyTorch's addmm and SDPA over the live prefix; `decode_self_attention_us`). PyTorch runs the same with
TF32 off for matmuls and cuDNN (the CSV's torch_tf32 reads torch's flags; the residual as a
second op, as a user writes it). An LSTM step's gates GEMM (64
rows against a 4096 x 1024 weight) runs twice: as gemm() picks it (K split: few 64 x 64
tiles) and forced to one span (`lstm_gates_split_over_unsplit_time`), against torch.addmm.
A layer of each of VGG's five convolution stages at 224x224 input (conv1: 64 channels at
224x224 ... conv5: 512 at 14x14, 3x3, each over a batch that makes about 50,000 output pixels,
as a training batch does and more) runs its forward (bias, ReLU), backward-data and
backward-weight (with the bias gradient) against cuDNN's fp32 (`conv_fractions_of_fp32_peak`,
`conv_min_fraction_of_fp32_peak`, `conv_over_cudnn_time`; kernels `conv3_fwd` and so on);
so does VGG's first layer, `conv1_1` (3 -> 64 channels on the images: forward and weight
gradient, the two a training step runs). `maxpool_bwd` is the 2x2 max-pool's backward at VGG's
first pool (64 channels at 224x224), against PyTorch's.

Full size: d=768, vocab 50257, T=1024, batch 5. Toy size: tiny shapes for the simulator
(its timings mean nothing; the run checks the script end to end).

    python -m experiments kernel_speed            # run + plot
    python -m experiments kernel_speed --plot-only
"""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
from typing import Callable

import numpy as np

from experiments import common
from kernels import elementwise, embedding, gemm, layernorm, mlp, softmax
from proto.device import backend, timing
from proto import graph
from proto.device.backend import cuda

NAME = "kernel_speed"
HEADLINE = "gemm_decode_nt"
DECODE_GEMMS = ("gemm_decode_qkv", "gemm_decode_attn_proj", "gemm_decode_fc",
                "gemm_decode_mlp_proj", HEADLINE)  # GPT-2 small's five decode shapes
# GPT-J-6B's decode GEMMs in float16, 5 beams against Hugging Face's (N, K) Linear weights:
# q, k and v fused (no bias), the attention output and the MLP's second GEMM into the
# residual, the MLP's first (bias, GELU), the untied head (bias)
# GPT-J's decode GEMMs as its block launches them: qkv and fc_in, both of ln_1's rows, one
# launch (gemm.gemm_two_outputs); the attention projection and fc_out, both added into the
# residual, one launch over both (gemm.gemm_sum); the head. Each product alone beside them.
GPTJ_GEMMS = ("gemm_gptj_qkv_fc_in", "gemm_gptj_attn_out_fc_out", "gemm_gptj_head")
GPTJ_ALONE = ("gemm_gptj_qkv", "gemm_gptj_fc_in", "gemm_gptj_attn_out", "gemm_gptj_fc_out")
SIZES = {  # D model width, V vocab, T sequence, B batch (beams), H heads; LSTM: LB x L hidden;
    # convs: layer -> (N, C, K, H=W) of a 3x3, pad-1 VGG conv at 224x224 input; pool: (N, C,
    # H=W) of VGG's first 2x2 max-pool
    "full": dict(D=768, V=50257, T=1024, B=5, H=12, L=1024, LB=64,
                 convs={"conv1_1": (1, 3, 64, 224), "conv1": (1, 64, 64, 224),
                        "conv2": (4, 128, 128, 112), "conv3": (16, 256, 256, 56),
                        "conv4": (64, 512, 512, 28), "conv5": (256, 512, 512, 14)},
                 pool=(4, 64, 224), copy_bytes=1 << 30, gptj=dict(D=4096, F=16384, V=50400)),
    "toy": dict(D=8, V=24, T=5, B=2, H=1, L=8, LB=10,  # B*T, LB > 8: tiled
                convs={"conv1_1": (1, 3, 2, 6), "conv1": (1, 2, 2, 6), "conv3": (1, 4, 4, 6)},
                pool=(1, 2, 6), copy_bytes=1 << 16, gptj=dict(D=16, F=64, V=40)),
}
CONV_KINDS = ("fwd", "bwd_data", "bwd_weight")
# kernels.winograd beside the direct kernels where it applies (every 3x3 layer but the first,
# whose 3 input channels leave it no multiplications to save): f"{stage}_{kind}_winograd",
# its TFLOPs counted as the direct convolution's work (what it replaces)
WINOGRAD_KINDS = ("fwd", "bwd_data", "bwd_weight")


def conv_kinds(layer: str) -> tuple:
    """The convolutions a training step runs for a layer: VGG's first (conv1_1, on the
    images) needs no input gradient."""
    return ("fwd", "bwd_weight") if layer == "conv1_1" else CONV_KINDS
REPS = {"full": dict(warmup=3, reps=20), "toy": dict(warmup=0, reps=1)}  # toy: simulated
# FP32 lanes per SM by compute capability (8.0 and older datacenter parts have 64).
_FP32_LANES = {(6, 0): 64, (7, 0): 64, (8, 0): 64}

# Kernels of other modules, measured only where the module exists: module -> its cases.
OPTIONAL = {m: cases for m, cases in {"attention": ["attention_decode"],
                                      "self_attention": ["self_attention_decode"],
                                      "sampling": ["argmax", "topk", "beam_topk"],
                                      "lstm": ["lstm_cell"]}.items()
            if importlib.util.find_spec(f"kernels.{m}") is not None}


@dataclasses.dataclass
class Case:
    """One kernel at one shape. `ours()` / `theirs()` launch it (theirs: PyTorch, or None);
    `result()` / `their_result()` return what each computed, for a cross-check."""
    name: str
    shape: str
    bound: str  # "memory" or "compute"
    bytes: int
    flops: int
    ours: Callable
    result: Callable
    theirs: Callable | None = None
    their_result: Callable | None = None
    # Graph timing over rotating copies of the data: [(ours, theirs)] per copy, or None.
    rotation: list | None = None


def _torch():
    """The torch module when it and a CUDA GPU are usable here, else None."""
    if backend.SIMULATOR or importlib.util.find_spec("torch") is None:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    common.no_tf32()   # cuDNN's convolutions default to TF32: float32 must mean float32 here
    return torch


def _dev(x):
    return cuda.to_device(np.ascontiguousarray(x))


def _cases(s: dict, torch) -> list[Case]:
    rng = np.random.default_rng(0)
    D, V, T, B, H, L = (s[k] for k in "DVTBHL")
    f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    tt = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()) if torch else None
    F = torch.nn.functional if torch else None
    cases = []

    def add(name, shape, bound, nbytes, flops, ours, result, theirs=None, their_result=None):
        cases.append(Case(name, shape, bound, int(nbytes), int(flops), ours, result,
                          theirs if torch else None, their_result if torch else None))

    # Decode GEMMs: 5 beams against each of GPT-2's weights, with their epilogues.
    x = f32(B, D)
    wte = f32(V, D)
    dwte = _dev(wte)
    for name, K, N, trans_b, act, accumulate, bias in (
            ("gemm_decode_qkv", D, 3 * D, False, None, False, True),
            ("gemm_decode_attn_proj", D, D, False, None, True, True),
            ("gemm_decode_fc", D, 4 * D, False, "gelu", False, True),
            ("gemm_decode_mlp_proj", 4 * D, D, False, None, True, True),
            (HEADLINE, D, V, True, None, False, False),
            ("gemm_decode_nn", D, V, False, None, False, False)):
        w = wte if name == HEADLINE else (wte.T if name == "gemm_decode_nn" else f32(K, N))
        cases.append(_decode_gemm_case(name, rng, torch, tt, f32(B, K) if K != D else x,
                                       np.ascontiguousarray(w), N, trans_b, act, accumulate,
                                       f32(N) if bias else None))
    # GPT-J-6B's, in float16 beside cuBLAS's float16 GEMMs (tensor cores, PyTorch's default).
    # Weights scaled as trained ones are (std 0.02), so no float16 sum overflows.
    J = s["gptj"]
    h16 = lambda *shape, std=1.0: (std * rng.standard_normal(shape)).astype(np.float16)  # noqa: E731
    xj = h16(B, J["D"])
    for name, K, N, act, accumulate, bias in (
            ("gemm_gptj_qkv", J["D"], 3 * J["D"], None, False, False),
            ("gemm_gptj_attn_out", J["D"], J["D"], None, True, False),
            ("gemm_gptj_fc_in", J["D"], J["F"], "gelu", False, True),
            ("gemm_gptj_fc_out", J["F"], J["D"], None, True, True),
            ("gemm_gptj_head", J["D"], J["V"], None, False, True)):
        cases.append(_decode_gemm_case(name, rng, torch, tt, xj if K == J["D"] else h16(B, K),
                                       h16(N, K, std=0.02), N, True, act, accumulate,
                                       h16(N) if bias else None))
    cases.append(_decode_gemm_outs_case(
        "gemm_gptj_qkv_fc_in", rng, torch, tt, xj, h16(3 * J["D"], J["D"], std=0.02),
        h16(J["F"], J["D"], std=0.02), h16(J["F"])))
    cases.append(_decode_gemm_sum_case(
        "gemm_gptj_attn_out_fc_out", rng, torch, tt, (xj, h16(J["D"], J["D"], std=0.02)),
        (h16(B, J["F"]), h16(J["D"], J["F"], std=0.02)), h16(J["D"])))
    # The whole MLP of a decode step (kernels.mlp: one fused kernel and a sum that also
    # normalizes the rows for the next layer), against the two GEMMs above that it replaces
    # and PyTorch's four ops.
    cases.append(_decode_mlp_case(rng, torch, tt, x, f32(D, 4 * D), f32(4 * D),
                                  f32(4 * D, D), f32(D), (f32(D), f32(D))))

    # Prefill GEMM (c_attn: bias fused) and the MLP's first GEMM (bias + GELU fused).
    xs, w_attn, b_attn = f32(B * T, D), f32(D, 3 * D) * 0.05, f32(3 * D)
    dxs, dw_attn, db_attn = _dev(xs), _dev(w_attn), _dev(b_attn)
    out_attn = cuda.device_array((B * T, 3 * D), np.float32)
    txs, tw_attn, tb_attn = (tt(xs), tt(w_attn), tt(b_attn)) if torch else (None,) * 3
    tout_attn = torch.empty(B * T, 3 * D, device="cuda") if torch else None
    add("gemm_prefill_bias", f"{B * T}x{D} @ {D}x{3 * D} + bias", "compute",
        4 * (B * T * D + D * 3 * D + 3 * D + B * T * 3 * D), 2 * B * T * D * 3 * D,
        lambda: gemm.gemm(dxs, dw_attn, out_attn, bias=db_attn), out_attn.copy_to_host,
        lambda: torch.addmm(tb_attn, txs, tw_attn, out=tout_attn),
        lambda: tout_attn.cpu().numpy())
    w_fc, b_fc = f32(D, 4 * D) * 0.05, f32(4 * D)
    dw_fc, db_fc = _dev(w_fc), _dev(b_fc)
    out_fc = cuda.device_array((B * T, 4 * D), np.float32)
    tw_fc, tb_fc = (tt(w_fc), tt(b_fc)) if torch else (None, None)
    add("gemm_prefill_bias_gelu", f"{B * T}x{D} @ {D}x{4 * D} + bias, gelu", "compute",
        4 * (B * T * D + D * 4 * D + 4 * D + B * T * 4 * D), 2 * B * T * D * 4 * D,
        lambda: gemm.gemm(dxs, dw_fc, out_fc, bias=db_fc, act="gelu"), out_fc.copy_to_host,
        lambda: F.gelu(torch.addmm(tb_fc, txs, tw_fc), approximate="tanh"),
        lambda: F.gelu(torch.addmm(tb_fc, txs, tw_fc), approximate="tanh").cpu().numpy())

    # An LSTM step's gates GEMM: LB rows of h against W_hh.T (4L x L) + bias. Its 64 x 64
    # tiles are few for the SMs, so gemm() splits K (gemm.tiled_plan); "_unsplit" forces one
    # span through the same kernel, so the split's effect is measured in the same run.
    LB, Lh = s["LB"], s["L"]
    hx, w_hh, b_g = f32(LB, Lh), f32(4 * Lh, Lh) * 0.05, f32(4 * Lh)
    dhx, dw_hh, db_g = _dev(hx), _dev(w_hh), _dev(b_g)
    out_g = cuda.device_array((LB, 4 * Lh), np.float32)
    thx, tw_hh, tb_g = (tt(hx), tt(w_hh), tt(b_g)) if torch else (None,) * 3
    tout_g = torch.empty(LB, 4 * Lh, device="cuda") if torch else None
    gates = (f"{LB}x{Lh} @ ({4 * Lh}x{Lh}).T + bias", "compute",
             4 * (LB * Lh + 4 * Lh * Lh + 4 * Lh + LB * 4 * Lh), 2 * LB * Lh * 4 * Lh)
    add("gemm_lstm_gates", *gates,
        lambda: gemm.gemm(dhx, dw_hh, out_g, bias=db_g, trans_b=True), out_g.copy_to_host,
        lambda: torch.addmm(tb_g, thx, tw_hh.t(), out=tout_g), lambda: tout_g.cpu().numpy())
    flags = (1, gemm.ACTS[None], 0, 0, 1)   # bias, act, accumulate, trans_a, trans_b
    add("gemm_lstm_gates_unsplit", *gates,
        lambda: gemm.tiled(dhx.reshape(1, LB, Lh), dw_hh.reshape(1, 4 * Lh, Lh),
                           out_g.reshape(1, LB, 4 * Lh), db_g, *flags, 0, target_blocks=1),
        out_g.copy_to_host)

    # Row kernels.
    twte = tt(wte) if torch else None
    gamma, beta = f32(D), f32(D)
    dgamma, dbeta = _dev(gamma), _dev(beta)
    out_ln = cuda.device_array((B * T, D), np.float32)
    tgamma, tbeta = (tt(gamma), tt(beta)) if torch else (None, None)
    add("layernorm", f"{B * T}x{D}", "memory", 4 * (2 * B * T * D + 2 * D), 0,
        lambda: layernorm.layernorm(dxs, dgamma, dbeta, out_ln), out_ln.copy_to_host,
        lambda: F.layer_norm(txs, (D,), tgamma, tbeta, 1e-5),
        lambda: F.layer_norm(txs, (D,), tgamma, tbeta, 1e-5).cpu().numpy())
    scores = f32(B * H * T, T) * 3
    dscores, dlen = _dev(scores), _dev(np.array([T], np.int32))
    out_sm = cuda.device_array(scores.shape, np.float32)
    tscores = tt(scores) if torch else None
    add("masked_softmax", f"{B * H * T}x{T}, length {T}", "memory", 8 * scores.size, 0,
        lambda: softmax.masked_softmax(dscores, dlen, out_sm), out_sm.copy_to_host,
        lambda: torch.softmax(tscores, -1), lambda: torch.softmax(tscores, -1).cpu().numpy())
    logits = f32(B, V) * 3
    dlogits = _dev(logits)
    out_ls = cuda.device_array((B, V), np.float32)
    tlogits = tt(logits) if torch else None
    add("log_softmax", f"{B}x{V}", "memory", 8 * logits.size, 0,
        lambda: softmax.log_softmax(dlogits, out_ls), out_ls.copy_to_host,
        lambda: F.log_softmax(tlogits, -1), lambda: F.log_softmax(tlogits, -1).cpu().numpy())

    # Embedding lookup of a whole prompt batch (token + position).
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    wpe = f32(T, D)
    dtokens, dwpe = _dev(tokens), _dev(wpe)
    out_emb = cuda.device_array((B, T, D), np.float32)
    ttokens = tt(tokens).long() if torch else None
    twpe = tt(wpe) if torch else None
    tpos = torch.arange(T, device="cuda") if torch else None
    add("embed", f"{B}x{T} tokens, {V}x{D} + {T}x{D}", "memory",
        4 * (B * T + 3 * B * T * D), 0,
        lambda: embedding.embed(dtokens, dwte, out_emb, wpe=dwpe), out_emb.copy_to_host,
        lambda: F.embedding(ttokens, twte) + F.embedding(tpos, twpe),
        lambda: (F.embedding(ttokens, twte) + F.embedding(tpos, twpe)).cpu().numpy())

    # Elementwise.
    h = f32(B * T, 4 * D)
    dh, out_gelu = _dev(h), cuda.device_array(h.shape, np.float32)
    th = tt(h) if torch else None
    add("gelu", f"{B * T}x{4 * D}", "memory", 8 * h.size, 0,
        lambda: elementwise.gelu(dh, out_gelu), out_gelu.copy_to_host,
        lambda: F.gelu(th, approximate="tanh"),
        lambda: F.gelu(th, approximate="tanh").cpu().numpy())
    out_add = cuda.device_array(xs.shape, np.float32)
    add("add", f"{B * T}x{D}", "memory", 12 * xs.size, 0,
        lambda: elementwise.add(dxs, dxs, out_add), out_add.copy_to_host,
        lambda: torch.add(txs, txs), lambda: (txs + txs).cpu().numpy())

    if "attention" in OPTIONAL:
        cases.append(_attention_case(s, rng, torch, tt))
    if "self_attention" in OPTIONAL:
        cases.append(_self_attention_case(s, rng, torch, tt))
    if "sampling" in OPTIONAL:
        cases.extend(_sampling_cases(s, rng, torch, tt))
    if "lstm" in OPTIONAL:
        cases.append(_lstm_case(s, rng, torch, tt))
    for stage, dims in s["convs"].items():
        cases.extend(_conv_cases(stage, dims, rng, torch, tt))
    cases.append(_pool_bwd_case(s["pool"], rng, torch, tt))
    return cases


def _copies(nbytes: int) -> int:
    """Copies of an op's data that make 2.5x the L2 (at most 64): the graph runs the op once
    on each, so none finds its data in L2. One on the simulator."""
    if backend.SIMULATOR:
        return 1
    return max(1, min(64, -(-5 * cuda.get_current_device().L2_CACHE_SIZE // (2 * nbytes))))


def _decode_gemm_case(name, rng, torch, tt, x, w, N, trans_b, act, accumulate,
                      bias) -> Case:
    """out (B, N) (+)= act(x @ op(w) + bias) on rotating copies of w, x and out."""
    B, K = x.shape
    old = rng.standard_normal((B, N)).astype(x.dtype)
    nbytes = x.itemsize * (w.size + x.size + old.size * (2 if accumulate else 1)
                           + (0 if bias is None else N))
    dbias = None if bias is None else _dev(bias)
    tbias = tt(bias) if torch and bias is not None else None
    F = torch.nn.functional if torch else None
    rotation, outs, last = [], [], {}
    for _ in range(_copies(nbytes)):
        dx, dw, dout = _dev(x), _dev(w), _dev(old)
        outs.append(dout)
        ours = (lambda dx=dx, dw=dw, dout=dout: gemm.gemm(
            dx, dw, dout, bias=dbias, act=act, trans_b=trans_b, accumulate=accumulate))
        theirs = None
        if torch:
            tx, tw, tout = tt(x), tt(w), tt(old)

            def theirs(tx=tx, tw=tw, tout=tout):
                wk = tw.T if trans_b else tw
                if accumulate:  # the residual: out += x @ w + bias
                    y = tout.addmm_(tx, wk)
                    y = y if tbias is None else y.add_(tbias)
                else:
                    y = torch.matmul(tx, wk, out=tout) if tbias is None else \
                        torch.addmm(tbias, tx, wk, out=tout)
                    y = F.gelu(y, approximate="tanh") if act == "gelu" else y
                last.setdefault("y", y)  # copy 0's first result, for the cross-check
                return y
        rotation.append((ours, theirs))
    shape = f"{B}x{K} @ " + (f"({N}x{K}).T" if trans_b else f"{K}x{N}") + \
        ("" if bias is None else " + bias") + (", gelu" if act else "") + \
        (", += out" if accumulate else "")
    # Cross-check on copy 0: both start from the same old out, each runs once.
    first_ours, first_theirs = rotation[0]
    return Case(name, shape, "memory", nbytes, 2 * B * K * N, first_ours, outs[0].copy_to_host,
                first_theirs, (lambda: last["y"].cpu().numpy()) if torch else None, rotation)


def _decode_gemm_outs_case(name, rng, torch, tt, x, w, w2, bias2) -> Case:
    """out (B, N1) = x @ w.T and out2 (B, N2) = GELU(x @ w2.T + bias2) on rotating copies:
    ours one gemm_two_outputs, cuBLAS one GEMM against both weights stacked (made before
    timing, as a user who stores them so would) and the bias and GELU on out2's columns."""
    B, N1, N2 = x.shape[0], w.shape[0], w2.shape[0]
    nbytes = x.itemsize * (w.size + w2.size + x.size + B * (N1 + N2) + N2)
    dbias, tbias = _dev(bias2), tt(bias2) if torch else None
    F = torch.nn.functional if torch else None
    rotation, outs, last = [], [], {}
    for _ in range(_copies(nbytes)):
        dx, dw, dw2 = _dev(x), _dev(w), _dev(w2)
        dout, dout2 = (cuda.device_array((B, n), x.dtype) for n in (N1, N2))
        outs.append((dout, dout2))
        ours = (lambda dx=dx, dw=dw, dw2=dw2, dout=dout, dout2=dout2: gemm.gemm_two_outputs(
            dx, dw, dout, dw2, dout2, bias2=dbias, act2="gelu"))
        theirs = None
        if torch:
            tx, tw = tt(x), torch.cat([tt(w), tt(w2)], dim=0)
            tout = torch.empty(B, N1 + N2, dtype=tx.dtype, device="cuda")

            def theirs(tx=tx, tw=tw, tout=tout):
                y = torch.matmul(tx, tw.T, out=tout)
                y2 = y[:, N1:]
                y2.copy_(F.gelu(y2 + tbias, approximate="tanh"))
                last.setdefault("y", y)
                return y
        rotation.append((ours, theirs))
    shape = f"{B}x{x.shape[1]} @ ({N1}x{x.shape[1]}).T, @ ({N2}x{x.shape[1]}).T + bias, gelu"
    first_ours, first_theirs = rotation[0]
    return Case(name, shape, "memory", nbytes, 2 * B * (w.size + w2.size), first_ours,
                lambda: np.concatenate([o.copy_to_host() for o in outs[0]], axis=1),
                first_theirs, (lambda: last["y"].cpu().numpy()) if torch else None, rotation)


def _decode_gemm_sum_case(name, rng, torch, tt, first, second, bias) -> Case:
    """out (B, N) += x @ w.T + x2 @ w2.T + bias (`first` = (x, w), `second` = (x2, w2),
    weights (N, K)) on rotating copies: ours one gemm_sum, cuBLAS one addmm over both
    operands concatenated along K (made before timing: the strongest way to run it, one
    GEMM reading both weights, as a user who stores the weights side by side would)."""
    (x, w), (x2, w2) = first, second
    (B, _), N = x.shape, w.shape[0]
    old = rng.standard_normal((B, N)).astype(x.dtype)
    nbytes = x.itemsize * (w.size + w2.size + x.size + x2.size + 2 * old.size + N)
    dbias, tbias = _dev(bias), tt(bias) if torch else None
    rotation, outs, last = [], [], {}
    for _ in range(_copies(nbytes)):
        ops, dout = [_dev(v) for v in (x, w, x2, w2)], _dev(old)
        outs.append(dout)
        ours = (lambda ops=ops, dout=dout: gemm.gemm_sum(*ops, dout, bias=dbias,
                                                         accumulate=True))
        theirs = None
        if torch:
            tx = torch.cat([tt(x), tt(x2)], dim=1)
            tw, tout = torch.cat([tt(w), tt(w2)], dim=1), tt(old)

            def theirs(tx=tx, tw=tw, tout=tout):
                y = tout.addmm_(tx, tw.T).add_(tbias)
                last.setdefault("y", y)
                return y
        rotation.append((ours, theirs))
    shape = (f"{B}x{x.shape[1]} @ ({N}x{x.shape[1]}).T + {B}x{x2.shape[1]} @ "
             f"({N}x{x2.shape[1]}).T + bias, += out")
    first_ours, first_theirs = rotation[0]
    return Case(name, shape, "memory", nbytes, 2 * B * (w.size + w2.size), first_ours,
                outs[0].copy_to_host, first_theirs,
                (lambda: last["y"].cpu().numpy()) if torch else None, rotation)


def _decode_mlp_case(rng, torch, tt, x, w1, b1, w2, b2, ln) -> Case:
    """out (B, D) += GELU(x @ w1 + b1) @ w2 + b2, then ln_out = layernorm(out) with ln =
    (gamma, beta), as the model runs it, on rotating copies of the weights, x, out and
    ln_out. PyTorch: addmm, GELU (tanh), addmm_ into out and the bias, layer_norm. The
    cross-check compares out."""
    (B, D), H = x.shape, w1.shape[1]
    old = rng.standard_normal((B, D), dtype=np.float32)
    nbytes = 4 * (w1.size + b1.size + w2.size + b2.size + x.size + 3 * old.size + 2 * D)
    F = torch.nn.functional if torch else None
    dln = (_dev(ln[0]), _dev(ln[1]))
    tln = (tt(ln[0]), tt(ln[1])) if torch else None
    rotation, outs, last = [], [], {}
    for _ in range(_copies(nbytes)):
        dx, dw1, db1, dw2, db2, dout = (_dev(a) for a in (x, w1, b1, w2, b2, old))
        dy = cuda.device_array((B, D), np.float32)
        outs.append(dout)
        ours = (lambda dx=dx, dw1=dw1, db1=db1, dw2=dw2, db2=db2, dout=dout, dy=dy:
                mlp.mlp(dx, dw1, db1, dw2, db2, dout, ln_out=(*dln, 1e-5, dy)))
        theirs = None
        if torch:
            tx, tw1, tb1, tw2, tb2, tout = (tt(a) for a in (x, w1, b1, w2, b2, old))

            def theirs(tx=tx, tw1=tw1, tb1=tb1, tw2=tw2, tb2=tb2, tout=tout):
                h = F.gelu(torch.addmm(tb1, tx, tw1), approximate="tanh")
                y = tout.addmm_(h, tw2).add_(tb2)
                F.layer_norm(y, (D,), *tln, 1e-5)
                last.setdefault("y", y)  # copy 0's first result, for the cross-check
                return y
        rotation.append((ours, theirs))
    shape = (f"{B}x{D} @ {D}x{H} + bias, gelu, @ {H}x{D} + bias, += out, layernorm"
             + (" (fused)" if mlp.fuses(B, D, H) else " (two GEMMs)"))
    first_ours, first_theirs = rotation[0]
    return Case("mlp_decode", shape, "memory", nbytes, 4 * B * D * H, first_ours,
                outs[0].copy_to_host, first_theirs,
                (lambda: last["y"].cpu().numpy()) if torch else None, rotation)


def _attention_case(s, rng, torch, tt) -> Case:
    """One decode step halfway through the cache (GPT-2 beam search at position 512 of
    1024): 1 query per beam and head against the live positions 0..pos, on rotating copies
    of the caches. Bytes: the live K and V (plus q, k, v in and the output). PyTorch:
    SDPA over the same live prefix after writing this step's k, v."""
    from kernels import attention
    D, T, B, H = s["D"], s["T"], s["B"], s["H"]
    hd, pos = D // H, T // 2
    qkv = rng.standard_normal((B, 1, 3 * D), dtype=np.float32)
    cache = rng.standard_normal((2, B, H, T, hd), dtype=np.float32)
    dpos = _dev(np.array([pos], np.int32))
    nbytes = 4 * (2 * B * H * (pos + 1) * hd + B * 3 * D + B * D)
    rotation, outs, last = [], [], {}
    for _ in range(_copies(cache.nbytes)):
        dqkv, dk, dv = _dev(qkv), _dev(cache[0]), _dev(cache[1])
        out = cuda.device_array((B, 1, D), np.float32)
        outs.append(out)
        ours = (lambda dqkv=dqkv, dk=dk, dv=dv, out=out:
                attention.attention(dqkv, dk, dv, dpos, out, n_head=H))
        theirs = None
        if torch:
            tq = tt(qkv[:, 0, :D].reshape(B, H, 1, hd))
            tk, tvv = tt(cache[0]), tt(cache[1])
            tnew = tt(qkv[:, 0, D:].reshape(B, 2, H, 1, hd))

            def theirs(tq=tq, tk=tk, tvv=tvv, tnew=tnew):
                tk[:, :, pos:pos + 1] = tnew[:, 0]
                tvv[:, :, pos:pos + 1] = tnew[:, 1]
                y = torch.nn.functional.scaled_dot_product_attention(
                    tq, tk[:, :, :pos + 1], tvv[:, :, :pos + 1])
                last.setdefault("y", y)
                return y
        rotation.append((ours, theirs))
    their_result = (lambda: last["y"].permute(0, 2, 1, 3).reshape(B, 1, D).cpu().numpy()) \
        if torch else None
    return Case("attention_decode", f"B{B} H{H} hd{hd}, pos {pos} of {T}", "memory", nbytes,
                4 * B * H * (pos + 1) * hd, rotation[0][0], outs[0].copy_to_host,
                rotation[0][1], their_result, rotation)


def _self_attention_case(s, rng, torch, tt) -> Case:
    """A decode layer's qkv projection and attention as the model runs them
    (`kernels.self_attention`: at GPT-2 small's size the projection's K-split partials,
    summed by the attention tile), at the attention case's position, on rotating copies of
    the weight and the caches. Bytes: the weight and bias, the live K and V, x and the
    output. PyTorch: addmm, then SDPA over the live prefix after writing this step's k, v."""
    from kernels import self_attention
    D, T, B, H = s["D"], s["T"], s["B"], s["H"]
    hd, pos = D // H, T // 2
    x = rng.standard_normal((B, 1, D), dtype=np.float32)
    w = rng.standard_normal((D, 3 * D), dtype=np.float32) / np.float32(np.sqrt(D))
    b = rng.standard_normal(3 * D, dtype=np.float32)
    cache = rng.standard_normal((2, B, H, T, hd), dtype=np.float32)
    dpos, dx, db = _dev(np.array([pos], np.int32)), _dev(x), _dev(b)
    nbytes = 4 * (w.size + b.size + 2 * B * H * (pos + 1) * hd + B * D + B * D)
    tx, tb = (tt(x[:, 0]), tt(b)) if torch else (None, None)
    rotation, outs, last = [], [], {}
    for _ in range(_copies(w.nbytes + cache.nbytes)):
        dw, dk, dv = _dev(w), _dev(cache[0]), _dev(cache[1])
        out = cuda.device_array((B, 1, D), np.float32)
        outs.append(out)
        ours = (lambda dw=dw, dk=dk, dv=dv, out=out: self_attention.self_attention(
            dx, dw, db, dk, dv, dpos, out, n_head=H))
        theirs = None
        if torch:
            tw, tk, tvv = tt(w), tt(cache[0]), tt(cache[1])

            def theirs(tw=tw, tk=tk, tvv=tvv):
                qkv = torch.addmm(tb, tx, tw).reshape(B, 3, H, 1, hd)
                tk[:, :, pos:pos + 1] = qkv[:, 1]
                tvv[:, :, pos:pos + 1] = qkv[:, 2]
                y = torch.nn.functional.scaled_dot_product_attention(
                    qkv[:, 0], tk[:, :, :pos + 1], tvv[:, :, :pos + 1])
                last.setdefault("y", y)
                return y
        rotation.append((ours, theirs))
    their_result = (lambda: last["y"].permute(0, 2, 1, 3).reshape(B, 1, D).cpu().numpy()) \
        if torch else None
    return Case("self_attention_decode",
                f"{B}x{D} @ {D}x{3 * D} + bias, then attention B{B} H{H} hd{hd}, pos {pos} "
                f"of {T}", "memory", nbytes,
                2 * B * D * 3 * D + 4 * B * H * (pos + 1) * hd, rotation[0][0],
                outs[0].copy_to_host, rotation[0][1], their_result, rotation)


def _sampling_cases(s, rng, torch, tt) -> list[Case]:
    """Beam search ranks all beams x vocab scores of a step in one row."""
    from kernels import sampling
    n = s["B"] * s["V"]
    scores = rng.standard_normal((1, n), dtype=np.float32)
    dscores = _dev(scores)
    am = cuda.device_array(1, np.int32)
    k = s["B"]
    values, indices = cuda.device_array((1, k), np.float32), cuda.device_array((1, k), np.int32)
    ts = tt(scores) if torch else None
    return [
        Case("argmax", f"1x{n}", "memory", 4 * n, 0,
             lambda: sampling.argmax(dscores, am), am.copy_to_host,
             (lambda: torch.argmax(ts, -1)) if torch else None,
             (lambda: torch.argmax(ts, -1).int().cpu().numpy()) if torch else None),
        Case("topk", f"1x{n}, k {k}", "memory", 4 * n, 0,
             lambda: sampling.topk(dscores, k, values, indices), values.copy_to_host,
             (lambda: torch.topk(ts, k)) if torch else None,
             (lambda: torch.topk(ts, k).values.cpu().numpy()) if torch else None),
        _beam_topk_case(s, rng, torch, tt),
    ]


def _beam_topk_case(s, rng, torch, tt) -> Case:
    """A beam-search step's whole candidate choice: the top 2B of log_softmax(logits) + the
    beams' scores over B x vocab (PyTorch: log_softmax, add, topk over the flattened row)."""
    from kernels import sampling
    B, V = s["B"], s["V"]
    k = min(2 * B, sampling.KMAX)
    logits = rng.standard_normal((B, V), dtype=np.float32)
    scores = -np.abs(rng.standard_normal((B, 1), dtype=np.float32))
    dl, ds = _dev(logits), _dev(scores)
    values, indices = cuda.device_array((1, k), np.float32), cuda.device_array((1, k), np.int32)
    theirs = None
    if torch:
        import torch.nn.functional as F
        tl, tsc = tt(logits), tt(scores)

        def theirs():
            return torch.topk((F.log_softmax(tl, -1) + tsc).reshape(1, -1), k)
    return Case("beam_topk", f"{B}x{V}, k {k}", "memory", 4 * B * V, 0,
                lambda: sampling.beam_topk(dl, ds, k, values, indices), values.copy_to_host,
                theirs, (lambda: theirs().values.cpu().numpy()) if torch else None)


def _lstm_case(s, rng, torch, tt) -> Case:
    from kernels import lstm
    B, Hh = s["LB"], s["L"]
    gates = rng.standard_normal((B, 4 * Hh), dtype=np.float32)
    c = rng.standard_normal((B, Hh), dtype=np.float32)
    dgates, dc = _dev(gates), _dev(c)
    h_out, c_out = cuda.device_array((B, Hh), np.float32), cuda.device_array((B, Hh), np.float32)
    theirs = their_result = None
    if torch:
        tg, tc = tt(gates), tt(c)

        def theirs():
            i, f, g, o = tg.chunk(4, 1)
            c2 = torch.sigmoid(f) * tc + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c2)

        def their_result():
            return theirs().cpu().numpy()
    return Case("lstm_cell", f"B{B} H{Hh}", "memory", 4 * (B * 4 * Hh + 3 * B * Hh), 0,
                lambda: lstm.lstm_cell(dgates, dc, h_out, c_out), h_out.copy_to_host,
                theirs, their_result)


def _conv_cases(stage: str, dims, rng, torch, tt) -> list[Case]:
    """A VGG layer's convolutions (3x3, pad 1, ReLU fused into the forward; the weight
    gradient with the bias gradient; those of `conv_kinds(stage)`) against cuDNN's fp32 (TF32
    off) through torch; kernels named f"{stage}_fwd" and so on."""
    from kernels import conv
    N, C, K, HW = dims
    x = rng.standard_normal((N, C, HW, HW), dtype=np.float32)
    w = rng.standard_normal((K, C, 3, 3), dtype=np.float32) * np.float32(0.05)
    b = rng.standard_normal(K, dtype=np.float32)
    dy = rng.standard_normal((N, K, HW, HW), dtype=np.float32)
    dx_, dw_, db_, ddy = _dev(x), _dev(w), _dev(b), _dev(dy)
    out, dxg = cuda.device_array(dy.shape, np.float32), cuda.device_array(x.shape, np.float32)
    dwg, dbg = cuda.device_array(w.shape, np.float32), cuda.device_array(K, np.float32)
    work = cuda.device_array(max(1, conv.wgrad_workspace_size(x.shape, w.shape, pad=1)),
                             np.float32)
    flops = int(conv.conv2d_flops(N, C, K, 3, 3, HW, HW))
    shape = f"N{N} C{C} K{K} {HW}x{HW}, 3x3 pad 1"
    act_bytes = 2 * (x.size + dy.size)   # 4 bytes each, half of it in, half out
    if torch:
        F, grad = torch.nn.functional, torch.nn.grad
        tx, tw, tb, tdy = tt(x), tt(w), tt(b), tt(dy)
        fwd = lambda: F.relu(F.conv2d(tx, tw, tb, padding=1))  # noqa: E731
        bwd_data = lambda: grad.conv2d_input(tx.shape, tw, tdy, padding=1)  # noqa: E731
        bwd_weight = lambda: (grad.conv2d_weight(tx, tw.shape, tdy, padding=1),  # noqa: E731
                              tdy.sum((0, 2, 3)))
    else:
        fwd = bwd_data = bwd_weight = None

    def result_of(fn, index=None):
        return None if fn is None else (
            lambda: (fn() if index is None else fn()[index]).cpu().numpy())
    cases = [
        Case(f"{stage}_fwd", shape + ", bias, relu", "compute", 2 * act_bytes + 4 * (w.size + K),
             flops, lambda: conv.conv2d(dx_, dw_, db_, out, pad=1, relu=True),
             out.copy_to_host, fwd, result_of(fwd)),
        Case(f"{stage}_bwd_data", shape, "compute", 2 * act_bytes + 4 * w.size, flops,
             lambda: conv.conv2d_bwd_data(ddy, dw_, dxg, pad=1), dxg.copy_to_host,
             bwd_data, result_of(bwd_data)),
        Case(f"{stage}_bwd_weight", shape + ", with db", "compute", 2 * act_bytes + 4 * (w.size + K),
             flops, lambda: conv.conv2d_bwd_weight(dx_, ddy, dwg, dbg, pad=1, workspace=work),
             dwg.copy_to_host, bwd_weight, result_of(bwd_weight, 0)),
    ]
    if stage != "conv1_1":
        from kernels import winograd
        wino = cuda.device_array(winograd.workspace_size(x.shape, w.shape, pad=1), np.float32)
        wout, wdx = cuda.device_array(dy.shape, np.float32), cuda.device_array(x.shape, np.float32)
        wdw, wdb = cuda.device_array(w.shape, np.float32), cuda.device_array(K, np.float32)
        cases += [
            Case(f"{stage}_fwd_winograd", shape + ", bias, relu", "compute",
                 2 * act_bytes + 4 * (w.size + K), flops,
                 lambda: winograd.conv2d(dx_, dw_, db_, wout, pad=1, relu=True, workspace=wino),
                 wout.copy_to_host, fwd, result_of(fwd)),
            Case(f"{stage}_bwd_data_winograd", shape, "compute", 2 * act_bytes + 4 * w.size, flops,
                 lambda: winograd.conv2d_bwd_data(ddy, dw_, wdx, pad=1, workspace=wino),
                 wdx.copy_to_host, bwd_data, result_of(bwd_data)),
            Case(f"{stage}_bwd_weight_winograd", shape + ", with db", "compute",
                 2 * act_bytes + 4 * (w.size + K), flops,
                 lambda: winograd.conv2d_bwd_weight(dx_, ddy, wdw, wdb, pad=1, workspace=wino),
                 wdw.copy_to_host, bwd_weight, result_of(bwd_weight, 0))]
    wanted = {f"{stage}_{kind}" for kind in conv_kinds(stage)}
    wanted |= {f"{stage}_{kind}_winograd" for kind in WINOGRAD_KINDS if stage != "conv1_1"}
    return [c for c in cases if c.name in wanted]


def _pool_bwd_case(dims, rng, torch, tt) -> Case:
    """VGG's 2x2 max-pool backward at its first pool (dx from the pool's input and dy),
    against PyTorch's max_pool2d backward (which reads the indices its forward saved)."""
    from kernels import pool
    N, C, HW = dims
    x = rng.standard_normal((N, C, HW, HW), dtype=np.float32)
    dy = rng.standard_normal((N, C, HW // 2, HW // 2), dtype=np.float32)
    dx_, ddy = _dev(x), _dev(dy)
    dxg = cuda.device_array(x.shape, np.float32)
    theirs = their_result = None
    if torch:
        tx, tdy = tt(x), tt(dy)
        _, idx = torch.nn.functional.max_pool2d(tx, 2, 2, return_indices=True)
        theirs = lambda: torch.ops.aten.max_pool2d_with_indices_backward(  # noqa: E731
            tdy, tx, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
        their_result = lambda: theirs().cpu().numpy()  # noqa: E731
    return Case("maxpool_bwd", f"N{N} C{C} {HW}x{HW}, 2x2 stride 2", "memory",
                4 * (2 * x.size + dy.size), 0, lambda: pool.maxpool2x2_bwd(dx_, ddy, dxg),
                dxg.copy_to_host, theirs, their_result)


def fp32_spec_TFLOPs() -> float | None:
    """The datasheet peak: SMs x FP32 lanes x 2 FLOP (an FMA) x clock; None on the simulator."""
    if backend.SIMULATOR:
        return None
    dev = cuda.get_current_device()
    lanes = _FP32_LANES.get(tuple(dev.compute_capability), 128)
    return dev.MULTIPROCESSOR_COUNT * lanes * 2 * dev.CLOCK_RATE * 1e3 / 1e12


def fp32_fma_peak_TFLOPs(reps: dict) -> float | None:
    """The FP32 peak kernels can reach, measured: kernels.peak's FMA loop over two waves of
    full blocks (the compute-bound kernels' bound). None on the simulator."""
    if backend.SIMULATOR:
        return None
    from kernels import peak
    blocks = 16 * cuda.get_current_device().MULTIPROCESSOR_COUNT
    out = cuda.device_array(blocks * peak.THREADS, np.float32)
    iters = 1024   # about 2 ms a launch
    flops = peak.fma_loop(out, blocks, iters)   # (a first launch, untimed)
    t = timing.bench(lambda: peak.fma_loop(out, blocks, iters), **reps)
    return flops / (t.median_ms * 1e-3) / 1e12


def _release_device_memory():
    """Numba frees device arrays lazily; flush its queue so the next measurement has room."""
    gc.collect()
    if not backend.SIMULATOR:
        cuda.synchronize()
        cuda.current_context().memory_manager.deallocations.clear()


def _graph_repeats(nbytes: int) -> int:
    """How many times a graph repeats an op: 10 when its data is at least twice the L2 (each
    pass then still streams from HBM), else 1 (a repeat would find its inputs in L2)."""
    if backend.SIMULATOR:
        return 1
    return 10 if nbytes >= 2 * cuda.get_current_device().L2_CACHE_SIZE else 1


def _graphed(impl: str, fns: list, torch):
    """(replay, close) for `fns` run in order inside one graph: proto.graph for ours
    (the walk executor on the simulator), torch.cuda.CUDAGraph for PyTorch."""
    def body(**_):
        for fn in fns:
            fn()

    if impl == "ours":  # no warm-up run: the eager timing just ran fn, first-call work included
        graphed = graph.capture(body, {}, binding="alias", warmup=0)
        return graphed.replay, graphed.close
    g, _ = common.torch_cuda_graph(body)
    return g.replay, g.reset


def run(size: str = "toy") -> None:
    reps = REPS[size]
    torch = _torch()
    copy_GBps = timing.copy_bandwidth_GBps(SIZES[size]["copy_bytes"], **reps)
    _release_device_memory()
    peak, spec = fp32_fma_peak_TFLOPs(reps), fp32_spec_TFLOPs()
    rows = []
    for case in common.progress(_cases(SIZES[size], torch), desc=NAME):
        impls = [("ours", case.ours)] + ([("torch", case.theirs)] if case.theirs else [])
        diff = ""
        if case.theirs:  # correct before fast: both compute the same thing
            case.ours()
            case.theirs()
            diff = float(np.max(np.abs(case.result() - case.their_result())))
        for impl, fn in impls:
            # Eager: one call from an idle GPU, so the host's launch path (Python, argument
            # checks, the driver) is part of it. Graphed: the op replayed inside a graph, as a
            # model step runs it, which leaves the kernel's own time plus the node gaps.
            if case.rotation:
                fns = [pair[0 if impl == "ours" else 1] for pair in case.rotation]
            else:
                fns = [fn] * _graph_repeats(case.bytes)
            repeats = len(fns)
            eager = timing.bench(fn, flush=True, **reps)
            replay, close = _graphed(impl, fns, torch)
            try:
                t = timing.bench(replay, flush=True, **reps)
            finally:
                close()
            seconds = t.median_ms * 1e-3 / repeats
            GBps, TFLOPs = case.bytes / seconds / 1e9, case.flops / seconds / 1e12
            if case.bound == "memory":
                fraction = GBps / copy_GBps
            else:
                fraction = TFLOPs / peak if peak else ""
            rows.append({"kernel": case.name, "impl": impl, "shape": case.shape,
                         "bound": case.bound, "median_us": round(seconds * 1e6, 3),
                         "p10_us": round(t.p10_ms * 1e3 / repeats, 3),
                         "p90_us": round(t.p90_ms * 1e3 / repeats, 3),
                         "eager_us": round(eager.median_us, 3), "graph_repeats": repeats,
                         "bytes": case.bytes, "flops": case.flops, "GBps": round(GBps, 2),
                         "TFLOPs": round(TFLOPs, 4),
                         "fraction_of_bound": fraction if fraction == "" else round(fraction, 4),
                         "max_abs_diff_vs_torch": diff if impl == "ours" else "",
                         "torch_tf32": common.torch_tf32() if impl == "torch" else "",
                         "copy_GBps": common.significant(copy_GBps),
                         "fp32_peak_TFLOPs": round(peak, 2) if peak else "",
                         "fp32_spec_TFLOPs": round(spec, 2) if spec else "",
                         "reps": t.reps})
    _release_device_memory()
    common.write_csv(NAME, rows)
    common.write_summary(NAME, summarize(rows, SIZES[size]))


def summarize(rows: list[dict], s: dict) -> dict:
    """Headline: the decode GEMMs' bytes (weights + activations) / time over the copy
    bandwidth, the worst of GPT-2's five shapes, the output head against PyTorch, and
    decode attention's live K/V bytes / time."""
    ours = {r["kernel"]: r for r in rows if r["impl"] == "ours"}
    us = {(r["kernel"], r["impl"]): float(r["median_us"]) for r in rows}
    eager = {(r["kernel"], r["impl"]): float(r["eager_us"]) for r in rows}
    copy_GBps = float(rows[0]["copy_GBps"])

    def fraction(kernel):
        return int(ours[kernel]["bytes"]) / (us[(kernel, "ours")] * 1e-6) / 1e9 / copy_GBps

    fractions = {k: fraction(k) for k in DECODE_GEMMS}
    torch_us = us.get((HEADLINE, "torch"))
    summary = {
        "decode_gemm_min_fraction_of_bandwidth": min(fractions.values()),
        "decode_gemm_fractions_of_bandwidth": fractions,
        "decode_gemm_step_us": {k: us[(k, "ours")] for k in DECODE_GEMMS},
        "torch_decode_gemm_step_us": {k: us.get((k, "torch")) for k in DECODE_GEMMS},
        "decode_gemm_fraction_of_bandwidth": fraction(HEADLINE),
        "decode_gemm_over_torch_time": us[(HEADLINE, "ours")] / torch_us if torch_us else None,
        "copy_bandwidth_GBps": copy_GBps,
        "decode_gemm_us": us[(HEADLINE, "ours")],
        "torch_decode_gemm_us": torch_us,
        "decode_gemm_eager_us": eager[(HEADLINE, "ours")],
        "torch_decode_gemm_eager_us": eager.get((HEADLINE, "torch")),
        "decode_gemm_nn_fraction_of_bandwidth": fraction("gemm_decode_nn"),
        # The MLP as the model runs it (fc and projection in one fused kernel and a sum that
        # writes the next layer norm too),
        # beside the two decode GEMMs it replaces (decode_gemm_step_us' fc + mlp_proj).
        "decode_mlp_fraction_of_bandwidth": fraction("mlp_decode"),
        "decode_mlp_us": us[("mlp_decode", "ours")],
        "torch_decode_mlp_us": us.get(("mlp_decode", "torch")),
        "kernels_measured": sorted({r["kernel"] for r in rows}),
    }
    if all(k in ours for k in GPTJ_GEMMS):
        gptj = {k: fraction(k) for k in GPTJ_GEMMS}
        summary.update(
            gptj_decode_gemm_min_fraction_of_bandwidth=min(gptj.values()),
            gptj_decode_gemm_fractions_of_bandwidth=gptj,
            gptj_decode_gemm_us={k: us[(k, "ours")] for k in GPTJ_GEMMS},
            cublas_fp16_gptj_decode_gemm_us={k: us.get((k, "torch")) for k in GPTJ_GEMMS},
            gptj_decode_gemm_over_cublas_fp16_time={
                k: us[(k, "ours")] / us[(k, "torch")] if (k, "torch") in us else None
                for k in GPTJ_GEMMS},
            # each product as a launch of its own, which the model no longer makes
            # (gemm_two_outputs, gemm_sum): what the paired launches save
            gptj_products_alone_fractions={k: fraction(k) for k in GPTJ_ALONE if k in ours},
            gptj_products_alone_us={k: us[(k, "ours")] for k in GPTJ_ALONE if k in ours})
    if ("gemm_lstm_gates_unsplit", "ours") in us:
        summary["lstm_gates_split_over_unsplit_time"] = (us[("gemm_lstm_gates", "ours")]
                                                         / us[("gemm_lstm_gates_unsplit", "ours")])
        torch_gates = us.get(("gemm_lstm_gates", "torch"))
        summary["lstm_gates_over_torch_time"] = (us[("gemm_lstm_gates", "ours")] / torch_gates
                                                 if torch_gates else None)
    convs = [f"{stage}_{kind}" for stage in s["convs"] for kind in conv_kinds(stage)]
    if all(c in ours for c in convs):
        first = ours[convs[0]]
        fractions = {c: ours[c]["fraction_of_bound"] for c in convs}
        measured = "" not in fractions.values()   # no peak on the simulator
        summary.update(
            fp32_fma_peak_TFLOPs=first["fp32_peak_TFLOPs"] or None,
            fp32_spec_TFLOPs=first["fp32_spec_TFLOPs"] or None,
            conv_fractions_of_fp32_peak=(
                {c: float(v) for c, v in fractions.items()} if measured else None),
            conv_min_fraction_of_fp32_peak=(
                min(float(v) for v in fractions.values()) if measured else None),
            conv_over_cudnn_time={c: us[(c, "ours")] / us[(c, "torch")]
                                  if (c, "torch") in us else None for c in convs})
    winograd = {c: f"{c}_winograd" for c in convs if f"{c}_winograd" in ours}
    if winograd:
        summary["winograd_over_direct_time"] = {c: us[(w, "ours")] / us[(c, "ours")]
                                                for c, w in winograd.items()}
    if "attention_decode" in ours:
        summary["attention_decode_fraction_of_bandwidth"] = fraction("attention_decode")
        summary["attention_decode_us"] = us[("attention_decode", "ours")]
        summary["torch_attention_decode_us"] = us.get(("attention_decode", "torch"))
    if "self_attention_decode" in ours:   # qkv and attention as the model runs them
        summary["decode_self_attention_fraction_of_bandwidth"] = fraction(
            "self_attention_decode")
        summary["decode_self_attention_us"] = us[("self_attention_decode", "ours")]
        summary["torch_decode_self_attention_us"] = us.get(("self_attention_decode", "torch"))
    return summary


def plot():
    """Two panels, so each stays readable: the memory-bound kernels as fractions of the copy
    bandwidth, the compute-bound ones as fractions of the FP32 peak (a Winograd convolution
    counted by the direct convolution's multiply-adds, beside the direct kernel and cuDNN)."""
    rows = common.read_csv(NAME)
    frac = {(r["kernel"], r["impl"]): float(r["fraction_of_bound"]) for r in rows
            if r["fraction_of_bound"] != ""}
    bound = {r["kernel"]: r["bound"] for r in rows}
    kernels = [k for k in dict.fromkeys(r["kernel"] for r in rows) if not k.endswith("_winograd")]
    panels = [(ks, label) for ks, label in (
        ([k for k in kernels if bound[k] == "memory"],
         f"fraction of copy bandwidth ({float(rows[0]['copy_GBps']):.3g} GB/s)"),
        ([k for k in kernels if bound[k] == "compute"], "fraction of FP32 peak")) if ks]
    series = [("ours (Numba)", "C0", lambda k: (k, "ours")),
              ("ours, Winograd", "C2", lambda k: (k + "_winograd", "ours")),
              ("PyTorch (cuBLAS, cuDNN)", "C1", lambda k: (k, "torch"))]
    widest = max(len(ks) for ks, _ in panels)
    fig, axes = common.new_figure(rows, len(panels), 1, squeeze=False,
                                  figsize=(max(6.0, 0.55 * widest + 2), 4.2 * len(panels)))
    for ax, (ks, label) in zip(axes[:, 0], panels):
        present = [s for s in series if any(s[2](k) in frac for k in ks)]
        if not present:   # the simulator measures no bandwidth or peak to divide by
            ax.text(0.5, 0.5, "no fractions measured", ha="center", transform=ax.transAxes)
        width = 0.8 / max(1, len(present))
        for j, (name, color, key) in enumerate(present):
            shift = (j - (len(present) - 1) / 2) * width
            have = [(i, k) for i, k in enumerate(ks) if key(k) in frac]
            bars = ax.bar([i + shift for i, _ in have], [frac[key(k)] for _, k in have], width,
                          color=color, label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=5)
        ax.set_xticks(range(len(ks)))
        ax.set_xticklabels(ks, rotation=60, ha="right", fontsize=7)
        ax.set_xlim(-0.6, widest - 0.4)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label, fontsize=8)
        if present:
            ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, 0].set_title("Kernel speed against the measured bound (higher is faster)", fontsize=9)
    return common.save_figure(fig, NAME)
