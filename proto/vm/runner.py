"""What every executor of a plan shares, whatever memory it runs on.

A plan can run on two kinds of memory: a budgeted device arena with pinned host copies
(executor.py) or one managed (unified) arena whose pages are prefetched back and forth
(managed.py). Both need the same things, kept here once: the three streams (compute, D2H,
H2D), events created once and re-recorded every step, host I/O outside the timed step, the op
runner, and the replay visitor's skeleton. The skeleton fixes the ordering every backend owes
the GPU (an eviction waits for the op that last wrote its tensor, a release makes compute wait
for that eviction, a prefetch waits until compute is done with the bytes it lands in, a wait
makes compute wait for the prefetch); a backend only says how bytes move (`_send_out`,
`_bring_in`) and what happens to its own bookkeeping.
"""
from __future__ import annotations

import numpy as np

from proto.device import backend
from proto import graph
from proto.device.backend import cuda
from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.check import validate
from proto.vm.timeline import estimate_op_seconds
from proto.vm.walk import At, Visitor, walk


def _event():
    return cuda.event() if backend.SIMULATOR else cuda.event(timing=False)


class StepRunner:
    """One training step of `tape` under `plan` per `step()`; memory is the subclass's.

    `load` writes persistent tensors, `read` returns any persistent tensor or step output
    (valid after `step`). Call `close()` (or use `with`) to give memory and streams back.
    A subclass provides `_write`, `_read`, `_start_step`, `_replay` and `_release`.
    """

    def __init__(self, tape: Tape, plan: Plan):
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a Plan (from proto.vm.plan), got {type(plan).__name__}")
        validate(tape, plan)
        self.tape, self.plan = tape, plan
        self.compute, self.d2h, self.h2d = cuda.stream(), cuda.stream(), cuda.stream()
        self.current: dict[str, object] = {}      # tensors an op may use now, by name
        self._persistent = frozenset(plan.persistent) | frozenset(plan.homed)
        self._op_names = [tuple(dict.fromkeys(op.reads + op.writes)) for op in tape.ops]
        # Persistent tensors the step reads before it writes them: their memory holds
        # garbage until `load` gives them values.
        self._unloaded = {name for name in self._persistent if tape.uses(name)
                          and name in tape.ops[tape.uses(name)[0]].reads}
        self._closed = False
        self._events: dict[tuple, object] = {}   # created once, re-recorded every step
        self.graphed: graph.Graph | None = None   # set by a backend that can capture

    # -- host I/O (outside the timed step) ------------------------------------------------
    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: this executor is closed (its memory, streams and "
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
            self._touch([name])
            self._write(name, np.ascontiguousarray(value, dtype=self.tape.tensors[name].dtype))
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
            if name not in self.plan.homed and name not in self.current:
                raise KeyError(f"read: {name!r} is neither persistent nor an output of the last step")
            self._touch([name])
            out[name] = self._read(name)
        self._after_io()
        return out

    # -- the step ---------------------------------------------------------------------------
    def step(self, marks: list | None = None) -> None:
        """Enqueue one training step (returns before the GPU is done; synchronize to wait).
        After a capture that is one graph launch. marks: events to record on the compute
        stream before each op and after the last (an eager step, for profiling)."""
        self._require_open("step")
        self._require_loaded("step", self._unloaded)
        if self.graphed is not None and marks is None:
            self.graphed.replay()
            return
        self._start_step()
        walk(self.plan, self._replay(marks))
        self._end_step()

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

    # -- what a backend provides ------------------------------------------------------------
    def _write(self, name: str, value: np.ndarray) -> None:
        raise NotImplementedError

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def _start_step(self) -> None:
        """Forget the previous step's outputs."""

    def _end_step(self) -> None:
        pass

    def _replay(self, marks):
        raise NotImplementedError

    def _release(self) -> None:
        """Give the backend's memory back (close)."""

    # Hooks for backends whose pages move on their own (paging.py, managed.py).
    def _before_op(self, i: int) -> None:
        pass

    def _touch(self, names) -> None:
        pass

    def _after_io(self) -> None:
        pass

    def close(self) -> None:
        """Give memory, graph and streams back; closing twice is harmless, any other use
        afterwards raises RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self.graphed is not None:
            self.graphed.close()
            self.graphed = None
        backend.synchronize()
        self.current.clear()
        self._events.clear()
        self._release()
        if not backend.SIMULATOR:   # Numba frees lazily; give the memory back now
            cuda.current_context().memory_manager.deallocations.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Replay(Visitor):
    """One step of `ex` on its streams: ops on compute, evictions on D2H, prefetches on H2D,
    ordered by events. marks: as StepRunner.step. A backend subclasses it and says how bytes
    move (`_send_out`, `_bring_in`) and what alloc/free/release/wait do to its memory."""

    def __init__(self, ex: StepRunner, marks: list | None):
        self.ex, self.marks = ex, marks

    def op(self, i: int) -> None:
        self.ex._before_op(i)
        if self.marks is not None:
            self.marks[i].record(self.ex.compute)
        self.ex._run_op(i)

    def ops_done(self) -> None:   # before the end's releases: they are no op's time
        if self.marks is not None:
            self.marks[-1].record(self.ex.compute)

    def _handoff(self, stream, *key) -> None:
        """`stream` waits for what compute has enqueued so far."""
        ev = self.ex._event(*key)
        graph.record_event(ev, self.ex.compute)
        graph.wait_event(ev, stream)

    def evict(self, act: Action, at: At) -> None:
        ex, name = self.ex, act.tensor
        self._handoff(ex.d2h, at.op, at.slot, name, "computed")
        self._send_out(name)
        graph.record_event(ex._event(name, "evicted"), ex.d2h)

    def release(self, act: Action, at: At) -> None:
        graph.wait_event(self.ex._event(act.tensor, "evicted"), self.ex.compute)
        self._released(act, at)

    def prefetch(self, act: Action, at: At) -> None:
        ex, name = self.ex, act.tensor
        self._handoff(ex.h2d, at.op, at.slot, name, "clear")
        self._bring_in(act)
        graph.record_event(ex._event(name, "arrived"), ex.h2d)

    def wait(self, act: Action, at: At) -> None:
        graph.wait_event(self.ex._event(act.tensor, "arrived"), self.ex.compute)
        self._arrived(act)

    def recompute(self, act: Action, at: At) -> None:
        self.alloc(act, at)
        self.ex._run_op(act.producer)

    # -- the backend's part -------------------------------------------------------------------
    def _send_out(self, name: str) -> None:
        """Enqueue moving `name`'s bytes to the host on the D2H stream."""
        raise NotImplementedError

    def _released(self, act: Action, at: At) -> None:
        """The eviction is done (compute waited for it): its device bytes are free."""
        raise NotImplementedError

    def _bring_in(self, act: Action) -> None:
        """Enqueue moving `act.tensor`'s bytes back to the device on the H2D stream."""
        raise NotImplementedError

    def _arrived(self, act: Action) -> None:
        """Compute waited for the prefetch: ops may use the tensor."""
        raise NotImplementedError
