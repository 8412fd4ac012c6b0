"""The walk executor: run a description node by node with ordinary eager launches.

It is the executor on the simulator (which has no graphs), and on a GPU the reference the
CUDA executor is tested against. Nodes run in recording order (every dependency points
backwards, so that order respects them all); at a conditional node it reads the flag from
device memory where the GPU would test the condition. Its patch swaps the argument array
itself.
"""
from __future__ import annotations

from proto.device.backend import device_copy, view_at
from proto.graph.ir import Conditional, Copy, Description, KernelLaunch
from proto.graph.record import LoopBoundError, read_flag


def run_conditional(node: Conditional, body) -> None:
    """An IF / WHILE node driven from the host: read the flag, launch the body's executor (and
    check the body's own loops after each pass that ran it); a WHILE stops with
    LoopBoundError once `max_passes` passes left the flag set."""
    flag = node.args[0]
    if not node.loop:
        if read_flag(flag):
            body.launch()
            body.finish()
        return
    passes = 0
    while read_flag(flag):
        if passes == node.max_passes:
            raise LoopBoundError(f"while_loop: the flag is still set after max_passes="
                                 f"{node.max_passes} passes; the body must clear it")
        body.launch()
        body.finish()
        passes += 1


class WalkExecutor:
    """Launch the description node by node (simulator, or an eager reference on a GPU)."""

    memory_bytes = None

    def __init__(self, description: Description):
        self._nodes = list(description.nodes)
        self._args = [list(node.args) for node in self._nodes]  # what patch rewrites
        self._bodies = {j: WalkExecutor(node.body) for j, node in enumerate(self._nodes)
                        if isinstance(node, Conditional)}
        self.closed = False

    def launch(self) -> None:
        if self.closed:
            raise RuntimeError("launch: the executor is closed")
        for j, (node, args) in enumerate(zip(self._nodes, self._args)):
            if isinstance(node, KernelLaunch):
                node.kernel[node.griddim, node.blockdim, 0, node.sharedmem](*args)
            elif isinstance(node, Copy):
                device_copy(*args)
            elif isinstance(node, Conditional):
                run_conditional(node, self._bodies[j])
            else:
                raise NotImplementedError(f"walk executor: no rule for {type(node).__name__}")

    def prepare(self) -> None:
        """Nothing to get ready: the walk has no executables."""

    def finish(self) -> None:
        """Nothing to check: a loop past its bound raised during `launch`."""

    def set_array_args(self, j: int, args: dict) -> None:
        for i, (base, offset) in args.items():
            self._args[j][i] = view_at(base, offset, self._args[j][i])

    def close(self) -> None:
        self._nodes, self._args, self.closed = [], [], True
