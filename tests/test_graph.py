"""Graph description, recording, capture's phases and release (simulator lane).

The workload `make_step` is shared with test_binding and test_graph_gpu: two kernels and a
copy node, one kernel reading both inputs, the copy reading an input (so patch binding
rewrites a memcpy node too), and intermediates the graph must keep alive.
"""
import gc
import types
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import cuda, jit, launch
from proto.graph import default_executor
from proto.graph.binding import MODES
from proto.graph.ir import Copy, KernelLaunch
from tests.helpers import dev, rand


THREADS = 32  # small blocks: every simulated thread is a Python thread


@jit("void(float32, float32[::1], float32[::1], float32[::1])")
def axpy_kernel(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


@jit("void(float32[::1], float32[::1])")
def square_kernel(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] * x[i]


def blocks(n: int) -> int:
    return (n + THREADS - 1) // THREADS


def make_step(n: int):
    """step(x, y) -> ((2x + y)^2, copy of y); buffers allocated once, outside the graph."""
    h, out, y_copy = (dev(np.zeros(n, np.float32)) for _ in range(3))

    def step(x, y):
        launch(axpy_kernel, blocks(n), THREADS, (2.0, x, y, h))  # reads both inputs + a scalar
        launch(square_kernel, blocks(n), THREADS, (h, out))      # reads an intermediate
        graph.copy(y_copy, y)                                     # a copy node reading an input
        return out, y_copy
    return step


def eager(n, x, y):
    """The step run eagerly on fresh buffers: what every replay must reproduce exactly."""
    out, y_copy = make_step(n)(x=dev(x), y=dev(y))
    return out.copy_to_host(), y_copy.copy_to_host()


def run_replay(graphed, binding, x, y):
    """Replay on new host data, brought in the way `binding` expects."""
    if binding == "alias":  # the producer writes into the placeholders themselves
        graphed.placeholders["x"].copy_to_device(x)
        graphed.placeholders["y"].copy_to_device(y)
        return graphed.replay(**graphed.placeholders)
    return graphed.replay(x=dev(x), y=dev(y))


def count_launches(graphed, monkeypatch) -> list:
    launches = []
    real = graphed._executables[0].launch
    monkeypatch.setattr(graphed._executables[0], "launch", lambda: (launches.append(1), real()))
    return launches


def test_record_describes_launches_without_running_them():
    n = 7
    x, y = dev(np.ones(n, np.float32)), dev(np.full(n, 2, np.float32))
    step = make_step(n)
    with graph.record() as recorder:
        out, y_copy = step(x=x, y=y)
    nodes = graph.Description(recorder.nodes).nodes
    assert [type(node) for node in nodes] == [KernelLaunch, KernelLaunch, Copy]
    assert [node.name for node in nodes[:2]] == ["axpy_kernel", "square_kernel"]
    assert nodes[0].griddim == (1, 1, 1) and nodes[0].blockdim == (THREADS, 1, 1)
    assert [i for i, _ in nodes[0].array_args()] == [1, 2, 3]  # argument 0 is the scalar
    assert nodes[2].args == (y_copy, y)
    assert "square_kernel" in graph.Description(nodes).summary()
    # Recording ran nothing: a real launch would have written (2*1 + 2)^2 = 16 into `out`.
    assert not np.any(out.copy_to_host())


def test_record_rejects_host_arrays_and_copy_checks_shapes():
    host = np.zeros(4, np.float32)
    out = dev(host)
    with graph.record(), pytest.raises(TypeError, match="argument 0 is a host NumPy array"):
        launch(square_kernel, 1, THREADS, (host, out))
    a, b = dev(np.arange(4, dtype=np.float32)), dev(np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"dst is float32 \(5,\), src is float32 \(4,\)"):
        graph.copy(b, a)
    with pytest.raises(TypeError, match="src: expected a device or host array"):
        graph.copy(a, [0.0] * 4)
    with pytest.raises(TypeError, match="both arrays are on the host"):
        graph.copy(host, host.copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        graph.copy(a, np.zeros(8, np.float32)[::2])
    c = dev(np.zeros(4, np.float32))
    graph.copy(c, a)  # not recording: runs now
    np.testing.assert_array_equal(c.copy_to_host(), np.arange(4))


def test_capture_warms_up_records_and_replays():
    n = 5
    x, y = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    step, calls = make_step(n), []

    def counted(x, y):
        calls.append(1)
        return step(x=x, y=y)

    g = graph.capture(counted, {"x": x, "y": y}, warmup=2)
    assert len(calls) == 3                    # two eager warm-ups, one recording
    assert len(g.description) == 3 and g.stats.replays == 0
    out, _ = g.outputs
    out.copy_to_device(np.zeros(n, np.float32))
    assert g.replay(x=x, y=y) is g.outputs    # a replay returns the outputs it rewrote
    assert len(calls) == 3 and g.stats.replays == 1
    np.testing.assert_array_equal(out.copy_to_host(), eager(n, np.ones(n, np.float32), np.ones(n, np.float32))[0])
    g.close()
    assert g.closed
    with pytest.raises(RuntimeError, match="the graph is closed"):
        g.replay(x=x, y=y)


def test_capture_times_each_phase():
    """capture_s splits the capture's host time by phase: a warm-up that sleeps shows up in
    'warmup' and nowhere else, and the phases add up to no more than the whole call."""
    import time
    n = 5
    x, y = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    step, recording = make_step(n), []

    def slow_warmup(x, y):
        if not graph.recording():
            time.sleep(0.2)
        recording.append(graph.recording())
        return step(x=x, y=y)

    t0 = time.perf_counter()
    g = graph.capture(slow_warmup, {"x": x, "y": y}, warmup=1)
    wall = time.perf_counter() - t0
    assert recording == [False, True]
    assert set(g.capture_s) == {"warmup", "record", "plan", "build"}
    assert all(s >= 0 for s in g.capture_s.values())
    assert g.capture_s["warmup"] >= 0.2 and max(g.capture_s["record"], g.capture_s["plan"],
                                                 g.capture_s["build"]) < 0.2
    assert sum(g.capture_s.values()) <= wall
    g.close()


def test_capture_rejects_functions_that_launch_nothing_and_bad_options():
    x = dev(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="launched no kernels"):
        graph.capture(lambda x: None, {"x": x})
    with pytest.raises(ValueError, match="binding: expected one of"):
        graph.capture(make_step(3), {"x": x, "y": x}, binding="borrow")
    with pytest.raises(ValueError, match="placeholders 'x' and 'y' overlap"):
        graph.capture(make_step(3), {"x": x, "y": x})
    for warmup in (1.5, -1, True):
        with pytest.raises(ValueError, match="warmup: expected a non-negative integer"):
            graph.capture(make_step(3), {"x": x, "y": dev(np.zeros(3, np.float32))}, warmup=warmup)


@pytest.mark.parametrize("binding", MODES)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_replay_matches_eager(binding, n, seed, scale):
    rng, n = np.random.default_rng(seed), n * scale
    x0, y0 = rand(rng, n), rand(rng, n)
    with graph.capture(make_step(n), {"x": dev(x0), "y": dev(y0)}, binding=binding,
                       executor=default_executor()) as g:
        for _ in range(2):  # two replays: binding must work again after the first one
            x, y = rand(rng, n, scale=2.0), rand(rng, n)
            run_replay(g, binding, x, y)
            out, y_copy = (a.copy_to_host() for a in g.outputs)
            want_out, want_copy = eager(n, x, y)
            np.testing.assert_array_equal(out, want_out)
            np.testing.assert_array_equal(y_copy, want_copy)


@pytest.mark.parametrize("binding", MODES)
def test_wrong_inputs_rejected_before_any_launch(binding, monkeypatch):
    n = 6
    x_ph = dev(np.arange(n, dtype=np.float32))
    with graph.capture(make_step(n), {"x": x_ph, "y": dev(np.zeros(n, np.float32))},
                       binding=binding) as g:
        launches = count_launches(g, monkeypatch)
        good = g.placeholders["x"] if binding == "alias" else dev(np.full(n, 9, np.float32))
        bad_y = [
            (dev(np.zeros(n, np.float64)), TypeError, "'y': expected dtype float32, got float64"),
            (dev(np.zeros(n + 1, np.float32)), ValueError,
             r"'y': expected shape \(6,\) \(24 bytes\), got \(7,\) \(28 bytes\)"),
            (np.zeros(n, np.float32), TypeError,
             r"'y': expected a device array float32 \(6,\), got a host NumPy array"),
        ]
        for value, error, message in bad_y:
            with pytest.raises(error, match=message):
                g.replay(x=good, y=value)
        with pytest.raises(TypeError, match=r"expected inputs \['x', 'y'\].*missing \['y'\]"):
            g.replay(x=good)
        with pytest.raises(TypeError, match=r"unexpected \['z'\]"):
            g.replay(x=good, y=g.placeholders["y"], z=good)
        assert launches == []
        # x was valid but its replay failed on y: nothing may have been copied into x's placeholder.
        np.testing.assert_array_equal(x_ph.copy_to_host(), np.arange(n))
        assert g.stats.replays == 0


def test_close_releases_graph_and_buffers():
    n = 4
    x, y = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    captured = {}

    def step(x, y):
        tmp = cuda.device_array(n, np.float32)  # allocated per call: the graph keeps its own
        captured["tmp"] = weakref.ref(tmp)
        launch(axpy_kernel, blocks(n), THREADS, (1.0, x, y, tmp))
        return tmp

    with graph.capture(step, {"x": x, "y": y}) as g:
        executable = g._executables[0]
        assert captured["tmp"]() is g.outputs  # the recorded call's buffer is the output
    assert g.closed and executable.closed
    assert g.description is None and g.placeholders == {}
    gc.collect()
    assert captured["tmp"]() is None


# ------------------------------------------------------------------ shared executables' policy
class _FakeExecutable:
    """Stands in for an instantiated cuda.core graph: records what it was retargeted to."""

    def __init__(self, definition):
        self.holds = definition

    def update(self, definition):
        self.holds = definition

    def close(self):
        self.holds = None


class _FakeGraph:
    """What SharedExecutables reads of a CudaExecutor: a topology and a definition."""

    def __init__(self, name, topology="step"):
        self.topology = topology
        self._lowered = types.SimpleNamespace(definition=name)
        self._stream = None


@given(st.integers(1, 4), st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_shared_executables_never_retarget_the_one_just_launched(capacity, launches):
    """The LRU policy alone (no GPU: executables are stand-ins): every launch gets an
    executable holding that graph; at most `capacity` exist; with two or more, a miss
    retargets the least recently used, never the executable the previous launch used (which
    may still be running); with one, every switch retargets it."""
    import proto.graph.cuda as cuda_exec
    pool = cuda_exec.SharedExecutables(capacity)
    graphs = [_FakeGraph(f"g{i}") for i in range(8)]
    original = cuda_exec._instantiate
    cuda_exec._instantiate = lambda definition, stream: (_FakeExecutable(definition), 0)
    try:
        previous = None
        for i in launches:
            exe = pool.acquire(graphs[i])
            assert exe.holds == f"g{i}"
            if capacity >= 2 and previous is not None and last != i:   # a switch
                assert exe is not previous and previous.holds == f"g{last}"
            previous, last = exe, i
        assert pool.instantiations <= capacity
        assert pool.instantiations == min(capacity, len(dict.fromkeys(launches)))
        switches = sum(a != b for a, b in zip(launches, launches[1:]))
        if capacity == 1:
            assert pool.updates == switches
    finally:
        cuda_exec._instantiate = original


def test_early_launch_is_on_unless_switched_off(monkeypatch):
    """Early launch (programmatic edges into kernels that opted in) is the default; only
    PROTO_EARLY_LAUNCH=off turns it off, and any other value is refused by name."""
    from proto.graph import cuda as graph_cuda
    monkeypatch.delenv("PROTO_EARLY_LAUNCH", raising=False)
    assert graph_cuda.early_launch_switched_on() is True
    monkeypatch.setenv("PROTO_EARLY_LAUNCH", "off")
    assert graph_cuda.early_launch_switched_on() is False
    monkeypatch.setenv("PROTO_EARLY_LAUNCH", "yes")
    with pytest.raises(ValueError, match="PROTO_EARLY_LAUNCH"):
        graph_cuda.early_launch_switched_on()


def test_a_negative_memory_reading_is_refused_not_clamped():
    """Graph memory is a drop in device-wide free memory: if it rose while an executable was
    made, something else freed memory and the reading says nothing. It is kept as read and
    refused where it is reported, never turned into a plausible 0."""
    from proto.graph.cuda import _reading
    assert _reading(0, "memory_bytes") == 0 and _reading(2 << 20, "memory_bytes") == 2 << 20
    with pytest.raises(RuntimeError, match=r"memory_bytes: free device memory rose by 4096"):
        _reading(-4096, "memory_bytes")
