"""A/B on the H200, one process: qkv's projection as K-split partial sums that the attention
tile adds (with the bias) as it loads q, k and v (`kernels.gemm.partials`,
`attention.takes_partials`), against the whole-K projection that writes qkv itself
(`gemm.NN_COLS`: 16-column tiles, 144 blocks, no reduction launch), in GPT-2 small's graphed
step and WHILE graph (kernels._ab_step: the step at positions 100, 512 and 1000, a whole
generation per token, rounds interleaved, the tokens of each compared). Two split counts:
the plan's 6 of 128 rows (216 blocks) and 12 of 64 (432).

Why: the whole-K kernel took 7.9-8.4 us a launch to read 7 MB (0.20 of copy bandwidth,
kernel_speed), and a split kernel about 5 (results/h200/profiles/stream_df1cd61.txt), but
a split needs its partials summed: a reduction launch lost that gain before; here the
tile's blocks sum them as they load what they load anyway, one memory round trip.
AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_qkv_partials 2>&1 | tee $OUT/ab_qkv_partials.txt
"""
import contextlib
import sys

from kernels import _ab_step, attention, gemm
from kernels._ab_step import describe, patched


@contextlib.contextmanager
def _qkv(sums: bool, target: int):
    with patched(attention, SUM_PARTIALS=[sums]), patched(gemm, PARTIALS_TARGET=target):
        yield


def main() -> int:
    base = gemm.PARTIALS_TARGET
    variants = {"whole_qkv": lambda: _qkv(False, base),
                "partials": lambda: _qkv(True, base),
                "partials_x2": lambda: _qkv(True, 2 * base)}
    C = _ab_step.cfg.n_embd
    for name, target in (("partials", base), ("partials_x2", 2 * base)):
        with patched(gemm, PARTIALS_TARGET=target):
            print(f"{name}: {gemm.partial_splits(3 * C, C)} splits of K = {C}", flush=True)
    if not _ab_step.TOY:
        describe("tile", attention.SMALL_TILE.kernel)
        describe("tile rows", attention.SMALL_TILE_ROWS.kernel)
        describe("split gemm (NN)", gemm.NN.kernel)
        describe("whole-K gemm (NN_COLS)", gemm.NN_COLS.kernel)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
