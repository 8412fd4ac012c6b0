"""Graph memory: what the many graphs of a dynamic-shape workload hold (Grape's memory figure).

Serving every length of a generation with graphs means one graph per length, and every graph
can hold memory twice: the buffers its kernels read and write (a private memory pool per
graph in PyTorch by default) and the driver's executable (every node's parameters and
launch descriptors), whichever of the two the driver actually takes from the GPU. Grape
reports up to 36.43x less GPU memory than PyTorch CUDA graphs.

Workloads:
  GPT-2 small (12 layers, d=768, vocab 50257, random float32 weights), beam search with beam
  5 and a 5-token prompt, to 1024 positions: every decode length 5..1023 (1019 lengths);
  an LSTM LM (2 layers, 512 -> 1024, vocab 10000), one graph per batch size 1..64.

Methods (GPT-2; the LSTM's are the same with batch sizes for lengths):
  ptgraph_private      PyTorch, one torch.cuda.CUDAGraph per length, attention over the live
                       prefix (the length a Python int baked into each graph), each graph its
                       own memory pool (PyTorch's default) (experiments/torch_gpt2.py)
  ptgraph_shared_pool  the same, every graph in one pool (graph_pool_handle, as vLLM and
                       torch.compile); the logits go to one static buffer, so no graph holds an
                       output of its own
  ours_unplanned       our per-length graphs (alias binding: one per length and KV-cache set),
                       every temporary in private memory
  ours_planned         the same, temporaries placed by the memory planner in one arena that
                       every graph shares (the memory tape)
  ours_planned_shared  the same, and the graphs share K executables, retargeted with executable
                       update when a graph of another length is launched
  ours_device          the length read on the device: one graph per cache set for every length

Memory is what building a method's graphs takes from the GPU: free device memory (cuMemGetInfo)
before and after, once every freed buffer is really freed, plus the static tensors PtGraph's
graphs are bound to (the tokens they read and the logits they write, made before its meter
starts; ours read the caller's tokens by alias and write the logits in the arena, which the
drop counts); weights, the KV cache and the LSTM state are the model's and count on neither
side. The driver reserves memory in 2 MiB
chunks, so a method whose graphs take little (ours_planned_shared, ours_device) reads 0, 2 or 4
MiB; for those the figure is also computed from parts (the arena, plus K executables at the
driver bytes per node measured over ours_planned's 2038 graphs), and the headline takes the
larger of the two. Where PyTorch runs out of memory before the last length, the measured
curve is fitted and extrapolated (drawn dashed, flagged in the summary).

Capture time: `capture_s`, the wall time of building a method's graphs (the meter's samples
included); for ours, `record_s`, `plan_s` and `build_s` split the host time of the captures
(recording the launches, placing the temporaries and moving the description onto the arena,
lowering and instantiating: `Graph.capture_s`).

Time per token: whole generations (1019 tokens), the median of `reps` after a warm-up one,
spread (p10, p90) in the CSV; tokens compared with ours_unplanned's. The LSTM's: one loop
through every batch size (64 steps, 64 rows down to 1, an argmax after each), per step.
PyTorch computes in float32 as our kernels do: TF32 off for matmuls and for cuDNN, whose LSTM
would take TF32 tensor cores by default (`torch_tf32` in the CSV reads PyTorch's flags). Toy
size: a tiny model on the simulator (no PyTorch, no memory figures, timings meaningless).

    python -m experiments graph_memory
"""
from __future__ import annotations

import gc
import time

import numpy as np

from experiments import common
from proto import backend, timing
from proto.backend import cuda
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedGPT2, GraphedLSTM
from proto.models.lstm import LSTMConfig, LSTMLM, random_state_dict as lstm_weights

NAME = "graph_memory"
GRAPE_REPORTED = 36.43   # Grape's headline: up to this much less GPU memory than PtGraph
FLOOR_MIB = 1e-2         # where the figure's log axis draws a measured 0
METHODS = ["ptgraph_private", "ptgraph_shared_pool", "ours_unplanned", "ours_planned",
           "ours_planned_shared", "ours_device"]
SIZES = {
    "toy": dict(gpt2=GPT2Config(1, 8, 2, 13, 5), beam=2, prompt_len=2,
                lstm=LSTMConfig(1, 4, 4, 11), max_batch=2, reps=1, warmup=0, executables=1,
                samples=2),
    "full": dict(gpt2=GPT2Config(12, 768, 12, 50257, 1024), beam=5, prompt_len=5,
                 lstm=LSTMConfig(2, 512, 1024, 10000), max_batch=64, reps=5, warmup=1,
                 executables=2, samples=8),
}
RESERVE = 8 << 30   # PyTorch stops capturing with this much device memory left
COLORS = {"ptgraph_private": "C3", "ptgraph_shared_pool": "C1", "ours_unplanned": "C7",
          "ours_planned": "C0", "ours_planned_shared": "C2", "ours_device": "C4"}


def _torch():
    if backend.SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def settled_free() -> int | None:
    """Free device bytes once every dropped buffer is really freed (Numba queues frees and
    flushes them in batches; PyTorch caches them); None on the simulator."""
    if backend.SIMULATOR:
        return None
    gc.collect()
    backend.synchronize()
    torch = _torch()
    if torch is not None:   # blocks PyTorch caches but no graph holds go back to the driver
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    ctx = cuda.current_context()
    ctx.memory_manager.deallocations.clear()
    return ctx.get_memory_info()[0]


class _Meter:
    """Free-memory drop since `start`, sampled at chosen numbers of shapes served, plus
    `static_bytes`: the static input and output tensors a method allocated for its graphs
    before the meter started (PtGraph's graphs read and write fixed addresses; ours bind the
    caller's tokens by alias and write their outputs in the arena, which the drop counts)."""

    def __init__(self, total: int, samples: int, static_bytes: int = 0):
        self.static_bytes = static_bytes
        self.start = settled_free()
        self.points: list[tuple[int, int]] = []
        self.at = set(np.unique(np.geomspace(1, total, samples).astype(int)).tolist()) | {total}

    def sample(self, served: int) -> None:
        if self.start is not None and served in self.at:
            self.points.append((served, self.start - settled_free() + self.static_bytes))

    @property
    def total(self) -> int | None:
        return self.points[-1][1] if self.points else None


# ------------------------------------------------------------------------- GPT-2
def _ours_gpt2(method, model, beam, max_len, cfg):
    kw = {"ours_unplanned": dict(strategy="exact", planned=False),
          "ours_planned": dict(strategy="exact"),
          "ours_planned_shared": dict(strategy="exact", shared_executables=cfg["executables"]),
          "ours_device": dict(strategy="device")}[method]
    g = GraphedGPT2(model, batch=beam, max_len=max_len, binding="alias", **kw)
    meter = _Meter(len(g.keys), cfg["samples"])
    t0 = time.perf_counter()
    g.build_all(after_each=None if kw["strategy"] == "device" else meter.sample)
    capture_s = time.perf_counter() - t0
    for position in range(max_len - cfg["executables"], max_len):
        g.replayer(position)()       # a shared pool instantiates its K executables on first use
    meter.sample(len(g.keys))
    info = {"graphs": g.num_graphs + g.num_reorder_graphs, "nodes": g.num_nodes,
            "arena_bytes": g.arena_bytes, "private_bytes": g.private_bytes,
            "executables": (g.shared.instantiations if g.shared is not None
                            else g.num_graphs + g.num_reorder_graphs),
            "update_us_per_switch": None, **_phases(g)}
    if g.tape is not None and g.tape.plans:
        plan = g.tape.plans[0]
        info.update(peak_live_bytes=plan.peak_live_bytes, buffer_bytes=plan.total_bytes)
    return g, meter, capture_s, info, lambda prompt, new: g.beam_search(prompt, max_new_tokens=new)


def _phases(g) -> dict:
    """Where our capture time went, summed over the graphs (`capture_seconds`): record_s,
    plan_s, build_s, columns beside capture_s."""
    return {f"{phase}_s": round(s, 3) for phase, s in g.capture_seconds.items()
            if phase != "warmup"}


def _ptgraph_gpt2(method, config, state_dict, beam, max_len, cfg):
    from experiments.torch_gpt2 import PerLengthDecoder
    torch = _torch()
    dec = PerLengthDecoder(config, state_dict, batch=beam, max_len=max_len,
                           pool="private" if method == "ptgraph_private" else "shared")
    lengths = range(cfg["prompt_len"], max_len + 1)
    meter = _Meter(len(lengths), cfg["samples"], _torch_bytes(dec._tokens, dec._static_logits))
    t0 = time.perf_counter()
    for n, length in enumerate(lengths, 1):   # ascending: the order a generation replays
        if torch.cuda.mem_get_info()[0] < RESERVE:
            break
        dec.capture(length)
        meter.sample(n)
    capture_s = time.perf_counter() - t0
    info = {"graphs": len(dec.graphs), "lengths_captured": len(dec.graphs),
            "torch_tf32": common.torch_tf32()}
    return dec, meter, capture_s, info, lambda prompt, new: dec.beam_search(prompt, max_new_tokens=new)


def _torch_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _extrapolate(points, total: int) -> tuple[float, bool]:
    """Memory at `total` shapes: measured if the last point is there, else a line fitted to
    the measured points (extrapolated: True)."""
    served, used = zip(*points)
    if served[-1] >= total:
        return float(used[-1]), False
    slope, icept = np.polyfit(served, used, 1)
    return float(slope * total + icept), True


def _per_token(t: timing.Timing | None, tokens: int) -> dict:
    """A run's CSV columns per token: median, p10, p90 (None where it was not timed)."""
    return {"ms_per_token": None if t is None else round(t.median_ms / tokens, 4),
            "ms_per_token_p10": None if t is None else round(t.p10_ms / tokens, 4),
            "ms_per_token_p90": None if t is None else round(t.p90_ms / tokens, 4),
            "reps": None if t is None else t.reps}


def _time(generate, prompt, new, cfg) -> timing.Timing:
    out = []
    t = timing.bench_host(lambda: out.append(generate(prompt, new)), warmup=cfg["warmup"],
                          reps=cfg["reps"])
    return t, out[-1]


def run_gpt2(cfg, rows, curve) -> dict:
    config, beam, T0 = cfg["gpt2"], cfg["beam"], cfg["prompt_len"]
    max_len = config.n_positions
    new = max_len - T0 + 1                # the last token generated is never fed back
    state_dict = random_state_dict(config, seed=0)
    model = GPT2(config, state_dict, max_batch=beam, max_tokens=T0)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, T0)
    methods = METHODS if _torch() is not None else [m for m in METHODS if m.startswith("ours")]
    results, tokens = {}, {}
    for method in common.progress(methods, desc=f"{NAME} gpt2"):
        if method.startswith("ours"):
            m, meter, capture_s, info, gen = _ours_gpt2(method, model, beam, max_len, cfg)
        else:
            m, meter, capture_s, info, gen = _ptgraph_gpt2(method, config, state_dict, beam,
                                                           max_len, cfg)
        served = len(range(T0, max_len + 1))
        memory, extrapolated = (None, False) if not meter.points else \
            _extrapolate(meter.points, served if method.startswith("pt") else meter.points[-1][0])
        timed = method != "ptgraph_private" and info["graphs"] > 0 and \
            info.get("lengths_captured", served) >= served
        t, got = _time(gen, prompt, new, cfg) if timed else (None, None)
        if got is not None:
            tokens[method] = got.tokens
        if method == "ours_planned_shared" and getattr(m, "shared", None) is not None:
            info["update_us_per_switch"] = round(m.shared.update_us_per_switch, 2)
            info["executables"] = m.shared.instantiations
        results[method] = dict(memory=memory, info=info)
        rows.append({"model": "gpt2", "n_layer": config.n_layer, "n_embd": config.n_embd,
                     "beam": beam, "prompt_len": T0, "shapes_served": served, "method": method,
                     "memory_mib": None if memory is None else round(memory / 2**20, 3),
                     "extrapolated": extrapolated, "capture_s": round(capture_s, 3),
                     **_per_token(t, new), "same_tokens": None, **info})
        common.report(NAME, rows[-1])
        curve += [{"model": "gpt2", "method": method, "shapes_served": n,
                   "memory_mib": round(b / 2**20, 3)} for n, b in meter.points]
        m.close()
        del m, gen
    want = tokens.get("ours_unplanned")
    for r in rows:
        if r["model"] == "gpt2" and r["method"] in tokens and want is not None:
            r["same_tokens"] = bool(np.array_equal(tokens[r["method"]], want))
    return results


# ------------------------------------------------------------------------- LSTM
class _TorchLSTMGraphs:
    """PtGraph for the LSTM LM: one CUDA graph per batch size, torch.nn.LSTM (cuDNN) with our
    weights; the state lives in static (L, max_batch, H) tensors, rows [:b] updated in place."""

    def __init__(self, config, state_dict, max_batch: int, pool: str):
        # cuDNN's LSTM takes TF32 tensor cores by default (torch.backends.cudnn.allow_tf32):
        # float32 must mean float32 beside our kernels, as in every other comparison
        common.no_tf32()
        torch = _torch()
        self.torch = torch
        dev = "cuda"
        self.emb = torch.nn.Embedding(config.vocab_size, config.n_embd).to(dev)
        self.lstm = torch.nn.LSTM(config.n_embd, config.n_hidden, config.n_layer).to(dev)
        self.dec = torch.nn.Linear(config.n_hidden, config.vocab_size).to(dev)
        with torch.no_grad():
            self.emb.weight.copy_(torch.from_numpy(state_dict["embedding.weight"]))
            for name, p in self.lstm.named_parameters():
                p.copy_(torch.from_numpy(state_dict[f"lstm.{name}"]))
            self.dec.weight.copy_(torch.from_numpy(state_dict["decoder.weight"]))
            self.dec.bias.copy_(torch.from_numpy(state_dict["decoder.bias"]))
        L, H, B = config.n_layer, config.n_hidden, max_batch
        self.h = torch.zeros((L, B, H), device=dev)
        self.c = torch.zeros((L, B, H), device=dev)
        self.tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self.logits = torch.zeros((B, config.vocab_size), device=dev)
        self.handle = torch.cuda.graph_pool_handle() if pool == "shared" else None
        self.graphs = {}

    def _step(self, b: int) -> None:
        with self.torch.no_grad():
            # cuDNN wants contiguous state: rows [:b] of (L, B, H) are not, so copy them out
            y, (h, c) = self.lstm(self.emb(self.tokens[:b])[None],
                                  (self.h[:, :b].contiguous(), self.c[:, :b].contiguous()))
            self.h[:, :b].copy_(h)
            self.c[:, :b].copy_(c)
            self.torch.addmm(self.dec.bias, y[0], self.dec.weight.T, out=self.logits[:b])

    def capture(self, b: int) -> None:
        self.graphs[b], _ = common.torch_cuda_graph(lambda: self._step(b), pool=self.handle)

    def shrinking(self, prompt) -> None:
        """One token per batch size, max_batch rows down to 1 (sequences finishing)."""
        self.tokens.copy_(self.torch.from_numpy(prompt).cuda())
        for b in range(len(prompt), 0, -1):
            self.graphs[b].replay()
            self.tokens[:b].copy_(self.logits[:b].argmax(dim=1))

    def close(self) -> None:
        self.torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs = {}


def _ours_lstm_shrinking(g, prompt) -> None:
    from kernels import sampling
    g.tokens.copy_to_device(prompt.astype(np.int32))
    for b in range(len(prompt), 0, -1):
        sampling.argmax(g.step(g.tokens, b), backend.leading(g.tokens, b))


def run_lstm(cfg, rows, curve) -> dict:
    config, B = cfg["lstm"], cfg["max_batch"]
    state_dict = lstm_weights(config, seed=0)
    model = LSTMLM(config, state_dict, max_batch=B)
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, B)
    methods = [m for m in METHODS if m != "ours_device"]
    if _torch() is None:
        methods = [m for m in methods if m.startswith("ours")]
    results = {}
    for method in common.progress(methods, desc=f"{NAME} lstm"):
        ptgraph = method.startswith("ptgraph")
        if ptgraph:   # its weights and state first, outside the meter
            m = _TorchLSTMGraphs(config, state_dict, B, "private" if method == "ptgraph_private"
                                 else "shared")
        meter = _Meter(B, cfg["samples"], _torch_bytes(m.tokens, m.logits) if ptgraph else 0)
        t0 = time.perf_counter()
        if method.startswith("ours"):
            m = GraphedLSTM(model, max_batch=B, binding="alias", strategy="exact",
                            planned=method != "ours_unplanned",
                            shared_executables=cfg["executables"] if method.endswith("shared") else None)
            m.build_all(after_each=meter.sample)
            capture_s = time.perf_counter() - t0
            for b in range(B - cfg["executables"] + 1, B + 1):
                m.step(m.tokens, b)                  # a shared pool instantiates on first use
            meter.sample(B)
            info = {"graphs": m.num_graphs, "nodes": m.num_nodes, "arena_bytes": m.arena_bytes,
                    "private_bytes": m.private_bytes, **_phases(m)}
            run = lambda: _ours_lstm_shrinking(m, prompt)  # noqa: E731
        else:
            for n, b in enumerate(range(B, 0, -1), 1):
                m.capture(b)
                meter.sample(n)
            capture_s = time.perf_counter() - t0
            info = {"graphs": len(m.graphs), "torch_tf32": common.torch_tf32()}
            run = lambda: m.shrinking(prompt)  # noqa: E731
        t = timing.bench_host(run, warmup=cfg["warmup"], reps=cfg["reps"])
        memory = meter.total
        results[method] = dict(memory=memory, info=info)
        rows.append({"model": "lstm", "n_layer": config.n_layer, "n_embd": config.n_embd,
                     "beam": None, "prompt_len": None, "shapes_served": B, "method": method,
                     "memory_mib": None if memory is None else round(memory / 2**20, 3),
                     "extrapolated": False, "capture_s": round(capture_s, 3),
                     **_per_token(t, B),
                     "same_tokens": None, **info})
        common.report(NAME, rows[-1])
        curve += [{"model": "lstm", "method": method, "shapes_served": n,
                   "memory_mib": round(b / 2**20, 3)} for n, b in meter.points]
        m.close()
    return results


# ------------------------------------------------------------------------- run, summary, plot
def _ours_attributed(gpt2: dict, executables: int) -> int | None:
    """ours_planned_shared from parts: its arena, plus K step executables and the reorder
    graphs at the driver bytes per node that ours_planned's many executables measured."""
    planned, shared = gpt2.get("ours_planned"), gpt2.get("ours_planned_shared")
    if not planned or planned["memory"] is None or not shared:
        return None
    p = planned["info"]
    # The free-memory drop can read below the arena (2 MiB steps): never a negative share
    per_node = max(planned["memory"] - p["arena_bytes"], 0) / p["nodes"]
    s = shared["info"]
    step_nodes = s["nodes"] / max(s["graphs"] - 2, 1)          # two of the graphs reorder
    return int(s["arena_bytes"] + per_node * executables * step_nodes
               + per_node * (s["nodes"] - step_nodes * (s["graphs"] - 2)))


def run(size: str = "toy") -> None:
    cfg = SIZES[size]
    rows, curve = [], []

    def save():   # after each workload: a failure later leaves what was measured
        columns = list(dict.fromkeys(k for r in rows for k in r))
        common.write_csv(NAME, [{k: r.get(k) for k in columns} for r in rows])
        common.write_csv(f"{NAME}_curve", curve or [{"model": None, "method": None,
                                                     "shapes_served": None, "memory_mib": None}])

    run_lstm(cfg, rows, curve)      # the short one first
    save()
    gpt2 = run_gpt2(cfg, rows, curve)
    save()
    by = {(r["model"], r["method"]): r for r in rows}
    mem = {k: r["memory_mib"] for k, r in by.items()}
    ms = {k: r["ms_per_token"] for k, r in by.items()}
    attributed = _ours_attributed(gpt2, cfg["executables"])
    ours = mem.get(("gpt2", "ours_planned_shared"))
    ours_headline = None if ours is None else max(ours, (attributed or 0) / 2**20)

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else round(a / b, 3)

    plan = by[("gpt2", "ours_planned")]
    summary = {
        "model": f"GPT-2 {cfg['gpt2'].n_layer}L d={cfg['gpt2'].n_embd}, beam {cfg['beam']}, "
                 f"prompt {cfg['prompt_len']}, lengths {cfg['prompt_len']}..{cfg['gpt2'].n_positions}",
        "ptgraph_over_ours_memory": ratio(mem.get(("gpt2", "ptgraph_shared_pool")), ours_headline),
        "ptgraph_private_over_ours_memory": ratio(mem.get(("gpt2", "ptgraph_private")), ours_headline),
        "ptgraph_memory_extrapolated": bool(by.get(("gpt2", "ptgraph_shared_pool"), {}).get("extrapolated")),
        "ours_memory_mib": ours_headline,
        "ours_memory_measured_mib": ours,
        "ours_memory_from_parts_mib": None if attributed is None else round(attributed / 2**20, 3),
        "ptgraph_shared_pool_memory_mib": mem.get(("gpt2", "ptgraph_shared_pool")),
        "ptgraph_private_memory_mib": mem.get(("gpt2", "ptgraph_private")),
        "ours_unplanned_memory_mib": mem.get(("gpt2", "ours_unplanned")),
        "ours_planned_memory_mib": mem.get(("gpt2", "ours_planned")),
        "ours_device_memory_mib": mem.get(("gpt2", "ours_device")),
        "planned_over_unplanned_time_per_token": ratio(ms.get(("gpt2", "ours_planned_shared")),
                                                       ms.get(("gpt2", "ours_unplanned"))),
        "ptgraph_ms_per_token": ms.get(("gpt2", "ptgraph_shared_pool")),
        "ours_unplanned_ms_per_token": ms.get(("gpt2", "ours_unplanned")),
        "ours_planned_shared_ms_per_token": ms.get(("gpt2", "ours_planned_shared")),
        "update_us_per_switch": by[("gpt2", "ours_planned_shared")].get("update_us_per_switch"),
        "arena_over_peak_live": ratio(plan.get("arena_bytes"), plan.get("peak_live_bytes")),
        "lstm_ptgraph_over_ours_memory": ratio(mem.get(("lstm", "ptgraph_shared_pool")),
                                               mem.get(("lstm", "ours_planned_shared"))),
        "lstm_ours_planned_over_ptgraph_time_per_step": ratio(
            ms.get(("lstm", "ours_planned")), ms.get(("lstm", "ptgraph_shared_pool"))),
        "all_tokens_equal": all(r["same_tokens"] in (True, None) for r in rows),
        "grape_reported_memory_ratio": GRAPE_REPORTED,
    }
    common.write_summary(NAME, summary)


def plot(device: str | None = None):
    rows = common.read_csv(NAME, device)
    curve = [r for r in common.read_csv(f"{NAME}_curve", device) if r["method"]]
    summary = common.read_summary(NAME, device)
    fig, axes = common.new_figure(rows, 2, 2, figsize=(12, 10),
                                  gridspec_kw={"width_ratios": [1.6, 1]})
    for i, model in enumerate(("gpt2", "lstm")):
        ax, bars = axes[i]
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            pts = [(int(c["shapes_served"]), float(c["memory_mib"])) for c in curve
                   if c["model"] == model and c["method"] == r["method"]]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, [max(y, FLOOR_MIB) for y in ys], marker="o", ms=3,
                    color=COLORS[r["method"]], label=r["method"].replace("_", " "))
            if r["extrapolated"] == "True":
                ax.plot([xs[-1], int(r["shapes_served"])], [ys[-1], float(r["memory_mib"])],
                        ls="--", color=COLORS[r["method"]], label="  (extrapolated)")
        # free memory moves in 2 MiB steps: a method that took less reads 0, drawn at the floor
        ax.axhline(2, ls=":", lw=1, color="0.5",
                   label=f"2 MiB step of the measurement (0 read is drawn at {FLOOR_MIB})")
        if model == "gpt2" and summary.get("ours_memory_from_parts_mib"):
            ax.plot([int(mine[0]["shapes_served"])], [summary["ours_memory_from_parts_mib"]],
                    marker="*", ms=11, ls="", color=COLORS["ours_planned_shared"],
                    label="ours planned shared, from parts (arena + K executables)")
        ax.set_yscale("log")
        ax.set_xlabel("lengths served" if model == "gpt2" else "batch sizes served")
        ax.set_ylabel("GPU memory held by the graphs (MiB, log)")
        ax.set_title(f"{model.upper()}: memory against shapes served")
        if ax.get_legend_handles_labels()[0]:   # below the axes: the curves fill them
            ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
        timed = [r for r in mine if r["ms_per_token"] not in ("", "None")]
        names = [r["method"].replace("_", "\n", 1) for r in timed]
        vals = [float(r["ms_per_token"]) for r in timed]
        errs = [[v - float(r["ms_per_token_p10"]) for v, r in zip(vals, timed)],
                [float(r["ms_per_token_p90"]) - v for v, r in zip(vals, timed)]]
        bars.bar(range(len(vals)), vals, yerr=errs, color=[COLORS[r["method"]] for r in timed])
        bars.set_xticks(range(len(vals)), names, fontsize=7)
        bars.set_ylabel("ms per token (median, p10-p90)")
        bars.set_title("time per token of whole generations")
    return common.save_figure(fig, NAME, device)
