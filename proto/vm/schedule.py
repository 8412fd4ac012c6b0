"""The AutoVM planner: which activations leave the device, when they go, when they come back.

From the tape's layer order and each tensor's uses (liveness.py) the planner picks gaps to spend
off the device until every op fits the budget, then turns them into actions around each op:

    before[i]:  release (compute waits for an eviction's copy, then its bytes are free)
                alloc   (first write of a tensor, at a planned arena offset)
                prefetch (host -> device on the H2D stream, after the compute work so far)
                wait    (compute waits for a prefetch that op i or a recompute needs)
                recompute (re-run a cheap producer op instead of copying its output back)
    after[i]:   evict   (device -> pinned host on the D2H stream, after op i)
                drop    (forget a tensor that will be recomputed)
                free    (last use)

The plan is plain data so `validate` can check it without a GPU: nothing is touched while not
resident, the budget holds after every action, blocks never overlap, and every tensor sent away
comes back before its next use. The executor (executor.py) only replays it.

Timing model (to place releases and prefetches so copies overlap compute): ops take
`op_seconds`, copies take bytes / link bandwidth on one FIFO stream per direction. An eviction
is released at the first op that starts after its copy should be done; a prefetch is issued
at the last op boundary from which it can still arrive in time (or `lookahead` ops ahead).
Where the budget is tighter than that allows, windows are widened and compute waits.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Literal

from proto.tape import Tape
from proto.vm.liveness import BudgetError, Gap, Liveness, fmt_bytes
from proto.vm.pool import Block, align_up, place

ActionKind = Literal["alloc", "free", "evict", "release", "prefetch", "wait", "drop", "recompute"]
_BEFORE_ORDER = {"release": 0, "alloc": 1, "prefetch": 2, "wait": 3, "recompute": 4}
_AFTER_ORDER = {"evict": 0, "drop": 1, "free": 2}


@dataclasses.dataclass(frozen=True)
class Action:
    kind: ActionKind
    tensor: str
    offset: int = -1      # arena offset, for the actions that take memory (alloc, prefetch, recompute)
    producer: int = -1    # recompute: the op to re-run


@dataclasses.dataclass(frozen=True)
class Link:
    """Host-link bandwidth in bytes/s, per direction (pinned memory)."""
    h2d: float = 54e9     # measured on the H200 (shared/DESIGN.md)
    d2h: float = 55e9


@dataclasses.dataclass
class Plan:
    budget: int
    arena_bytes: int
    persistent: dict[str, int]          # name -> offset; resident for the whole step
    before: list[list[Action]]
    after: list[list[Action]]
    offloaded: list[Gap]                # gaps spent on the host
    recomputed: list[Gap]               # gaps spent dropped, then recomputed
    peak_bytes: int                     # the most bytes resident at any point

    @property
    def d2h_bytes(self) -> int:
        return sum(g.nbytes for g in self.offloaded)

    @property
    def h2d_bytes(self) -> int:
        return self.d2h_bytes

    def link_seconds(self, link: Link) -> float:
        """Time the host link needs for this plan's copies (the two directions run at once)."""
        return max(self.d2h_bytes / link.d2h, self.h2d_bytes / link.h2d)

    def actions(self):
        """(slot, op index, action) in execution order; slot is 'before' or 'after'."""
        for i, (pre, post) in enumerate(zip(self.before, self.after)):
            yield from (("before", i, a) for a in pre)
            yield from (("after", i, a) for a in post)


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
    release_by: int    # release no later than before this op (forced when the budget is tight)
    prefetch_from: int  # prefetch no earlier than this op


class _Planner:
    def __init__(self, tape: Tape, op_seconds, link: Link, lookahead: int | None):
        self.tape, self.link, self.lookahead = tape, link, lookahead
        self.n = len(tape.ops)
        self.op_seconds = list(op_seconds) if op_seconds is not None else estimate_op_seconds(tape)
        if len(self.op_seconds) != self.n:
            raise ValueError(f"op_seconds: expected {self.n} values (one per op), got {len(self.op_seconds)}")
        self.start = list(itertools.accumulate(self.op_seconds, initial=0.0))  # start[i]: op i begins

    # -- when copies can overlap compute --------------------------------------------------
    def _release_op(self, g: Gap, d2h_free: float) -> tuple[int, float]:
        """The first op that starts after g's eviction (queued behind `d2h_free`) is done."""
        done = max(self.start[g.after + 1], d2h_free) + g.nbytes / self.link.d2h
        r = g.after + 1
        while r < g.before and self.start[r] < done:
            r += 1
        return r, done

    def _prefetch_op(self, g: Gap, h2d_next: float) -> tuple[int, float]:
        """The last op boundary from which g's prefetch (queued before one that starts at
        `h2d_next`) still lands before op g.before starts; or `lookahead` ops ahead."""
        if self.lookahead is not None:
            p = max(g.before - self.lookahead, g.after + 1)
            return p, self.start[p]
        latest = min(self.start[g.before], h2d_next) - g.nbytes / self.link.h2d
        p = g.before
        while p > g.after + 1 and self.start[p] > latest:
            p -= 1
        return p, min(self.start[p], latest)

    def natural_window(self, g: Gap) -> tuple[int, int]:
        """Ops [release, prefetch) g would spend off the device with the copy streams to itself."""
        return self._release_op(g, 0.0)[0], self._prefetch_op(g, float("inf"))[0]

    def windows(self, chosen: dict[Gap, _Choice]) -> dict[Gap, tuple[int, int]]:
        """Ops [release, prefetch) during which each chosen gap holds no device memory, with
        evictions queued FIFO on one stream and prefetches on another."""
        offload = [g for g, c in chosen.items() if c.mode == "offload"]
        release, d2h_free = {}, 0.0
        for g in sorted(offload, key=lambda g: (g.after, g.tensor)):
            release[g], d2h_free = self._release_op(g, d2h_free)
        prefetch, h2d_next = {}, float("inf")
        for g in sorted(offload, key=lambda g: (-g.before, g.tensor)):
            prefetch[g], h2d_next = self._prefetch_op(g, h2d_next)
        out = {}
        for g, c in chosen.items():
            if c.mode == "recompute":
                out[g] = (g.after + 1, g.before)
            else:
                r = min(release[g], c.release_by)
                out[g] = (r, min(max(prefetch[g], c.prefetch_from, r), g.before))
        return out

    def profile(self, live: Liveness, windows) -> list[int]:
        """Resident bytes during each op when each gap frees its window."""
        diff = [0] * (self.n + 1)
        for g, (r, p) in windows.items():
            if r < p:
                diff[r] -= g.nbytes
                diff[p] += g.nbytes
        return [b + d for b, d in zip(live.live_bytes, itertools.accumulate(diff))]

    # -- choosing gaps until every op fits ------------------------------------------------
    def fit(self, live: Liveness, budget: int, chosen: dict[Gap, _Choice], order: str) -> dict[Gap, _Choice]:
        """Add or widen gaps, first over-budget op first, until the profile fits."""
        score = (lambda g: g.length) if order == "gap" else (lambda g: g.nbytes * g.length)
        while True:
            windows = self.windows(chosen)
            prof = self.profile(live, windows)
            i = next((k for k in range(self.n) if prof[k] > budget), None)
            if i is None:
                return chosen
            covering = [g for g in live.gaps if g.after < i < g.before]
            fresh = [g for g in covering if g not in chosen
                     and self.natural_window(g)[0] <= i < self.natural_window(g)[1]]
            if fresh:   # a gap whose copies can overlap compute frees op i: take the best
                chosen[max(fresh, key=lambda g: (score(g), g.tensor))] = _Choice("offload", self.n, 0)
                continue
            # Otherwise compute will have to wait somewhere: widen the window of the biggest
            # tensor (already chosen or not) until it covers op i.
            stuck = [g for g in covering if not (g in windows and windows[g][0] <= i < windows[g][1])]
            if not stuck:
                raise BudgetError(f"no tensor can leave the device at op {self.tape.ops[i].name!r}")
            c = chosen.setdefault(max(stuck, key=lambda g: (g.nbytes, g in chosen, g.tensor)),
                                  _Choice("offload", self.n, 0))
            c.release_by = min(c.release_by, i)
            c.prefetch_from = max(c.prefetch_from, i + 1)


def plan(tape: Tape, budget: int | None = None, *, op_seconds=None, link: Link = Link(),
         lookahead: int | None = None, recompute: bool = False, order: str = "bytes_x_gap") -> Plan:
    """Schedule one training step of `tape` to hold at most `budget` device bytes.

    budget None: the unconstrained plan (nothing moves; the arena is the placed peak).
    op_seconds: measured (or estimated) seconds of each op; link: host-link bandwidth.
    lookahead: issue each prefetch this many ops before its use (None: from the timing model).
    recompute: where the link is the bottleneck, recompute cheap activations instead of copying.
    order: which gap to spend first, 'gap' (longest) or 'bytes_x_gap' (most byte-ops freed).
    Raises BudgetError (naming the op and the bytes it needs) if the budget cannot work.
    """
    if order not in ("gap", "bytes_x_gap"):
        raise ValueError(f"order: expected 'gap' or 'bytes_x_gap', got {order!r}")
    if lookahead is not None and lookahead < 1:
        raise ValueError(f"lookahead: expected a positive number of ops, got {lookahead}")
    planner = _Planner(tape, op_seconds, link, lookahead)
    if budget is None:
        return _build(Liveness(tape), {}, planner, budget=None)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget: expected a positive number of bytes, got {budget!r}")
    Liveness(tape).check_budget(budget)
    # Fragmentation can make the placed arena larger than the profile's peak: plan again
    # against a smaller target until the placement fits the real budget.
    target = budget
    for _ in range(16):
        live = Liveness(tape)
        try:
            live.check_budget(target)
            chosen = planner.fit(live, target, {}, order)
        except BudgetError:
            break
        if recompute:
            live, chosen, _ = _convert_to_recompute(tape, live, chosen, planner, target, order)
        result = _build(live, chosen, planner, budget=budget)
        if result.arena_bytes <= budget:
            return result
        target -= max(result.arena_bytes - budget, align_up(1))
    raise BudgetError(f"budget {fmt_bytes(budget)}: the schedule fits in bytes, but its blocks do "
                      "not pack into an arena that small (fragmentation); give a little more")


def _can_recompute(live: Liveness, g: Gap, chosen: dict[Gap, _Choice], planner: _Planner) -> bool:
    """Recompute g.tensor just before op g.before instead of copying it when: its producer
    writes only it; the producer's inputs still hold the same values there and stay alive past
    it anyway (so no lifetime grows) and none of them is itself dropped across that point; and
    the producer runs faster than one copy of the tensor over the host link."""
    p = live.first(g.tensor)
    if live.writes[p] != {g.tensor} or g.tensor in live.reads[p]:
        return False
    if planner.op_seconds[p] >= g.nbytes / min(planner.link.h2d, planner.link.d2h):
        return False
    for y in live.reads[p]:
        if any(y in live.writes[k] for k in range(p + 1, g.before)):
            return False
        if y in live.persistent:
            continue
        if live.last(y) < g.before:
            return False
        if any(h.tensor == y and c.mode == "recompute" and h.after < g.before < h.before
               for h, c in chosen.items()):
            return False
    return True


def _convert_to_recompute(tape, live, chosen, planner, budget, order):
    """Turn offloaded gaps, biggest first, into recomputations where that beats the link;
    keep each conversion only if the step still fits."""
    extra: dict[str, frozenset[int]] = {}
    for g in sorted([g for g, c in chosen.items() if c.mode == "offload"], key=lambda g: (-g.nbytes, g.tensor)):
        if g not in chosen or not _can_recompute(live, g, chosen, planner):
            continue
        # The producer's inputs are read again just before op g.before.
        trial_extra = dict(extra)
        for y in live.reads[live.first(g.tensor)] - set(live.persistent):
            trial_extra[y] = trial_extra.get(y, frozenset()) | {g.before}
        trial_live = Liveness(tape, trial_extra)
        if g not in set(trial_live.gaps):
            continue
        trial = _rekey(chosen, trial_live)
        trial[g] = _Choice("recompute", planner.n, 0)
        try:
            trial = planner.fit(trial_live, budget, trial, order)
        except BudgetError:
            continue
        live, chosen, extra = trial_live, trial, trial_extra
    return live, chosen, extra


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


def _build(live: Liveness, chosen: dict[Gap, _Choice], planner: _Planner, budget) -> Plan:
    """Turn chosen gaps into placed blocks and per-op actions."""
    tape, n = live.tape, live.n_ops
    # Gaps whose window came out empty free nothing: those tensors just stay.
    windows = {g: w for g, w in planner.windows(chosen).items() if w[0] < w[1]}
    blocks = [Block(("persistent", name), 0, max(n - 1, 0), live.nbytes(name))
              for name in live.persistent]
    spans: dict[str, list[tuple[int, int, Gap | None]]] = {}   # name -> [(first op, last op, gap after)]
    for name in live.uses:
        start, parts = live.first(name), []
        for g in sorted((g for g in windows if g.tensor == name), key=lambda g: g.after):
            parts.append((start, windows[g][0] - 1, g))
            start = windows[g][1]
        parts.append((start, live.last(name), None))
        spans[name] = parts
        blocks.extend(Block((name, s), s, e, live.nbytes(name)) for s, e, _ in parts)
    offsets, arena = place(blocks)

    before: list[list[Action]] = [[] for _ in range(n)]
    after: list[list[Action]] = [[] for _ in range(n)]
    for name, parts in spans.items():
        before[parts[0][0]].append(Action("alloc", name, offsets[(name, parts[0][0])]))
        for (_, _, g), (s_next, _, _) in zip(parts, parts[1:]):
            off = offsets[(name, s_next)]
            if chosen[g].mode == "recompute":
                after[g.after].append(Action("drop", name))
                before[g.before].append(Action("recompute", name, off, live.first(name)))
            else:
                r, p = windows[g]
                after[g.after].append(Action("evict", name))
                before[r].append(Action("release", name))
                before[p].append(Action("prefetch", name, off))
                before[g.before].append(Action("wait", name))
        if name not in live.outputs:
            after[parts[-1][1]].append(Action("free", name))
    for i in range(n):   # recomputations in producer order: one may feed the next
        before[i].sort(key=lambda a: (_BEFORE_ORDER[a.kind], a.producer, a.tensor))
        after[i].sort(key=lambda a: (_AFTER_ORDER[a.kind], a.tensor))
    by_mode = {m: sorted((g for g in windows if chosen[g].mode == m), key=lambda g: (g.after, g.tensor))
               for m in ("offload", "recompute")}
    return Plan(budget=arena if budget is None else budget, arena_bytes=arena,
                persistent={name: offsets[("persistent", name)] for name in live.persistent},
                before=before, after=after, offloaded=by_mode["offload"],
                recomputed=by_mode["recompute"],
                peak_bytes=max(planner.profile(live, windows), default=live.persistent_bytes))


# ------------------------------------------------------------------------------- checking
def validate(tape: Tape, plan: Plan) -> None:
    """Replay `plan` symbolically; raise PlanError at the first broken rule.

    Rules: what an op (or a recomputation) reads is resident and holds data; what an op writes
    is resident and not being copied out; resident bytes stay within the budget after every
    action; blocks lie inside the arena and never overlap; every tensor sent to the host is
    released, prefetched and waited for before its next use; at the end only outputs remain.
    """
    n = len(tape.ops)
    if len(plan.before) != n or len(plan.after) != n:
        raise PlanError(f"plan has {len(plan.before)}/{len(plan.after)} action lists for {n} ops")
    if plan.arena_bytes > plan.budget:
        raise PlanError(f"arena of {plan.arena_bytes} bytes passes the budget {plan.budget}")
    live = Liveness(tape)
    if set(plan.persistent) != set(live.persistent):
        raise PlanError("the plan's persistent tensors differ from the tape's")
    state: dict[str, str] = {}   # absent | resident | evicting | host | prefetching | dropped
    filled: set[str] = set(plan.persistent)   # tensors holding data
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
            fail(f"moves persistent tensor {name}")
        if state.get(name, "absent") not in frm:
            fail(f"{name} is {state.get(name, 'absent')}, expected {' or '.join(frm)}")
        state[name] = to

    def apply(act: Action, i: int):
        name = act.tensor
        if act.kind == "alloc":
            if name not in tape.ops[i].writes:
                fail(f"allocates {name} before op {i}, which does not write it")
            move(name, ("absent",), "resident")
            filled.discard(name)
            take(name, act.offset)
        elif act.kind == "free":
            move(name, ("resident",), "absent")
            held.pop(name)
        elif act.kind == "evict":
            if name not in filled:
                fail(f"evicts {name}, which holds no data")
            move(name, ("resident",), "evicting")
        elif act.kind == "release":
            move(name, ("evicting",), "host")
            held.pop(name)
        elif act.kind == "prefetch":
            move(name, ("host",), "prefetching")
            take(name, act.offset)
        elif act.kind == "wait":
            move(name, ("prefetching",), "resident")
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
        for act in plan.after[i]:
            where = f"after op {i} ({op.name}), {act.kind} {act.tensor}"
            apply(act, i)
    left = {k: v for k, v in state.items()
            if v != "absent" and not (v == "resident" and k in live.outputs)}
    if left:
        raise PlanError(f"at the end of the step these tensors are still held: {left}")
