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
Streams, events, host I/O and the replay's ordering are shared with the managed-memory backend
(runner.py); this module is the pool-and-pinned-copies half.

One graph per step. Every copy and event goes through proto.graph (`copy`, `record_event`,
`wait_event`) and every kernel through proto.device.backend.launch, so `capture()` can record a whole
step, all three streams, into one graph description: the events become edges between the
compute chain and the two copy chains, and the CUDA executor instantiates it as one CUDA
graph whose copy branches overlap compute as the streams did. A step is then one graph
launch. That works because a plan is static: every step allocates the same offsets, moves the
same tensors between the same buffers, in the same order.
"""
from __future__ import annotations

import numpy as np

from proto import graph
from proto.device.backend import cuda
from proto.tape import Tape
from proto.vm.actions import Action, Plan
from proto.vm.pool import DevicePool
from proto.vm.runner import Replay, StepRunner
from proto.vm.walk import At


class Executor(StepRunner):
    """Replays `plan` for `tape` on a budgeted device pool, one `step()` per training step.

    Persistent tensors (parameters, gradients, state, inputs) stay at fixed places, or, when
    the plan homes them on the host, in their pinned buffers between steps: `load` writes
    them, `read` returns any persistent tensor or step output (valid after `step`).
    Call `close()` (or use `with`) to give the arena, pinned buffers and streams back.
    """

    def __init__(self, tape: Tape, plan: Plan, *, managed: bool = False, pinned: dict | None = None):
        """pinned: host buffers by tensor name to use (and add to) instead of allocating
        new ones; pinning gigabytes takes a while, so runs of one tape can share them."""
        super().__init__(tape, plan)
        self.pool = DevicePool(plan.budget, plan.arena_bytes, managed=managed)
        self.current.update({name: self.pool.alloc(tape.tensors[name], off)
                             for name, off in plan.persistent.items()})
        on_host = {a.tensor for _, _, a in plan.actions() if a.kind == "evict"} | set(plan.homed)
        self.pinned = pinned if pinned is not None else {}
        for name in sorted(on_host - set(self.pinned)):
            self.pinned[name] = cuda.pinned_array(tape.tensors[name].shape, tape.tensors[name].dtype)
        self._pending: dict[str, object] = {}    # prefetched views, usable after their wait

    def _write(self, name: str, value: np.ndarray) -> None:
        if name in self.plan.homed:
            self.pinned[name][...] = value
        else:
            self.current[name].copy_to_device(value)

    def _read(self, name: str) -> np.ndarray:
        if name in self.plan.homed:
            return np.array(self.pinned[name])
        return self.current[name].copy_to_host()

    def _start_step(self) -> None:
        for name in [n for n in self.current if n not in self.plan.persistent]:
            self.pool.free(name)          # outputs of the previous step
            del self.current[name]

    def _replay(self, marks):
        return _Replay(self, marks)

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

    def _release(self) -> None:
        self._pending.clear()
        self.pinned = None   # shared buffers stay with their owner
        self.pool.close()


class _Replay(Replay):
    """The pool's half of a step: views of the arena at planned offsets, pinned copies."""

    def alloc(self, act: Action, at: At) -> None:
        self.ex.current[act.tensor] = self.ex.pool.alloc(self.ex.tape.tensors[act.tensor], act.offset)

    def free(self, act: Action, at: At) -> None:
        self.ex.pool.free(act.tensor)
        del self.ex.current[act.tensor]

    drop = discard = free   # the bytes are free at once: a host copy is current, or none is needed

    def _send_out(self, name: str) -> None:
        graph.copy(self.ex.pinned[name], self.ex.current[name], stream=self.ex.d2h)

    def _released(self, act: Action, at: At) -> None:
        self.free(act, at)

    def _bring_in(self, act: Action) -> None:
        ex, name = self.ex, act.tensor
        view = ex.pool.alloc(ex.tape.tensors[name], act.offset)
        graph.copy(view, ex.pinned[name], stream=ex.h2d)
        ex._pending[name] = view

    def _arrived(self, act: Action) -> None:
        self.ex.current[act.tensor] = self.ex._pending.pop(act.tensor)
