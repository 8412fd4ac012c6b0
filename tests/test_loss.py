import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import loss as xent
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(B=st.integers(1, 6), V=st.integers(1, 70), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1.0, 30.0]))
def test_softmax_xent_matches_reference(B, V, seed, spread, scale):
    rng = np.random.default_rng(seed)
    logits = rand(rng, B, V * scale, scale=spread)    # spread 30: exp() would overflow unshifted
    labels = rng.integers(0, V * scale, B).astype(np.int32)
    loss, dlogits = cuda.device_array(1, np.float32), cuda.device_array((B, V * scale), np.float32)
    xent.softmax_xent(dev(logits), dev(labels), loss, dlogits)
    ref_loss, ref_d = xent.softmax_xent_ref(logits, labels)
    # float32 exp/log of shifted logits: ~1e-6 relative; the loss sums B such terms.
    np.testing.assert_allclose(loss.copy_to_host()[0], ref_loss, rtol=1e-5, atol=1e-5)
    assert_close(dlogits, ref_d, "softmax")
    assert abs(dlogits.copy_to_host().sum()) < 1e-5 * B   # each row of softmax - onehot sums to 0


def test_uniform_logits_give_log_classes():
    loss, d = cuda.device_array(1, np.float32), cuda.device_array((3, 10), np.float32)
    xent.softmax_xent(dev(np.zeros((3, 10), np.float32)), dev(np.int32([0, 4, 9])), loss, d)
    assert np.isclose(loss.copy_to_host()[0], np.log(10), rtol=1e-6)


def test_rejects_bad_input_before_launch():
    logits, loss = dev(np.zeros((2, 5), np.float32)), dev(np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="labels: expected dtype int32"):
        xent.softmax_xent(logits, dev(np.zeros(2, np.int64)), loss, logits)
    with pytest.raises(ValueError, match=r"loss: expected shape \(1,\)"):
        xent.softmax_xent(logits, dev(np.zeros(2, np.int32)), dev(np.zeros(2, np.float32)), logits)
    with pytest.raises(ValueError, match=r"dlogits: expected shape \(2, 5\)"):
        xent.softmax_xent(logits, dev(np.zeros(2, np.int32)), loss, dev(np.zeros((2, 4), np.float32)))


def test_labels_outside_the_classes_give_nan_never_a_finite_loss():
    """Labels live on the device: -1 or >= V cannot be refused before the launch, so the loss
    and that row's gradient are NaN (the rule of kernels/__init__.py), as in the reference."""
    rng = np.random.default_rng(0)
    logits = rand(rng, 3, 5)
    for bad in (-1, 5, 2**31 - 1):
        labels = np.int32([1, bad, 4])
        loss, d = cuda.device_array(1, np.float32), cuda.device_array((3, 5), np.float32)
        xent.softmax_xent(dev(logits), dev(labels), loss, d)
        ref_loss, ref_d = xent.softmax_xent_ref(logits, labels)
        assert np.isnan(loss.copy_to_host()[0]) and np.isnan(ref_loss)
        got = d.copy_to_host()
        assert np.isnan(got[1]).all() and np.isnan(ref_d[1]).all()
        assert_close(got[[0, 2]], ref_d[[0, 2]], "softmax")   # the other rows are unharmed


def test_a_nan_logit_makes_its_row_and_the_loss_nan():
    """The row max may skip a NaN (max() is fmaxf on the GPU) but the sum of exp cannot."""
    logits = np.zeros((2, 5), np.float32)
    logits[1, 3] = np.nan
    labels = np.int32([0, 1])
    loss, d = cuda.device_array(1, np.float32), cuda.device_array((2, 5), np.float32)
    xent.softmax_xent(dev(logits), dev(labels), loss, d)
    ref_loss, ref_d = xent.softmax_xent_ref(logits, labels)
    assert np.isnan(loss.copy_to_host()[0]) and np.isnan(ref_loss)
    np.testing.assert_array_equal(np.isnan(d.copy_to_host()), np.isnan(ref_d))
