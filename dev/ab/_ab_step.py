"""The harness of the step A/Bs (dev.ab.ab_attention_cp, dev.ab.ab_mlp_step), on the H200 in
one process: one GPT-2 small model (12 layers, beam 5), a graphed step per variant (alias
binding, the length read on the device) recorded while the variant's switch is on, a beam
search under each, whose tokens must equal the first's, each one's planned arena (the memory
the step's temporaries take), then the step timed at positions 100, 512 and 1000 in
interleaved rounds (the first variant is the base of the ratios), and a whole generation to
the last position in one WHILE graph (`BeamLoop`, as end_to_end's graph_while), per token,
in interleaved rounds, its tokens compared too: a generation passes every position, so it
weighs a change by how the positions of a real search use it. AB_TOY=1: toy sizes, to check
a script end to end on the simulator.

Every replayer of a model reads the one position input that its searches write (alias
binding: the graphs read it in place), so a replayer is taken right before its timing, and
the position in that input is read back after it: until 2026-12-04 the replayers were taken
before the beam search, and every A/B timed the search's last position (203) under the
labels 100, 512 and 1000 (the profiles in results/h200/profiles/ before ab_mlp_ln_step's at
that date).
"""
import contextlib
import os
import time
from typing import Callable, ContextManager

import numpy as np

from proto.device import backend, timing
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedDecoder
from proto.models.search_loop import BeamLoop

TOY = os.environ.get("AB_TOY") == "1"
cfg = GPT2Config(2, 32, 2, 50, 32) if TOY else GPT2Config(12, 768, 12, 50257, 1024)
MAX, POSITIONS, ROUNDS, NEW = (16, (6, 11), 1, 2) if TOY else (1024, (100, 512, 1000), 7, 200)
REPLAYS, REPS = (1, dict(warmup=0, reps=1)) if TOY else (10, dict(warmup=3, reps=20))
prompt = np.array([4, 20, 7, 21, 18] if TOY else [464, 2068, 7586, 21831, 18045], np.int32)
# the WHILE generation: to the last position, as end_to_end's (the toy's 3: the simulator)
WHILE_NEW = 3 if TOY else MAX - len(prompt) + 1


@contextlib.contextmanager
def patched(module, **values):
    """The module's globals set to `values` while a variant's graphs record, then restored:
    the library reads them at recording, so a switch needs nothing else."""
    was = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in was.items():
            setattr(module, k, v)


def describe(name: str, kernel) -> None:
    """Print a compiled kernel's registers, local and shared memory (a variant's occupancy)."""
    def one(by_signature):   # (a kernel of one eager signature: its value, not a dict)
        values = list(by_signature.values()) if isinstance(by_signature, dict) else [by_signature]
        return values[0] if len(values) == 1 else by_signature
    print(f"{name} kernel: {one(kernel.get_regs_per_thread())} registers, "
          f"{one(kernel.get_local_mem_per_thread())} bytes local, "
          f"{one(kernel.get_shared_mem_per_block())} bytes shared a block", flush=True)


def run(variants: dict[str, Callable[[], ContextManager]], dtype=np.float32) -> int:
    """variants: name -> a context manager that switches the library's code to the variant
    (it is read while the graphs record their launches); the model in `dtype`. Returns 0
    when every variant's tokens equal the first's, else 1 (in float16 a variant that sums in
    another order rounds some logits differently, which may change a near tie: read it as
    a report there, not a failure)."""
    names = list(variants)
    model = GPT2(cfg, random_state_dict(cfg, seed=0), max_batch=5, max_tokens=4, dtype=dtype)
    graphs, loops, tokens, while_tokens = {}, {}, {}, {}
    for name, switch in variants.items():
        with switch():
            t0 = time.perf_counter()
            g = GraphedDecoder(model, batch=5, max_len=MAX, binding="alias", strategy="device")
            for p in POSITIONS:   # records (under the switch) and lowers every graph timed
                g.replayer(p)()
            backend.synchronize()
            tokens[name] = np.asarray(g.beam_search(prompt, max_new_tokens=NEW).tokens)
            loop = BeamLoop(model, beam=5, max_len=MAX)   # records its graph under the switch
            while_tokens[name] = np.asarray(
                loop.generate(prompt, max_new_tokens=WHILE_NEW).tokens)
        graphs[name], loops[name] = g, loop
        print(f"built {name} in {time.perf_counter() - t0:.1f} s; planned arena "
              f"{g.arena_bytes / 2**20:.3f} MiB", flush=True)

    step_us = {(n, p): [] for n in names for p in POSITIONS}
    for _ in range(ROUNDS):
        for p in POSITIONS:
            for n in names:
                r = graphs[n].replayer(p)   # writes p into the position input: see above
                t = timing.bench(lambda: [r() for _ in range(REPLAYS)], **REPS)
                step_us[(n, p)].append(t.median_us / REPLAYS)
                timed = int(graphs[n].inputs.pos.copy_to_host()[0])
                if timed != p:
                    raise RuntimeError(f"{n}: timed at position {timed}, not {p}")
    while_ms = {n: [] for n in names}
    for _ in range(ROUNDS):
        for n in names:
            t0 = time.perf_counter()
            loops[n].generate(prompt, max_new_tokens=WHILE_NEW)
            backend.synchronize()
            while_ms[n].append((time.perf_counter() - t0) * 1e3 / WHILE_NEW)
    width = max(len(n) for n in names)
    for p in POSITIONS:
        _report(f"STEP pos {p:4d}", {n: step_us[(n, p)] for n in names}, width, "8.1f", ".1f",
                "us")
    _report(f"WHILE {WHILE_NEW} tokens", while_ms, width, ".4f", ".4f", "ms a token")
    equal = _same(f"beam search, {NEW} tokens", tokens)
    while_equal = _same(f"WHILE graph, {WHILE_NEW} tokens", while_tokens)
    for g in graphs.values():
        g.close()
    for loop in loops.values():
        loop.close()
    return 0 if equal and while_equal else 1


def _report(head: str, samples: dict, width: int, fmt: str, spread: str, unit: str) -> None:
    """A line a variant: the median of its samples, their min, max and count, and its ratio
    to the first variant's median."""
    first, base = next(iter(samples)), np.median(next(iter(samples.values())))
    for n, values in samples.items():
        v = np.array(values)
        print(f"{head} {n:{width}s} {np.median(v):{fmt}} {unit} (min {v.min():{spread}}, "
              f"max {v.max():{spread}}, n={len(v)}) / {first} {np.median(v) / base:.4f}",
              flush=True)


def _same(what: str, tokens: dict) -> bool:
    """Whether every variant's tokens equal the first's; printed."""
    first = next(iter(tokens.values()))
    equal = all(np.array_equal(first, t) for t in tokens.values())
    print(f"{what}: tokens equal: {equal}", flush=True)
    return equal
