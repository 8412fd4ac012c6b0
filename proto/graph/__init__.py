"""The graph layer: record a function's kernel launches once, replay them as one CUDA graph.

Modules, bottom to top (each imports only those above it in this list):

  ir        the description: nodes (kernel launches, copies, IF/WHILE on a device flag), their
            dependencies and the temporaries they use, as plain data; `races()`
  record    the one recording stack: launches, copies, events, allocations and control flow
            become a description instead of work
  plan      the memory planner: temporaries placed in one arena, shared by every graph of an
            owner through a `Tape`
  walk      the walk executor (the simulator's; node by node)
  cuda      the CUDA executor (cuda.core graphs, conditional nodes, shared executables)
  binding   how a replay's inputs reach the graph: copy, patch, alias
  capture   warm-up, record, plan, build: ``capture(fn, inputs) -> Graph``

Models use the names re-exported here: what they record with and `capture`.
"""
from proto.graph.binding import MODES, ReplayStats
from proto.graph.capture import CONTROLS, Graph, capture, default_executor
from proto.graph.cuda import SharedExecutables
from proto.graph.ir import Description, races
from proto.graph.plan import Tape
from proto.graph.record import (LoopBoundError, copy, if_then, phase, record, record_event,
                                recording, require_eager, wait_event, while_loop)

__all__ = ["CONTROLS", "Description", "Graph", "LoopBoundError", "MODES", "ReplayStats",
           "SharedExecutables", "Tape", "capture", "copy", "default_executor", "if_then", "phase",
           "races", "record", "record_event", "recording", "require_eager", "wait_event", "while_loop"]
