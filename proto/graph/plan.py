"""The memory planner: every temporary of a graph at an offset in one arena.

A recorded function allocates its temporaries through ``proto.device.backend.empty``; recording
turns each into a buffer of the description (proto.graph.ir.Buffer). A buffer is *live* from
the first node that touches it to the last (to the end of the graph if the function returns
it); two buffers whose lifetimes do not meet can share bytes. Planning is a pure function of
the description:

  lifetimes   first and last use of every buffer, in node order (a buffer used inside a WHILE
              body is live for the whole loop: the next pass comes back to it);
  place       offsets such that no two buffers alive at once overlap: greedy interval
              packing (largest first, longest-lived first, ..., each by first fit and best
              fit; the smallest arena wins). This is the one offset-assignment core of the
              project: AutoVM's device pool is placed by the same function;
  Plan        plain data: offsets, the arena's size, the sum of buffer sizes (what private
              buffers would take) and the peak of live bytes (the lower bound for any arena).
              `validate(plan)` re-checks it with no GPU.

The memory tape (Grape's). The graphs of one model, one per length, bucket or batch size,
record the same temporaries under the same names. A `Tape` keeps one arena for all of them and
the offset it gave each name: planned largest first, every later graph finds its buffers
where the first put them, and new names are placed around those. So the arena is what the
largest graph needs, not the sum over graphs, and one logical tensor has one address in every
graph: an alias-bound input produced by one graph is where the next graph reads it.

`apply` then moves the description onto the arena: every node argument inside a buffer
becomes the same view at the buffer's offset in the arena (and so do the function's outputs),
and the buffers' private memory is dropped.
"""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from proto.device import backend
from proto.device.backend import ALIGN, address, align_up, cuda, extent, view_at
from proto.graph.ir import Conditional, Description
from proto.device.memo import PerObject


class PlanError(AssertionError):
    """A plan that breaks one of its invariants (validate)."""


# ------------------------------------------------------------------------- the offset core
@dataclasses.dataclass(frozen=True)
class Block:
    """`nbytes` held from the start of step `first` to the end of step `last` (inclusive)."""
    key: object
    first: int
    last: int
    nbytes: int


def _overlapping(first, last, lo, hi, a, b):
    """Whether blocks a and b (indices, slices or broadcasting index arrays into the spans'
    arrays: steps first..last, bytes [lo, hi)) are alive at a common step and share bytes."""
    return (first[a] <= last[b]) & (first[b] <= last[a]) & (lo[a] < hi[b]) & (lo[b] < hi[a])


def footprint(nbytes: int, align: int = ALIGN) -> int:
    """The bytes a block holds in the arena: its size aligned up, and at least one aligned
    unit, so that a zero-size temporary still has an address of its own (a kernel given it
    may still compare it with its other arguments)."""
    return align_up(max(nbytes, 1), align)


def _fit(blocks: list[Block], align: int, best: bool, fixed) -> tuple[dict, int]:
    """Place blocks in the given order, each in a hole clear of the placed blocks it meets in
    time: the lowest such hole (first fit) or the tightest one (best fit). (The placed
    blocks' spans live in arrays: a step of a few thousand buffers is planned per graph,
    and a Python loop over the placed blocks made planning most of a capture's time.)"""
    fixed = list(fixed)
    n = len(fixed) + len(blocks)
    first, last, lo, hi = (np.empty(n, np.int64) for _ in range(4))
    for i, (b, off) in enumerate(fixed):
        first[i], last[i], lo[i], hi[i] = b.first, b.last, off, off + footprint(b.nbytes, align)
    count = len(fixed)
    arena = int(hi[:count].max()) if count else 0
    offsets: dict = {}
    for blk in blocks:
        size = footprint(blk.nbytes, align)
        meets = (first[:count] <= blk.last) & (last[:count] >= blk.first)
        start, end = lo[:count][meets], hi[:count][meets]
        order = np.lexsort((end, start))                 # by start, then end
        start, end = start[order], end[order]
        # the lowest free byte before each busy block, and after them all
        cursor = np.maximum.accumulate(np.concatenate(([0], end)))
        gaps = start - cursor[:-1]
        holes = np.flatnonzero(gaps >= size)
        if holes.size and best:                         # the tightest, then the lowest
            tight = holes[gaps[holes] == gaps[holes].min()]
            offset = int(cursor[tight].min())
        elif holes.size:
            offset = int(cursor[holes[0]])
        else:
            offset = int(cursor[-1])                     # above every busy block: always fits
        offsets[blk.key] = offset
        first[count], last[count], lo[count], hi[count] = blk.first, blk.last, offset, offset + size
        count += 1
        arena = max(arena, offset + size)
    return offsets, arena


ORDERS = {
    "largest first": lambda b: (-b.nbytes, b.first, b.last),
    "longest-lived first": lambda b: (-(b.last - b.first), -b.nbytes, b.first),
    "most byte-steps first": lambda b: (-(b.last - b.first + 1) * b.nbytes, b.first),
    "earliest first": lambda b: (b.first, -b.nbytes, b.last),
}


def place(blocks: list[Block], align: int = ALIGN, fixed=()) -> tuple[dict, int]:
    """Offsets such that blocks alive during a common step never overlap; returns
    (offsets by key, arena bytes). `fixed` lists (Block, offset) already placed.

    Greedy placement in a few orders, each by first fit and by best fit; the smallest arena
    wins (ties: the first order tried, so the result is deterministic). Not optimal (the
    problem is NP-hard) but tight on layer-ordered programs."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align: expected a positive number of bytes, got {align!r}")
    fixed = list(fixed)
    results = [_fit(sorted(blocks, key=order), align, best, fixed)
               for order in ORDERS.values() for best in (False, True)]
    return min(results, key=lambda result: result[1])


# ------------------------------------------------------------------------- lifetimes
class _BufferIndex:
    """Which buffer of a description an array lies in, by address."""

    def __init__(self, buffers):
        self._spans = sorted((address(b.array), address(b.array) + max(b.nbytes, 1), i)
                             for i, b in enumerate(buffers))

    def find(self, arr) -> tuple[int, int] | None:
        """(buffer index, byte offset of `arr` in it), or None outside every buffer."""
        lo, hi = extent(arr)
        k = bisect.bisect_right(self._spans, (lo, float("inf"), 0)) - 1
        if k >= 0:
            start, end, i = self._spans[k]
            if hi <= end:
                return i, lo - start
        return None


def lifetimes(description: Description, outputs=()) -> dict[int, tuple[int, int]]:
    """Buffer index -> (first, last) step that touches it. Steps number the nodes in order,
    a conditional's body nodes in place; every use inside a WHILE body covers the loop's
    whole range; a conditional node reads its flag at its body's first step; a buffer holding
    one of `outputs` lives to the end. A description that is
    not a chain (several streams) keeps every buffer live throughout: node order is not
    time order there."""
    buffers = description.buffers
    index = _BufferIndex(buffers)

    def owner(arr) -> int | None:
        found = index.find(arr)
        return None if found is None else found[0]

    spans: dict[int, tuple[int, int]] = {}

    def use(i, first, last):
        old = spans.get(i, (first, last))
        spans[i] = (min(old[0], first), max(old[1], last))

    def walk(nodes, step) -> int:
        for node in nodes:
            if isinstance(node, Conditional):
                begin = step
                # The node reads its flag before its body's first node runs: a use there, or
                # a buffer placed later could overwrite the flag before it is read
                flag = owner(node.args[0])
                if flag is not None:
                    use(flag, begin, begin)
                step = walk(node.body.nodes, step)
                if node.loop:   # a loop comes back: everything it touches spans all of it
                    for a, _ in node.accesses():
                        i = owner(a)
                        if i is not None:
                            use(i, begin, step - 1)
            else:
                for a, _ in node.accesses():
                    i = owner(a)
                    if i is not None:
                        use(i, step, step)
                step += 1
        return step

    end = max(walk(description.nodes, 0) - 1, 0)
    for arr in outputs:
        i = owner(arr)
        if i is not None:
            use(i, spans.get(i, (end, end))[0], end)
    for i in range(len(buffers)):
        if i not in spans:                  # allocated, never touched: give it one step
            spans[i] = (end, end)
    if not description.is_chain:
        spans = {i: (0, end) for i in spans}
    return spans


# ------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every buffer of one graph lives in its arena."""
    blocks: tuple            # Block per buffer (key = the buffer's tape key)
    offsets: dict            # tape key -> byte offset in the arena
    arena_bytes: int         # the arena this graph needs (the tape's may be larger)

    @property
    def total_bytes(self) -> int:
        """What private buffers would take: the sum of every buffer's aligned size."""
        return sum(footprint(b.nbytes) for b in self.blocks)

    @property
    def peak_live_bytes(self) -> int:
        """The most bytes alive at one step: no arena can be smaller."""
        steps = {s for b in self.blocks for s in (b.first, b.last)}
        return max((sum(footprint(b.nbytes) for b in self.blocks if b.first <= s <= b.last)
                    for s in steps), default=0)

    def summary(self) -> str:
        return (f"{len(self.blocks)} buffers, {self.total_bytes} bytes private, arena "
                f"{self.arena_bytes} bytes, peak live {self.peak_live_bytes} bytes")


def validate(plan: Plan) -> None:
    """Raise PlanError unless every block has a lifetime (first <= last) and a size, is
    aligned, inside the arena, and clear of every block alive at the same time."""
    n = len(plan.blocks)
    first, last, lo, hi = (np.empty(n, np.int64) for _ in range(4))
    for i, blk in enumerate(plan.blocks):
        if not 0 <= blk.first <= blk.last:
            raise PlanError(f"buffer {blk.key}: lifetime steps {blk.first}-{blk.last} are not "
                            "a span (expected 0 <= first <= last)")
        if blk.nbytes < 0:
            raise PlanError(f"buffer {blk.key}: negative size {blk.nbytes}")
        off = plan.offsets.get(blk.key)
        if off is None:
            raise PlanError(f"buffer {blk.key}: no offset")
        if off < 0 or off % ALIGN or off + max(blk.nbytes, 1) > plan.arena_bytes:
            raise PlanError(f"buffer {blk.key} at [{off}, {off + blk.nbytes}) is misaligned or "
                            f"outside the arena of {plan.arena_bytes} bytes")
        first[i], last[i], lo[i], hi[i] = blk.first, blk.last, off, off + footprint(blk.nbytes)
        clash = np.flatnonzero(_overlapping(first, last, lo, hi, i, slice(0, i)))
        if clash.size:                     # (the earliest block it overlaps)
            other = plan.blocks[int(clash[0])]
            raise PlanError(f"buffers {blk.key} and {other.key} are alive at once (steps "
                            f"{blk.first}-{blk.last}, {other.first}-{other.last}) and overlap "
                            f"at offsets {off} and {int(lo[clash[0]])}")


def plan(description: Description, outputs=(), fixed: dict | None = None) -> Plan:
    """Plan the description's buffers; `fixed` maps tape keys to the offsets an earlier graph
    gave them (the tape), which they keep. (`apply`, the one way a plan reaches a graph,
    validates it.)"""
    spans = lifetimes(description, outputs)
    blocks = tuple(Block(b.key, *spans[i], b.nbytes) for i, b in enumerate(description.buffers))
    fixed = fixed or {}
    pinned = [(blk, fixed[blk.key]) for blk in blocks if blk.key in fixed]
    free = [blk for blk in blocks if blk.key not in fixed]
    offsets, arena = place(free, fixed=pinned)
    offsets.update({blk.key: off for blk, off in pinned})
    return Plan(blocks, offsets, arena)


# ------------------------------------------------------------------------- applying it
_arena_views = PerObject()


def arena_view(arena, offset: int, like):
    """`like`'s shape, strides and dtype at `offset` bytes into `arena`: one object for every
    graph planned on that arena. The graphs of a tape hold the same tensors at the same
    offsets, and making a device array costs host time at every capture (Numba builds it
    from scratch)."""
    key = (offset, tuple(like.shape), tuple(like.strides), like.dtype.str)
    return _arena_views.get(arena, key, lambda: view_at(arena, offset, like))


def apply(description: Description, plan_: Plan, arena, outputs):
    """(the description on the arena, the outputs on the arena): every array inside a buffer
    becomes the same view at the buffer's offset in the arena. The buffers keep their keys
    and sizes; their arrays become their place in the arena. The plan is validated first:
    a plan that breaks an invariant never reaches a graph."""
    validate(plan_)
    missing = [b.key for b in description.buffers if b.key not in plan_.offsets]
    if missing:
        raise PlanError(f"apply: the plan has no offset for buffers {missing[:5]}")
    if arena is None or arena.nbytes < plan_.arena_bytes:
        raise PlanError(f"apply: the arena holds {0 if arena is None else arena.nbytes} bytes, "
                        f"the plan needs {plan_.arena_bytes}")
    index = _BufferIndex(description.buffers)
    offsets = [plan_.offsets[b.key] for b in description.buffers]

    def rebase(arr):
        found = index.find(arr) if backend.is_device_array(arr) else None
        if found is None:
            return arr
        i, within = found
        return arena_view(arena, offsets[i] + within, arr)

    def moved(desc: Description) -> Description:
        nodes = []
        for node in desc.nodes:
            changes = {"args": tuple(rebase(a) for a in node.args)}
            if isinstance(node, Conditional):
                changes["body"] = moved(node.body)
            nodes.append(dataclasses.replace(node, **changes))
        return Description(nodes, list(desc.deps))

    result = moved(description)
    result.buffers = [dataclasses.replace(b, array=arena_view(arena, off, b.array))
                      for b, off in zip(description.buffers, offsets)]
    return result, map_arrays(outputs, rebase)


def map_arrays(tree, fn):
    """Apply `fn` to every device array in a nest of tuples, lists and dicts."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_arrays(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: map_arrays(v, fn) for k, v in tree.items()}
    return fn(tree) if backend.is_device_array(tree) else tree


def leaves(tree) -> list:
    out = []
    map_arrays(tree, lambda a: out.append(a) or a)
    return out


# ------------------------------------------------------------------------- the tape
class Tape:
    """One arena for every graph of one owner, and the offset each tensor got in it.

    `plan_graph(description, outputs)` plans a graph's buffers keeping the offsets earlier
    graphs gave the same keys; the first graph planned sizes the arena (plan largest first).
    A later graph that needs a larger arena, or a model's tensor (a key with an owner) larger
    than where the tape put it, raises: its addresses could not match the graphs already built.

    Kernel scratch (a key without an owner, proto.device.backend.empty's `owner=None`) dies
    inside one launcher call, so no value of it crosses graphs. It keeps its first address
    where that still fits, but a kernel may split a reduction more ways at a smaller shape
    (its split count rounds differently), and the k-th scratch of a name may then be another
    launch's: where the kept addresses do not fit or collide, this graph places its scratch
    anew."""

    def __init__(self, name: str = "tape"):
        self.name = name
        self.offsets: dict = {}       # tape key -> offset
        self.sizes: dict = {}         # tape key -> bytes reserved there
        self.arena = None
        self.arena_bytes = 0
        self.plans: list[Plan] = []

    def plan_graph(self, description: Description, outputs=()) -> Plan:
        for b in description.buffers:
            if b.key[0] is not None and b.key in self.sizes and b.nbytes > self.sizes[b.key]:
                raise ValueError(f"tape {self.name!r}: buffer {b.name!r} needs {b.nbytes} bytes but "
                                 f"the tape placed it with {self.sizes[b.key]} from an earlier, "
                                 "smaller graph; capture the largest shape first")
        keys = {b.key for b in description.buffers}
        fixed = {k: off for k, off in self.offsets.items() if k in keys}
        result = self._plan_kept(description, outputs, fixed)
        if result is None:           # scratch placed anew (see the class docstring)
            result = plan(description, outputs, {k: off for k, off in fixed.items()
                                                 if k[0] is not None})
        if self.arena is None:
            self.arena_bytes = max(align_up(result.arena_bytes), ALIGN)
            self.arena = cuda.device_array(self.arena_bytes, "u1")
        elif result.arena_bytes > self.arena_bytes:
            raise ValueError(f"tape {self.name!r}: this graph needs an arena of "
                             f"{result.arena_bytes} bytes, the tape has {self.arena_bytes} "
                             "(sized by the first graph planned); capture the largest shape first")
        for blk in result.blocks:
            if blk.key not in self.offsets:
                self.offsets[blk.key], self.sizes[blk.key] = result.offsets[blk.key], blk.nbytes
        self.plans.append(result)
        return result

    def _plan_kept(self, description, outputs, fixed) -> Plan | None:
        """The plan that keeps every earlier offset, or None where kept scratch would not fit
        its place, would meet a buffer alive beside it, or would outgrow the arena."""
        if any(b.key in fixed and b.nbytes > self.sizes[b.key] for b in description.buffers):
            return None
        result = plan(description, outputs, fixed)
        if self.arena is not None and result.arena_bytes > self.arena_bytes:
            return None
        kept = [i for i, blk in enumerate(result.blocks) if blk.key in fixed and blk.key[0] is None]
        if kept:                     # kept scratch against every block, at once
            spans = np.array([(b.first, b.last, result.offsets[b.key], footprint(b.nbytes))
                              for b in result.blocks], np.int64)
            first, last, lo = spans[:, 0], spans[:, 1], spans[:, 2]
            hi = lo + spans[:, 3]
            k = np.array(kept)
            meet = _overlapping(first, last, lo, hi, k[:, None], slice(None))
            meet[np.arange(len(k)), k] = False
            if meet.any():
                return None
        return result

    def close(self) -> None:
        self.arena, self.offsets, self.sizes, self.plans = None, {}, {}, []
