"""Graph memory: what the many graphs of a dynamic-shape workload hold (Grape's memory figure).

Serving every length of a generation with graphs means one graph per length, and every graph
can hold memory twice: the buffers its kernels read and write (a private memory pool per
graph in PyTorch by default) and the driver's executable (every node's parameters and
launch descriptors). Grape reports up to 36.43x less GPU memory than PyTorch CUDA graphs.

Workloads:
  GPT-2 small (12 layers, d=768, vocab 50257, random float32 weights), beam search with beam
  5 and a 5-token prompt, to 1024 positions: every decode length 5..1023 (1019 lengths);
  an LSTM LM (2 layers, 512 -> 1024, vocab 10000), one graph per batch size 1..64.

Methods (GPT-2; the LSTM's are the same with batch sizes for lengths):
  ptgraph_private      PyTorch, one torch.cuda.CUDAGraph per length, attention over the live
                       prefix (the length a Python int baked into each graph), each graph its
                       own memory pool (PyTorch's default) (experiments/torch_gpt2.py)
  ptgraph_shared_pool  the same, every graph in one pool (graph_pool_handle, as vLLM and
                       torch.compile); the logits go to one static buffer
  ours_unplanned       our per-length graphs (alias binding: one per length and KV-cache set),
                       every temporary in private memory
  ours_planned         the same, temporaries placed by the memory planner in one arena that
                       every graph shares (the memory tape)
  ours_planned_shared  the same, and the graphs share K executables, retargeted with executable
                       update when a graph of another length is launched
  ours_device          the length read on the device: one graph per cache set for every length

How memory is read. Each method runs in a process of its own (experiments.isolate): the
driver keeps what freed graphs held and reuses it silently, so a method measured after
another in one process reads too little. In that process, free device memory (cuMemGetInfo,
after Numba's queued frees are flushed and PyTorch's cache emptied) is read

  init      before anything of the method exists;
  state     after the model state (weights, KV caches, static inputs and outputs, our second
            KV set for alias binding) and one eager decode step (the same warm-up on both
            sides: kernels loaded, eager scratch and library handles made);
  captured  after every graph is built (samples on the way make the curve);
  uploaded  after every graph has been launched once (a generation launches each anyway).

The headline is graph memory, state -> uploaded: what the graphs hold (executables,
definitions, pools or arena, per-graph device arrays). State is a column of its own, and the
whole footprint (init -> uploaded) beside it. Graph memory is split into its parts: the
buffers (PyTorch: the pool's growth, torch.cuda.memory_reserved; ours: Numba's live device
allocations made while building, the arena among them) and the driver's part, the rest. The
driver's part is checked against a microbenchmark of its own (`driver_probe`: N graphs of K
trivial kernel nodes, uploaded, in a fresh process; bytes a node and a graph fitted by least
squares): `memory_breakdown_complete` says whether ours' buffers plus the driver bytes its
instantiated executables should take come within 4 MiB of its measured graph memory.

A method whose graphs would leave less than RESERVE free stops building there; its memory is
extrapolated from the measured curve (dashed, flagged), and its time is not measured.

Time per token: whole generations (1019 tokens), the median of `reps` after a warm-up one,
spread (p10, p90) in the CSV; tokens compared with ours_planned's. The LSTM's: one loop
through every batch size (64 steps, 64 rows down to 1, an argmax after each), per step.
PyTorch computes in float32 as our kernels do: TF32 off for matmuls and cuDNN. Toy size: a
tiny model on the simulator (no PyTorch, no memory figures, timings meaningless).

    python -m experiments graph_memory
"""
from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np

from experiments import common, isolate
from proto.device import backend, timing
from proto.device.backend import cuda

NAME = "graph_memory"
GRAPE_REPORTED = 36.43   # Grape's headline: up to this much less GPU memory than PtGraph
FLOOR_MIB = 1e-2         # where the figure's log axis draws a measured 0
BREAKDOWN_SLACK_MIB = 4  # parts must sum to the measured graph memory within this
METHODS = ["ptgraph_private", "ptgraph_shared_pool", "ours_unplanned", "ours_planned",
           "ours_planned_shared", "ours_device"]
HEADLINE = ("ptgraph_shared_pool", "ours_planned_shared")
SIZES = {
    "toy": dict(gpt2=dict(n_layer=1, n_embd=8, n_head=2, vocab_size=13, n_positions=5), beam=2,
                prompt_len=2, lstm=dict(n_layer=1, n_embd=4, n_hidden=4, vocab_size=11),
                max_batch=2, reps=1, warmup=0, executables=1, samples=2, sweep=2,
                probe=[(2, 1), (2, 2)]),
    "full": dict(gpt2=dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                           n_positions=1024), beam=5, prompt_len=5,
                 lstm=dict(n_layer=2, n_embd=512, n_hidden=1024, vocab_size=10000),
                 max_batch=64, reps=5, warmup=1, executables=2, samples=8,
                 sweep=256,   # the lengths every exact method times (ours unplanned fits these)
                 # (graphs, kernel nodes each): 2 MiB steps stay under 5% of every reading
                 probe=[(2048, 1), (2048, 8), (512, 64), (256, 256)]),
}
RESERVE = 8 << 30   # a method stops building graphs with this much device memory left
COLORS = {"ptgraph_private": "C3", "ptgraph_shared_pool": "C1", "ours_unplanned": "C7",
          "ours_planned": "C0", "ours_planned_shared": "C2", "ours_device": "C4"}
MIB = 2**20


def _torch():
    if backend.SIMULATOR:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


# ------------------------------------------------------------------------- the meter
class Meter:
    """Readings of free device memory in this process, by name, once every dropped buffer is
    really freed (Numba queues frees and flushes them in batches; PyTorch caches them).
    Also Numba's live device bytes and PyTorch's reserved bytes, to split what a drop is
    made of. On the simulator every reading is None."""

    def __init__(self):
        self.free: dict[str, int] = {}
        self.numba: dict[str, int] = {}
        self.torch: dict[str, int] = {}

    def read(self, name: str) -> int | None:
        if backend.SIMULATOR:
            return None
        reserved = common.release_torch_cache()
        if reserved is not None:
            self.torch[name] = reserved
        self.free[name], self.numba[name] = backend.settled_free_memory()
        return self.free[name]

    def drop(self, start: str, end: str) -> int | None:
        """Bytes taken between two readings. A reading that went up means something this
        process freed came back between them: the measurement would be wrong, so it raises."""
        if start not in self.free or end not in self.free:
            return None
        taken = self.free[start] - self.free[end]
        if taken < -2 * MIB:   # (one 2 MiB chunk of jitter is the driver's granularity)
            raise RuntimeError(f"free memory rose by {-taken / MIB:.1f} MiB from {start!r} to "
                               f"{end!r}: memory freed in between was counted; every method "
                               "must run in its own process with nothing freed while metered")
        return taken


def _mib(b) -> float | None:
    return None if b is None else round(b / MIB, 3)


# ------------------------------------------------------------------------- the children
def measure(model: str, method: str, size: str) -> dict:
    """One method on one workload, in this (fresh) process: the readings, the curve, the
    timings and the tokens (experiments.isolate runs it)."""
    cfg = SIZES[size]
    meter = Meter()
    meter.read("init")
    run = {("gpt2", True): _pt_gpt2, ("gpt2", False): _ours_gpt2,
           ("lstm", True): _pt_lstm, ("lstm", False): _ours_lstm}[(model, method.startswith("pt"))]
    return run(method, cfg, meter)


class _Stop(Exception):
    """Building stopped: the next graph would leave less than RESERVE free."""


def _curve(meter: Meter, total: int, samples: int):
    """A callback for build_all(after_each=...): free-memory samples at log-spaced counts
    of shapes served (drop since "state"), and the stop at RESERVE."""
    at = set(np.unique(np.geomspace(1, total, samples).astype(int)).tolist()) | {total}
    points = []

    def after_each(served: int) -> None:
        if backend.SIMULATOR:
            return
        if served in at:
            meter.read(f"served {served}")
            points.append((served, meter.drop("state", f"served {served}")))
        if cuda.current_context().get_memory_info()[0] < RESERVE:
            points.append((served, None))
            raise _Stop
    return after_each, points


def _build_and_upload(meter: Meter, build, launch_all) -> float:
    """`build()` (which may stop at RESERVE: `_curve`), the "captured" reading, every graph
    launched once (`launch_all()`), the "uploaded" reading; returns build's seconds."""
    t0 = time.perf_counter()
    try:
        build()
    except _Stop:
        pass
    capture_s = time.perf_counter() - t0
    meter.read("captured")
    launch_all()
    meter.read("uploaded")
    return capture_s


def _time(generate, cfg) -> tuple[timing.Timing, list]:
    """Whole generations timed (`generate()` returns a search result); and the last one's
    tokens."""
    out = []
    t = timing.bench_host(lambda: out.append(generate()), warmup=cfg["warmup"], reps=cfg["reps"])
    return t, out[-1].tokens


def _result(meter: Meter, points, served: int, built: int, info: dict, buffers, t, tokens,
            per: int) -> dict:
    graph = meter.drop("state", "uploaded")
    row = {"shapes_served": served, "shapes_built": built,
           "graph_mib": _mib(graph), "graph_after_capture_mib": _mib(meter.drop("state", "captured")),
           "state_mib": _mib(meter.drop("init", "state")),
           "footprint_mib": _mib(meter.drop("init", "uploaded")),
           "buffers_mib": _mib(buffers),
           "driver_mib": None if graph is None or buffers is None else _mib(graph - buffers),
           **info, **_per_token(t, per)}
    curve = [(n, b) for n, b in points if b is not None]
    if built < served and len(curve) >= 2:   # stopped at RESERVE: the line through the samples
        served_at, used = zip(*curve)
        slope, icept = np.polyfit(served_at, used, 1)
        row["graph_mib"], row["extrapolated"] = _mib(slope * served + icept), True
    else:
        row["extrapolated"] = False
    return {"row": row, "curve": [(n, _mib(b)) for n, b in curve],
            "tokens": None if tokens is None else np.asarray(tokens).tolist()}


def _gpt2_setup(cfg):
    from proto.models.gpt2 import GPT2Config, random_state_dict
    config = GPT2Config(**cfg["gpt2"])
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, cfg["prompt_len"])
    return config, random_state_dict(config, seed=0), prompt, config.n_positions - cfg["prompt_len"] + 1


def _ours_gpt2(method, cfg, meter) -> dict:
    from proto.models.gpt2 import GPT2
    from proto.models.graphed import GraphedDecoder
    config, state_dict, prompt, new = _gpt2_setup(cfg)
    beam, max_len = cfg["beam"], config.n_positions
    kw = {"ours_unplanned": dict(strategy="exact", planned=False),
          "ours_planned": dict(strategy="exact"),
          "ours_planned_shared": dict(strategy="exact", shared_executables=cfg["executables"]),
          "ours_device": dict(strategy="device")}[method]
    model = GPT2(config, state_dict, max_batch=beam, max_tokens=cfg["prompt_len"])
    g = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias", **kw)
    # the warm-up: one eager decode step at the last position on the first cache set
    g.reset()
    g.inputs.pos.copy_to_device(np.array([max_len - 1], np.int32))
    model.step(g.inputs.tokens, g.inputs.pos, g.caches[0])
    meter.read("state")
    after_each, points = _curve(meter, len(g.keys), cfg["samples"])
    capture_s = _build_and_upload(
        meter, lambda: g.build_all(after_each=None if kw["strategy"] == "device" else after_each),
        g.launch_all)
    # lengths whose graphs exist (every length, once all are built: the device strategy's
    # one graph serves them all)
    keys_built = {k for d in g.graphed.dispatchers for k in d.graphs}
    built = max_len if len(keys_built) == len(g.keys) else len(keys_built)
    arrays = None if backend.SIMULATOR else meter.numba["uploaded"] - meter.numba["state"]
    # executables the driver holds: the pool's (step graphs) or one a graph, and the reorders'
    step_nodes = g.num_nodes // max(g.num_graphs, 1)
    reorder_nodes = sum(len(r.description) for r in g.graphed.helpers)
    step_exes = g.shared.instantiations if g.shared is not None else g.num_graphs
    info = {"graphs": g.num_graphs + g.num_reorder_graphs, "nodes": g.num_nodes + reorder_nodes,
            "executables": step_exes + g.num_reorder_graphs,
            "executable_nodes": step_exes * step_nodes + reorder_nodes,
            "arena_mib": _mib(g.arena_bytes), "private_mib": _mib(g.private_bytes),
            "second_kv_mib": _mib(sum(a.nbytes for a in g.caches[1].arrays())),
            "capture_s": round(capture_s, 3), **_phases(g)}
    if g.tape is not None and g.tape.plans:
        plan = g.tape.plans[0]
        info.update(peak_live_mib=_mib(plan.peak_live_bytes), buffer_total_mib=_mib(plan.total_bytes))
    tail = list(range(max_len - cfg["sweep"] + 1, max_len + 1))
    if kw["strategy"] == "exact" and keys_built >= set(tail):
        info.update(_sweep(g, tail, cfg))
    t, tokens = None, None
    if built == max_len:
        if g.shared is not None:
            g.shared.updates = 0
            g.shared.update_s = 0.0
        t, tokens = _time(lambda: g.beam_search(prompt, max_new_tokens=new), cfg)
        if g.shared is not None:
            info["update_us_per_switch"] = round(g.shared.update_us_per_switch, 2)
    g.close()
    return _result(meter, points, max_len, built, info, arrays, t, tokens, new)


def _sweep(g, lengths: list[int], cfg) -> dict:
    """The decode graphs of `lengths` replayed once each, ascending: a generation's graphs
    without its search, timed per token. Every exact-strategy method builds the largest
    lengths first, so it times the same graphs even where it stopped at RESERVE (ours
    unplanned, whose private buffers outgrow an 80 GB card): the planned/unplanned time ratio."""
    steps = [g.replayer(n - 1) for n in lengths]

    def sweep():
        for replay in steps:
            replay()
    t = timing.bench_host(sweep, warmup=cfg["warmup"], reps=cfg["reps"])
    return {"sweep_lengths": len(lengths),
            **{f"sweep_{k}": v for k, v in _per_token(t, len(lengths)).items() if k != "reps"}}


def _pt_gpt2(method, cfg, meter) -> dict:
    from experiments.torch_gpt2 import PerLengthDecoder
    config, state_dict, prompt, new = _gpt2_setup(cfg)
    beam, T0, max_len = cfg["beam"], cfg["prompt_len"], config.n_positions
    dec = PerLengthDecoder(config, state_dict, batch=beam, max_len=max_len,
                           pool="private" if method == "ptgraph_private" else "shared")
    dec.model.decode_at(dec._tokens, max_len, dec._static_logits)   # the warm-up
    meter.read("state")
    lengths = list(range(T0, max_len + 1))
    after_each, points = _curve(meter, len(lengths), cfg["samples"])

    def build():
        for n, length in enumerate(reversed(lengths), 1):   # largest first (PerLengthDecoder)
            dec.capture(length)
            after_each(n)
    capture_s = _build_and_upload(meter, build, lambda: [g.replay() for g in dec.graphs.values()])
    pool = meter.torch["uploaded"] - meter.torch["state"]
    built = len(dec.graphs)
    info = {"graphs": built, "capture_s": round(capture_s, 3),
            "pool_mib": _mib(pool), "torch_tf32": common.torch_tf32()}
    t, tokens = None, None
    if method != "ptgraph_private" and built == len(lengths):
        t, tokens = _time(lambda: dec.beam_search(prompt, max_new_tokens=new), cfg)
    dec.close()
    return _result(meter, points, len(lengths), built, info, pool, t, tokens, new)


def _phases(g) -> dict:
    """Where our capture time went, summed over the graphs (`capture_seconds`): record_s,
    plan_s, build_s, columns beside capture_s."""
    return {f"{phase}_s": round(s, 3) for phase, s in g.capture_seconds.items()
            if phase != "warmup"}


def _per_token(t: timing.Timing | None, tokens: int) -> dict:
    """A run's CSV columns per token: median, p10, p90 (None where it was not timed)."""
    return {"ms_per_token": None if t is None else round(t.median_ms / tokens, 4),
            "ms_per_token_p10": None if t is None else round(t.p10_ms / tokens, 4),
            "ms_per_token_p90": None if t is None else round(t.p90_ms / tokens, 4),
            "reps": None if t is None else t.reps}


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


def _lstm_setup(cfg):
    from proto.models.lstm import LSTMConfig, random_state_dict
    config = LSTMConfig(**cfg["lstm"])
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, cfg["max_batch"])
    return config, random_state_dict(config, seed=0), prompt


def _ours_lstm(method, cfg, meter) -> dict:
    from kernels import sampling
    from proto.models.graphed import GraphedLSTM
    from proto.models.lstm import LSTMLM
    config, state_dict, prompt = _lstm_setup(cfg)
    B = cfg["max_batch"]
    model = LSTMLM(config, state_dict, max_batch=B)
    m = GraphedLSTM(model, max_batch=B, binding="alias", strategy="exact",
                    planned=method != "ours_unplanned",
                    shared_executables=cfg["executables"] if method.endswith("shared") else None)
    model.step(m.tokens, m.state)   # the warm-up (eager, the whole batch)
    meter.read("state")
    after_each, points = _curve(meter, B, cfg["samples"])
    capture_s = _build_and_upload(meter, lambda: m.build_all(after_each=after_each), m.launch_all)
    arrays = None if backend.SIMULATOR else meter.numba["uploaded"] - meter.numba["state"]
    exes = m.shared.instantiations if m.shared is not None else m.num_graphs
    info = {"graphs": m.num_graphs, "nodes": m.num_nodes, "executables": exes,
            "executable_nodes": exes * (m.num_nodes // max(m.num_graphs, 1)),
            "arena_mib": _mib(m.arena_bytes), "private_mib": _mib(m.private_bytes),
            "capture_s": round(capture_s, 3), **_phases(m)}

    def shrinking():
        m.tokens.copy_to_device(prompt.astype(np.int32))
        for b in range(B, 0, -1):
            sampling.argmax(m.step(m.tokens, b), backend.leading(m.tokens, b))
    t = timing.bench_host(shrinking, warmup=cfg["warmup"], reps=cfg["reps"])
    built = m.num_graphs
    m.close()
    return _result(meter, points, B, built, info, arrays, t, None, B)


def _pt_lstm(method, cfg, meter) -> dict:
    config, state_dict, prompt = _lstm_setup(cfg)
    B = cfg["max_batch"]
    m = _TorchLSTMGraphs(config, state_dict, B, "private" if method == "ptgraph_private" else "shared")
    m._step(B)   # the warm-up
    meter.read("state")
    after_each, points = _curve(meter, B, cfg["samples"])

    def build():
        for n, b in enumerate(range(B, 0, -1), 1):
            m.capture(b)
            after_each(n)
    capture_s = _build_and_upload(meter, build, lambda: [g.replay() for g in m.graphs.values()])
    pool = meter.torch["uploaded"] - meter.torch["state"]
    info = {"graphs": len(m.graphs), "capture_s": round(capture_s, 3), "pool_mib": _mib(pool),
            "torch_tf32": common.torch_tf32()}
    t = timing.bench_host(lambda: m.shrinking(prompt), warmup=cfg["warmup"], reps=cfg["reps"])
    built = len(m.graphs)
    m.close()
    return _result(meter, points, B, built, info, pool, t, None, B)


# ------------------------------------------------------------------------- driver bytes
def driver_probe(graphs: int, nodes: int) -> dict:
    """N graphs of K kernel nodes of a trivial kernel, each its own executable, uploaded
    (launched once): the drop in free memory, in this (fresh) process."""
    from proto.device.backend import jit
    from proto.graph import capture

    @jit("void(float32[::1])", writes=("x",))
    def bump(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 1.0

    def fn(x):
        for _ in range(nodes):
            backend.launch(bump, 1, 32, (x,))
    x = cuda.to_device(np.zeros(32, np.float32))
    meter = Meter()
    with capture(fn, {"x": x}, binding="alias", warmup=1, planned=False) as warm:   # kernels loaded, as before
        warm.replay(x=x)
    meter.read("state")
    # (unplanned: no temporaries, so no arena of their own either)
    built = [capture(fn, {"x": x}, binding="alias", warmup=0, planned=False)
             for _ in range(graphs)]
    for g in built:
        g.replay(x=x)
    meter.read("uploaded")
    taken = meter.drop("state", "uploaded")
    for g in built:
        g.close()
    return {"graphs": graphs, "nodes_per_graph": nodes, "graph_nodes": graphs * nodes,
            "taken_mib": _mib(taken)}


def fit_driver_bytes(probes: list[dict]) -> tuple[float, float] | None:
    """(bytes a graph, bytes a node) fitted by least squares to the probes' readings."""
    measured = [p for p in probes if p["taken_mib"] is not None]
    if len(measured) < 2:
        return None
    a = np.array([[p["graphs"], p["graph_nodes"]] for p in measured], float)
    b = np.array([p["taken_mib"] * MIB for p in measured])
    (per_graph, per_node), *_ = np.linalg.lstsq(a, b, rcond=None)
    return float(per_graph), float(per_node)


# ------------------------------------------------------------------------- run, summary, plot
def run(size: str = "toy") -> None:
    cfg = SIZES[size]
    has_torch = _torch() is not None
    probes = [isolate.run(f"{__name__}:driver_probe", {"graphs": n, "nodes": k})
              for n, k in common.progress(cfg["probe"], desc=f"{NAME} driver probe")]
    common.write_csv(f"{NAME}_driver", probes)
    fit = fit_driver_bytes(probes)
    rows, curve, tokens = [], [], {}
    jobs = [(model, m) for model in ("lstm", "gpt2") for m in METHODS
            if (has_torch or m.startswith("ours")) and not (model == "lstm" and m == "ours_device")]
    spec = [{"model": model, "method": method, "size": size} for model, method in jobs]
    if backend.SIMULATOR:   # nothing to meter: the children may run side by side
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
            outs = pool.map(lambda s: isolate.run(f"{__name__}:measure", s), spec)
    else:                   # one at a time: each reads the GPU's free memory
        outs = (isolate.run(f"{__name__}:measure", s) for s in spec)
    for (model, method), out in common.progress(zip(jobs, outs), desc=NAME, total=len(jobs)):
        row = {"model": model, "method": method, **out["row"]}
        if fit is not None and row.get("executable_nodes") is not None:
            row["driver_fit_mib"] = _mib(fit[0] * row["executables"]
                                         + fit[1] * row["executable_nodes"])
        rows.append(row)
        curve += [{"model": model, "method": method, "shapes_served": n, "graph_mib": b}
                  for n, b in out["curve"]]
        if out["tokens"] is not None:
            tokens[(model, method)] = out["tokens"]
        common.report(NAME, row)
        _save(rows, curve)
    want = tokens.get(("gpt2", "ours_planned"))
    for r in rows:
        got = tokens.get((r["model"], r["method"]))
        r["same_tokens"] = None if got is None or want is None else got == want
    _save(rows, curve)
    common.write_summary(NAME, summarize(rows, fit))


def _save(rows, curve) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    common.write_csv(NAME, [{k: r.get(k) for k in columns} for r in rows])
    common.write_csv(f"{NAME}_curve", curve or [{"model": None, "method": None,
                                                 "shapes_served": None, "graph_mib": None}])


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def summarize(rows: list[dict], fit) -> dict:
    by = {(r["model"], r["method"]): r for r in rows}

    def get(model, method, key):
        return by.get((model, method), {}).get(key)
    pt, ours = (by.get(("gpt2", m), {}) for m in HEADLINE)
    parts = None
    if ours.get("buffers_mib") is not None and ours.get("driver_fit_mib") is not None:
        parts = ours["buffers_mib"] + ours["driver_fit_mib"]
    planned = by.get(("gpt2", "ours_planned"), {})
    return {
        "model": "GPT-2 small, beam 5, prompt 5, every length to 1024 (full size)",
        "ptgraph_over_ours_memory": _ratio(pt.get("graph_mib"), ours.get("graph_mib")),
        "ptgraph_over_ours_device_memory": _ratio(pt.get("graph_mib"),
                                                  get("gpt2", "ours_device", "graph_mib")),
        "ptgraph_private_over_ours_memory": _ratio(get("gpt2", "ptgraph_private", "graph_mib"),
                                                   ours.get("graph_mib")),
        "ptgraph_graph_mib": pt.get("graph_mib"),
        "ours_graph_mib": ours.get("graph_mib"),
        "ours_device_graph_mib": get("gpt2", "ours_device", "graph_mib"),
        "ours_planned_graph_mib": planned.get("graph_mib"),
        "ours_unplanned_graph_mib": get("gpt2", "ours_unplanned", "graph_mib"),
        "ptgraph_private_graph_mib": get("gpt2", "ptgraph_private", "graph_mib"),
        "ptgraph_driver_mib": pt.get("driver_mib"),
        "ours_driver_mib": ours.get("driver_mib"),
        "ours_buffers_mib": ours.get("buffers_mib"),
        "ours_driver_fit_mib": ours.get("driver_fit_mib"),
        "memory_breakdown_complete": None if parts is None or ours.get("graph_mib") is None
        else abs(parts - ours["graph_mib"]) <= BREAKDOWN_SLACK_MIB,
        "driver_bytes_per_node": None if fit is None else round(fit[1], 1),
        "driver_bytes_per_graph": None if fit is None else round(fit[0], 1),
        "ours_second_kv_mib": ours.get("second_kv_mib"),
        "ours_total_footprint_mib": ours.get("footprint_mib"),
        "ptgraph_total_footprint_mib": pt.get("footprint_mib"),
        "ptgraph_memory_extrapolated": pt.get("extrapolated"),
        "planned_over_unplanned_time_per_token": _ratio(
            ours.get("sweep_ms_per_token"), get("gpt2", "ours_unplanned", "sweep_ms_per_token")),
        "ptgraph_ms_per_token": pt.get("ms_per_token"),
        "ours_ms_per_token": ours.get("ms_per_token"),
        "update_us_per_switch": ours.get("update_us_per_switch"),
        "arena_over_peak_live": _ratio(planned.get("arena_mib"), planned.get("peak_live_mib")),
        "lstm_ptgraph_over_ours_memory": _ratio(get("lstm", "ptgraph_shared_pool", "graph_mib"),
                                                get("lstm", "ours_planned_shared", "graph_mib")),
        "lstm_ours_planned_over_ptgraph_time_per_step": _ratio(
            get("lstm", "ours_planned", "ms_per_token"),
            get("lstm", "ptgraph_shared_pool", "ms_per_token")),
        "all_tokens_equal": all(r.get("same_tokens") in (True, None) for r in rows),
        "grape_reported_memory_ratio": GRAPE_REPORTED,
    }


def plot(device: str | None = None):
    rows = common.read_csv(NAME, device)
    curve = [r for r in common.read_csv(f"{NAME}_curve", device) if r["method"]]
    fig, axes = common.new_figure(rows, 2, 2, figsize=(13, 10),
                                  gridspec_kw={"width_ratios": [1.5, 1]})

    def num(v):
        return None if v in ("", "None", None) else float(v)

    def graph(r):   # (results from before the clean-process method called it memory_mib)
        return num(r.get("graph_mib", r.get("memory_mib")))
    for i, model in enumerate(("gpt2", "lstm")):
        ax, bars = axes[i]
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            pts = [(int(c["shapes_served"]), graph(c)) for c in curve
                   if c["model"] == model and c["method"] == r["method"]]
            pts = [(n, b) for n, b in pts if b is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, [max(y, FLOOR_MIB) for y in ys], marker="o", ms=3,
                    color=COLORS[r["method"]], label=r["method"].replace("_", " "))
            if r["extrapolated"] == "True":
                ax.plot([xs[-1], int(r["shapes_served"])], [ys[-1], graph(r)],
                        ls="--", color=COLORS[r["method"]], label="  (extrapolated)")
        ax.axhline(2, ls=":", lw=1, color="0.5",
                   label=f"2 MiB: the driver's step (a 0 read is drawn at {FLOOR_MIB})")
        ax.set_yscale("log")
        ax.set_xlabel("lengths served" if model == "gpt2" else "batch sizes served")
        ax.set_ylabel("GPU memory the graphs hold (MiB, log)")
        ax.set_title(f"{model.upper()}: graph memory against shapes served (each method in "
                     "its own process)", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
        # the parts at every shape served: buffers (pool, arena, private) and the driver's
        done = [r for r in mine if graph(r) is not None]
        if not done:   # (no free-memory readings: the simulator) what was measured: time
            ax.text(0.5, 0.5, "no free-memory readings on this device" if mine else
                    "not run", ha="center", va="center", transform=ax.transAxes, color="0.4")
            timed = [r for r in mine if num(r.get("ms_per_token")) is not None]
            bars.bar(range(len(timed)), [num(r["ms_per_token"]) for r in timed],
                     color=[COLORS[r["method"]] for r in timed])
            bars.set_xticks(range(len(timed)), [r["method"].replace("_", "\n", 1)
                                                for r in timed], fontsize=7)
            bars.set_ylabel("ms per token")
            bars.set_title("time per token (no memory readings here)", fontsize=9)
            continue
        names = [r["method"].replace("_", "\n", 1) for r in done]
        buf = [max(num(r.get("buffers_mib")) or graph(r), FLOOR_MIB) for r in done]
        drv = [max(num(r.get("driver_mib")) or 0.0, FLOOR_MIB) for r in done]
        x = np.arange(len(done))
        bars.bar(x, buf, color=[COLORS[r["method"]] for r in done], label="buffers")
        bars.bar(x, drv, bottom=buf, color=[COLORS[r["method"]] for r in done], alpha=0.4,
                 hatch="//", label="driver (executables, ...)")
        for j, r in enumerate(done):
            t = num(r["ms_per_token"])
            if t is not None:
                bars.text(j, buf[j] + drv[j], f"{t:.3g} ms", ha="center", va="bottom", fontsize=7)
        bars.set_yscale("log")
        bars.set_xticks(x, names, fontsize=7)
        bars.set_ylabel("MiB at every shape (log); label: ms per token")
        bars.set_title("graph memory by part", fontsize=9)
        if done:
            bars.legend(fontsize=7)
    return common.save_figure(fig, NAME, device)
