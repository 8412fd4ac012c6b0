"""Recomputation: spend a gap with the tensor dropped and its producer re-run before the next
use, instead of copied out and back, where the producer is cheaper than the link."""
from __future__ import annotations

import dataclasses

from proto.tape import Tape
from proto.vm.fit import fit
from proto.vm.liveness import BudgetError, Gap, Liveness
from proto.vm.timeline import Choice, Timeline


def convert_to_recompute(tape: Tape, live: Liveness, chosen: dict[Gap, Choice], timeline: Timeline,
                         limits: list[int], order: str) -> tuple[Liveness, dict[Gap, Choice]]:
    """Turn offloaded gaps, biggest first, into recomputations where that beats the link;
    keep each conversion only if the step still fits and the link has less to carry (an
    input read again earlier can push other tensors out). Returns the liveness with the
    producers' extra reads, and the choices under it."""
    extra: dict[str, frozenset[int]] = {}
    for g in sorted([g for g, c in chosen.items() if c.mode == "offload"], key=lambda g: (-g.nbytes, g.tensor)):
        if g not in chosen or not can_recompute(live, g, chosen, timeline):
            continue
        # The producer's inputs are read again just before op g.before.
        trial_extra = dict(extra)
        for y in live.reads[live.first(g.tensor)]:
            trial_extra[y] = trial_extra.get(y, frozenset()) | {g.before}
        trial_live = Liveness(tape, trial_extra)
        if g not in set(trial_live.gaps):
            continue
        trial = _rekey(chosen, trial_live)
        trial[g] = Choice("recompute", 2 * timeline.n, 0)
        try:
            trial = fit(timeline, trial_live, limits, trial, order)
        except BudgetError:
            continue
        if timeline.link_seconds(trial_live, trial) < timeline.link_seconds(live, chosen):
            live, chosen, extra = trial_live, trial, trial_extra
    return live, chosen


def can_recompute(live: Liveness, g: Gap, chosen: dict[Gap, Choice], timeline: Timeline) -> bool:
    """Recompute g.tensor just before op g.before instead of copying it when: it is transient,
    its producer writes only it, and nothing changed it in place since; the producer's inputs
    still hold the same values there and stay alive past it anyway (so no lifetime grows) and
    none is itself dropped across that point; and the producer runs faster than one copy of
    the tensor over the host link."""
    if g.wrap or g.tensor in live.persistent:
        return False
    p = live.first(g.tensor)
    if live.writes[p] != {g.tensor} or g.tensor in live.reads[p]:
        return False
    if live.written_between(g.tensor, p + 1, g.after):   # changed in place since: the
        return False                                      # producer would not give it back
    if timeline.op_seconds[p] >= g.nbytes / min(timeline.link.h2d, timeline.link.d2h):
        return False
    for y in live.reads[p]:
        if live.written_between(y, p + 1, g.before - 1):
            return False
        if live.last(y) < g.before:
            return False
        if any(h.tensor == y and c.mode == "recompute" and h.after < g.before < h.before
               for h, c in chosen.items()):
            return False
    return True


def _rekey(chosen: dict[Gap, Choice], live: Liveness) -> dict[Gap, Choice]:
    """Chosen gaps after extra reads split some: each becomes the gap that starts where it
    started (an extra read can only end it sooner)."""
    by_start = {(g.tensor, g.after): g for g in live.gaps}
    out = {}
    for g, c in chosen.items():
        new = by_start.get((g.tensor, g.after))
        if new is not None:
            out[new] = dataclasses.replace(c, release_by=min(c.release_by, new.before),
                                           prefetch_from=min(c.prefetch_from, new.before))
    return out
