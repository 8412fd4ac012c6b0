import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import lstm
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(B=st.integers(1, 6), H=st.integers(1, 50), gate_scale=st.sampled_from([1.0, 30.0]),
       in_place=st.booleans(), seed=st.integers(0, 2**16))
def test_lstm_cell_matches_reference(B, H, gate_scale, in_place, seed, scale):
    rng = np.random.default_rng(seed)
    H *= scale
    # gate_scale 30 saturates the sigmoids and tanh, where a naive exp overflows.
    gates, c_prev = rand(rng, B, 4 * H, scale=gate_scale), rand(rng, B, H)
    d_c = dev(c_prev)
    c_out = d_c if in_place else cuda.device_array((B, H), np.float32)
    h_out = cuda.device_array((B, H), np.float32)
    lstm.lstm_cell(dev(gates), d_c, h_out, c_out)
    want_h, want_c = lstm.lstm_cell_ref(gates, c_prev)
    # a few float32 transcendental ops per element: elementwise tolerance
    assert_close(c_out, want_c, "elementwise")
    assert_close(h_out, want_h, "elementwise")
    assert np.isfinite(h_out.copy_to_host()).all()


@given(S=st.integers(1, 5), n_bias=st.integers(0, 2), B=st.integers(1, 4),
       H=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_lstm_cell_sums_partials_and_biases(S, n_bias, B, H, seed, scale):
    """The gates as S partial products (the gate GEMMs' K splits) and the biases apart: the
    cell of their sum."""
    rng = np.random.default_rng(seed)
    H *= scale
    part, c_prev = rand(rng, S, B, 4 * H), rand(rng, B, H)
    biases = [rand(rng, 4 * H) for _ in range(n_bias)]
    h_out, c_out = cuda.device_array((B, H), np.float32), cuda.device_array((B, H), np.float32)
    lstm.lstm_cell(dev(part), dev(c_prev), h_out, c_out, biases=[dev(b) for b in biases])
    gates = part.astype(np.float64).sum(axis=0) + sum(b.astype(np.float64) for b in biases)
    want_h, want_c = lstm.lstm_cell_ref(gates, c_prev)
    # S + 2 float32 additions before the transcendental ops
    assert_close(c_out, want_c, "reduction")
    assert_close(h_out, want_h, "reduction")


def test_gate_order_is_pytorchs():
    """One gate block at a time saturated: i, f, g, o in PyTorch's order."""
    B, H, big = 1, 3, 50.0
    c_prev = np.full((B, H), 0.5, np.float32)
    gates = np.full((B, 4 * H), -big, np.float32)  # every sigmoid 0, tanh(g) -1
    gates[:, 0:H] = big        # i = 1
    gates[:, 3 * H:] = big     # o = 1
    h_out, c_out = cuda.device_array((B, H), np.float32), cuda.device_array((B, H), np.float32)
    lstm.lstm_cell(dev(gates), dev(c_prev), h_out, c_out)
    # c = f*c + i*g = 0*0.5 + 1*(-1) = -1; h = o*tanh(c) = tanh(-1)
    np.testing.assert_allclose(c_out.copy_to_host(), -1.0, atol=1e-6)
    np.testing.assert_allclose(h_out.copy_to_host(), np.tanh(-1.0), atol=1e-6)


def test_matches_torch_lstm_cell():
    torch = pytest.importorskip("torch")
    B, E, H = 3, 7, 11
    cell = torch.nn.LSTMCell(E, H).double()
    rng = np.random.default_rng(0)
    x, h, c = rng.standard_normal((B, E)), rng.standard_normal((B, H)), rng.standard_normal((B, H))
    p = {k: v.detach().numpy() for k, v in cell.state_dict().items()}
    gates = x @ p["weight_ih"].T + p["bias_ih"] + h @ p["weight_hh"].T + p["bias_hh"]
    h_out, c_out = cuda.device_array((B, H), np.float32), cuda.device_array((B, H), np.float32)
    lstm.lstm_cell(dev(gates.astype(np.float32)), dev(c.astype(np.float32)), h_out, c_out)
    want_h, want_c = cell(torch.from_numpy(x), (torch.from_numpy(h), torch.from_numpy(c)))
    # float32 kernel against float64 torch; gates of order 1 rounded to float32 first
    assert_close(h_out, want_h.detach().numpy(), "reduction")
    assert_close(c_out, want_c.detach().numpy(), "reduction")


def test_rejects_bad_input_before_launch():
    B, H = 2, 3
    gates, c = dev(np.zeros((B, 4 * H), np.float32)), dev(np.zeros((B, H), np.float32))
    h_out = cuda.device_array((B, H), np.float32)
    with pytest.raises(TypeError, match="gates: expected dtype float32"):
        lstm.lstm_cell(dev(np.zeros((B, 4 * H))), c, h_out, c)
    with pytest.raises(ValueError, match=r"gates: expected shape \(2, 12\)"):
        lstm.lstm_cell(dev(np.zeros((B, 3 * H), np.float32)), c, h_out, c)
    with pytest.raises(TypeError, match="c_prev: expected a device array"):
        lstm.lstm_cell(gates, np.zeros((B, H), np.float32), h_out, c)
    with pytest.raises(ValueError, match="output 'h_out' .* overlaps argument 'c_prev'"):
        lstm.lstm_cell(gates, c, c, c)
    with pytest.raises(ValueError, match="output 'h_out' .* overlaps argument 'gates'"):
        lstm.lstm_cell(gates, c, gates.reshape(B * 4 * H)[:B * H].reshape(B, H), c)
    with pytest.raises(ValueError, match=r"gates: expected shape \('\*', 2, 12\)"):
        lstm.lstm_cell(dev(np.zeros((3, B + 1, 4 * H), np.float32)), c, h_out, c)
    with pytest.raises(ValueError, match="biases: at most 2, got 3"):
        lstm.lstm_cell(gates, c, h_out, c, biases=[dev(np.zeros(4 * H, np.float32))] * 3)
    with pytest.raises(ValueError, match=r"biases\[1\]: expected shape \(12,\)"):
        lstm.lstm_cell(gates, c, h_out, c, biases=[dev(np.zeros(4 * H, np.float32)),
                                                  dev(np.zeros(4 * H + 1, np.float32))])
