"""The AutoVM planner: which tensors leave the device, when they go, when they come back.

From the tape's op order and each tensor's uses (liveness.py) the planner picks gaps to spend
off the device until every op fits the budget, then turns them into actions around each op:

    before[i]:  release   compute waits for an eviction's copy; its bytes are free again
                alloc     a tensor's first write this step, at a planned arena offset
                prefetch  host -> device on the H2D stream, once compute is done with the bytes
                wait      compute waits for a prefetch that op i (or a recompute) reads
                recompute re-run a cheap producer op instead of copying its output back
    after[i]:   evict     device -> pinned host on the D2H stream, after op i
                discard   the host copy is still current (nothing wrote the tensor since it
                          arrived): just free the device bytes, nothing to copy
                drop      forget a tensor that will be recomputed
                free      last use
    end:        release   evictions still in flight when the step ends

Persistent tensors whose wrap gap is spent on the host are *homed* there: each step prefetches
them before their first use and evicts them after their last (the momentum buffers, the big
classifier weights). The rest stay at fixed offsets.

The plan is plain data so `validate` can check it without a GPU: nothing is touched while not
resident, the budget holds after every action, blocks never overlap, and every tensor sent
away comes back before its next use. The executor (executor.py) only replays it.

Timing model (to place releases and prefetches so copies overlap compute): ops take
`op_seconds`, copies take bytes / link bandwidth on one FIFO stream per direction. An eviction
is released at the first op that starts after its copy should be done; a prefetch is issued
at the last op boundary from which it still arrives in time (or `lookahead` ops ahead).
Where the budget is tighter than that allows, windows are widened and compute waits.
Time and op indices of the next step continue past n (op i of the next step is n + i).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Literal

from kernels import _check
from proto.tape import Tape
from proto.vm.liveness import BudgetError, Gap, Liveness, align_up, fmt_bytes
from proto.graph.plan import Block, place

ActionKind = Literal["alloc", "free", "evict", "discard", "release", "prefetch", "wait", "drop",
                     "recompute"]
_BEFORE_ORDER = {"release": 0, "alloc": 1, "prefetch": 2, "wait": 3, "recompute": 4}
_AFTER_ORDER = {"evict": 0, "discard": 1, "drop": 2, "free": 3}


@dataclasses.dataclass(frozen=True)
class Action:
    kind: ActionKind
    tensor: str
    offset: int = -1      # arena offset, for the actions that take memory (alloc, prefetch, recompute)
    producer: int = -1    # recompute: the op to re-run


@dataclasses.dataclass(frozen=True)
class Link:
    """Host-link bandwidth in bytes/s, per direction (pinned memory)."""
    h2d: float = 54e9     # measured on the H200 (pinned memory, both directions)
    d2h: float = 55e9

    def __post_init__(self):   # copy times divide by these: 0, NaN or inf would mislead
        for name in ("h2d", "d2h"):
            _check.number(f"Link.{name}", getattr(self, name), positive=True)


@dataclasses.dataclass
class Plan:
    budget: int
    arena_bytes: int
    persistent: dict[str, int]          # name -> offset: resident at a fixed place all step
    homed: tuple[str, ...]              # persistent tensors that live on the host between steps
    before: list[list[Action]]
    after: list[list[Action]]
    end: list[Action]
    offloaded: list[Gap]                # gaps spent on the host
    recomputed: list[Gap]               # gaps spent dropped, then recomputed
    peak_bytes: int                     # the most bytes resident at any point
    d2h_bytes: int = 0                  # copied each step, each way
    h2d_bytes: int = 0

    def link_seconds(self, link: Link) -> float:
        """Time the host link needs for this plan's copies (the two directions run at once)."""
        return max(self.d2h_bytes / link.d2h, self.h2d_bytes / link.h2d)

    def actions(self):
        """(slot, op index, action) in execution order; slot is 'before', 'after' or 'end'."""
        for i, (pre, post) in enumerate(zip(self.before, self.after)):
            yield from (("before", i, a) for a in pre)
            yield from (("after", i, a) for a in post)
        yield from (("end", len(self.before), a) for a in self.end)


class PlanError(AssertionError):
    """A plan breaks one of the rules `validate` checks."""


def estimate_op_seconds(tape: Tape, flops_per_s: float = 20e12, bytes_per_s: float = 3e12) -> list[float]:
    """A roofline guess per op, used when no measured profile is given."""
    out = []
    for op in tape.ops:
        nbytes = sum(tape.tensors[n].nbytes for n in set(op.reads) | set(op.writes))
        out.append(max(op.flops / flops_per_s, nbytes / bytes_per_s, 2e-6))
    return out


# ------------------------------------------------------------------------------- planning
@dataclasses.dataclass
class _Choice:
    mode: Literal["offload", "recompute"]
    release_by: int     # release no later than before this op (forced when the budget is tight)
    prefetch_from: int  # prefetch no earlier than this op


def _contains(window: tuple[int, int], i: int, n: int) -> bool:
    """Is op i of this step inside [release, prefetch) (which may run into the next step)?"""
    r, p = window
    return r <= i < p or r <= i + n < p


class _Planner:
    def __init__(self, tape: Tape, op_seconds, link: Link, lookahead: int | None):
        self.tape, self.link, self.lookahead = tape, link, lookahead
        self.n = n = len(tape.ops)
        self.op_seconds = list(op_seconds) if op_seconds is not None else estimate_op_seconds(tape)
        if len(self.op_seconds) != n:
            raise ValueError(f"op_seconds: expected {n} values (one per op), got {len(self.op_seconds)}")
        for i, s in enumerate(self.op_seconds):
            _check.number(f"op_seconds[{i}] ({tape.ops[i].name})", s, at_least=0)
        # start[i]: when op i begins, for this step and the next (i up to 2n)
        self.start = list(itertools.accumulate(self.op_seconds * 2, initial=0.0))
        self._dirty_memo: dict = {}

    # -- when copies can overlap compute --------------------------------------------------
    def _release_op(self, g: Gap, d2h_free: float) -> tuple[int, float]:
        """The first op that starts after g's eviction (queued behind `d2h_free`) is done;
        at most the end of the step (n)."""
        done = max(self.start[g.after + 1], d2h_free) + g.nbytes / self.link.d2h
        return bisect.bisect_left(self.start, done, g.after + 1, min(g.before, self.n)), done

    def _prefetch_op(self, g: Gap, h2d_next: float, live: Liveness) -> tuple[int, float]:
        """The last op boundary from which g's prefetch (queued before one that starts at
        `h2d_next`) still lands before op g.before starts; or `lookahead` ops ahead. A wrap
        gap's prefetch happens in the step that uses it (from op n on)."""
        if not live.reads_at(g.tensor, g.before % self.n):
            return g.before, h2d_next          # the use overwrites it: nothing comes back
        lo = max(g.after + 1, self.n if g.wrap else 0)
        if self.lookahead is not None:
            p = max(g.before - self.lookahead, lo)
            return p, self.start[p]
        latest = min(self.start[g.before], h2d_next) - g.nbytes / self.link.h2d
        p = max(bisect.bisect_right(self.start, latest, lo, g.before + 1) - 1, lo)
        return p, min(self.start[p], latest)

    def natural_window(self, g: Gap, live: Liveness) -> tuple[int, int]:
        """Ops [release, prefetch) g would spend off the device with the copy streams to itself."""
        return self._release_op(g, 0.0)[0], self._prefetch_op(g, float("inf"), live)[0]

    def dirty(self, live: Liveness, chosen: dict[Gap, _Choice]) -> set[Gap]:
        """Offloaded gaps whose eviction must copy: the tensor was written since it last came
        from the host (homed tensors start the step with a current host copy)."""
        out = set()
        by_tensor: dict[str, list[Gap]] = {}
        for g in chosen:
            by_tensor.setdefault(g.tensor, []).append(g)
        for name, gaps in by_tensor.items():
            key = (id(live), tuple(sorted((g.after, g.before, chosen[g].mode) for g in gaps)))
            hit = self._dirty_memo.get((name, key))
            if hit is None:
                hit = self._dirty_memo[(name, key)] = self._dirty_chain(live, name, gaps, chosen)
            out.update(hit)
        return out

    @staticmethod
    def _dirty_chain(live: Liveness, name: str, gaps: list[Gap], chosen) -> list[Gap]:
        out, host_current, pos = [], name in live.persistent, 0
        for g in sorted(gaps, key=lambda g: g.after):
            if live.written_between(name, pos, g.after):
                host_current = False
            if chosen[g].mode == "recompute":
                host_current = False
            elif not host_current:
                out.append(g)
                host_current = True
            pos = g.before
        return out

    def windows(self, live: Liveness, chosen: dict[Gap, _Choice]) -> dict[Gap, tuple[int, int]]:
        """Ops [release, prefetch) during which each chosen gap holds no device memory, with
        evictions queued FIFO on one stream and prefetches on another."""
        offload = [g for g, c in chosen.items() if c.mode == "offload"]
        dirty = self.dirty(live, chosen)
        release, d2h_free = {}, 0.0
        for g in sorted(offload, key=lambda g: (g.after, g.tensor)):
            if g in dirty:
                release[g], d2h_free = self._release_op(g, d2h_free)
            else:
                release[g] = g.after + 1    # the host copy is current: free at once
        prefetch, h2d_next = {}, float("inf")
        for g in sorted(offload, key=lambda g: (-g.before, g.tensor)):
            prefetch[g], h2d_next = self._prefetch_op(g, h2d_next, live)
        out = {}
        for g, c in chosen.items():
            if c.mode == "recompute":
                out[g] = (g.after + 1, g.before)
            else:
                r = min(release[g], c.release_by)
                out[g] = (r, min(max(prefetch[g], c.prefetch_from, r), g.before))
        return out

    def link_seconds(self, live: Liveness, chosen: dict[Gap, _Choice]) -> float:
        """Host-link time of the copies `chosen` implies (both directions run at once)."""
        dirty = self.dirty(live, chosen)
        d2h = sum(g.nbytes for g in dirty)
        h2d = sum(g.nbytes for g, c in chosen.items()
                  if c.mode == "offload" and live.reads_at(g.tensor, g.before % self.n))
        return max(d2h / self.link.d2h, h2d / self.link.h2d)

    def profile(self, live: Liveness, windows) -> list[int]:
        """Resident bytes during each op when each gap frees its window."""
        n = self.n
        diff = [0] * (2 * n + 1)
        for g, (r, p) in windows.items():
            if r < p:
                diff[r] += g.nbytes
                diff[p] -= g.nbytes
        freed = list(itertools.accumulate(diff))
        return [live.live_bytes[i] - freed[i] - freed[i + n] for i in range(n)]

    # -- choosing gaps until every op fits ------------------------------------------------
    def fit(self, live: Liveness, limits: list[int], chosen: dict[Gap, _Choice], order: str) -> dict[Gap, _Choice]:
        """Add or widen gaps, first over-budget op first, until the profile fits (op i may
        hold at most limits[i] bytes).

        Choosing a persistent tensor's gap inside the step also chooses its wrap gap: the
        tensor then starts and ends each step on the host, so it needs no fixed place."""
        n = self.n
        wrap_of = {g.tensor: g for g in live.gaps if g.wrap}

        def traffic(g):
            """Bytes over the link per step if g is spent on the host (a guess: the exact
            count depends on the other choices), counting the wrap gap it would drag in."""
            if g.wrap:
                written = live.written_between(g.tensor, 0, n - 1)
            else:
                written = live.written_between(g.tensor, live.first(g.tensor), g.after)
            moved = g.nbytes * (written + live.reads_at(g.tensor, g.before % n))
            drag = wrap_of.get(g.tensor)
            return moved + (traffic(drag) if drag is not None and drag != g and drag not in chosen else 0)

        score = {"gap": lambda g: g.length,
                 "bytes_x_gap": lambda g: g.nbytes * g.length,
                 "per_traffic": lambda g: g.nbytes * g.length / max(traffic(g), 1)}[order]

        def choose(g):
            if g.tensor in wrap_of:
                chosen.setdefault(wrap_of[g.tensor], _Choice("offload", 2 * n, 0))
            return chosen.setdefault(g, _Choice("offload", 2 * n, 0))

        while True:
            windows = self.windows(live, chosen)
            prof = self.profile(live, windows)
            i = next((k for k in range(n) if prof[k] > limits[k]), None)
            if i is None:
                return self._prune(live, limits, chosen, windows)
            covering = [g for g in live.gaps if g.covers(i, n)]
            fresh = [g for g in covering
                     if g not in chosen and _contains(self.natural_window(g, live), i, n)]
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
            stuck = [g for g in covering if not (g in windows and _contains(windows[g], i, n))]
            if not stuck:
                raise BudgetError(f"no tensor can leave the device at op {self.tape.ops[i].name!r}")
            need = prof[i] - limits[i]
            for g in sorted(stuck, key=lambda g: (self._forced_wait(g, i, live) / g.nbytes, -g.nbytes,
                                                  g not in chosen, g.tensor, g.after)):
                c = choose(g)
                if g.after < i:            # open the window from op i on ...
                    c.release_by = min(c.release_by, i)
                    c.prefetch_from = max(c.prefetch_from, i + 1)
                else:                      # ... or, for a wrap gap, until op i of the next step
                    c.prefetch_from = max(c.prefetch_from, i + n + 1)
                need -= g.nbytes
                if need <= 0:
                    break


    def _forced_wait(self, g: Gap, i: int, live: Liveness) -> float:
        """Seconds compute would wait if g had to be off the device during op i: for the
        eviction to finish before op i, and for the prefetch issued after op i to land."""
        wait = 0.0
        if g.after < i:
            wait += max(0.0, self.start[g.after + 1] + g.nbytes / self.link.d2h - self.start[i])
        if live.reads_at(g.tensor, g.before % self.n):
            after_i = i + 1 if i < g.before else i + self.n + 1
            wait += max(0.0, self.start[after_i] + g.nbytes / self.link.h2d - self.start[g.before])
        return wait

    def _prune(self, live, limits, chosen, windows) -> dict[Gap, _Choice]:
        """Undo choices the step turns out not to need: fixing ops one at a time, early ones
        take gaps that later choices make redundant. Try dropping each offloaded gap, the
        biggest first (a wrap gap together with the tensor's other gaps, which need it), and
        keep every drop after which the step still fits."""
        n = self.n
        prof = self.profile(live, windows)
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
            trial_windows = self.windows(live, trial)
            trial_prof = self.profile(live, trial_windows)
            if all(b <= lim for b, lim in zip(trial_prof, limits)):
                chosen, windows, prof = trial, trial_windows, trial_prof
        return chosen


def plan(tape: Tape, budget: int | None = None, *, op_seconds=None, link: Link = Link(),
         lookahead: int | None = None, recompute: bool = False, order: str = "per_traffic") -> Plan:
    """Schedule one training step of `tape` to hold at most `budget` device bytes.

    budget None: the unconstrained plan (nothing moves; the arena is the placed peak).
    op_seconds: measured (or estimated) seconds of each op; link: host-link bandwidth.
    lookahead: issue each prefetch this many ops before its use (None: from the timing model).
    recompute: where the link is the bottleneck, recompute cheap activations instead of copying.
    order: which gap to spend first: 'gap' (longest), 'bytes_x_gap' (most byte-ops freed) or
        'per_traffic' (most byte-ops freed per byte the link must carry: clean tensors, which
        go back without a copy, are cheap).
    Raises BudgetError (naming the op and the bytes it needs) if the budget cannot work.
    """
    if order not in ("gap", "bytes_x_gap", "per_traffic"):
        raise ValueError(f"order: expected 'gap', 'bytes_x_gap' or 'per_traffic', got {order!r}")
    if lookahead is not None:
        lookahead = _check.positive("lookahead", lookahead)
    if not isinstance(link, Link):
        raise ValueError(f"link: expected a Link, got {type(link).__name__}")
    planner = _Planner(tape, op_seconds, link, lookahead)
    if budget is None:
        return _build(Liveness(tape), {}, planner, budget=None)[0]
    budget = _check.positive("budget", budget)
    Liveness(tape).check_budget(budget)
    # Placement can fragment: the arena then needs more than the profile's peak. Lower the
    # target of the ops where it overflows (never below what they must hold) and plan again;
    # when that stops helping, lower every op's target.
    live, chosen = Liveness(tape), {}
    need = [max(f, live.working_set(i)) for i, f in enumerate(live.floor_bytes)]
    limits = [budget] * len(tape.ops)
    for attempt in range(24):
        try:   # limits only come down: the last choices are a fine start
            chosen = planner.fit(live, limits, {g: dataclasses.replace(c) for g, c in chosen.items()}, order)
        except BudgetError:
            if attempt == 0:
                raise
            break
        used = live, chosen
        result, extent = _build(live, chosen, planner, budget=budget)
        if recompute:   # worth it only if it still packs
            converted = _convert_to_recompute(tape, live, chosen, planner, limits, order)
            more = _build(*converted, planner, budget=budget)
            if more[0].arena_bytes <= budget or result.arena_bytes > budget:
                (result, extent), used = more, converted
        if result.arena_bytes <= budget:
            return result
        held = planner.profile(used[0], planner.windows(*used))
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


def _can_recompute(live: Liveness, g: Gap, chosen: dict[Gap, _Choice], planner: _Planner) -> bool:
    """Recompute g.tensor just before op g.before instead of copying it when: it is transient
    and its producer writes only it; the producer's inputs still hold the same values there and
    stay alive past it anyway (so no lifetime grows) and none is itself dropped across that
    point; and the producer runs faster than one copy of the tensor over the host link."""
    if g.wrap or g.tensor in live.persistent:
        return False
    p = live.first(g.tensor)
    if live.writes[p] != {g.tensor} or g.tensor in live.reads[p]:
        return False
    if planner.op_seconds[p] >= g.nbytes / min(planner.link.h2d, planner.link.d2h):
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


def _convert_to_recompute(tape, live, chosen, planner, limits, order):
    """Turn offloaded gaps, biggest first, into recomputations where that beats the link;
    keep each conversion only if the step still fits and the link has less to carry (an
    input read again earlier can push other tensors out)."""
    extra: dict[str, frozenset[int]] = {}
    for g in sorted([g for g, c in chosen.items() if c.mode == "offload"], key=lambda g: (-g.nbytes, g.tensor)):
        if g not in chosen or not _can_recompute(live, g, chosen, planner):
            continue
        # The producer's inputs are read again just before op g.before.
        trial_extra = dict(extra)
        for y in live.reads[live.first(g.tensor)]:
            trial_extra[y] = trial_extra.get(y, frozenset()) | {g.before}
        trial_live = Liveness(tape, trial_extra)
        if g not in set(trial_live.gaps):
            continue
        trial = _rekey(chosen, trial_live)
        trial[g] = _Choice("recompute", 2 * planner.n, 0)
        try:
            trial = planner.fit(trial_live, limits, trial, order)
        except BudgetError:
            continue
        if planner.link_seconds(trial_live, trial) < planner.link_seconds(live, chosen):
            live, chosen, extra = trial_live, trial, trial_extra
    return live, chosen


def _rekey(chosen: dict[Gap, _Choice], live: Liveness) -> dict[Gap, _Choice]:
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


def _build(live: Liveness, chosen: dict[Gap, _Choice], planner: _Planner, budget) -> tuple[Plan, list[int]]:
    """Turn chosen gaps into placed blocks and per-op actions; also returns, per op, the
    highest arena byte in use (above the budget where placement fragmented)."""
    tape, n = live.tape, live.n_ops
    windows = planner.windows(live, chosen)
    dirty = planner.dirty(live, chosen)
    homed = sorted(g.tensor for g in windows if g.wrap)
    fixed = [name for name in live.persistent if name not in homed]
    blocks = [Block(("fixed", name), 0, max(n - 1, 0), live.nbytes(name)) for name in fixed]

    # Each moving tensor's device residency: [(first op, last op, gap that ends it or None)]
    spans: dict[str, list[tuple[int, int, Gap | None]]] = {}
    for name in live.uses:
        if name in fixed:
            continue
        gaps = sorted((g for g in windows if g.tensor == name and not g.wrap), key=lambda g: g.after)
        wrap = next((g for g in windows if g.tensor == name and g.wrap), None)
        start = live.first(name) if wrap is None else windows[wrap][1] - n
        parts = []
        for g in gaps:
            parts.append((start, windows[g][0] - 1, g))
            start = windows[g][1]
        end = live.last(name) if wrap is None else windows[wrap][0] - 1
        parts.append((start, end, wrap))
        spans[name] = parts
        blocks.extend(Block((name, s), s, e, live.nbytes(name)) for s, e, _ in parts)
    offsets, arena = place(blocks)
    extent = [0] * n
    for blk in blocks:
        for i in range(blk.first, blk.last + 1):
            extent[i] = max(extent[i], offsets[blk.key] + align_up(blk.nbytes))

    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    end: list[Action] = []
    d2h = h2d = 0

    def arrive(name, g, s):
        """The tensor comes back for the use that closes gap g, into the block starting at s."""
        nonlocal h2d
        use = g.before % n
        if g in chosen and chosen[g].mode == "recompute":
            before[use].append(Action("recompute", name, offsets[(name, s)], live.first(name)))
        elif live.reads_at(name, use):
            before[s].append(Action("prefetch", name, offsets[(name, s)]))
            before[use].append(Action("wait", name))
            h2d += tape.tensors[name].nbytes
        else:
            before[use].append(Action("alloc", name, offsets[(name, s)]))

    def leave(name, g):
        """The tensor leaves after the use that opens gap g."""
        nonlocal d2h
        if chosen[g].mode == "recompute":
            after[g.after].append(Action("drop", name))
        elif g in dirty:
            after[g.after].append(Action("evict", name))
            r = windows[g][0]
            (before[r] if r < n else end).append(Action("release", name))
            d2h += tape.tensors[name].nbytes
        else:
            after[g.after].append(Action("discard", name))

    for name, parts in spans.items():
        wrap = parts[-1][2]
        if wrap is None:
            before[parts[0][0]].append(Action("alloc", name, offsets[(name, parts[0][0])]))
        else:
            arrive(name, wrap, parts[0][0])
        for (_, _, g), (s_next, _, _) in zip(parts, parts[1:]):
            leave(name, g)
            arrive(name, g, s_next)
        if wrap is not None:
            leave(name, wrap)
        elif name not in live.outputs:
            after[parts[-1][1]].append(Action("free", name))
    for i in range(n):   # recomputations in producer order: one may feed the next
        before[i].sort(key=lambda a: (_BEFORE_ORDER[a.kind], a.producer, a.tensor))
        after[i].sort(key=lambda a: (_AFTER_ORDER[a.kind], a.tensor))
    by_mode = {m: sorted((g for g in windows if chosen[g].mode == m), key=lambda g: (g.after, g.tensor))
               for m in ("offload", "recompute")}
    return Plan(budget=arena if budget is None else budget, arena_bytes=arena,
                persistent={name: offsets[("fixed", name)] for name in fixed}, homed=tuple(homed),
                before=before, after=after, end=end, offloaded=by_mode["offload"],
                recomputed=by_mode["recompute"],
                peak_bytes=max(planner.profile(live, windows), default=live.persistent_bytes),
                d2h_bytes=d2h, h2d_bytes=h2d), extent


def estimate_seconds(tape: Tape, plan: Plan, op_seconds, link: Link = Link()) -> float:
    """Step time the plan should take: ops run back to back on the compute stream except where
    it waits for a copy; each copy stream serves its copies in issue order, a prefetch starting
    once the compute work before it is done (as the executor orders them)."""
    compute = d2h_free = h2d_free = 0.0
    evicted: dict[str, float] = {}
    arrived: dict[str, float] = {}

    def apply(act: Action):
        nonlocal compute, d2h_free, h2d_free
        nbytes = tape.tensors[act.tensor].nbytes
        if act.kind == "release":
            compute = max(compute, evicted[act.tensor])
        elif act.kind == "prefetch":
            h2d_free = arrived[act.tensor] = max(h2d_free, compute) + nbytes / link.h2d
        elif act.kind == "wait":
            compute = max(compute, arrived[act.tensor])
        elif act.kind == "recompute":
            compute += op_seconds[act.producer]
        elif act.kind == "evict":
            d2h_free = evicted[act.tensor] = max(d2h_free, compute) + nbytes / link.d2h

    for i in range(len(tape.ops)):
        for act in plan.before[i]:
            apply(act)
        compute += op_seconds[i]
        for act in plan.after[i]:
            apply(act)
    for act in plan.end:
        apply(act)
    return compute


# ------------------------------------------------------------------------------- checking
def validate(tape: Tape, plan: Plan) -> None:
    """Replay `plan` symbolically; raise PlanError at the first broken rule.

    Rules: what an op (or a recomputation) reads is resident and holds data; what an op writes
    is resident and not being copied out; resident bytes stay within the budget after every
    action; blocks lie inside the arena and never overlap; a tensor is discarded only while its
    host copy is current; every tensor sent to the host is released, prefetched and waited for
    before its next use; at the end only outputs remain, and homed tensors are back home.
    """
    n = len(tape.ops)
    if not _check._is_integer(plan.budget) or plan.budget <= 0:   # NaN would pass every check
        raise PlanError(f"plan.budget: expected a positive integer number of bytes, got {plan.budget!r}")
    if len(plan.before) != n or len(plan.after) != n:
        raise PlanError(f"plan has {len(plan.before)}/{len(plan.after)} action lists for {n} ops")
    if plan.arena_bytes > plan.budget:
        raise PlanError(f"arena of {plan.arena_bytes} bytes passes the budget {plan.budget}")
    live = Liveness(tape)
    if set(plan.persistent) | set(plan.homed) != set(live.persistent) or set(plan.persistent) & set(plan.homed):
        raise PlanError("the plan's fixed and homed tensors do not split the tape's persistent ones")
    state = {name: "host" for name in plan.homed}   # absent|resident|evicting|host|prefetching|dropped
    filled = set(plan.persistent) | set(plan.homed)   # tensors holding data
    host_current = set(plan.homed)                    # host copy equals the data
    held = {name: (off, align_up(tape.tensors[name].nbytes)) for name, off in plan.persistent.items()}
    where = ""

    def fail(msg):
        raise PlanError(f"{where}: {msg}")

    def take(name, off):
        nbytes = align_up(tape.tensors[name].nbytes)   # blocks take whole alignment units
        if off < 0 or off + nbytes > plan.arena_bytes:
            fail(f"{name} at [{off}, {off + nbytes}) is outside the arena of {plan.arena_bytes}")
        for other, (o, b) in held.items():
            if off < o + b and o < off + nbytes:
                fail(f"{name} at [{off}, {off + nbytes}) overlaps {other} at [{o}, {o + b})")
        held[name] = (off, nbytes)
        total = sum(b for _, b in held.values())
        if total > plan.budget:
            fail(f"{total} bytes resident, past the budget {plan.budget}")

    def read(name):
        ok = name in plan.persistent or state.get(name) in ("resident", "evicting")
        if not ok or name not in filled:
            fail(f"reads {name} while it is {state.get(name, 'absent')}"
                 + ("" if name in filled else " and holds no data"))

    def move(name, frm, to):
        if name in plan.persistent:
            fail(f"moves {name}, which has a fixed place")
        if state.get(name, "absent") not in frm:
            fail(f"{name} is {state.get(name, 'absent')}, expected {' or '.join(frm)}")
        state[name] = to

    def apply(act: Action, i: int):
        name = act.tensor
        if act.kind == "alloc":
            if name not in tape.ops[i].writes:
                fail(f"allocates {name} before op {i}, which does not write it")
            move(name, ("absent", "host"), "resident")
            filled.discard(name)
            take(name, act.offset)
        elif act.kind == "free":
            move(name, ("resident",), "absent")
            held.pop(name)
        elif act.kind == "evict":
            if name not in filled:
                fail(f"evicts {name}, which holds no data")
            move(name, ("resident",), "evicting")
            host_current.add(name)
        elif act.kind == "discard":
            if name not in host_current:
                fail(f"discards {name}, whose host copy is not current")
            move(name, ("resident",), "host")
            held.pop(name)
        elif act.kind == "release":
            move(name, ("evicting",), "host")
            held.pop(name)
        elif act.kind == "prefetch":
            if name not in host_current:
                fail(f"prefetches {name}, which has no current host copy")
            move(name, ("host",), "prefetching")
            take(name, act.offset)
        elif act.kind == "wait":
            move(name, ("prefetching",), "resident")
            filled.add(name)
        elif act.kind == "drop":
            move(name, ("resident",), "dropped")
            held.pop(name)
            filled.discard(name)
        elif act.kind == "recompute":
            if not 0 <= act.producer < n or tuple(tape.ops[act.producer].writes) != (name,):
                fail(f"op {act.producer} does not write exactly {name}, so it cannot recompute it")
            for r in tape.ops[act.producer].reads:
                read(r)
            move(name, ("dropped",), "resident")
            take(name, act.offset)
            filled.add(name)
            host_current.discard(name)
        else:
            fail(f"unknown action kind {act.kind!r}")

    for i, op in enumerate(tape.ops):
        for act in plan.before[i]:
            where = f"before op {i} ({op.name}), {act.kind} {act.tensor}"
            apply(act, i)
        where = f"op {i} ({op.name})"
        for name in op.reads:
            read(name)
        for name in op.writes:
            if name not in plan.persistent and state.get(name) != "resident":
                fail(f"writes {name} while it is {state.get(name, 'absent')}")
            filled.add(name)
            host_current.discard(name)
        for act in plan.after[i]:
            where = f"after op {i} ({op.name}), {act.kind} {act.tensor}"
            apply(act, i)
    for act in plan.end:
        where = f"at the end, {act.kind} {act.tensor}"
        apply(act, n - 1)
    where = "at the end of the step"
    left = {k: v for k, v in state.items() if k not in plan.homed
            and v != "absent" and not (v == "resident" and k in live.outputs)}
    if left:
        fail(f"these tensors are still held: {left}")
    away = {k: state[k] for k in plan.homed if state[k] != "host" or k not in host_current}
    if away:
        fail(f"homed tensors not back on the host with current data: {away}")
