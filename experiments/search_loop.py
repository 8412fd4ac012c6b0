"""The search loop inside the graph: ms per token of greedy and beam-search generation, the
ways to run the loop side by side.

GPT-2 with random weights, float32, prompt 5, greedy (batch 5) and beam search (beam 5),
without EOS (so every method generates the same N tokens; the tests check stopping at EOS),
for several N, at two sizes (4 layers d=256 and GPT-2 small, 12 layers d=768):

  numba_eager        every kernel launched from Python; the host decides each step (run for
                     N <= 128 only: it is the slow reference, not a contender)
  graph_per_step     the host loop: Grape's decode graph (alias binding, position on the
                     device: one graph for every length) replayed once per token; after each
                     replay the host copies the tokens (greedy) or the top-k candidates (beam)
                     back and decides (GraphedDecoder.greedy / .beam_search)
  graph_while        the whole search as one graph: a WHILE node on a device flag, the step and
                     every decision (argmax or top-k, beam choice, KV-cache reorder, stop test)
                     on the GPU (proto.models.search_loop)
  predicated_K       the same search by predication (Grape's way, any driver): the body
                     unrolled K times in a plain graph, every kernel testing the loop's flag,
                     the host relaunching it every K passes until the flag falls (a beam
                     search pass makes two steps, alternating its two KV-cache sets)

Each generation is timed whole, prefill (eager in all) included, and divided by N: the median
of `reps` after a warm-up one, spread (p10, p90) in the CSV. Every method's tokens (and beam
score, to float32 rounding: `score_rel_diff` <= 1e-5, since the in-graph loops read the cache
through a row table with their own attention kernel) are compared with the eager run's, or
(past the eager lengths) with the WHILE graph's.
Toy size: a tiny model on the simulator (timings there mean nothing).

    python -m experiments search_loop
"""
from __future__ import annotations

import numpy as np

from experiments import common
from proto.device import timing
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedDecoder
from proto.models.search_loop import BeamLoop, GreedyLoop

NAME = "search_loop"
SEARCHES = ["greedy", "beam"]
SIZES = {
    "toy": dict(configs=[GPT2Config(1, 8, 2, 13, 8)], batch=2, prompt_len=2, new=[3],
                unrolls=[1, 2], eager_up_to=8, reps=1, warmup=0),
    "full": dict(configs=[GPT2Config(4, 256, 4, 50257, 1024),
                          GPT2Config(12, 768, 12, 50257, 1024)],
                 batch=5, prompt_len=5, new=[16, 128, 1000], unrolls=[1, 4, 16, 64],
                 eager_up_to=128, reps=5, warmup=1),
}
# The loops read the beams' cache through a row table (attention's row-table kernel); eager and
# graph_per_step move the cache (the plain kernel): the same sums in another order.
SCORE_RTOL = 1e-5


def _rel_diff(a: float, b: float) -> float:
    """|a - b| / |b| of two beam scores (greedy's are 0.0)."""
    return 0.0 if a == b else abs(a - b) / max(abs(b), 1e-30)


FIXED = ["numba_eager", "graph_per_step", "graph_while"]
COLORS = {"numba_eager": "C3", "graph_per_step": "C0", "graph_while": "C2", "predicated": "C1"}


def methods(cfg) -> list[str]:
    return FIXED + [f"predicated_{k}" for k in cfg["unrolls"]]


def _runs(search: str, model, prompt, B: int, max_len: int, unrolls):
    """{method: n -> Generation}, and what to close afterwards."""
    per_step = GraphedDecoder(model, batch=B, max_len=max_len, binding="alias", strategy="device",
                           build_all=True)
    Loop, kw = (GreedyLoop, dict(batch=B)) if search == "greedy" else (BeamLoop, dict(beam=B))
    loops = {"graph_while": Loop(model, max_len=max_len, **kw)}
    loops.update({f"predicated_{k}": Loop(model, max_len=max_len, control="predicated",
                                          unroll=k, **kw) for k in unrolls})
    if search == "greedy":
        runs = {"numba_eager": lambda n: generate.greedy(model, prompt, max_new_tokens=n),
                "graph_per_step": lambda n: per_step.greedy(prompt, max_new_tokens=n)}
        runs.update({m: (lambda n, lp=lp: lp.generate(prompt, max_new_tokens=n))
                     for m, lp in loops.items()})
    else:
        row = prompt[0]
        runs = {"numba_eager": lambda n: generate.beam_search(model, row, beam=B, max_new_tokens=n),
                "graph_per_step": lambda n: per_step.beam_search(row, max_new_tokens=n)}
        runs.update({m: (lambda n, lp=lp: lp.generate(row, max_new_tokens=n))
                     for m, lp in loops.items()})
    return runs, (per_step, *loops.values())


def run(size: str = "toy") -> None:
    cfg = SIZES[size]
    B, T0 = cfg["batch"], cfg["prompt_len"]
    rows = []
    total = len(cfg["configs"]) * len(SEARCHES) * len(cfg["new"]) * len(methods(cfg))
    bar = common.progress(range(total), desc=NAME)
    for config in cfg["configs"]:
        max_len = T0 + max(cfg["new"]) - 1
        model = GPT2(config, random_state_dict(config, seed=0), max_batch=B, max_tokens=T0)
        prompt = np.random.default_rng(1).integers(0, config.vocab_size, (B, T0)).astype(np.int32)
        for search in SEARCHES:
            runs, owned = _runs(search, model, prompt, B, max_len, cfg["unrolls"])
            try:
                for n in cfg["new"]:
                    want = None
                    for method in methods(cfg):
                        bar.update(1)
                        if method == "numba_eager" and n > cfg["eager_up_to"]:
                            continue
                        out = []
                        t = timing.bench_host(lambda: out.append(runs[method](n)),
                                              warmup=cfg["warmup"], reps=cfg["reps"])
                        got = out[-1]
                        want = want or got
                        score_diff = _rel_diff(got.score, want.score)
                        rows.append({"search": search, "method": method, "new_tokens": n,
                                     "batch": B, "prompt_len": T0, "n_layer": config.n_layer,
                                     "n_embd": config.n_embd,
                                     "unroll": int(method.split("_")[1]) if method.startswith("predicated") else None,
                                     "ms_per_token": t.median_ms / n, "generation_ms": t.median_ms,
                                     "p10_ms": t.p10_ms, "p90_ms": t.p90_ms, "reps": t.reps,
                                     "compared_with": "numba_eager" if n <= cfg["eager_up_to"] else "graph_per_step",
                                     "score_rel_diff": score_diff,
                                     "result_equal": bool(np.array_equal(got.tokens, want.tokens)
                                                          and score_diff <= SCORE_RTOL)})
            finally:
                for thing in owned:
                    thing.close()
    bar.close()
    common.write_csv(NAME, rows)
    common.write_summary(NAME, summarize(rows))


def summarize(rows: list[dict]) -> dict:
    """Headline ratios at the longest generation of the largest model, beam and greedy."""
    n = max(int(r["new_tokens"]) for r in rows)
    layers = max(int(r["n_layer"]) for r in rows)
    out = {"new_tokens": n, "n_layer": layers}
    for search in SEARCHES:
        ms = {r["method"]: float(r["ms_per_token"]) for r in rows if r["search"] == search
              and int(r["new_tokens"]) == n and int(r["n_layer"]) == layers}
        pred = {m: v for m, v in ms.items() if m.startswith("predicated")}
        best = min(pred, key=pred.get)
        prefix = "" if search == "beam" else "greedy_"
        out[f"{prefix}predicated_over_while_per_token"] = pred[best] / ms["graph_while"]
        out[f"{prefix}host_loop_over_predicated_per_token"] = ms["graph_per_step"] / pred[best]
        out[f"{prefix}best_unroll"] = int(best.split("_")[1])
        out[f"{search}_per_step_over_while_per_token"] = ms["graph_per_step"] / ms["graph_while"]
        out.update({f"{search}_{m}_ms_per_token": v for m, v in ms.items()})
    out["all_results_equal"] = all(str(r["result_equal"]) == "True" for r in rows)
    return out


def plot():
    """Per model and search, the longest generation: ms per token against the unroll K of
    predication, with the WHILE graph and the host loop as lines."""
    rows = common.read_csv(NAME)
    n = max(int(r["new_tokens"]) for r in rows)
    models = sorted({int(r["n_layer"]) for r in rows})
    fig, axes = common.new_figure(rows, len(models), len(SEARCHES),
                                  figsize=(5.5 * len(SEARCHES), 3.8 * len(models)), squeeze=False)
    for row_axes, layers in zip(axes, models):
        for ax, search in zip(row_axes, SEARCHES):
            mine = [r for r in rows if r["search"] == search and int(r["new_tokens"]) == n
                    and int(r["n_layer"]) == layers]
            pts = sorted((int(r["unroll"]), float(r["ms_per_token"])) for r in mine
                         if r["method"].startswith("predicated"))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS["predicated"],
                        label="predicated (unrolled K passes, host relaunch)")
            for method, style in (("graph_while", "-"), ("graph_per_step", "--"),
                                  ("numba_eager", ":")):
                for r in (r for r in mine if r["method"] == method):
                    ax.axhline(float(r["ms_per_token"]), ls=style, color=COLORS[method],
                               label=method.replace("_", " "))
            ax.set_xscale("log", base=2)
            ax.set_xlabel("unroll K (passes per launch)")
            ax.set_ylabel("ms per generated token")
            r = mine[0]
            ax.set_title(f"GPT-2 {layers}L d{r['n_embd']}, {search} "
                         f"({'beam' if search == 'beam' else 'batch'} {r['batch']}), {n} tokens",
                         fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    return common.save_figure(fig, NAME)
