"""GPT-J: beam search in float16, our graphs against Hugging Face's generate, and the decode
step against its bandwidth floor.

GPT-J-6B (28 layers, d 4096, 16 heads of 256, rotary on 64 dims of each, vocabulary 50400)
with random weights drawn on the device (proto.models.gptj.random_device_state_dict: 12 GB of
float16 that never cross the host), beam 5, prompt 5, no end-of-text token, generated to 1024
positions. Each method runs in a process of its own (experiments.isolate), so the memory it
reads is its own and no method inherits another's warm driver:

  ours_eager        GPTJ.step launched kernel by kernel under generate.beam_search;
  ours_per_length   Grape's per-length graphs: one per length and cache set (2 x 1020),
                    temporaries planned on one tape, 2 shared executables, alias binding;
  ours_device       the length read on the device: one graph per cache set serves every
                    length, alias binding;
  ours_while        the whole search in one WHILE graph (proto.models.search_loop.BeamLoop);
  ptgraph_step      PyTorch's step as PtGraph runs it (experiments.torch_gptj): the CUDA
                    graph of one length attending to its live prefix, float16 with tensor
                    cores, timed alone at position 512 against ours (GPU only);
  ptgraph_shared / ptgraph_private   PtGraph's whole generation: a graph per length (1020),
                    captured largest first into one shared pool or a private pool each,
                    tokens copied in, the beam reorder an eager gather of the live prefix
                    copied back (GPU only);
  hf_generate       transformers' GPTJForCausalLM in float16, loaded with the same device
                    weights (zero copy, through the CUDA array interface), searched by its own
                    generate(num_beams=5) with its default attention and cache, as a user calls
                    it (GPU only);
  hf_compiled       the same with transformers' recipe for fast decoding: its static cache
                    and the forward under torch.compile(mode="reduce-overhead") (GPU only).

Per method: a short warm-up generation, `reps` whole generations timed (median ms per token,
p10 and p90 in the CSV), their tokens against ours_eager's, build time and the device memory
it keeps beyond the weights once its generations are done (free memory read before and
after, in its own process, every graph by then replayed, PyTorch's allocator emptied of
blocks no graph pool holds), and of that what is not its KV caches (`graphs_mib`: pools or
arena, executables, the driver's; `gptj_ptgraph_over_ours_memory` compares PtGraph's shared
pool with our per-length graphs on it). The device-length graph's step is also timed alone at position 512 (`step`),
against its bandwidth floor: every weight and the live K and V read once at the device's
measured copy rate (`gptj_step_over_bandwidth_floor`).

PyTorch's methods run where PyTorch sees a GPU; one that fails is reported in the summary's
`unavailable` with its error, and the run goes on.
Toy size: a one-layer model, 4 tokens, on the simulator (timings mean nothing there).

    python -m experiments gptj --size full
    python -m experiments gptj --size full --methods ours_eager,ours_device,ptgraph_step

`--methods` runs some of them (`run(size, methods)`), keeping the rows of the others that an
earlier run measured at this commit on this device: a GPU session too short for all nine
runs some, a later one the rest, and the summary is of them all. A ratio of two methods
is taken only where both ran in one run (the row's `date`; the summary's `runs`).
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

from experiments import common, isolate
from experiments.common import drop_mib, free_memory
from proto.device import backend, timing
from proto.models import generate
from proto.models.gptj import GPTJ, GPTJ_6B, GPTJConfig, random_device_state_dict

NAME = "gptj"
# ours_eager first (every other method's tokens are compared with its), then the summary's
# pairs (the step against PtGraph's, the per-length graphs' memory against PtGraph's shared
# pool, transformers' generate against ours), so that a run cut short keeps them
METHODS = ["ours_eager", "ours_device", "ptgraph_step", "ours_per_length", "ptgraph_shared",
           "hf_generate", "ours_while", "hf_compiled", "ptgraph_private"]
TORCH_METHODS = ("ptgraph_step", "ptgraph_shared", "ptgraph_private", "hf_generate",
                 "hf_compiled")
# torch.compile's first generation compiles the 28-layer forward (and again for each shape
# it meets): held to 15 minutes, so that a compile that runs away costs its own row, not
# ptgraph_private's after it (the whole run takes about 25 minutes of a GPU session's 30)
TIMEOUTS = {"hf_compiled": 900}
SIZES = {
    # (a simulated GPT-J step takes seconds: the toy generates 2 tokens, once)
    "toy": dict(config=GPTJConfig(n_layer=1, n_embd=8, n_head=1, vocab_size=11,
                                  n_positions=8, rotary_dim=4),
                beam=2, prompt_len=2, max_len=3, reps=1, warmup_tokens=1, step_position=2,
                step=dict(warmup=0, reps=1), copy_bytes=1 << 16),
    "full": dict(config=GPTJ_6B, beam=5, prompt_len=5, max_len=1024, reps=5, warmup_tokens=8,
                 step_position=512, step=dict(warmup=3, reps=20), copy_bytes=1 << 30),
}
SEED = 0


INFO = ("graphs", "graph_nodes", "arena_mib", "cache_mib")   # (every row has these columns)


def _mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)


class _Ours:
    """One of our methods over a GPTJ model: `generate(prompt, new)` -> generate.Generation."""

    def __init__(self, method: str, model: GPTJ, beam: int, max_len: int):
        from proto.models.graphed import GraphedDecoder
        from proto.models.search_loop import BeamLoop
        self.method, self.model, self.beam = method, model, beam
        self.g = self.loop = None
        if method == "ours_per_length":
            self.g = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias",
                                    strategy="exact", shared_executables=2, build_all=True)
        elif method == "ours_device":
            self.g = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias",
                                    strategy="device", build_all=True)
        elif method == "ours_while":
            self.loop = BeamLoop(model, beam=beam, max_len=max_len)

    def generate(self, prompt, new: int):
        if self.g is not None:
            return self.g.beam_search(prompt, max_new_tokens=new)
        if self.loop is not None:
            return self.loop.generate(prompt, max_new_tokens=new)
        return generate.beam_search(self.model, prompt, beam=self.beam, max_new_tokens=new)

    def info(self) -> dict:
        if self.g is None:
            if self.loop is None:   # (the eager search's caches are freed by then)
                return {"graphs": 0, "cache_mib": 0.0}
            return {"graphs": 1, "cache_mib": _mib(self.loop.cache.data.nbytes)}
        return {"graphs": self.g.num_graphs, "graph_nodes": self.g.num_nodes,
                "arena_mib": round(self.g.arena_bytes / 2**20, 2),
                "cache_mib": _mib(self.g.cache_bytes)}

    def close(self) -> None:
        for owner in (self.g, self.loop):
            if owner is not None:
                owner.close()


class _PtGraph:
    """PtGraph's whole generation (experiments.torch_gptj.PerLengthGPTJ) on the same weights,
    every length's graph captured before anything is timed or read."""

    def __init__(self, cfg: dict, weights: dict, pool: str):
        import torch
        from experiments.torch_gptj import PerLengthGPTJ
        self.dec = PerLengthGPTJ(cfg["config"], {k: torch.as_tensor(v, device="cuda")
                                                 for k, v in weights.items()},
                                 batch=cfg["beam"], max_len=cfg["max_len"], pool=pool)
        for length in range(cfg["max_len"], cfg["prompt_len"] - 1, -1):   # largest first
            self.dec.capture(length)

    def generate(self, prompt, new: int):
        return self.dec.beam_search(prompt, max_new_tokens=new)

    def info(self) -> dict:
        model = self.dec.model
        return {"graphs": len(self.dec.graphs),
                "cache_mib": _mib(sum(t.numel() * t.element_size() for t in (model.k, model.v)))}

    def close(self) -> None:
        self.dec.close()


class _HF:
    """transformers' GPTJForCausalLM in float16 with the same weights, its own generate."""

    def __init__(self, config: GPTJConfig, state_dict: dict, beam: int, compiled: bool = False):
        import torch
        import transformers
        self.torch, self.beam, self.compiled = torch, beam, compiled
        hf_config = transformers.GPTJConfig(
            vocab_size=config.vocab_size, n_positions=config.n_positions,
            n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
            rotary_dim=config.rotary_dim, n_inner=config.n_inner,
            activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        torch.set_default_dtype(torch.float16)   # built in float16 on the GPU: no 24 GB stage
        try:
            with torch.device("cuda"):
                self.model = transformers.GPTJForCausalLM(hf_config)
        finally:
            torch.set_default_dtype(torch.float32)
        weights = {k: torch.as_tensor(v, device="cuda") for k, v in state_dict.items()}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        # (some versions keep each attention's causal mask as a buffer: no weight of ours)
        missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias"))]
        if missing or unexpected:
            raise ValueError(f"GPT-J weights: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.model.eval()
        if compiled:
            from experiments.hf_gpt2 import compile_for_decoding
            compile_for_decoding(self.model)

    def generate(self, prompt, new: int):
        from experiments.hf_gpt2 import beam_generate
        out = beam_generate(self.model, prompt, new, beam=self.beam, static_cache=self.compiled,
                            device="cuda")
        self.torch.cuda.synchronize()
        return generate.Generation(out[0].cpu().numpy(), float("nan"),
                                   generate.PhaseTimes(steps=new, synchronized=True))

    def info(self) -> dict:
        return {"cache_mib": 0.0}   # (its search's cache is freed by then)

    def close(self) -> None:
        self.model = None
        self.torch.cuda.empty_cache()


COLUMNS = ("method", "n_layer", "n_embd", "beam", "prompt_len", "max_len", "tokens",
           "ms_per_token", "p10_ms_per_token", "p90_ms_per_token", "reps", "setup_s",
           "weights_mib", "graphs_and_caches_mib", "graphs_mib", "copy_GBps",
           "same_tokens_every_run",
           *INFO, "step_position", "step_us", "step_p10_us", "step_p90_us", "step_read_bytes",
           "floor_us")


def _step_columns(position: int, t) -> dict:
    return {"step_position": position, "step_us": round(t.median_us, 2),
            "step_p10_us": round(t.p10_ms * 1e3, 2), "step_p90_us": round(t.p90_ms * 1e3, 2)}


def measure(method: str, size: str) -> dict:
    """One method in this process (experiments.isolate runs it in a fresh one): its row, and
    the tokens of its last generation (None for ptgraph_step, which times one step)."""
    cfg = SIZES[size]
    config, beam, max_len = cfg["config"], cfg["beam"], cfg["max_len"]
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, cfg["prompt_len"])
    new = max_len - cfg["prompt_len"] + 1   # the last token generated is never fed back
    copy_GBps = None if backend.SIMULATOR else timing.copy_bandwidth_GBps(
        cfg["copy_bytes"], **cfg["step"])
    row = dict.fromkeys(COLUMNS) | {
        "method": method, "n_layer": config.n_layer, "n_embd": config.n_embd, "beam": beam,
        "prompt_len": cfg["prompt_len"], "max_len": max_len,
        "copy_GBps": None if copy_GBps is None else round(copy_GBps, 1)}
    free_start = free_memory()
    weights = random_device_state_dict(config, SEED)
    t0 = time.perf_counter()
    if method == "ptgraph_step":
        return _ptgraph_step(cfg, weights, row, free_start, t0)
    if method.startswith("hf_"):
        m, model = _HF(config, weights, beam, compiled=method == "hf_compiled"), None
    elif method.startswith("ptgraph"):
        m, model = _PtGraph(cfg, weights, method.split("_")[1]), None
    else:
        model = GPTJ(config, weights, max_batch=beam, max_tokens=max(cfg["prompt_len"] - 1, 1))
    del weights   # (the model holds what it uses; q, k and v now live stacked in it)
    free_weights = free_memory()
    if model is not None:
        m = _Ours(method, model, beam, max_len)
    setup_s = time.perf_counter() - t0
    m.generate(prompt, min(cfg["warmup_tokens"], new))   # first-call costs (compilation,
    # first launches)
    out = []
    t = timing.bench_host(lambda: out.append(m.generate(prompt, new)), warmup=0,
                          reps=cfg["reps"])
    # What the method keeps once every method has run the same warm-up and generations (every
    # length's graph replayed: uploaded; a search's own caches, eager or transformers', freed;
    # PyTorch's allocator gives back the blocks no graph's pool holds: free_memory)
    free_kept = free_memory()
    row.update(tokens=new, ms_per_token=round(t.median_ms / new, 4),
               p10_ms_per_token=round(t.p10_ms / new, 4),
               p90_ms_per_token=round(t.p90_ms / new, 4), reps=t.reps,
               setup_s=round(setup_s, 3), weights_mib=drop_mib(free_start, free_weights),
               graphs_and_caches_mib=drop_mib(free_weights, free_kept),
               same_tokens_every_run=all(np.array_equal(g.tokens, out[0].tokens) for g in out),
               **m.info())
    # the graphs' own memory (pools or arena, executables, the driver's): what it keeps
    # beside its KV caches, which every method needs (ours with alias binding: two sets)
    if row["graphs_and_caches_mib"] is not None:
        row["graphs_mib"] = round(row["graphs_and_caches_mib"] - row["cache_mib"], 1)
    if method == "ours_device":   # the step alone at one position, against its floor
        step = timing.bench(m.g.replayer(cfg["step_position"]), **cfg["step"])
        weight_bytes, kv_bytes = model.decode_read_bytes(beam, cfg["step_position"] + 1)
        row.update(**_step_columns(cfg["step_position"], step),
                   step_read_bytes=weight_bytes + kv_bytes,
                   floor_us=None if copy_GBps is None else
                   round((weight_bytes + kv_bytes) / copy_GBps / 1e3, 2))
    m.close()
    return {"row": row, "tokens": out[-1].tokens.tolist()}


def _ptgraph_step(cfg: dict, weights: dict, row: dict, free_start, t0) -> dict:
    """PtGraph's step: experiments.torch_gptj on the same weights (viewed, not copied), the
    graph of length step_position + 1 captured (its memory read after capture) and replayed."""
    import torch
    from experiments.torch_gptj import TorchGPTJ
    config, beam, length = cfg["config"], cfg["beam"], cfg["step_position"] + 1
    dec = TorchGPTJ(config, {k: torch.as_tensor(v, device="cuda") for k, v in weights.items()},
                    batch=beam, max_len=cfg["max_len"])
    free_weights = free_memory()
    tokens = torch.zeros(beam, dtype=torch.int64, device="cuda")
    out = torch.empty(beam, config.vocab_size, dtype=dec.dtype, device="cuda")
    graph, _ = common.torch_cuda_graph(lambda: dec.decode_at(tokens, length, out))
    setup_s = time.perf_counter() - t0
    step = timing.bench(graph.replay, **cfg["step"])
    free_kept = free_memory()   # (after its replays, as the other methods' after their generations)
    row.update(setup_s=round(setup_s, 3), weights_mib=drop_mib(free_start, free_weights),
               graphs_and_caches_mib=drop_mib(free_weights, free_kept), graphs=1,
               **_step_columns(cfg["step_position"], step))
    return {"row": row, "tokens": None}


def choices() -> list[str]:
    """The names `--methods` picks among (run's `methods`), in the order a run runs them."""
    return METHODS


def run(size: str = "toy", methods=None) -> None:
    """The methods named (None: all, in METHODS' order), each in its own process; rows an
    earlier run measured at this commit on this device are kept for the other methods
    (common.rows_of_this_commit), so a run longer than a GPU session can be completed over
    several at one commit. Every row is stamped with its run's date: a ratio of two methods
    is taken only where both ran in one run."""
    methods = [m for m in METHODS if methods is None or m in methods]
    rows, unavailable = common.rows_of_this_commit(NAME, methods, text=("tokens_digest",)), {}
    for method, result in isolate.each_method(NAME, methods, f"{__name__}:measure", size,
                                              baselines=TORCH_METHODS, unavailable=unavailable,
                                              transformers=("hf_generate", "hf_compiled"),
                                              timeouts=TIMEOUTS):
        row = {**result["row"], "tokens_digest": tokens_digest(result["tokens"])}
        common.report(NAME, row)
        rows.append({**row, "date": common.provenance()["date"]})
        rows = same_tokens_as_eager(sorted(rows, key=lambda r: METHODS.index(r["method"])))
        # Each method's row as it ends, and the summary of those so far, saying which methods
        # have not run: a run the device's time cuts short (this experiment takes about 25
        # minutes) keeps what it measured and says what it did not
        common.write_csv(NAME, rows)
        _write_summary(rows, unavailable)
    _write_summary(rows, unavailable)   # (with the methods unavailable after the last row)
    isolate.raise_failures(NAME, unavailable)


def tokens_digest(tokens) -> str | None:
    """The first 16 hex digits of the sha256 of a generation's tokens as int32 (None: the
    method generates none): what a row keeps to compare its tokens with ours_eager's, which
    may have run in another process, another run, another session."""
    if tokens is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


def same_tokens_as_eager(rows: list[dict]) -> list[dict]:
    """The rows, each with `same_tokens_as_eager`: its tokens' digest against ours_eager's row,
    of this run or an earlier one at this commit (None: no ours_eager row yet, or no tokens)."""
    eager = next((r["tokens_digest"] for r in rows if r["method"] == "ours_eager"), None)
    return [{**r, "same_tokens_as_eager": None if eager is None or r["tokens_digest"] is None
             else r["tokens_digest"] == eager} for r in rows]


def _write_summary(rows: list[dict], unavailable: dict) -> None:
    """The summary of the methods measured so far at this commit (the step figures None
    until the device-length graph's row is among them: a run of some methods may come
    before it), naming those not run yet."""
    if rows:
        done = {r["method"] for r in rows} | set(unavailable)
        common.write_summary(NAME, {**summarize(rows), "unavailable": unavailable,
                                    "methods_not_run": [m for m in METHODS if m not in done]})


def _same_run(a: dict, b: dict) -> bool:
    """Whether two rows were measured in one run (the date it stamped on them): only those
    are set side by side, on one machine at one time, in a ratio."""
    return a.get("date") == b.get("date")


def summarize(rows: list[dict]) -> dict:
    per = {r["method"]: r for r in rows}
    ours = {m: float(r["ms_per_token"]) for m, r in per.items() if m.startswith("ours")}
    # Each per-token ratio is over the fastest of ours measured in the other method's run
    best = {m: min((o for o in ours if _same_run(per[o], per[m])), key=ours.get, default=None)
            for m in ("ptgraph_shared", "ptgraph_private", "hf_generate", "hf_compiled")
            if m in per}

    def over_ours(m: str, digits: int):
        if best.get(m) is None:
            return None
        return round(float(per[m]["ms_per_token"]) / ours[best[m]], digits)
    device = per.get("ours_device", {})
    floor = device.get("floor_us")
    hf, torch_step = per.get("hf_generate"), per.get("ptgraph_step")
    compiled = per.get("hf_compiled")
    ours_same = [r["same_tokens_as_eager"] for m, r in per.items() if m.startswith("ours")]
    return {
        "model": f"GPT-J ({rows[0]['n_layer']} layers, d {rows[0]['n_embd']}), beam "
                 f"{rows[0]['beam']}, prompt {rows[0]['prompt_len']}, to {rows[0]['max_len']} "
                 "positions, float16",
        "runs": common.runs(rows),
        "ms_per_token": {m: float(r["ms_per_token"]) for m, r in per.items()
                         if r["ms_per_token"] not in (None, "")},
        # PtGraph's whole generation against our best of its run (above 1: ours is faster)
        "gptj_ptgraph_over_ours_per_token": {
            m: over_ours(m, 3) for m in ("ptgraph_shared", "ptgraph_private") if m in per},
        # the method of ours each per-token ratio divides by (None: none ran in its run)
        "best_ours": best,
        "gptj_step_over_bandwidth_floor": None if not floor else
        round(float(device["step_us"]) / float(floor), 3),
        "gptj_step_us": float(device["step_us"]) if device else None,
        "gptj_floor_us": floor,
        "gptj_hf_generate_over_ours_per_token": over_ours("hf_generate", 2),
        "gptj_hf_compiled_over_ours_per_token": over_ours("hf_compiled", 2),
        # (the device-length graph's step against PtGraph's graph of that length)
        "gptj_ours_over_torch_graph_step": _ratio(per, "ours_device", "ptgraph_step", "step_us",
                                                  digits=3),
        "gptj_torch_graph_step_us": None if torch_step is None else float(torch_step["step_us"]),
        "graphs_and_caches_mib": {m: r["graphs_and_caches_mib"] for m, r in per.items()},
        "graphs_mib": {m: r["graphs_mib"] for m, r in per.items()},
        # PtGraph's per-length graphs in one shared pool over ours per length (planner, tape,
        # shared executables), each method in its own process, beside their KV caches
        "gptj_ptgraph_over_ours_memory": _ratio(per, "ptgraph_shared", "ours_per_length",
                                                "graphs_mib"),
        # (None until ours_eager's row, which every other method's tokens are compared with)
        "gptj_all_tokens_equal": None if None in ours_same else all(ours_same),
        "gptj_decode_gemm_min_fraction_of_bandwidth": _kernel_speed_figure(),
        # ours run the same kernels on the same weights; transformers' float16 GEMMs round
        # other sums, so its tokens may part from ours at a near-tie (reported, not required)
        "hf_tokens_equal": None if hf is None else hf["same_tokens_as_eager"],
        "hf_compiled_tokens_equal": None if compiled is None else compiled["same_tokens_as_eager"],
    }


def _ratio(per: dict, num: str, den: str, key: str, digits: int = 2):
    """per[num][key] over per[den][key], where both were measured in one run (else None)."""
    if num not in per or den not in per or not _same_run(per[num], per[den]):
        return None
    a, b = per[num].get(key), per[den].get(key)
    return None if a in (None, "") or b in (None, "") or float(b) <= 0 else \
        round(float(a) / float(b), digits)


def _kernel_speed_figure():
    """kernel_speed's slowest GPT-J decode GEMM as a share of copy bandwidth, where that
    experiment ran on this device at this run's commit (None otherwise: run it too)."""
    try:
        ks = common.read_summary("kernel_speed")
    except (FileNotFoundError, ValueError):
        return None
    same = ks.get("provenance", {}).get("git_commit") == common.provenance()["git_commit"]
    return ks.get("gptj_decode_gemm_min_fraction_of_bandwidth") if same else None


def plot():
    """Time per token by method (bars), and the device-length step against its floor."""
    rows = common.read_csv(NAME)
    fig, (ax, ax2) = common.new_figure(rows, 1, 2, figsize=(10, 4))
    timed = [r for r in rows if r["ms_per_token"] not in (None, "")]
    methods = [r["method"] for r in timed]
    ms = [float(r["ms_per_token"]) for r in timed]
    bars = ax.bar(range(len(timed)), ms, color=[f"C{i}" for i in range(len(timed))])
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(timed)))
    ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per generated token (median)")
    ax.set_title(f"GPT-J beam {rows[0]['beam']}, float16, to {rows[0]['max_len']} positions",
                 fontsize=9)
    # (a run of some methods at this commit may have either step row, or neither, so far)
    device, torch_step = (next((r for r in rows if r["method"] == m), None)
                          for m in ("ours_device", "ptgraph_step"))
    parts = []
    if device is not None:
        parts.append(("ours (device graph)", device["step_us"], "C2"))
    if torch_step is not None:
        parts.append(("PtGraph (fp16, cuBLAS)", torch_step["step_us"], "C1"))
    if device is not None and device.get("floor_us") not in (None, ""):
        parts.append(("bandwidth floor", device["floor_us"], "grey"))
    bars = ax2.bar(range(len(parts)), [float(v) for _, v, _ in parts],
                   color=[c for _, _, c in parts])
    ax2.bar_label(bars, fmt="%.0f", fontsize=7)
    ax2.set_xticks(range(len(parts)))
    ax2.set_xticklabels([p for p, _, _ in parts], fontsize=8)
    position = next((r["step_position"] for r in (device, torch_step) if r), "")
    ax2.set_ylabel(f"us at position {position}")
    ax2.set_title("decode step: ours, PtGraph's, and weights + live KV at copy rate",
                  fontsize=9)
    return common.save_figure(fig, NAME)
