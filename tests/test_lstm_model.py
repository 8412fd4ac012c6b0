"""LSTM language model on the kernels against the NumPy float64 reference."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import gemm
from proto.models import reference
from proto.models.lstm import LSTMConfig, LSTMLM, LSTMState, load_state_dict, random_state_dict
from tests.helpers import dev

# float32 against float64 through <= 2 layers of saturating gates: errors seen ~1e-6 of
# unit-scale states, ~1e-5 of logits of size ~sqrt(n_hidden); 10x room.
STATE_TOL = dict(atol=1e-5, rtol=1e-4)
LOGIT_TOL = dict(atol=2e-4, rtol=2e-4)


@settings(max_examples=3)  # ~3 s per simulated example
@given(n_layer=st.integers(1, 2), n_embd=st.integers(3, 12), n_hidden=st.integers(3, 12),
       vocab=st.integers(11, 40), batch=st.integers(1, 3), steps=st.integers(1, 3),
       sum_in_cell=st.booleans(), seed=st.integers(0, 2**16))
def test_steps_match_reference(n_layer, n_embd, n_hidden, vocab, batch, steps, sum_in_cell,
                               seed):
    """Either way of summing the gate GEMMs: each GEMM's reduction, or the cell summing
    both GEMMs' K-split partials (LSTMLM's sum_in_cell)."""
    _steps_match_reference(n_layer, n_embd, n_hidden, vocab, batch, steps, seed,
                           sum_in_cell=sum_in_cell)


def _steps_match_reference(n_layer, n_embd, n_hidden, vocab, batch, steps, seed, **variants):
    config = LSTMConfig(n_layer, n_embd, n_hidden, vocab)
    sd = random_state_dict(config, seed)
    seq = np.random.default_rng(seed).integers(0, vocab, (batch, steps))
    want, (h, c) = reference.lstm_logits(config, sd, seq)
    model = LSTMLM(config, sd, max_batch=batch + 1, **variants)  # a batch below the maximum
    state = LSTMState(config, batch)
    for t in range(steps):
        logits = model.step(dev(seq[:, t].astype(np.int32)), state)
        np.testing.assert_allclose(logits.copy_to_host(), want[:, t], **LOGIT_TOL)
    for k in range(n_layer):
        np.testing.assert_allclose(state.h[k].copy_to_host(), h[k], **STATE_TOL)
        np.testing.assert_allclose(state.c[k].copy_to_host(), c[k], **STATE_TOL)


@pytest.mark.parametrize("sum_in_cell", [False, True])
def test_a_batch_past_the_decode_rows_matches_reference(sum_in_cell):
    """Batch 10: the gate GEMMs take the tiled kernel (past gemm.DECODE_MAX_M rows); with
    the skinny tiles, the first layer's input GEMM is one tile, so the simulator's plan splits
    its K (256: 2 splits on the GPU and here), and the cell sums partials of more than one split."""
    assert gemm.split_count(10, 4 * 8, 256, trans_b=True, skinny=True) > 1
    _steps_match_reference(2, 256, 8, 17, 10, 2, seed=3, sum_in_cell=sum_in_cell,
                           skinny_tiles=True)


def test_reference_continues_from_a_state():
    """The reference's (h, c) carry a sequence on: two halves equal the whole."""
    config = LSTMConfig(2, 5, 7, 13)
    sd = random_state_dict(config, 4)
    seq = np.random.default_rng(4).integers(0, 13, (2, 5))
    whole, _ = reference.lstm_logits(config, sd, seq)
    first, state = reference.lstm_logits(config, sd, seq[:, :2])
    second, _ = reference.lstm_logits(config, sd, seq[:, 2:], state)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, rtol=1e-12)


def test_rejects_bad_state_dict_and_input():
    config = LSTMConfig(2, 5, 7, 13)
    sd = random_state_dict(config, 0)
    with pytest.raises(ValueError, match=r"missing 1 key.*lstm\.bias_hh_l1"):
        load_state_dict(config, {k: v for k, v in sd.items() if k != "lstm.bias_hh_l1"})
    with pytest.raises(ValueError, match=r"weight_ih_l1.*expected shape \(28, 7\), got \(28, 5\)"):
        load_state_dict(config, {**sd, "lstm.weight_ih_l1": np.zeros((28, 5), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected.*lstm\.weight_ih_l2"):
        load_state_dict(config, {**sd, "lstm.weight_ih_l2": np.zeros((28, 7), np.float32)})
    model = LSTMLM(config, sd, max_batch=2)
    with pytest.raises(ValueError, match=r"batch\).*at most 2"):
        model.step(dev(np.zeros(3, np.int32)), LSTMState(config, 3))
    with pytest.raises(ValueError, match="state: expected an LSTMState .* batch 2"):
        model.step(dev(np.zeros(2, np.int32)), LSTMState(config, 1))
    with pytest.raises(TypeError, match="tokens: expected a device array"):
        model.step(np.zeros(2, np.int32), LSTMState(config, 2))
