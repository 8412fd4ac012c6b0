"""Data-dependent control flow inside one graph: IF and WHILE on a device flag.

Why. A CUDA graph replays fixed work, but generation is a loop whose length the data decides
(stop once every sequence has produced EOS). Left to the host, that decision costs a round
trip per token: replay a step, copy the tokens back, look, replay again, with the GPU idle
while the host looks. Grape moves the decision onto the device:

  flag    a 1-element int32 device array that a kernel of the body writes (non-zero: go on)
  WHILE   a conditional graph node (CUDA 12.4+): its body graph runs again and again while a
          condition value is non-zero. The condition is not memory but a handle the driver
          owns, set from device code with ``cudaGraphSetConditional``; so the CUDA executor
          puts a one-thread kernel that copies flag[0] into the handle before the node, and
          another at the end of the body (proto.executors).
  IF      the same with a body that runs at most once.

    control.while_loop(flag, body)   # eager: while flag[0]: body()   (a host read per pass)
                                     # recording: one Conditional node, its body recorded
    control.if_then(flag, body)      # eager: if flag[0]: body()

`body` takes no arguments and launches through proto.backend.launch / proto.graph (it closes
over its buffers, like any recorded function). Executors: the walk executor (the simulator)
reads the flag from device memory where the GPU would test the condition; the CUDA executor
builds real conditional nodes or, on a driver without them, says so and falls back to graphs
cut at each conditional node with the host reading the flags in between (correct, but it
synchronizes like the eager loop).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from proto import graph
from proto.backend import is_device_array


def check_flag(flag) -> None:
    if not is_device_array(flag):
        raise TypeError(f"flag: expected a 1-element int32 device array, got {type(flag).__name__}")
    if np.dtype(flag.dtype) != np.int32 or tuple(flag.shape) != (1,):
        raise ValueError(f"flag: expected a 1-element int32 device array, got "
                         f"{np.dtype(flag.dtype)} {tuple(flag.shape)}")


def read_flag(flag) -> bool:
    """flag[0] != 0, read on the host (waits for the work that writes it)."""
    return bool(flag.copy_to_host()[0])


def while_loop(flag, body: Callable[[], None]) -> int:
    """Run `body()` while flag[0] != 0 (tested before every pass); `body` must update the
    flag. Eagerly: returns the number of passes. Recording: returns 0, nothing runs."""
    check_flag(flag)
    if graph.recording():
        graph.record_conditional(flag, body, loop=True)
        return 0
    passes = 0
    while read_flag(flag):
        body()
        passes += 1
    return passes


def if_then(flag, body: Callable[[], None]) -> bool:
    """Run `body()` once if flag[0] != 0. Eagerly: returns whether it ran."""
    check_flag(flag)
    if graph.recording():
        graph.record_conditional(flag, body, loop=False)
        return False
    if read_flag(flag):
        body()
        return True
    return False
