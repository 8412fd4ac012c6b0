"""Recording work spread over streams and events: the graph becomes a DAG (simulator lane,
with the replay also checked on the GPU).

The reference for the edges is CUDA's own stream semantics, computed independently here with
vector clocks: op a happens before op b when b's stream has, through its own order and the
events it waited for, seen a. The recorded description must order exactly those pairs.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import cuda, jit, launch
from proto.graph import default_executor
from tests.helpers import dev

THREADS = 32


@jit("void(float32[::1], float32)")
def add_kernel(x, v):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += v


def ancestors(description) -> list[set]:
    out = []
    for deps in description.deps:
        out.append(set(deps).union(*(out[d] for d in deps)))
    return out


def test_events_become_edges_between_stream_chains():
    a, b = dev(np.zeros(4, np.float32)), dev(np.zeros(4, np.float32))
    host = cuda.pinned_array(4, np.float32)
    compute, d2h = cuda.stream(), cuda.stream()
    computed, copied = cuda.event(), cuda.event()
    with graph.record() as rec:
        launch(add_kernel, 1, THREADS, (a, 1.0), compute)        # 0
        graph.record_event(computed, compute)
        graph.wait_event(computed, d2h)
        graph.copy(host, a, stream=d2h)                           # 1: after 0
        graph.record_event(copied, d2h)
        launch(add_kernel, 1, THREADS, (b, 1.0), compute)        # 2: after 0, beside 1
        graph.wait_event(copied, compute)
        launch(add_kernel, 1, THREADS, (a, 2.0), compute)        # 3: after 1 and 2
    desc = rec.description()
    assert desc.deps == [(), (0,), (0,), (1, 2)]
    assert not desc.is_chain and graph.races(desc) == []
    assert desc.nodes[1].direction == "D2H"
    assert "after [1, 2]" in desc.summary()

    # Without the wait, node 3 writes `a` while the copy may still read it.
    with graph.record() as rec:
        launch(add_kernel, 1, THREADS, (a, 1.0), compute)
        graph.record_event(computed, compute)
        graph.wait_event(computed, d2h)
        graph.copy(host, a, stream=d2h)
        launch(add_kernel, 1, THREADS, (a, 2.0), compute)
    assert graph.races(rec.description()) == [(1, 2)]


def test_one_stream_records_a_chain_and_foreign_events_are_refused():
    a = dev(np.zeros(4, np.float32))
    with graph.record() as rec:
        for v in (1.0, 2.0, 3.0):
            launch(add_kernel, 1, THREADS, (a, v))
    assert rec.description().is_chain and graph.races(rec.description()) == []
    outside = cuda.event()
    outside.record()
    with graph.record(), pytest.raises(ValueError, match="not recorded earlier in this graph"):
        graph.wait_event(outside, cuda.stream())
    with pytest.raises(ValueError, match="can only wait for earlier nodes"):
        graph.Description(rec.nodes, [(), (0,), (2,)])


def test_host_computation_refuses_to_be_recorded():
    with graph.record(), pytest.raises(RuntimeError, match="computes on the host"):
        graph.require_eager("a NumPy step")
    graph.require_eager("a NumPy step")   # outside recording: fine


# A random program over 3 streams: launches touching one of 3 buffers, event records, waits.
program = st.lists(st.tuples(st.sampled_from(["launch", "record", "wait"]),
                             st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=25)


@given(program)
def test_recorded_edges_are_exactly_stream_semantics(ops):
    bufs = [dev(np.zeros(2, np.float32)) for _ in range(3)]
    streams, events = [cuda.stream() for _ in range(3)], [cuda.event() for _ in range(3)]
    clocks = [[0] * 3 for _ in range(3)]     # per stream: how far it has seen each stream
    seen_by_event, launched = {}, []          # launched: (stream, its sequence number)
    with graph.record() as rec:
        for kind, s, x in ops:
            if kind == "launch":
                launch(add_kernel, 1, THREADS, (bufs[x], 1.0), streams[s])
                clocks[s][s] += 1
                launched.append((s, clocks[s][s], list(clocks[s])))
            elif kind == "record":
                graph.record_event(events[x], streams[s])
                seen_by_event[x] = list(clocks[s])
            elif x in seen_by_event:
                graph.wait_event(events[x], streams[s])
                clocks[s] = [max(p, q) for p, q in zip(clocks[s], seen_by_event[x])]
    desc = rec.description()
    assert len(desc) == len(launched)
    reach = ancestors(desc)
    for j, (_, _, clock_j) in enumerate(launched):
        want = {i for i, (s_i, seq_i, _) in enumerate(launched[:j]) if clock_j[s_i] >= seq_i}
        assert reach[j] == want, f"node {j}"


def test_multi_stream_graph_replays_like_eager():
    """Fork to a copy stream and join back, with device-to-host and host-to-device copies
    (on a GPU: a real CUDA graph with two copy branches)."""
    n = 64
    a, b = dev(np.arange(n, dtype=np.float32)), dev(np.zeros(n, np.float32))
    host = cuda.pinned_array(n, np.float32)
    compute, d2h, h2d = cuda.stream(), cuda.stream(), cuda.stream()
    ev = [cuda.event() for _ in range(3)]

    def step():
        launch(add_kernel, 1, n, (a, 1.0), compute)
        graph.record_event(ev[0], compute)
        graph.wait_event(ev[0], d2h)
        graph.copy(host, a, stream=d2h)             # a out to the host ...
        graph.record_event(ev[1], d2h)
        graph.wait_event(ev[1], h2d)
        graph.copy(b, host, stream=h2d)             # ... and back into b
        graph.record_event(ev[2], h2d)
        graph.wait_event(ev[2], compute)
        launch(add_kernel, 1, n, (b, 100.0), compute)
        launch(add_kernel, 1, n, (a, 10.0), compute)

    with graph.capture(step, {}, executor=default_executor()) as g:
        assert graph.races(g.description) == [] and not g.description.is_chain
        assert [type(node).__name__ for node in g.description.nodes] == [
            "KernelLaunch", "Copy", "Copy", "KernelLaunch", "KernelLaunch"]
        for _ in range(2):
            g.replay()
        cuda.synchronize()
    # 3 runs (the warm-up, two replays): a gains 11 each; b is a after the 3rd +1, + 100.
    base = np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(a.copy_to_host(), base + 33)
    np.testing.assert_array_equal(b.copy_to_host(), base + 22 + 1 + 100)
