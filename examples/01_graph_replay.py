"""1. A CUDA graph from Numba kernels, and what replaying it saves.

A step of many tiny kernels is bound by the host: each eager launch costs 5-30 us of Python
and driver work while the kernel itself runs for a few. Recording the step once and replaying
it as a graph hands the driver the whole list in one call.

    python examples/01_graph_replay.py        (simulator or GPU)
"""
import numpy as np

from proto.device import backend, timing
from proto import graph
from proto.device.backend import cuda, jit, launch


@jit("void(float32[::1], float32)", writes=("x",))
def add_kernel(x, v):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += v


N = 64 if not backend.SIMULATOR else 8      # kernels in the step
x = cuda.to_device(np.zeros(32, np.float32))


def step(x):
    for k in range(N):
        launch(add_kernel, 1, 32, (x, np.float32(1.0)))


with graph.record() as rec:                 # record: nothing runs, every launch is a node
    step(x=x)
print(f"recorded {len(rec.nodes)} kernel nodes, first two:")
print("\n".join(rec.description().summary().splitlines()[:2]))
assert not x.copy_to_host().any()           # recording ran nothing

with graph.capture(step, {"x": x}, warmup=0) as g:   # record, plan, instantiate
    g.replay(x=x)                                    # one launch runs all N kernels
    assert (x.copy_to_host() == N).all()
    if backend.SIMULATOR:
        print("simulator: no real graphs here, so no timing (run this on a GPU)")
    else:
        eager = timing.bench_host(lambda: step(x=x), warmup=2, reps=10)
        replay = timing.bench_host(lambda: g.replay(x=x), warmup=2, reps=10)
        print(f"eager {eager.median_us / N:.2f} us per kernel, graph replay "
              f"{replay.median_us / N:.2f} us per kernel: {eager.median_ms / replay.median_ms:.1f}x")
print("ok: the replay computed what the eager step computes")
