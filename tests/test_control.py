"""IF and WHILE on a device flag (proto.graph.while_loop / if_then): eager semantics,
recording into conditional nodes, the bound on a loop's passes, and replays (the walk
executor on the simulator; real conditional nodes on a GPU, plus the host-driven fallback for
drivers without them)."""
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto.device import backend
from proto import graph
from proto.graph.cuda import conditional_nodes_switched_off
from proto.graph.ir import Conditional, KernelLaunch
from proto.device.backend import cuda, jit, launch
from tests.helpers import dev


@jit("void(int32[::1], float32[::1], int32[::1])")
def countdown_kernel(counter, total, flag):
    """total += counter; counter -= 1; flag = counter > 0 (one thread)."""
    if cuda.grid(1) == 0:
        total[0] += counter[0]
        counter[0] -= 1
        flag[0] = 1 if counter[0] > 0 else 0


@jit("void(float32[::1], float32)")
def add_kernel(x, v):
    if cuda.grid(1) == 0:
        x[0] += v


MAX_TRIPS = 64   # the countdown loops' bound: more than any test counts down from


def _i32(v):
    return dev(np.array([v], np.int32))


class Loop:
    """total = sum of counter, counter-1, ..., 1 by a WHILE on the device, then +1000 if a
    second flag is set (an IF): the step a graph records."""

    def __init__(self):
        self.counter, self.flag, self.go = _i32(0), _i32(0), _i32(0)
        self.total = dev(np.zeros(1, np.float32))

    def step(self):
        launch(add_kernel, 1, 1, (self.total, np.float32(0.5)))
        graph.while_loop(self.flag, lambda: launch(countdown_kernel, 1, 1,
                                                     (self.counter, self.total, self.flag)),
                         max_passes=MAX_TRIPS)
        graph.if_then(self.go, lambda: launch(add_kernel, 1, 1, (self.total, np.float32(1000.0))))

    def set(self, n, go):
        self.counter.copy_to_device(np.array([n], np.int32))
        self.flag.copy_to_device(np.array([int(n > 0)], np.int32))
        self.go.copy_to_device(np.array([int(go)], np.int32))
        self.total.copy_to_device(np.zeros(1, np.float32))

    def result(self):
        return float(self.total.copy_to_host()[0])


def want(n, go):
    return 0.5 + n * (n + 1) / 2 + (1000.0 if go else 0.0)


def test_eager_loop_runs_on_the_host():
    loop = Loop()
    loop.set(4, go=True)
    loop.step()
    assert loop.result() == want(4, True)
    assert graph.while_loop(loop.flag, lambda: None, max_passes=1) == 0   # flag 0: no pass


def test_recording_makes_conditional_nodes_with_bodies():
    loop = Loop()
    with graph.record() as rec:
        loop.step()
    desc = rec.description()
    assert [type(n) for n in desc.nodes] == [KernelLaunch, Conditional, Conditional]
    assert desc.nodes[1].loop and not desc.nodes[2].loop
    assert [n.name for n in desc.nodes[1].body.nodes] == ["countdown_kernel"]
    assert "while flag[0] != 0: 1 nodes" in desc.summary()
    assert "| " in desc.summary() and graph.races(desc) == []
    assert loop.result() == 0.0   # recording ran nothing
    # a body counted once: what one pass (or a taken IF) launches, 1 + 1 + 1 here
    assert desc.count_kernels() == 3 and desc.count_nodes() == 5


@given(n=st.integers(0, 6), go=st.booleans())
def test_one_graph_replays_every_trip_count(n, go):
    loop = Loop()
    loop.set(0, go=False)
    with graph.capture(loop.step, {}) as g:
        for m, branch in ((n, go), (n + 1, not go)):   # same graph, data-dependent trips
            loop.set(m, branch)
            g.replay()
            assert loop.result() == want(m, branch)


def test_bad_flags_and_empty_bodies_are_refused():
    with pytest.raises(ValueError, match=r"flag: expected a 1-element int32 .* float32 \(1,\)"):
        graph.while_loop(dev(np.zeros(1, np.float32)), lambda: None, max_passes=1)
    with pytest.raises(TypeError, match="flag: expected a 1-element int32 device array"):
        graph.if_then(np.zeros(1, np.int32), lambda: None)
    flag = _i32(1)
    with graph.record(), pytest.raises(ValueError, match="while_loop: the body launched no kernels"):
        graph.while_loop(flag, lambda: None, max_passes=1)


def test_patch_binding_refuses_conditional_graphs():
    x = dev(np.zeros(1, np.float32))
    flag = _i32(0)

    def step(x):
        graph.if_then(flag, lambda: launch(add_kernel, 1, 1, (x, np.float32(1.0))))

    with pytest.raises(ValueError, match="binding 'patch' rewrites top-level nodes only"):
        graph.capture(step, {"x": x}, binding="patch")


@pytest.mark.gpu
def test_host_driven_fallback_matches():
    # What a driver without conditional nodes gets: graph segments, the host reading flags.
    from proto.graph.cuda import HostDrivenExecutor, conditional_nodes_supported
    assert conditional_nodes_supported(), "the H200's driver should have conditional nodes"
    loop = Loop()
    with graph.record() as rec:
        loop.step()
    desc = rec.description()
    ex = HostDrivenExecutor(desc)
    for n, go in ((3, True), (0, False), (5, False)):
        loop.set(n, go)
        ex.launch()
        assert loop.result() == want(n, go)
    ex.close()
    assert ex.closed and not backend.SIMULATOR


@pytest.mark.gpu
@pytest.mark.skipif(conditional_nodes_switched_off(),
                    reason="PROTO_CONDITIONAL_NODES=off (the sanitizer lane): the test is about them")
def test_a_while_graph_is_one_cuda_graph():
    # Real conditional nodes: the executable is one CUDA graph (no host-driven segments), and
    # a replay of 50 passes needs no host decision.
    from proto.graph.cuda import CudaExecutor
    loop = Loop()
    loop.set(0, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback warning on this driver
        g = graph.capture(loop.step, {})
    assert isinstance(g._executables[0], CudaExecutor)
    loop.set(50, True)
    g.replay()
    assert loop.result() == want(50, True)
    g.close()


def test_a_driver_without_conditional_nodes_gets_predication_and_a_warning(monkeypatch):
    # The choice itself (predication's replays are checked in test_predicate, GPU included).
    from proto.graph import cuda as executors
    from proto.graph.ir import Description
    from proto.graph.predicate import PredicatedExecutor
    picked = []
    monkeypatch.delenv("PROTO_CONDITIONAL_NODES", raising=False)   # the driver's reason only
    monkeypatch.setattr(executors, "conditional_nodes_supported", lambda: False)
    monkeypatch.setattr(executors, "CudaExecutor", lambda *a: picked.append("cuda") or "cuda")
    loop = Loop()
    with graph.record() as rec:
        loop.step()
    with pytest.warns(RuntimeWarning, match="no conditional graph nodes.*predication"):
        assert isinstance(executors.make_cuda_executor(rec.description()), PredicatedExecutor)
    plain = Description(rec.nodes[:1])   # no conditional node: the ordinary executor, no warning
    picked.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert executors.make_cuda_executor(plain) == "cuda"
    assert picked == ["cuda"]


def test_conditional_nodes_switched_off_get_predication_and_say_why(monkeypatch):
    # The sanitizer lane's switch: a driver with conditional nodes, told not to use them.
    from proto.graph import cuda as executors
    from proto.graph.predicate import PredicatedExecutor
    monkeypatch.setattr(executors, "conditional_nodes_supported", lambda: True)
    monkeypatch.setattr(executors, "CudaExecutor", lambda *a: "cuda")
    loop = Loop()
    with graph.record() as rec:
        loop.step()
    monkeypatch.setenv("PROTO_CONDITIONAL_NODES", "off")
    with pytest.warns(RuntimeWarning, match="CONDITIONAL_NODES=off: IF/WHILE run by predication"):
        assert isinstance(executors.make_cuda_executor(rec.description()), PredicatedExecutor)
    monkeypatch.setenv("PROTO_CONDITIONAL_NODES", "on")
    assert executors.make_cuda_executor(rec.description()) == "cuda"
    monkeypatch.setenv("PROTO_CONDITIONAL_NODES", "no")
    with pytest.raises(ValueError, match="CONDITIONAL_NODES: expected 'on' or 'off', got 'no'"):
        executors.make_cuda_executor(rec.description())


# ------------------------------------------------------------------------- loop bounds
@jit("void(int32[::1], int32[::1])")
def forever_kernel(flag, count):
    """count += 1 and leave the flag set: a body that never ends its loop."""
    if cuda.grid(1) == 0:
        count[0] += 1
        flag[0] = 1


def test_a_loop_that_never_clears_its_flag_stops_at_its_bound_eagerly():
    flag, count = _i32(1), _i32(0)
    with pytest.raises(graph.LoopBoundError, match="still set after max_passes=7"):
        graph.while_loop(flag, lambda: launch(forever_kernel, 1, 1, (flag, count)), max_passes=7)
    assert int(count.copy_to_host()[0]) == 7
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_passes: expected a positive integer"):
            graph.while_loop(flag, lambda: None, max_passes=bad)


def test_a_replayed_loop_stops_at_its_bound_and_the_replay_says_so():
    flag, count = _i32(0), _i32(0)
    g = graph.capture(lambda: graph.while_loop(
        flag, lambda: launch(forever_kernel, 1, 1, (flag, count)), max_passes=5), {}, warmup=0)
    flag.copy_to_device(np.array([1], np.int32))
    with pytest.raises(graph.LoopBoundError, match="max_passes=5"):
        g.replay()
    assert int(count.copy_to_host()[0]) == 5   # stopped after exactly the bound: no more passes
    flag.copy_to_device(np.array([0], np.int32))
    count.copy_to_device(np.zeros(1, np.int32))
    g.replay()                                 # flag clear: no pass, no error
    assert int(count.copy_to_host()[0]) == 0
    g.close()


# ------------------------------------------------------------------------- what cannot be recorded
def test_recording_refuses_host_transfers_and_nesting():
    x = dev(np.zeros(4, np.float32))
    with graph.record():
        with pytest.raises(RuntimeError, match=r"copy_to_host\(\) inside a recorded function"):
            x.copy_to_host()
        with pytest.raises(RuntimeError, match=r"to_device\(\) inside a recorded function"):
            cuda.to_device(np.ones(4, np.float32))
        with pytest.raises(RuntimeError, match=r"copy_to_device\(\) inside a recorded function"):
            x.copy_to_device(np.ones(4, np.float32))
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with graph.record():
                pass
        with pytest.raises(RuntimeError, match="captures cannot nest"):
            graph.capture(lambda: launch(add_kernel, 1, 1, (x, np.float32(1.0))), {})
    np.testing.assert_array_equal(x.copy_to_host(), 0)   # transfers work again afterwards

    def step_reading_the_host(x):
        launch(add_kernel, 1, 1, (x, np.float32(1.0)))
        return float(x.copy_to_host()[0])     # would freeze this value into every replay
    with pytest.raises(RuntimeError, match="stale data"):
        graph.capture(step_reading_the_host, {"x": x}, warmup=0)


def test_block_wide_kernels_inside_a_nested_if_in_a_while_match_their_references(scale):
    """Kernels with shared memory and barriers (layer norm, both top-k stages) as the body of
    an IF inside a WHILE: a replay runs them as conditional graph nodes on a GPU. Each pass
    normalizes x into y and ranks y, so after any number of passes the results are one
    pass's. (The search loop's step is such a body; this is its smallest form.)"""
    from kernels import layernorm, sampling
    rng = np.random.default_rng(5)
    R, C, k = 3, 300 * scale, 5
    x = rng.standard_normal((R, C)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    dx, dg, db = dev(x), dev(g), dev(b)
    y, values = dev(np.zeros((R, C), np.float32)), dev(np.zeros((R, k), np.float32))
    indices = dev(np.zeros((R, k), np.int32))
    loop = Loop()

    def body():
        graph.if_then(loop.go, lambda: (layernorm.layernorm(dx, dg, db, y),
                                        sampling.topk(y, k, values, indices)))
        launch(countdown_kernel, 1, 1, (loop.counter, loop.total, loop.flag))

    g_ = graph.capture(lambda: graph.while_loop(loop.flag, body, max_passes=MAX_TRIPS), {})
    loop.set(3, True)
    g_.replay()
    want_y = layernorm.layernorm_ref(x, g, b)
    np.testing.assert_allclose(y.copy_to_host(), want_y, atol=1e-5, rtol=1e-4)
    want_v, _ = sampling.topk_ref(y.copy_to_host(), k)
    np.testing.assert_array_equal(values.copy_to_host(), want_v)
    assert loop.result() == 3 + 2 + 1   # every pass ran
    g_.close()


@pytest.mark.parametrize("case", ["while", "if", "nested", "while_wide", "while_temp"])
def test_the_sanitizer_repro_cases_replay_correctly(case):
    """tests/conditional_repro.py's graphs (what the sanitizer lane's switch rests on) give
    the right totals on every replay, here without a tool."""
    from tests import conditional_repro
    assert case in conditional_repro.CASES
    assert conditional_repro.run_case(case, replays=4) == 0
