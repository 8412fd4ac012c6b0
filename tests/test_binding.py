"""Input binding: the pure slot finder, bytes moved per mode, alias checks, patch on views."""
import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import address, device_copy, launch
from proto.graph import binding, default_executor
from proto.graph.binding import MODES, ReplayStats, Slot, input_slots
from tests.helpers import dev, rand
from tests.test_graph import (THREADS, axpy_kernel, blocks, count_launches, make_step,
                               run_replay)


# ------------------------------------------------------------------------- input_slots (pure)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=4),
       picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 63), st.integers(1, 64)),
                      max_size=8))
def test_input_slots_maps_arguments_inside_an_input(sizes, picks):
    # Inputs laid out at 1000-byte strides, gaps between them; arguments are byte ranges.
    inputs = {f"in{k}": (1000 * k, 1000 * k + size) for k, size in enumerate(sizes)}
    args, want = [], []
    for i, (k, start, length) in enumerate(picks):
        k = k % len(sizes)
        lo, hi = inputs[f"in{k}"]
        start = min(start, hi - lo - 1)
        end = min(lo + start + length, hi)
        args.append((i, lo + start, end))
        want.append(Slot(node=0, arg=i, name=f"in{k}", offset=start))
    args.append((len(picks), 500, 600))  # lies in a gap: reads no input
    assert input_slots([args], inputs) == want


def test_input_slots_rejects_an_argument_straddling_an_input_edge():
    with pytest.raises(ValueError, match="node 0 argument 2 overlaps input 'x' only in part"):
        input_slots([[(2, 90, 110)]], {"x": (100, 200)})
    assert input_slots([[], [(0, 100, 200)]], {"x": (100, 200)}) == [Slot(1, 0, "x", 0)]


def test_replay_stats_add_up():
    total = ReplayStats()
    total += ReplayStats(1, 8, 2e-6)
    total += ReplayStats(1, 0, 4e-6)
    assert (total.replays, total.bytes_copied) == (2, 8)
    assert total.bind_us_per_replay == pytest.approx(3.0)


# ------------------------------------------------------------------------- bytes and checks per mode
@pytest.mark.parametrize("mode", MODES)
def test_bytes_copied_per_mode(mode):
    n = 9
    rng = np.random.default_rng(0)
    with graph.capture(make_step(n), {"x": dev(rand(rng, n)), "y": dev(rand(rng, n))},
                       binding=mode) as g:
        assert g.stats == ReplayStats()  # capture's own runs are not counted
        for _ in range(3):
            run_replay(g, mode, rand(rng, n), rand(rng, n))
            stats = g.last_stats
            assert stats.bytes_copied == (2 * n * 4 if mode == "copy" else 0)
            assert stats.bind_s > 0
        assert g.stats.replays == 3
        assert g.stats.bytes_copied == (3 * 2 * n * 4 if mode == "copy" else 0)
        # Passing the placeholders themselves moves nothing in any mode.
        g.replay(**g.placeholders)
        assert g.last_stats.bytes_copied == 0


# ------------------------------------------------------------------------- live prefixes (copy)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_a_prefix_copy_moves_exactly_the_prefix(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1), label="axis")
    n = data.draw(st.integers(0, shape[axis]), label="n")
    rng = np.random.default_rng(len(shape) * 7 + n)
    src, old = rand(rng, *shape), rand(rng, *shape)
    dst = dev(old)
    device_copy(dst, dev(src), prefix=(axis, n))
    # Restated: an element moves iff its index along `axis` is below n.
    index = np.indices(shape)[axis]
    np.testing.assert_array_equal(dst.copy_to_host(), np.where(index < n, src, old))


def test_copy_binding_moves_only_the_live_prefix_and_counts_its_bytes():
    n, live = 9, 4
    rng = np.random.default_rng(1)
    with graph.capture(make_step(n), {"x": dev(rand(rng, n)), "y": dev(rand(rng, n))},
                       binding="copy") as g:
        old_x = g.placeholders["x"].copy_to_host()
        x, y = rand(rng, n), rand(rng, n)
        g.replay(live={"x": (0, live)}, x=dev(x), y=dev(y))
        assert g.last_stats.bytes_copied == live * 4 + n * 4
        np.testing.assert_array_equal(g.placeholders["x"].copy_to_host(),
                                      np.concatenate([x[:live], old_x[live:]]))
        np.testing.assert_array_equal(g.placeholders["y"].copy_to_host(), y)


@pytest.mark.parametrize("live, match", [
    ({"z": (0, 1)}, "'z' is not an input"),
    ({"x": (1, 1)}, "axis 1 is outside"),
    ({"x": (0, 10)}, "length 10 is outside"),
    ({"x": (0, -1)}, "length -1 is outside"),
    ({"x": 3}, r"expected \(axis, length\)"),
])
def test_bad_live_prefixes_are_refused_before_any_copy(live, match, monkeypatch):
    rng = np.random.default_rng(2)
    with graph.capture(make_step(9), {"x": dev(rand(rng, 9)), "y": dev(rand(rng, 9))}) as g:
        before = g.placeholders["x"].copy_to_host()
        launches = count_launches(g, monkeypatch)
        with pytest.raises((ValueError, TypeError), match=match):
            g.replay(live=live, x=dev(rand(rng, 9)), y=dev(rand(rng, 9)))
        assert launches == []
        np.testing.assert_array_equal(g.placeholders["x"].copy_to_host(), before)


@pytest.mark.parametrize("name", ["live", "phase"])
def test_an_input_named_like_an_argument_of_replay_is_refused_at_capture(name):
    with pytest.raises(ValueError, match=f"'{name}' names an argument of replay"):
        graph.capture(lambda **kw: None, {name: dev(np.zeros(4, np.float32))})


def test_alias_rejects_an_array_that_is_not_the_placeholder():
    n = 5
    x_ph, y_ph = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    with graph.capture(make_step(n), {"x": x_ph, "y": y_ph}, binding="alias") as g:
        same_values = dev(np.ones(n, np.float32))  # equal contents, other address
        want = f"{address(x_ph):#x}"
        with pytest.raises(ValueError, match=rf"'x': alias binding needs the graph's placeholder "
                                             rf"itself \(device address {want}\), got a different"):
            g.replay(x=same_values, y=y_ph)
        x_view = x_ph[:]  # a view of the placeholder starts at its address: accepted
        g.replay(x=x_view, y=y_ph)
        assert g.last_stats.bytes_copied == 0


def test_patch_rebinds_views_at_offsets_and_skips_unchanged_inputs(monkeypatch):
    # A kernel that reads x through a slice (offset 4 bytes) and a reshape (offset 0).
    n = 12
    out = dev(np.zeros(n - 1, np.float32))

    def fn(x):
        flat = x.reshape(n)  # (R, C) -> (n,)
        launch(axpy_kernel, blocks(n - 1), THREADS, (3.0, flat[1:], flat[:-1], out))
        return out

    x_ph = dev(np.zeros((3, 4), np.float32))
    with graph.capture(fn, {"x": x_ph}, binding="patch", executor=default_executor()) as g:
        assert g.slots == [Slot(0, 1, "x", 4), Slot(0, 2, "x", 0)]
        calls = []
        real = g._executables[0].set_array_args
        monkeypatch.setattr(g._executables[0], "set_array_args",
                            lambda j, args: (calls.append((j, sorted(args))), real(j, args)))
        x = np.arange(n, dtype=np.float32).reshape(3, 4)
        dx = dev(x)
        g.replay(x=dx)
        g.replay(x=dx)  # same array again: nothing to rewrite
        assert calls == [(0, [1, 2])]  # one update per node, both slots at once
        flat = x.reshape(n)
        np.testing.assert_array_equal(out.copy_to_host(), 3 * flat[1:] + flat[:-1])
        np.testing.assert_array_equal(x_ph.copy_to_host(), 0)  # the placeholder was never written
        g.replay(x=x_ph)  # back to the placeholder
        np.testing.assert_array_equal(out.copy_to_host(), 0)


def test_patch_keeps_the_bound_input_alive_until_rebound():
    # The graph reads the caller's array in place, so it must outlive the caller's reference.
    n = 6
    with graph.capture(make_step(n), {"x": dev(np.zeros(n, np.float32)),
                                      "y": dev(np.zeros(n, np.float32))}, binding="patch") as g:
        x = dev(np.ones(n, np.float32))
        alive = weakref.ref(x)
        g.replay(x=x, y=g.placeholders["y"])
        del x
        gc.collect()
        assert alive() is not None
        g.replay(**g.placeholders)  # rebound: the old input may go
        gc.collect()
        assert alive() is None


def test_binder_rejects_unknown_mode():
    with pytest.raises(ValueError, match=r"binding: expected one of \('copy', 'patch', 'alias'\)"):
        binding.Binder("borrow", {}, [], None)


def test_driver_stream_takes_the_default_stream_and_both_kinds_of_numba_handle():
    import ctypes
    import types
    from proto.device.backend import driver_stream
    assert int(driver_stream(0)) == 0 and int(driver_stream(None)) == 0
    assert int(driver_stream(types.SimpleNamespace(handle=12345))) == 12345
    assert int(driver_stream(types.SimpleNamespace(handle=ctypes.c_void_p(678)))) == 678
    assert int(driver_stream(types.SimpleNamespace(handle=ctypes.c_void_p(None)))) == 0
