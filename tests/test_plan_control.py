"""The memory planner with control flow: every node that reads a temporary keeps it alive,
conditional nodes reading their flag included (simulator lane; the walk executor replays the
same description a CUDA graph would).

The reference is the program run eagerly (no graph, no planner) and the same graph with
every temporary in private memory: a planned graph must give their results for any program.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import cuda, empty, jit, launch
from proto.graph import plan as planner
from proto.graph.plan import Block, Plan, PlanError
from tests.helpers import dev
from tests.test_plan import add_kernel, scale_kernel

N = 4   # elements of every temporary: one thread each


@jit("void(float32[::1], float32[::1])", writes=("acc",))
def acc_kernel(acc, x):
    i = cuda.grid(1)
    if i < acc.size:
        acc[i] += x[i]


@jit("void(float32[::1], int32[::1])", writes=("flag",))
def positive_flag_kernel(x, flag):
    """flag := x[0] > 0 (one thread)."""
    if cuda.grid(1) == 0:
        flag[0] = 1 if x[0] > 0 else 0


@jit("void(int32[::1], int32[::1], int32)", writes=("counter", "flag"))
def start_count_kernel(counter, flag, n):
    if cuda.grid(1) == 0:
        counter[0] = n
        flag[0] = 1 if n > 0 else 0


@jit("void(int32[::1], int32[::1])", writes=("counter", "flag"))
def tick_kernel(counter, flag):
    if cuda.grid(1) == 0:
        counter[0] -= 1
        flag[0] = 1 if counter[0] > 0 else 0


# ------------------------------------------------------------------------- one program, by hand
def flag_overwritten_program(x):
    """The flag is a temporary written first; a temporary written after it (zeros: x * 0) is
    free to take the flag's bytes unless the IF's read of the flag keeps it alive."""
    flag = empty(1, np.int32, "flag")
    launch(positive_flag_kernel, 1, 1, (x, flag))
    zeros = empty(N, np.float32, "zeros")
    launch(scale_kernel, 1, N, (x, zeros, np.float32(0)))
    out = empty(N, np.float32, "out")
    launch(scale_kernel, 1, N, (x, out, np.float32(1)))
    graph.if_then(flag, lambda: launch(acc_kernel, 1, N, (out, zeros)) or
                  launch(scale_kernel, 1, N, (x, out, np.float32(10))))
    return out


@pytest.mark.parametrize("control", ["conditional", "predicated"])
@pytest.mark.parametrize("nested", [False, True])
def test_an_if_reading_a_planned_flag_runs_its_body_as_eagerly(control, nested):
    go = dev(np.ones(1, np.int32))

    def fn(x):
        if not nested:
            return flag_overwritten_program(x)
        held = []
        graph.if_then(go, lambda: held.append(flag_overwritten_program(x)))
        return held[0]
    x = dev(np.full(N, 2.0, np.float32))
    want = fn(x).copy_to_host()                          # eagerly: the body runs
    np.testing.assert_array_equal(want, 20.0)
    with graph.capture(fn, {"x": x}, warmup=0, control=control) as g:
        flag_key = next(b for b in g.plan.blocks if b.key[1] == "flag")
        if_step = flag_key.last
        np.testing.assert_array_equal(g.replay(x=x).copy_to_host(), want)
    # the flag lives until the IF reads it: past the kernels that write the other temporaries
    assert if_step >= 2


# ------------------------------------------------------------------------- any program
def _ops(depth):
    leaf = st.one_of(
        st.tuples(st.just("scale"), st.integers(0, 9), st.sampled_from([-1.0, 0.0, 0.5, 2.0])),
        st.tuples(st.just("add"), st.integers(0, 9), st.integers(0, 9)))
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3)
    inner = _ops(depth - 1)
    node = st.one_of(leaf, st.tuples(st.just("if"), st.integers(0, 9), inner),
                     st.tuples(st.just("while"), st.integers(0, 3), inner))
    return st.lists(node, min_size=1, max_size=4)


class Program:
    """A random program over temporaries: each op makes a new temporary from earlier ones
    (scale or add), an IF's flag is a temporary computed from an earlier one (another
    temporary is written before the IF reads it), a WHILE counts down a temporary counter;
    the result is the sum of every temporary made at top level."""

    def __init__(self, ops):
        self.ops = ops

    def __call__(self, x):
        base = empty(N, np.float32, "base")     # (bodies add into temporaries, never into x)
        launch(scale_kernel, 1, N, (x, base, np.float32(1)))
        self.made, self.top = [base], 0
        self._run(self.ops, "")
        out = empty(N, np.float32, "sum")
        launch(scale_kernel, 1, N, (x, out, np.float32(0)))
        for t in self.made[:self.top + 1]:
            launch(acc_kernel, 1, N, (out, t))
        return out

    def _pick(self, i):
        return self.made[i % len(self.made)]

    def _run(self, ops, where):
        for j, op in enumerate(ops):
            name = f"{where}{j}"
            if op[0] == "scale":
                t = empty(N, np.float32, f"t{name}")
                launch(scale_kernel, 1, N, (self._pick(op[1]), t, np.float32(op[2])))
                self.made.append(t)
            elif op[0] == "add":
                t = empty(N, np.float32, f"t{name}")
                launch(add_kernel, 1, N, (self._pick(op[1]), self._pick(op[2]), t))
                self.made.append(t)
            elif op[0] == "if":
                flag = empty(1, np.int32, f"flag{name}")
                launch(positive_flag_kernel, 1, 1, (self._pick(op[1]), flag))
                # a temporary between the flag's write and the IF (zeros: a flag it
                # overwrote would read false)
                pad = empty(N, np.float32, f"pad{name}")
                launch(scale_kernel, 1, N, (self.made[0], pad, np.float32(0)))
                graph.if_then(flag, lambda body=op[2], n=name: self._body(body, n))
            else:
                counter, flag = (empty(1, np.int32, f"{k}{name}") for k in ("counter", "flag"))
                launch(start_count_kernel, 1, 1, (counter, flag, np.int32(op[1])))
                graph.while_loop(flag, lambda body=op[2], n=name, c=counter, f=flag: (
                    self._body(body, n), launch(tick_kernel, 1, 1, (c, f))), max_passes=4)
            if where == "":
                self.top = len(self.made) - 1

    def _body(self, body, name):
        # a body's temporaries are its own (what follows must not read one that an untaken IF
        # never wrote): what it makes is added into the last temporary made before it
        seen = len(self.made)
        self._run(body, name + "_")
        into = self.made[seen - 1]
        for t in self.made[seen:]:
            launch(acc_kernel, 1, N, (into, t))
        del self.made[seen:]


@given(ops=_ops(2), sign=st.sampled_from([-1.0, 1.0]), control=st.sampled_from(
    ["conditional", "predicated"]))
def test_planned_programs_with_ifs_and_loops_over_temporaries_match_private_and_eager(
        ops, sign, control):
    program = Program(ops)
    x = dev(np.array([sign, 0.5, -0.25, 1.0], np.float32))
    want = program(x).copy_to_host()
    planned = graph.capture(program, {"x": x}, warmup=0, control=control)
    private = graph.capture(program, {"x": x}, warmup=0, planned=False, control=control)
    try:
        planner.validate(planned.plan)
        np.testing.assert_array_equal(private.replay(x=x).copy_to_host(), want)
        np.testing.assert_array_equal(planned.replay(x=x).copy_to_host(), want)
    finally:
        planned.close()
        private.close()


# ------------------------------------------------------------------------- plans themselves
def test_validate_refuses_a_lifetime_that_ends_before_it_starts_and_apply_validates():
    with pytest.raises(PlanError, match="not a span"):
        planner.validate(Plan((Block("a", 5, 2, 16),), {"a": 0}, 256))
    with pytest.raises(PlanError, match="negative size"):
        planner.validate(Plan((Block("a", 0, 2, -1),), {"a": 0}, 256))
    # apply() checks the plan it is given before it moves anything onto the arena
    x = dev(np.ones(N, np.float32))
    with graph.record(private=False) as rec:
        t = empty(N, np.float32, "t")
        launch(scale_kernel, 1, N, (x, t, np.float32(1)))
    desc = rec.description()
    key = desc.buffers[0].key
    arena = cuda.device_array(512, np.uint8)
    overlapping = Plan((Block(key, 0, 0, 16), Block("other", 0, 0, 16)), {key: 0, "other": 0}, 512)
    with pytest.raises(PlanError, match="alive at once"):
        planner.apply(desc, overlapping, arena, t)
    with pytest.raises(PlanError, match="the plan needs 1024"):
        planner.apply(desc, Plan((Block(key, 0, 0, 16),), {key: 0}, 1024), arena, t)


def test_a_zero_size_temporary_gets_bytes_of_its_own():
    """Eagerly an empty temporary is a buffer of its own; planned, it must not sit on the
    bytes of a live one (a kernel given both is checked for overlapping writes)."""
    def fn(x):
        z = empty(0, np.float32, "empty")
        out = empty(N, np.float32, "out")
        launch(add_kernel, 1, N, (x, x, out))
        launch(scale_kernel, 1, N, (out, z, np.float32(3)))   # writes nothing: z is empty
        return out
    x = dev(np.ones(N, np.float32))
    want = fn(x).copy_to_host()
    with graph.capture(fn, {"x": x}, warmup=0) as g:
        np.testing.assert_array_equal(g.replay(x=x).copy_to_host(), want)
        offsets = {k[1]: off for k, off in g.plan.offsets.items()}
        assert offsets["empty"] != offsets["out"]
    offsets, arena = planner.place([Block("z", 0, 3, 0), Block("a", 0, 3, 100)])
    assert offsets["z"] != offsets["a"] and arena == 2 * planner.ALIGN


def test_place_refuses_a_bad_alignment():
    for bad in (0, -256, 2.5, True):
        with pytest.raises(ValueError, match="align: expected a positive number of bytes"):
            planner.place([Block("a", 0, 1, 8)], align=bad)
