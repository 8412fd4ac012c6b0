"""6. The memory planner: a graph's temporaries in one arena, and one arena for many graphs.

A recorded function takes its temporaries from `proto.device.backend.empty`; recording makes each a
buffer of the graph's description, live from the first node that touches it to the last.
Buffers whose lifetimes do not meet can share bytes, so the planner places them in one arena
(`capture(..., planned=True)`, the default). Three numbers say how well: the sum of the
buffers (what private buffers take), the arena, and the peak of bytes alive at one step (no
arena can be smaller). `validate` re-checks a plan with no GPU. A `Tape` carries the offsets
from graph to graph: the graphs of every length share one arena, planned largest first.

    python examples/06_memory_planner.py
"""
import dataclasses

import numpy as np

from proto import graph
from proto.device.backend import cuda, empty, jit, launch
from proto.graph import plan as planner


@jit("void(float32[::1], float32[::1])", writes=("out",))
def grow_kernel(x, out):
    """out[i] = 2 x[i mod len(x)] + 1: each stage reads the one before."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 2 * x[i % x.size] + 1


def layers(x, width):
    """Four stages of `width`, 2 `width`, 4 `width` and `width` floats, each a temporary read
    only by the next: at most two are alive at once."""
    h = x
    for k, w in enumerate((width, 2 * width, 4 * width, width)):
        out = empty(w, np.float32, f"stage{k}")
        launch(grow_kernel, (w + 31) // 32, 32, (h, out))
        h = out
    return h


x = cuda.to_device(np.ones(64, np.float32))

# 1. One graph: lifetimes, offsets, and the three numbers.
tape = graph.Tape("example")
big = graph.capture(lambda x: layers(x, 256), {"x": x}, warmup=0, tape=tape)
p = big.plan
print("one graph, 4 temporaries:")
for blk in p.blocks:   # a block's key: (owner, name, occurrence), the same in every graph
    print(f"  {blk.key[1]:>8}: {blk.nbytes:5d} bytes, live at nodes {blk.first}..{blk.last}, "
          f"offset {p.offsets[blk.key]}")
print(f"  private buffers {p.total_bytes} bytes, arena {p.arena_bytes}, "
      f"peak live {p.peak_live_bytes} (the lower bound)")
assert p.arena_bytes < p.total_bytes and p.arena_bytes >= p.peak_live_bytes

# 2. The plan is plain data, checked without a GPU: move stage1 onto stage2, which is alive
# at the same time, and validate says so.
key = {blk.key[1]: blk.key for blk in p.blocks}
broken = dataclasses.replace(p, offsets={**p.offsets, key["stage1"]: p.offsets[key["stage2"]]})
try:
    planner.validate(broken)
except planner.PlanError as exc:
    print(f"validate refuses a broken plan: {exc}")
else:
    raise AssertionError("validate accepted two live buffers at one offset")

# 3. The tape: a smaller graph of the same names finds its buffers where the first put them,
# so the arena is the largest graph's, not the sum of both.
small = graph.capture(lambda x: layers(x, 64), {"x": x}, warmup=0, tape=tape)
same = all(tape.offsets[blk.key] == small.plan.offsets[blk.key] for blk in small.plan.blocks)
print(f"a second graph (width 64) on the same tape: same offsets for every name: {same}; "
      f"tape arena {tape.arena_bytes} bytes for both graphs")
assert same and tape.arena_bytes == p.arena_bytes

# 4. Planned or private, a replay computes the same.
private = graph.capture(lambda x: layers(x, 256), {"x": x}, warmup=0, planned=False)
got, want = big.replay(x=x).copy_to_host(), private.replay(x=x).copy_to_host()
assert np.array_equal(got, want)
print(f"planned and private replays agree: {got[:4]} ...")
for g in (big, small, private):
    g.close()
tape.close()
