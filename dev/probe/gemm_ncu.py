"""What bounds the tiled GEMM's tiles: one launch of each candidate on one product of a
Wav2Vec2 layer at 120 frames (fc1's forward, 960 x 3072 x 768, the shape where the tensor
tiles won least), for Nsight Compute to read the counters of.

    ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis_Tables -k regex:gemm_tiled python3 -m dev.probe.gemm_ncu

Each tile is launched twice, its kernel compiled and run once before the one ncu reads
(`--launch-skip` is not needed: ncu reports every launch, the second of each is the one to
read). The SIMT default (64 x 64), the tensor tile split as read (128 x 128, cp.async, 3
stages) and split once in fragment order (128 x 128 through registers), whole K each.
GPU only.
"""
from __future__ import annotations

import sys

import numpy as np

from kernels import gemm as G
from kernels._tile import Tiles
from proto.device import backend
from proto.device.backend import cuda

M, N, K = 960, 3072, 768
TILES = ((G.TILE, 0), (Tiles(128, 128, 8, 8, 8, True), 3), (Tiles(128, 128, 8, 8, 8, True), 0))


def main() -> None:
    rng = np.random.default_rng(0)
    a = cuda.to_device(rng.standard_normal((1, M, K)).astype(np.float32))
    b = cuda.to_device(rng.standard_normal((1, N, K)).astype(np.float32))
    out = cuda.device_array((1, M, N), np.float32)
    for tile, stages in TILES:
        for _ in range(2):
            G.tiled(a, b, out, b.reshape(b.size), 0, 0, 0, 0, 1, 0, target_blocks=1,
                    tile=tile, stages=stages)
        cuda.synchronize()
        print(f"launched {tuple(tile)} stages {stages} twice", flush=True)


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("gemm_ncu launches on a GPU: run it where CUDA is")
    main()
