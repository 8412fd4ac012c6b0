"""A/B on the H200, one process: the next layer norm (ln_1 of the next layer, ln_f after the
last) computed by the MLP's sum launch, in each row's last block (`kernels.mlp`'s ln_out:
`sum_ln_kernel`), and the first ln_1 by the embedding (`embed`'s ln_out, as at 572e02c),
against the plain sum and the embedding each followed by a layernorm launch (the step as it
was at 863f0b2: 99 nodes against 86), in GPT-2 small's graphed step and its WHILE graph
(dev.ab._ab_step: the step at positions 100, 512 and 1000 and a whole generation per token,
rounds interleaved, the tokens of each compared). Measured at d7842d3, when the harness
timed position 203 alone: 515.8 us against 528.7 (ab_mlp_ln_step_d7842d3.txt); what it
gains at the other positions is this script's next run. Why it may pay: a layernorm launch
cost 4.6 us a layer in the step (ln_2's A/B, results/h200/profiles/ab_ln_out_step_863f0b2.txt,
at 203 too), while the last
block's tail is a threadfence, an atomic and one row read back from L2. Why it may not: the
tail runs after every other block of its row, and every last-block fusion tried before lost
(dev/notes/decode.md). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_mlp_ln_step 2>&1 | tee $OUT/ab_mlp_ln_step.txt
"""
import contextlib
import sys

from dev.ab import _ab_step
from kernels import embedding, layernorm, mlp


@contextlib.contextmanager
def ln_launched(on: bool):
    """While on, `mlp.mlp` (the model calls it through the module) runs the MLP without its
    ln_out and then a layernorm launch on the updated rows, and the embedding says it cannot
    normalize, so the model puts a layernorm launch after it (as gemm's ln_in did)."""
    fused, embeds = mlp.mlp, embedding.fuses_layernorm

    def launched(x, w1, b1, w2, b2, out, *, ln_out=None, stream=0):
        fused(x, w1, b1, w2, b2, out, stream=stream)
        if ln_out is not None:
            gamma, beta, eps, y = ln_out
            layernorm.layernorm(out, gamma, beta, y, eps=float(eps), stream=stream)

    if on:
        mlp.mlp, embedding.fuses_layernorm = launched, lambda width: False
    try:
        yield
    finally:
        mlp.mlp, embedding.fuses_layernorm = fused, embeds


def main() -> int:
    return _ab_step.run({"in_sum": lambda: ln_launched(False),
                         "launch": lambda: ln_launched(True)})


if __name__ == "__main__":
    sys.exit(main())
