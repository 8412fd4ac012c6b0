"""A/B on the H200, one process: decode attention computing from shared memory as a small
matrix product (`attention.SMALL_TILE`: a split's K and V copied there whole before the
early-launch wait, then scores, softmax and P.V by the block) against the preloading
kernel it replaced (`attention.SMALL_PRELOAD`: the same copies, then a warp per batch of
positions with its lanes along the head dim), and the tile with splits twice as long (8 of
128 positions, 70 KB of shared memory a block), in GPT-2 small's graphed step and WHILE
graph (dev.ab._ab_step: the step at positions 100, 512 and 1000, a whole generation per
token, rounds interleaved, the tokens of each compared).

Why the tile: ncu at position 512 found the lanes-along-the-head-dim kernel issue-bound,
not memory-bound (6.7 million instructions a launch, 53% of issue slots, DRAM 27%): every
warp spends a 5-shuffle butterfly and an online-softmax update on every position. Why
longer splits: the tile makes a position cheap in instructions, so a block may take more of
them (the old kernel's 8 x 128 lost to each warp's serial batches), with half the blocks
and half the partials for the combine to read; 3 blocks an SM instead of 6. AB_TOY=1
checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_attention_tile 2>&1 | tee $OUT/ab_attention_tile.txt
"""
# A record: this A/B's winner became the only path, and the module-level switch it flipped is
# gone (attention(..., tile=False, preload=False) keeps the kernels it replaced, for tests).
# To run it again, check out the commit it ran at (its results file names it).
import sys

from dev.ab import _ab_step
from kernels import attention
from dev.ab._ab_step import describe, patched


def main() -> int:
    variants = {"preload": lambda: patched(attention, TILE=[False]),
                "tile": lambda: patched(attention, TILE=[True])}
    if not _ab_step.TOY:
        describe("preload", attention.SMALL_PRELOAD.kernel)
        describe("tile", attention.SMALL_TILE.kernel)
        try:   # twice the positions a split: more shared memory than a static array may ask
            long, long_rows = (attention.make_attention_tile(128, 8, 64, 3, use_rows=r)
                               for r in (False, True))
            describe("tile 8x128", long.kernel)
            describe("tile 8x128 rows", long_rows.kernel)
            target = round(attention.TARGET_BLOCKS * 15 / 32)   # S = 8 of 128 at GPT-2 small
            variants["tile8x128"] = lambda: patched(
                attention, TILE=[True], SMALL_TILE=long, SMALL_TILE_ROWS=long_rows,
                TARGET_BLOCKS=target)
        except Exception as exc:   # noqa: BLE001 (a compile or load failure drops the variant)
            print(f"tile 8x128 not run: {type(exc).__name__}: {exc}", flush=True)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
