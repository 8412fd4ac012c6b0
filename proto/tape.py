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
from typing import Callable, Literal

import numpy as np

TensorKind = Literal["input", "param", "grad", "activation", "workspace", "state"]
Phase = Literal["forward", "loss", "backward", "update"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: TensorKind
    dtype: np.dtype = np.dtype(np.float32)

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
            for name in op.reads + op.writes:
                if name not in self.tensors:
                    raise ValueError(f"op {op.name!r} touches undeclared tensor {name!r}")

    def uses(self, name: str) -> list[int]:
        """Indices of the ops that read or write `name`, in order."""
        return [i for i, op in enumerate(self.ops) if name in op.reads or name in op.writes]

    def nbytes(self, kind: TensorKind | None = None) -> int:
        return sum(t.nbytes for t in self.tensors.values() if kind is None or t.kind == kind)
