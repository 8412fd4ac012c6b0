"""Two launches of each kernel the speed issues are about, at their real sizes, for a profiler.

    ncu --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python -m dev.profile.profile_launches

VGG's conv3 layer at 224x224 input (N 16, 256 -> 256 channels, 56x56, 3x3, pad 1): forward
with bias and ReLU, backward-data, backward-weight with its split reduction; the prefill GEMM
(5120 x 768 against 768 x 3072); two decode GEMMs of GPT-2 small (5 rows against 768 x 2304
and 768 x 3072 with GELU); a beam-search step's top-k over GPT-2's logits (5 x 50257, k 5:
`sampling.beam_topk`, its softmax partials and `beam_topk_kernels`; `ncu -k regex:beam_topk`
picks it out); GPT-2 small's decode attention at position 512 (5 beams x 12 heads, a
1024-position cache), plain, then with the beams' row table (the WHILE graph's variant);
Winograd's forward at the conv3 shape (kernels.winograd: its transforms and GEMMs). The first launch of each compiles, so profile the second (`--launch-skip`)
or read both. Results: results/h200/profiles/.

    python -m dev.profile.profile_launches decode_gemm   # only the two decode GEMMs, twice
    python -m dev.profile.profile_launches decode_layer  # GPT-2 small's layer as the model
                                                     # runs it but attention: qkv, the
                                                     # fused MLP and its sum: twice
    python -m dev.profile.profile_launches decode_step   # GPT-2 small's whole step at 512, as
                                                     # the model runs it, the second pass
                                                     # alone (ncu --profile-from-start off)
    python -m dev.profile.profile_launches winograd      # only Winograd's three convolutions at
                                                     # conv4 (N 64, 512 -> 512, 28x28), twice

The families alone let a profiler take every launch of one (`--launch-skip` the first pass)
without a kernel-name filter: Winograd's convolutions are transforms around batched GEMMs.
"""
import sys

import numpy as np

from kernels import attention, conv, gemm, mlp, sampling, winograd
from proto.device.backend import cuda, synchronize


def _dev(rng, *shape, scale=1.0):
    return cuda.to_device((rng.standard_normal(shape) * scale).astype(np.float32))


def _conv_layer(rng, N: int, C: int, HW: int):
    """A 3x3 layer's operands, C -> C channels at HW x HW: x, dy, w, b, out, dx, dw, db."""
    x, dy = _dev(rng, N, C, HW, HW), _dev(rng, N, C, HW, HW)
    w, b = _dev(rng, C, C, 3, 3, scale=0.05), _dev(rng, C)
    out, dx = (cuda.device_array((N, C, HW, HW), np.float32) for _ in range(2))
    dw, db = cuda.device_array((C, C, 3, 3), np.float32), cuda.device_array(C, np.float32)
    return x, dy, w, b, out, dx, dw, db


def _decode_gemms(rng):
    """GPT-2 small's two whole-K decode GEMMs (5 rows against 768 x 2304, and 768 x 3072
    with GELU): their operands, and a function that launches both."""
    a5, w_qkv, w_fc = _dev(rng, 5, 768), _dev(rng, 768, 2304), _dev(rng, 768, 3072)
    qkv, fc = cuda.device_array((5, 2304), np.float32), cuda.device_array((5, 3072), np.float32)

    def launch_both():
        gemm.gemm(a5, w_qkv, qkv)
        gemm.gemm(a5, w_fc, fc, act="gelu")
    return launch_both


def main() -> None:
    rng = np.random.default_rng(0)
    x, dy, w, b, out, dx, dw, db = _conv_layer(rng, 16, 256, 56)
    work = cuda.device_array(max(1, conv.wgrad_workspace_size(x.shape, w.shape, pad=1)), np.float32)
    a, wt = _dev(rng, 5120, 768), _dev(rng, 768, 3072)
    prefill = cuda.device_array((5120, 3072), np.float32)
    decode_gemms = _decode_gemms(rng)
    logits, scores = _dev(rng, 5, 50257, scale=3.0), _dev(rng, 5, 1)
    top_v, top_i = cuda.device_array((1, 5), np.float32), cuda.device_array((1, 5), np.int32)
    B, H, hd, T = 5, 12, 64, 1024
    k_cache, v_cache = _dev(rng, B, H, T, hd), _dev(rng, B, H, T, hd)
    step_qkv, att = _dev(rng, B, 1, 3 * H * hd), cuda.device_array((B, 1, H * hd), np.float32)
    pos = cuda.to_device(np.array([512], np.int32))
    rows = cuda.to_device(np.repeat(np.arange(B, dtype=np.int32)[:, None], T, 1))
    wino = cuda.device_array(winograd.workspace_size(x.shape, w.shape, pad=1), np.float32)
    for _ in range(2):
        conv.conv2d(x, w, b, out, pad=1, relu=True)
        conv.conv2d_bwd_data(dy, w, dx, pad=1)
        conv.conv2d_bwd_weight(x, dy, dw, db, pad=1, workspace=work)
        gemm.gemm(a, wt, prefill)
        decode_gemms()
        sampling.beam_topk(logits, scores, 5, top_v, top_i)
        attention.attention(step_qkv, k_cache, v_cache, pos, att, n_head=H)
        attention.attention(step_qkv, k_cache, v_cache, pos, att, n_head=H, rows=rows)
        winograd.conv2d(x, w, b, out, pad=1, relu=True, workspace=wino)
    synchronize()


def decode_gemm() -> None:
    decode_gemms = _decode_gemms(np.random.default_rng(0))
    for _ in range(2):
        decode_gemms()
    synchronize()


def decode_layer() -> None:
    """GPT-2 small's qkv GEMM, then the model's MLP (kernels.mlp: the fused kernel and its
    sum, which writes the next qkv's layer-normalized rows), for a profiler.
    Residual-stream-like rows (mean 0, scale 3)."""
    rng = np.random.default_rng(0)
    x = _dev(rng, 5, 768, scale=3.0)
    w_qkv, b_qkv = _dev(rng, 768, 2304, scale=0.02), _dev(rng, 2304, scale=0.02)
    gamma = cuda.to_device((1 + 0.1 * rng.standard_normal(768)).astype(np.float32))
    beta = _dev(rng, 768, scale=0.1)
    w1, b1 = _dev(rng, 768, 3072, scale=0.02), _dev(rng, 3072, scale=0.02)
    w2, b2 = _dev(rng, 3072, 768, scale=0.02), _dev(rng, 768, scale=0.02)
    qkv, out = cuda.device_array((5, 2304), np.float32), _dev(rng, 5, 768)
    y = cuda.device_array((5, 768), np.float32)
    for _ in range(2):
        gemm.gemm(x, w_qkv, qkv, bias=b_qkv)
        mlp.mlp(x, w1, b1, w2, b2, out, ln_out=(gamma, beta, 1e-5, y))
    synchronize()


def decode_step() -> None:
    """GPT-2 small's whole decode step as the model runs it (beam 5, position 512, random
    weights), eagerly, twice: every kernel of the step (qkv's partials, the attention tile
    and its combine, the projection and its reduction with ln_2, the fused MLP and its sum
    with the next ln_1, the head), 86 launches a pass. The second pass runs between
    cudaProfilerStart and Stop: `ncu --profile-from-start off` profiles it alone."""
    from proto.models.gpt2 import GPT2, GPT2Config, KVCache, random_state_dict
    cfg = GPT2Config(12, 768, 12, 50257, 1024)
    model = GPT2(cfg, random_state_dict(cfg, seed=0), max_batch=5, max_tokens=1)
    cache = KVCache(cfg, batch=5, max_len=1024)
    tokens = cuda.to_device(np.array([[464], [2068], [7586], [21831], [18045]], np.int32))
    pos = cuda.to_device(np.array([512], np.int32))
    model.step(tokens, pos, cache)   # (compiles; outside the profiled range)
    synchronize()
    cuda.profile_start()
    model.step(tokens, pos, cache)
    synchronize()
    cuda.profile_stop()


def winograd_conv4() -> None:
    """kernel_speed's conv4 shape, where Winograd is furthest from cuDNN (1.9-3.5x)."""
    x, dy, w, b, out, dx, dw, db = _conv_layer(np.random.default_rng(0), 64, 512, 28)
    images = winograd.chunk_images(x.shape, w.shape, pad=1, floats=x.size)
    work = cuda.device_array(winograd.workspace_size(x.shape, w.shape, pad=1, images=images),
                             np.float32)
    for _ in range(2):
        winograd.conv2d(x, w, b, out, pad=1, relu=True, workspace=work)
        winograd.conv2d_bwd_data(dy, w, dx, pad=1, workspace=work)
        winograd.conv2d_bwd_weight(x, dy, dw, db, pad=1, workspace=work)
    synchronize()


FAMILIES = {"all": main, "decode_gemm": decode_gemm, "decode_layer": decode_layer,
            "decode_step": decode_step, "winograd": winograd_conv4}

if __name__ == "__main__":
    family = sys.argv[1] if len(sys.argv) > 1 else "all"
    if family not in FAMILIES:
        sys.exit(f"profile_launches: family must be one of {sorted(FAMILIES)}, got {family!r}")
    FAMILIES[family]()
