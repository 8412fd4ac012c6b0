"""gemm against its float64 NumPy reference: both kernel families (decode for M <= 8, tiled
above), every flag combination, batched calls, the aliasing rules, and validation before
any launch."""
import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import gemm as G
from proto import backend
from proto.backend import cuda
from tests.helpers import assert_close, dev, rand

FLAGS = list(itertools.product([False, True], [False, True], [None, "gelu", "relu"],
                               [False, True], [False, True]))  # trans_a, trans_b, act, bias, acc


def _check_gemm(rng, batch, m, n, k, trans_a, trans_b, act, has_bias, accumulate):
    """Run gemm on random inputs of the given shape and flags; compare with gemm_ref."""
    lead = () if batch is None else (batch,)
    a = rand(rng, *lead, *((k, m) if trans_a else (m, k)))
    b = rand(rng, *lead, *((n, k) if trans_b else (k, n)))
    old = rand(rng, *lead, m, n)
    bias = rand(rng, n) if has_bias else None
    out = dev(old)
    G.gemm(dev(a), dev(b), out, bias=None if bias is None else dev(bias), act=act,
           trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    # A float32 sum of k unit-variance products accumulated in sequence has rounding error
    # of std ~ 3e-8 * k / sqrt(2) (eps/2 times the partial sums' size, sqrt(i) at step i);
    # 2e-7 * k is ~9 of those, and at k = 1600 (the GPU lane) still well under the sum's
    # own size ~ 40.
    np.testing.assert_allclose(
        out.copy_to_host(),
        G.gemm_ref(a, b, bias, act, trans_a, trans_b, old=old if accumulate else None),
        atol=1e-5 + 2e-7 * k, rtol=1e-4)


@pytest.mark.parametrize("trans_a,trans_b,act,has_bias,accumulate", FLAGS)
def test_every_flag_combination_on_both_kernel_families(trans_a, trans_b, act, has_bias,
                                                        accumulate, scale):
    rng = np.random.default_rng(FLAGS.index((trans_a, trans_b, act, has_bias, accumulate)))
    for m in (3, 9 * scale):  # 3 rows take a decode kernel, more than 8 the tiled one
        _check_gemm(rng, None, m, 5 * scale, 7 * scale, trans_a, trans_b, act, has_bias,
                    accumulate)


@given(m=st.integers(1, 12), n=st.integers(1, 12), k=st.integers(1, 100),
       batch=st.sampled_from([None, 1, 3]), flags=st.sampled_from(FLAGS),
       seed=st.integers(0, 2**16))
def test_matches_reference_on_irregular_shapes(m, n, k, batch, flags, seed, scale):
    # k up to 100 crosses the simulator's 64-wide K chunk (the decode kernels' multi-chunk
    # path) and their unrolled main loop; m stays <= 8 where drawn so to keep the decode path.
    m = m if m <= G.DECODE_MAX_M else m * scale
    _check_gemm(np.random.default_rng(seed), batch, m, n * scale, k * scale, *flags)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_decode_kernels_across_k_chunks(trans_a, trans_b):
    """K longer than two shared-memory chunks: x is restaged per chunk and the unrolled
    main loop runs inside every chunk (KC is 64 on the simulator, 768 on a GPU)."""
    _check_gemm(np.random.default_rng(7), None, 3, 5, 2 * G.KC + 41, trans_a, trans_b,
                "gelu", True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [True, False])
def test_decode_gpt2_output_projection(trans_b):
    """The headline shape: 5 beams x d=768 against GPT-2's 50257-token embedding."""
    rng = np.random.default_rng(0)
    x = rand(rng, 5, 768)
    w = rand(rng, 50257, 768) if trans_b else rand(rng, 768, 50257)
    out = cuda.device_array((5, 50257), np.float32)
    G.gemm(dev(x), dev(w), out, trans_b=trans_b)
    assert_close(out, G.gemm_ref(x, w, trans_b=trans_b), "gemm")


def test_bias_may_alias_an_input():
    rng = np.random.default_rng(1)
    a, b = rand(rng, 4, 6), rand(rng, 6, 5)
    db = dev(b)
    out = cuda.device_array((4, 5), np.float32)
    G.gemm(dev(a), db, out, bias=db[0], act="relu")  # bias is b's first row, read-only
    assert_close(out, G.gemm_ref(a, b, b[0], "relu"), "gemm")


class _LaunchRecorder:
    def __init__(self):
        self.launches = []

    def record_launch(self, *args):
        self.launches.append(args)


def _raises_before_launch(exc, match, **kwargs):
    """gemm(**kwargs) raises `exc` matching `match`, and nothing reached the GPU first."""
    recorder = _LaunchRecorder()
    with backend.recording(recorder), pytest.raises(exc, match=match):
        G.gemm(**kwargs)
    assert recorder.launches == []


def test_out_must_not_overlap_an_input():
    sq = dev(np.ones((4, 4), np.float32))
    other = dev(np.ones((4, 4), np.float32))
    _raises_before_launch(ValueError, "out overlaps a", a=sq, b=other, out=sq)
    _raises_before_launch(ValueError, "out overlaps b", a=other, b=sq, out=sq)
    buf = dev(np.ones((8, 4), np.float32))  # out a view into the rows of b
    _raises_before_launch(ValueError, "out overlaps b", a=dev(np.ones((4, 8), np.float32)),
                          b=buf, out=buf[4:])


def test_rejects_bad_input_before_launch():
    a, b = dev(np.ones((3, 4), np.float32)), dev(np.ones((4, 5), np.float32))
    out = cuda.device_array((3, 5), np.float32)
    ok = dict(a=a, b=b, out=out)
    _raises_before_launch(TypeError, "a: expected a device array",
                          **{**ok, "a": np.ones((3, 4), np.float32)})
    _raises_before_launch(TypeError, "b: expected dtype float32",
                          **{**ok, "b": dev(np.ones((4, 5), np.float64))})
    _raises_before_launch(ValueError, r"b: expected op\(b\) of shape \(4, \*\)",
                          **{**ok, "b": dev(np.ones((6, 5), np.float32))})
    _raises_before_launch(ValueError, r"out: expected shape \(3, 5\)",
                          **{**ok, "out": cuda.device_array((3, 6), np.float32)})
    _raises_before_launch(ValueError, "C-contiguous",
                          **{**ok, "a": dev(np.ones((3, 8), np.float32))[:, ::2]})
    _raises_before_launch(ValueError, "act: expected one of",
                          **ok, act="tanh")
    _raises_before_launch(ValueError, r"bias: expected shape \(5,\)",
                          **ok, bias=dev(np.ones(4, np.float32)))
    _raises_before_launch(ValueError, "all 2-D or all 3-D",
                          **{**ok, "a": dev(np.ones((1, 3, 4), np.float32))})
    _raises_before_launch(ValueError, r"b: expected op\(b\).* with batch \(2,\)",
                          a=dev(np.ones((2, 3, 4), np.float32)),
                          b=dev(np.ones((1, 4, 5), np.float32)),
                          out=cuda.device_array((2, 3, 5), np.float32))
