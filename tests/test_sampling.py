import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import sampling
from proto import backend
from proto.backend import cuda
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


def test_launch_configuration_depends_on_shape_only():
    """The grids come from (R, V) alone, so a graph captured once replays for any scores."""
    class Recorder:
        def __init__(self):
            self.launches = []

        def record_launch(self, kernel, griddim, blockdim, args, sharedmem, stream=0):
            self.launches.append((kernel, griddim, blockdim))

    def record(seed):
        x = dev(np.random.default_rng(seed).standard_normal((2, 300)).astype(np.float32))
        values, indices = cuda.device_array((2, 4), np.float32), cuda.device_array((2, 4), np.int32)
        with backend.recording(Recorder()) as rec:
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
