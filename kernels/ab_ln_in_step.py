"""A/B on the H200, one process: GPT-2's ln_1 and ln_f normalized inside the GEMM that reads
the residual (gemm's ln_in, as the model runs: every block of qkv and of the head normalizes
the 5 rows after its early-launch wait) against a layer norm launch into scratch before a
plain GEMM (what gemm does where its plan splits K), in GPT-2 small's graphed step
(kernels._ab_step: positions 100, 512 and 1000, rounds interleaved, each one's planned arena,
then a beam search under each, whose tokens must be equal). kernel_speed times qkv with ln_in
at 1.39x qkv alone; this says what the fusion is worth in the step. AB_TOY=1 checks the
script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_ln_in_step 2>&1 | tee $OUT/ab_ln_in_step.txt
"""
import contextlib
import sys

from kernels import _ab_step, gemm
from proto import backend


@contextlib.contextmanager
def ln_in_launched(on: bool):
    """While on, gemm.gemm(..., ln_in=(gamma, beta, eps)) takes gemm's own unfused path
    (`gemm._normalized`: a layernorm launch into a recorded temporary), then the plain GEMM.
    The model's ln_in GEMMs read 2-D rows."""
    fused = gemm.gemm

    def launched(a, b, out, *, ln_in=None, stream=0, **kwargs):
        if ln_in is not None:
            y = gemm._normalized(backend.reshaped(a, (1, *a.shape)), *ln_in, stream)
            a = backend.reshaped(y, a.shape)
        return fused(a, b, out, stream=stream, **kwargs)

    if on:
        gemm.gemm = launched
    try:
        yield
    finally:
        gemm.gemm = fused


def main() -> int:
    return _ab_step.run({"ln_in": lambda: ln_in_launched(False),
                         "launch": lambda: ln_in_launched(True)})


if __name__ == "__main__":
    sys.exit(main())
