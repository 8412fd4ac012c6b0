"""A/B on the H200, one process: the LSTM's graphed shrinking loop (graph_memory's: batch
64..1, the argmax writing into the token buffer) with `backend.leading`'s remembered views
against a new slice at every call (the code before `leading`). The same graphs; 7
interleaved rounds of 5 loops each, every loop from the same state and prompt (untimed reset);
milliseconds a token; the tokens of the last loops compared.

Why: graph_memory times our LSTM at about 4x PtGraph's time per token, and each step made
seven new device-array views on the host (the step's inputs and output, the argmax's rows),
each also missing every per-object cache after it.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_lstm_views 2>&1 | tee $OUT/ab_lstm_views.txt

AB_TOY=1 checks the script on the simulator (timings meaningless there)."""
import statistics
import sys
import time

import numpy as np

from proto.device import backend
from proto.models import graphed
from proto.models.graphed import GraphedLSTM
from proto.models.lstm import LSTMConfig, LSTMLM, random_state_dict
from kernels import sampling
from dev.ab._ab_step import TOY, _report


def sliced(arr, n):
    return arr[:n]


def main() -> int:
    cfg = LSTMConfig(1, 4, 4, 11) if TOY else LSTMConfig(2, 512, 1024, 10000)
    B, ROUNDS, REPS = (2, 1, 1) if TOY else (64, 7, 5)
    model = LSTMLM(cfg, random_state_dict(cfg, seed=0), max_batch=B)
    g = GraphedLSTM(model, max_batch=B, binding="alias", strategy="exact")
    g.build_all()
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, B).astype(np.int32)
    remembered = backend.leading

    zeros = [np.zeros(a.shape, np.float32) for a in g.state.arrays()]

    def start():   # every loop from the same state and prompt (each loop advances the state)
        g.tokens.copy_to_device(prompt)
        for a, z in zip(g.state.arrays(), zeros):
            a.copy_to_device(z)
        backend.synchronize()

    def loop():
        for b in range(B, 0, -1):
            sampling.argmax(g.step(g.tokens, b), backend.leading(g.tokens, b))
        backend.synchronize()

    def use(fn):   # (graphed imported the name: both places)
        backend.leading = graphed.leading = fn

    samples, tokens = {"views": [], "slices": []}, {}
    try:
        for r in range(ROUNDS + 1):   # round 0 warms up
            for name, fn in (("views", remembered), ("slices", sliced)):
                use(fn)
                ts = []
                for _ in range(REPS):
                    start()
                    t0 = time.perf_counter()
                    loop()
                    ts.append((time.perf_counter() - t0) / B * 1e3)
                tokens[name] = g.tokens.copy_to_host()
                if r:
                    samples[name].append(statistics.median(ts))
    finally:
        use(remembered)
        g.close()
    _report("LSTM shrinking loop", samples, 6, ".4f", ".4f", "ms a token")
    equal = np.array_equal(tokens["views"], tokens["slices"])
    print("tokens equal:", equal)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
