"""A training step as a tape: named tensors and the ordered ops that read and write them.

A model (proto.models.vgg) *describes* its step as a Tape; a memory policy (proto.vm) *runs*
it. Keeping the two apart is what lets one VGG step run unconstrained, under demand paging,
or under the AutoVM swap schedule with identical math: the policy decides where each tensor
lives before an op runs, never what the op computes.

    tape.tensors["conv3.out"]  -> TensorSpec(shape=(B, C, H, W), kind="activation")
    tape.ops[i].reads/writes   -> the names an op touches; the policy makes them resident
    tape.ops[i].run(arrays)    -> launches the op's kernels on device arrays, by name
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Callable, Literal

import numpy as np

TensorKind = Literal["input", "param", "grad", "activation", "workspace", "state"]
Phase = Literal["forward", "loss", "backward", "update"]


def _names(what: str, names) -> None:
    # A bare string would be read as its characters: ("x") is "x", not ("x",).
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{what}: expected a tuple of tensor names, got {names!r}")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: TensorKind
    dtype: np.dtype = np.dtype(np.float32)

    def __post_init__(self):
        if self.kind not in typing.get_args(TensorKind):
            raise ValueError(f"tensor {self.name!r}: kind must be one of "
                             f"{typing.get_args(TensorKind)}, got {self.kind!r}")
        if not isinstance(self.shape, tuple) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
                for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be a tuple of positive "
                             f"integers, got {self.shape!r}")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of the tape. `run(arrays, stream)` launches kernels; `arrays` maps every name in
    reads + writes to a device array of its TensorSpec's shape and dtype."""
    name: str
    phase: Phase
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    run: Callable[[dict, object], None]
    flops: float = 0.0          # for the scheduler's compute-time estimate and recompute cost
    layer: str = ""             # the model layer this op belongs to (for errors and plots)


@dataclasses.dataclass
class Tape:
    tensors: dict[str, TensorSpec]
    ops: list[Op]

    def __post_init__(self):
        for op in self.ops:
            _names(f"op {op.name!r}: reads", op.reads)
            _names(f"op {op.name!r}: writes", op.writes)
            if op.phase not in typing.get_args(Phase):
                raise ValueError(f"op {op.name!r}: phase must be one of "
                                 f"{typing.get_args(Phase)}, got {op.phase!r}")
            if not callable(op.run):
                raise ValueError(f"op {op.name!r}: run must be callable, got {op.run!r}")
            for name in op.reads + op.writes:
                if name not in self.tensors:
                    raise ValueError(f"op {op.name!r} touches undeclared tensor {name!r}")

    def uses(self, name: str) -> list[int]:
        """Indices of the ops that read or write `name`, in order."""
        return [i for i, op in enumerate(self.ops) if name in op.reads or name in op.writes]

    def nbytes(self, kind: TensorKind | None = None) -> int:
        return sum(t.nbytes for t in self.tensors.values() if kind is None or t.kind == kind)
