"""A/B on the H200, one process: each of kernel_speed's six decode GEMMs (5 rows against
GPT-2 small's weights) with its kernel compiled for the 5 rows it multiplies
(`gemm.rows_variant`, main since 6c19e70) against the 8-row kernel it was.

Why: the rows change won in the model's step (qkv's partials, the attention projection and
the head run 5-row kernels there), but kernel_speed's next run on it (392e11c) timed the
whole-K [K, N] kernel (NN_COLUMNS: qkv's 2304 and fc's 3072 columns through `gemm.gemm`)
slower than the run before with 8 rows (qkv 9.0 against 8.1 us, fc 12.0 against 8.9),
on another machine: this times both in one process. Same registers and shared memory either
way (ptxas), and the same bits (each row's sum runs in the same order; checked below).

Each variant's graph is recorded under its rows choice (the library reads it at recording)
over kernel_speed's rotating copies, then the variants replay in interleaved rounds; the
median of ROUNDS rounds (each a median of 20 replays) with min and max, per shape.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_gemm_rows 2>&1 | tee $OUT/ab_gemm_rows.txt

AB_TOY=1 checks the script on the simulator (timings meaningless there).
"""
import sys

import numpy as np

from experiments import kernel_speed as ks
from kernels import gemm
from dev.ab._ab_step import TOY, _report, patched
from proto.device import timing
from proto import graph

ROUNDS, REPS = (1, dict(warmup=0, reps=1)) if TOY else (7, dict(warmup=3, reps=20))
VARIANTS = {"rows_exact": {}, "rows_8": {"rows_variant": lambda dk, m_rows: dk}}
SHAPES = ks.DECODE_GEMMS + ("gemm_decode_nn",)


def main() -> int:
    size = ks.SIZES["toy" if TOY else "full"]
    graphs = {}   # (shape, variant) -> (graph, copies in it, copy 0's first output)
    for variant, values in VARIANTS.items():
        # the same seed for both: the same weights, x and old outputs
        cases = [c for c in ks._cases(size, None) if c.name in SHAPES]
        for case in cases:
            fns = [pair[0] for pair in case.rotation]
            with patched(gemm, **values):
                case.ours()   # once on copy 0 (and the variant's kernel compiled)
                first = case.result()
                g = graph.capture(lambda **_: [fn() for fn in fns], {}, binding="alias",
                                  warmup=0)
            graphs[case.name, variant] = (g, len(fns), first)
    same = all(np.array_equal(graphs[s, "rows_exact"][2], graphs[s, "rows_8"][2])
               for s in SHAPES)
    samples = {key: [] for key in graphs}
    for _ in range(ROUNDS):
        for key, (g, copies, _) in graphs.items():
            samples[key].append(timing.bench(g.replay, flush=True, **REPS).median_ms
                                * 1e3 / copies)
    for shape in SHAPES:
        _report(f"{shape:22s}", {v: samples[shape, v] for v in VARIANTS}, 10, "7.3f", ".3f",
                "us")
    print(f"outputs bit-identical across variants: {same}")
    for g, _, _ in graphs.values():
        g.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
