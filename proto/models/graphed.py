"""Graphed decode steps: one generic wrapper (`Graphed`) and the adapters it serves today, a
decoder over a KV cache (GPT-2, GPT-J; greedy and beam search) and the LSTM LM.

    g = GraphedDecoder(model, batch=5, max_len=1024, binding="alias", strategy="device")
    out = g.beam_search(prompt, max_new_tokens=1000)   # generate.beam_search, graphed steps
    g.stats(), g.num_graphs, g.memory_bytes            # bytes bound, graphs, driver memory
    g.arena_bytes                                      # the memory tape every graph shares
    g.close()

The model protocol: what a model gives the graph layer
------------------------------------------------------
A graphed model is an adapter (GraphedDecoder, GraphedLSTM) that owns the model's persistent
state (weights stay in the model; KV caches, recurrent state and input buffers here) and
gives `Graphed` two things:

  placeholders(state_set, key)  the named device arrays a graph of shape `key` records on for
                                state set `state_set`: the state's arrays and the input
                                buffers a producer (the search) writes;
  recorded_step(key)            the model step over those names, as `capture` records it;
                                what it returns is the graph's outputs (the logits a search
                                reads; a replay returns the same arrays).

`Graphed` is given two policies, never branching on the model:
  binding   how inputs reach a graph (proto.graph.binding): `alias` records one graph set per
            state set, so the producer that writes a set (a beam reorder, the argmax) writes
            the next graph's placeholders in place; `copy` and `patch` record one graph set
            and move the live inputs' bytes or addresses into it at every replay. An input
            buffer is the placeholder itself under alias binding (`input_buffer`).
  shapes    which graph serves a length (proto.shapes): `exact` one per length, `bucket` one
            per power-of-two bucket, `device` one for all lengths (the length read on the
            device).
and owns the rest: a shape dispatcher per graph set, the memory tape every graph shares (the
planner: one arena, a tensor at the same address in every graph), optionally K shared
executables, helper graphs (GPT-2's cache reorders) and the accounting over all of them.
Adding a model is an adapter with those two methods and its search, plus a test against the
eager model (tests/test_graphed_models.py).

Decoders (GPT-2, GPT-J)
-----------------------
`GraphedDecoder.step(tokens, pos, cache)` has the model's step signature, so
proto.models.generate runs it unchanged (`greedy`/`beam_search` here pass it with the right
caches and input buffers). The prompt (prefill, T > 1) runs eagerly once; every search step
(T = 1) replays a graph recorded from the model's step. The caches are of the model's dtype
(GPT-J's float16). Its state sets are KV caches; how each binding moves them:
  copy   PtGraph, the plain PyTorch-CUDA-graph way. The graph owns static placeholders: a
         token buffer and one KV cache set S. The search writes tokens into its own buffer;
         the beam reorder reads S (the model's output cache) and gathers into a scratch set R
         (torch's index_select result; eager launches, outside the graph), and the next
         replay copies tokens and R into the placeholders: the whole KV cache moves every
         beam step.
  patch  Two cache sets A and B; the search gathers from one into the other, alternating.
         One graph, recorded on A; a replay on B rewrites the pointers of every node that
         reads the cache (cuGraphExecKernelNodeSetParams), so no bytes move. The gathers
         (2 per layer) are themselves replayed as a graph per direction (A->B, B->A).
  alias  Grape. The same A/B sets, but two graphs, one recorded on each, so the gather's
         destination IS the next replay's placeholder; the search writes the tokens and the
         position straight into the placeholders (that H2D write is input preparation, not
         binding). Binding checks addresses and moves 0 bytes. Gathers graphed as for patch.
and each shape strategy (the context length grows by one every step):
  exact   one graph per length, the position baked in (each graph reads its own constant
          device int32). A host mirror of the position picks the graph. ~max_len graphs.
  bucket  one graph per power-of-two bucket of lengths. The KV cache of a bucket holds that
          many positions (B, H, bucket, hd), so its attention launches are sized to the
          bucket; positions past the length are the padding, which the attention masks by the
          position it reads on the device. Crossing into a larger bucket re-pads the live
          cache into the larger one (device copies, log2(max_len) times a generation).
  device  one graph for every length: the position lives in device memory and every kernel
          reads it there (kernels.attention, kernels.embedding). The capacity cache max_len.

Memory and executables
----------------------
The step's temporaries (proto.device.backend.empty) are planned into the tape's arena
(`planned=True`, the default): the arena is what the largest graph needs. `planned=False`
gives every graph private buffers instead (what graphs without a planner hold). Each graph
instantiates its own executable or, with `shared_executables=K`, the graphs share K of them,
retargeted with executable update (CUDA only); a step retargets one to the next step's graph
right after launching its own, so the update overlaps the GPU's work.

Graphs are recorded without a warm-up (a model step has no first-call path: its scratch comes
from `empty`), on first use, largest first; or all up front (`build_all`), so a timed run
excludes capture.
"""
from __future__ import annotations

import functools

import numpy as np

from kernels import _check, sampling
from proto.device import backend
from proto import shapes
from proto.device.backend import cuda, leading, reshaped
from proto.graph import (MODES, ReplayStats, SharedExecutables, Tape, capture, copy,
                         default_executor)
from proto.models import generate
from proto.models.gpt2 import KVCache
from proto.models.lstm import LSTMState


# --------------------------------------------------------------------------- the wrapper
class Graphed:
    """A model's step replayed as graphs: see the module doc for the protocol `model` follows
    (`placeholders`, `recorded_step`, a `name` for its memory tape) and the two policies.

    state_sets: how many sets of state the model alternates between (GPT-2's beam search
    gathers from one KV cache set into the other: 2; the LSTM updates its state in place: 1).
    `dynamic` names the inputs whose leading axis is the shape (proto.shapes)."""

    def __init__(self, model, *, binding: str, strategy: str, max_length: int, buckets=None,
                 dynamic=(), state_sets: int = 1, executor: str | None = None,
                 planned: bool = True, shared_executables: int | None = None):
        if binding not in MODES:
            raise ValueError(f"binding: expected one of {MODES}, got {binding!r}")
        if shared_executables is not None:   # (checked where no pool is made, too: the walk)
            _check.positive("shared_executables", shared_executables)
        self.model, self.binding = model, binding
        self.executor = executor or default_executor()
        self.tape = Tape(model.name) if planned else None
        self.shared = (SharedExecutables(shared_executables)
                       if shared_executables is not None and self.executor == "cuda" else None)
        graph_sets = _check.positive("state_sets", state_sets) if binding == "alias" else 1
        self.dispatchers = [shapes.ShapeDispatcher(functools.partial(self._build, i),
                                                   strategy=strategy, max_length=max_length,
                                                   dynamic=dynamic, buckets=buckets)
                            for i in range(graph_sets)]
        self.keys = self.dispatchers[0].keys   # every shape a graph set can have, ascending
        self.helpers: list = []                # graphs beside the step's (add_helper)
        self.closed = False

    # ------------------------------------------------------------------ building
    def input_buffer(self, producer_buffer):
        """The buffer graphs record on for an input whose producer writes `producer_buffer`:
        that very buffer under alias binding (the producer writes the placeholder), else a
        buffer of the graphs' own, holding what the producer's holds now (a guard value such
        as position -1), that each replay copies or patches the input into."""
        if self.binding == "alias":
            return producer_buffer
        own = cuda.device_array_like(producer_buffer)
        own.copy_to_device(producer_buffer)
        return own

    def capture(self, step, placeholders):
        """`step` captured on `placeholders` with this wrapper's binding, executor, tape and
        shared executables (no warm-up: see the module doc)."""
        return capture(step, placeholders, binding=self.binding, executor=self.executor,
                       warmup=0, planned=self.tape is not None, tape=self.tape,
                       shared=self.shared)

    def _build(self, graph_set: int, key: int):
        return self.capture(self.model.recorded_step(key), self.model.placeholders(graph_set, key))

    def add_helper(self, graph):
        """Count a graph of the model's own (not a step: a reorder) in the accounting and
        close it with the rest."""
        self.helpers.append(graph)
        return graph

    def build_all(self, after_each=None) -> None:
        """Build every shape's graph on every graph set now, largest first;
        `after_each(shapes built)`, if given, after each shape's graphs."""
        self.require_open("build_all")
        for n, key in enumerate(reversed(self.keys), 1):
            for dispatcher in self.dispatchers:
                dispatcher.graph(key)
            if after_each is not None:
                after_each(n)

    # ------------------------------------------------------------------ replaying
    def _dispatcher(self, state_set: int):
        """State set `state_set`'s graphs: its own under alias binding, else the one set."""
        return self.dispatchers[state_set if self.binding == "alias" else 0]

    def graph(self, state_set: int, length: int):
        """The graph serving `length` on state set `state_set`, built now if need be."""
        self.require_open("graph")
        return self._dispatcher(state_set).graph(length)

    def built(self, state_set: int, length: int):
        """That graph if it is built, else None (nothing is built)."""
        dispatcher = self._dispatcher(state_set)
        if not 1 <= length <= self.keys[-1]:
            return None
        return dispatcher.graphs.get(shapes.key_for(length, dispatcher.keys))

    def replay(self, state_set: int, length: int, inputs: dict, live=None, following=None):
        """Replay the graph of (state_set, length) on `inputs` and return its outputs. With
        shared executables, `following` = (state set, length) of the next step, if the
        caller knows it, retargets one to that graph while the GPU runs this one (if that
        graph is built)."""
        outputs = self.graph(state_set, length).replay(live=live, **inputs)
        if self.shared is not None and following is not None:
            upcoming = self.built(*following)
            if upcoming is not None:
                upcoming.prepare()
        return outputs

    # ------------------------------------------------------------------ accounting
    def step_graphs(self) -> list:
        return [g for d in self.dispatchers for g in d.graphs.values()]

    def stats(self) -> ReplayStats:
        """Binding cost summed over every replay of every step graph so far."""
        total = ReplayStats()
        for g in self.step_graphs():
            total += g.stats
        return total

    @property
    def num_graphs(self) -> int:
        """Graphs of the model step (helper graphs are counted apart)."""
        return len(self.step_graphs())

    @property
    def num_nodes(self) -> int:
        return sum(len(g.description) for g in self.step_graphs())

    @property
    def memory_bytes(self) -> int | None:
        """Driver memory of every executable: the graphs' own, or the shared pool's. None
        where unmeasurable (the simulator)."""
        sizes = [g.memory_bytes for g in self.step_graphs() + self.helpers]
        if any(s is None for s in sizes):
            return None
        return sum(sizes) + (self.shared.memory_bytes if self.shared is not None else 0)

    @property
    def arena_bytes(self) -> int:
        """The memory tape's arena (0 without the planner)."""
        return self.tape.arena_bytes if self.tape is not None else 0

    @property
    def private_bytes(self) -> int:
        """Temporaries in private memory, summed over graphs (0 with the planner)."""
        return sum(g.private_bytes for g in self.step_graphs())

    def launch_all(self) -> int:
        """Replay every graph built so far once, each on its own placeholders, and wait: what
        a generation does to them anyway, so that whatever the driver allocates at a first
        launch (an upload, a shared executable's update) is allocated now. The placeholders'
        contents are whatever they hold (a position of -1 makes the decode kernels write
        nothing). Returns how many graphs ran."""
        self.require_open("launch_all")
        graphs = self.step_graphs() + self.helpers
        for g in graphs:
            g.replay(**g.placeholders)
        backend.synchronize()
        return len(graphs)

    @property
    def capture_seconds(self) -> dict[str, float]:
        """Host seconds of each capture phase (warmup, record, plan, build: `Graph.capture_s`)
        summed over every graph built so far. A shared pool's executables are instantiated at
        their first use, outside `build`."""
        total: dict[str, float] = {}
        for g in self.step_graphs() + self.helpers:
            for phase, s in g.capture_s.items():
                total[phase] = total.get(phase, 0.0) + s
        return total

    def require_open(self, what: str) -> None:
        if self.closed:   # its graphs and buffers are gone: a rebuild would hide the misuse
            raise RuntimeError(f"{what}: this {type(self.model).__name__} is closed")

    def close(self) -> None:
        """Destroy every graph, the shared executables and the arena."""
        for d in self.dispatchers:
            d.close()
        for g in self.helpers:
            g.close()
        self.helpers = []
        self.closed = True
        if self.shared is not None:
            self.shared.close()
        if self.tape is not None:
            self.tape.close()


class _GraphedModel:
    """What a model adapter shows of its `Graphed` (`self.graphed`): the accounting, the
    policies, and closing (the adapter's `close` frees its own state too)."""

    graphed: Graphed

    binding = property(lambda self: self.graphed.binding)
    executor = property(lambda self: self.graphed.executor)
    tape = property(lambda self: self.graphed.tape)
    shared = property(lambda self: self.graphed.shared)
    keys = property(lambda self: self.graphed.keys)
    strategy = property(lambda self: self.graphed.dispatchers[0].strategy)
    closed = property(lambda self: self.graphed.closed)
    num_graphs = property(lambda self: self.graphed.num_graphs)
    num_nodes = property(lambda self: self.graphed.num_nodes)
    memory_bytes = property(lambda self: self.graphed.memory_bytes)
    arena_bytes = property(lambda self: self.graphed.arena_bytes)
    private_bytes = property(lambda self: self.graphed.private_bytes)
    capture_seconds = property(lambda self: self.graphed.capture_seconds)

    def stats(self) -> ReplayStats:
        return self.graphed.stats()

    def launch_all(self) -> int:
        return self.graphed.launch_all()

    def build_all(self, after_each=None) -> None:
        self.graphed.build_all(after_each)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- decoders
class _CacheView(KVCache):
    """A KVCache over arrays someone else owns (no allocation): what a recorded step reads."""

    def __init__(self, config, batch: int, k: list, v: list):
        self.config, self.batch, self.max_len = config, batch, k[0].shape[2]
        self.dtype = np.dtype(k[0].dtype)
        self.k, self.v = list(k), list(v)


class _SearchCache(_CacheView):
    """One of the two caches the search alternates (`GraphedDecoder.caches`). Its arrays are the
    owner's current set `index` (a bucket change swaps them); `max_len` is the capacity the
    owner grows to. The reorder goes through the owner, which knows the binding's data flow."""

    def __init__(self, owner: "GraphedDecoder", index: int):
        self.config, self.batch, self.max_len = owner.model.config, owner.batch, owner.max_len
        self.dtype = owner.dtype
        self.k, self.v = [], []
        self.owner, self.index = owner, index

    def reorder_into(self, index, dst, stream=0, length=None) -> None:
        self.owner._reorder(self, index, dst, stream, length)


class GraphedDecoder(_GraphedModel):
    """A decoder's step (GPT2.step, GPTJ.step: `step(tokens, pos, cache)` over a KVCache of
    the model's dtype) for `batch` sequences (greedy rows or beams) of up to `max_len`
    positions, replayed as graphs; see the module doc for `binding` and `strategy`."""

    def __init__(self, model, *, batch: int, max_len: int, binding: str = "alias",
                 strategy: str = "device", executor: str | None = None, buckets=None,
                 build_all: bool = False, planned: bool = True,
                 shared_executables: int | None = None):
        self.model, self.config = model, model.config
        self.name = f"{type(model).__name__.lower()}-decode"   # (the memory tape's)
        self.dtype = generate.model_dtype(model)   # the caches'
        self.batch = _check.positive("batch", batch, at_most=model.max_batch)
        self.max_len = _check.positive("max_len", max_len, at_most=self.config.n_positions)
        # (the beam search gathers one cache set into the other: two sets, save under copy
        # binding, whose one graph set reads the model's static cache)
        self.graphed = Graphed(self, binding=binding, strategy=strategy, max_length=max_len,
                               buckets=buckets, state_sets=2, executor=executor,
                               planned=planned, shared_executables=shared_executables)
        # The search's input buffers, and the graphs' (the same ones under alias binding)
        self.inputs = generate.DecodeInputs(cuda.to_device(np.zeros((batch, 1), np.int32)),
                                            cuda.to_device(np.array([-1], np.int32)))
        self._tokens_ph = self.graphed.input_buffer(self.inputs.tokens)
        self._pos_ph = self.graphed.input_buffer(self.inputs.pos)  # -1: a replay before the
        # first copy writes nothing (the kernels' guard)
        self._cache_names = [f"{kv}{i}" for kv in "kv" for i in range(self.config.n_layer)]
        self._sets: dict[int, tuple[KVCache, KVCache]] = {}  # capacity -> (set 0, set 1)
        self._reorders: dict[tuple[int, int], object] = {}  # (capacity, src set) -> Graph
        self._positions = None     # exact: every position, each graph reading its own
        self.caches = (_SearchCache(self, 0), _SearchCache(self, 1))
        self.repad_bytes = 0
        self._position = 0         # host mirror of the next position (picks exact/bucket graphs)
        self._capacity = None      # capacity the search caches hold now
        self._pending = False      # copy: the reorder left the live cache in R, not S
        self.reset()
        if build_all:
            self.build_all()

    def build_all(self, after_each=None) -> None:
        """Build every graph a generation can use now, largest first: the step graphs of every
        length (or bucket) on every cache set, and the reorder graphs of every capacity.
        `after_each(lengths built)`, if given, is called after each length's graphs."""
        self.graphed.build_all(after_each)
        if self.binding != "copy":
            for capacity in sorted({self._capacity_for(k) for k in self.keys}, reverse=True):
                for src in (0, 1):
                    self._reorder_graph(capacity, src)

    # ------------------------------------------------------------------ caches
    def _capacity_for(self, length: int) -> int:
        return shapes.key_for(length, self.keys) if self.strategy == "bucket" \
            else self.max_len

    def _set(self, capacity: int) -> tuple[KVCache, KVCache]:
        if capacity not in self._sets:
            self._sets[capacity] = tuple(KVCache(self.config, self.batch, capacity, self.dtype)
                                         for _ in range(2))
        return self._sets[capacity]

    def _use_capacity(self, capacity: int) -> None:
        """Point the search caches at `capacity`'s sets; re-pad the live data (bucket only)."""
        if capacity == self._capacity:
            return
        new = self._set(capacity)
        if self._capacity is not None:
            if capacity < self._capacity:
                raise ValueError(f"cache capacity cannot shrink from {self._capacity} to "
                                 f"{capacity} within a generation; call reset()")
            for old_set, new_set in zip(self._sets[self._capacity], new):
                for src, dst in zip(old_set.arrays(), new_set.arrays()):
                    for b in range(self.batch):  # (B, H, old, hd) -> first rows of (B, H, new, hd)
                        for h in range(self.config.n_head):
                            copy(dst[b, h, :self._capacity], src[b, h])
                    self.repad_bytes += src.nbytes
        for cache, live in zip(self.caches, new):
            cache.k, cache.v = live.k, live.v
        self._capacity = capacity

    def _reorder(self, src: _SearchCache, index, dst: _SearchCache, stream=0, length=None) -> None:
        if not (isinstance(dst, _SearchCache) and dst.owner is self and dst is not src):
            raise ValueError("dst: expected the other cache of this GraphedDecoder's `caches`")
        sets = self._sets[self._capacity]
        if length is None:   # no live length given: move the whole capacity
            length = cuda.to_device(np.array([self._capacity], np.int32))
        if self.binding == "copy":  # the search reads the model's (static) cache, writes R
            KVCache.reorder_into(sets[0], index, sets[1], stream, length=length)
            self._pending = True
            return
        # A/B: the gathers run as a graph of their own per direction (2L eager launches cost
        # ~0.6 ms of host time a step); its `index` input is patched to the search's parents
        # buffer, once per buffer address.
        self._reorder_graph(self._capacity, src.index).replay(index=index, length=length)

    def _reorder_graph(self, capacity: int, src: int):
        """The gathers of the live prefix from cache set `src` into the other set at
        `capacity`, as one graph whose `index` and `length` inputs are patched to the
        search's parents and position buffers."""
        key = (capacity, src)
        if key not in self._reorders:
            source, target = self._set(capacity)[src], self._set(capacity)[1 - src]
            self._reorders[key] = self.graphed.add_helper(capture(
                lambda index, length: KVCache.reorder_into(source, index, target, length=length),
                {"index": cuda.device_array(self.batch, np.int32),
                 "length": cuda.device_array(1, np.int32)}, binding="patch",
                executor=self.executor, warmup=0))  # gathers have no first-call path
        return self._reorders[key]

    def reset(self, prompt_len: int = 1) -> None:
        """Start a generation from a prompt of `prompt_len` tokens: position 0, the smallest
        capacity; the next step call is the prefill of prompt_len - 1 tokens (if any)."""
        self.graphed.require_open("reset")
        self._position, self._pending, self._capacity = 0, False, None
        self._prefill = _check.positive("prompt_len", prompt_len, at_most=self.max_len) - 1
        self._use_capacity(self._capacity_for(1))

    # ------------------------------------------------------------------ graphs
    def _inputs(self, tokens, pos, cache) -> dict:
        """A graph's inputs by name: tokens, k0.., v0.. (cache.arrays() order), pos unless
        the strategy bakes it."""
        inputs = {"tokens": tokens, **dict(zip(self._cache_names, cache.arrays()))}
        if self.strategy != "exact":
            inputs["pos"] = pos
        return inputs

    def placeholders(self, state_set: int, key: int) -> dict:
        """(The protocol.) The graph of length `key` records on cache set `state_set` at the
        capacity serving `key`, and the graphs' token and position buffers."""
        cache = self._set(self._capacity_for(key))[state_set]
        return self._inputs(self._tokens_ph, self._pos_ph, cache)

    def recorded_step(self, key: int):
        """(The protocol.) The model's step over the named caches, at position key-1: read from the
        `pos` input, or under the exact strategy from a constant only this graph reads
        (element key-1 of one array of every position: an allocation per graph costs the
        driver far more than its 4 bytes)."""
        baked = None
        if self.strategy == "exact":
            if self._positions is None:
                self._positions = cuda.to_device(np.arange(self.max_len, dtype=np.int32))
            baked = backend.rows(self._positions, key - 1, key)
        L, B = self.config.n_layer, self.batch

        def step(tokens, pos=None, **kv):
            view = _CacheView(self.config, B, [kv[f"k{i}"] for i in range(L)],
                              [kv[f"v{i}"] for i in range(L)])
            return self.model.step(tokens, baked if pos is None else pos, view)
        return step

    def step(self, tokens, pos, cache):
        """The model step's contract on `cache`, one of `self.caches`. The first call after
        reset(prompt_len > 1) is the prefill (eager); every other call is one decode step
        (T = 1) and replays the graph of its length."""
        self.graphed.require_open("step")
        _check.device_array("tokens", tokens, dtype=np.int32, shape=(self.batch, None))
        _check.device_array("pos", pos, dtype=np.int32, shape=(1,))
        if not (isinstance(cache, _SearchCache) and cache.owner is self):
            raise ValueError("cache: expected one of this GraphedDecoder's `caches` "
                             f"(their arrays are the graphs' placeholders), got {type(cache).__name__}")
        T = tokens.shape[1]
        length = self._position + T
        if length > self.max_len:
            raise ValueError(f"tokens: position {self._position} + {T} new tokens exceeds "
                             f"max_len={self.max_len}")
        if self._prefill:
            if T != self._prefill:
                raise ValueError(f"tokens: expected the prefill's {self._prefill} tokens "
                                 f"(reset(prompt_len={self._prefill + 1})), got {T}")
            self._use_capacity(self._capacity_for(length))
            logits = self.model.step(tokens, pos, cache)
            self._position, self._prefill = length, 0
            return logits
        if T != 1:
            raise ValueError(f"tokens: a decode step takes 1 token per sequence, got {T} "
                             "(a prompt goes through reset(prompt_len) and the first call)")
        self._use_capacity(self._capacity_for(length))
        prefix = None   # only copy binding moves bytes, so only it needs the live prefix
        if self.binding == "copy":
            live = self._sets[self._capacity][1 if self._pending else 0]
            self._pending = False
            # A step reads positions [:position] of the cache (it writes position `position`
            # itself), so copy binding moves that prefix, as a framework user would slice it.
            prefix = {name: (2, self._position) for name in self._cache_names}
        else:
            live = cache
        # (the next step reads the other cache set at the next length: the search
        # alternates the sets)
        logits = self.graphed.replay(cache.index, length, self._inputs(tokens, pos, live),
                                     live=prefix, following=(1 - cache.index, length + 1))
        self._position = length
        return logits

    # ------------------------------------------------------------------ searches
    def greedy(self, prompt, *, max_new_tokens: int, eos: int | None = None, timed=False):
        """generate.greedy over graphed steps; `prompt` (batch, T0)."""
        self.reset(np.shape(prompt)[-1])
        return generate.greedy(self.model, prompt, max_new_tokens=max_new_tokens, eos=eos,
                               step=self.step, cache=self.caches[0], inputs=self.inputs,
                               timed=timed)

    def beam_search(self, prompt, *, max_new_tokens: int, eos: int | None = None, timed=False):
        """generate.beam_search with beam = batch over graphed steps; `prompt` (T0,)."""
        self.reset(np.shape(prompt)[-1])
        return generate.beam_search(self.model, prompt, beam=self.batch,
                                    max_new_tokens=max_new_tokens, eos=eos, step=self.step,
                                    caches=self.caches, inputs=self.inputs, timed=timed)

    def replayer(self, position: int):
        """A zero-argument replay of the decode graph at `position` on the search's first
        cache, for timing a step alone (built and recorded first if need be). Repeating it
        rewrites the same cache slot, so it is idempotent. The position is written into
        `inputs.pos`, which every replayer, step and search of this model shares (under
        alias binding the graphs read it in place): a replayer replays `position` only until
        the next of them writes it, so take it right before use."""
        self.reset()
        self._use_capacity(self._capacity_for(position + 1))
        self.inputs.pos.copy_to_device(np.array([position], np.int32))
        inputs = self._inputs(self.inputs.tokens, self.inputs.pos, self.caches[0])
        g = self.graphed.graph(0, position + 1)
        return lambda: g.replay(**inputs)

    # ------------------------------------------------------------------ accounting
    @property
    def num_reorder_graphs(self) -> int:
        return len(self._reorders)

    @property
    def cache_bytes(self) -> int:
        """Device bytes of the KV cache sets (two a capacity: a reorder gathers into the
        other set)."""
        return sum(c.data.nbytes for pair in self._sets.values() for c in pair)

    def close(self) -> None:
        """Destroy every graph (the reorders with them) and free the cache sets."""
        self.graphed.close()
        self._sets, self._reorders, self._positions = {}, {}, None
        for cache in self.caches:
            cache.k, cache.v = [], []


# --------------------------------------------------------------------------- LSTM
class _StateView(LSTMState):
    """An LSTMState over rows of arrays someone else owns (no allocation)."""

    def __init__(self, config, h: list, c: list):
        self.config, self.batch, self.h, self.c = config, h[0].shape[0], list(h), list(c)


class GraphedLSTM(_GraphedModel):
    """LSTMLM.step over a batch of `batch <= max_batch` rows, as graphs.

    The recurrent state is the stepper's own (`state`, capacity max_batch, rows [:batch] are
    the sequences): it is updated in place by every step, so it never needs binding; the
    binding mode applies to the token ids, which a producer (argmax) writes into `tokens`
    (alias: the placeholder itself; copy: copied in; patch: pointers rewritten once).
    The batch is the dynamic dimension: `exact` one graph per batch size, `bucket` power-of-two
    batches whose extra rows are padding (token 0, state rows nobody reads), `device` one graph
    over all max_batch rows (the LSTM kernels read no length on the device, so this is the
    single largest bucket).
    """

    name = "lstm-step"   # (the memory tape's)

    def __init__(self, model, *, max_batch: int, binding: str = "alias",
                 strategy: str = "device", executor: str | None = None, buckets=None,
                 planned: bool = True, shared_executables: int | None = None):
        self.model, self.config = model, model.config
        self.max_batch = _check.positive("max_batch", max_batch, at_most=model.max_batch)
        self._names = [f"h{k}" for k in range(self.config.n_layer)] + \
                      [f"c{k}" for k in range(self.config.n_layer)]
        self.graphed = Graphed(self, binding=binding, strategy=strategy, max_length=max_batch,
                               buckets=buckets, dynamic=("tokens", *self._names),
                               executor=executor, planned=planned,
                               shared_executables=shared_executables)
        self.state = LSTMState(self.config, max_batch)
        self.tokens = cuda.to_device(np.zeros(max_batch, np.int32))  # where producers write
        self._tokens_ph = self.graphed.input_buffer(self.tokens)

    def _rows(self, tokens, key: int) -> dict:
        """The first `key` rows of the tokens and of every state array, by name (views made
        once: see `leading`)."""
        return {"tokens": leading(tokens, key),
                **{n: leading(a, key) for n, a in zip(self._names, self.state.arrays())}}

    def placeholders(self, state_set: int, key: int) -> dict:
        """(The protocol.) The graph of batch size `key` records on the first `key` rows."""
        return self._rows(self._tokens_ph, key)

    def recorded_step(self, key: int):
        """(The protocol.) LSTMLM.step over the named state rows. (No warm-up here either:
        the step updates the state in place, so an extra eager run would advance every
        sequence one token too far.)"""
        L = self.config.n_layer

        def step(tokens, **hc):
            state = _StateView(self.config, [hc[f"h{k}"] for k in range(L)],
                               [hc[f"c{k}"] for k in range(L)])
            return self.model.step(tokens, state)
        return step

    def step(self, tokens, batch: int):
        """Logits (batch, V) of the next token for rows [:batch]; `tokens` device int32
        (max_batch,), rows past `batch` padding (valid ids). Updates `state` rows in place."""
        self.graphed.require_open("step")
        _check.device_array("tokens", tokens, dtype=np.int32, shape=(self.max_batch,))
        _check.positive("batch", batch, at_most=self.max_batch)
        inputs = self._rows(tokens, shapes.key_for(batch, self.keys))
        return leading(self.graphed.replay(0, batch, inputs), batch)

    def close(self) -> None:
        self.graphed.close()


def lstm_greedy(step, tokens, prompt, max_new_tokens: int, *, vocab: int) -> np.ndarray:
    """Greedy decoding of `prompt` (B, T0) with an LSTM step: `step(tokens) -> logits (B, V)`
    reads the token buffer `tokens` (device int32, at least B rows) and advances its state.
    The argmax writes each next token straight into `tokens`. Returns (B, T0 + n) ids."""
    prompt = generate._check_prompt(prompt, _check.positive("vocab", vocab), ndim=2)
    _check.device_array("tokens", tokens, dtype=np.int32, ndim=1)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected a non-negative integer, got {max_new_tokens!r}")
    B, T0 = prompt.shape
    if B > tokens.shape[0]:
        raise ValueError(f"tokens: {tokens.shape[0]} rows, fewer than the prompt's {B}")
    padded = np.zeros(tokens.shape[0], np.int32)
    for t in range(T0 - 1):
        padded[:B] = prompt[:, t]
        tokens.copy_to_device(padded)
        step(tokens)
    padded[:B] = prompt[:, -1]
    tokens.copy_to_device(padded)
    out = [prompt]
    top = cuda.device_array((max(max_new_tokens, 1), B, 1), np.float32)   # each step's best logit
    rows = leading(tokens, B)
    for t in range(max_new_tokens):
        logits = step(tokens)  # (B, V)
        sampling.topk(logits, 1, top[t], reshaped(rows, (B, 1)))        # the argmax
        out.append(rows.copy_to_host()[:, None])
    if max_new_tokens and not np.isfinite(top.copy_to_host()[:max_new_tokens]).all():
        raise FloatingPointError("lstm_greedy: some step's logits had no finite value (NaN or "
                                 "infinite weights or state); the tokens would be garbage")
    return np.concatenate(out, axis=1)
