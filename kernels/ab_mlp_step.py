"""A/B on the H200, one process: the MLP by kernels.mlp's fused kernel and sum (2 launches)
against kernels.gemm's fc and projection (3 launches: `mlp.fuses` forced False while that
model's graphs record), and the fused kernel at twice the hidden columns a block (`mlp.C`
doubled: half the partials), in GPT-2 small's graphed step (12 layers, beam 5, alias
binding, the length read on the device) at positions 100, 512 and 1000, rounds interleaved;
each one's planned arena (the memory the step's temporaries take); then a beam search under
each, whose tokens must be equal. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_mlp_step 2>&1 | tee $OUT/ab_mlp_step.txt
"""
import os
import sys
import time

import numpy as np

from kernels import mlp
from proto import backend, timing
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedGPT2

TOY = os.environ.get("AB_TOY") == "1"
cfg = GPT2Config(2, 32, 2, 50, 32) if TOY else GPT2Config(12, 768, 12, 50257, 1024)
MAX, POSITIONS, ROUNDS, NEW = (16, (6,), 1, 2) if TOY else (1024, (100, 512, 1000), 7, 200)
REPLAYS, REPS = (1, dict(warmup=0, reps=1)) if TOY else (10, dict(warmup=3, reps=20))
prompt = np.array([4, 20, 7, 21, 18] if TOY else [464, 2068, 7586, 21831, 18045], np.int32)
NAMES = ("gemm", "fused", "fused_2c")


def main() -> int:
    model = GPT2(cfg, random_state_dict(cfg, seed=0), max_batch=5, max_tokens=4)

    fuses, C = mlp.fuses, mlp.C
    graphs, tokens = {}, {}
    for name in NAMES:   # mlp.fuses and mlp.C are read when the graphs record their launches
        mlp.fuses = (lambda *shape: False) if name == "gemm" else fuses
        mlp.C = 2 * C if name == "fused_2c" else C
        t0 = time.perf_counter()
        g = GraphedGPT2(model, batch=5, max_len=MAX, binding="alias", strategy="device")
        replay = {p: g.replayer(p) for p in POSITIONS}
        for r in replay.values():
            r()
        backend.synchronize()
        tokens[name] = np.asarray(g.beam_search(prompt, max_new_tokens=NEW).tokens)
        graphs[name] = (g, replay)
        print(f"built {name} in {time.perf_counter() - t0:.1f} s; planned arena "
              f"{g.arena_bytes / 2**20:.3f} MiB", flush=True)
    mlp.fuses, mlp.C = fuses, C

    step_us = {(n, p): [] for n in NAMES for p in POSITIONS}
    for _ in range(ROUNDS):
        for p in POSITIONS:
            for n in NAMES:
                r = graphs[n][1][p]
                t = timing.bench(lambda: [r() for _ in range(REPLAYS)], **REPS)
                step_us[(n, p)].append(t.median_us / REPLAYS)
    for p in POSITIONS:
        base = np.median(step_us[("gemm", p)])
        for n in NAMES:
            s = np.array(step_us[(n, p)])
            print(f"STEP pos {p:4d} {n:6s} {np.median(s):8.1f} us (min {s.min():.1f}, max "
                  f"{s.max():.1f}, n={len(s)}) / gemm {np.median(s) / base:.4f}", flush=True)
    equal = all(np.array_equal(tokens["gemm"], tokens[n]) for n in NAMES)
    print(f"beam search, {NEW} tokens: tokens equal: {equal}", flush=True)
    for g, _ in graphs.values():
        g.close()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
