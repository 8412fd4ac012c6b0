"""A/B on the H200, one process: the WHILE graph's row-table tile (`attention.SMALL_TILE_ROWS`),
which stages its split's rows of the table in shared memory before its cp.async copies, at
6 blocks an SM (40 registers, no spill) against the same kernel bounded to 4 an SM, as it
ran when it read each copy's row from the table in global memory (60 registers, spilling
at 5). In GPT-2 small's graphed step and WHILE graph (dev.ab._ab_step; only the WHILE graph
and its beam search read through the row table, so the step's positions should not move).

Why: at ea6d5f4 the row-table tile took 153 us a token against the plain tile's 124, and a
WHILE token was 1.159x a step (goal 1.15). At 59d9b25 this script (then
dev/ab/ab_while_search.py) also timed the beam choice made by beam top-k's last block (3
launches a token) against the choice as a launch of its own: the launch won, 0.5479 against
0.5516 ms a token, and the other was removed (results/h200/profiles/
ab_while_search_59d9b25.txt). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_attention_rows 2>&1 | tee $OUT/ab_attention_rows.txt
"""
import sys

from dev.ab import _ab_step
from kernels import attention
from dev.ab._ab_step import describe, patched


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
