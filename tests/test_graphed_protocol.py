"""The generic graphed wrapper (proto.models.graphed.Graphed) serves any model that follows
its protocol: here a model that is neither GPT-2 nor the LSTM, a running sum over rows, under
every binding and shape strategy, against NumPy; and the wrapper's own contract (its
policies checked before anything is built, the input buffer each binding records on, closing).

The model: state `acc` (max_batch,) float32, updated in place; the producer writes `x`; a step
over the first `key` rows does acc += x and returns out = acc + acc, a temporary of the step
(so the memory planner places it)."""
import numpy as np
import pytest

from kernels import elementwise
from proto import shapes
from proto.device.backend import cuda, empty, leading
from proto.graph.binding import MODES
from proto.models.graphed import Graphed
from tests.helpers import dev


class RunningSum:
    """A model adapter: the protocol's `name`, `placeholders` and `recorded_step`."""

    name = "running-sum"

    def __init__(self, max_batch: int, binding: str, strategy: str, **kw):
        self.graphed = Graphed(self, binding=binding, strategy=strategy, max_length=max_batch,
                               dynamic=("x", "acc"), **kw)
        self.acc = dev(np.zeros(max_batch, np.float32))
        self.x = dev(np.zeros(max_batch, np.float32))        # the producer writes here
        self._x_ph = self.graphed.input_buffer(self.x)

    def placeholders(self, state_set, key):
        return {"x": leading(self._x_ph, key), "acc": leading(self.acc, key)}

    def recorded_step(self, key):
        def step(x, acc):
            elementwise.add(acc, x, acc)
            out = empty(acc.shape, np.float32, "out")
            elementwise.add(acc, acc, out)
            return out
        return step

    def step(self, batch: int):
        key = shapes.key_for(batch, self.graphed.keys)
        inputs = {"x": leading(self.x, key), "acc": leading(self.acc, key)}
        return leading(self.graphed.replay(0, batch, inputs), batch)


def served_rows(strategy: str, batch: int, max_batch: int) -> int:
    """The rows a step over `batch` rows computes (restated): exact its own, device all,
    bucket the next power of two (at most max_batch)."""
    if strategy == "exact":
        return batch
    if strategy == "device":
        return max_batch
    return min(1 << (batch - 1).bit_length(), max_batch)


@pytest.mark.parametrize("binding", MODES)
@pytest.mark.parametrize("strategy", shapes.STRATEGIES)
def test_a_third_model_runs_through_the_generic_wrapper(binding, strategy):
    max_batch, rng = 5, np.random.default_rng(3)
    model = RunningSum(max_batch, binding, strategy)
    want = np.zeros(max_batch, np.float32)
    try:
        for batch in (5, 3, 3, 1, 4, 2):
            x = rng.integers(-4, 5, max_batch).astype(np.float32)
            model.x.copy_to_device(x)
            got = model.step(batch).copy_to_host()
            rows = served_rows(strategy, batch, max_batch)
            want[:rows] += x[:rows]
            np.testing.assert_array_equal(got, 2 * want[:batch], err_msg=f"batch {batch}")
        np.testing.assert_array_equal(model.acc.copy_to_host(), want)
        keys = {served_rows(strategy, b, max_batch) for b in (5, 3, 1, 4, 2)}
        assert model.graphed.num_graphs == len(keys)
        assert model.graphed.arena_bytes > 0            # `out` was planned into the tape
    finally:
        model.graphed.close()


def test_the_input_buffer_is_the_producers_own_only_under_alias_binding():
    for binding in MODES:
        model = RunningSum(3, binding, "device")
        try:
            model.x.copy_to_device(np.array([7, 8, 9], np.float32))
            buf = model.graphed.input_buffer(model.x)
            if binding == "alias":
                assert buf is model.x
            else:   # a buffer of its own, holding the producer's values of the moment
                assert buf is not model.x
                np.testing.assert_array_equal(buf.copy_to_host(), [7, 8, 9])
        finally:
            model.graphed.close()


def test_policies_are_checked_before_anything_is_built():
    with pytest.raises(ValueError, match="binding"):
        RunningSum(3, "bind-somehow", "device")
    with pytest.raises(ValueError, match="strateg"):
        RunningSum(3, "alias", "sometimes")
    with pytest.raises(ValueError, match="shared_executables"):
        RunningSum(3, "alias", "device", shared_executables=0)
    with pytest.raises(ValueError, match="state_sets"):
        Graphed(RunningSum, binding="alias", strategy="device", max_length=3, state_sets=0)


def test_a_closed_wrapper_refuses_to_build_or_replay():
    model = RunningSum(2, "alias", "exact")
    model.step(2)
    model.graphed.close()
    assert model.graphed.num_graphs == 0
    for call in (lambda: model.step(1), lambda: model.graphed.build_all(),
                 model.graphed.launch_all):
        with pytest.raises(RuntimeError, match="closed"):
            call()
