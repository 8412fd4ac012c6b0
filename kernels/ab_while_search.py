"""A/B on the H200, one process: the two changes to the WHILE graph's extra per token, each
against the library with that change undone, in GPT-2 small's graphed step and WHILE graph
(kernels._ab_step; only the WHILE graph and its beam search read through the row table and
run the beam step, so the step's positions should not move):

  rows_6_an_sm    the defaults: the row-table tile (`attention.SMALL_TILE_ROWS`) stages its
                  split's rows of the table in shared memory before its cp.async copies and
                  runs 6 blocks an SM (40 registers, no spill, local ptxas); the beam choice
                  is made by beam top-k's last block (`sampling.CHOOSE_IN_TOPK`: 3 launches
                  a token)
  rows_4_an_sm    the same tile bounded to 4 blocks an SM, as it ran when it read each
                  copy's row from the table in global memory (60 registers, spilling at 5)
  choice_launch   the beam choice as a one-thread launch of its own (4 launches a token)

Why: at ea6d5f4 the row-table tile took 153 us a token against the plain tile's 124, the
choice launch 4.0 us, and a WHILE token was 1.159x a step (goal 1.15). AB_TOY=1 checks the
script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_while_search 2>&1 | tee $OUT/ab_while_search.txt
"""
import sys

from kernels import _ab_step, attention, sampling
from kernels._ab_step import describe, patched


def main() -> int:
    variants = {"rows_6_an_sm": lambda: patched(attention),
                "choice_launch": lambda: patched(sampling, CHOOSE_IN_TOPK=[False])}
    if not _ab_step.TOY:
        four = attention.make_attention_tile(64, 8, 64, 4, use_rows=True)
        describe("rows, 6 an SM", attention.SMALL_TILE_ROWS.kernel)
        describe("rows, 4 an SM", four.kernel)
        describe("beam_topk", sampling.beam_topk_kernel)
        describe("beam_topk_choose", sampling.beam_topk_choose_kernel)
        variants["rows_4_an_sm"] = lambda: patched(attention, SMALL_TILE_ROWS=four)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
