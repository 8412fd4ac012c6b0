"""Host costs of the LSTM's graphed decode loop on the GPU (is its time per token host-bound?).
Prints per-call host time of Numba slicing and of our per-object caches, then the shrinking
loop of graph_memory (64 steps, batch 64..1): wall time with a sync at the end, against the
host time spent issuing it (no sync inside), and a profile of the host time by function.

    PYTHONUNBUFFERED=1 python3 -m dev.profile.host_costs 2>&1 | tee $OUT/host_costs.txt

On the simulator it runs at toy size (its timings are the simulator's, not a GPU host's)."""
import cProfile
import pstats
import time

import numpy as np

from proto.device import backend
from proto.device.backend import cuda
from proto.models.graphed import GraphedLSTM
from proto.models.lstm import LSTMConfig, LSTMLM, random_state_dict
from kernels import sampling

TOY = backend.SIMULATOR
N = 200 if TOY else 20000


def per(fn, n=N):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    a = cuda.device_array((64, 1024), np.float32)
    print(f"a[:32]                    {per(lambda: a[:32]):7.2f} us")
    print(f"a.reshape                 {per(lambda: a.reshape(64 * 1024)):7.2f} us")
    print(f"backend.reshaped (hit)    {per(lambda: backend.reshaped(a, (64 * 1024,))):7.2f} us")
    print(f"backend.extent(a[:32])    {per(lambda: backend.extent(a[:32])):7.2f} us "
          "(a new view each)")
    print(f"backend.extent(a) (hit)   {per(lambda: backend.extent(a)):7.2f} us")

    cfg = LSTMConfig(1, 4, 4, 11) if TOY else LSTMConfig(2, 512, 1024, 10000)
    B = 2 if TOY else 64
    model = LSTMLM(cfg, random_state_dict(cfg, seed=0), max_batch=B)
    g = GraphedLSTM(model, max_batch=B, binding="alias", strategy="exact")
    g.build_all()
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, B).astype(np.int32)

    def shrinking(parts=None):
        g.tokens.copy_to_device(prompt)
        for b in range(B, 0, -1):
            t0 = time.perf_counter()
            logits = g.step(g.tokens, b)
            t1 = time.perf_counter()
            sampling.argmax(logits, backend.leading(g.tokens, b))   # (as graph_memory's loop)
            t2 = time.perf_counter()
            if parts is not None:
                parts[0] += t1 - t0
                parts[1] += t2 - t1

    for _ in range(3):
        shrinking()
    backend.synchronize()
    for _ in range(5):
        parts = [0.0, 0.0]
        t0 = time.perf_counter()
        shrinking(parts)
        issued = time.perf_counter() - t0
        backend.synchronize()
        wall = time.perf_counter() - t0
        print(f"shrinking loop: {wall / B * 1e3:.4f} ms a token wall, "
              f"{issued / B * 1e3:.4f} issued "
              f"(step {parts[0] / B * 1e6:.1f} us, argmax {parts[1] / B * 1e6:.1f} us a token)")
    profile = cProfile.Profile()   # where the host time of three loops goes, by function
    profile.runcall(lambda: [shrinking() for _ in range(3)])
    backend.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    g.close()


if __name__ == "__main__":
    main()
