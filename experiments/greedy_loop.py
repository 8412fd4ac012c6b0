"""Greedy generation with the loop inside the graph: ms per token, three ways to run the loop.

GPT-2 with random weights, float32, batch 5, prompt 5, greedy decoding without EOS (so every
method generates the same N tokens; the tests check stopping at EOS), for several N:

  numba_eager      every kernel launched from Python; the host reads the tokens each step
  graph_per_step   Grape's decode graph (alias binding, position on the device: one graph for
                   every length) replayed once per token by the host loop, which copies the
                   tokens back every step to test for EOS (GraphedGPT2.greedy)
  graph_while      the whole loop as one graph: a WHILE node on a device flag, the step, the
                   argmax and the EOS/length test all on the GPU (proto.models.greedy_loop)

Each generation is timed whole, prefill (eager in all three) included, and divided by N.
Every method's tokens are compared with the eager run's. Toy size: a tiny model on the
simulator (timings there mean nothing).

    python -m experiments greedy_loop
"""
from __future__ import annotations

import time

import numpy as np

from experiments import common
from proto import timing
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedGPT2
from proto.models.greedy_loop import GreedyLoop

NAME = "greedy_loop"
METHODS = ["numba_eager", "graph_per_step", "graph_while"]
SIZES = {
    "toy": dict(config=GPT2Config(1, 8, 2, 13, 8), batch=2, prompt_len=2, new=[1, 2], reps=1),
    "full": dict(config=GPT2Config(4, 256, 4, 50257, 1024), batch=5, prompt_len=5,
                 new=[16, 128, 1000], reps=3),
}
COLORS = {"numba_eager": "C3", "graph_per_step": "C0", "graph_while": "C2"}


def run(size: str = "toy") -> None:
    cfg = SIZES[size]
    config, B, T0 = cfg["config"], cfg["batch"], cfg["prompt_len"]
    max_len = T0 + max(cfg["new"]) - 1
    model = GPT2(config, random_state_dict(config, seed=0), max_batch=B, max_tokens=T0)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, (B, T0)).astype(np.int32)
    per_step = GraphedGPT2(model, batch=B, max_len=max_len, binding="alias", strategy="device",
                           build_all=True)
    t0 = time.perf_counter()
    loop = GreedyLoop(model, batch=B, max_len=max_len)
    capture_s = time.perf_counter() - t0
    runs = {"numba_eager": lambda n: generate.greedy(model, prompt, max_new_tokens=n),
            "graph_per_step": lambda n: per_step.greedy(prompt, max_new_tokens=n),
            "graph_while": lambda n: loop.generate(prompt, max_new_tokens=n)}
    rows = []
    bar = common.progress(range(len(cfg["new"]) * len(METHODS)), desc=NAME)
    try:
        for n in cfg["new"]:
            want = None
            for method in METHODS:
                tokens = runs[method](n).tokens            # warm-up, and the tokens to compare
                want = tokens if want is None else want
                t = timing.bench_host(lambda: runs[method](n), warmup=0, reps=cfg["reps"])
                rows.append({"method": method, "new_tokens": n, "batch": B, "prompt_len": T0,
                             "n_layer": config.n_layer, "n_embd": config.n_embd,
                             "ms_per_token": t.median_ms / n, "generation_ms": t.median_ms,
                             "p10_ms": t.p10_ms, "p90_ms": t.p90_ms, "reps": t.reps,
                             "tokens_equal_eager": bool(np.array_equal(tokens, want)),
                             "while_capture_s": round(capture_s, 3)})
                bar.update(1)
    finally:
        bar.close()
        per_step.close()
        loop.close()
    common.write_csv(NAME, rows)
    common.write_summary(NAME, summarize(rows))


def summarize(rows: list[dict]) -> dict:
    n = max(int(r["new_tokens"]) for r in rows)
    ms = {r["method"]: float(r["ms_per_token"]) for r in rows if int(r["new_tokens"]) == n}
    return {"new_tokens": n,
            "per_step_over_while_per_token": ms["graph_per_step"] / ms["graph_while"],
            "eager_over_while_per_token": ms["numba_eager"] / ms["graph_while"],
            **{f"{m}_ms_per_token": v for m, v in ms.items()},
            "all_tokens_equal": all(str(r["tokens_equal_eager"]) == "True" for r in rows)}


def plot():
    rows = common.read_csv(NAME)
    fig, axes = common.new_figure(rows, 1, 1, figsize=(6, 4.2), squeeze=False)
    ax = axes[0][0]
    for method in METHODS:
        pts = sorted((int(r["new_tokens"]), float(r["ms_per_token"])) for r in rows
                     if r["method"] == method)
        ax.plot(*zip(*pts), marker="o", color=COLORS[method], label=method.replace("_", " "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens generated per sequence (one generation)")
    ax.set_ylabel("ms per generated token (prefill included)")
    r = rows[0]
    ax.set_title(f"Greedy GPT-2 {r['n_layer']}L d{r['n_embd']}, batch {r['batch']}: "
                 "the loop in the graph", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return common.save_figure(fig, NAME)
