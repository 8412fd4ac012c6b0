"""A/B on the H200, one process: qkv's projection as K-split partial sums that the attention
tile adds (with the bias) as it loads q, k and v (`kernels.gemm.partials`,
`attention.takes_partials`), against the whole-K projection that writes qkv itself
(`gemm.NN_COLS`: 16-column tiles, 144 blocks, no reduction launch), in GPT-2 small's graphed
step and WHILE graph (dev.ab._ab_step: the step at positions 100, 512 and 1000, a whole
generation per token, rounds interleaved, the tokens of each compared). The first run
(d9543fc) also took 12 splits of 64 rows (432 blocks): 500.8 us at 512 against the plan's 6
of 128 rows (216 blocks), 495.1, and 0.5567 against 0.5491 ms a WHILE token. The tile then
loaded all 16 partials a value could have (the index clamped to the last); now it loads the
P that exist, of at most 8: `clamped16` rebuilds the tile the first way.

Why: the whole-K kernel took 7.9-8.4 us a launch to read 7 MB (0.20 of copy bandwidth,
kernel_speed), and a split kernel about 5 (results/h200/profiles/stream_df1cd61.txt), but
a split needs its partials summed: a reduction launch lost that gain before; here the
tile's blocks sum them as they load what they load anyway, one memory round trip.
AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_qkv_partials 2>&1 | tee $OUT/ab_qkv_partials.txt
"""
# A record: this A/B's winner became the only path, and the module-level switch it flipped is
# gone (attention(..., tile=False, preload=False) keeps the kernels it replaced, for tests).
# To run it again, check out the commit it ran at (its results file names it).
import contextlib
import sys

import numpy as np

from dev.ab import _ab_step
from kernels import attention, gemm
from dev.ab._ab_step import describe, patched
from proto.device.backend import cuda

_u = np.uint32


@cuda.jit(device=True, inline="always")
def _projected_clamped16(qkv, bias, row, col):
    """attention._projected as d9543fc had it: 16 loads a value, past the last partial the
    last again (never added)."""
    vals = cuda.local.array(16, np.float32)
    n = qkv.shape[0]
    for s in range(16):
        vals[s] = qkv[_u(min(s, n - 1)), row, col]
    v = np.float32(0.0)
    for s in range(16):
        if s < n:
            v += vals[s]
    if bias.shape[0] == qkv.shape[2]:
        v += bias[col]
    return v


@contextlib.contextmanager
def _qkv(sums: bool, target: int):
    with patched(attention, SUM_PARTIALS=[sums]), patched(gemm, PARTIALS_TARGET=target):
        yield


@contextlib.contextmanager
def _clamped(tiles, target: int):
    with _qkv(True, target), patched(attention, SMALL_TILE=tiles[0], SMALL_TILE_ROWS=tiles[1],
                                     MAX_PARTS=16):
        yield


def main() -> int:
    base = gemm.PARTIALS_TARGET
    variants = {"whole_qkv": lambda: _qkv(False, base),
                "partials": lambda: _qkv(True, base)}
    C = _ab_step.cfg.n_embd
    print(f"partials: {gemm.partial_splits(3 * C, C)} splits of K = {C}", flush=True)
    if not _ab_step.TOY:
        try:
            with patched(attention, _projected=_projected_clamped16):
                old = [attention.make_attention_tile(*v.config[1:], use_rows=v.use_rows)
                       for v in (attention.SMALL_TILE, attention.SMALL_TILE_ROWS)]
            describe("tile clamped16", old[0].kernel)
            describe("tile clamped16 rows", old[1].kernel)
            variants["clamped16"] = lambda: _clamped(old, base)
        except Exception as exc:   # noqa: BLE001 (a compile failure drops the variant)
            print(f"clamped16 not run: {type(exc).__name__}: {exc}", flush=True)
        describe("tile", attention.SMALL_TILE.kernel)
        describe("tile rows", attention.SMALL_TILE_ROWS.kernel)
        describe("split gemm (NN)", gemm.NN.kernel)
        describe("whole-K gemm (NN_COLS)", gemm.NN_COLS.kernel)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
