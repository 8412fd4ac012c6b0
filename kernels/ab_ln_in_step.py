"""A/B on the H200, one process: GPT-2's ln_1 and ln_f normalized inside the GEMM that reads
the residual (gemm's ln_in, as the model runs: every block of qkv and of the head normalizes
the 5 rows after its early-launch wait) against a layer norm launch into scratch before a
plain GEMM (what gemm does where its plan splits K), in GPT-2 small's graphed step
(kernels._ab_step: positions 100, 512 and 1000, rounds interleaved, each one's planned arena,
then a beam search under each, whose tokens must be equal). kernel_speed times qkv with ln_in
at 1.39x qkv alone; this says what the fusion is worth in the step. A third
variant: ln_in with gamma and beta stored to shared memory after the wait and op(a)'s
staging loads (`gemm.LN_STORE_AFTER_WAIT`; the default stores them before the wait, where
each store holds its thread until its load, queued behind the block's weight loads, comes
back). AB_TOY=1 checks the script on the
simulator.

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


@contextlib.contextmanager
def ln_store_after_wait(on: bool):
    """While on, the decode kernels rebuilt with gamma and beta stored after the wait."""
    names = ("NN", "NN_COLS", "NN_WIDE_K", "NT")
    kept, was = {n: getattr(gemm, n) for n in names}, gemm.LN_STORE_AFTER_WAIT[0]
    gemm.LN_STORE_AFTER_WAIT[0] = on
    if on != was:
        gemm.NN, gemm.NN_COLS = gemm.make_decode_nn(*gemm.NN_SPLIT), \
            gemm.make_decode_nn(*gemm.NN_COLUMNS)
        gemm.NN_WIDE_K, gemm.NT = gemm.make_decode_nn(*gemm.NN_WIDE), \
            gemm.make_decode_nt(*gemm.NT_CONFIG)
    try:
        yield
    finally:
        gemm.LN_STORE_AFTER_WAIT[0] = was
        for n, dk in kept.items():
            setattr(gemm, n, dk)


def main() -> int:
    return _ab_step.run({"ln_in": lambda: ln_store_after_wait(False),
                         "launch": lambda: ln_in_launched(True),
                         "ln_in_after": lambda: ln_store_after_wait(True)})


if __name__ == "__main__":
    sys.exit(main())
