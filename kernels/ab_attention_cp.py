"""A/B on the H200, one process: attention with a split's K and V copied into shared memory by
cp.async before the early-launch wait (`attention.SMALL_PRELOAD`) against the plain kernel,
in GPT-2 small's graphed step (kernels._ab_step: positions 100, 512 and 1000, rounds
interleaved, then a beam search under each, whose tokens must be equal). AB_TOY=1 checks the
script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_attention_cp 2>&1 | tee $OUT/ab_attention_cp.txt
"""
import contextlib
import sys

from kernels import _ab_step, attention


@contextlib.contextmanager
def preload(on: bool):
    was, attention.PRELOAD[0] = attention.PRELOAD[0], on
    try:
        yield
    finally:
        attention.PRELOAD[0] = was


def main() -> int:
    if not _ab_step.TOY:
        k = attention.SMALL_PRELOAD.kernel
        print(f"preload kernel: {k.get_regs_per_thread()} registers, "
              f"{k.get_local_mem_per_thread()} bytes local, "
              f"{k.get_shared_mem_per_block()} bytes shared a block", flush=True)
    return _ab_step.run({"plain": lambda: preload(False), "preload": lambda: preload(True)})


if __name__ == "__main__":
    sys.exit(main())
