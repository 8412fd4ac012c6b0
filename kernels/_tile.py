"""The register tile that the tiled GEMM and the convolutions multiply with.

A block computes a bm x bn tile of a GEMM's output, stepping through the reduction bk rows at a
time: both operand tiles staged in shared memory k-major (a row of each every a_stride or
b_stride floats), each thread accumulating a tm x tn block of outputs in registers.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from proto.device import backend
from proto.device.backend import cuda

_u = np.uint32   # unsigned shared-memory indices: one base register plus immediate offsets
# The staged tiles' alignment: the register tile reads 16-byte groups (the simulator takes none).
TILE_ALIGN = None if backend.SIMULATOR else 16


class Tiles(NamedTuple):
    bm: int   # GEMM rows per block
    bn: int   # GEMM columns per block
    bk: int   # reduction step
    tm: int   # rows per thread
    tn: int   # columns per thread
    # True: the warps multiply on tensor cores, three TF32 products a float32 one
    # (kernels._tf32.mma_tile); tm x tn is then a lane's accumulators, 2 x 2 per mma tile
    mma: bool = False

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)


def register_tile(t: Tiles, a_stride: int, b_stride: int, rows_per_pass: int):
    """The TM x TN register tile of tile shape `t`: (multiply, row, col).

    A thread's TM rows are groups of VA adjacent ones, DX * VA apart (its TN columns: groups of
    VB, DY * VB apart), so each group is one 16-byte shared-memory load (ld.shared.v4; the
    tiles are 16-byte aligned and their strides multiples of 4). `multiply` adds one BK step
    of the staged tiles (k-major: a row of a_tile every a_stride floats, of b_tile every
    b_stride) into acc, `rows_per_pass` reduction rows written out a loop pass (more: fewer
    instructions of counting and addressing, more registers);
    `row(tx, i)` and `col(ty, j)` say which tile row and column acc[i, j] holds."""
    BM, BN, BK, TM, TN = t[:5]
    DX, DY = BM // TM, BN // TN
    VA, VB = (4 if TM % 4 == 0 else 1), (4 if TN % 4 == 0 else 1)

    @cuda.jit(device=True)
    def one_row(acc, a_reg, b_reg, a_tile, b_tile, a_row, b_row):
        for g in range(TM // VA):
            for v in range(VA):
                a_reg[g * VA + v] = a_tile[a_row + _u(g * DX * VA + v)]
        for g in range(TN // VB):
            for v in range(VB):
                b_reg[g * VB + v] = b_tile[b_row + _u(g * DY * VB + v)]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] += a_reg[i] * b_reg[j]

    # The compiler keeps the BK loop rolled: about 18 instructions of counting and addressing
    # a pass. Reduction rows written out, several a pass, cut that share (more registers).
    if rows_per_pass < 1 or rows_per_pass & (rows_per_pass - 1) or BK % rows_per_pass:
        raise ValueError(f"rows_per_pass: expected a power of two dividing {BK}, got {rows_per_pass}")
    rows, n = one_row, 1
    while n < rows_per_pass:   # n rows, then the n after them
        rows, n = _twice(rows, n * a_stride, n * b_stride), 2 * n

    @cuda.jit(device=True)
    def multiply(acc, a_reg, b_reg, a_tile, b_tile, a_start, b_start, tx, ty):
        a_base = a_start + tx * _u(VA)
        b_base = b_start + ty * _u(VB)
        for k0 in range(0, BK, rows_per_pass):
            rows(acc, a_reg, b_reg, a_tile, b_tile, a_base + _u(k0 * a_stride),
                 b_base + _u(k0 * b_stride))

    @cuda.jit(device=True)
    def row(tx, i):
        return tx * _u(VA) + _u((i // VA) * (DX * VA) + i % VA)

    @cuda.jit(device=True)
    def col(ty, j):
        return ty * _u(VB) + _u((j // VB) * (DY * VB) + j % VB)

    return multiply, row, col


def grid_place(DX: int):
    """register_tile's thread coordinates, place(tid) -> (tx, ty) = (tid % DX, tid // DX)
    for DX = bm // tm (kernels._tf32.mma_tile gives its own)."""
    @cuda.jit(device=True)
    def place(tid):
        return tid % _u(DX), tid // _u(DX)
    return place


def _twice(rows, a_gap: int, b_gap: int):
    """`rows` (some reduction rows of the register tile), then as many after them (a_gap and
    b_gap floats further on)."""
    @cuda.jit(device=True)
    def twice(acc, a_reg, b_reg, a_tile, b_tile, a_row, b_row):
        rows(acc, a_reg, b_reg, a_tile, b_tile, a_row, b_row)
        rows(acc, a_reg, b_reg, a_tile, b_tile, a_row + _u(a_gap), b_row + _u(b_gap))
    return twice


class Stage(NamedTuple):
    """Where a thread's staged elements of one operand tile lie: element i at (row + drs[i],
    k + dks[i]) of the tile, (row, k) = place(tid). `quads`: they come in fours that a
    tensor-core tile stores as one 16-byte group (kernels._tf32.lane_stage)."""
    place: object
    drs: tuple
    dks: tuple
    quads: bool = False

    @classmethod
    def of(cls, place, per: int, DR: int, DK: int) -> "Stage":
        """`stager`'s staging: a thread's `per` elements DR rows and DK rows of k apart."""
        return cls(place, tuple(i * DR for i in range(per)), tuple(i * DK for i in range(per)))


def stager(contiguous_k: bool, rows: int, bk: int, nt: int):
    """Where a thread's staged elements of one operand tile lie.

    The tile is bk x `rows` (k, row); element e = tid + i * nt. Consecutive threads walk the
    operand's contiguous axis so that global reads coalesce: along k when `contiguous_k`
    (row e // bk, k e % bk), else along the rows (row e % rows, k e // rows). As nt is a
    multiple of that axis's length (checked), a thread's elements keep one k and step DR rows,
    or keep one row and step DK rows of k: its first element's place is worked out once, and
    the others are a constant step away. Returns (place(tid) -> (row, k), DR, DK)."""
    if contiguous_k:
        if nt % bk:
            raise ValueError(f"{nt} threads stage a tile {bk} deep along k: need a multiple of {bk}")
        DR, DK = nt // bk, 0

        @cuda.jit(device=True)
        def place(tid):
            return tid // _u(bk), tid % _u(bk)
    else:
        if nt % rows:
            raise ValueError(f"{nt} threads stage a tile {rows} rows wide: need a multiple of {rows}")
        DR, DK = 0, nt // rows

        @cuda.jit(device=True)
        def place(tid):
            return tid % _u(rows), tid // _u(rows)
    return place, DR, DK
