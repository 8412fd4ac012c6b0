"""Predication (proto.device.backend.predicated, proto.graph.predicate): a predicated kernel whose
flag is false writes nothing; random nested IF/WHILE programs give the same result under
conditional nodes, predication (several unrolls) and the host loop, and the same as a plain
Python interpreter of the program (the reference, written independently here).

The simulator lane runs the walk executor (conditional: the host reads each flag) against
predication on the walk; the GPU lane adds real conditional nodes, predicated CUDA graphs and
host-driven graph segments.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import elementwise, layernorm, sampling, softmax
from proto.device import backend
from proto import graph
from proto.device.backend import cuda, jit, launch, predicated
from tests.helpers import dev

EXECUTORS = ["walk"] if backend.SIMULATOR else ["walk", "cuda"]


# ------------------------------------------------------------------------- a false flag writes nothing
def _launchers(rng):
    """(name, launcher call) pairs over small random inputs; each call launches kernels."""
    x = dev(rng.standard_normal((3, 17)).astype(np.float32))
    g, b = dev(np.ones(17, np.float32)), dev(np.zeros(17, np.float32))
    out = dev(np.zeros((3, 17), np.float32))
    idx = dev(np.zeros(3, np.int32))
    flat = dev(rng.standard_normal(40).astype(np.float32))
    flat_out = dev(np.zeros(40, np.float32))
    return [("add", lambda: elementwise.add(flat, flat, flat_out)),
            ("gelu", lambda: elementwise.gelu(flat, flat_out)),
            ("layernorm", lambda: layernorm.layernorm(x, g, b, out)),
            ("log_softmax", lambda: softmax.log_softmax(x, out)),
            ("argmax", lambda: sampling.argmax(x, idx))]


@pytest.mark.parametrize("which", range(5))
def test_a_predicated_kernel_whose_flag_is_false_writes_nothing(which):
    name, call = _launchers(np.random.default_rng(which))[which]
    with graph.record() as rec:
        call()
    off, on = dev(np.zeros(1, np.int32)), dev(np.ones(1, np.int32))
    for node in rec.nodes:
        twin = predicated(node.kernel)
        assert twin.params[0] == "pred" and twin.params[1:] == node.kernel.params
        written = [node.args[i] for i in node.kernel.writes]
        for arr in written:   # poison every output byte
            arr.copy_to_device(np.frombuffer(np.full(arr.nbytes, 0xAB, np.uint8).tobytes(),
                                             arr.dtype).reshape(arr.shape))
        before = [a.copy_to_host().tobytes() for a in written]
        launch(twin, node.griddim, node.blockdim, (off, *node.args))
        assert [a.copy_to_host().tobytes() for a in written] == before, name
        launch(twin, node.griddim, node.blockdim, (on, *node.args))
        got = [a.copy_to_host().copy() for a in written]
        launch(node.kernel, node.griddim, node.blockdim, node.args)   # the kernel itself
        for a, want in zip(got, [a.copy_to_host() for a in written]):
            np.testing.assert_array_equal(a, want, err_msg=name)


def test_predicated_twins_are_built_once_and_need_our_jit():
    add = elementwise.add_kernels[np.dtype(np.float32)]
    twin = predicated(add)
    assert predicated(add) is twin and twin.predicate_of is add
    with pytest.raises(TypeError, match="was not made by proto.device.backend.jit"):
        predicated(cuda.jit("void(float32[::1])")(lambda x: None))


# ------------------------------------------------------------------------- random programs
@jit("void(float32[::1], int32, float32)", writes=("acc",))
def add_at_kernel(acc, i, v):
    if cuda.grid(1) == 0:
        acc[i] += v


@jit("void(int32[::1], int32, int32[::1])", writes=("counter", "flag"))
def tick_kernel(counter, k, flag):
    """counter[k] -= 1; flag = counter[k] > 0: a WHILE body's own stop test."""
    if cuda.grid(1) == 0:
        counter[k] -= 1
        flag[0] = 1 if counter[k] > 0 else 0


@jit("void(int32[::1], int32, int32[::1])", writes=("flag",))
def set_flag_kernel(values, k, flag):
    if cuda.grid(1) == 0:
        flag[0] = 1 if values[k] > 0 else 0


def programs(depth=2):
    """A program: a list of ("add", slot, value) | ("if", cond, body) | ("while", trips, body).
    `cond` and `trips` index into the data the program runs on."""
    leaf = st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 9))
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3)
    inner = programs(depth - 1)
    return st.lists(st.one_of(leaf, st.tuples(st.just("if"), st.integers(0, 3), inner),
                              st.tuples(st.just("while"), st.integers(0, 3), inner)),
                    min_size=1, max_size=3)


def interpret(program, conds, trips):
    """The reference: the program run by Python on the host."""
    acc = np.zeros(4, np.float64)

    def run(ops):
        for op in ops:
            if op[0] == "add":
                acc[op[1]] += op[2]
            elif op[0] == "if":
                if conds[op[1]] > 0:
                    run(op[2])
            else:
                for _ in range(trips[op[1]]):
                    run(op[2])
    run(program)
    return acc


MAX_TRIPS = 3   # inner loops are unrolled in full under predication: keep them short


class Machine:
    """The device side of a program: an accumulator, the IF conditions, the WHILE trip counts
    (each loop counts down its own copy), a flag per IF and WHILE node, all allocated here:
    a recorded step may not move data to the device."""

    def __init__(self, program):
        self.program = program
        self.acc = dev(np.zeros(4, np.float32))
        self.conds = dev(np.zeros(4, np.int32))
        self.trips = dev(np.zeros(4, np.int32))
        self._flags = [dev(np.zeros(1, np.int32)) for _ in range(self._count(program))]
        self._counters = [dev(np.zeros(1, np.int32)) for _ in self._flags]

    def _count(self, ops) -> int:
        return sum(1 + self._count(op[2]) for op in ops if op[0] != "add")

    def step(self):
        self._next = 0
        self._run(self.program)

    def _take(self):
        k, self._next = self._next, self._next + 1
        return self._flags[k], self._counters[k]

    def _run(self, ops):
        for op in ops:
            if op[0] == "add":
                launch(add_at_kernel, 1, 1, (self.acc, np.int32(op[1]), np.float32(op[2])))
            elif op[0] == "if":
                flag, _ = self._take()
                launch(set_flag_kernel, 1, 1, (self.conds, np.int32(op[1]), flag))
                graph.if_then(flag, lambda body=op[2]: self._run(body))
            else:
                flag, counter = self._take()
                # the loop's own counter := trips[k], its flag := trips[k] > 0
                launch(copy_trip_kernel, 1, 1, (self.trips, np.int32(op[1]), counter, flag))
                graph.while_loop(flag, lambda body=op[2], c=counter, f=flag: (
                    self._run(body), launch(tick_kernel, 1, 1, (c, np.int32(0), f))),
                    max_passes=MAX_TRIPS)

    def set(self, conds, trips):
        self.conds.copy_to_device(np.asarray(conds, np.int32))
        self.trips.copy_to_device(np.asarray(trips, np.int32))
        self.acc.copy_to_device(np.zeros(4, np.float32))


@jit("void(int32[::1], int32, int32[::1], int32[::1])", writes=("counter", "flag"))
def copy_trip_kernel(trips, k, counter, flag):
    if cuda.grid(1) == 0:
        counter[0] = trips[k]
        flag[0] = 1 if trips[k] > 0 else 0


def _run_all(program, data, executor, control, unroll):
    m = Machine(program)
    m.set(*data[0])
    g = graph.capture(m.step, {}, warmup=0, executor=executor, control=control, unroll=unroll)
    try:
        out = []
        for conds, trips in data:
            m.set(conds, trips)
            g.replay()
            out.append(m.acc.copy_to_host())
        return out
    finally:
        g.close()


@settings(max_examples=6 if backend.SIMULATOR else 30, deadline=None)
@given(program=programs(), data=st.lists(st.tuples(
    st.lists(st.integers(0, 1), min_size=4, max_size=4),
    st.lists(st.integers(0, MAX_TRIPS), min_size=4, max_size=4)), min_size=1, max_size=3),
    unroll=st.sampled_from([3, 4, 7]))
def test_random_nested_programs_agree_under_every_control(program, data, unroll):
    want = [interpret(program, c, t) for c, t in data]
    for executor in EXECUTORS:
        controls = ["conditional", "predicated"] + (["host"] if executor == "cuda" else [])
        for control in controls:
            got = _run_all(program, data, executor, control, unroll)
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w, err_msg=f"{executor} {control} unroll={unroll}")


def test_a_predicated_top_level_loop_relaunches_every_k_passes_and_keeps_its_bound():
    m = Machine([("while", 0, [("add", 0, 1)])])
    for trips, want_launches in ((0, 1), (1, 1), (2, 1), (3, 2), (7, None)):
        m.set([0, 0, 0, 0], [trips, 0, 0, 0])
        g = graph.capture(m.step, {}, warmup=0, control="predicated", unroll=2)
        if trips > MAX_TRIPS:
            with pytest.raises(graph.LoopBoundError, match="max_passes=3"):
                g.replay()
            assert m.acc.copy_to_host()[0] == MAX_TRIPS   # stopped at the bound exactly
        else:
            g.replay()
            assert m.acc.copy_to_host()[0] == trips
            # K = 2 passes per launch: the host looks at the flag once per launch
            assert g._executables[0].launches == want_launches
        g.close()


def test_the_scope_flags_a_predicated_graph_writes_live_as_long_as_the_graph(monkeypatch):
    # Only the lowered nodes refer to the scope flags; a CUDA graph bakes their addresses, so
    # its executor must hold them (compute-sanitizer caught a write into a freed one).
    import gc
    import weakref
    from proto.graph import predicate
    made = []
    scope = predicate._Lowering._scope
    monkeypatch.setattr(predicate._Lowering, "_scope",
                        lambda self: made.append(weakref.ref(a := scope(self))) or a)
    # a top-level IF (a straight stretch: its flags were referenced by nothing the executor
    # kept) and a loop with an IF inside
    m = Machine([("if", 1, [("add", 0, 1)]), ("while", 0, [("if", 1, [("add", 0, 1)])])])
    for executor in EXECUTORS:
        made.clear()
        m.set([0, 1, 0, 0], [2, 0, 0, 0])
        g = graph.capture(m.step, {}, warmup=0, executor=executor, control="predicated",
                          unroll=2)
        gc.collect()
        assert made and all(ref() is not None for ref in made), executor
        g.replay()
        assert m.acc.copy_to_host()[0] == 3, executor
        g.close()


def test_predication_refuses_what_it_cannot_lower():
    host = cuda.pinned_array(4, np.float32)
    x, flag = dev(np.zeros(4, np.float32)), dev(np.ones(1, np.int32))

    def step():
        graph.if_then(flag, lambda: graph.copy(host, x))
    with pytest.raises(ValueError, match="a copy to or from the host cannot be predicated"):
        graph.capture(step, {}, warmup=0, control="predicated")
    m = Machine([("while", 0, [("while", 1, [("add", 0, 1)])])])
    with pytest.raises(ValueError, match=r"its max_passes \(3\) must be at most the unroll \(2\)"):
        graph.capture(m.step, {}, warmup=0, control="predicated", unroll=2)
    with pytest.raises(ValueError, match="control: expected one of"):
        graph.capture(m.step, {}, control="speculative")
    with pytest.raises(ValueError, match="unroll: expected a positive integer"):
        graph.capture(m.step, {}, control="predicated", unroll=0)
