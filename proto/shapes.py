"""Dynamic shapes: which graph serves a given length.

A graph freezes its launch sizes and the shapes baked into its kernel arguments, so a length
that changes every step (tokens generated so far, live beams, a batch's sequence length)
needs one of three strategies. All three give the same numbers; they differ in how many
graphs exist and how much padded work each replay does.

``exact``   one graph per length (Grape, plain PyTorch graphs). No wasted work, but GPT-2
            beam search to 1024 tokens needs ~1000 graphs, and each costs driver memory
            (about 3 KiB per kernel node on the H200) on top of its buffers.
``bucket``  round the length up to a bucket (powers of two by default) and pad (vLLM and
            SGLang's batch-size buckets). log2(max) graphs; a replay computes padded rows too,
            whose results the caller ignores. The padding must be neutral for any reduction
            over the padded axis (-inf before a softmax, 0 before a sum): the caller writes it.
``device``  kernels read the length from a device int32 (kernels.softmax.masked_softmax,
            kernels.attention's `pos`), so one graph per bucket, or one in all, serves every
            length, and writing the next length is a device write, not a new graph.

Buffers are *capacity* buffers. Each dynamic input (leading axis = the length) is passed as a
buffer with room for the graph's rows, usually `max_length`; the dispatcher hands the graph
for key K the prefix ``buffer[:K]``, which starts at the buffer's own address. That makes one
buffer the alias-binding placeholder of every graph, the way Grape's memory tape gives a
tensor the same address in every graph; it is also why graphs are captured largest first
when built eagerly.

    graphs = ShapeDispatcher(build, strategy="bucket", max_length=1024, dynamic=("x",))
    y = graphs.replay(length, x=x_buffer, n=n_device)   # build(key) -> a captured Graph

Graphs are built on first use, or all at construction (`eager=True`), largest first either
way when `largest_first` (the first graph built is then the largest): graphs whose
temporaries share one memory tape (proto.graph.plan.Tape) must be planned largest first.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

import numpy as np

from kernels import _check
from proto.device import backend

STRATEGIES = ("exact", "bucket", "device")


def power_of_two_buckets(max_length: int) -> list[int]:
    """1, 2, 4, ... below `max_length`, then `max_length` itself."""
    buckets, b = [], 1
    while b < max_length:
        buckets.append(b)
        b *= 2
    return buckets + [max_length]


def graph_keys(strategy: str, max_length: int, buckets: Sequence[int] | None) -> list[int]:
    """Every key a dispatcher can build, ascending. `device` without buckets: one graph."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    max_length = _check.positive("max_length", max_length)
    if strategy == "exact":
        return list(range(1, max_length + 1))
    if buckets is None:
        return power_of_two_buckets(max_length) if strategy == "bucket" else [max_length]
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in buckets):
        raise ValueError(f"buckets: expected integer sizes, got {list(buckets)}")
    keys = sorted(set(int(b) for b in buckets))
    if not keys or keys[0] < 1 or keys[-1] != max_length:
        raise ValueError(f"buckets: expected positive sizes whose largest is max_length "
                         f"{max_length}, got {list(buckets)}")
    return keys


def key_for(length: int, keys: Sequence[int]) -> int:
    """The smallest key >= length (keys ascending): the graph that serves `length`."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
            or not 1 <= length <= keys[-1]:
        raise ValueError(f"length: expected 1..{keys[-1]}, got {length}")
    return keys[bisect.bisect_left(keys, length)]


class ShapeDispatcher:
    """Map a length to its graph; build graphs lazily (on first use) or eagerly (largest first).

    `build(key)` returns a captured proto.graph.Graph whose dynamic inputs have `key` rows
    (leading axis). `dynamic` names those inputs; the others (weights, a device length) pass
    through unchanged.
    """

    def __init__(self, build: Callable[[int], object], *, strategy: str, max_length: int,
                 dynamic: Sequence[str], buckets: Sequence[int] | None = None,
                 eager: bool = False, largest_first: bool = True):
        self.strategy = strategy
        self.keys = graph_keys(strategy, max_length, buckets)
        self.dynamic = tuple(dynamic)
        self._build = build
        self.largest_first = largest_first
        self.graphs: dict[int, object] = {}
        if eager:
            self.build_all()

    def build_all(self) -> None:
        """Build every graph not built yet, largest first (see the module docstring)."""
        for key in reversed(self.keys):
            if key not in self.graphs:
                self.graphs[key] = self._build(key)

    def graph(self, length: int):
        """The graph serving `length`, built now if it is the first use of its key."""
        key = key_for(length, self.keys)
        if key not in self.graphs:
            if self.largest_first and not self.graphs and key != self.keys[-1]:
                self.graphs[self.keys[-1]] = self._build(self.keys[-1])
            self.graphs[key] = self._build(key)
        return self.graphs[key]

    def replay(self, length: int, **inputs):
        """Replay the graph serving `length` on the first `key` rows of each dynamic input;
        returns the graph's outputs."""
        key = key_for(length, self.keys)
        missing = [name for name in self.dynamic if name not in inputs]
        if missing:
            raise TypeError(f"replay: missing dynamic input(s) {missing}; this dispatcher "
                            f"slices {list(self.dynamic)} to each graph's rows")
        graph = self.graph(length)
        for name in self.dynamic:
            x = inputs[name]
            if x.shape[0] < key:
                raise ValueError(f"replay: input {name!r}: the graph for length {length} reads "
                                 f"{key} rows, got a buffer of {x.shape[0]}; pass a buffer with "
                                 f"room for {key} rows (rows past the length are padding)")
            inputs[name] = x if x.shape[0] == key else backend.leading(x, key)
        return graph.replay(**inputs)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @property
    def memory_bytes(self) -> int | None:
        """Driver memory of every graph built so far (None where it cannot be measured)."""
        sizes = [g.memory_bytes for g in self.graphs.values()]
        return None if any(s is None for s in sizes) else sum(sizes)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}

    def __enter__(self) -> "ShapeDispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
