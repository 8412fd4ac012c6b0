"""Every memory policy computes exactly what the unconstrained run computes.

On the simulator ops run in tape order whatever the policy, with the same kernels (or the same
host math), so results must be bit-identical; freed and evicted bytes are poisoned with NaNs,
so a policy that hands an op memory it does not own shows up as a mismatch.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto.device import backend
from proto import graph
from proto.graph.ir import Copy
from proto.tape import TensorSpec
from proto.vm import BudgetError, Executor, Liveness, Link, PagingExecutor, PlanError, plan
from proto.vm.pool import DevicePool, OutOfBudget
from proto.vm.synthetic import cnn_tape
from tests.helpers import assert_identical, run_plan


def _cheap_pools(tape):
    """op_seconds under which pooling is nearly free and convolution is not."""
    return [1e-6 if op.name.startswith("p") or "act" in op.name else 1e-3 for op in tape.ops]


@given(layers=st.sampled_from(["ccpccp", "cpcpc", "ccpc", "cpccpcc"]), width=st.integers(1, 3),
       frac=st.floats(0.0, 1.0), lookahead=st.one_of(st.none(), st.integers(1, 3)))
def test_every_policy_is_bit_identical_to_unconstrained(layers, width, frac, lookahead):
    tape, init = cnn_tape(64 * 4 * width, layers, seed=width)
    budget = Liveness(tape).budget_between(0.2 + 0.8 * frac)
    want = run_plan(Executor(tape, plan(tape)), init)
    slow = Link(h2d=1e6, d2h=1e6)
    swap = plan(tape, budget, lookahead=lookahead)
    both = plan(tape, budget, op_seconds=_cheap_pools(tape), link=slow, recompute=True)
    assert_identical(run_plan(Executor(tape, swap), init), want, "autovm")
    assert_identical(run_plan(Executor(tape, both), init), want, "autovm+recompute")
    assert_identical(run_plan(PagingExecutor(tape, budget, page_bytes=512), init), want, "paging")


def test_recompute_runs_and_matches():
    tape, init = cnn_tape(4096, "cpcpc")
    live = Liveness(tape)
    p = plan(tape, live.budget_between(0.2), op_seconds=_cheap_pools(tape),
             link=Link(1e6, 1e6), recompute=True)
    assert p.recomputed and p.offloaded
    assert_identical(run_plan(Executor(tape, p), init), run_plan(Executor(tape, plan(tape)), init), "recompute")


def test_real_kernels_under_a_tight_budget_match_unconstrained():
    # The project's elementwise kernels (launched through the simulator): slow, so one small case.
    tape, init = cnn_tape(128, "cpc", host_ops=False)
    live = Liveness(tape)
    budget = live.budget_between(0.3)
    want = run_plan(Executor(tape, plan(tape)), init, steps=1)
    swap = plan(tape, budget)
    assert swap.offloaded
    assert_identical(run_plan(Executor(tape, swap), init, steps=1), want, "autovm")
    assert_identical(run_plan(PagingExecutor(tape, budget, page_bytes=256), init, steps=1), want, "paging")


def _record_step(ex) -> graph.Description:
    with graph.record() as rec:
        ex.step()
    return rec.description()


def _cut(desc, cut) -> graph.Description:
    """The description without the edges (d -> j) for which cut(from node, to node) holds."""
    return graph.Description(desc.nodes, [tuple(d for d in deps if not cut(desc.nodes[d], node))
                                         for node, deps in zip(desc.nodes, desc.deps)])


def _direction(node) -> str:
    return node.direction if isinstance(node, Copy) else "compute"


@given(layers=st.sampled_from(["ccpccp", "cpcpc", "ccpc"]), width=st.integers(1, 3),
       frac=st.floats(0.0, 1.0), lookahead=st.one_of(st.none(), st.integers(1, 3)),
       recompute=st.booleans())
def test_a_recorded_step_is_a_race_free_graph(layers, width, frac, lookahead, recompute):
    # Recording runs nothing, so real-kernel tapes cost nothing here. Every pair of nodes
    # touching the same bytes (a kernel and the copy evicting or prefetching its tensor, two
    # tensors sharing arena bytes at different times, a pinned buffer written then read) must
    # be ordered by the edges the events became.
    tape, init = cnn_tape(64 * 4 * width, layers, host_ops=False, seed=width)
    budget = Liveness(tape).budget_between(0.2 + 0.8 * frac)
    p = plan(tape, budget, lookahead=lookahead, recompute=recompute,
             op_seconds=_cheap_pools(tape) if recompute else None,
             link=Link(1e6, 1e6) if recompute else Link())
    with Executor(tape, p) as ex:
        ex.load(init)   # a step, even one recorded, needs its state
        desc = _record_step(ex)
    moves = [a.kind for _, _, a in p.actions() if a.kind in ("evict", "prefetch")]
    directions = [_direction(node) for node in desc.nodes]
    assert directions.count("D2H") == moves.count("evict")
    assert directions.count("H2D") == moves.count("prefetch")
    assert graph.races(desc) == []
    assert desc.is_chain or moves   # no copies: one stream's chain
    # The checker is not vacuous: compute that never waits for prefetches, or evictions that
    # do not wait for the op that wrote their tensor, race.
    if "prefetch" in moves:
        assert graph.races(_cut(desc, lambda a, b: _direction(a) == "H2D" != _direction(b)))
    if "evict" in moves:
        assert graph.races(_cut(desc, lambda a, b: _direction(a) == "compute" and _direction(b) == "D2H"))


def test_captured_step_matches_unconstrained():
    # One graph for the whole step; on the simulator it is walked node by node in recording
    # order, so this checks what was recorded (every copy, every kernel, the right buffers).
    tape, init = cnn_tape(128, "cpc", host_ops=False)
    swap = plan(tape, Liveness(tape).budget_between(0.3))
    assert swap.offloaded
    want = run_plan(Executor(tape, plan(tape)), init, steps=1)
    assert_identical(run_plan(Executor(tape, swap), init, steps=1, capture=True), want, "graphed autovm")


def test_capture_refuses_host_math_and_demand_paging():
    tape, init = cnn_tape(256, "cc")
    with Executor(tape, plan(tape)) as ex, pytest.raises(RuntimeError, match="computes on the host"):
        ex.load(init)
        ex.capture()
    with PagingExecutor(tape, Liveness(tape).peak, page_bytes=256) as ex:
        with pytest.raises(TypeError, match="demand paging decides on the host"):
            ex.capture()


def test_a_wrong_plan_is_refused_before_running():
    tape, init = cnn_tape(1024, "ccp")
    p = plan(tape, Liveness(tape).budget_between(0.3))
    p.before = [[a for a in acts if a.kind != "wait"] for acts in p.before]
    with pytest.raises(PlanError):
        Executor(tape, p)


def test_too_small_budget_is_refused_naming_the_op():
    tape, _ = cnn_tape(4096, "cpc")
    live = Liveness(tape)
    worst = max(range(len(tape.ops)), key=live.working_set)
    with pytest.raises(BudgetError, match=tape.ops[worst].name):
        plan(tape, live.working_set(worst) - 256)
    own = sum(tape.tensors[n].nbytes for n in set(tape.ops[worst].reads + tape.ops[worst].writes))
    with pytest.raises(BudgetError, match=r"too small for op '.*' \(layer"):
        PagingExecutor(tape, own // 2, page_bytes=256)


def test_load_and_read_check_their_arguments():
    tape, init = cnn_tape(256, "c")
    with Executor(tape, plan(tape)) as ex:
        with pytest.raises(ValueError, match="not a persistent tensor"):
            ex.load({"c0.pre": np.zeros(256, np.float32)})
        with pytest.raises(ValueError, match=r"expected shape \(256,\)"):
            ex.load({"x": np.zeros(255, np.float32)})
        with pytest.raises(KeyError, match="neither persistent nor an output"):
            ex.read("c0.pre")


def test_pool_enforces_its_budget():
    spec = TensorSpec("a", (64,), "activation")
    pool = DevicePool(budget=512, capacity=512)
    a = pool.alloc(spec, 0)
    assert a.shape == (64,) and pool.live_bytes == 256
    pool.alloc(TensorSpec("b", (64,), "activation"), 256)
    with pytest.raises(OutOfBudget, match="past the budget"):
        pool.alloc(TensorSpec("c", (1,), "activation"), 0)
    pool.free("a")
    pool.free("b")
    assert pool.live_bytes == 0 and pool.peak_bytes == 512
    with pytest.raises(OutOfBudget, match="outside the arena"):
        pool.alloc(TensorSpec("d", (65,), "activation"), 256)
    with pytest.raises(OutOfBudget, match="passes the budget"):
        DevicePool(budget=100, capacity=512)
    pool.close()


# ---------------------------------------------------------------------------- GPU lane
@pytest.mark.gpu
def test_streamed_executor_on_cuda_matches_unconstrained(scale):
    # Real streams and events: a missing wait or an early release would race and corrupt data.
    # Captured: the whole scheduled step as one CUDA graph, copies on their own branches.
    tape, init = cnn_tape(4096 * 64 * scale, "ccpccpc", host_ops=False)
    live = Liveness(tape)
    want = run_plan(Executor(tape, plan(tape)), init, steps=3)
    for lookahead in (None, 1):
        p = plan(tape, live.budget_between(0.3), lookahead=lookahead)
        assert p.offloaded
        for capture in (False, True):
            assert_identical(run_plan(Executor(tape, p), init, steps=3, capture=capture), want,
                              f"autovm lookahead={lookahead} capture={capture}")


@pytest.mark.gpu
def test_managed_paging_on_cuda_faults_and_matches(scale):
    tape, init = cnn_tape(4096 * 64 * scale, "ccpccpc", host_ops=False)
    live = Liveness(tape)
    want = run_plan(Executor(tape, plan(tape)), init, steps=2)
    ex = PagingExecutor(tape, max(int(live.peak * 0.5), 8 << 20))
    got = run_plan(ex, init, steps=2)
    assert_identical(got, want, "managed paging")
    evicted, faulted = ex.moved_bytes()
    assert evicted > 0 and faulted > 0
    assert not backend.SIMULATOR
