"""A/B on the H200, one process: how many splits decode attention cuts the cache into
(`attention.TARGET_BLOCKS`, the grid it aims for; `attention._plan` turns it into S splits
of `span` positions), in GPT-2 small's graphed step and its WHILE graph (dev.ab._ab_step:
the step at positions 100, 512 and 1000 and a whole generation per token, rounds
interleaved, the tokens of each compared).

Why it may pay: the plan is static (one graph serves every position), so the live blocks
of a launch grow with the position: at today's S = 16 of 64 positions, 60 queries (beam 5 x
12 heads) give 540 live blocks at position 512 (9 splits, the ninth holding one position),
a few more than the 528 that fit at once (4 blocks an SM x 132 SMs), and 960 at 1000: a
second wave of a few blocks costs a whole block's latency. Fewer, longer splits (S = 8 of
128) fit one wave to the end of the cache and give the combine half the partials; more,
shorter ones (S = 32 of 32) halve each block's serial work. Why it may not: a longer split
is more batches in a row for each warp, and the cp.async preload covers its first 64
positions only. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_attention_split 2>&1 | tee $OUT/ab_attention_split.txt
"""
import sys

from dev.ab import _ab_step
from kernels import attention

# Grids to aim for, as fractions of today's; each becomes a plan of its own (deduplicated).
FRACTIONS = (1.0, 15 / 32, 21 / 32, 15 / 8)


def variants() -> dict:
    """{"S<splits>x<span>": switch} for the step's plain kernel at the harness's shape,
    today's plan first."""
    cfg = _ab_step.cfg
    hd = cfg.n_embd // cfg.n_head
    out = {}
    for f in FRACTIONS:
        target = max(1, round(attention.TARGET_BLOCKS * f))
        _, splits, span = attention._plan(5, cfg.n_head, 1, _ab_step.MAX, hd,
                                          target_blocks=target)
        out.setdefault(f"S{splits}x{span}",
                       lambda t=target: _ab_step.patched(attention, TARGET_BLOCKS=t))
    return out


def main() -> int:
    found = variants()
    print(f"plans (splits x positions): {', '.join(found)}", flush=True)
    return _ab_step.run(found)


if __name__ == "__main__":
    sys.exit(main())
