"""embed against its reference: with and without positions, pos0 read on the device,
out-of-range ids as NaN rows, validation before launch."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import embedding as E
from proto.device.backend import cuda
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


@given(batch=st.integers(1, 3), steps=st.integers(1, 3), width=st.integers(1, 40),
       offset=st.sampled_from([0.0, 100.0]), seed=st.integers(0, 2**16))
def test_ln_out_normalizes_each_embedded_row(batch, steps, width, offset, seed, scale):
    """GPT-2's first layer norm in the embedding's launch: out as without it, y its row-wise
    layer norm; an out-of-range id's row is NaN in both (widths past one thread's share of
    a row, and rows with a large mean, which a one-pass variance gets wrong)."""
    from kernels.layernorm import layernorm_ref
    rng = np.random.default_rng(seed)
    width = min(width * scale, E.LN_COLS * E.MAX_THREADS)
    vocab = 9
    tokens = rng.integers(0, vocab, (batch, steps)).astype(np.int32)
    tokens[0, 0] = vocab   # out of range: a NaN row
    wte = (rand(rng, vocab, width) + np.float32(offset)).astype(np.float32)
    wpe = rand(rng, steps + 3, width)
    gamma, beta = rand(rng, width), rand(rng, width)
    out = cuda.device_array((batch, steps, width), np.float32)
    y = dev(np.full((batch, steps, width), -7.0, np.float32))
    E.embed(dev(tokens), dev(wte), out, wpe=dev(wpe), pos0=dev(np.array([2], np.int32)),
            ln_out=(dev(gamma), dev(beta), 1e-5, y))
    want = E.embed_ref(tokens, wte, wpe, 2)
    assert_close(out, want, "elementwise")
    got_y = y.copy_to_host()
    assert np.isnan(got_y[0, 0]).all()
    want_y = layernorm_ref(want.reshape(-1, width), gamma, beta).reshape(want.shape)
    ok = ~np.isnan(want).any(axis=-1)
    np.testing.assert_allclose(got_y[ok], want_y[ok], atol=1e-3 if offset else 2e-5, rtol=1e-4)


def test_ln_out_rejects_bad_input_before_launch():
    tokens, wte = dev(np.zeros((1, 2), np.int32)), dev(np.zeros((5, 4), np.float32))
    out, y = cuda.device_array((1, 2, 4), np.float32), cuda.device_array((1, 2, 4), np.float32)
    g = dev(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="ln_out: expected"):
        E.embed(tokens, wte, out, ln_out=(g, g, 1e-5))
    with pytest.raises(ValueError, match=r"ln_out y: expected shape \(1, 2, 4\)"):
        E.embed(tokens, wte, out, ln_out=(g, g, 1e-5, cuda.device_array((2, 4), np.float32)))
    with pytest.raises(ValueError, match="ln_out eps"):
        E.embed(tokens, wte, out, ln_out=(g, g, 0.0, y))
    with pytest.raises(ValueError, match="overlap"):
        E.embed(tokens, wte, out, ln_out=(g, g, 1e-5, out))


# ---------------------------------------------------------------------------- half precision
# Float16 tables: the row wte[t] + wpe[p] is summed in float32 (exact to 2^-24 of it) and
# rounded once to float16 as it is stored (2^-11 of the result, 2^-25 below the normal range).
# The fused layer norm normalizes the float32 sum, not the rounded row: its bound is
# layernorm's in half precision (tests/test_layernorm.py), restated here.
U16, U32 = 2.0 ** -11, 2.0 ** -24


@given(batch=st.integers(1, 3), steps=st.integers(1, 4), width=st.integers(1, 40),
       with_ln=st.booleans(), seed=st.integers(0, 2**16))
def test_half_precision_rounds_once(batch, steps, width, with_ln, seed, scale):
    rng = np.random.default_rng(seed)
    width, vocab = width * scale, 7
    tokens = rng.integers(0, vocab, (batch, steps)).astype(np.int32)
    tokens[0, 0] = vocab   # an id past the table: a NaN row, in half precision too
    wte = rng.standard_normal((vocab, width)).astype(np.float16)
    wpe = rng.standard_normal((steps + 2, width)).astype(np.float16)
    gamma, beta = (rng.standard_normal(width).astype(np.float16) for _ in range(2))
    out = dev(np.zeros((batch, steps, width), np.float16))
    y = dev(np.zeros((batch, steps, width), np.float16))
    E.embed(dev(tokens), dev(wte), out, wpe=dev(wpe), pos0=dev(np.array([2], np.int32)),
            ln_out=(dev(gamma), dev(beta), 1e-5, y) if with_ln else None)
    got = out.copy_to_host()
    assert got.dtype == np.float16 and np.isnan(got[0, 0]).all()
    ok = np.ones((batch, steps), bool)
    ok[0, 0] = False
    want = wte[np.where(ok, tokens, 0)].astype(np.float64) + wpe[2:2 + steps].astype(np.float64)
    err = np.abs(got.astype(np.float64) - want) - ((U16 + U32) * np.abs(want) + 2.0 ** -25)
    assert np.all(err[ok] <= 0), float(err[ok].max())
    if with_ln:
        mean = want.mean(axis=-1, keepdims=True)
        sigma = np.sqrt(((want - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
        xh = (want - mean) / sigma
        g, b = np.abs(gamma.astype(np.float64)), np.abs(beta.astype(np.float64))
        ln = xh * gamma.astype(np.float64) + beta.astype(np.float64)
        e = 4 * width * U32 * (np.abs(want).max(axis=-1, keepdims=True) / sigma + 1) * (1 + np.abs(xh))
        bound = g * e + 2 * U32 * (g * np.abs(xh) + b) + U16 * np.abs(ln) + 2.0 ** -25
        err = np.abs(y.copy_to_host().astype(np.float64) - ln) - bound
        assert np.all(err[ok] <= 0), float(err[ok].max())


def test_half_and_single_precision_do_not_mix():
    tokens = dev(np.zeros((1, 1), np.int32))
    h, f = dev(np.zeros((2, 3), np.float16)), dev(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="out: expected dtype float16, got float32"):
        E.embed(tokens, h, dev(np.zeros((1, 1, 3), np.float32)))
    with pytest.raises(TypeError, match="wpe: expected dtype float32, got float16"):
        E.embed(tokens, f, dev(np.zeros((1, 1, 3), np.float32)), wpe=h)
    with pytest.raises(TypeError, match="ln_out gamma: expected dtype float16"):
        E.embed(tokens, h, dev(np.zeros((1, 1, 3), np.float16)),
                ln_out=(dev(np.ones(3, np.float32)), dev(np.ones(3, np.float16)), 1e-5,
                        dev(np.zeros((1, 1, 3), np.float16))))
