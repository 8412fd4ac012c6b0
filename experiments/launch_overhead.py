"""Launch overhead: what a kernel costs the host eagerly, and replayed inside one CUDA graph.

N copies of a tiny kernel (one block; each adds 1 to a small array, so the GPU work is nearly
nothing and the time is the launch path) are run for N = 1 .. 1000:
  numba_eager   N eager launches through proto.device.backend.launch (the overlap check, then
                proto.device.launcher: the kernel's flat parameters, remembered per array object,
                to cuda.core's launch; before it, Numba's own launch), timed end to end with
                a final sync (bench_host);
  numba_graph   the same N launches recorded by proto.graph and replayed as one CUDA graph
                (alias binding, so a replay is a check plus one cuGraphLaunch);
  torch_eager / torch_graph   the same with PyTorch's ``x.add_(1)`` and torch.cuda.CUDAGraph,
                when torch and a GPU are present.
Cost per kernel = replay (or loop) time / N. Expect eager ~20-30 us per kernel and a graph
~1 us per kernel at N = 1000 (as measured on the H200): the ratio is the headroom Grape's
graphs give a launch-bound decode step. At N = 1 the graph's fixed cost dominates.

    python -m experiments launch_overhead            # run + plot
    python -m experiments launch_overhead --plot-only
"""
from __future__ import annotations

import numpy as np

from experiments import common
from proto.device import backend, timing
from proto import graph
from proto.device.backend import cuda, jit, launch

NAME = "launch_overhead"
COUNTS = {"toy": [1, 2, 5, 10, 20], "full": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]}
METHODS = ["numba_eager", "numba_graph", "torch_eager", "torch_graph"]


@jit("void(float32[::1])")
def bump_kernel(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1.0


def _numba(count: int, threads: int, reps: dict) -> dict:
    x = cuda.to_device(np.zeros(threads, np.float32))

    def launches(x):
        for _ in range(count):
            launch(bump_kernel, 1, threads, (x,))

    eager = timing.bench_host(lambda: launches(x), **reps)
    with graph.capture(launches, {"x": x}, binding="alias") as graphed:
        replay = timing.bench_host(lambda: graphed.replay(x=x), **reps)
    return {"numba_eager": eager, "numba_graph": replay}


def _torch(count: int, threads: int, reps: dict) -> dict:
    try:
        import torch
    except ImportError:
        return {}
    if backend.SIMULATOR or not torch.cuda.is_available():
        return {}
    x = torch.zeros(threads, device="cuda")

    def launches():
        for _ in range(count):
            x.add_(1.0)

    eager = timing.bench_host(launches, **reps)
    g, _ = common.torch_cuda_graph(launches)
    replay = timing.bench_host(g.replay, **reps)
    g.reset()
    return {"torch_eager": eager, "torch_graph": replay}


def run(size: str = "toy") -> None:
    counts = COUNTS[size]
    threads = 32 if size == "full" else 1  # simulated threads are Python threads
    reps = {"warmup": 3, "reps": 20} if size == "full" else {"warmup": 1, "reps": 3}
    rows = []
    for count in common.progress(counts, desc=NAME):
        for method, t in {**_numba(count, threads, reps), **_torch(count, threads, reps)}.items():
            rows.append({"kernels": count, "method": method,
                         "us_total": round(t.median_us, 3),
                         "us_per_kernel": round(t.median_us / count, 4),
                         "p10_us_per_kernel": round(t.p10_ms * 1e3 / count, 4),
                         "p90_us_per_kernel": round(t.p90_ms * 1e3 / count, 4),
                         "reps": t.reps})
    common.write_csv(NAME, rows)
    common.write_summary(NAME, summarize(rows))


def summarize(rows: list[dict]) -> dict:
    """Headline figures at the largest kernel count."""
    largest = max(int(r["kernels"]) for r in rows)
    per = {r["method"]: float(r["us_per_kernel"]) for r in rows if int(r["kernels"]) == largest}
    summary = {"kernels": largest,
               "eager_over_graph_per_kernel": per["numba_eager"] / per["numba_graph"],
               "eager_us_per_kernel": per["numba_eager"],
               "graph_us_per_kernel": per["numba_graph"]}
    if "torch_eager" in per:
        summary.update(torch_eager_us_per_kernel=per["torch_eager"],
                       torch_graph_us_per_kernel=per["torch_graph"],
                       torch_eager_over_graph_per_kernel=per["torch_eager"] / per["torch_graph"])
    return summary


def plot():
    rows = common.read_csv(NAME)
    fig, ax = common.new_figure(rows, figsize=(6, 4.2))
    styles = {"numba_eager": ("C0", "--"), "numba_graph": ("C0", "-"),
              "torch_eager": ("C1", "--"), "torch_graph": ("C1", "-")}
    for method in METHODS:
        mine = sorted((int(r["kernels"]), float(r["us_per_kernel"]))
                      for r in rows if r["method"] == method)
        if mine:
            color, line = styles[method]
            ax.plot(*zip(*mine), marker="o", color=color, linestyle=line,
                    label=method.replace("_", " "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("kernels per step")
    ax.set_ylabel("host+GPU time per kernel (us)")
    ax.set_title("Launch overhead: eager launches vs one CUDA graph")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return common.save_figure(fig, NAME)
