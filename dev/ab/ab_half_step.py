"""A/B on a GPU, one process: GPT-2 small's float16 step (issue 56's gpt2_fp16_* figures) with
what this commit ships against what it replaced, in the graphed step at three positions and
the WHILE graph's generation (dev.ab._ab_step, the model in float16):

  shipped            qkv's and fc's tensor-core products over the whole K (one launch each,
                     gemm.MMA_WHOLE_K) and attention's packed group kernel (a lane's 8 dims
                     one 16-byte load, attention.PACKED_CONFIG);
  split_k            those two products split over K as the plan did before (each a launch
                     and its reduction's);
  strided_attention  attention's strided float16 kernels (2-byte loads, the plain kernel's
                     whole-warp score sums; the row table's 16-lane groups).

Each decides one choice of the shipped step: a variant faster than shipped says to switch
it back. Tokens may differ between variants that sum in another order (float16's roundings
of near ties); the script reports them. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_half_step 2>&1 | tee $OUT/ab_half_step.txt
"""
import sys

import numpy as np

from dev.ab import _ab_step
from dev.ab._ab_step import patched
from kernels import attention, gemm

HALF = np.dtype(np.float16)


def main() -> int:
    hd = _ab_step.cfg.n_embd // _ab_step.cfg.n_head
    strided = {rows: attention.kernel_for(hd, rows, HALF, aligned=False) for rows in (False, True)}
    print("attention variants:", {r: attention.kernel_for(hd, r, HALF, aligned=True).config
                                  for r in (False, True)}, "against",
          {r: v.config for r, v in strided.items()}, flush=True)
    return _ab_step.run({
        "shipped": lambda: patched(gemm),
        "split_k": lambda: patched(gemm, MMA_WHOLE_K=0),
        "strided_attention": lambda: patched(attention, _PACKED=strided)}, dtype=HALF)


if __name__ == "__main__":
    sys.exit(main())
