"""Tile choices measured on one kind of GPU for the tiled GEMM's unbatched products: which
tile shape, staging and K split beat the library's default there, by shape.

    choice(trans_a, trans_b, m, n, k) -> (Tiles, stages, whole) or None
    table(device)                     -> the entries of kernels/tuned/<device>.json

Why: no one rule picks the fastest tile over shapes and GPUs (on the H100 the 3xTF32
tensor tile ran a Wav2Vec2 layer's weight gradients 26% faster than the SIMT default and
its attention projections 18% slower), so, as vLLM does for its fused kernels, the choices
are measured per device and shipped as data: `python3 -m dev.bench.bench_train_gemm 65 120
199 --mma --write` times every tile on the products of a Wav2Vec2 layer and writes the
winners that beat the default by more than 3% (each having passed its float64 check).

An entry applies to a product of the same layout whose M, N and K are each within a factor
of 2 of its own (the nearest such entry, by the summed log distance); other products, batched
ones and a device without a file take the default (`gemm.tiled_launch_plan`). The file's
name is the device's results folder (`proto.device.backend.device_name`: h100, h200).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib

from kernels._tile import Tiles

DIR = pathlib.Path(__file__).parent / "tuned"
NEAR = 1.0   # log2 of the widest ratio of a product's dimension to an entry's


@functools.cache
def table(device: str) -> tuple:
    """((trans_a, trans_b), (m, n, k), Tiles, stages, whole) for each entry of the device's
    file; () where it has none."""
    path = DIR / f"{device}.json"
    if not path.exists():
        return ()
    return tuple(_entry(e, path) for e in json.loads(path.read_text())["entries"])


def stamp(device: str) -> str:
    """Which table a measurement ran with, for its provenance: the file's name and the first
    12 hex digits of its SHA-256, or 'none'."""
    path = DIR / f"{device}.json"
    if not path.exists():
        return "none"
    return f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def _entry(e: dict, path: pathlib.Path) -> tuple:
    try:
        tile = Tiles(*(int(x) for x in e["tile"][:5]), bool(e["tile"][5]))
        stages = int(e["stages"])
        if stages == 1 or stages < 0:
            raise ValueError(f"stages {stages}")
        return ((bool(e["trans_a"]), bool(e["trans_b"])),
                (int(e["m"]), int(e["n"]), int(e["k"])), tile, stages, bool(e["whole"]))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed entry {e!r} ({exc})") from None


def choice(trans_a: bool, trans_b: bool, m: int, n: int, k: int, entries: tuple):
    """(tile, stages, whole) of the nearest entry of `entries` for this product, or None."""
    best, best_d = None, math.inf
    for layout, dims, tile, stages, whole in entries:
        if layout != (bool(trans_a), bool(trans_b)):
            continue
        d = [abs(math.log2(x / y)) for x, y in zip((m, n, k), dims)]
        if max(d) <= NEAR and sum(d) < best_d:
            best, best_d = (tile, stages, whole), sum(d)
    return best
