"""A/B on the H200, one process: the MLP by kernels.mlp's fused kernel and sum (2 launches)
against kernels.gemm's fc and projection (3 launches: `mlp.fuses` forced False while that
model's graphs record), and the fused kernel with two teams a block (`mlp.TEAMS` = 2: half
the partials, the same work a thread), in GPT-2 small's graphed step (kernels._ab_step: positions 100,
512 and 1000, rounds interleaved, each one's planned arena, then a beam search under each,
whose tokens must be equal). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_mlp_step 2>&1 | tee $OUT/ab_mlp_step.txt
"""
import contextlib
import sys

from kernels import _ab_step, mlp


@contextlib.contextmanager
def variant(fused: bool, teams: int):
    fuses, TEAMS = mlp.fuses, mlp.TEAMS
    mlp.fuses = fuses if fused else (lambda *shape: False)
    mlp.TEAMS = teams
    try:
        yield
    finally:
        mlp.fuses, mlp.TEAMS = fuses, TEAMS


def main() -> int:
    # (C = 32, one team: 606.3 us against 538.9 at C = 16, results/h200/profiles/
    # ab_mlp_step_c3c1ebc.txt; not timed again)
    return _ab_step.run({"gemm": lambda: variant(False, 1),
                         "fused": lambda: variant(True, 1),
                         "fused_2teams": lambda: variant(True, 2)})


if __name__ == "__main__":
    sys.exit(main())
