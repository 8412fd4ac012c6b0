"""A/B on the H200, one process: decode attention computing from shared memory as a small
matrix product (`attention.SMALL_TILE`: a split's K and V copied there whole before the
early-launch wait, then scores, softmax and P.V by the block) against today's preloading
kernel (`attention.SMALL_PRELOAD`: the same copies, then a warp per batch of positions with
its lanes along the head dim), in GPT-2 small's graphed step and WHILE graph
(kernels._ab_step: the step at positions 100, 512 and 1000, a whole generation per token,
rounds interleaved, the tokens of each compared).

Why it may pay: ncu at position 512 found the lanes-along-the-head-dim kernel issue-bound,
not memory-bound (6.7 million instructions a launch, 53% of issue slots, DRAM 27%): every
warp spends a 5-shuffle butterfly and an online-softmax update on every position. The tile
kernel does a position's score in 4 lanes with 2 shuffles, one exponential a position and
P.V from shared memory. The WHILE graph's row-table kernel is not changed. AB_TOY=1 checks
the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_attention_tile 2>&1 | tee $OUT/ab_attention_tile.txt
"""
import contextlib
import sys

from kernels import _ab_step, attention


@contextlib.contextmanager
def tile(on: bool):
    was, attention.TILE[0] = attention.TILE[0], on
    try:
        yield
    finally:
        attention.TILE[0] = was


def main() -> int:
    if not _ab_step.TOY:
        for name, v in (("preload", attention.SMALL_PRELOAD), ("tile", attention.SMALL_TILE)):
            k = v.kernel
            print(f"{name} kernel: {k.get_regs_per_thread()} registers, "
                  f"{k.get_local_mem_per_thread()} bytes local, "
                  f"{k.get_shared_mem_per_block()} bytes shared a block", flush=True)
    return _ab_step.run({"preload": lambda: tile(False), "tile": lambda: tile(True)})


if __name__ == "__main__":
    sys.exit(main())
