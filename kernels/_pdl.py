"""Programmatic dependent launch (Hopper): a kernel of a graph may start while the kernel
before it still runs, so its launch, its blocks' start-up and its loads of constant data
(weights) overlap its predecessor's tail. A decode step is a chain of ~100 short kernels whose
fixed cost, not their bytes, sets its time (dev/notes/decode.md); this hides part of it.

A kernel opts in with `proto.device.backend.jit(..., early_launch=True)` and keeps one rule: before
`wait()` it reads only data no kernel of the graph writes (weights, shapes) and writes
nothing. `wait()` (PTX griddepcontrol.wait) returns once the predecessor has completed and its
writes are visible; without a programmatic predecessor (eager launches, the simulator) it
returns at once. `launch_dependents()` (griddepcontrol.launch_dependents) lets the successor
start once every block of this kernel has called it; kernels call it right after `wait()`,
so at most two kernels of a chain overlap. The graph layer (proto.graph.cuda) turns an edge
into a programmatic one where the successor opted in, unless PROTO_EARLY_LAUNCH=off (on the
H200, GPT-2 small's graphed step took 585 us with it against 629 without).
"""
from __future__ import annotations

from proto.device.backend import SIMULATOR

if SIMULATOR:   # the simulator runs one kernel at a time: there is nothing to wait for
    def wait():
        pass

    def launch_dependents():
        pass
else:
    from kernels._ptx import instruction

    wait = instruction("griddepcontrol.wait;")
    launch_dependents = instruction("griddepcontrol.launch_dependents;")
