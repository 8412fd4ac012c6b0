"""Run a tape's training step under a Plan: one compute stream, one D2H and one H2D copy stream.

The plan (schedule.py) decides everything; this module only replays it (through walk.py, as
the checker and the cost model read it) with the ordering the GPU needs, which is all CUDA
events:

    evict X     after op a:  d2h waits for compute (X is final), copies X to its pinned buffer
    discard X   after op a:  X's pinned copy is current: its bytes may be reused at once
    release X   before op r: compute waits for that copy, then X's bytes may be reused
    prefetch X  before op p: h2d waits for compute so far (the bytes it lands in are no longer
                             read or written), copies pinned -> device
    wait X      before op b: compute waits for the prefetch
    recompute X before op b: re-run X's producer on the compute stream

On the simulator streams and events do nothing and copies are synchronous, so the same code
runs there; freed bytes are poisoned (pool.py), so a wrong plan gives wrong numbers in tests.

One graph per step. Every copy and event goes through proto.graph (`copy`, `record_event`,
`wait_event`) and every kernel through proto.backend.launch, so `capture()` can record a whole
step, all three streams, into one graph description: the events become edges between the
compute chain and the two copy chains, and the CUDA executor instantiates it as one CUDA
graph whose copy branches overlap compute as the streams did. A step is then one graph
launch. That works because a plan is static: every step allocates the same offsets, moves the
same tensors between the same buffers, in the same order.
"""
from __future__ import annotations

import numpy as np

from proto import backend, graph
from proto.backend import cuda
from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.check import validate
from proto.vm.pool import DevicePool
from proto.vm.timeline import estimate_op_seconds
from proto.vm.walk import At, Visitor, walk


def _event():
    return cuda.event() if backend.SIMULATOR else cuda.event(timing=False)


class Executor:
    """Replays `plan` for `tape`, one `step()` per training step.

    Persistent tensors (parameters, gradients, state, inputs) stay at fixed places, or, when
    the plan homes them on the host, in their pinned buffers between steps: `load` writes
    them, `read` returns any persistent tensor or step output (valid after `step`).
    Call `close()` (or use `with`) to give the arena, pinned buffers and streams back.
    """

    def __init__(self, tape: Tape, plan: Plan, *, managed: bool = False, pinned: dict | None = None):
        """pinned: host buffers by tensor name to use (and add to) instead of allocating
        new ones; pinning gigabytes takes a while, so runs of one tape can share them."""
        validate(tape, plan)
        self.tape, self.plan = tape, plan
        self.pool = DevicePool(plan.budget, plan.arena_bytes, managed=managed)
        self.compute, self.d2h, self.h2d = cuda.stream(), cuda.stream(), cuda.stream()
        self.current = {name: self.pool.alloc(tape.tensors[name], off)
                        for name, off in plan.persistent.items()}
        self._persistent = frozenset(plan.persistent) | frozenset(plan.homed)
        on_host = {a.tensor for _, _, a in plan.actions() if a.kind == "evict"} | set(plan.homed)
        self.pinned = pinned if pinned is not None else {}
        for name in sorted(on_host - set(self.pinned)):
            self.pinned[name] = cuda.pinned_array(tape.tensors[name].shape, tape.tensors[name].dtype)
        self._op_names = [tuple(dict.fromkeys(op.reads + op.writes)) for op in tape.ops]
        # Persistent tensors the step reads before it writes them: their arena bytes (or pinned
        # buffers) hold garbage until `load` gives them values.
        self._unloaded = {name for name in self._persistent if tape.uses(name)
                          and name in tape.ops[tape.uses(name)[0]].reads}
        self._closed = False
        self._pending: dict[str, object] = {}    # prefetched views, usable after their wait
        self._events: dict[tuple, object] = {}   # created once, re-recorded every step
        self.graphed: graph.Graph | None = None   # set by capture()

    # -- host I/O (outside the timed step) ------------------------------------------------
    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: this executor is closed (its arena, pinned buffers and "
                               "graph were given back); make a new one")

    def _require_loaded(self, what: str, names) -> None:
        never = sorted(self._unloaded.intersection(names))
        if never:
            raise RuntimeError(f"{what}: {len(never)} persistent tensor(s) the step reads before "
                               f"writing were never loaded, first: {never[:4]}; their memory "
                               "holds garbage: load() them first")

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Write persistent tensors from host arrays (initial weights, the input batch)."""
        self._require_open("load")
        for name, value in values.items():
            if name not in self._persistent:
                raise ValueError(f"load: {name!r} is not a persistent tensor of the tape")
            spec = self.tape.tensors[name]
            if not np.issubdtype(np.asarray(value).dtype, np.number):
                raise ValueError(f"load: {name!r} expected numbers, got {np.asarray(value).dtype}")
            value = np.ascontiguousarray(value, dtype=spec.dtype)
            if value.shape != spec.shape:
                raise ValueError(f"load: {name!r} expected shape {spec.shape}, got {value.shape}")
        backend.synchronize()
        for name, value in values.items():
            spec = self.tape.tensors[name]
            if name in self.plan.homed:
                self.pinned[name][...] = value
                continue
            self._touch([name])
            self.current[name].copy_to_device(np.ascontiguousarray(value, dtype=spec.dtype))
        self._unloaded.difference_update(values)
        backend.synchronize()
        self._after_io()

    def read(self, name: str) -> np.ndarray:
        """A persistent tensor, or an output of the last step, copied to the host."""
        return self.read_many([name])[name]

    def read_many(self, names) -> dict[str, np.ndarray]:
        self._require_open("read")
        self._require_loaded("read", names)
        backend.synchronize()
        out = {}
        for name in names:
            if name in self.plan.homed:
                out[name] = np.array(self.pinned[name])
                continue
            if name not in self.current:
                raise KeyError(f"read: {name!r} is neither persistent nor an output of the last step")
            self._touch([name])
            out[name] = self.current[name].copy_to_host()
        self._after_io()
        return out

    # -- the step ---------------------------------------------------------------------------
    def step(self, marks: list | None = None) -> None:
        """Enqueue one training step (returns before the GPU is done; synchronize to wait).
        After `capture()` that is one graph launch. marks: events to record on the compute
        stream before each op and after the last (an eager step, for profiling)."""
        self._require_open("step")
        self._require_loaded("step", self._unloaded)
        if self.graphed is not None and marks is None:
            self.graphed.replay()
            return
        for name in [n for n in self.current if n not in self.plan.persistent]:
            self.pool.free(name)          # outputs of the previous step
            del self.current[name]
        walk(self.plan, _Replay(self, marks))

    def capture(self, executor: str | None = None) -> graph.Description:
        """Record one step, all three streams of it, as one graph; later `step()`s launch it.

        Runs the step once on the way (a warm-up, outside the graph), so
        `load` the starting state afterwards (and before: the warm-up reads it). `executor`:
        "cuda" (a CUDA graph; the default on a GPU) or "walk" (node by node; the simulator's).
        Returns the recorded description."""
        self._require_open("capture")
        if self.graphed is not None:
            raise RuntimeError("capture: this executor's step is already a graph")
        self.graphed = graph.capture(self.step, inputs={}, executor=executor)
        return self.graphed.description

    def profile_ops(self) -> list[float]:
        """Seconds each op takes on the compute stream, from events around every op of one
        step: the planner's timing model. The simulator has no GPU time: a roofline guess."""
        if backend.SIMULATOR:
            return estimate_op_seconds(self.tape)
        marks = [cuda.event() for _ in range(len(self.tape.ops) + 1)]
        self.step(marks)
        marks[-1].synchronize()
        return [cuda.event_elapsed_time(a, b) * 1e-3 for a, b in zip(marks, marks[1:])]

    def _run_op(self, i: int) -> None:
        self.tape.ops[i].run({n: self.current[n] for n in self._op_names[i]}, self.compute)

    def _event(self, *key):
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = _event()
        return ev

    # Hooks for demand paging (paging.py): make pages resident before an op or host I/O.
    def _before_op(self, i: int) -> None:
        pass

    def _touch(self, names) -> None:
        pass

    def _after_io(self) -> None:
        pass

    def close(self) -> None:
        """Give the arena, pinned buffers, graph and streams back; closing twice is harmless,
        any other use afterwards raises RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self.graphed is not None:
            self.graphed.close()
            self.graphed = None
        backend.synchronize()
        self.current.clear()
        self._pending.clear()
        self._events.clear()
        self.pinned = None   # shared buffers stay with their owner
        self.pool.close()
        if not backend.SIMULATOR:   # Numba frees lazily; give the arena back now
            cuda.current_context().memory_manager.deallocations.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Replay(Visitor):
    """One step of `ex` on its streams: ops on compute, evictions on d2h, prefetches on h2d,
    ordered by events. marks: as Executor.step."""

    def __init__(self, ex: Executor, marks: list | None):
        self.ex, self.marks = ex, marks

    def op(self, i: int) -> None:
        self.ex._before_op(i)
        if self.marks is not None:
            self.marks[i].record(self.ex.compute)
        self.ex._run_op(i)

    def ops_done(self) -> None:   # before the end's releases: they are no op's time
        if self.marks is not None:
            self.marks[-1].record(self.ex.compute)

    def alloc(self, act: Action, at: At) -> None:
        self.ex.current[act.tensor] = self.ex.pool.alloc(self.ex.tape.tensors[act.tensor], act.offset)

    def free(self, act: Action, at: At) -> None:
        self.ex.pool.free(act.tensor)
        del self.ex.current[act.tensor]

    drop = discard = free   # the bytes are free at once: a host copy is current, or none is needed

    def evict(self, act: Action, at: At) -> None:
        ex, name = self.ex, act.tensor
        ready = ex._event(at.op, at.slot, name, "computed")
        graph.record_event(ready, ex.compute)
        graph.wait_event(ready, ex.d2h)
        graph.copy(ex.pinned[name], ex.current[name], stream=ex.d2h)
        graph.record_event(ex._event(name, "evicted"), ex.d2h)

    def release(self, act: Action, at: At) -> None:
        graph.wait_event(self.ex._event(act.tensor, "evicted"), self.ex.compute)
        self.free(act, at)

    def prefetch(self, act: Action, at: At) -> None:
        ex, name = self.ex, act.tensor
        view = ex.pool.alloc(ex.tape.tensors[name], act.offset)
        clear = ex._event(at.op, at.slot, name, "clear")
        graph.record_event(clear, ex.compute)
        graph.wait_event(clear, ex.h2d)
        graph.copy(view, ex.pinned[name], stream=ex.h2d)
        graph.record_event(ex._event(name, "arrived"), ex.h2d)
        ex._pending[name] = view

    def wait(self, act: Action, at: At) -> None:
        graph.wait_event(self.ex._event(act.tensor, "arrived"), self.ex.compute)
        self.ex.current[act.tensor] = self.ex._pending.pop(act.tensor)

    def recompute(self, act: Action, at: At) -> None:
        self.alloc(act, at)
        self.ex._run_op(act.producer)
