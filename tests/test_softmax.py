"""masked_softmax and log_softmax against float64 references: irregular widths, every length
from the device (including 0 and past the end), huge logits, -inf entries, in place,
validation before launch."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import softmax as S
from kernels._reduce import WARP_ELEMS
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(rows=st.integers(1, 5), cols=st.integers(1, 70), data=st.data(),
       seed=st.integers(0, 2**16))
def test_masked_softmax_matches_reference(rows, cols, data, seed, scale):
    cols *= scale
    length = data.draw(st.integers(-2, cols + 3), label="length")
    x = rand(np.random.default_rng(seed), rows, cols, scale=5.0)
    out = cuda.device_array_like(x)
    S.masked_softmax(dev(x), dev(np.array([length], np.int32)), out)
    assert_close(out, S.masked_softmax_ref(x, length), "softmax")


@given(rows=st.integers(1, 3), extra=st.integers(1, 40), data=st.data(), seed=st.integers(0, 2**16))
def test_masked_softmax_past_the_register_rows_matches_reference(rows, extra, data, seed):
    """Rows longer than a block holds in registers (ELEMS_PER_THREAD a thread of the widest
    block) take the online kernel: both kernels are checked."""
    cols = S.ELEMS_PER_THREAD * S.MAX_THREADS + extra
    length = data.draw(st.integers(-2, cols + 3), label="length")
    x = rand(np.random.default_rng(seed), rows, cols, scale=5.0)
    out = cuda.device_array_like(x)
    S.masked_softmax(dev(x), dev(np.array([length], np.int32)), out)
    assert_close(out, S.masked_softmax_ref(x, length), "softmax")


@pytest.mark.parametrize("cols", sorted({c for e in WARP_ELEMS for c in (32 * e - 1, 32 * e, 32 * e + 1)}))
def test_masked_softmax_at_each_warp_width_and_past_it(cols):
    """Rows up to 32 * E take a warp each (E values a lane), wider ones the block kernels; 5
    rows leave the second block of 4 warps three without a row."""
    rng = np.random.default_rng(cols)
    x = rand(rng, 5, cols, scale=5.0)
    for length in (cols, cols - 1, 1, 0, cols + 7):
        out = cuda.device_array_like(x)
        S.masked_softmax(dev(x), dev(np.array([length], np.int32)), out)
        assert_close(out, S.masked_softmax_ref(x, length), "softmax")


def test_one_launch_config_serves_every_length():
    """The length is read on the device: changing it needs no new launch arguments."""
    x = rand(np.random.default_rng(5), 2, 9)
    dx, length, out = dev(x), dev(np.zeros(1, np.int32)), cuda.device_array((2, 9), np.float32)
    for n in (9, 4, 1, 0):
        length.copy_to_device(np.array([n], np.int32))
        S.masked_softmax(dx, length, out)
        assert_close(out, S.masked_softmax_ref(x, n), "softmax")


@given(rows=st.integers(1, 5), cols=st.integers(1, 70), shift=st.sampled_from([0.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_log_softmax_is_stable_for_large_logits(rows, cols, shift, seed, scale):
    # exp(1e4) overflows float32: only the subtracted row max keeps the result finite.
    x = rand(np.random.default_rng(seed), rows, cols * scale, scale=5.0) + np.float32(shift)
    out = cuda.device_array_like(x)
    S.log_softmax(dev(x), out)
    # At 1e4, float32 x itself is only good to ~1e-3 absolute, and so is x - max.
    atol = 2e-3 if shift else 1e-5
    np.testing.assert_allclose(out.copy_to_host(), S.log_softmax_ref(x), atol=atol, rtol=1e-4)


def test_minus_inf_entries_and_in_place():
    x = np.array([[0.0, -np.inf, 1.0, 2.0], [-np.inf, 3.0, -np.inf, 3.0]], np.float32)
    dx = dev(x)
    S.log_softmax(dx, dx)
    assert_close(dx, S.log_softmax_ref(x), "softmax")
    dx = dev(x)
    S.masked_softmax(dx, dev(np.array([3], np.int32)), dx)
    got = dx.copy_to_host()
    assert_close(got, S.masked_softmax_ref(x, 3), "softmax")
    assert got[0, 1] == 0.0 and np.all(got[:, 3] == 0.0)


def test_rejects_bad_input_before_launch():
    x = dev(np.ones((2, 5), np.float32))
    with pytest.raises(TypeError, match="length: expected dtype int32"):
        S.masked_softmax(x, dev(np.ones(1, np.int64)), x)
    with pytest.raises(TypeError, match="length: expected a device array"):
        S.masked_softmax(x, np.ones(1, np.int32), x)
    with pytest.raises(ValueError, match=r"length: expected shape \(1,\)"):
        S.masked_softmax(x, dev(np.ones(2, np.int32)), x)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5\)"):
        S.log_softmax(x, dev(np.ones((2, 4), np.float32)))
    with pytest.raises(ValueError, match="C-contiguous"):
        S.log_softmax(dev(np.ones((2, 10), np.float32))[:, ::2], x)
    np.testing.assert_array_equal(x.copy_to_host(), 1.0)  # nothing ran


def test_a_nan_in_the_row_makes_the_row_nan_as_in_numpy():
    x = np.array([[1.0, np.nan, 2.0, 3.0, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]], np.float32)
    out = cuda.device_array_like(x)
    S.masked_softmax(dev(x), dev(np.array([4], np.int32)), out)
    want = S.masked_softmax_ref(x, 4)
    assert np.isnan(want[0, :4]).all() and want[0, 4] == 0.0   # past the length: 0
    assert_close(out, want, "softmax")                          # NaN where NaN
    S.log_softmax(dev(x), out)
    assert_close(out, S.log_softmax_ref(x), "softmax")


@given(rows=st.integers(1, 5), cols=st.integers(513, 1500), seed=st.integers(0, 2**16),
       poison=st.sampled_from(["none", "-inf", "nan", "all -inf"]))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_long_rows_split_over_blocks_match_reference_and_repeat_bit_for_bit(rows, cols, seed,
                                                                            poison, scale):
    """Rows as long as a vocabulary (the beam search's 5 x 50257) are scanned by several
    blocks and combined; the result is NumPy's, NaN and -inf rows included, in place too,
    and the same bits every run."""
    cols *= scale
    rng = np.random.default_rng(seed)
    x = rand(rng, rows, cols, scale=5.0)
    if poison == "-inf":
        x[0, rng.integers(0, cols, 3)] = -np.inf
    elif poison == "nan":
        x[rows - 1, rng.integers(0, cols)] = np.nan
    elif poison == "all -inf":
        x[0] = -np.inf
    want = S.log_softmax_ref(x)
    out, again = cuda.device_array_like(x), cuda.device_array_like(x)
    S.log_softmax(dev(x), out)
    S.log_softmax(dev(x), again)
    got = out.copy_to_host()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=1e-5, rtol=1e-4)
    np.testing.assert_array_equal(got.view(np.uint32), again.copy_to_host().view(np.uint32))
    inplace = dev(x)
    S.log_softmax(inplace, inplace)
    np.testing.assert_array_equal(inplace.copy_to_host().view(np.uint32), got.view(np.uint32))


def test_rows_of_more_spans_than_a_warp_has_lanes_combine_them_all():
    """A row's span partials are combined by a warp, a lane a span; a longer row (here 3
    spans more than 32) gives some lanes two: NumPy's result, and beam_topk (which shares
    the combine) ranks its bits."""
    from kernels import sampling
    spans = 32 + 3
    cols = spans * S.SPAN - 5
    rng = np.random.default_rng(4)
    x = rand(rng, 1, cols, scale=5.0)
    out = cuda.device_array_like(x)
    S.log_softmax(dev(x), out)
    got = out.copy_to_host()
    np.testing.assert_allclose(got, S.log_softmax_ref(x), atol=1e-5, rtol=1e-4)
    values = cuda.device_array((1, 4), np.float32)
    indices = cuda.device_array((1, 4), np.int32)
    sampling.beam_topk(dev(x), dev(np.zeros((1, 1), np.float32)), 4, values, indices)
    want_v, want_i = sampling.topk_ref(got, 4)
    np.testing.assert_array_equal(indices.copy_to_host(), want_i)
    np.testing.assert_array_equal(values.copy_to_host(), want_v)


def test_a_captured_long_row_log_softmax_replays_the_eager_bits(scale):
    """In a graph the split's two scratch arrays are planned temporaries: a replay on new
    logits gives what an eager call gives."""
    from proto import graph
    rng = np.random.default_rng(3)
    x = dev(rand(rng, 5, 700 * scale, scale=5.0))
    out = cuda.device_array_like(x)
    g = graph.capture(lambda x: S.log_softmax(x, out), {"x": x}, binding="alias")
    fresh = rand(rng, 5, 700 * scale, scale=5.0)
    x.copy_to_device(fresh)
    g.replay(x=x)
    want = cuda.device_array_like(x)
    S.log_softmax(dev(fresh), want)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint32),
                                  want.copy_to_host().view(np.uint32))
    g.close()
