import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import sampling
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import dev


@pytest.fixture
def small_blocks(monkeypatch):
    """On the simulator, 32-thread blocks: rows of a few hundred then span several stage-1
    blocks (and wrap around the grid-stride loop); 256-thread blocks would need thousands."""
    if backend.SIMULATOR:
        monkeypatch.setattr(sampling, "THREADS", 32)
        monkeypatch.setattr(sampling, "PER_THREAD", 4)
        monkeypatch.setattr(sampling, "MAX_BLOCKS", 3)


def _run_topk(x: np.ndarray, k: int):
    R = x.shape[0]
    values = cuda.device_array((R, k), np.float32)
    indices = cuda.device_array((R, k), np.int32)
    sampling.topk(dev(x), k, values, indices)
    return values.copy_to_host(), indices.copy_to_host()


@given(rows=st.integers(1, 3), cols=st.integers(1, 400), k=st.integers(1, 8),
       levels=st.sampled_from([2, 5, 1000]), seed=st.integers(0, 2**16))
def test_topk_matches_stable_sort_with_ties(rows, cols, k, levels, seed, scale, small_blocks):
    cols *= scale
    k = min(k, cols)
    # Few distinct values (levels) make ties common; they must go to the lower index.
    x = np.random.default_rng(seed).integers(0, levels, (rows, cols)).astype(np.float32)
    values, indices = _run_topk(x, k)
    want_values, want_indices = sampling.topk_ref(x, k)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)


@given(cols=st.integers(513, 3000), k=st.integers(1, 8), levels=st.sampled_from([2, 7, 1000]),
       seed=st.integers(0, 2**16))
def test_rows_longer_than_one_batch_of_the_grid_carry_the_top_k_across_trips(
        cols, k, levels, seed, monkeypatch):
    """Two blocks of 32 threads (host-side launch settings, on either backend) take a row of
    more than 2 x 32 x 8 elements in several trips of a batch each: each warp's running top
    k rides from trip to trip, so an entry of the first trip still wins against ties after."""
    monkeypatch.setattr(sampling, "THREADS", 32)
    monkeypatch.setattr(sampling, "MAX_BLOCKS", 2)
    x = np.random.default_rng(seed).integers(0, levels, (2, cols)).astype(np.float32)
    values, indices = _run_topk(x, k)
    want_values, want_indices = sampling.topk_ref(x, k)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)


@given(rows=st.integers(1, 3), cols=st.integers(1, 400), seed=st.integers(0, 2**16))
def test_argmax_matches_numpy_with_ties(rows, cols, seed, scale, small_blocks):
    x = np.random.default_rng(seed).integers(0, 4, (rows, cols * scale)).astype(np.float32)
    out = cuda.device_array(rows, np.int32)
    sampling.argmax(dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), np.argmax(x, axis=1))


def test_nan_and_infinities_rank_as_documented(small_blocks):
    x = np.array([[np.nan, -np.inf, 1.0, np.inf, np.nan, -np.inf, 1.0],
                  [np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan],
                  [-np.inf, -np.inf, np.nan, -np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    values, indices = _run_topk(x, 7)
    # NaN ranks as -inf: row 0 is inf(3), 1(2), 1(6), then the -inf/NaN entries by index.
    np.testing.assert_array_equal(indices[0], [3, 2, 6, 0, 1, 4, 5])
    np.testing.assert_array_equal(indices[1:], np.tile(np.arange(7), (2, 1)))
    np.testing.assert_array_equal(values[0, :3], [np.inf, 1.0, 1.0])
    assert np.all(values[0, 3:] == -np.inf) and np.all(values[1:] == -np.inf)
    out = cuda.device_array(3, np.int32)
    sampling.argmax(dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), [3, 0, 0])


def test_launch_configuration_depends_on_shape_only(monkeypatch):
    """The grids come from (R, V) alone, so a graph captured once replays for any scores."""
    class Recorder:
        def __init__(self):
            self.launches = []

        def record_launch(self, kernel, griddim, blockdim, args, sharedmem, stream=0):
            self.launches.append((kernel, griddim, blockdim))

    def record(seed):
        x = dev(np.random.default_rng(seed).standard_normal((2, 300)).astype(np.float32))
        values, indices = cuda.device_array((2, 4), np.float32), cuda.device_array((2, 4), np.int32)
        rec = Recorder()
        with monkeypatch.context() as m:      # launches go to the recorder, not the device
            m.setattr(backend, "_recorder", rec)
            sampling.topk(x, 4, values, indices)
        return rec.launches

    first = record(0)
    assert len(first) == 2 and first == record(1)


@pytest.mark.gpu
def test_topk_at_beam_search_size():
    """Beam 5 x GPT-2 vocab in one row, as beam search ranks it: many stage-1 blocks."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 5 * 50257)).astype(np.float32)
    x[0, 1000:1008] = 9.0  # a tie among the top 8 across block boundaries
    x[0, 251000] = 9.0
    values, indices = _run_topk(x, 8)
    want_values, want_indices = sampling.topk_ref(x, 8)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)


def test_rejects_bad_input_before_launch():
    x = dev(np.zeros((2, 10), np.float32))
    values, indices = cuda.device_array((2, 3), np.float32), cuda.device_array((2, 3), np.int32)
    with pytest.raises(TypeError, match="x: expected a device array"):
        sampling.topk(np.zeros((2, 10), np.float32), 3, values, indices)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        sampling.topk(dev(np.zeros((2, 10), np.float64)), 3, values, indices)
    with pytest.raises(ValueError, match="k: expected a positive integer"):
        sampling.topk(x, 0, values, indices)
    with pytest.raises(ValueError, match="k: expected at most 8"):
        sampling.topk(dev(np.zeros((2, 20), np.float32)), 9, values, indices)
    with pytest.raises(ValueError, match="k: expected at most 2"):
        sampling.topk(dev(np.zeros((2, 2), np.float32)), 3, values, indices)
    with pytest.raises(ValueError, match=r"values: expected shape \(2, 4\)"):
        sampling.topk(x, 4, values, indices)
    with pytest.raises(TypeError, match="indices: expected dtype int32"):
        sampling.topk(x, 3, values, cuda.device_array((2, 3), np.int64))
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        sampling.argmax(dev(np.zeros(10, np.float32)), cuda.device_array(1, np.int32))
    with pytest.raises(ValueError, match=r"out: expected shape \(2,\)"):
        sampling.argmax(x, cuda.device_array(3, np.int32))
    tall = cuda.device_array((65536, 1), np.float32)
    with pytest.raises(ValueError, match="x: 65536 rows exceed the grid limit 65535"):
        sampling.argmax(tall, cuda.device_array(65536, np.int32))
    with pytest.raises(ValueError, match="k: expected a positive integer, got True"):
        sampling.topk(x, True, cuda.device_array((2, 1), np.float32), cuda.device_array((2, 1), np.int32))


# ---------------------------------------------------------------------------- device-side guards
def _greedy_buffers(t: int, B: int = 2, capacity: int = 4):
    return dict(tokens=dev(np.full((B, 1), 3, np.int32)), pos=dev(np.int32([5])),
                out=dev(np.full((B, capacity), -7, np.int32)), done=dev(np.zeros(B, np.int32)),
                state=dev(np.int32([t, 99, -1])), flag=dev(np.int32([1])))


@pytest.mark.parametrize("t", [-1, 4, 2**31 - 1])
def test_greedy_advance_outside_its_buffer_writes_nothing_and_stops(t):
    """A step index outside out[:, 0:capacity] (state lives on the device, so the host cannot
    refuse it): no write anywhere (never Python's wrap-around for -1), flag 0, and
    state[0] = STEP_ERROR for the host to see."""
    d = _greedy_buffers(t)
    sampling.greedy_advance(d["tokens"], d["pos"], d["out"], d["done"], d["state"], d["flag"])
    assert (d["out"].copy_to_host() == -7).all() and (d["done"].copy_to_host() == 0).all()
    assert d["pos"].copy_to_host()[0] == 5 and d["flag"].copy_to_host()[0] == 0
    assert d["state"].copy_to_host().tolist() == [sampling.STEP_ERROR, 99, -1]


def _beam_buffers(beam=2, vocab=5, cap=4, length=2, indices=(0, 6, 1, 7)):
    k = len(indices)
    hist = np.arange(beam * cap, dtype=np.int32).reshape(beam, cap)
    return dict(
        values=dev(np.linspace(-1, -2, k, dtype=np.float32)[None]),
        indices=dev(np.array(indices, np.int32)[None]), vocab=vocab,
        scores=dev(np.zeros((beam, 1), np.float32)), tokens=dev(np.zeros((beam, 1), np.int32)),
        parents=dev(np.zeros(beam, np.int32)), hist_src=dev(hist),
        hist_dst=dev(np.full((beam, cap), -7, np.int32)), best=dev(np.float32([-np.inf])),
        best_hist=dev(np.full(cap, -7, np.int32)), best_meta=dev(np.int32([-1, 0, 0])),
        state=dev(np.int32([0, 9, -1, length, beam])), pos=dev(np.int32([3])),
        flag=dev(np.int32([1])), bad=dev(np.int32([0])))


def _beam_advance(d, floor=-1e30):
    sampling.beam_advance(*(d[n] for n in ("values", "indices", "vocab", "scores", "tokens",
                                           "parents", "hist_src", "hist_dst", "best", "best_hist",
                                           "best_meta", "state", "pos", "flag")),
                          floor=floor, bad=d["bad"])


def test_beam_advance_refuses_an_empty_vocabulary():
    for vocab in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="vocab: expected a positive integer"):
            _beam_advance({**_beam_buffers(), "vocab": vocab})


def test_beam_advance_refuses_more_candidates_than_topk_gives():
    with pytest.raises(ValueError, match=f"values: {sampling.KMAX + 1} candidates"):
        _beam_advance(_beam_buffers(indices=tuple(range(sampling.KMAX + 1))))


def test_beam_advance_with_a_full_history_writes_nothing_and_stops():
    d = _beam_buffers(cap=4, length=4)     # no column left for this step's token
    _beam_advance(d)
    assert (d["hist_dst"].copy_to_host() == -7).all() and (d["best_hist"].copy_to_host() == -7).all()
    assert d["flag"].copy_to_host()[0] == 0 and d["pos"].copy_to_host()[0] == 3
    assert d["state"].copy_to_host().tolist() == [sampling.STEP_ERROR, 9, -1, 4, 2]


def test_beam_advance_skips_candidates_that_name_no_beam():
    # beam 2 x vocab 5: indices 10 and -1 name no beam; 6 = beam 1 token 1, 1 = beam 0 token 1
    d = _beam_buffers(indices=(10, 6, -1, 1))
    _beam_advance(d)
    assert d["parents"].copy_to_host().tolist() == [1, 0]
    assert d["tokens"].copy_to_host()[:, 0].tolist() == [1, 1]
    np.testing.assert_array_equal(d["hist_dst"].copy_to_host()[:, :3], [[4, 5, 1], [0, 1, 1]])


def test_beam_histories_give_minus_one_for_a_parent_that_names_no_row():
    """Called alone with a corrupt parent (beam_choose never makes one): a row of -1 and the
    new token, never a read outside hist_src."""
    src = dev(np.arange(8, dtype=np.int32).reshape(2, 4))
    dst, best_hist = dev(np.full((2, 4), -7, np.int32)), dev(np.full(4, -7, np.int32))
    args = (src, dst, dev(np.int32([1, 99])), dev(np.int32([[3], [4]])), best_hist,
            dev(np.int32([-5, 0, 0])), dev(np.int32([1, 9, -1, 3, 2])))   # length 2, no best
    blocks, threads = 1, 32
    backend.launch(sampling.beam_histories_kernel, blocks, threads, args)
    np.testing.assert_array_equal(dst.copy_to_host(), [[4, 5, 3, -7], [-1, -1, 4, -7]])
    assert (best_hist.copy_to_host() == -7).all()


def _run_beam_topk(logits: np.ndarray, scores: np.ndarray, k: int):
    values = cuda.device_array((1, k), np.float32)
    indices = cuda.device_array((1, k), np.int32)
    sampling.beam_topk(dev(logits), dev(scores), k, values, indices)
    return values.copy_to_host()[0], indices.copy_to_host()[0]


@given(beams=st.integers(1, 5), spans=st.integers(2, 3), k=st.integers(1, 8),
       levels=st.sampled_from([3, 50, None]), seed=st.integers(0, 2**16))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_beam_topk_is_log_softmax_plus_scores_then_topk(beams, spans, k, levels, seed):
    """One beam-search step's candidates in two launches give exactly what log_softmax,
    adding each beam's score and topk over the beams x vocab row give (the float32 values
    bit for bit, ties to the lower flat index b * V + token): rows of several spans, as a
    vocabulary's, and few distinct logits (levels) so that ties are common."""
    from kernels import softmax
    rng = np.random.default_rng(seed)
    V = spans * softmax.SPAN - int(rng.integers(0, softmax.SPAN // 2))
    k = min(k, beams * V)
    logits = (rng.integers(0, levels, (beams, V)) if levels else
              rng.standard_normal((beams, V))).astype(np.float32)
    scores = rng.choice([0.0, -1.5, -3.25], (beams, 1)).astype(np.float32)
    logprobs = cuda.device_array((beams, V), np.float32)
    softmax.log_softmax(dev(logits), logprobs)           # the three-step way
    want_v, want_i = sampling.topk_ref((logprobs.copy_to_host() + scores).reshape(1, -1), k)
    values, indices = _run_beam_topk(logits, scores, k)
    np.testing.assert_array_equal(indices, want_i[0])
    np.testing.assert_array_equal(values, want_v[0])
    # and against float64 NumPy (values only: float32 rounding may reorder near-ties)
    ref_v, _ = sampling.beam_topk_ref(logits, scores, k)
    np.testing.assert_allclose(values, ref_v[0], rtol=1e-5, atol=1e-5)


def test_beam_topk_ranks_nan_as_minus_infinity_and_leaves_counters_clean():
    """A NaN row (a broken beam) never wins; the launch's counter is back at zero, so the
    next call (a second step) is right too."""
    from kernels import _lastblock, softmax
    rng = np.random.default_rng(4)
    V = 2 * softmax.SPAN + 3
    for _ in range(2):
        logits = rng.standard_normal((3, V)).astype(np.float32)
        logits[1] = np.nan
        scores = np.zeros((3, 1), np.float32)
        values, indices = _run_beam_topk(logits, scores, 4)
        assert not np.isin(indices // V, [1]).any() and np.isfinite(values).all()
        ref_v, ref_i = sampling.beam_topk_ref(logits, scores, 4)
        np.testing.assert_array_equal(indices, ref_i[0])
        assert not _lastblock._counters[-1].copy_to_host().any()


def test_two_beam_topks_that_could_run_at_once_are_a_race():
    """beam_topk's last block counts the launch's blocks on a shared device counter, so two
    launches unordered in a graph (different streams, no event between) would corrupt each
    other's count: the race check sees it, because the kernel declares the counters
    written. Ordered by an event, they are not a race."""
    from kernels import softmax
    from proto import graph
    rng = np.random.default_rng(13)
    V = 2 * softmax.SPAN + 3
    logits = dev(rng.standard_normal((3, V)).astype(np.float32))
    scores = dev(np.zeros((3, 1), np.float32))
    outs = [(cuda.device_array((1, 4), np.float32), cuda.device_array((1, 4), np.int32))
            for _ in range(2)]
    streams, done = [cuda.stream(), cuda.stream()], cuda.event()
    for ordered in (False, True):
        with graph.record() as rec:
            sampling.beam_topk(logits, scores, 4, *outs[0], stream=streams[0])
            if ordered:
                graph.record_event(done, streams[0])
                graph.wait_event(done, streams[1])
            sampling.beam_topk(logits, scores, 4, *outs[1], stream=streams[1])
        assert bool(graph.races(rec.description())) is not ordered


def test_beam_topk_rejects_bad_input_before_launch():
    logits, scores = dev(np.zeros((2, 10), np.float32)), dev(np.zeros((2, 1), np.float32))
    values, indices = cuda.device_array((1, 3), np.float32), cuda.device_array((1, 3), np.int32)
    with pytest.raises(ValueError, match=r"scores: expected shape \(2, 1\)"):
        sampling.beam_topk(logits, dev(np.zeros((2,), np.float32)), 3, values, indices)
    with pytest.raises(ValueError, match="k: expected"):
        sampling.beam_topk(logits, scores, 9, values, indices)
    with pytest.raises(ValueError, match=r"values: expected shape \(1, 3\)"):
        sampling.beam_topk(logits, scores, 3, cuda.device_array((2, 3), np.float32), indices)
    with pytest.raises(TypeError, match="indices: expected dtype int32"):
        sampling.beam_topk(logits, scores, 3, values, cuda.device_array((1, 3), np.float32))


# ---------------------------------------------------------------------------- half precision
# A float16 value converts to float32 exactly, and the kernels convert each as they load it:
# over float16 logits they must give, bit for bit, what they give over the same values stored
# as float32 (ties, NaN as -inf and the lower index included).
@given(rows=st.integers(1, 3), cols=st.integers(1, 300), k=st.integers(1, 8),
       levels=st.sampled_from([3, None]), seed=st.integers(0, 2**16))
def test_topk_of_half_precision_equals_topk_of_its_float32_values(rows, cols, k, levels, seed,
                                                                    scale, small_blocks):
    rng = np.random.default_rng(seed)
    cols *= scale
    k = min(k, cols)
    x = (rng.integers(0, levels, (rows, cols)) if levels else
         rng.standard_normal((rows, cols))).astype(np.float16)
    x[rng.random(x.shape) < 0.05] = np.nan
    values, indices = _run_topk(x, k)
    want_values, want_indices = _run_topk(x.astype(np.float32), k)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)


@given(beams=st.integers(1, 5), k=st.integers(1, 8), levels=st.sampled_from([3, None]),
       seed=st.integers(0, 2**16))
def test_beam_topk_of_half_precision_equals_beam_topk_of_its_float32_values(beams, k, levels,
                                                                            seed):
    from kernels import softmax
    rng = np.random.default_rng(seed)
    V = 2 * softmax.SPAN - int(rng.integers(0, softmax.SPAN // 2))   # two spans a row
    k = min(k, beams * V)
    logits = (rng.integers(0, levels, (beams, V)) if levels else
              4 * rng.standard_normal((beams, V))).astype(np.float16)
    scores = rng.choice([0.0, -1.5, -3.25], (beams, 1)).astype(np.float32)
    values, indices = _run_beam_topk(logits, scores, k)
    want_v, want_i = _run_beam_topk(logits.astype(np.float32), scores, k)
    np.testing.assert_array_equal(indices, want_i)
    np.testing.assert_array_equal(values, want_v)


def test_float64_logits_are_refused():
    with pytest.raises(TypeError, match="logits: expected dtype float32 or float16, got float64"):
        _run_beam_topk(np.zeros((2, 5)), np.zeros((2, 1), np.float32), 2)
    with pytest.raises(TypeError, match="x: expected dtype float32 or float16, got float64"):
        _run_topk(np.zeros((2, 5)), 2)
