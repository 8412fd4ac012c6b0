"""Tile choices measured on one kind of GPU, shipped as data: which tile shape, staging and
K split beat the library's default for the tiled GEMM's unbatched products (and whether the
operands are first transposed so that the product reads both along K), and which tile for a
convolution layer's forward and backward-data.

    table(device)        -> Table(gemm, conv): the entries of kernels/tuned/<device>.json
    gemm_choice(trans_a, trans_b, m, n, k, entries) -> GemmChoice or None
    conv_choice(op, c, k, r, s, stride, entries)    -> Tiles or None
    write_section(device, name, entries, command)   (the benches' --write)
    stamp(device)        -> the file and its SHA-256, for a measurement's provenance

    python -m kernels.tuning [device ...]   prints the tables (every file's, by default)

Why: no one rule picks the fastest tile over shapes and GPUs (on the H100 the 3xTF32
tensor tile ran a Wav2Vec2 layer's weight gradients 26% faster than the SIMT default and
its attention projections 18% slower), so, as vLLM does for its fused kernels, the choices
are measured per device and shipped as data: `python3 -m dev.bench.bench_train_gemm 120 199
65 --mma --write` (section "gemm") and `python3 -m dev.bench.bench_conv1d --write`
("conv") time the candidates on Wav2Vec2's products and layers and write those that beat
the default by more than 3%, each having passed its check against float64 or the SIMT
kernels.

A GEMM entry applies to a product of the same layout whose M, N and K are each within a
factor of 2 of its own (the nearest such entry, by the summed log distance); a convolution
entry to a layer of the same operation, channels, kernel and stride. Other products,
batched ones, and a device without a file take the default. The file's name is the device's
results folder (`proto.device.backend.device_name`: h100, h200).
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import os
import pathlib
from typing import NamedTuple

from kernels._tile import Tiles

DIR = pathlib.Path(__file__).parent / "tuned"
NEAR = 1.0   # log2 of the widest ratio of a product's dimension to a GEMM entry's
CONV_OPS = ("fwd", "bwd_data")


class GemmChoice(NamedTuple):
    """How the tiled GEMM runs one product: the tile, its staging (0: through registers, n:
    cp.async into n buffers), K whole (no split-K reduction) or split as `gemm.tiled_plan`
    says, `via_nt`: op(a) and op(b) first copied K-contiguous (transposes into scratch),
    so the product runs as NT, the layout whose tensor tiles reach cuBLAS's float32 time,
    and `fold`: a split K's partials summed by the GEMM's own last block per tile instead of
    a reduction launch (an entry from before these fields existed has them False)."""
    tile: Tiles
    stages: int
    whole: bool
    via_nt: bool = False
    fold: bool = False


class Table(NamedTuple):
    gemm: tuple = ()   # ((trans_a, trans_b), (m, n, k), GemmChoice)
    conv: tuple = ()   # ((op, c, k, r, s, stride), Tiles)


def _path(device: str) -> pathlib.Path:
    return DIR / f"{device}.json"


@functools.cache
def table(device: str) -> Table:
    """The device's entries; an empty Table where it has no file."""
    path = _path(device)
    if not path.exists():
        return Table()
    body = json.loads(path.read_text())
    return Table(tuple(_gemm_entry(e, path) for e in body.get("gemm", {}).get("entries", [])),
                 tuple(_conv_entry(e, path) for e in body.get("conv", {}).get("entries", [])))


def _tile(e: dict) -> Tiles:
    return Tiles(*(int(x) for x in e["tile"][:5]), bool(e["tile"][5]))


def _gemm_entry(e: dict, path: pathlib.Path) -> tuple:
    try:
        stages = int(e["stages"])
        if stages == 1 or stages < 0:
            raise ValueError(f"stages {stages}")
        return ((bool(e["trans_a"]), bool(e["trans_b"])),
                (int(e["m"]), int(e["n"]), int(e["k"])),
                GemmChoice(_tile(e), stages, bool(e["whole"]), bool(e.get("via_nt", False)),
                           bool(e.get("fold", False))))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed gemm entry {e!r} ({exc})") from None


def _conv_entry(e: dict, path: pathlib.Path) -> tuple:
    try:
        if e["op"] not in CONV_OPS:
            raise ValueError(f"op {e['op']!r}, expected one of {CONV_OPS}")
        return ((e["op"], *(int(e[f]) for f in ("c", "k", "r", "s", "stride"))), _tile(e))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed conv entry {e!r} ({exc})") from None


@functools.cache   # (gemm.tiled asks at every eager launch: each shape is looked up once)
def gemm_choice(trans_a: bool, trans_b: bool, m: int, n: int, k: int, entries: tuple):
    """The GemmChoice of the nearest GEMM entry for this product, or None."""
    best, best_d = None, math.inf
    for layout, dims, choice in entries:
        if layout != (bool(trans_a), bool(trans_b)):
            continue
        d = [abs(math.log2(x / y)) for x, y in zip((m, n, k), dims)]
        if max(d) <= NEAR and sum(d) < best_d:
            best, best_d = choice, sum(d)
    return best


def conv_choice(op: str, c: int, k: int, r: int, s: int, stride: int, entries: tuple):
    """The tile of the convolution entry for this layer (forward geometry: c input and k
    output channels, an r x s kernel) and operation, or None."""
    key = (op, c, k, r, s, stride)
    return next((tile for at, tile in entries if at == key), None)


def write_section(device: str, name: str, entries: list[dict], command: str) -> pathlib.Path:
    """Replace section `name` of the device's file (keeping the others) with `entries`,
    stamped with the commit (PROTO_GIT_COMMIT), the date and the command that measured
    them."""
    path = _path(device)
    body = json.loads(path.read_text()) if path.exists() else {}
    body[name] = {"git_commit": os.environ.get("PROTO_GIT_COMMIT", "unknown"),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime(
                      "%Y-%m-%dT%H:%M:%SZ"),
                  "command": command, "entries": entries}
    DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps(body, indent=1) + "\n")
    table.cache_clear()
    return path


def stamp(device: str) -> str:
    """Which table a measurement ran with, for its provenance: the file's name and the first
    12 hex digits of its SHA-256, or 'none'."""
    path = _path(device)
    if not path.exists():
        return "none"
    return f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def describe(device: str) -> str:
    """The device's table as text: one line an entry."""
    t = table(device)
    lines = [f"{device}: {stamp(device)}, {len(t.gemm)} gemm and {len(t.conv)} conv entries"]
    for (ta, tb), (m, n, k), (tile, stages, whole, via_nt, fold) in t.gemm:
        lines.append(f"  gemm {'T' if ta else 'N'}{'T' if tb else 'N'} {m} x {n} x {k}: "
                     f"{tuple(tile)} stages {stages}, K {'whole' if whole else 'split'}"
                     + (", summed in the GEMM" if fold and not whole else "")
                     + (", via NT" if via_nt else ""))
    for (op, c, k, r, s, stride), tile in t.conv:
        lines.append(f"  conv {op} {c}->{k} {r}x{s} stride {stride}: {tuple(tile)}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys
    names = sys.argv[1:] or sorted(p.stem for p in DIR.glob("*.json"))
    print("\n".join(describe(d) for d in names) if names else f"no tables in {DIR}")
