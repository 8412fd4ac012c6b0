"""Lowering: chosen gaps -> arena offsets and the per-op action lists of a Plan.

Each tensor's device residency is cut at its chosen gaps into spans; every span is a block for
the offset assignment the graph planner also uses (proto.graph.plan.place), and its ends become
actions: the tensor arrives (alloc, prefetch + wait, or recompute) where a span starts and
leaves (evict + release, discard, drop, or free) where one ends.
"""
from __future__ import annotations

from proto.graph.plan import Block, place
from proto.vm.actions import Action, Plan
from proto.vm.liveness import Gap, Liveness, align_up
from proto.vm.timeline import Choice, Timeline

# Order within one slot. Before an op: bytes are released before they are reused, and a
# recomputation runs last, once what it reads is back.
_BEFORE_ORDER = {"release": 0, "alloc": 1, "prefetch": 2, "wait": 3, "recompute": 4}
_AFTER_ORDER = {"evict": 0, "discard": 1, "drop": 2, "free": 3}


def lower(live: Liveness, chosen: dict[Gap, Choice], timeline: Timeline,
          budget: int | None) -> tuple[Plan, list[int]]:
    """The Plan that spends `chosen` gaps off the device (budget None: the arena's size), and,
    per op, the highest arena byte in use (above the budget where placement fragmented)."""
    tape, n = live.tape, live.n_ops
    windows = timeline.windows(live, chosen)
    dirty = timeline.dirty(live, chosen)
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

    def copy_from(name, g, start) -> int:
        """After which op a dirty tensor's copy home may start: its last write in the span
        [start, g.after] that gap g ends (the ops after it only read it, so the copy overlaps
        them), where the pool keeps host copies. A span the tensor arrived in by
        recomputation, or managed memory, which moves the pages themselves (a kernel reading
        a page on its way out would fault it back): after the gap's first op."""
        last = live.last_write(name, start, g.after) if timeline.host_copy else None
        return g.after if last is None else last

    def leave(name, g, start):
        """The tensor leaves the span from op `start` after the use that opens gap g."""
        nonlocal d2h
        if chosen[g].mode == "recompute":
            after[g.after].append(Action("drop", name))
        elif g in dirty:
            after[copy_from(name, g, start)].append(Action("evict", name))
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
        for (start, _, g), (s_next, _, _) in zip(parts, parts[1:]):
            leave(name, g, start)
            arrive(name, g, s_next)
        if wrap is not None:
            leave(name, wrap, parts[-1][0])
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
                peak_bytes=max(timeline.profile(live, windows), default=live.persistent_bytes),
                d2h_bytes=d2h, h2d_bytes=h2d), extent
