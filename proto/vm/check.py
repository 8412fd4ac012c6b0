"""The checker: replay a plan symbolically, without a GPU, and name the first rule it breaks."""
from __future__ import annotations

from kernels import _check
from proto.tape import Tape
from proto.vm.actions import Action, Plan, PlanError
from proto.vm.liveness import Liveness, align_up
from proto.vm.walk import At, Visitor, walk


def validate(tape: Tape, plan: Plan) -> None:
    """Replay `plan` symbolically; raise PlanError at the first broken rule.

    Rules: what an op (or a recomputation) reads is resident and holds data; what an op writes
    is resident and not being copied out; resident bytes stay within the budget after every
    action; blocks lie inside the arena and never overlap; a tensor is discarded only while its
    host copy is current; a recomputation re-runs the op that wrote the tensor last, on inputs
    no op has written since; every tensor sent to the host is released, prefetched and waited
    for before its next use; at the end only outputs remain, and homed tensors are back home.
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
    checker = _Checker(tape, plan)
    walk(plan, checker)
    checker.where = "at the end of the step"
    left = {k: v for k, v in checker.state.items() if k not in plan.homed
            and v != "absent" and not (v == "resident" and k in live.outputs)}
    if left:
        checker.fail(f"these tensors are still held: {left}")
    away = {k: checker.state[k] for k in plan.homed
            if checker.state[k] != "host" or k not in checker.host_current}
    if away:
        checker.fail(f"homed tensors not back on the host with current data: {away}")


class _Checker(Visitor):
    """Where each tensor is, whether it holds data, and which arena bytes are taken."""

    def __init__(self, tape: Tape, plan: Plan):
        self.tape, self.plan = tape, plan
        # absent | resident | evicting | host | prefetching | dropped
        self.state = {name: "host" for name in plan.homed}
        self.filled = set(plan.persistent) | set(plan.homed)   # tensors holding data
        self.host_current = set(plan.homed)                    # host copy equals the data
        self.held = {name: (off, align_up(tape.tensors[name].nbytes))
                     for name, off in plan.persistent.items()}
        # Writes so far per tensor, and for each tensor its last writer with the versions of
        # what that op read: a recomputation must re-run the last writer on the same inputs.
        self.version: dict[str, int] = {}
        self.made_by: dict[str, tuple[int, dict[str, int]]] = {}
        self.where = ""

    # -- the rules --------------------------------------------------------------------------
    def fail(self, msg):
        raise PlanError(f"{self.where}: {msg}")

    def visit(self, act: Action, at: At) -> None:
        # Every failure names the action it happened at, as a person reads the plan.
        self.where = (f"at the end, {act.kind} {act.tensor}" if at.slot == "end" else
                      f"{at.slot} op {at.op} ({self.tape.ops[at.op].name}), {act.kind} {act.tensor}")
        super().visit(act, at)

    def _take(self, name, off):
        nbytes = align_up(self.tape.tensors[name].nbytes)   # blocks take whole alignment units
        arena = self.plan.arena_bytes
        if off < 0 or off + nbytes > arena:
            self.fail(f"{name} at [{off}, {off + nbytes}) is outside the arena of {arena}")
        for other, (o, b) in self.held.items():
            if off < o + b and o < off + nbytes:
                self.fail(f"{name} at [{off}, {off + nbytes}) overlaps {other} at [{o}, {o + b})")
        self.held[name] = (off, nbytes)
        total = sum(b for _, b in self.held.values())
        if total > self.plan.budget:
            self.fail(f"{total} bytes resident, past the budget {self.plan.budget}")

    def _read(self, name):
        ok = name in self.plan.persistent or self.state.get(name) in ("resident", "evicting")
        if not ok or name not in self.filled:
            self.fail(f"reads {name} while it is {self.state.get(name, 'absent')}"
                      + ("" if name in self.filled else " and holds no data"))

    def _move(self, name, frm, to):
        if name in self.plan.persistent:
            self.fail(f"moves {name}, which has a fixed place")
        if self.state.get(name, "absent") not in frm:
            self.fail(f"{name} is {self.state.get(name, 'absent')}, expected {' or '.join(frm)}")
        self.state[name] = to

    # -- the op -------------------------------------------------------------------------------
    def op(self, i: int) -> None:
        op = self.tape.ops[i]
        self.where = f"op {i} ({op.name})"
        for name in op.reads:
            self._read(name)
        inputs = {r: self.version.get(r, 0) for r in op.reads}
        for name in op.writes:
            if name not in self.plan.persistent and self.state.get(name) != "resident":
                self.fail(f"writes {name} while it is {self.state.get(name, 'absent')}")
            self.filled.add(name)
            self.host_current.discard(name)
            self.version[name] = self.version.get(name, 0) + 1
            self.made_by[name] = (i, inputs)

    # -- the actions --------------------------------------------------------------------------
    def unknown(self, act: Action, at: At) -> None:
        self.fail(f"unknown action kind {act.kind!r}")

    def alloc(self, act: Action, at: At) -> None:
        name, i = act.tensor, min(at.op, len(self.tape.ops) - 1)   # the end follows the last op
        if name not in self.tape.ops[i].writes:
            self.fail(f"allocates {name} before op {i}, which does not write it")
        self._move(name, ("absent", "host"), "resident")
        self.filled.discard(name)
        self._take(name, act.offset)

    def free(self, act: Action, at: At) -> None:
        self._move(act.tensor, ("resident",), "absent")
        self.held.pop(act.tensor)

    def evict(self, act: Action, at: At) -> None:
        if act.tensor not in self.filled:
            self.fail(f"evicts {act.tensor}, which holds no data")
        self._move(act.tensor, ("resident",), "evicting")
        self.host_current.add(act.tensor)

    def discard(self, act: Action, at: At) -> None:
        if act.tensor not in self.host_current:
            self.fail(f"discards {act.tensor}, whose host copy is not current")
        self._move(act.tensor, ("resident",), "host")
        self.held.pop(act.tensor)

    def release(self, act: Action, at: At) -> None:
        self._move(act.tensor, ("evicting",), "host")
        self.held.pop(act.tensor)

    def prefetch(self, act: Action, at: At) -> None:
        if act.tensor not in self.host_current:
            self.fail(f"prefetches {act.tensor}, which has no current host copy")
        self._move(act.tensor, ("host",), "prefetching")
        self._take(act.tensor, act.offset)

    def wait(self, act: Action, at: At) -> None:
        self._move(act.tensor, ("prefetching",), "resident")
        self.filled.add(act.tensor)

    def drop(self, act: Action, at: At) -> None:
        self._move(act.tensor, ("resident",), "dropped")
        self.held.pop(act.tensor)
        self.filled.discard(act.tensor)

    def recompute(self, act: Action, at: At) -> None:
        name, ops = act.tensor, self.tape.ops
        if not 0 <= act.producer < len(ops) or tuple(ops[act.producer].writes) != (name,):
            self.fail(f"op {act.producer} does not write exactly {name}, so it cannot recompute it")
        last, inputs = self.made_by.get(name, (None, {}))
        if last != act.producer:
            self.fail(f"recomputes {name} with op {act.producer}, but op {last} wrote it last")
        changed = [r for r, v in inputs.items() if self.version.get(r, 0) != v]
        if changed:
            self.fail(f"recomputes {name}, but its producer's inputs {changed} changed since")
        for r in ops[act.producer].reads:
            self._read(r)
        self._move(name, ("dropped",), "resident")
        self._take(name, act.offset)
        self.filled.add(name)
        self.host_current.discard(name)
