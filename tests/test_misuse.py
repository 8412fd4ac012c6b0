"""Misuse a new user would try: each gets a clear early error that names what is wrong,
never a silently wrong answer or an exception from deep inside NumPy, Numba or the driver."""
import functools
import math
import re

import numpy as np
import pytest

from kernels import _check
from proto import graph
from proto.device.backend import cuda, jit, launch
from proto.models import checked_params, vgg
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.tape import TensorSpec
from proto.vm import Executor, Link, PagingExecutor, PlanError, plan, validate
from proto.vm.paging import PageTable
from proto.vm.pool import DevicePool
from proto.vm.synthetic import cnn_tape
from tests.helpers import dev


# ---------------------------------------------------------------------------- numbers
def test_numpy_scalars_are_numbers_and_bools_strings_floats_are_not():
    assert _check.positive("n", np.int64(3)) == 3 and type(_check.positive("n", np.int32(3))) is int
    assert _check.integer("pad", np.uint8(0), at_least=0) == 0
    assert _check.number("eps", np.float32(1e-5), positive=True) == pytest.approx(1e-5)
    assert _check.number("lr", np.int64(0), at_least=0) == 0.0
    for bad in (True, np.bool_(True), 1.5, np.float64(2.0), "3", None, 0, -2):
        with pytest.raises(ValueError, match=r"n: expected a positive integer, got .*\("):
            _check.positive("n", bad)
    for bad in (True, "1e-5", None, math.nan, math.inf, 0.0, -1):
        with pytest.raises(ValueError, match="eps: expected a positive number"):
            _check.number("eps", bad, positive=True)
    with pytest.raises(ValueError, match="k: expected at most 8, got 9"):
        _check.positive("k", np.int64(9), at_most=8)


# ---------------------------------------------------------------------------- weights
def _shapes():
    return {"w": (2, 3), "b": (3,)}


def _state(**over):
    return {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32), **over}


@pytest.mark.parametrize("bad, where", [(np.nan, "(1, 2)"), (np.inf, "(1, 2)"), (-np.inf, "(1, 2)"),
                                        (1e39, "(1, 2)")])   # 1e39 is inf as float32
def test_non_finite_weights_are_refused_naming_the_tensor_unless_allowed(bad, where):
    w = np.ones((2, 3), np.float64)
    w[1, 2] = bad
    with pytest.raises(ValueError, match=r"M state_dict\['w'\]: 1 non-finite value\(s\) as "
                                         rf"float32, first at {re.escape(where)}.*allow_nonfinite"):
        checked_params(_shapes(), _state(w=w), what="M")
    params = checked_params(_shapes(), _state(w=w), what="M", allow_nonfinite=True)
    assert not np.isfinite(params["w"][1, 2]) and params["w"].dtype == np.float32


def test_non_numeric_weights_are_refused_naming_the_tensor():
    for value in ("0.5", np.array(["a", "b", "c"]), np.array([object()] * 3), None):
        with pytest.raises(ValueError, match=r"M state_dict\['b'\]: expected a numeric array"):
            checked_params(_shapes(), _state(b=value), what="M")


def test_a_model_with_nan_weights_does_not_load():
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    sd = random_state_dict(config, 0)
    sd["transformer.h.0.attn.c_attn.weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"GPT-2 state_dict\['transformer.h.0.attn.c_attn.weight'\]"):
        GPT2(config, sd, max_batch=1, max_tokens=1)


def test_vgg_config_and_batch_are_checked():
    cfg = vgg.VGGConfig(depth=np.int64(11), batch=np.int64(2), image_size=32, width=np.float32(0.0625),
                        num_classes=10, hidden=np.int32(8), lr=np.float32(0.1))
    assert type(cfg.batch) is int and type(cfg.lr) is float and cfg.depth == 11
    for field, bad, message in (("batch", True, "batch: expected a positive integer"),
                                ("batch", 2.0, "batch: expected a positive integer"),
                                ("lr", math.nan, "lr: expected a finite number"),
                                ("momentum", -0.1, "momentum: expected a number >= 0"),
                                ("depth", "16", "depth: expected one of"),
                                ("image_size", 32.0, "image_size: expected a positive integer")):
        with pytest.raises(ValueError, match=message):
            vgg.VGGConfig(**{"depth": 11, "image_size": 32, field: bad})
    images = np.zeros((2, 3, 32, 32), np.float32)
    state = vgg.random_state_dict(cfg)
    with pytest.raises(ValueError, match="labels: expected 2 integer class indices"):
        vgg.initial_values(cfg, state, images, np.array([1.7, 2.0]))   # would truncate to 1
    with pytest.raises(ValueError, match="images: non-finite"):
        vgg.initial_values(cfg, state, np.full_like(images, np.nan), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"momentum state_dict: missing"):
        vgg.initial_values(cfg, state, images, np.array([1, 2]), momentum={})


# ---------------------------------------------------------------------------- memory policies
def test_budgets_and_bandwidths_are_checked_before_they_can_mislead():
    tape, _ = cnn_tape(256, "cc")
    for budget in (math.nan, 0, -1, 1.5e6, "1000000", True):
        with pytest.raises(ValueError, match="budget: expected a positive integer"):
            DevicePool(budget, 256)
        with pytest.raises(ValueError, match="budget: expected a positive integer"):
            PagingExecutor(tape, budget, page_bytes=256)
        with pytest.raises(ValueError, match="budget: expected a positive integer"):
            plan(tape, budget)
    with pytest.raises(ValueError, match="page_bytes: expected a positive integer"):
        PageTable(1 << 20, 1 << 20, page_bytes=0)
    assert plan(tape, np.int64(plan(tape).arena_bytes)).arena_bytes > 0   # NumPy bytes count
    for h2d in (0, -1.0, math.nan, math.inf, "54e9"):
        with pytest.raises(ValueError, match="Link.h2d: expected a positive number"):
            Link(h2d=h2d)
    with pytest.raises(ValueError, match="lookahead: expected a positive integer"):
        plan(tape, lookahead=1.5)
    with pytest.raises(ValueError, match=r"op_seconds\[1\] \(.*\): expected a finite number"):
        plan(tape, op_seconds=[1e-3, math.nan] + [1e-3] * (len(tape.ops) - 2))
    p = plan(tape)
    p.budget = math.nan      # every comparison with NaN is False: nothing would be enforced
    with pytest.raises(PlanError, match="plan.budget: expected a positive integer"):
        validate(tape, p)


def test_a_closed_executor_says_so():
    tape, init = cnn_tape(256, "c")
    ex = Executor(tape, plan(tape))
    ex.load(init)
    ex.step()
    ex.close()
    ex.close()   # twice is harmless
    for use in (ex.step, lambda: ex.load(init), lambda: ex.read("loss"), ex.capture):
        with pytest.raises(RuntimeError, match="this executor is closed"):
            use()
    pool = DevicePool(512, 512)
    pool.close()
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.alloc(TensorSpec("a", (4,), "activation"), 0)


def test_state_never_loaded_is_an_error_not_garbage():
    """Persistent tensors the step reads before writing (inputs, parameters, optimizer
    state: here the weight c0.w) must be loaded: the arena holds whatever was there before.
    VGG's momentum ("state") is such a tensor too: its sgd op reads it first."""
    tape, init = cnn_tape(256, "c")
    assert "c0.w" in tape.ops[tape.uses("c0.w")[0]].reads
    assert "c0.dw" not in tape.ops[tape.uses("c0.dw")[0]].reads   # written first: no need
    for policy in (lambda: Executor(tape, plan(tape)),
                   lambda: PagingExecutor(tape, plan(tape).arena_bytes, page_bytes=256)):
        with policy() as ex:
            ex.load({"x": init["x"]})
            with pytest.raises(RuntimeError, match=r"never loaded, first: \['c0.w'\]"):
                ex.step()
            with pytest.raises(RuntimeError, match="never loaded"):
                ex.read("c0.w")
            ex.load({"c0.w": init["c0.w"]})
            ex.step()
    cfg = vgg.VGGConfig(depth=11, width=1 / 16, image_size=32, batch=2, num_classes=10, hidden=8)
    tape = vgg.build_tape(cfg)
    momentum = next(n for n, t in tape.tensors.items() if t.kind == "state")
    assert momentum in tape.ops[tape.uses(momentum)[0]].reads


def test_a_tape_refuses_what_it_would_misread():
    from proto.tape import Op, Tape
    x = TensorSpec("x", (4,), "input")
    y = TensorSpec("y", (4,), "activation")

    def run(arrays, stream):
        pass

    for bad, message in ((dict(reads="x"), r"reads: expected a tuple of tensor names, got 'x'"),
                         (dict(writes=["y"]), "writes: expected a tuple of tensor names"),
                         (dict(phase="fwd"), "phase must be one of"),
                         (dict(run=None), "run must be callable")):
        op = dict(name="f", phase="forward", reads=("x",), writes=("y",), run=run) | bad
        with pytest.raises(ValueError, match=message):
            Tape({"x": x, "y": y}, [Op(**op)])
    with pytest.raises(ValueError, match="shape must be a tuple of positive integers"):
        TensorSpec("z", (0, 3), "activation")
    with pytest.raises(ValueError, match="kind must be one of"):
        TensorSpec("z", (3,), "weights")
    assert TensorSpec("z", (np.int64(3),), "param").nbytes == 12


def test_executor_load_and_budget_fractions_name_the_problem():
    from proto.vm import Liveness
    tape, _ = cnn_tape(256, "c")
    with Executor(tape, plan(tape)) as ex, pytest.raises(ValueError, match="load: 'x' expected numbers"):
        ex.load({"x": np.array(["a"] * 256)})
    for frac in (math.nan, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"frac: expected a number in \[0, 1\]"):
            Liveness(tape).budget_between(frac)


def test_flags_and_callables_are_checked_before_anything_runs():
    """A string read as True, or a body never called because the flag was clear, would hide
    the mistake; each is refused naming the argument."""
    from kernels import gemm
    from proto import graph
    a, b, out = dev(np.ones((3, 4), np.float32)), dev(np.ones((4, 5), np.float32)), \
        dev(np.zeros((3, 5), np.float32))
    for name, value in (("trans_a", "yes"), ("trans_b", 1), ("accumulate", 1.5)):
        with pytest.raises(ValueError, match=f"{name}: expected True or False"):
            gemm.gemm(a, b, out, **{name: value})
    clear = dev(np.zeros(1, np.int32))
    for loop in (functools.partial(graph.while_loop, max_passes=2), graph.if_then):
        with pytest.raises(TypeError, match="body: expected a function of no arguments, got int"):
            loop(clear, 3)
    with pytest.raises(TypeError, match="fn: expected the function to capture, got int"):
        graph.capture(3, {"x": a})


def test_closed_graphed_models_overlapping_copies_and_pool_sizes_are_refused():
    """A closed graphed model would rebuild its graphs (or fail on a stale placeholder), an
    overlapping copy is undefined, and shared_executables=0 would be dropped on the walk."""
    from proto import graph
    from proto.models.graphed import GraphedDecoder, GraphedLSTM, lstm_greedy
    from proto.models.lstm import LSTMLM, LSTMConfig, random_state_dict as lstm_state_dict
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=8)
    model = GPT2(config, random_state_dict(config, seed=1), max_batch=2, max_tokens=8)
    g = GraphedDecoder(model, batch=2, max_len=4)
    g.close()
    with pytest.raises(RuntimeError, match="reset: this GraphedDecoder is closed"):
        g.greedy(np.ones((2, 2), np.int32), max_new_tokens=1)
    lc = LSTMConfig(n_layer=1, n_embd=4, n_hidden=4, vocab_size=11)
    lm = LSTMLM(lc, lstm_state_dict(lc, seed=1), max_batch=2)
    with pytest.raises(ValueError, match="shared_executables: expected a positive integer"):
        GraphedLSTM(lm, max_batch=2, shared_executables=0)
    gl = GraphedLSTM(lm, max_batch=2)
    gl.close()
    with pytest.raises(RuntimeError, match="step: this GraphedLSTM is closed"):
        gl.step(dev(np.zeros(2, np.int32)), 1)
    with pytest.raises(ValueError, match="tokens: 1 rows, fewer than the prompt's 2"):
        lstm_greedy(lambda t: None, dev(np.zeros(1, np.int32)), np.ones((2, 2), np.int32), 1,
                    vocab=11)
    x = dev(np.arange(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"copy: dst \(bytes .*\) overlaps src"):
        graph.copy(x[1:], x[:3])


def test_a_remembered_argument_check_still_refuses_other_requirements():
    """`_check.device_array` remembers an array object that passed (its metadata cannot
    change); the same object against another shape or dtype is still refused, every time,
    and a failure is never remembered as a pass."""
    x = dev(np.zeros((2, 3), np.float32))
    assert _check.device_array("x", x, shape=(2, 3)) is x
    assert _check.device_array("x", x, shape=(2, 3)) is x
    for _ in range(2):
        with pytest.raises(ValueError, match=r"x: expected shape \(3, 2\)"):
            _check.device_array("x", x, shape=(3, 2))
        with pytest.raises(TypeError, match="x: expected dtype int32"):
            _check.device_array("x", x, dtype=np.int32)


@jit("void(float32[::1], float32[::1])", writes=("out",))
def _double(x, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = 2 * x[i]


def test_capture_and_replay_name_the_argument_they_refuse():
    """Misuse a student would try: each error names the argument, before anything runs."""
    from proto.graph import plan as planner
    from proto.graph.predicate import MAX_UNROLL
    x = cuda.to_device(np.ones(4, np.float32))

    out = cuda.to_device(np.zeros(4, np.float32))

    def fn(x, **_):
        launch(_double, 1, 4, (x, out))
        return out
    with pytest.raises(TypeError, match=r"inputs: 'n': expected a device array .* got int"):
        graph.capture(fn, {"x": x, "n": 3})
    with pytest.raises(TypeError, match="tape: expected a proto.graph.Tape"):
        graph.capture(fn, {"x": x}, tape="tape")
    for bad in (0, MAX_UNROLL + 1, 2.5):
        with pytest.raises(ValueError, match="unroll: expected (a positive integer|at most 1024)"):
            graph.capture(fn, {"x": x}, unroll=bad)
    with pytest.raises(ValueError, match="align: expected a positive number of bytes"):
        planner.place([planner.Block("a", 0, 1, 8)], align=0)
    with graph.capture(fn, {"x": x}, warmup=0, binding="copy") as g:
        for live in ({"x": (0, 2.5)}, {"x": (0, True)}, {"x": 2}, [("x", (0, 2))]):
            with pytest.raises(TypeError, match=r"live"):
                g.replay(x=x, live=live)
    with pytest.raises(TypeError, match="max_passes"):
        graph.while_loop(cuda.to_device(np.zeros(1, np.int32)), lambda: None)   # no bound
