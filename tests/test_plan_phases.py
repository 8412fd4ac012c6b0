"""Graphs of several phases (proto.graph.phase): a training step's forward and backward as
executables of their own, planned as one step so the tensors the forward saves keep their
bytes until the backward's last read."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import empty, launch
from proto.graph.plan import validate
from tests.helpers import dev
from tests.test_plan import add_kernel, scale_kernel


def two_phase_program(n, forward, backward):
    """A function of x in two phases. forward[i] = j: temporary f_i = x * (i + 1) (j < 0)
    or x + f_j (an earlier forward temporary, j mod how many there are). backward[i] = j:
    b_i = x + f_j (j >= 0: a tensor the forward saved) or x + b_(-j-1) (an earlier backward
    temporary; the first backward op always reads a saved one). The last b is the output.
    Returns (fn, NumPy reference, which forward temporaries the backward reads)."""
    saved = {j % len(forward) for j in backward if j >= 0}

    def fn(x):
        fs, bs = [], []
        for i, j in enumerate(forward):
            t = empty(n, np.float32, f"f{i}")
            if j < 0:
                launch(scale_kernel, 1, 32, (x, t, np.float32(i + 1)))
            else:
                launch(add_kernel, 1, 32, (x, fs[j % len(fs)], t))
            fs.append(t)
        graph.phase("backward")
        for i, j in enumerate(backward):
            t = empty(n, np.float32, f"b{i}")
            src = fs[j % len(fs)] if j >= 0 or not bs else bs[(-j - 1) % len(bs)]
            launch(add_kernel, 1, 32, (x, src, t))
            bs.append(t)
        return bs[-1]

    def ref(x):
        fs, bs = [], []
        for i, j in enumerate(forward):
            fs.append((i + 1) * x if j < 0 else x + fs[j % len(fs)])
        for j in backward:
            bs.append(x + (fs[j % len(fs)] if j >= 0 or not bs else bs[(-j - 1) % len(bs)]))
        return bs[-1]
    return fn, ref, saved


forward_ops = st.lists(st.integers(-1, 6), min_size=1, max_size=8).map(lambda o: [-1] + o[1:])
backward_ops = st.lists(st.integers(-4, 6), min_size=1, max_size=8).map(
    lambda o: [abs(o[0])] + o[1:])


@given(forward=forward_ops, backward=backward_ops, n=st.integers(1, 24))
def test_saved_tensors_live_from_the_forward_write_to_the_last_backward_read(forward, backward, n):
    fn, ref, saved = two_phase_program(n, forward, backward)
    x = np.random.default_rng(len(forward) + 7 * len(backward)).standard_normal(n)
    x = x.astype(np.float32)
    g = graph.capture(fn, {"x": dev(x)}, warmup=0)
    whole = graph.capture(fn, {"x": dev(x)}, warmup=0, planned=False)
    try:
        assert g.phases == ("start", "backward")
        validate(g.plan)
        span = {blk.key[1]: (blk.first, blk.last) for blk in g.plan.blocks}
        backward_start = len(forward)          # one node per op: the backward's first step
        last_read = {}
        for step, j in enumerate(backward, backward_start):
            if j >= 0 or step == backward_start:
                last_read[j % len(forward)] = step
        for f in saved:
            first, last = span[f"f{f}"]
            assert first < backward_start <= last_read[f] <= last
        # forward then backward, replayed apart, give what the reference and one private
        # graph give: nothing the backward allocated took the bytes of a saved tensor
        g.replay(phase="start", x=g.placeholders["x"])
        out = g.replay(phase="backward").copy_to_host()
        np.testing.assert_allclose(out, ref(x.astype(np.float64)), rtol=1e-6)
        np.testing.assert_array_equal(out, whole.replay(x=whole.placeholders["x"]).copy_to_host())
        np.testing.assert_array_equal(out, g.replay(x=g.placeholders["x"]).copy_to_host())
    finally:
        g.close()
        whole.close()


def test_phases_share_one_tape_with_the_graphs_of_other_lengths():
    """Per-length two-phase graphs on one tape, largest first: each length's backward reads
    its own forward's saved tensors at the tape's one address for that name."""
    tape = graph.Tape("phased")
    x = dev(np.arange(16, dtype=np.float32))
    graphs = []
    try:
        for n in (16, 9, 3):
            fn, ref, _ = two_phase_program(n, [-1, 0, -1], [1, -1, 0])
            graphs.append((n, ref, graph.capture(lambda x, fn=fn, n=n: fn(x[:n]), {"x": x},
                                                 warmup=0, tape=tape)))
        assert tape.arena_bytes >= graphs[0][2].plan.arena_bytes
        for n, ref, g in graphs:
            g.replay(phase="start", x=x)
            out = g.replay(phase="backward").copy_to_host()
            np.testing.assert_allclose(out, ref(np.arange(n, dtype=np.float64)), rtol=1e-6)
    finally:
        for _, _, g in graphs:
            g.close()
        tape.close()


def test_phase_misuse_is_refused():
    fn, _, _ = two_phase_program(4, [-1], [0])
    x = dev(np.ones(4, np.float32))
    g = graph.capture(fn, {"x": x}, warmup=0)
    try:
        with pytest.raises(RuntimeError, match="phases run in order"):
            g.replay(phase="backward")
        g.replay(phase="start", x=x)
        with pytest.raises(ValueError, match="inputs are bound at the first phase"):
            g.replay(phase="backward", x=x)
        with pytest.raises(ValueError, match="phase: expected one of"):
            g.replay(phase="update")
        g.replay(phase="backward")
    finally:
        g.close()
    with pytest.raises(ValueError, match="patch"):
        graph.capture(fn, {"x": x}, warmup=0, binding="patch")

    def twice(x):
        fn(x)
        graph.phase("backward")
    with pytest.raises(ValueError, match="already has a phase"):
        graph.capture(twice, {"x": x}, warmup=0)

    def empty_phase(x):
        fn(x)
        graph.phase("update")
    with pytest.raises(ValueError, match=r"phases \['update'\] launched no kernels"):
        graph.capture(empty_phase, {"x": x}, warmup=0)

    flag = dev(np.ones(1, np.int32))

    def inside_if(x):
        t = empty(4, np.float32, "t")
        graph.if_then(flag, lambda: (graph.phase("late"), launch(scale_kernel, 1, 32, (x, t, np.float32(2)))))
    with pytest.raises(RuntimeError, match="inside an IF or WHILE body"):
        graph.capture(inside_if, {"x": x}, warmup=0)
    graph.phase("eager")   # eagerly a no-op
