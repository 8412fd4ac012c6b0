"""The CUDA executor on a real GPU: the simulator lane's properties, on real CUDA graphs.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -q tests/test_graph_gpu.py
"""
import gc
import types
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph, shapes
from proto.device import backend
from proto.device.backend import cuda, launch
from proto.graph.binding import MODES, Slot
from proto.graph.cuda import CudaExecutor, SharedExecutables
from tests.helpers import assert_close, dev, rand
from tests.test_graph import THREADS, axpy_kernel, blocks, eager, make_step, run_replay
from tests.test_shapes import Workload, softmax_ref

pytestmark = pytest.mark.gpu


def free_bytes() -> int:
    """Device memory free once every dropped Numba buffer is really freed."""
    return backend.settled_free_memory()[0]


@pytest.mark.parametrize("executor", ["cuda", "walk"])
@pytest.mark.parametrize("binding", MODES)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_replay_matches_eager_on_the_gpu(executor, binding, n, seed, scale):
    rng, n = np.random.default_rng(seed), n * scale
    with graph.capture(make_step(n), {"x": dev(rand(rng, n)), "y": dev(rand(rng, n))},
                       binding=binding, executor=executor) as g:
        assert isinstance(g._executables[0], CudaExecutor) == (executor == "cuda")
        for _ in range(2):
            x, y = rand(rng, n, scale=2.0), rand(rng, n)
            run_replay(g, binding, x, y)
            assert g.last_stats.bytes_copied == (2 * n * 4 if binding == "copy" else 0)
            want_out, want_copy = eager(n, x, y)
            np.testing.assert_array_equal(g.outputs[0].copy_to_host(), want_out)
            np.testing.assert_array_equal(g.outputs[1].copy_to_host(), want_copy)


def test_patch_rewrites_real_kernel_and_memcpy_nodes():
    # 2-D input read through views at offsets: slots sit inside Numba's flattened parameters.
    rows, cols = 37, 129
    n = rows * cols
    out = dev(np.zeros(n - 1, np.float32))
    x_copy = dev(np.zeros((rows, cols), np.float32))

    def fn(x):
        flat = x.reshape(n)
        launch(axpy_kernel, blocks(n - 1), THREADS, (3.0, flat[1:], flat[:-1], out))
        graph.copy(x_copy, x)  # a memcpy node reading the input
        return out

    x_ph = dev(np.zeros((rows, cols), np.float32))
    with graph.capture(fn, {"x": x_ph}, binding="patch", executor="cuda") as g:
        assert g.slots == [Slot(0, 1, "x", 4), Slot(0, 2, "x", 0), Slot(1, 1, "x", 0)]
        for seed in range(3):
            x = rand(np.random.default_rng(seed), rows, cols)
            g.replay(x=dev(x))
            assert g.last_stats.bytes_copied == 0
            flat = x.reshape(n)
            # The GPU fuses a*x + y into one FMA (one rounding), NumPy rounds twice.
            assert_close(out, 3 * flat[1:] + flat[:-1], "elementwise")
            np.testing.assert_array_equal(x_copy.copy_to_host(), x)
        np.testing.assert_array_equal(x_ph.copy_to_host(), 0)  # never copied into


@pytest.mark.parametrize("binding", MODES)
def test_wrong_inputs_rejected_before_any_graph_launch(binding, monkeypatch):
    n = 1000
    with graph.capture(make_step(n), {"x": dev(np.zeros(n, np.float32)),
                                      "y": dev(np.zeros(n, np.float32))}, binding=binding) as g:
        launches = []
        real = g._executables[0].launch
        monkeypatch.setattr(g._executables[0], "launch", lambda: (launches.append(1), real()))
        with pytest.raises(ValueError, match=r"'y': expected shape \(1000,\) \(4000 bytes\), "
                                             r"got \(999,\)"):
            g.replay(x=g.placeholders["x"], y=dev(np.zeros(n - 1, np.float32)))
        with pytest.raises(TypeError, match="'x': expected dtype float32, got int32"):
            g.replay(x=dev(np.zeros(n, np.int32)), y=g.placeholders["y"])
        if binding == "alias":
            with pytest.raises(ValueError, match="alias binding needs the graph's placeholder"):
                g.replay(x=dev(np.zeros(n, np.float32)), y=g.placeholders["y"])
        assert launches == []


def _owns(root, target) -> bool:
    """Whether `target` is among the objects `root` owns: reachable through gc referents, not
    through modules, classes, functions, code or frames (those lead to everything)."""
    skip = (types.ModuleType, type, types.FunctionType, types.CodeType, types.FrameType)
    seen, level = {id(root)}, [root]
    while level:
        nxt = []
        for r in gc.get_referents(*level):
            if r is target:
                return True
            if id(r) not in seen and not isinstance(r, skip):
                seen.add(id(r))
                nxt.append(r)
        level = nxt
    return False


def _capture_with_views(size: int, warmup: int):
    """A one-kernel graph whose node writes a view of a fresh `size`-element buffer (the view
    holds the whole allocation alive), and weak references to every view `fn` made."""
    x = dev(np.ones(THREADS, np.float32))
    views = []

    def fn(x):
        view = cuda.device_array(size, np.float32)[:THREADS]
        views.append(view)
        launch(axpy_kernel, 1, THREADS, (1.0, x, x, view))
        return None
    g = graph.capture(fn, {"x": x}, executor="cuda", warmup=warmup)
    refs = [weakref.ref(v) for v in views]
    views.clear()
    return g, refs


def _allocated(pointer: int) -> bool:
    """Whether the driver still has an allocation at `pointer` (cuMemGetAddressRange). Asked
    of the pointer, not read from the device's free memory: other processes (the lane's
    shards, the sanitizer's four tools) allocate and free meanwhile."""
    from cuda.bindings import driver
    err, _, _ = driver.cuMemGetAddressRange(pointer)
    if err == driver.CUresult.CUDA_SUCCESS:
        return True
    assert err == driver.CUresult.CUDA_ERROR_NOT_FOUND, err
    return False


def test_close_destroys_the_graph_and_frees_its_buffers():
    g, (recorded_view,) = _capture_with_views(16 << 20, warmup=0)
    gc.collect()
    assert recorded_view() is not None  # the recorded buffer lives on in the description
    pointer = recorded_view().__cuda_array_interface__["data"][0]
    assert _allocated(pointer)   # (the control: the question sees a live allocation)
    executable = g._executables[0]
    g.close()
    assert executable.closed
    gc.collect()
    assert recorded_view() is None  # no Python reference left ...
    free_bytes()                    # (Numba frees dropped buffers in batches: flush them)
    assert not _allocated(pointer)  # ... and the driver has the memory back


def test_the_graph_keeps_no_warm_up_buffer():
    # Whether the warm-up's view is freed at once is up to Python's frames (under
    # compute-sanitizer a frame of Numba's launch outlives the call, held from C); what the
    # graph owns is ours to check. The recorded view is the control that the search finds one.
    g, (warmup_view, recorded_view) = _capture_with_views(THREADS, warmup=1)
    with g:
        assert _owns(g, recorded_view())
        assert warmup_view() is None or not _owns(g, warmup_view())


@pytest.mark.parametrize("binding", MODES)
@pytest.mark.parametrize("strategy", shapes.STRATEGIES)
def test_shapes_on_cuda_graphs(strategy, binding):
    rng = np.random.default_rng(1)
    w = Workload(strategy, binding, 300, "cuda")
    with shapes.ShapeDispatcher(w.build, strategy=strategy, max_length=300, dynamic=("x",),
                                eager=strategy != "exact") as d:
        for length in (1, 77, 300, 129, 64):
            x = rand(rng, length, 3, scale=3.0)
            _, got = w.step(d, x)
            assert_close(got, softmax_ref(x.astype(np.float64)), "softmax")
        assert d.num_graphs == {"exact": 5, "bucket": 10, "device": 1}[strategy]


def test_graphs_of_one_topology_share_an_executable_retargeted_by_update():
    """Eight graphs that differ only in their pointers (an offset baked per graph, as the
    per-length decode graphs bake their position), one executable: each replay retargets it
    with executable update and computes what its own graph would."""
    n, k = 4096, 8
    x, y = dev(np.arange(n, dtype=np.float32)), dev(np.ones(n, np.float32))
    outs = [dev(np.zeros(n, np.float32)) for _ in range(k)]

    def build(j):
        scale = np.float32(j + 1)
        return graph.capture(lambda x, y: launch(axpy_kernel, blocks(n), THREADS,
                                                 (scale, x, y, outs[j])),
                             {"x": x, "y": y}, binding="alias", warmup=0, shared=pool)

    pool = SharedExecutables(capacity=1)
    graphs = [build(j) for j in range(k)]
    assert pool.instantiations == 0 and all(g.memory_bytes == 0 for g in graphs)
    for rounds in range(2):
        for j in (3, 0, 7, 7, 5, 1, 2, 6, 4):
            graphs[j].replay(x=x, y=y)
            cuda.synchronize()
            np.testing.assert_array_equal(outs[j].copy_to_host(), (j + 1) * np.arange(n) + 1)
            outs[j].copy_to_device(np.zeros(n, np.float32))
    assert pool.instantiations == 1           # one executable served every graph
    assert pool.updates == 2 * 9 - 2 - 1      # a miss per switch (7 then 7 is a hit; so is the
                                              # first launch, which instantiates)
    assert pool.update_us_per_switch > 0
    for g in graphs:
        g.close()
    pool.close()


def test_a_planned_graph_shares_its_tape_and_equals_an_unplanned_one():
    """Temporaries from `empty` placed in one arena: the same name has one address in every
    graph of the tape, the arena is what the largest graph needs, and replays equal private
    buffers bit for bit."""
    from proto.device.backend import empty
    from kernels import elementwise

    def fn(x, rows):
        t = empty((rows, 64), np.float32, "t")
        elementwise.add(x[:rows], x[:rows], t)
        u = empty((rows, 64), np.float32, "u")
        elementwise.add(t, x[:rows], u)
        v = empty((rows, 64), np.float32, "v")   # t is dead: v can take its bytes
        elementwise.add(u, u, v)
        return v

    x = dev(np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32))
    tape = graph.Tape("test")
    planned = {r: graph.capture(lambda x, r=r: fn(x, r), {"x": x}, warmup=0, tape=tape)
               for r in (512, 100, 7)}            # largest first
    private = {r: graph.capture(lambda x, r=r: fn(x, r), {"x": x}, warmup=0, planned=False)
               for r in (512, 100, 7)}
    big = planned[512].plan
    assert tape.arena_bytes == big.arena_bytes <= 1.10 * big.peak_live_bytes
    assert big.arena_bytes < big.total_bytes      # t and v share bytes
    for r in (7, 100, 512):
        got, want = planned[r].replay(x=x).copy_to_host(), private[r].replay(x=x).copy_to_host()
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, 6 * x.copy_to_host()[:r])
        assert planned[r].plan.offsets == {k: big.offsets[k] for k in planned[r].plan.offsets}
    for g in list(planned.values()) + list(private.values()):
        g.close()
    tape.close()
