"""A/B on the H200, one process: the decode GEMMs compiled for the rows they multiply
(`gemm.rows_variant`: GPT-2's beam of 5 runs 5-row kernels for qkv's partials, the attention
projection and the head) against the 8-row kernels they were (rows 5..7 repeating row 4,
multiplied and never stored: 3/8 of the multiply-adds and of the shared-memory loads of x).
In GPT-2 small's graphed step and WHILE graph (dev.ab._ab_step).

Why: the head (5 x 768 x 50257) is 51 us of the step against 36 us of bytes, and by
instruction count about half of that is issue and shared-memory traffic, which 5 rows
instead of 8 cut by a third (dev/notes/decode.md). The per-layer GEMMs are latency-bound
and should move less. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_decode_rows 2>&1 | tee $OUT/ab_decode_rows.txt
"""
import sys

from dev.ab import _ab_step
from kernels import gemm
from dev.ab._ab_step import describe, patched


def main() -> int:
    if not _ab_step.TOY:
        describe("head, 5 rows", gemm.rows_variant(gemm.NT, 5).kernel)
        describe("head, 8 rows", gemm.NT.kernel)
    return _ab_step.run({
        "rows_exact": lambda: patched(gemm),
        "rows_8": lambda: patched(gemm, rows_variant=lambda dk, m_rows: dk)})


if __name__ == "__main__":
    sys.exit(main())
