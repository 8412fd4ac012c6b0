"""Dynamic shapes: exact / bucket / device-length strategies give the eager result.

Workload: a softmax over the dynamic (leading) axis of x (L, C), one thread per column. The
exact and bucket graphs read L from the array's shape, baked into the graph; the device
graphs read it from a device int32, so rows past it are never touched. Bucket padding is -inf,
neutral for a softmax. (kernels.softmax.masked_softmax reads its length the same way.)
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph, shapes
from proto.device.backend import cuda, jit, launch
from proto.graph import default_executor
from proto.graph.binding import MODES
from tests.helpers import assert_close, dev, rand

C = 3  # columns = threads per launch


@cuda.jit(device=True)
def _softmax_column(x, out, c, n):
    m = -math.inf
    for r in range(n):
        m = max(m, x[r, c])
    total = 0.0
    for r in range(n):
        total += math.exp(x[r, c] - m)
    for r in range(n):
        out[r, c] = math.exp(x[r, c] - m) / total


@jit("void(float32[:, ::1], float32[:, ::1])")
def softmax_rows_kernel(x, out):
    c = cuda.grid(1)
    if c < x.shape[1]:
        _softmax_column(x, out, c, x.shape[0])


@jit("void(float32[:, ::1], int32[::1], float32[:, ::1])")
def softmax_length_kernel(x, length, out):
    c = cuda.grid(1)
    if c < x.shape[1]:
        _softmax_column(x, out, c, length[0])


def softmax_ref(x):
    e = np.exp(x - x.max(axis=0))
    return e / e.sum(axis=0)


class Workload:
    """Capacity buffers and a `build(key)` for one (strategy, binding, executor)."""

    def __init__(self, strategy, binding, max_length, executor):
        self.strategy, self.binding, self.executor = strategy, binding, executor
        self.x = dev(np.zeros((max_length, C), np.float32))   # (max, C) capacity input
        self.out = dev(np.zeros((max_length, C), np.float32))  # every graph writes a prefix
        self.n = dev(np.zeros(1, np.int32))                     # device length
        self.built = []

    def build(self, key):
        self.built.append(key)
        out = self.out[:key]
        if self.strategy == "device":
            def fn(x, n):
                launch(softmax_length_kernel, 1, C, (x, n, out))
                return out
        else:
            def fn(x):
                launch(softmax_rows_kernel, 1, C, (x, out))
                return out
        # alias: the capacity buffer's prefix is the placeholder; otherwise the graph's own.
        inputs = {"x": self.x[:key] if self.binding == "alias" else dev(np.zeros((key, C), np.float32))}
        if self.strategy == "device":
            inputs["n"] = self.n if self.binding == "alias" else dev(np.ones(1, np.int32))
        return graph.capture(fn, inputs, binding=self.binding, executor=self.executor)

    def step(self, dispatcher, x):
        """Write x (L, C) into the capacity buffer (padding with -inf), replay, read (L, C)."""
        length = x.shape[0]
        padded = np.full(self.x.shape, -np.inf, np.float32)
        padded[:length] = x
        self.x.copy_to_device(padded)
        self.n.copy_to_device(np.array([length], np.int32))
        extra = {"n": self.n} if self.strategy == "device" else {}
        dispatcher.replay(length, x=self.x, **extra)
        return dispatcher.graph(length).last_stats, self.out.copy_to_host()[:length]


@given(max_length=st.integers(1, 7), seed=st.integers(0, 2**16), data=st.data())
@pytest.mark.parametrize("binding", MODES)
@pytest.mark.parametrize("strategy", shapes.STRATEGIES)
def test_every_strategy_and_binding_gives_the_eager_result(strategy, binding, max_length, seed,
                                                           data, scale):
    rng = np.random.default_rng(seed)
    max_length *= scale
    lengths = data.draw(st.lists(st.integers(1, max_length), min_size=1, max_size=4))
    w = Workload(strategy, binding, max_length, default_executor())
    with shapes.ShapeDispatcher(w.build, strategy=strategy, max_length=max_length,
                                dynamic=("x",)) as d:
        for length in lengths:
            x = rand(rng, length, C, scale=3.0)
            stats, got = w.step(d, x)
            assert_close(got, softmax_ref(x.astype(np.float64)), "softmax")
            assert stats.bytes_copied == 0 or binding == "copy"
        # built on first use, the largest first (graphs sharing a memory tape need that)
        keys = {shapes.key_for(n, d.keys) for n in lengths} | {d.keys[-1]}
        assert d.num_graphs == len(keys) and sorted(d.graphs) == sorted(keys)
        assert w.built[0] == max_length
        if strategy == "device":
            assert d.num_graphs == 1  # one graph serves every length


@given(max_length=st.integers(1, 2000), length=st.integers(1, 2000))
def test_key_for_picks_the_smallest_graph_that_fits(max_length, length):
    length = min(length, max_length)
    exact = shapes.graph_keys("exact", max_length, None)
    bucket = shapes.graph_keys("bucket", max_length, None)
    assert shapes.key_for(length, exact) == length
    key = shapes.key_for(length, bucket)
    assert key >= length and (key == max_length or key & (key - 1) == 0)
    assert all(b < length for b in bucket if b < key)  # no smaller bucket fits
    assert len(bucket) <= math.ceil(math.log2(max_length)) + 1
    assert shapes.graph_keys("device", max_length, None) == [max_length]


def test_bad_lengths_buckets_and_buffers_are_rejected():
    keys = shapes.graph_keys("bucket", 8, [2, 8])
    with pytest.raises(ValueError, match="length: expected 1..8, got 9"):
        shapes.key_for(9, keys)
    with pytest.raises(ValueError, match="largest is max_length 8"):
        shapes.graph_keys("bucket", 8, [2, 4])
    with pytest.raises(ValueError, match="strategy: expected one of"):
        shapes.graph_keys("ragged", 8, None)
    w = Workload("bucket", "copy", 8, default_executor())
    with shapes.ShapeDispatcher(w.build, strategy="bucket", max_length=8, dynamic=("x",),
                                buckets=[2, 8]) as d:
        with pytest.raises(ValueError, match=r"'x': the graph for length 3 reads 8 rows, got a "
                                             r"buffer of 4"):
            d.replay(3, x=w.x[:4])
        with pytest.raises(TypeError, match=r"missing dynamic input\(s\) \['x'\]"):
            d.replay(3, y=w.x)
    with pytest.raises(ValueError, match="buckets: expected positive sizes"):
        shapes.graph_keys("bucket", 8, [])
    with pytest.raises(ValueError, match="buckets: expected integer sizes"):
        shapes.graph_keys("bucket", 8, [2.5, 8])
    with pytest.raises(ValueError, match="max_length: expected a positive integer"):
        shapes.graph_keys("exact", 8.0, None)
    assert shapes.graph_keys("exact", np.int64(3), None) == [1, 2, 3]   # NumPy integers work
    assert shapes.key_for(np.int32(2), keys) == 2


def test_eager_building_captures_largest_first_and_close_releases():
    w = Workload("bucket", "alias", 6, default_executor())
    d = shapes.ShapeDispatcher(w.build, strategy="bucket", max_length=6, dynamic=("x",),
                               eager=True)
    assert w.built == [6, 4, 2, 1] and d.num_graphs == 4
    graphs = list(d.graphs.values())
    if default_executor() == "walk":
        assert d.memory_bytes is None  # nothing instantiated, nothing to measure
    d.close()
    assert d.num_graphs == 0 and all(g.closed for g in graphs)
