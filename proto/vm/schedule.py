"""The AutoVM planner: which tensors leave the device, when they go, when they come back.

From the tape's op order and each tensor's uses (liveness.py) `plan` picks gaps to spend off
the device until every op fits the budget (fit.py, with the timing model of timeline.py,
under a few link speeds, keeping the plan that the cost model times fastest),
optionally trades copies for recomputation (recompute.py), and lowers the choices to arena
offsets and per-op actions (lower.py, the action vocabulary in actions.py). The result is
plain data: `validate` (check.py) checks it without a GPU, `estimate_seconds` (cost.py) times
it, and the executor (executor.py) replays it; all three read it through walk.py.
"""
from __future__ import annotations

from kernels import _check
from proto.tape import Tape
from proto.vm.actions import Plan
from proto.vm.cost import estimate_seconds
from proto.vm.fit import GAP_ORDERS, fit
from proto.vm.liveness import BudgetError, Liveness, fmt_bytes
from proto.vm.lower import lower
from proto.vm.recompute import convert_to_recompute
from proto.vm.timeline import Link, Timeline


# Link speeds, as multiples of the real one, that `plan` fits under. The fit is greedy and its
# timing model steers it: under a slow link the eviction windows are short, and it spends
# many small gaps where a few long ones would do (VGG-19 at 75% on managed memory's 10 GB/s
# evictions: 16 GB moved a step where 7 GB do). Every plan is valid whatever link it assumed
# (a release waits for its copy), so each is timed with the real link and the fastest kept.
LINK_SCALES = (1.0, 0.5, 2.0, 4.0, 8.0)


def plan(tape: Tape, budget: int | None = None, *, op_seconds=None, link: Link = Link(),
         lookahead: int | None = None, recompute: bool = False, order: str = "per_traffic",
         host_copy: bool = True, link_scales=LINK_SCALES) -> Plan:
    """Schedule one training step of `tape` to hold at most `budget` device bytes.

    budget None: the unconstrained plan (nothing moves; the arena is the placed peak).
    op_seconds: measured (or estimated) seconds of each op; link: host-link bandwidth.
    lookahead: issue each prefetch this many ops before its use (None: from the timing model).
    recompute: where the link is the bottleneck, recompute cheap activations instead of copying.
    order: which gap to spend first: 'gap' (longest), 'bytes_x_gap' (most byte-ops freed) or
        'per_traffic' (most byte-ops freed per byte the link must carry: clean tensors, which
        go back without a copy, are cheap).
    host_copy: whether a tensor brought back to the device keeps its host copy (pinned
        buffers, the pool executor: True), so that it can leave again without a copy if nothing
        wrote it. Managed memory moves pages and keeps one copy of each (False): every tensor
        that leaves is copied, and its bytes are free only once the copy is done.
    link_scales: link speeds (multiples of `link`) to fit under; the plan that
        `estimate_seconds` with the real link times fastest is returned (see LINK_SCALES).
    Raises BudgetError (naming the op and the bytes it needs) if the budget cannot work.
    """
    if order not in GAP_ORDERS:
        raise ValueError(f"order: expected 'gap', 'bytes_x_gap' or 'per_traffic', got {order!r}")
    if lookahead is not None:
        lookahead = _check.positive("lookahead", lookahead)
    if not isinstance(link, Link):
        raise ValueError(f"link: expected a Link, got {type(link).__name__}")
    if not isinstance(host_copy, bool):
        raise ValueError(f"host_copy: expected True or False, got {host_copy!r}")
    scales = tuple(link_scales)
    if not scales:
        raise ValueError("link_scales: expected at least one scale (1.0: the link as given)")
    for k, f in enumerate(scales):
        _check.number(f"link_scales[{k}]", f, positive=True)
    timeline = Timeline(tape, op_seconds, link, lookahead, host_copy)
    if budget is None:
        return lower(Liveness(tape), {}, timeline, budget=None)[0]
    budget = _check.positive("budget", budget)
    Liveness(tape).check_budget(budget)
    best, best_s, first_error = None, float("inf"), None
    for f in scales:
        assumed = timeline if f == 1 else Timeline(
            tape, timeline.op_seconds, Link(h2d=link.h2d * f, d2h=link.d2h * f), lookahead, host_copy)
        try:
            p = _fit_and_lower(tape, budget, assumed, recompute, order)
        except BudgetError as e:
            first_error = first_error or e
            continue
        s = estimate_seconds(tape, p, timeline.op_seconds, link)
        if s < best_s:
            best, best_s = p, s
    if best is None:
        raise first_error
    return best


def _fit_and_lower(tape: Tape, budget: int, timeline: Timeline, recompute: bool, order: str) -> Plan:
    """One plan under `timeline`'s link (see plan)."""
    # Placement can fragment: the arena then needs more than the profile's peak. Lower the
    # target of the ops where it overflows (never below what they must hold) and plan again;
    # when that stops helping, lower every op's target.
    live, chosen = Liveness(tape), {}
    need = [max(f, live.working_set(i)) for i, f in enumerate(live.floor_bytes)]
    limits = [budget] * len(tape.ops)
    for attempt in range(24):
        try:   # limits only come down: the last choices are a fine start
            chosen = fit(timeline, live, limits, chosen, order)
        except BudgetError:
            if attempt == 0:
                raise
            break
        used = live, chosen
        result, extent = lower(live, chosen, timeline, budget=budget)
        if recompute:   # worth it only if it still packs
            converted = convert_to_recompute(tape, live, chosen, timeline, limits, order)
            more = lower(*converted, timeline, budget=budget)
            if more[0].arena_bytes <= budget or result.arena_bytes > budget:
                (result, extent), used = more, converted
        if result.arena_bytes <= budget:
            return result
        held = timeline.profile(used[0], timeline.windows(*used))
        excess = result.arena_bytes - budget
        lowered = [max(min(lim, h) - (e - budget), n) if e > budget else lim
                   for lim, e, h, n in zip(limits, extent, held, need)]
        if lowered == limits:
            lowered = [max(min(lim, h) - excess, n) for lim, h, n in zip(limits, held, need)]
        if lowered == limits:
            break
        limits = lowered
    raise BudgetError(f"budget {fmt_bytes(budget)}: the schedule fits in bytes, but its blocks do "
                      "not pack into an arena that small (fragmentation); give a little more")
