"""Capture: a function's launches recorded once, planned, instantiated, then replayed.

Why graphs. An eager kernel launch costs the host 5-30 us (Python, Numba's argument
flattening, the driver), while a small decode-step kernel runs for a few microseconds, so a
step of hundreds of kernels is bound by the CPU. A CUDA graph is the list of launches (and
copies) with their dependencies, handed to the driver once: *instantiation* validates it and
prepares every launch, and from then on one ``cuGraphLaunch`` replays all of it for about
1 us per kernel. What a graph freezes is everything a launch is made of: the kernels, grid and
block sizes, and every argument, including the device address of every array. Replaying
therefore reruns the same arithmetic on the same buffers; new data must be placed where the
graph looks (proto.graph.binding) and new shapes need new graphs or kernels that read their
length on the device (proto.shapes).

``capture(fn, inputs)`` goes through the phases once (as tinygrad's TinyJit and
torch.cuda.graphs do):

  WARM-UP  run `fn` eagerly `warmup` times (default 1), so that whatever it does only on its
           first call (load a table, fill a cache) happens outside the graph: a graph must
           never record a one-off first-call path. Kernels that allocate their scratch
           through ``proto.device.backend.empty`` need no warm-up for it; pass ``warmup=0`` when
           running `fn` once more would change state the caller cares about.
  RECORD   run `fn` on the placeholders (`inputs`) with every launch, copy and allocation
           recorded (proto.graph.record): nothing runs.
  PLAN     place every temporary `fn` allocated in an arena (proto.graph.plan): the
           graph's own, or a `Tape` shared by every graph of one owner, so a tensor has one
           address in all of them. ``planned=False`` keeps each temporary in private memory
           (what a graph without a planner holds). A description recorded on several streams
           is checked for races (proto.graph.ir.races) before it goes further.
  BUILD    lower the description to an executable: a CUDA graph (proto.graph.cuda; its own,
           or one of a SharedExecutables pool's) or, on the simulator, the walk executor.

and returns a `Graph`:

    graph = capture(step, inputs={"x": x_placeholder}, binding="copy")
    y = graph.replay(x=x_new)    # check inputs, bind, launch; returns fn's outputs (arrays
                                 # the replay writes again: graph.outputs)
    graph.stats                  # ReplayStats summed over replays: bytes copied, bind time
    graph.capture_s              # host seconds of each phase: warmup, record, plan, build
    graph.close()                # or: with capture(...) as graph: ...

Every array a node references is kept alive by the description until `close()`; closing
destroys the executable and drops those references, so the buffers are freed.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import extent
from proto.graph import plan as planner
from proto.graph.binding import (MODES, Binder, ReplayStats, check_disjoint, check_inputs,
                                 check_live, input_slots, what_it_is)
from proto.graph.ir import Description, races, segment
from proto.graph.predicate import MAX_UNROLL, PredicatedExecutor
from proto.graph.record import record, recording
from proto.graph.walk import WalkExecutor


EXECUTORS = ("cuda", "walk")


def _executor(description, executor: str, shared, control: str, unroll: int):
    """What runs the description: predication over the chosen executor's parts, host-driven
    segments, or the executor itself (CUDA conditional nodes where the driver has them; the
    walk reads flags on the host anyway, and shares no executables)."""
    if executor == "walk":
        if control == "predicated" and description.has_conditionals:
            return PredicatedExecutor(description, WalkExecutor, unroll)
        return WalkExecutor(description)
    from proto.graph import cuda
    if control == "predicated" and description.has_conditionals:
        return PredicatedExecutor(description, cuda.CudaExecutor, unroll)
    if control == "host" and description.has_conditionals:
        return cuda.HostDrivenExecutor(description)
    return cuda.make_cuda_executor(description, shared, unroll)


CONTROLS = ("conditional", "predicated", "host")


def default_executor() -> str:
    return "walk" if backend.SIMULATOR else "cuda"


class Graph:
    """A captured function: `replay(**inputs)` runs it again on new inputs. Made by `capture`.

    A function that marked phases (proto.graph.record.phase) has an executable per phase:
    `replay(**inputs)` runs them all, in order; `replay(phase=name, **inputs)` runs one,
    and the phases of one step must be replayed in order, the inputs bound at the first.
    Between them nothing else may run on the graph's arena (another graph of its tape):
    the bytes a later phase reads were left there by an earlier one."""

    def __init__(self, description: Description, outputs, placeholders: dict, *, binding: str,
                 executor: str, plan, tape, own_tape: bool, shared, control: str, unroll: int,
                 parts=(("start", 0, None),)):
        self.description, self.outputs, self.placeholders = description, outputs, placeholders
        self.binding, self.executor, self.plan = binding, executor, plan
        self._tape, self._own_tape = tape, own_tape
        self.slots = []  # patch binding: which (node, argument) reads which input
        if binding == "patch":
            self.slots = input_slots([[(i, *extent(a)) for i, a in node.array_args()]
                                      for node in description.nodes],
                                     {name: extent(a) for name, a in placeholders.items()})
        self.phases = tuple(name for name, _, _ in parts)
        self._executables = []
        try:
            for _, lo, hi in parts:
                part = description if len(parts) == 1 else segment(description, lo, hi)
                self._executables.append(_executor(part, executor, shared, control, unroll))
        except BaseException:
            for e in self._executables:
                e.close()
            raise
        self._binder = Binder(binding, placeholders, self.slots, self._executables[0])
        self._next = 0   # the phase a replay may run next
        self.stats = ReplayStats()  # accumulated over replays
        self.last_stats = ReplayStats()
        self.capture_s: dict[str, float] = {}   # seconds a phase (set by `capture`)

    @property
    def closed(self) -> bool:
        return self._executables is None

    def replay(self, /, live: dict | None = None, phase: str | None = None, **inputs):
        """Check the inputs (names, device, dtype, shape, layout) before anything moves, bind
        them, launch. Returns `outputs`. A graph with a WHILE loop waits for the GPU after the
        launch to read its loops' pass counters (LoopBoundError if one hit its bound).

        live: {input name: (axis, n)}: the graph reads only that input's first n entries along
        `axis` this time (a KV cache's live positions), so copy binding copies only those.
        phase: run only that phase (see the class doc); None runs every phase."""
        if self.closed:
            raise RuntimeError("replay: the graph is closed")
        if phase is None:
            first, last = 0, len(self.phases)
        else:
            if phase not in self.phases:
                raise ValueError(f"phase: expected one of {list(self.phases)}, got {phase!r}")
            first = self.phases.index(phase)
            last = first + 1
            if first not in (0, self._next):
                raise RuntimeError(f"replay(phase={phase!r}): the next phase of this step is "
                                   f"{self.phases[self._next]!r}; phases run in order")
            if first > 0 and (inputs or live):
                raise ValueError(f"replay(phase={phase!r}): inputs are bound at the first "
                                 f"phase, {self.phases[0]!r}")
        t0 = time.perf_counter()
        moved = 0
        if first == 0:
            check_inputs(self.placeholders, inputs)
            if live:
                check_live(self.placeholders, live)
            moved = self._binder.bind(inputs, live)
        bind_s = time.perf_counter() - t0
        for executable in self._executables[first:last]:
            executable.launch()
        for executable in self._executables[first:last]:
            executable.finish()
        self._next = last % len(self.phases)
        if first == 0:
            self.last_stats = ReplayStats(1, moved, bind_s)
            self.stats += self.last_stats
        return self.outputs

    def prepare(self) -> None:
        """Get the executable ready for the next replay ahead of time (a shared executable is
        retargeted to this graph now, while the GPU may still be busy); optional."""
        if self.closed:
            raise RuntimeError("prepare: the graph is closed")
        for executable in self._executables:
            executable.prepare()

    @property
    def memory_bytes(self) -> int | None:
        """Device memory the executables took at instantiation (None: unmeasurable; 0 for a
        graph whose executable is shared)."""
        if self.closed:
            return None
        sizes = [e.memory_bytes for e in self._executables]
        return None if any(s is None for s in sizes) else sum(sizes)

    @property
    def private_bytes(self) -> int:
        """Bytes of temporaries held in private memory (an unplanned graph's buffers)."""
        return 0 if self.plan is not None else sum(b.nbytes for b in self.description.buffers)

    def close(self) -> None:
        """Destroy the executables and drop every buffer reference the graph holds."""
        if self._executables is not None:
            backend.synchronize()  # a replay in flight must finish before its graph goes
            for executable in self._executables:
                executable.close()
        if self._own_tape and self._tape is not None:
            self._tape.close()
        self._executables = self._binder = self.description = self.outputs = self._tape = None
        self.placeholders, self.slots = {}, []

    def __enter__(self) -> "Graph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parts(phases: list[tuple[str, int]], n: int) -> list[tuple[str, int, int]]:
    """(name, first node, end) of every non-empty phase; nodes before the first mark are the
    phase "start"."""
    marks = ([("start", 0)] if not phases or phases[0][1] > 0 else []) + list(phases)
    parts = [(name, lo, marks[i + 1][1] if i + 1 < len(marks) else n)
             for i, (name, lo) in enumerate(marks)]
    empty = [name for name, lo, hi in parts if hi <= lo]
    if empty:
        raise ValueError(f"capture: phases {empty} launched no kernels and made no copies")
    return parts


def capture(fn: Callable, inputs: dict, *, binding: str = "copy", executor: str | None = None,
            warmup: int = 1, planned: bool = True, tape: planner.Tape | None = None,
            shared=None, control: str = "conditional", unroll: int = 16) -> Graph:
    """Warm up `fn` on `inputs`, record it with `inputs` as placeholders, plan its
    temporaries, build the executable; see the module doc. `fn` takes the inputs as keyword
    arguments and launches through proto.device.backend.launch / proto.graph.copy; what it returns
    becomes `outputs`.

    binding: one of proto.graph.binding.MODES. executor: "cuda" (default on a GPU) or "walk".
    planned: place temporaries in an arena (`tape`'s, shared with the other graphs of its
    owner, or the graph's own) or keep them private. shared: a proto.graph.cuda
    SharedExecutables pool this graph's executable comes from (CUDA executor only).
    control: how IF/WHILE nodes run: "conditional" (CUDA conditional graph nodes; on a driver
    without them, predication, with a warning), "predicated" (proto.graph.predicate: kernels
    test a device flag, a WHILE unrolled `unroll` passes per launch) or "host" (graph
    segments, the host reading each flag).
    """
    if recording():
        raise RuntimeError("capture: called while recording a graph; captures cannot nest")
    if not callable(fn):
        raise TypeError(f"fn: expected the function to capture, got {type(fn).__name__}")
    if binding not in MODES:
        raise ValueError(f"binding: expected one of {MODES}, got {binding!r}")
    executor = executor or default_executor()
    if executor not in EXECUTORS:
        raise ValueError(f"executor: expected one of {list(EXECUTORS)}, got {executor!r}")
    if control not in CONTROLS:
        raise ValueError(f"control: expected one of {CONTROLS}, got {control!r}")
    unroll = _check.positive("unroll", unroll, at_most=MAX_UNROLL)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup < 0:
        raise ValueError(f"warmup: expected a non-negative integer, got {warmup!r}")
    if tape is not None and not isinstance(tape, planner.Tape):
        raise TypeError(f"tape: expected a proto.graph.Tape (or None), got {type(tape).__name__}")
    if tape is not None and not planned:
        raise ValueError("tape: a tape places temporaries; it needs planned=True")
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs: expected a dict of name -> device array, got {type(inputs).__name__}")
    for reserved in ("live", "phase"):
        if reserved in inputs:
            raise ValueError(f"inputs: {reserved!r} names an argument of replay; rename that input")
    for name, x in inputs.items():
        if not backend.is_device_array(x):
            raise TypeError(f"inputs: {name!r}: expected a device array (the graph's "
                            f"placeholder), got {what_it_is(x)}")
    check_inputs(inputs, inputs, where="placeholders")
    check_disjoint(inputs)
    placeholders = dict(inputs)

    t0 = time.perf_counter()
    for _ in range(int(warmup)):      # WARM-UP
        fn(**placeholders)
    backend.synchronize()
    t1 = time.perf_counter()
    with record(private=not planned) as recorder:        # RECORD
        outputs = fn(**placeholders)
    if not recorder.nodes:
        raise ValueError("record: the function launched no kernels and made no copies")
    description = recorder.description()
    if not description.is_chain:
        found = races(description)
        if found:
            raise ValueError(f"capture: nodes {found[:5]} touch the same bytes with no "
                             "order between them (a missing event wait between streams)")
    parts = _parts(recorder.phases, len(description.nodes))
    if len(parts) > 1 and (binding == "patch" or shared is not None):
        raise ValueError("capture: a graph of several phases takes 'copy' or 'alias' binding "
                         "and executables of its own (patch binding and a shared pool "
                         "retarget one executable)")
    if binding == "patch" and description.has_conditionals:
        raise ValueError("binding 'patch' rewrites top-level nodes only, and a "
                         "conditional body may read the inputs too; use 'copy' or 'alias'")
    plan = None
    own_tape = planned and tape is None
    t2 = time.perf_counter()
    if planned:                       # PLAN
        tape = tape or planner.Tape("graph")
        plan = tape.plan_graph(description, planner.leaves(outputs))
        # (a description on several streams keeps every buffer live throughout: nothing
        # shares bytes, so planning cannot add a race)
        description, outputs = planner.apply(description, plan, tape.arena, outputs)
    t3 = time.perf_counter()
    try:                              # BUILD
        graph = Graph(description, outputs, placeholders, binding=binding,
                      executor=executor, plan=plan, tape=tape, own_tape=own_tape,
                      shared=shared, control=control, unroll=unroll, parts=parts)
    except BaseException:
        if own_tape:
            tape.close()
        raise
    graph.capture_s = {"warmup": t1 - t0, "record": t2 - t1, "plan": t3 - t2,
                       "build": time.perf_counter() - t3}
    return graph
