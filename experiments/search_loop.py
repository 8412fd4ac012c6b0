"""The search loop inside the graph: ms per token of greedy and beam-search generation, three
ways to run the loop.

GPT-2 with random weights, float32, prompt 5, greedy (batch 5) and beam search (beam 5),
without EOS (so every method generates the same N tokens; the tests check stopping at EOS),
for several N:

  numba_eager      every kernel launched from Python; the host decides each step
  graph_per_step   Grape's decode graph (alias binding, position on the device: one graph
                   for every length) replayed once per token; after each replay the host
                   copies the tokens (greedy) or the top-k candidates (beam) back and decides
                   (GraphedGPT2.greedy / .beam_search)
  graph_while      the whole search as one graph: a WHILE node on a device flag, the step and
                   every decision (argmax or top-k, beam choice, KV-cache reorder, stop test)
                   on the GPU (proto.models.search_loop)

Each generation is timed whole, prefill (eager in all three) included, and divided by N.
Every method's tokens (and beam score) are compared with the eager run's. Toy size: a tiny
model on the simulator (timings there mean nothing).

    python -m experiments search_loop
"""
from __future__ import annotations

import numpy as np

from experiments import common
from proto import timing
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedGPT2
from proto.models.search_loop import BeamLoop, GreedyLoop

NAME = "search_loop"
SEARCHES = ["greedy", "beam"]
METHODS = ["numba_eager", "graph_per_step", "graph_while"]
SIZES = {
    "toy": dict(config=GPT2Config(1, 8, 2, 13, 8), batch=2, prompt_len=2, new=[2], reps=1),
    "full": dict(config=GPT2Config(4, 256, 4, 50257, 1024), batch=5, prompt_len=5,
                 new=[16, 128, 1000], reps=3),
}
COLORS = {"numba_eager": "C3", "graph_per_step": "C0", "graph_while": "C2"}


def _runs(search: str, model, prompt, B: int, max_len: int):
    """{method: n -> Generation}, and what to close afterwards."""
    per_step = GraphedGPT2(model, batch=B, max_len=max_len, binding="alias", strategy="device",
                           build_all=True)
    if search == "greedy":
        loop = GreedyLoop(model, batch=B, max_len=max_len)
        return {"numba_eager": lambda n: generate.greedy(model, prompt, max_new_tokens=n),
                "graph_per_step": lambda n: per_step.greedy(prompt, max_new_tokens=n),
                "graph_while": lambda n: loop.generate(prompt, max_new_tokens=n)}, (per_step, loop)
    row = prompt[0]
    loop = BeamLoop(model, beam=B, max_len=max_len)
    return {"numba_eager": lambda n: generate.beam_search(model, row, beam=B, max_new_tokens=n),
            "graph_per_step": lambda n: per_step.beam_search(row, max_new_tokens=n),
            "graph_while": lambda n: loop.generate(row, max_new_tokens=n)}, (per_step, loop)


def run(size: str = "toy") -> None:
    cfg = SIZES[size]
    config, B, T0 = cfg["config"], cfg["batch"], cfg["prompt_len"]
    max_len = T0 + max(cfg["new"]) - 1
    model = GPT2(config, random_state_dict(config, seed=0), max_batch=B, max_tokens=T0)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, (B, T0)).astype(np.int32)
    rows = []
    bar = common.progress(range(len(SEARCHES) * len(cfg["new"]) * len(METHODS)), desc=NAME)
    for search in SEARCHES:
        runs, owned = _runs(search, model, prompt, B, max_len)
        try:
            for n in cfg["new"]:
                want = None
                for method in METHODS:
                    got = runs[method](n)                 # warm-up, and the result to compare
                    want = want or got
                    t = timing.bench_host(lambda: runs[method](n), warmup=0, reps=cfg["reps"])
                    rows.append({"search": search, "method": method, "new_tokens": n,
                                 "batch": B, "prompt_len": T0, "n_layer": config.n_layer,
                                 "n_embd": config.n_embd, "ms_per_token": t.median_ms / n,
                                 "generation_ms": t.median_ms, "p10_ms": t.p10_ms,
                                 "p90_ms": t.p90_ms, "reps": t.reps,
                                 "result_equal_eager": bool(np.array_equal(got.tokens, want.tokens)
                                                            and got.score == want.score)})
                    bar.update(1)
        finally:
            for thing in owned:
                thing.close()
    bar.close()
    common.write_csv(NAME, rows)
    common.write_summary(NAME, summarize(rows))


def summarize(rows: list[dict]) -> dict:
    n = max(int(r["new_tokens"]) for r in rows)
    out = {"new_tokens": n}
    for search in SEARCHES:
        ms = {r["method"]: float(r["ms_per_token"]) for r in rows
              if r["search"] == search and int(r["new_tokens"]) == n}
        out[f"{search}_per_step_over_while_per_token"] = ms["graph_per_step"] / ms["graph_while"]
        out[f"{search}_eager_over_while_per_token"] = ms["numba_eager"] / ms["graph_while"]
        out.update({f"{search}_{m}_ms_per_token": v for m, v in ms.items()})
    out["all_results_equal"] = all(str(r["result_equal_eager"]) == "True" for r in rows)
    return out


def plot():
    rows = common.read_csv(NAME)
    fig, axes = common.new_figure(rows, 1, len(SEARCHES), figsize=(5.5 * len(SEARCHES), 4.2),
                                  squeeze=False)
    for ax, search in zip(axes[0], SEARCHES):
        mine = [r for r in rows if r["search"] == search]
        for method in METHODS:
            pts = sorted((int(r["new_tokens"]), float(r["ms_per_token"])) for r in mine
                         if r["method"] == method)
            ax.plot(*zip(*pts), marker="o", color=COLORS[method], label=method.replace("_", " "))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens generated (one generation)")
        ax.set_ylabel("ms per generated token (prefill included)")
        r = mine[0]
        ax.set_title(f"GPT-2 {r['n_layer']}L d{r['n_embd']}, {search} "
                     f"({'beam' if search == 'beam' else 'batch'} {r['batch']})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return common.save_figure(fig, NAME)
