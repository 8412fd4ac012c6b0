"""embed against its reference: with and without positions, pos0 read on the device,
out-of-range ids as NaN rows, validation before launch."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import embedding as E
from proto.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(batch=st.integers(1, 3), steps=st.integers(1, 5), width=st.integers(1, 40),
       vocab=st.integers(1, 30), positions=st.sampled_from(["none", "default", "pos0"]),
       data=st.data(), seed=st.integers(0, 2**16))
def test_matches_reference(batch, steps, width, vocab, positions, data, seed, scale):
    rng = np.random.default_rng(seed)
    width, vocab = width * scale, vocab * scale
    tokens = rng.integers(0, vocab, (batch, steps)).astype(np.int32)
    wte, wpe = rand(rng, vocab, width), rand(rng, steps + 6, width)
    pos0 = data.draw(st.integers(0, 6), label="pos0") if positions == "pos0" else 0
    out = cuda.device_array((batch, steps, width), np.float32)
    E.embed(dev(tokens), dev(wte), out, wpe=None if positions == "none" else dev(wpe),
            pos0=dev(np.array([pos0], np.int32)) if positions == "pos0" else None)
    want = E.embed_ref(tokens, wte, None if positions == "none" else wpe, pos0)
    assert_close(out, want, "elementwise")


def test_out_of_range_ids_and_positions_give_nan_rows():
    rng = np.random.default_rng(2)
    wte, wpe = rand(rng, 4, 3), rand(rng, 3, 3)
    tokens = np.array([[0, 4, -1, 3]], np.int32)  # ids 4 and -1 are outside the table
    out = cuda.device_array((1, 4, 3), np.float32)
    E.embed(dev(tokens), dev(wte), out)
    got = out.copy_to_host()
    assert np.isnan(got[0, 1:3]).all() and not np.isnan(got[0, [0, 3]]).any()
    one = cuda.device_array((1, 1, 3), np.float32)
    E.embed(dev(tokens[:, :1]), dev(wte), one, wpe=dev(wpe),
            pos0=dev(np.array([3], np.int32)))  # position 3 is past wpe's 3 rows
    assert np.isnan(one.copy_to_host()).all()
    np.testing.assert_array_equal(
        np.isnan(E.embed_ref(tokens, wte)), np.isnan(got))


def test_rejects_bad_input_before_launch():
    tok = dev(np.zeros((1, 2), np.int32))
    wte = dev(np.ones((5, 3), np.float32))
    out = dev(np.ones((1, 2, 3), np.float32))
    with pytest.raises(TypeError, match="tokens: expected dtype int32"):
        E.embed(dev(np.zeros((1, 2), np.int64)), wte, out)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 3\)"):
        E.embed(tok, wte, dev(np.ones((1, 2, 4), np.float32)))
    with pytest.raises(ValueError, match=r"wpe: expected shape \('\*', 3\)"):
        E.embed(tok, wte, out, wpe=dev(np.ones((4, 2), np.float32)))
    with pytest.raises(ValueError, match="pos0: given without wpe"):
        E.embed(tok, wte, out, pos0=dev(np.zeros(1, np.int32)))
    with pytest.raises(TypeError, match="wte: expected a device array"):
        E.embed(tok, np.ones((5, 3), np.float32), out)
    np.testing.assert_array_equal(out.copy_to_host(), 1.0)  # nothing ran
