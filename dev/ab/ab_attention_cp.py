"""A/B on the H200, one process: attention with a split's K and V copied into shared memory by
cp.async before the early-launch wait (`attention.SMALL_PRELOAD`) against the plain kernel,
in GPT-2 small's graphed step (dev.ab._ab_step: positions 100, 512 and 1000, rounds
interleaved, then a beam search under each, whose tokens must be equal). AB_TOY=1 checks the
script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_attention_cp 2>&1 | tee $OUT/ab_attention_cp.txt
"""
# A record: this A/B's winner became the only path, and the module-level switch it flipped is
# gone (attention(..., tile=False, preload=False) keeps the kernels it replaced, for tests).
# To run it again, check out the commit it ran at (its results file names it).
import sys

from dev.ab import _ab_step
from kernels import attention


def main() -> int:
    if not _ab_step.TOY:
        _ab_step.describe("preload", attention.SMALL_PRELOAD.kernel)
    return _ab_step.run({"plain": lambda: _ab_step.patched(attention, PRELOAD=[False]),
                         "preload": lambda: _ab_step.patched(attention, PRELOAD=[True])})


if __name__ == "__main__":
    sys.exit(main())
