"""4. Data-dependent control flow inside one graph: a WHILE loop on a device flag.

Generation loops until the data says stop. `graph.while_loop(flag, body)` records a
conditional node: on the GPU a WHILE graph node whose body runs again and again while a
kernel of the body leaves the flag set, with no host round trip between passes. Every loop
has a bound on its passes.

    python examples/04_while_loop.py
"""
import numpy as np

from proto import graph
from proto.device.backend import cuda, jit, launch


@jit("void(int32[::1], float32[::1], int32[::1])", writes=("counter", "total", "flag"))
def countdown_kernel(counter, total, flag):
    if cuda.grid(1) == 0:
        total[0] += counter[0]
        counter[0] -= 1
        flag[0] = 1 if counter[0] > 0 else 0


counter, flag = cuda.to_device(np.zeros(1, np.int32)), cuda.to_device(np.zeros(1, np.int32))
total = cuda.to_device(np.zeros(1, np.float32))


def step():
    graph.while_loop(flag, lambda: launch(countdown_kernel, 1, 1, (counter, total, flag)),
                     max_passes=100)


with graph.capture(step, {}, warmup=0) as g:
    print(g.description.summary())
    for n in (3, 10, 0):                     # one graph, any trip count
        counter.copy_to_device(np.array([n], np.int32))
        flag.copy_to_device(np.array([int(n > 0)], np.int32))
        total.copy_to_device(np.zeros(1, np.float32))
        g.replay()
        print(f"counted down from {n}: total {total.copy_to_host()[0]:.0f} (want {n * (n + 1) // 2})")
        assert total.copy_to_host()[0] == n * (n + 1) // 2

# A loop that would run 1000 passes against a bound of 5 stops at 5 and says so (a body that
# never clears its flag would otherwise run forever).
counter.copy_to_device(np.array([1000], np.int32))
flag.copy_to_device(np.ones(1, np.int32))
try:
    graph.while_loop(flag, lambda: launch(countdown_kernel, 1, 1, (counter, total, flag)),
                     max_passes=5)
except graph.LoopBoundError as e:
    print(f"a loop whose flag never falls stops at its bound: {e}")
