"""Choosing gaps to spend off the device until every op fits its byte limit.

`fit` is pure: it returns a new {gap: Choice} and leaves the one it is given as it was, so a
caller can keep earlier choices (to retry from, or to compare with) without copying them.
"""
from __future__ import annotations

from proto.vm.liveness import BudgetError, Gap, Liveness
from proto.vm.timeline import Choice, Timeline, contains

GAP_ORDERS = ("gap", "bytes_x_gap", "per_traffic")   # which gap `fit` spends first (see schedule.plan)


def fit(timeline: Timeline, live: Liveness, limits: list[int], chosen: dict[Gap, Choice],
        order: str) -> dict[Gap, Choice]:
    """`chosen` plus the gaps (and wider windows) it takes for every op to fit, first
    over-budget op first (op i may hold at most limits[i] bytes), less any choice that turned
    out not to be needed.

    Choosing a persistent tensor's gap inside the step also chooses its wrap gap: the tensor
    then starts and ends each step on the host, so it needs no fixed place."""
    n = timeline.n
    chosen = dict(chosen)   # Choices are frozen: copying the dict leaves the caller's intact
    wrap_of = {g.tensor: g for g in live.gaps if g.wrap}

    def traffic(g):
        """Bytes over the link per step if g is spent on the host (a guess: the exact
        count depends on the other choices), counting the wrap gap it would drag in."""
        moved = g.nbytes * (timeline.may_copy(live, g) + live.reads_at(g.tensor, g.before % n))
        drag = wrap_of.get(g.tensor)
        return moved + (traffic(drag) if drag is not None and drag != g and drag not in chosen else 0)

    score = {"gap": lambda g: g.length,
             "bytes_x_gap": lambda g: g.nbytes * g.length,
             "per_traffic": lambda g: g.nbytes * g.length / max(traffic(g), 1)}[order]

    def choose(g):
        if g.tensor in wrap_of:
            chosen.setdefault(wrap_of[g.tensor], Choice("offload", 2 * n, 0))
        return chosen.setdefault(g, Choice("offload", 2 * n, 0))

    while True:
        windows = timeline.windows(live, chosen)
        prof = timeline.profile(live, windows)
        i = next((k for k in range(n) if prof[k] > limits[k]), None)
        if i is None:
            return _prune(timeline, live, limits, chosen, windows)
        covering = [g for g in live.gaps if g.covers(i, n)]
        fresh = [g for g in covering
                 if g not in chosen and contains(timeline.natural_window(g, live), i, n)]
        if fresh:   # gaps whose copies can overlap compute free op i: take the best
            need = prof[i] - limits[i]
            for g in sorted(fresh, key=lambda g: (score(g), g.tensor, g.after), reverse=True):
                choose(g)
                need -= g.nbytes
                if need <= 0:
                    break
            continue
        # Otherwise compute will have to wait somewhere: widen windows until they cover
        # op i, cheapest wait per byte freed first.
        stuck = [g for g in covering if not (g in windows and contains(windows[g], i, n))]
        if not stuck:
            raise BudgetError(f"no tensor can leave the device at op {timeline.tape.ops[i].name!r}")
        need = prof[i] - limits[i]
        for g in sorted(stuck, key=lambda g: (timeline.forced_wait(g, i, live) / g.nbytes, -g.nbytes,
                                              g not in chosen, g.tensor, g.after)):
            c = choose(g)
            if g.after < i:            # open the window from op i on ...
                chosen[g] = Choice(c.mode, min(c.release_by, i), max(c.prefetch_from, i + 1))
            else:                      # ... or, for a wrap gap, until op i of the next step
                chosen[g] = Choice(c.mode, c.release_by, max(c.prefetch_from, i + n + 1))
            need -= g.nbytes
            if need <= 0:
                break


def _prune(timeline: Timeline, live: Liveness, limits, chosen, windows) -> dict[Gap, Choice]:
    """Undo choices the step turns out not to need: fixing ops one at a time, early ones
    take gaps that later choices make redundant. Try dropping each offloaded gap, the
    biggest first (a wrap gap together with the tensor's other gaps, which need it), and
    keep every drop after which the step still fits."""
    n = timeline.n
    prof = timeline.profile(live, windows)
    for g in sorted(chosen, key=lambda g: (-g.nbytes, g.tensor, g.after)):
        if g not in chosen or chosen[g].mode != "offload":
            continue
        gone = [k for k in chosen if k == g or (g.wrap and k.tensor == g.tensor)]
        # Quick refusal: the bytes coming back alone would pass a limit.
        back = [0] * n
        for k in gone:
            r, p = windows[k]
            for j in range(r, p):
                back[j % n] += k.nbytes
        if any(prof[i] + back[i] > limits[i] for i in range(n)):
            continue
        trial = {k: v for k, v in chosen.items() if k not in gone}
        trial_windows = timeline.windows(live, trial)
        trial_prof = timeline.profile(live, trial_windows)
        if all(b <= lim for b, lim in zip(trial_prof, limits)):
            chosen, windows, prof = trial, trial_windows, trial_prof
    return chosen
