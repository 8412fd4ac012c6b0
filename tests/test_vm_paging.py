"""The demand-paging baseline's page table: least recently used pages go first, never the ones
the current op needs, and faults are exactly the needed pages that were away."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from proto.device import backend
from proto.vm import BudgetError, Liveness, PagingExecutor, measure_link
from proto.vm.paging import PageTable, page_runs
from proto.vm.synthetic import cnn_tape

P = 1024  # page size for these tests


def _pages(*idx):
    return np.array(idx, dtype=np.int64)


def test_least_recently_used_pages_are_evicted_first():
    t = PageTable(arena_bytes=8 * P, budget=4 * P, page_bytes=P)
    assert t.touch(_pages(0, 1)) == ([], [(0, 2)])      # cold: both fault in
    assert t.touch(_pages(2, 3)) == ([], [(2, 4)])
    assert t.touch(_pages(0)) == ([], [])                # resident: no fault, now recent
    evict, fault = t.touch(_pages(4))                    # full: the oldest (page 1) goes
    assert evict == [(1, 2)] and fault == [(4, 5)]
    evict, fault = t.touch(_pages(5, 6))                 # next oldest: pages 2 and 3
    assert evict == [(2, 4)] and fault == [(5, 7)]
    assert sorted(np.flatnonzero(t.resident)) == [0, 4, 5, 6]
    assert (t.evicted_pages, t.faulted_pages) == (3, 7)


def test_pages_the_op_needs_are_never_evicted_even_if_oldest():
    t = PageTable(arena_bytes=8 * P, budget=3 * P, page_bytes=P)
    t.touch(_pages(0, 1, 2))
    evict, fault = t.touch(_pages(0, 3))                 # 0 is oldest but needed: 1 goes
    assert evict == [(1, 2)] and fault == [(3, 4)]
    assert t.resident[[0, 2, 3]].all()


def test_an_op_larger_than_the_budget_is_refused():
    t = PageTable(arena_bytes=8 * P, budget=2 * P, page_bytes=P)
    with pytest.raises(BudgetError, match="3 pages needed at once, the budget holds 2"):
        t.touch(_pages(0, 1, 2))
    with pytest.raises(BudgetError, match="holds no page"):
        PageTable(arena_bytes=8 * P, budget=P - 1, page_bytes=P)


def test_a_budget_of_the_whole_arena_evicts_nothing_even_with_a_partial_last_page():
    """100% of the peak is the arena's size, which rarely ends on a page boundary: the budget
    must hold the last, partial page too. One byte less holds only the whole pages."""
    arena = 8 * P + P // 2                                # 9 pages, the last half full
    for budget, evicted in ((arena, 0), (arena - 1, 1)):
        t = PageTable(arena_bytes=arena, budget=budget, page_bytes=P)
        for page in range(9):
            t.touch(_pages(page))
        assert t.evicted_pages == evicted, budget


def test_byte_ranges_map_to_pages():
    t = PageTable(arena_bytes=10 * P, budget=4 * P, page_bytes=P)
    assert list(t.pages([(0, 1)])) == [0]
    assert list(t.pages([(P - 1, 2)])) == [0, 1]          # straddles a boundary
    assert list(t.pages([(3 * P, P), (0, P), (3 * P + 5, 1)])) == [0, 3]
    assert list(t.pages([])) == []


@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
                min_size=1, max_size=30), st.integers(4, 12))
def test_residency_never_passes_the_budget_and_needed_pages_are_resident(touches, budget_pages):
    t = PageTable(arena_bytes=16 * P, budget=budget_pages * P, page_bytes=P)
    for pages in touches:
        before = t.resident.copy()
        evict, fault = t.touch(np.array(sorted(pages)))
        assert t.resident.sum() <= budget_pages
        assert t.resident[pages].all()
        faulted = [p for a, b in fault for p in range(a, b)]
        assert faulted == sorted(p for p in pages if not before[p])
        assert not any(p in pages for a, b in evict for p in range(a, b))


def test_runs_coalesce_consecutive_pages():
    assert page_runs(np.array([1, 2, 3, 7, 9, 10])) == [(1, 4), (7, 8), (9, 11)]
    assert page_runs(np.array([], dtype=np.int64)) == []


def test_paging_moves_more_the_smaller_the_budget():
    tape, init = cnn_tape(4096, "ccpccp")
    live = Liveness(tape)
    moved = []
    for frac in (2.0, 0.8, 0.6):
        with PagingExecutor(tape, int(live.peak * frac), page_bytes=P) as ex:
            ex.load(init)
            ex.step()
            ex.step()
            moved.append(ex.moved_bytes())
    assert moved[0][0] == 0                     # everything fits: nothing is ever evicted
    assert 0 < moved[1][0] < moved[2][0]        # tighter budget, more traffic
    assert moved[1][1] < moved[2][1]


def test_measure_link_reports_every_rate():
    """NaN on the simulator (no link to measure); positive rates on a GPU."""
    rates = measure_link(1 << 20)
    assert set(rates) == {"pinned_h2d_gbps", "pinned_d2h_gbps", "fault_h2d_gbps", "prefetch_h2d_gbps",
                          "evict_d2h_gbps"}
    if backend.SIMULATOR:
        assert all(np.isnan(v) for v in rates.values())
    else:
        assert all(np.isfinite(v) and v > 0 for v in rates.values())


@pytest.mark.gpu
def test_measure_link_on_cuda_sees_faults_slower_than_pinned_copies():
    rates = measure_link(128 << 20, reps=2)
    assert all(v > 0.1 for v in rates.values()), rates
    assert rates["fault_h2d_gbps"] < rates["pinned_h2d_gbps"], rates
