"""A/B on the H200, one process: the WHILE graph's attention tile (`attention.SMALL_TILE_ROWS`,
the row-table twin) with the split's rows of the table staged in shared memory before its
cp.async copies, at 6 blocks an SM (40 registers, no spill, local ptxas) against the same
kernel bounded to 4 an SM, as main's twin was (which read each copy's row from the table in
global memory, 60 registers: at 5 an SM it spilled). In GPT-2 small's graphed step and WHILE
graph (kernels._ab_step; only the WHILE graph and the beam search read through the table, so
the step's positions should not move). Why: the WHILE graph's twin took 153 us a token
against the plain tile's 124 at ea6d5f4 (end_to_end_kernels.csv), and a WHILE token is
1.159x a step (goal 1.15). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_attention_rows 2>&1 | tee $OUT/ab_attention_rows.txt
"""
import sys

from kernels import _ab_step, attention
from kernels._ab_step import describe, patched


def main() -> int:
    variants = {"rows_6_an_sm": lambda: patched(attention)}
    if not _ab_step.TOY:
        four = attention.make_attention_tile(64, 8, 64, 4, use_rows=True)
        describe("rows, 6 an SM", attention.SMALL_TILE_ROWS.kernel)
        describe("rows, 4 an SM", four.kernel)
        variants["rows_4_an_sm"] = lambda: patched(attention, SMALL_TILE_ROWS=four)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
