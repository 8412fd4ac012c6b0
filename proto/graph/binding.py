"""How a replay's inputs reach a recorded graph: copy, patch or alias.

A CUDA graph stores raw device addresses in its nodes. Record a graph that reads buffer X and
every replay reads X again, whatever array the caller holds this time. There are three ways
to get new data in front of the graph, and Grape's first contribution is the third:

``copy``  (plain PyTorch CUDA graphs: ``static_input.copy_(x)``) Each input is copied into its
          placeholder, the buffer the graph was recorded with, before the launch: one driver
          call per input. Simple and always correct, but every replay moves every input byte
          (or, told `live`, a prefix of it): in beam search the input is the reordered KV
          cache, so the copy can cost more than the step itself.
``patch`` (tinygrad's ``input_replace``) The graph's kernel nodes that read an input get their
          pointer argument rewritten in the *instantiated* graph
          (``cuGraphExecKernelNodeSetParams``), so the graph reads the caller's array in place.
          No bytes move, but each changed node costs a driver call (~2 us from Python).
``alias`` (Grape's alias predictor) The placeholder IS the input: whoever produces the next
          step's input (a sampling kernel, a gather that reorders the KV cache) writes straight
          into the placeholder. Binding moves no bytes and patches nothing; it only verifies
          that the caller really passed the placeholder (same device address).

This module holds the parts that do not depend on how the graph is executed: the pure
function that finds which (node, argument) slots read which input (`input_slots`), the input
checks every replay runs before any launch (`check_inputs`), and the binding step itself
(`Binder`), whose patch loop calls the executor's ``set_array_args``. Every replay reports a
`ReplayStats`, whose bytes are counted from the copies binding actually issued.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from proto.device.backend import address, device_copy, extent, is_device_array, prefix_rows

MODES = ("copy", "patch", "alias")


@dataclasses.dataclass
class ReplayStats:
    """What binding cost: replays counted, bytes copied into placeholders, host seconds spent
    checking and binding inputs (launch not included). Adds up with ``+=``."""
    replays: int = 0
    bytes_copied: int = 0
    bind_s: float = 0.0

    def __iadd__(self, other: "ReplayStats") -> "ReplayStats":
        self.replays += other.replays
        self.bytes_copied += other.bytes_copied
        self.bind_s += other.bind_s
        return self

    @property
    def bind_us_per_replay(self) -> float:
        return 1e6 * self.bind_s / max(self.replays, 1)


# ------------------------------------------------------------------------- which slots read an input
@dataclasses.dataclass(frozen=True)
class Slot:
    """Argument `arg` of node `node` lies inside input `name`, `offset` bytes from its start."""
    node: int
    arg: int
    name: str
    offset: int


def input_slots(node_ranges, input_ranges: dict) -> list[Slot]:
    """Map every (node, argument) whose memory lies inside an input to that input.

    Pure: `node_ranges[j]` lists ``(arg_index, lo, hi)`` for node j's array arguments,
    `input_ranges` maps input name -> ``(lo, hi)``; both are byte ranges from `extent`. An
    argument may be a view (reshape, slice) of an input, hence ranges, not identity. An
    argument that straddles an input's edge cannot be rebound and raises ValueError.
    """
    slots = []
    for j, args in enumerate(node_ranges):
        for i, lo, hi in args:
            for name, (ilo, ihi) in input_ranges.items():
                if ilo <= lo and hi <= ihi:
                    slots.append(Slot(j, i, name, lo - ilo))
                    break
                if lo < ihi and ilo < hi:
                    raise ValueError(f"node {j} argument {i} overlaps input {name!r} only in part "
                                     f"(bytes [{lo:#x}, {hi:#x}) vs [{ilo:#x}, {ihi:#x})): "
                                     "patch binding cannot rebind it")
    return slots


# ------------------------------------------------------------------------- checks before launch
def what_it_is(x) -> str:
    """How an error names a value that should have been a device array."""
    return "a host NumPy array" if isinstance(x, np.ndarray) else type(x).__name__


def _describe(arr) -> str:
    return f"{np.dtype(arr.dtype)} {tuple(arr.shape)}"


def check_inputs(expected: dict, given: dict, where: str = "replay") -> None:
    """Raise TypeError/ValueError, naming the input and showing expected against actual,
    unless `given` matches `expected` in names, device residence, dtype, shape (hence size)
    and layout. Runs before any copy or launch."""
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise TypeError(f"{where}: expected inputs {sorted(expected)}, got {sorted(given)}"
                        + (f" (missing {missing})" if missing else "")
                        + (f" (unexpected {extra})" if extra else ""))
    for name, want in expected.items():
        got = given[name]
        if got is want:  # the placeholder itself (alias binding's every replay): it matches
            continue
        if not is_device_array(got):
            raise TypeError(f"{where}: input {name!r}: expected a device array {_describe(want)}, "
                            f"got {what_it_is(got)}")
        if np.dtype(got.dtype) != np.dtype(want.dtype):
            raise TypeError(f"{where}: input {name!r}: expected dtype {np.dtype(want.dtype)}, "
                            f"got {np.dtype(got.dtype)}")
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{where}: input {name!r}: expected shape {tuple(want.shape)} "
                             f"({want.nbytes} bytes), got {tuple(got.shape)} ({got.nbytes} bytes)")
        if not got.is_c_contiguous():
            raise ValueError(f"{where}: input {name!r}: expected a C-contiguous array, "
                             f"got strides {tuple(got.strides)}")


def check_live(placeholders: dict, live: dict, where: str = "replay") -> None:
    """`live` names inputs, each with (axis, n) inside that input's shape; before any copy."""
    if not isinstance(live, dict):
        raise TypeError(f"{where}: live: expected a dict of input name -> (axis, length), got "
                        f"{type(live).__name__}")
    for name, spec in live.items():
        if name not in placeholders:
            raise ValueError(f"{where}: live: {name!r} is not an input (inputs: {sorted(placeholders)})")
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in spec)):
            raise TypeError(f"{where}: live[{name!r}]: expected (axis, length), two integers, "
                            f"got {spec!r}")
        axis, n = (int(v) for v in spec)
        prefix_rows(placeholders[name], axis, n)


def check_disjoint(arrays: dict) -> None:
    """Placeholders must not share memory: each one is rebound on its own."""
    spans = sorted((extent(a), name) for name, a in arrays.items())
    for ((_, hi), a), ((lo, _), b) in zip(spans, spans[1:]):
        if lo < hi:
            raise ValueError(f"placeholders {a!r} and {b!r} overlap in device memory")


# ------------------------------------------------------------------------- binding
class Binder:
    """Bring a replay's inputs to the graph in one of `MODES`."""

    def __init__(self, mode: str, placeholders: dict, slots: list[Slot], executable):
        if mode not in MODES:
            raise ValueError(f"binding: expected one of {MODES}, got {mode!r}")
        self.mode, self.placeholders, self._executable = mode, placeholders, executable
        self._slots_by_name = defaultdict(list)
        for slot in slots:
            self._slots_by_name[slot.name].append(slot)
        # patch: the address each input's nodes point at now, and the arrays they point into,
        # held so that memory stays alive while the graph may read it.
        self._bound = {name: address(a) for name, a in placeholders.items()}
        self._held = dict(placeholders)
        self.bytes_issued = 0   # every byte a binding copy has moved, counted as issued
        self._bind = getattr(self, f"_{mode}")  # chosen once

    def bind(self, inputs: dict, live: dict | None = None) -> int:
        """Bring `inputs` to the graph; returns the bytes this binding copied. live: under copy
        binding, {name: (axis, n)} copies only that input's first n entries along `axis`
        (what the graph reads of it this replay; the rest of its placeholder keeps old data)."""
        before = self.bytes_issued
        self._bind(inputs, live or {})
        return self.bytes_issued - before

    def _copy(self, inputs: dict, live: dict) -> None:
        for name, x in inputs.items():
            placeholder = self.placeholders[name]
            if address(x) == address(placeholder):
                continue
            self.bytes_issued += device_copy(placeholder, x, prefix=live.get(name))

    def _alias(self, inputs: dict, live: dict) -> None:
        for name, x in inputs.items():
            want, got = address(self.placeholders[name]), address(x)
            if got != want:
                raise ValueError(
                    f"replay: input {name!r}: alias binding needs the graph's placeholder itself "
                    f"(device address {want:#x}), got a different array at {got:#x}; have the "
                    f"producer write into graph.placeholders[{name!r}]")

    def _patch(self, inputs: dict, live: dict) -> None:
        by_node = defaultdict(dict)
        for name, x in inputs.items():
            if address(x) == self._bound[name]:
                continue  # nodes already read this array: nothing to rewrite
            for slot in self._slots_by_name[name]:
                by_node[slot.node][slot.arg] = (x, slot.offset)
            self._bound[name], self._held[name] = address(x), x
        for node, args in by_node.items():  # one driver call per node, however many slots
            self._executable.set_array_args(node, args)
