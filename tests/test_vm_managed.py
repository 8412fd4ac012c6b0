"""AutoVM on managed memory (proto.vm.managed): the same plan as the pool executor, its moves
done by prefetching one unified-memory arena, its budget counted in pages.

On the simulator the arena is a device array with a host mirror, copies are synchronous, and
bytes that left the device are poisoned with NaNs: results must be bit-identical to the
unconstrained run and to the pool executor, and a plan that forgot a prefetch shows NaNs.
"""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto.device import backend
from proto.models import vgg
from proto.vm import (BudgetError, Executor, Link, Liveness, ManagedExecutor, PlanError,
                      estimate_seconds, plan, plan_for_pages, validate)
from proto.vm.actions import Action
from proto.vm.residency import PageLedger, layout
from proto.vm.synthetic import cnn_tape
from proto.vm.walk import At, walk
from tests.helpers import assert_identical, run_plan, spy_on_plan_visits


@given(layers=st.sampled_from(["ccpccp", "cpcpc", "ccpc", "cpccpcc"]), width=st.integers(1, 3),
       frac=st.floats(0.1, 1.0), page=st.sampled_from([256, 512, 1024]),
       recompute=st.booleans())
def test_managed_is_bit_identical_to_unconstrained_and_to_the_pool(layers, width, frac, page, recompute):
    tape, init = cnn_tape(64 * 4 * width, layers, seed=width)
    budget = Liveness(tape).budget_between(frac)
    kw = dict(op_seconds=[1e-6 if "p" in op.name or "act" in op.name else 1e-3 for op in tape.ops],
              link=Link(1e6, 1e6), recompute=True) if recompute else {}
    try:
        p = plan_for_pages(tape, budget, page_bytes=page, **kw)
    except BudgetError:   # tight budgets may not fit in pages: refused before any launch
        return
    want = run_plan(Executor(tape, plan(tape)), init)
    assert_identical(run_plan(Executor(tape, p), init), want, "pool")
    ex = ManagedExecutor(tape, p, budget=budget, page_bytes=page)
    assert_identical(run_plan(ex, init), want, "managed")
    # what the step counted is what the check counted before launch, and within the budget
    assert ex.peak_pages == ex.planned_peak_pages <= ex.max_pages == budget // page


@pytest.mark.parametrize("front_splits", [1, 2])
def test_tiny_vgg_on_managed_memory_matches_unconstrained_and_the_pool(front_splits):
    # The toy VGG-11 of experiments/autovm.py, on its kernels' host references (its first
    # block whole, and in two micro-batches as the experiment runs it).
    cfg = vgg.VGGConfig(depth=11, width=1 / 16, image_size=32, batch=2, num_classes=10, hidden=32,
                        front_splits=front_splits)
    tape = vgg.build_tape(cfg, host_math=True)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, 2).astype(np.int32)
    init = vgg.initial_values(cfg, vgg.random_state_dict(cfg, seed=11), images, labels)
    checked = ["loss"] + [f"{p}.grad" for p in vgg.param_shapes(cfg)]

    def one_step(ex):
        with ex:
            ex.load(init)
            ex.step()
            return ex.read_many(checked)

    want = one_step(Executor(tape, plan(tape)))
    live = Liveness(tape)
    for frac in (1.0, 0.5):
        budget = int(frac * live.peak)
        p = plan_for_pages(tape, budget, page_bytes=4096)
        assert frac == 1.0 or p.offloaded
        assert_identical(one_step(Executor(tape, p)), want, f"pool at {frac}")
        assert_identical(one_step(ManagedExecutor(tape, p, budget=budget, page_bytes=4096)),
                          want, f"managed at {frac}")


def test_a_plan_without_its_prefetches_reads_nans_on_the_mirror_and_faults_on_a_gpu():
    # The checker refuses such a plan, so the prefetches go after construction: the step then
    # reads ranges whose bytes were sent to the host (poisoned there on the simulator).
    tape, init = cnn_tape(1024, "ccpcc")
    budget = Liveness(tape).budget_between(0.2)
    p = plan_for_pages(tape, budget, page_bytes=256)
    assert any(a.kind == "prefetch" for _, _, a in p.actions())
    want = run_plan(Executor(tape, plan(tape)), init, steps=1)
    assert_identical(run_plan(ManagedExecutor(tape, p, budget=budget, page_bytes=256), init, steps=1),
                      want, "intact plan")
    ex = ManagedExecutor(tape, p, budget=budget, page_bytes=256)
    ex.plan = dataclasses.replace(p, before=[[a for a in acts if a.kind != "prefetch"]
                                             for acts in p.before])
    got = run_plan(ex, init, steps=1)
    if backend.SIMULATOR:   # the host mirror poisoned what left the device
        assert np.isnan(got["loss"]).any()
    else:   # managed memory stays coherent: the kernels fault the evicted pages back in
        assert_identical(got, want, "without prefetches: demand paging")


def test_a_plan_that_fits_in_bytes_but_not_in_pages_is_refused_before_launch():
    tape, init = cnn_tape(512, "ccpccp")
    budget = Liveness(tape).peak
    p = plan(tape, budget)      # fits by bytes: nothing moves
    assert p.peak_bytes <= budget and not p.offloaded
    # 2 KiB tensors in 1.5 KiB pages: each takes two pages, and resident pages pass the budget
    with pytest.raises(BudgetError, match=r"holds \d+ pages of 1.50 KiB.*would make \d+ pages"):
        ManagedExecutor(tape, p, page_bytes=1536)
    fitted = plan_for_pages(tape, budget, page_bytes=1536)   # re-planned under fewer bytes
    assert fitted.budget < budget and fitted.offloaded
    assert_identical(run_plan(ManagedExecutor(tape, fitted, budget=budget, page_bytes=1536), init),
                      run_plan(Executor(tape, plan(tape)), init), "re-planned for pages")


@given(layers=st.sampled_from(["ccpccp", "cpcpc", "ccpc"]), frac=st.floats(0.1, 1.0),
       page=st.sampled_from([256, 1024, 4096]))
def test_moving_tensors_own_whole_pages_and_never_share_a_range_while_alive(layers, frac, page):
    tape, _ = cnn_tape(1024, layers)
    live = Liveness(tape)
    p = plan(tape, live.budget_between(frac))
    lay = layout(tape, p, page)
    fixed = set(p.persistent)
    assert all(lay.offsets[n] + tape.tensors[n].nbytes <= lay.fixed_bytes for n in fixed)
    movers = [n for n in lay.offsets if n not in fixed]
    for n in movers:
        assert lay.offsets[n] % page == 0 and lay.offsets[n] >= lay.fixed_bytes
    span = {n: (live.first(n), live.last(n)) for n in movers}
    for i, a in enumerate(movers):
        for b in movers[i + 1:]:
            meet = span[a][0] <= span[b][1] and span[b][0] <= span[a][1]
            apart = (lay.offsets[a] + tape.tensors[a].nbytes <= lay.offsets[b]
                     or lay.offsets[b] + tape.tensors[b].nbytes <= lay.offsets[a])
            assert apart or not meet, f"{a} and {b} overlap while both alive"


def test_discarded_pages_count_until_compute_waits_on_the_copy_stream():
    tape, _ = cnn_tape(1024, "ccpcc")
    p = plan(tape, Liveness(tape).budget_between(0.2))
    led = PageLedger(tape, layout(tape, p, 256), 1 << 30)
    led.start()
    fixed = led.resident_pages
    name = next(a.tensor for _, _, a in p.actions() if a.kind == "prefetch")
    here = At("before", 0)
    led.visit(Action("alloc", name, 0), here)
    grown = led.resident_pages - fixed
    assert grown == -(-tape.tensors[name].nbytes // 256)
    led.visit(Action("discard", name), here)
    assert led.resident_pages == fixed + grown          # on its way to the host
    led.drain()
    assert led.resident_pages == fixed


@pytest.mark.parametrize("front_splits", [1, 4])
def test_vgg19_at_the_papers_size_plans_for_managed_pages_at_half_its_peak(front_splits):
    # On the H200 this was refused: the pool's plan discarded conv1_1's 3 GiB output (its
    # host copy current) just before conv1_1's 3 GiB gradient was allocated, and on managed
    # memory a discard's pages stay resident until they are home. Planning without host
    # copies evicts and releases instead. Planning only: nothing is allocated. (4 micro-batches
    # of the first block: the experiment's tape.)
    cfg = vgg.VGGConfig(depth=19, width=1.0, image_size=224, batch=256, front_splits=front_splits)
    tape = vgg.build_tape(cfg, host_math=False)
    budget = Liveness(tape).budget_between(0.5)
    p = plan_for_pages(tape, budget, page_bytes=2 << 20)
    assert p.budget == budget                    # no re-planning under fewer bytes needed
    assert not any(a.kind == "discard" for _, _, a in p.actions())
    ledger = PageLedger(tape, layout(tape, p, 2 << 20), budget)
    assert ledger.check(p) <= ledger.max_pages == budget // (2 << 20)


def test_dead_pages_are_reused_in_place_and_discarded_only_for_room():
    tape, init = cnn_tape(1024, "ccpccp")
    page = 256
    p = plan_for_pages(tape, Liveness(tape).peak, page_bytes=page)
    lay = layout(tape, p, page)
    movers = -(-(lay.arena_bytes - lay.fixed_bytes) // page)

    def step_counts(ledger):
        filled = dropped = 0
        dropped += sum(e - s for s, e in ledger.start())
        for slot, i, act in p.actions():
            ledger.visit(act, At(slot, i))
            filled += sum(e - s for s, e in ledger.filled)
            dropped += sum(e - s for s, e in ledger.dropped)
        ledger.drain()
        return filled, dropped

    roomy = PageLedger(tape, lay, lay.arena_bytes + page)   # every page fits: none is dropped
    roomy.check(p)
    first, again = step_counts(roomy), step_counts(roomy)
    assert first[1] == again[1] == 0
    assert 0 < first[0] <= movers and again[0] == 0   # the second step reuses every page
    tight = Liveness(tape).budget_between(0.3)
    p = plan_for_pages(tape, tight, page_bytes=page)
    lay = layout(tape, p, page)
    ledger = PageLedger(tape, lay, tight)
    ledger.check(p)
    for _ in range(3):   # the budget makes it drop dead pages, and never passes it
        assert step_counts(ledger)[1] > 0 and ledger.peak_pages <= ledger.max_pages
    want = run_plan(Executor(tape, plan(tape)), init, steps=3)
    assert_identical(run_plan(ManagedExecutor(tape, p, budget=tight, page_bytes=page), init, steps=3),
                     want, "tight, three steps")


@given(layers=st.sampled_from(["ccpccp", "cpcpc", "ccpc"]), frac=st.floats(0.1, 1.0),
       page=st.sampled_from([256, 1024]))
def test_steps_after_the_checked_ones_stay_within_the_budget(layers, frac, page):
    # The check walks steps until one starts as an earlier one did; dead pages carry over,
    # so the claim is that no later step can pass the budget either. Walk six, strictly.
    tape, _ = cnn_tape(1024, layers)
    budget = Liveness(tape).budget_between(frac)
    try:
        p = plan_for_pages(tape, budget, page_bytes=page)
    except BudgetError:
        return
    ledger = PageLedger(tape, layout(tape, p, page), budget)
    peak = ledger.check(p)
    ledger.strict = True
    for _ in range(6):
        ledger.start()
        walk(p, ledger)
        ledger.drain()
    assert ledger.peak_pages <= peak <= ledger.max_pages


def test_checker_cost_model_ledger_and_managed_replay_see_the_same_actions(monkeypatch):
    tape, init = cnn_tape(4096, "cpcpc")
    seconds = [1e-6 if op.name.startswith("p") or "act" in op.name else 1e-3 for op in tape.ops]
    budget = Liveness(tape).budget_between(0.3)
    p = plan_for_pages(tape, budget, page_bytes=256, op_seconds=seconds, link=Link(1e6, 1e6),
                       recompute=True)
    seen = spy_on_plan_visits(monkeypatch)
    validate(tape, p)
    estimate_seconds(tape, p, seconds, Link(1e6, 1e6))
    with ManagedExecutor(tape, p, budget=budget, page_bytes=256) as ex:   # checks pages again
        ex.load(init)
        ex.step()
    want = list(p.actions())
    assert seen.pop("_Checker") == want + want
    assert seen.pop("_Clock") == want
    assert seen.pop("_ManagedReplay") == want
    # The check before launch walks steps until one starts as an earlier one did (dead pages
    # outlive a step), then the step itself: whole walks, each in plan order.
    ledger = seen.pop("PageLedger")
    walks, rest = divmod(len(ledger), len(want))
    assert rest == 0 and walks >= 3 and ledger == want * walks
    assert not seen


def test_bad_arguments_are_refused_naming_them_before_any_launch():
    tape, init = cnn_tape(256, "cc")
    p = plan(tape)
    for bad in (float("nan"), 0, -5, 1.5):
        with pytest.raises(ValueError, match="budget"):
            ManagedExecutor(tape, p, budget=bad)
    with pytest.raises(ValueError, match="page_bytes"):
        ManagedExecutor(tape, p, page_bytes=0)
    with pytest.raises(ValueError, match="managed"):
        ManagedExecutor(tape, p, managed="yes")
    if backend.SIMULATOR:
        with pytest.raises(ValueError, match="managed: True needs a GPU"):
            ManagedExecutor(tape, p, managed=True)
    with pytest.raises(TypeError, match="plan: expected a Plan"):
        ManagedExecutor(tape, {"budget": 1})
    other, _ = cnn_tape(256, "ccc")
    with pytest.raises(PlanError, match="plan"):
        ManagedExecutor(other, p)
    with pytest.raises(PlanError, match="plan.budget"):
        ManagedExecutor(tape, dataclasses.replace(p, budget=float("nan")))
    with pytest.raises(BudgetError, match="holds no page"):
        ManagedExecutor(tape, p, budget=100, page_bytes=256)
    with pytest.raises(ValueError, match="budget"):
        plan_for_pages(tape, float("nan"))
    ex = ManagedExecutor(tape, p, page_bytes=256)
    with pytest.raises(TypeError, match="cuMemPrefetchAsync.*eagerly"):
        ex.capture()
    ex.close()
    ex.close()   # twice is harmless
    for call in (ex.step, lambda: ex.load(init), lambda: ex.read("loss")):
        with pytest.raises(RuntimeError, match="this executor is closed"):
            call()


# ---------------------------------------------------------------------------- GPU lane
@pytest.mark.gpu
def test_managed_on_cuda_matches_the_pool_at_half_budget_within_its_pages(scale):
    # Real prefetches on real streams: a missing wait would race and corrupt data, a page
    # left behind would fault (correct, only slow); the ledger counts 2 MiB pages.
    tape, init = cnn_tape(4096 * 256 * scale, "ccpccpc", host_ops=False)
    budget = Liveness(tape).peak // 2
    p = plan_for_pages(tape, budget)
    assert p.offloaded
    want = run_plan(Executor(tape, p), init, steps=3)
    assert_identical(want, run_plan(Executor(tape, plan(tape)), init, steps=3), "pool")
    ex = ManagedExecutor(tape, p, budget=budget)
    assert ex.mem.real and not backend.SIMULATOR
    assert_identical(run_plan(ex, init, steps=3), want, "managed")
    assert 0 < ex.peak_pages <= ex.max_pages


@pytest.mark.gpu
def test_cuda_cannot_capture_a_prefetch_into_a_graph():
    # The managed executor runs eagerly because of this; if a driver ever captures it, this
    # test says so (and capture() could be allowed).
    from cuda.bindings import driver
    from proto.device.backend import cuda
    from proto.vm.pool import managed_bytes
    from proto.vm.um import prefetch_managed
    arena = managed_bytes(2 << 20)
    stream = cuda.stream()
    hstream = driver.CUstream(int(getattr(stream.handle, "value", stream.handle)))
    (err,) = driver.cuStreamBeginCapture(hstream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    assert err == driver.CUresult.CUDA_SUCCESS
    try:
        with pytest.raises(RuntimeError, match="cuMemPrefetchAsync"):
            prefetch_managed(int(arena.device_ctypes_pointer.value), 2 << 20, stream)
    finally:
        driver.cuStreamEndCapture(hstream)
