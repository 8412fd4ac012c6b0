"""The memory planner (proto.graph.plan): offsets, lifetimes, the tape across graphs, and the
models planned against private buffers (simulator lane; GPU tests in test_graph_gpu and
test_graphed_models_gpu).

The reference for "no two live buffers overlap" is restated here by brute force over every
step, not read from the planner's own `validate`.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto import graph
from proto.device.backend import address, cuda, empty, jit, launch
from proto.graph import plan as planner
from proto.graph.plan import ALIGN, Block, Plan, PlanError, place, validate
from tests.helpers import dev


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


blocks_strategy = st.lists(
    st.tuples(st.integers(0, 30), st.integers(0, 10), st.integers(1, 5000)), min_size=1,
    max_size=25).map(lambda spec: [Block(i, first, first + length, size)
                                   for i, (first, length, size) in enumerate(spec)])


def _brute_force_check(blocks, offsets, arena):
    """Every step: the blocks alive then occupy disjoint byte ranges inside the arena."""
    steps = range(min(b.first for b in blocks), max(b.last for b in blocks) + 1)
    peak = 0
    for s in steps:
        alive = sorted((offsets[b.key], offsets[b.key] + b.nbytes) for b in blocks
                       if b.first <= s <= b.last)
        for (_, end), (start, _) in zip(alive, alive[1:]):
            assert end <= start, f"step {s}: overlap"
        assert all(0 <= lo and hi <= arena and lo % ALIGN == 0 for lo, hi in alive)
        peak = max(peak, sum(_aligned(hi - lo) for lo, hi in alive))
    return peak


@given(blocks=blocks_strategy)
def test_live_buffers_never_overlap_and_the_arena_is_at_least_the_peak(blocks):
    offsets, arena = place(blocks)
    peak = _brute_force_check(blocks, offsets, arena)
    assert arena >= peak
    assert arena <= sum(_aligned(b.nbytes) for b in blocks)   # never worse than private
    assert place(blocks) == (offsets, arena)                  # deterministic
    p = Plan(tuple(blocks), offsets, arena)
    assert p.peak_live_bytes == peak
    validate(p)


@given(blocks=blocks_strategy, data=st.data())
def test_validate_catches_a_moved_block(blocks, data):
    offsets, arena = place(blocks)
    # move one block onto another that is alive at the same time, if any pair is
    pairs = [(a, b) for a in blocks for b in blocks
             if a.key != b.key and a.first <= b.last and b.first <= a.last]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    bad = {**offsets, a.key: offsets[b.key]}
    with pytest.raises(PlanError, match="alive at once"):
        validate(Plan(tuple(blocks), bad, max(arena, offsets[b.key] + a.nbytes)))
    with pytest.raises(PlanError, match="outside the arena"):
        validate(Plan(tuple(blocks), offsets, arena - ALIGN if arena > ALIGN else 0))


@given(blocks=blocks_strategy, data=st.data())
def test_fixed_blocks_keep_their_offsets_and_new_ones_avoid_them(blocks, data):
    k = data.draw(st.integers(0, len(blocks)))
    first, _ = place(blocks[:k])
    fixed = [(b, first[b.key]) for b in blocks[:k]]
    offsets, arena = place(blocks[k:], fixed=fixed)
    offsets.update({b.key: off for b, off in fixed})
    _brute_force_check(blocks, offsets, arena)


# ------------------------------------------------------------------------- recorded programs
@jit("void(float32[::1], float32[::1], float32)", writes=("out",))
def scale_kernel(x, out, a):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i]


@jit("void(float32[::1], float32[::1], float32[::1])", writes=("out",))
def add_kernel(x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] + y[i]


def chain_program(n, ops):
    """A function of x: temporaries t0, t1, ... from `empty`, each made from x and earlier
    ones (ops[i] = index of the earlier temporary it adds, or -1 for x alone); the last is
    the output. Returns (fn, numpy reference)."""
    def fn(x):
        ts = []
        for i, j in enumerate(ops):
            t = empty(n, np.float32, f"t{i}")
            if j < 0:
                launch(scale_kernel, 1, 32, (x, t, np.float32(i + 1)))
            else:
                launch(add_kernel, 1, 32, (x, ts[j % len(ts)], t))
            ts.append(t)
        return ts[-1]

    def ref(x):
        ts = []
        for i, j in enumerate(ops):
            ts.append((i + 1) * x if j < 0 else x + ts[j % len(ts)])
        return ts[-1]
    return fn, ref


ops_strategy = st.lists(st.integers(-1, 8), min_size=1, max_size=10).map(
    lambda ops: [-1] + ops[1:])


@given(ops=ops_strategy, n=st.integers(1, 32))
def test_planned_graphs_equal_private_ones_and_are_race_free(ops, n):
    fn, ref = chain_program(n, ops)
    x = np.random.default_rng(len(ops)).standard_normal(n).astype(np.float32)
    planned = graph.capture(fn, {"x": dev(x)}, warmup=0)
    private = graph.capture(fn, {"x": dev(x)}, warmup=0, planned=False)
    try:
        assert graph.races(planned.description) == []
        p = planned.plan
        validate(p)
        assert p.arena_bytes <= p.total_bytes == sum(_aligned(n * 4) for _ in ops)
        assert private.plan is None and private.private_bytes == 4 * n * len(ops)
        want = ref(x.astype(np.float64))
        got = planned.replay(x=planned.placeholders["x"]).copy_to_host()
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_array_equal(got, private.replay(x=private.placeholders["x"]).copy_to_host())
        # the output's bytes are no other buffer's at the end: reading it after is safe
        out_key = (None, f"t{len(ops) - 1}", 0)
        assert next(b for b in p.blocks if b.key == out_key).last == max(b.last for b in p.blocks)
    finally:
        planned.close()
        private.close()


@given(ops=ops_strategy, lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_a_tape_gives_a_name_one_address_in_every_graph(ops, lengths):
    """A family of graphs of one program at several sizes, planned largest first on one tape:
    every name has the same address in every graph, and the arena is the largest's."""
    sizes = sorted(set(lengths), reverse=True)
    tape = graph.Tape("family")
    x = dev(np.ones(max(sizes), np.float32))
    graphs = []
    try:
        for n in sizes:
            fn, _ = chain_program(n, ops)
            graphs.append(graph.capture(lambda x, fn=fn, n=n: fn(x[:n]), {"x": x}, warmup=0,
                                        tape=tape))
        assert tape.arena_bytes == _aligned(graphs[0].plan.arena_bytes)
        where = {}
        for g in graphs:
            for blk, buf in zip(g.plan.blocks, g.description.buffers):
                where.setdefault(blk.key, address(buf.array))
                assert address(buf.array) == where[blk.key]
                assert address(buf.array) == address(tape.arena) + tape.offsets[blk.key]
    finally:
        for g in graphs:
            g.close()
        tape.close()


def test_a_tape_refuses_a_larger_graph_after_a_smaller_one():
    """A larger arena than the first graph's, or a model's tensor larger than where the tape
    put it, cannot keep the first graph's addresses."""
    tape = graph.Tape("grow")
    x = dev(np.ones(1024, np.float32))
    small, _ = chain_program(8, [-1, 0])
    big, _ = chain_program(1024, [-1, 0])
    g = graph.capture(small, {"x": x[:8]}, warmup=0, tape=tape)
    with pytest.raises(ValueError, match="needs an arena of .* capture the largest shape first"):
        graph.capture(big, {"x": x}, warmup=0, tape=tape)
    g.close()
    with pytest.raises(ValueError, match="needs planned=True"):
        graph.capture(small, {"x": x[:8]}, planned=False, tape=tape)
    owner = object.__new__(type("Owner", (), {}))
    owned = graph.Tape("owned")
    first, _ = split_program(64, owner, [])
    g = graph.capture(first, {"x": x}, warmup=0, tape=owned)
    later, _ = split_program(128, owner, [])                  # "out" grows, arena or not
    with pytest.raises(ValueError, match="buffer 'out' needs 512 bytes but the tape placed it "
                                         "with 256 .* capture the largest shape first"):
        graph.capture(later, {"x": x}, warmup=0, tape=owned)
    g.close()


def split_program(n, owner, scratch):
    """Layers that each make an owned tensor of n elements from x, through kernel scratch of
    scratch[i] elements (0: none) where a kernel would split its reduction; the output adds
    them all. Returns (fn, numpy reference)."""
    def fn(x):
        out = empty(n, np.float32, "out", owner=owner)
        launch(scale_kernel, 1, 32, (x, out, np.float32(0)))
        for i, size in enumerate(scratch):
            total = empty(n, np.float32, f"sum{i}", owner=owner)
            t = empty(n, np.float32, f"layer{i}", owner=owner)
            if size:
                part = empty(size, np.float32, "partials")     # no owner: scratch
                launch(scale_kernel, 1, 64, (x, part, np.float32(i + 1)))
                launch(add_kernel, 1, 32, (x, part, t))
            else:
                launch(scale_kernel, 1, 32, (x, t, np.float32(i + 2)))
            launch(add_kernel, 1, 32, (out, t, total))
            out = total
        return out
    return fn, lambda x: sum(x[:n] * (i + 2) for i in range(len(scratch)))


@given(n=st.integers(4, 16), layers=st.lists(st.tuples(st.sampled_from([0, 1, 3]),
                                                        st.sampled_from([0, 1, 3])),
                                              min_size=1, max_size=4))
def test_kernel_scratch_that_grows_at_a_smaller_shape_is_placed_anew(n, layers):
    """A kernel may split its reduction more ways at a smaller shape (its split count
    rounds), and the k-th scratch of a name may then be another layer's: the smaller graph
    still plans on the tape, computes what it should, and every owned tensor keeps its
    address. (Scratch of 0, n or 3n elements a layer, drawn apart for the two shapes.)"""
    owner = object.__new__(type("Owner", (), {}))
    tape = graph.Tape("split")
    x = np.arange(1, 3 * 2 * n + 1, dtype=np.float32)
    graphs = []
    try:
        for m, which in ((2 * n, 0), (n, 1)):               # largest first
            fn, ref = split_program(m, owner, [s[which] * m for s in layers])
            g = graph.capture(fn, {"x": dev(x)}, warmup=0, tape=tape)
            graphs.append(g)
            validate(g.plan)
            got = g.replay(x=g.placeholders["x"]).copy_to_host()
            np.testing.assert_array_equal(got, ref(x.astype(np.float64)))
        owned = [{b.key: address(b.array) for b in g.description.buffers if b.key[0] is not None}
                 for g in graphs]
        assert all(owned[0][k] == a for k, a in owned[1].items())
    finally:
        for g in graphs:
            g.close()
        tape.close()


def test_a_name_allocated_twice_in_a_graph_is_two_tensors_with_one_address_per_graph():
    """A step recorded twice in one graph allocates each of its names twice: the k-th
    allocation is its own tensor (both alive at once must not share bytes), and on one tape
    the k-th allocation has the same address in every graph."""
    owner = object.__new__(type("Owner", (), {}))
    tape = graph.Tape()

    def twice(x):
        ts = [empty(4, np.float32, "t", owner=owner) for _ in range(2)]
        for t in ts:                            # both written before either is read
            launch(scale_kernel, 1, 32, (x, t, np.float32(2)))
        for t in ts:
            launch(scale_kernel, 1, 32, (t, x, np.float32(1)))
        return ts
    addresses = []
    for _ in range(2):                          # two graphs of one owner on one tape
        g = graph.capture(twice, {"x": dev(np.ones(4, np.float32))}, warmup=0, tape=tape)
        a, b = (address(t) for t in g.outputs)
        assert abs(a - b) >= 16                 # two live tensors, disjoint bytes
        addresses.append((a, b))
        g.close()
    assert addresses[0] == addresses[1]


def test_a_buffer_used_in_a_loop_lives_through_the_whole_loop():
    """Inside a WHILE body, a temporary written at the end of one pass may be read at the
    start of the next: the planner must not reuse its bytes within the loop."""
    flag = dev(np.zeros(1, np.int32))
    x = dev(np.ones(8, np.float32))

    def fn(x):
        a = empty(8, np.float32, "a")
        launch(scale_kernel, 1, 32, (x, a, np.float32(1)))

        def body():
            b = empty(8, np.float32, "b")
            launch(scale_kernel, 1, 32, (a, b, np.float32(2)))
            c = empty(8, np.float32, "c")
            launch(scale_kernel, 1, 32, (b, c, np.float32(3)))
        graph.while_loop(flag, body, max_passes=4)
        d = empty(8, np.float32, "d")
        launch(scale_kernel, 1, 32, (x, d, np.float32(4)))
        return d
    g = graph.capture(fn, {"x": x}, warmup=0)
    spans = {b.key[1]: (b.first, b.last) for b in g.plan.blocks}
    assert spans["a"] == (0, 2) and spans["b"] == spans["c"] == (1, 2)   # the loop is steps 1-2
    offs = {k[1]: off for k, off in g.plan.offsets.items()}
    assert len({offs["a"], offs["b"], offs["c"]}) == 3
    g.close()


def test_the_planner_switch_and_the_summary():
    fn, _ = chain_program(16, [-1, 0, 0, 1])
    g = graph.capture(fn, {"x": dev(np.ones(16, np.float32))}, warmup=0)
    assert "4 buffers" in g.plan.summary() and "peak live" in g.plan.summary()
    assert g.private_bytes == 0
    g.close()
    assert planner.lifetimes(graph.Description([])) == {}


@pytest.mark.parametrize("n_layer,n_embd,vocab", [(2, 32, 1000), (3, 16, 50)])
def test_the_gpt2_decode_arena_is_within_ten_percent_of_the_peak(n_layer, n_embd, vocab):
    """Recorded, not run (no simulator cost): the planner on the real model's decode step."""
    from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
    from proto.models.graphed import GraphedDecoder
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab,
                        n_positions=16)
    model = GPT2(config, random_state_dict(config, 0), max_batch=5, max_tokens=1)
    with GraphedDecoder(model, batch=5, max_len=16, build_all=True) as g:
        plan = g.tape.plans[0]
        assert plan.arena_bytes <= 1.10 * plan.peak_live_bytes, plan.summary()
        assert plan.arena_bytes < plan.total_bytes
        # every graph of the object (one per cache set) found its buffers where the first put them
        assert all(p.offsets == plan.offsets for p in g.tape.plans)


def test_eager_empty_reuses_one_buffer_per_name_and_one_view_per_shape():
    """Outside a recording, `empty` keeps one device buffer per (owner, name): a smaller or
    equal request is a view of it (the same address), the same shape is the very same
    array object step after step (no array made per launch), a larger request grows the
    buffer, and another owner has memory of its own."""
    class Owner:
        pass
    a, b = Owner(), Owner()
    first = empty((4, 8), np.float32, "t", owner=a)
    assert empty((4, 8), np.float32, "t", owner=a) is first
    smaller = empty((2, 3), np.int32, "t", owner=a)
    assert address(smaller) == address(first) and smaller.shape == (2, 3)
    assert smaller.dtype == np.int32
    other = empty((4, 8), np.float32, "t", owner=b)
    assert address(other) != address(first)
    grown = empty((64, 64), np.float32, "t", owner=a)
    assert grown.shape == (64, 64) and empty((4, 8), np.float32, "t", owner=a) is not first
    many = [empty((1, n), np.float32, "t", owner=a) for n in range(1, 40)]
    assert all(v.shape == (1, n) for v, n in zip(many, range(1, 40)))
    from proto.device import backend
    assert len(backend._eager_owned[a]["t"][1]) <= backend._VIEWS_PER_BUFFER   # views stay few


def test_scratch_bytes_counts_the_launchers_own_buffers_and_nothing_owned():
    """`scratch_bytes` is what owner-less `empty` calls (kernel scratch) hold, grown buffers
    counted at their size; a model's (owned) temporaries are not scratch."""
    from proto.device import backend
    before = backend.scratch_bytes()
    empty((1000,), np.float32, "test.scratch_bytes")
    assert backend.scratch_bytes() == before + 4000
    empty((10,), np.float32, "test.scratch_bytes")              # fits: no new bytes
    assert backend.scratch_bytes() == before + 4000
    empty((2000,), np.float32, "test.scratch_bytes")            # grows the one buffer
    assert backend.scratch_bytes() == before + 8000

    class Owner:
        pass
    empty((5000,), np.float32, "test.scratch_bytes", owner=Owner())
    assert backend.scratch_bytes() == before + 8000
