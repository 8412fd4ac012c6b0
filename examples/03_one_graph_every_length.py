"""3. Dynamic shapes: one graph per length, buckets, or one graph for every length; and one
arena for every graph (the memory tape).

A graph bakes in its launch sizes. Serving lengths 1..L takes L graphs (`exact`), about
log2(L) with padding (`bucket`), or one when the kernels read the length from device memory
(`device`). The temporaries of all those graphs live in one arena planned largest first.

    python examples/03_one_graph_every_length.py
"""
import numpy as np

from proto import graph, shapes
from proto.device.backend import cuda, empty, jit, launch


@jit("void(float32[:, ::1], int32[::1], float32[:, ::1])", writes=("out",))
def prefix_sum_kernel(x, n, out):
    """out[r] = x[0] + ... + x[r] for the first n[0] rows (n read on the device)."""
    c = cuda.grid(1)
    if c < x.shape[1]:
        total = 0.0
        for r in range(min(n[0], x.shape[0])):
            total += x[r, c]
            out[r, c] = total


L, C = 12, 4
x = cuda.to_device(np.ones((L, C), np.float32))
n = cuda.to_device(np.array([L], np.int32))
tape = graph.Tape("example")


def build(key):
    def fn(x, n):
        tmp = empty((key, C), np.float32, "prefix")   # a temporary: placed by the planner
        launch(prefix_sum_kernel, 1, 32, (x[:key], n, tmp))
        return tmp
    return graph.capture(fn, {"x": x, "n": n}, binding="alias", warmup=0, tape=tape)


for strategy in shapes.STRATEGIES:
    with shapes.ShapeDispatcher(build, strategy=strategy, max_length=L, dynamic=()) as d:
        for length in (3, 7, 12, 5):
            n.copy_to_device(np.array([length], np.int32))
            got = d.replay(length, x=x, n=n).copy_to_host()[:length, 0]
            assert (got == np.arange(1, length + 1)).all()
        print(f"{strategy:>6}: {d.num_graphs} graphs served lengths 3, 7, 12, 5")
print(f"every graph's temporary sits in one {tape.arena_bytes}-byte arena, at offset "
      f"{sorted(set(tape.offsets.values()))}: planned for the largest graph first")
