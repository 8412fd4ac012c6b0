"""A/B on the H200, one process: beam top-k's merge of its blocks' candidates in the ranking
launch's last block (`sampling.beam_topk_kernel`, kernels._lastblock: a threadfence and an
atomic a block, then one block merges 125 x 5 candidates after every other has arrived)
against a launch of its own (`MERGE_IN_LAST_BLOCK` off: `beam_topk_spans_kernel`, then
`topk_merge_kernel`, one block), in GPT-2 small's graphed step and WHILE graph
(kernels._ab_step; only the WHILE graph runs beam top-k, so the step's positions should
not move). Why: twice the same session (2026-12-04) moving a small launch's work behind one
thread or one block of another launch lost, the beam choice in this kernel's last block by
3.7 us a token and the whole advance in one block by 2.4; beam top-k is 14.8 us a token,
the largest of the search's kernels. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_beam_merge 2>&1 | tee $OUT/ab_beam_merge.txt
"""
import sys

from kernels import _ab_step, sampling
from kernels._ab_step import describe, patched


def main() -> int:
    variants = {"merge_in_last_block": lambda: patched(sampling, MERGE_IN_LAST_BLOCK=[True]),
                "merge_launch": lambda: patched(sampling, MERGE_IN_LAST_BLOCK=[False])}
    if not _ab_step.TOY:
        describe("beam_topk", sampling.beam_topk_kernel)
        describe("beam_topk_spans", sampling.beam_topk_spans_kernel)
        describe("topk_merge", sampling.topk_merge_kernel)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
