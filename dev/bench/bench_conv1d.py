"""Wav2Vec2-base's convolutions (kernels.conv1d) and weight norm, timed beside cuDNN (TF32
off) when PyTorch is installed; the feature encoder's 512-channel layers and the positional
convolution also on the tensor-core tiles (kernels.conv.GPU_CONV_MMA_TILES,
GPU_WGRAD_MMA_TILES, kernels.conv1d.GPU_GROUPED_MMA_TILES), each checked against the SIMT
kernels' result.  python -m dev.bench.bench_conv1d [batch] [--write]

--write: with the GPU's table set aside (the library rows run the untuned choice), for
each of the encoder's layer geometries (channels, kernel, stride) and for its forward and
backward-data, the tensor tile whose summed time over the layers of that geometry beats
the untuned choice by more than MARGIN (its result within 1e-3 of the SIMT kernels' largest
output: a gross-error check; the GPU lane holds the tiles to their derived bound) becomes
kernels/tuned/<gpu>.json's "conv" section (kernels.tuning), replacing the one there."""
import numpy as np

from kernels import conv, tuning
from kernels.conv1d import (GPU_GROUPED_MMA_TILES, GPU_GROUPED_TILES, conv1d, conv1d_bwd_data,
                            conv1d_bwd_weight, conv1d_grouped, conv1d_grouped_bwd_data,
                            conv1d_grouped_bwd_weight, conv1d_grouped_flops, conv1d_out_size,
                            weight_norm, weight_norm_bwd)
from proto.device import backend
from proto.device.backend import cuda


MARGIN = 0.03   # --write: a tile replaces the default for a layer only if this much faster
GROSS = 1e-3    # --write: a tile whose deviation from SIMT passes this is not a candidate


def main(argv=None):
    """Time Wav2Vec2-base's convolutions (batch 8) and weight norm, next to PyTorch (cuDNN,
    TF32 off) when it is installed:  python -m dev.bench.bench_conv1d [batch]"""
    import sys

    from proto.device import timing
    argv = sys.argv[1:] if argv is None else argv
    write = "--write" in argv
    if write:   # the library rows are then the untuned default, whatever the table says
        conv.TUNED = ()
    numbers = [a for a in argv if not a.startswith("--")]
    B = int(numbers[0]) if numbers else 8
    totals: dict = {}   # (op, c, k, r, s, stride) -> {tile or None: summed ms over the layers}
    rng = np.random.default_rng(0)
    try:
        import torch
        torch.backends.cudnn.allow_tf32 = False
        F = torch.nn.functional
    except ImportError:
        torch = None
    print(f"Wav2Vec2-base convolutions, batch {B}, {backend.describe()}")
    print(f"{'layer':>28} | {'fwd':>14} {'bwd_data':>14} {'bwd_weight':>14}   TFLOPS (ms)"
          + ("   | cuDNN fwd, data, weight" if torch else ""))

    def row(name, flops, runs, torch_runs):
        cells, ms = [], []
        for run in runs:
            t = timing.bench(run, warmup=2, reps=10)
            ms.append(t.median_ms)
            cells.append(f"{flops / t.median_ms / 1e9:6.1f} ({t.median_ms:6.3f})")
        line = f"{name:>28} | " + " ".join(cells)
        if torch_runs:
            line += "   | " + " ".join(
                f"{flops / timing.bench(f, warmup=2, reps=10).median_ms / 1e9:6.1f}"
                for f in torch_runs)
        print(line, flush=True)
        return ms

    def run_and_copy(run, dst):
        run()
        return dst.copy_to_host()

    def arr(*shape):
        return cuda.to_device(rng.standard_normal(shape, dtype=np.float32))

    C, T = 1, 16000 * 4
    for K, k, s in ((512, 10, 5), (512, 3, 2), (512, 3, 2), (512, 3, 2), (512, 3, 2),
                    (512, 2, 2), (512, 2, 2)):
        T_out = conv1d_out_size(T, k, s)
        x, w, dy = arr(B, C, T), arr(K, C, k), arr(B, K, T_out)
        out, dx, dw = (cuda.device_array(a.shape, np.float32) for a in (dy, x, w))
        runs = [lambda: conv1d(x, w, None, out, stride=s),
                lambda: conv1d_bwd_data(dy, w, dx, stride=s),
                lambda: conv1d_bwd_weight(x, dy, dw, None, stride=s)]
        torch_runs = None
        if torch is not None:
            tx, tw, ty = (torch.as_tensor(a, device="cuda") for a in (x, w, dy))
            torch_runs = [lambda: F.conv1d(tx, tw, stride=s),
                          lambda: torch.nn.grad.conv1d_input(tx.shape, tw, ty, stride=s),
                          lambda: torch.nn.grad.conv1d_weight(tx, tw.shape, ty, stride=s)]
        ms = row(f"conv {C}->{K} k{k} s{s} T{T}", 2.0 * B * K * T_out * C * k, runs,
                 torch_runs)
        keys = [(op, C, K, 1, k, s) for op in tuning.CONV_OPS]
        for key, m in zip(keys, ms):
            totals.setdefault(key, {}).setdefault(None, 0.0)
            totals[key][None] += m
        if C > 1:   # the same on tensor cores (kernels._tf32)
            x4, w4 = x.reshape(B, C, 1, T), w.reshape(K, C, 1, k)
            out4, dy4, dx4 = (a.reshape(a.shape[0], a.shape[1], 1, a.shape[2]) for a in (out, dy, dx))
            dw4 = dw.reshape(K, C, 1, k)
            for t, tw in zip(conv.GPU_CONV_MMA_TILES, conv.GPU_WGRAD_MMA_TILES):
                want = [run_and_copy(r, d) for r, d in zip(runs, (out, dx, dw))]
                size = conv.wgrad_workspace_size(x4.shape, dw4.shape, stride=s, tiles=tw)
                ws = cuda.device_array(size, np.float32) if size else None
                mma = [lambda t=t: conv.conv2d(x4, w4, None, out4, stride=s, tiles=t),
                       lambda t=t: conv.conv2d_bwd_data(dy4, w4, dx4, stride=s, tiles=t),
                       lambda tw=tw, ws=ws: conv.conv2d_bwd_weight(
                           x4, dy4, dw4, None, stride=s, tiles=tw, workspace=ws)]
                # (against the SIMT kernels' results: sums of C*k, K*k and B*T_out products)
                errs = []
                for run, dst, want in zip(mma, (out, dx, dw), want):
                    err = np.max(np.abs(run_and_copy(run, dst) - want)) / np.max(np.abs(want))
                    errs.append(err)
                    print(f"{'':>28}   tensor cores {t.bm}x{t.bn} (weight {tw.bm}x{tw.bn}): "
                          f"max deviation from SIMT {err:.2e} of the largest output")
                ms = row(f"tensor cores {t.bm}x{t.bn}/{tw.bm}x{tw.bn}",
                         2.0 * B * K * T_out * C * k, mma, None)
                for key, m, err in zip(keys, ms, errs):   # (fwd, bwd_data: not the weight's)
                    at = totals[key].setdefault(t, 0.0)
                    totals[key][t] = at + m if err <= GROSS and at == at else float("nan")
        C, T = K, T_out

    C, G, k, pad = 768, 16, 128, 64
    v, g = arr(C, C // G, k), arr(1, 1, k)
    for T in (65, 199):
        x, w, b, dy = arr(B, C, T), arr(C, C // G, k), arr(C), arr(B, C, T)
        out, dx, dw, db = (cuda.device_array(a.shape, np.float32) for a in (dy, x, w, b))
        # the SIMT tile of the forward and backward-data (conv1d_grouped takes the tensor-core
        # one below): the 32-frame one where it pads a quarter fewer frames than the 64
        simt = GPU_GROUPED_TILES[1] if T <= 96 else GPU_GROUPED_TILES[0]
        runs = [lambda: conv1d_grouped(x, w, b, out, groups=G, pad=pad, tiles=simt),
                lambda: conv1d_grouped_bwd_data(dy, w, dx, groups=G, pad=pad, tiles=simt),
                lambda: conv1d_grouped_bwd_weight(x, dy, dw, db, groups=G, pad=pad)]
        torch_runs = None
        if torch is not None:
            tx, tw, tb = (torch.as_tensor(a, device="cuda") for a in (x, w, b))
            ty = torch.zeros((B, C, T + 1), device="cuda")   # torch's conv gives T + 1 frames
            torch_runs = [
                lambda: F.conv1d(tx, tw, tb, padding=pad, groups=G),
                lambda: torch.nn.grad.conv1d_input(tx.shape, tw, ty, padding=pad, groups=G),
                lambda: torch.nn.grad.conv1d_weight(tx, tw.shape, ty, padding=pad, groups=G)]
        row(f"positional T{T}", conv1d_grouped_flops(B, C, C, T, k, G), runs, torch_runs)
        want = [run_and_copy(r, d) for r, d in zip(runs[:2], (out, dx))]
        for t in GPU_GROUPED_MMA_TILES:   # forward and backward-data on tensor cores
            mma = [lambda t=t: conv1d_grouped(x, w, b, out, groups=G, pad=pad, tiles=t),
                   lambda t=t: conv1d_grouped_bwd_data(dy, w, dx, groups=G, pad=pad, tiles=t)]
            for run, dst, ref in zip(mma, (out, dx), want):
                err = np.max(np.abs(run_and_copy(run, dst) - ref)) / np.max(np.abs(ref))
                print(f"{'':>28}   tensor cores {t.bm}x{t.bn}: max deviation from SIMT "
                      f"{err:.2e} of the largest output")
            row(f"tensor cores {t.bm}x{t.bn}", conv1d_grouped_flops(B, C, C, T, k, G), mma, None)
    w, dv, dg = (cuda.device_array(a.shape, np.float32) for a in (v, v, g))
    for name, run in (("weight_norm", lambda: weight_norm(v, g, w)),
                      ("weight_norm_bwd", lambda: weight_norm_bwd(v, g, w, dv, dg))):
        print(f"{name:>28} | {timing.bench(run, warmup=2, reps=10).median_ms:.3f} ms")
    if write:
        write_conv(totals, argv)


def conv_entries(totals: dict) -> list[dict]:
    """For each layer geometry and operation, the tile whose summed time beats the default's
    (key None) by more than MARGIN (NaN: a tile that failed the gross-error check)."""
    entries = []
    for (op, c, k, r, s, stride), by_tile in totals.items():
        default = by_tile.get(None)
        tiles = {t: ms for t, ms in by_tile.items() if t is not None and ms == ms}
        if default is None or not tiles:
            continue
        best = min(tiles, key=tiles.get)
        if tiles[best] < (1 - MARGIN) * default:
            entries.append(dict(op=op, c=c, k=k, r=r, s=s, stride=stride, tile=list(best),
                                ms=round(tiles[best], 4), default_ms=round(default, 4)))
    return entries


def write_conv(totals: dict, argv: list) -> None:
    entries = conv_entries(totals)
    path = tuning.write_section(backend.device_name(), "conv", entries,
                                "python3 -m dev.bench.bench_conv1d " + " ".join(argv))
    print(f"wrote {len(entries)} conv entries to {path}")


if __name__ == "__main__":
    main()
