"""Which step of building GPT-2's per-length graphs takes device memory that no allocation of
ours explains (dev/notes/graph_memory.md: about 300 KiB a graph, growing with the number of
graphs; recording the step itself, or any of its launchers alone, takes none).

One fresh process, GPT-2 small at beam 5, every reading a drop in free memory after Numba's
queued frees are flushed. Each case builds N graphs' descriptions (kept: nothing is freed
in between; executables are not made) and plans them into one tape:

    PYTHONPATH=. python3 -m dev.probe.graph_memory_bisect [N]      (GPU only; about a minute)

Cases, each adding one thing GraphedDecoder does to the one before: the step recorded with one
position array; with a view of one array of every position per graph (what the exact
strategy bakes); through `capture` (alias binding, the model's tape) with one position, and
with a view per graph; GraphedDecoder itself (exact strategy, its two KV sets made first).
"""
from __future__ import annotations

import importlib
import json
import sys

import numpy as np

from proto.device import backend
from proto.device.backend import cuda
from proto.graph import plan as planner
from proto.graph.record import record

capture_module = importlib.import_module("proto.graph.capture")   # (the package exports
# a function of the same name)


def reading(label: str, start: int | None = None, **extra) -> int:
    free, live = backend.settled_free_memory()
    print(json.dumps({"stage": label, "free_mib": free / 2**20, "numba_live_mib": live / 2**20,
                      "drop_mib": None if start is None else (start - free) / 2**20, **extra}),
          flush=True)
    return free


class Kept:
    """What capture would build a Graph from, kept as it is: no definition, no executable."""

    def __init__(self, description, outputs, placeholders, **kw):
        self.description, self.outputs, self.placeholders = description, outputs, placeholders
        self.capture_s, self.memory_bytes = {}, 0

    def close(self) -> None:
        pass


def main(n: int) -> int:
    from proto.models.gpt2 import GPT2, GPT2Config, KVCache, random_state_dict
    from proto.models.graphed import GraphedDecoder
    config = GPT2Config(12, 768, 12, 50257, 1024)
    model = GPT2(config, random_state_dict(config, 0), max_batch=5, max_tokens=5)
    cache = KVCache(config, 5, 1024)
    tokens = cuda.to_device(np.zeros((5, 1), np.int32))
    pos = cuda.to_device(np.array([7], np.int32))
    positions = cuda.to_device(np.arange(1024, dtype=np.int32))
    model.step(tokens, pos, cache)          # the warm-up: kernels loaded, eager scratch made
    capture_module.Graph = Kept
    names = [f"{kv}{i}" for kv in "kv" for i in range(config.n_layer)]
    placeholders = {"tokens": tokens, **dict(zip(names, cache.arrays()))}

    def step_on(p):
        def step(tokens, **kv):
            view = KVCache.__new__(KVCache)
            view.config, view.batch, view.max_len = config, 5, 1024
            view.k = [kv[f"k{i}"] for i in range(config.n_layer)]
            view.v = [kv[f"v{i}"] for i in range(config.n_layer)]
            return model.step(tokens, p, view)
        return step

    def recorded(tape, p):
        with record(private=False) as rec:
            out = model.step(tokens, p, cache)
        d = rec.description()
        return planner.apply(d, tape.plan_graph(d, planner.leaves(out)), tape.arena, out)

    def captured(tape, p):
        return capture_module.capture(step_on(p), placeholders, binding="alias", warmup=0,
                                      planned=True, tape=tape)

    cases = {
        "record, one pos": lambda tape, i: recorded(tape, pos),
        "record, a pos view per graph": lambda tape, i: recorded(
            tape, backend.rows(positions, i, i + 1)),
        "capture, one pos": lambda tape, i: captured(tape, pos),
        "capture, a pos view per graph": lambda tape, i: captured(
            tape, backend.rows(positions, i, i + 1)),
    }
    for name, build in cases.items():
        start = reading(f"{name}: before")
        tape, kept = planner.Tape(name), []
        for i in range(1, n + 1):
            kept.append(build(tape, 1024 - i))
            if i in (1, n // 4, n // 2) and i < n:   # a fixed cost or one per graph: the slope
                reading(f"{name}: {i} graphs", start)
        reading(f"{name}: {n} graphs", start, arena_mib=tape.arena_bytes / 2**20)
    graphed(model, n)
    return 0


def graphed(model, n):
    from proto.models.graphed import GraphedDecoder
    g = GraphedDecoder(model, batch=5, max_len=1024, binding="alias", strategy="exact")
    start = reading("GraphedDecoder exact: before (two KV sets made)")
    keys = list(reversed(g.keys))[:max(1, n // 2)]
    for i, key in enumerate(keys, 1):
        for dispatcher in g.graphed.dispatchers:
            dispatcher.graph(key)
        if i in (1, len(keys) // 4, len(keys) // 2) and i < len(keys):
            reading(f"GraphedDecoder exact: {2 * i} graphs", start)
    reading(f"GraphedDecoder exact: {2 * len(keys)} graphs", start, arena_mib=g.arena_bytes / 2**20)
    return g


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("GPU only: free device memory is what it reads")
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 128))
