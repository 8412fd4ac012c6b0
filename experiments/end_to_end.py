"""End to end: time per generated token of GPT-2 beam search, eager against graphed.

Beam search (beam 5, prompt 5, no eos, so every run generates the same number of tokens)
with random GPT-2 weights, float32, two configurations, both generated to 1024 positions:
4 layers d=256 (4 heads) and GPT-2 small, 12 layers d=768 (12 heads); vocabulary 50257. Then
GPT-2 small in float16 (HALF_METHODS: ours, and transformers' generate in float16), whose
figures are the summary's gpt2_fp16_* keys.
Methods, all driving the same search (proto.models.generate.beam_search, whose log-softmax,
top-k and host choice of beams are identical for every method), except the WHILE graph:

  numba_eager         our kernels launched one by one (GPT2.step);
  graph_copy_exact    "PtGraph": one CUDA graph per length (position baked in), static
                      placeholders; every step copies the tokens and the reordered KV cache's
                      live prefix in (one driver call per array);
  graph_alias_device  Grape: the position in device memory (one graph per cache set serves
                      every length), alias binding: the beam gather writes the next graph's
                      placeholder, binding moves 0 bytes;
  graph_while         the whole search (steps, top-k, beam choice, reorder, stop test) in one
                      graph with a WHILE node (proto.models.search_loop.BeamLoop);
  torch_eager / torch_graph   the same model in plain PyTorch with a static KV cache, eager
                      and as one torch.cuda.CUDAGraph with inputs copied in
                      (experiments/torch_gpt2.py; GPU only);
  hf_generate / hf_compiled   Hugging Face's GPT2LMHeadModel and its own generate (beam 5,
                      no eos): eager with the default cache, what a user gets by default; and
                      torch.compile(mode="reduce-overhead") with the static cache, the
                      strongest a user would pick (experiments/hf_gpt2.py, in a process of
                      its own, PyTorch's alone; GPU only). Their
                      tokens are compared too; they can differ only at float32 near-ties.

Per method: a short warm-up generation (first-call costs), `reps` whole generations timed
end to end (-> the median ms per token, p10 and p90 in the CSV; 5 at full size), and one
more with every phase synchronized (-> input preparation, model, search per token; the
second figure). Graphs are all captured before timing
(largest first), and capture time and driver memory are recorded. After every setup's
generations, one child process (experiments/step_profile.py) times the decode step alone at
the middle position: our alias graph's replay, against the sum of its kernels' GPU times
and against PyTorch's CUDA-graphed steps: the graph of that length attending to the live
prefix (PtGraph in PyTorch, `ours_over_torch_graph_step`) and the one static-cache graph
whose attention spans every position, masked (`ours_over_torch_masked_graph_step`); and,
for the largest setup, the WHILE graph's kernels over one whole generation (per token,
who="ours_while" in the kernels CSV; where that fails the summary's `unavailable` says why):
what a token costs beyond a step, kernels or the graph's own overhead. Toy size: a tiny
model, 2 tokens, simulator.

    python -c "from experiments import end_to_end as e; e.run('full'); e.plot()"
    python -m experiments end_to_end --size full --setups 12L-d768-fp16

`--setups` runs some setups (`run(size, setups)`), keeping the rows of the others that an
earlier run measured at this commit on this device: a GPU session too short for the whole
run (up to 25 minutes) runs the float16 setup, another the two float32 ones, and the
summary is of them all. Its ratios each take two methods of one setup (one run).
"""
from __future__ import annotations

import time

import numpy as np

from experiments import common
from experiments.step_profile import step_spec, step_timings
from proto.device import backend, timing
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, KVCache, random_state_dict
from proto.models.graphed import GraphedDecoder
from proto.models.search_loop import BeamLoop

NAME = "end_to_end"
METHODS = ["numba_eager", "graph_copy_exact", "graph_alias_device", "graph_while", "torch_eager",
           "torch_graph", "hf_generate", "hf_compiled"]
# A float16 setup's methods: ours that the figures quote, and transformers' generate in
# float16 as a user calls it (the float32 setups carry the other comparisons)
HALF_METHODS = ["numba_eager", "graph_alias_device", "graph_while", "hf_generate"]
TOY = GPT2Config(1, 8, 2, 13, 8)
SMALL = GPT2Config(12, 768, 12, 50257, 1024)   # GPT-2 small
SIZES = {
    # (label, config, positions generated to, dtype); step: how the decode step alone is
    # timed (replays per sample: the host's checks overlap the GPU's work). The headline
    # figures are the last float32 setup's; the float16 one's are gpt2_fp16_*.
    # (a simulated generation takes seconds: the simulator's toy runs float32 alone, a GPU's
    # toy, the lane's, the float16 setup too, with the eager tokens and the WHILE graph)
    "toy": dict(setups=[("toy-1L-d8", TOY, 2, np.float32)]
                + ([] if backend.SIMULATOR else [("toy-1L-d8-fp16", TOY, 2, np.float16)]),
                beam=2, prompt_len=1, build_all=False, reps=2,
                step=dict(replays=1, warmup=1, reps=2, copy_bytes=1 << 16),
                half_methods=["numba_eager", "graph_while", "hf_generate"]),
    "full": dict(setups=[("4L-d256", GPT2Config(4, 256, 4, 50257, 1024), 1024, np.float32),
                         ("12L-d768", SMALL, 1024, np.float32),
                         ("12L-d768-fp16", SMALL, 1024, np.float16)],
                 beam=5, prompt_len=5, build_all=True, reps=5,
                 step=dict(replays=10, warmup=3, reps=20, copy_bytes=1 << 30)),
}


# ------------------------------------------------------------------------- methods
class _Method:
    """A way to run the search: `generate(prompt, new, timed)` -> generate.Generation."""

    def warmup(self, prompt, new: int) -> None:
        """Pay first-call costs (compilation, first launches) outside the timing."""
        self.generate(prompt, min(8, new), False)


class _Eager(_Method):
    def __init__(self, model, beam: int, max_len: int):
        self.model, self.beam = model, beam
        self.caches = tuple(KVCache(model.config, beam, max_len, dtype=model.dtype)
                            for _ in range(2))
        self.inputs = generate.DecodeInputs.allocate(beam)

    def generate(self, prompt, new: int, timed: bool):
        return generate.beam_search(self.model, prompt, beam=self.beam, max_new_tokens=new,
                                    caches=self.caches, inputs=self.inputs, timed=timed)

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        self.caches = ()


class _Graphed(_Method):
    def __init__(self, model, beam: int, max_len: int, binding: str, strategy: str,
                 build_all: bool):
        self.g = GraphedDecoder(model, batch=beam, max_len=max_len, binding=binding,
                             strategy=strategy, build_all=build_all)

    def generate(self, prompt, new: int, timed: bool):
        return self.g.beam_search(prompt, max_new_tokens=new, timed=timed)

    def info(self) -> dict:
        stats, memory = self.g.stats(), self.g.memory_bytes
        return {"graphs": self.g.num_graphs, "reorder_graphs": self.g.num_reorder_graphs,
                "graph_nodes": self.g.num_nodes,
                "graph_memory_mib": None if memory is None else round(memory / 2**20, 2),
                "bytes_copied_per_step": round(stats.bytes_copied / max(stats.replays, 1)),
                "bind_us_per_step": round(stats.bind_us_per_replay, 2)}

    def close(self) -> None:
        self.g.close()


class _While(_Method):
    """The whole search as one graph: a WHILE node on a device flag (proto.models.search_loop).
    It has no per-phase split: its one launch is all "model"."""

    def __init__(self, model, beam: int, max_len: int):
        self.loop = BeamLoop(model, beam=beam, max_len=max_len)

    def generate(self, prompt, new: int, timed: bool):
        if not timed:
            return self.loop.generate(prompt, max_new_tokens=new)
        t0 = time.perf_counter()
        gen = self.loop.generate(prompt, max_new_tokens=new)
        backend.synchronize()
        gen.times.model_s = time.perf_counter() - t0
        return gen

    def info(self) -> dict:
        return {"graphs": 1}

    def close(self) -> None:
        self.loop.close()


class _HF(_Method):
    """Hugging Face's generate: no phase split (all of a token's time counts as "model"),
    no score. A compiled model warms up on a whole generation: its static cache and CUDA
    graphs are shaped by the generation length."""

    def __init__(self, config, state_dict, beam: int, compiled: bool, dtype):
        from experiments.hf_gpt2 import HFChild   # its own process, as a user runs it
        # (a generation, compilation included, takes a few minutes at most; a child silent
        # for ten is stuck, and a device session cannot wait for it)
        self.search = HFChild(config, state_dict, beam=beam, compiled=compiled, timeout_s=600,
                              dtype=dtype)

    def warmup(self, prompt, new: int) -> None:
        self.search.generate(prompt, new if self.search.compiled else min(8, new))

    def generate(self, prompt, new: int, timed: bool):
        t0 = time.perf_counter()
        tokens = self.search.generate(prompt, new)
        times = generate.PhaseTimes(model_s=time.perf_counter() - t0, steps=new,
                                    synchronized=True)
        return generate.Generation(tokens, float("nan"), times)

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        self.search.close()


class _Torch(_Method):
    def __init__(self, config, state_dict, beam: int, max_len: int, graphed: bool):
        from experiments.torch_gpt2 import TorchDecoder
        self.dec = TorchDecoder(config, state_dict, batch=beam, max_len=max_len, graphed=graphed)

    def generate(self, prompt, new: int, timed: bool):
        return self.dec.beam_search(prompt, max_new_tokens=new, timed=timed)

    def info(self) -> dict:
        return {"graphs": 1} if self.dec.graphed else {}

    def close(self) -> None:
        self.dec.close()


def _torch_available() -> bool:
    if backend.SIMULATOR:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _methods(dtype=np.float32, half=HALF_METHODS) -> list[str]:
    """Ours always; PyTorch's on a GPU with torch; Hugging Face's where transformers is too;
    of a float16 setup, those of `half`."""
    methods = METHODS
    if not _torch_available():
        methods = METHODS[:4]
    else:
        try:
            import transformers  # noqa: F401
        except ImportError:
            methods = METHODS[:6]
    return methods if np.dtype(dtype) == np.float32 else [m for m in methods if m in half]


def _make(method: str, model, state_dict, beam: int, max_len: int, build_all: bool):
    if method == "numba_eager":
        return _Eager(model, beam, max_len)
    if method == "graph_copy_exact":
        return _Graphed(model, beam, max_len, "copy", "exact", build_all)
    if method == "graph_alias_device":
        return _Graphed(model, beam, max_len, "alias", "device", build_all)
    if method == "graph_while":
        return _While(model, beam, max_len)
    if method in ("hf_generate", "hf_compiled"):
        return _HF(model.config, state_dict, beam, compiled=method == "hf_compiled",
                   dtype=model.dtype)
    return _Torch(model.config, state_dict, beam, max_len, graphed=method == "torch_graph")


# ------------------------------------------------------------------------- run
def _measure(method: str, live: dict, model, state_dict, cfg: dict, max_len: int, prompt,
             new: int, want):
    """One method's row: built (into `live`, closed by the caller), warmed up, `reps` whole
    generations timed, then one with every phase synchronized. Returns (row, tokens); the
    row's same_tokens_as_eager compares with `want` (None: this method is the first)."""
    t0 = time.perf_counter()
    m = live[method] = _make(method, model, state_dict, cfg["beam"], max_len, cfg["build_all"])
    setup_s = time.perf_counter() - t0
    m.warmup(prompt, new)
    out = []
    t = timing.bench_host(lambda: out.append(m.generate(prompt, new, False)),
                          warmup=0, reps=cfg["reps"])
    steps = out[0].times.steps
    gen = m.generate(prompt, new, True)     # once more, every phase synchronized
    want = gen.tokens if want is None else want
    return {"tokens": gen.times.steps, "method": method,
            "ms_per_token": round(t.median_ms / steps, 4),
            "p10_ms_per_token": round(t.p10_ms / steps, 4),
            "p90_ms_per_token": round(t.p90_ms / steps, 4), "reps": t.reps,
            **{k: round(v, 4) for k, v in gen.times.per_token_ms().items()},
            "same_tokens_as_eager": all(np.array_equal(g.tokens, want) for g in (gen, *out)),
            "setup_s": round(setup_s, 3),
            **{k: None for k in ("graphs", "reorder_graphs", "graph_nodes", "graph_memory_mib",
                                 "bytes_copied_per_step", "bind_us_per_step")},
            **m.info()}, gen.tokens


def _failed_before(method: str, unavailable: dict) -> str | None:
    """Why `method` is not tried again: it failed for an earlier setup (the same software
    stack; hf_compiled took minutes of device time a setup to fail); None to try it."""
    earlier = next((key for key in unavailable if key.endswith(f"/{method}")), None)
    if earlier is None:
        return None
    return f"not tried: it failed for {earlier} ({unavailable[earlier]})"[:300]


def choices(size: str) -> list[str]:
    """The setups' labels at `size`, in the order a run runs them: what `--setups` picks
    among (run's `setups`)."""
    return [s[0] for s in SIZES[size]["setups"]]


def run(size: str = "toy", setups=None) -> None:
    """The setups named (labels of `size`; None: all, in SIZES' order), each setup's methods
    in this process, then every setup's decode step in one child (`step_timings`). The rows
    an earlier run measured at this commit on this device for this size's other setups are
    kept, in all three CSVs (common.rows_of_this_commit, by setup), so the three setups can
    run in different GPU sessions at one commit; the summary is of them all."""
    cfg = SIZES[size]
    labels = choices(size)
    if setups is not None and (not setups or set(setups) - set(labels)):
        raise ValueError(f"unknown {size} setup(s) {[s for s in setups if s not in labels]}; "
                         f"choose from {labels}")
    chosen = [s for s in cfg["setups"] if setups is None or s[0] in setups]
    others = [label for label in labels if label not in {s[0] for s in chosen}]
    beam, prompt_len = cfg["beam"], cfg["prompt_len"]
    # (rows of the other size's setups, which a toy run on the same card writes, are dropped)
    rows, step_rows, kernel_rows = (
        [r for r in common.rows_of_this_commit(name, exclude=[s[0] for s in chosen],
                                                key="setup", text=("kernel",))
         if r["setup"] in others] for name in (NAME, NAME + "_step", NAME + "_kernels"))
    kept_unavailable = _unavailable_of_this_commit(others)
    unavailable, step_specs = {}, []
    date = common.provenance()["date"]   # (stamped on this run's rows: see summarize)
    half = cfg.get("half_methods", HALF_METHODS)
    bar = common.progress(range(sum(len(_methods(s[3], half)) for s in chosen)), desc=NAME)
    last32 = [s[0] for s in cfg["setups"] if s[3] == np.float32][-1]
    for label, config, max_len, dtype in chosen:
        methods = _methods(dtype, half)
        state_dict = random_state_dict(config, seed=0)
        model = GPT2(config, state_dict, max_batch=beam, max_tokens=max(prompt_len - 1, 1),
                     dtype=dtype)
        if "torch_eager" in methods:
            from experiments.torch_gpt2 import check_logits
            torch_error = check_logits(model, state_dict)  # asserts: same model as ours
        prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len)
        new = max_len - prompt_len + 1  # the last token generated is never fed back
        live, want = {}, None
        for method in methods:
            why = _failed_before(method, unavailable)
            if why is not None:
                unavailable[f"{label}/{method}"] = why
                common.report(NAME, {"setup": label, "method": method, "unavailable": why})
                bar.update(1)
                continue
            try:
                row, tokens = _measure(method, live, model, state_dict, cfg, max_len, prompt, new,
                                       want)
            except Exception as exc:   # noqa: BLE001  only where the issue allows: see below
                if method != "hf_compiled":
                    raise
                # torch.compile depends on the machine's compiler stack and has crashed its
                # process here; where it fails, the row is left out and the summary says why,
                # rather than the run dying.
                why = unavailable[f"{label}/{method}"] = f"{type(exc).__name__}: {exc}"[:300]
                common.report(NAME, {"setup": label, "method": method, "unavailable": why})
                bar.update(1)
                continue
            want = tokens if want is None else want
            rows.append({"setup": label, "n_layer": config.n_layer, "n_embd": config.n_embd,
                         "dtype": np.dtype(dtype).name, "beam": beam, "prompt_len": prompt_len, "max_len": max_len, **row,
                         "torch_logit_error": round(torch_error, 8)
                         if "torch_eager" in methods else None})
            common.report(NAME, rows[-1])
            rows[-1]["date"] = date
            bar.update(1)
        for m in live.values():   # give their device memory back (the child runs at the end)
            m.close()
        # The largest setup also profiles the WHILE graph's kernels (the figure), after
        # its step: if that fails, only this breakdown is missing, and the summary says why.
        profile_while = "torch_graph" in methods and label == last32
        step_specs.append(step_spec(label, config, beam, prompt_len, max_len, max_len // 2,
                                    cfg["step"], use_torch="torch_graph" in methods, dtype=dtype,
                                    parts=("step", "while") if profile_while else ("step",),
                                    profile=_torch_available()))
        # Each setup's rows as it ends, and the summary so far: a run cut short (a session's
        # device time) keeps the generations it measured. The decode steps come after every
        # setup, in ONE child that compiles the kernels once for all of them, so a cut-short
        # run has none of its own (their CSVs keep the other setups' alone).
        _write(labels, last32, rows, step_rows, kernel_rows, {**kept_unavailable, **unavailable})
    bar.close()
    for spec, (row, kernels, failed) in zip(step_specs, step_timings(step_specs)):
        step_rows.append({**row, **{key: row.get(key) for key in (
            "while_kernel_sum_us_per_token", "while_kernels_per_token")}, "date": date})
        kernel_rows.extend({**k, "date": date} for k in kernels)
        if "while" in failed:
            unavailable[f"{spec['label']}/while_kernels"] = failed["while"]
            common.report(NAME, {"setup": spec["label"], "while_kernels": "unavailable"})
    _write(labels, last32, rows, step_rows, kernel_rows, {**kept_unavailable, **unavailable})


def _unavailable_of_this_commit(labels: list[str]) -> dict:
    """The summary's `unavailable` entries ("setup/what": why) of `labels`' setups, where the
    summary now stored is of this commit on this device: kept beside their setups' rows."""
    path = common.results_dir() / f"{NAME}.summary.json"
    if not path.exists():
        return {}
    old = common.read_summary(NAME)
    if not common.of_this_commit(old.get("provenance", {})):
        return {}
    return {k: why for k, why in old.get("unavailable", {}).items()
            if k.split("/")[0] in labels}


def _write(labels: list[str], headline: str, rows: list[dict], step_rows: list[dict],
           kernel_rows: list[dict], unavailable: dict) -> None:
    """The three CSVs, each in the setups' order (the first row has every column: float32's
    PyTorch figures come before float16's), and the summary of them all. A step or kernel
    CSV with no rows is removed: what it held was of another commit, or of a setup that this
    run measures again."""
    def ordered(rs):
        return sorted(rs, key=lambda r: labels.index(r["setup"]))
    for name, rs in ((NAME, rows), (NAME + "_step", step_rows),
                     (NAME + "_kernels", kernel_rows)):
        if rs:
            common.write_csv(name, ordered(rs))
        else:
            (common.results_dir() / f"{name}.csv").unlink(missing_ok=True)
    if rows:
        done = {r["setup"] for r in rows}
        common.write_summary(NAME, {
            **summarize(ordered(rows), ordered(step_rows), setup=headline),
            "unavailable": unavailable,
            "setups_not_run": [label for label in labels if label not in done]})


# The float32 setup's headline figures (README), None in a summary without its rows
HEADLINE_KEYS = ("step_over_bandwidth_floor", "ours_over_torch_graph_step",
                 "while_per_token_over_step", "hf_generate_over_ours_per_token")


def _same_run(a: dict, b: dict) -> bool:
    """Whether two rows were measured in one run (the date it stamped on them)."""
    return a.get("date") == b.get("date")


def summarize(rows: list[dict], step_rows: list[dict], setup: str | None = None) -> dict:
    """Headline figures for the float32 setup `setup` (None: the last float32 one among
    `rows`; a run names its size's last, the largest: GPT-2 small), every setup's time per
    token by method, which setups ran together (`runs`), and the float16 setup's figures as
    gpt2_fp16_* (`half_summary`).

    Every ratio here sets side by side two methods of ONE setup, which ran in one process in
    one run, or a setup's generations against its own decode step, which the same run's
    child timed (a run keeps or replaces a setup's rows in all three CSVs together, and a
    step row is taken only where its date is its setup's). No figure compares two setups
    (ms_per_token_by_setup lists each setup's times, no ratio of them), so rows of setups
    measured in different runs at one commit may share a summary."""
    label = setup if setup is not None else next(
        (r["setup"] for r in reversed(rows) if r.get("dtype", "float32") == "float32"), None)
    per = {r["method"]: r for r in rows if r["setup"] == label}
    by_setup = {s: {r["method"]: float(r["ms_per_token"]) for r in rows if r["setup"] == s}
                for s in dict.fromkeys(r["setup"] for r in rows)}
    if not per:   # (a run of other setups: the float16 one's figures alone)
        return {"setup": label, **dict.fromkeys(HEADLINE_KEYS),
                "ms_per_token_by_setup": by_setup, "runs": common.runs(rows, key="setup"),
                **half_summary(rows, step_rows)}
    copy, alias = per["graph_copy_exact"], per["graph_alias_device"]
    ms = {m: float(r["ms_per_token"]) for m, r in per.items()}
    summary = {
        "setup": label,
        **{f"{m}_ms_per_token": v for m, v in ms.items()},
        "eager_over_alias_per_token": ms["numba_eager"] / ms["graph_alias_device"],
        "copy_exact_over_alias_per_token": ms["graph_copy_exact"] / ms["graph_alias_device"],
        "alias_bytes_copied_per_step": int(alias["bytes_copied_per_step"]),
        "alias_binding_fraction_of_step": float(alias["bind_us_per_step"]) / 1e3
        / float(alias["model_ms"]),
        "copy_bytes_copied_per_step": int(copy["bytes_copied_per_step"]),
        "copy_exact_graphs": int(copy["graphs"]),
        "copy_exact_graph_memory_mib": copy["graph_memory_mib"],
        "alias_device_graphs": int(alias["graphs"]),
        "alias_device_graph_memory_mib": alias["graph_memory_mib"],
        "while_over_alias_per_token": ms["graph_while"] / ms["graph_alias_device"],
        "all_ours_same_tokens": all(per[m]["same_tokens_as_eager"] for m in
                                    ("graph_copy_exact", "graph_alias_device", "graph_while")),
        "graphed_step_over_kernel_sum": None,
        "ours_over_torch_graph_step": None,
    }
    for hf in ("hf_generate", "hf_compiled"):   # "ours": the whole search in one WHILE graph
        if hf in ms:
            summary[f"{hf}_over_ours_per_token"] = ms[hf] / ms["graph_while"]
            summary[f"{hf}_same_tokens"] = per[hf]["same_tokens_as_eager"]
    summary["ms_per_token_by_setup"] = by_setup
    summary["runs"] = common.runs(rows, key="setup")
    if "torch_graph" in ms:
        summary["torch_graph_over_alias_per_token"] = ms["torch_graph"] / ms["graph_alias_device"]
        summary["torch_eager_over_alias_per_token"] = ms["torch_eager"] / ms["graph_alias_device"]
    step = next((r for r in step_rows if r["setup"] == label and _same_run(r, alias)), None)
    if step is not None:
        summary["ours_step_us"] = float(step["ours_step_us"])
        summary["ours_step_p10_us"] = float(step["ours_step_p10_us"])
        summary["ours_step_p90_us"] = float(step["ours_step_p90_us"])
        summary["ours_graph_nodes_per_step"] = int(step["ours_graph_nodes"])
        if step.get("floor_us"):   # (rows from before the floor was measured lack it)
            summary.update(weight_bytes_per_step=int(step["weight_bytes"]),
                           kv_bytes_per_step=int(step["kv_bytes"]),
                           copy_bandwidth_GBps=float(step["copy_GBps"]),
                           bandwidth_floor_us=float(step["floor_us"]),
                           step_over_bandwidth_floor=float(step["ours_step_us"])
                           / float(step["floor_us"]))
        # a whole generation in one WHILE graph, per token, against one replayed step at the
        # middle position: what the search adds (top-k, beam choice, reorder, stop test)
        summary["while_per_token_over_step"] = ms["graph_while"] * 1e3 / float(step["ours_step_us"])
        if step.get("while_kernel_sum_us_per_token") is not None:
            # is the WHILE graph's excess over a step its kernels or the graph's own cost?
            summary["while_kernel_sum_us_per_token"] = float(step["while_kernel_sum_us_per_token"])
            summary["while_kernels_per_token"] = float(step["while_kernels_per_token"])
        if step.get("ours_kernel_sum_us") is not None:   # profiled (torch present)
            summary["ours_kernel_sum_us"] = float(step["ours_kernel_sum_us"])
            if float(step["ours_kernel_sum_us"]) > 0:
                summary["graphed_step_over_kernel_sum"] = \
                    float(step["ours_step_us"]) / float(step["ours_kernel_sum_us"])
        if step.get("torch_step_us") is not None:   # the live-prefix graph of this length
            summary["torch_graph_step_us"] = float(step["torch_step_us"])
            summary["torch_graph_kernel_sum_us"] = float(step["torch_kernel_sum_us"])
            summary["ours_over_torch_graph_step"] = \
                float(step["ours_step_us"]) / float(step["torch_step_us"])
        if step.get("torch_masked_step_us") is not None:   # one graph, full cache masked
            summary["torch_masked_graph_step_us"] = float(step["torch_masked_step_us"])
            summary["ours_over_torch_masked_graph_step"] = \
                float(step["ours_step_us"]) / float(step["torch_masked_step_us"])
    # (None where not measured: no step row yet, or no transformers)
    return {**summary, **{k: summary.get(k) for k in HEADLINE_KEYS},
            **half_summary(rows, step_rows)}


def half_summary(rows: list[dict], step_rows: list[dict]) -> dict:
    """The float16 setup's figures (none without one): its decode step against its bandwidth
    floor (float16 weights and KV cache at the copy rate), and transformers' float16
    generate against our WHILE graph, per token."""
    half = [r for r in rows if r.get("dtype") == "float16"]
    if not half:
        return {}
    label = half[-1]["setup"]
    ms = {r["method"]: float(r["ms_per_token"]) for r in half if r["setup"] == label}
    out = {"gpt2_fp16_setup": label,
           "gpt2_fp16_ms_per_token": ms,
           "gpt2_fp16_all_ours_same_tokens": all(
               r["same_tokens_as_eager"] in (True, "True") for r in half
               if r["setup"] == label and not r["method"].startswith("hf_"))}
    if "hf_generate" in ms:
        out["gpt2_fp16_hf_generate_over_ours_per_token"] = ms["hf_generate"] / ms["graph_while"]
    step = next((r for r in step_rows if r["setup"] == label and _same_run(r, half[-1])),
                None)
    if step is not None and step.get("floor_us"):
        out.update(gpt2_fp16_step_us=float(step["ours_step_us"]),
                   gpt2_fp16_bandwidth_floor_us=float(step["floor_us"]),
                   gpt2_fp16_step_over_bandwidth_floor=float(step["ours_step_us"])
                   / float(step["floor_us"]),
                   gpt2_fp16_graph_nodes_per_step=step.get("ours_graph_nodes"),
                   # (the step's kernels' own times summed, from its twin without early
                   # launch, where torch's profiler ran: end_to_end_kernels.csv has them)
                   gpt2_fp16_kernel_sum_us=step.get("ours_kernel_sum_us"))
    return out


# ------------------------------------------------------------------------- plot
COLORS = {"numba_eager": "C0", "graph_copy_exact": "C1", "graph_alias_device": "C2",
          "graph_while": "C4", "torch_eager": "C7", "torch_graph": "C3", "hf_generate": "C5",
          "hf_compiled": "C6"}
PHASES = [("prep_ms", "input preparation"), ("model_ms", "model step"), ("search_ms", "search")]


def _by_setup(rows):
    setups = list(dict.fromkeys(r["setup"] for r in rows))
    return setups, {s: [r for r in rows if r["setup"] == s] for s in setups}


def plot():
    """Figure 1: ms per generated token by method; figure 2 (end_to_end_phases): the same
    split into input preparation, model and search; figure 3 (end_to_end_while) where the
    WHILE graph was profiled. Returns figure 1's path."""
    from matplotlib import ticker
    rows = common.read_csv(NAME)
    setups, by = _by_setup(rows)
    steps = {r["setup"]: r for r in common.read_csv(NAME + "_step")} \
        if (common.results_dir() / f"{NAME}_step.csv").exists() else {}
    fig, axes = common.new_figure(rows, 1, len(setups), figsize=(5.5 * len(setups), 4.2),
                                  squeeze=False)
    for ax, setup in zip(axes[0], setups):
        mine = by[setup]
        step = steps.get(setup, {})
        # One replayed step at the middle position, and the bytes it must read at the copy
        # rate: what a token would cost if the search were free, and if the step were too.
        for key, style, label in (("ours_step_us", "-", "our step at the middle position"),
                                  ("floor_us", "--", "its bandwidth floor")):
            if step.get(key):
                ax.axhline(float(step[key]) / 1e3, color="k", linestyle=style, linewidth=0.8,
                           label=label)
        names = [r["method"] for r in mine]
        values = np.array([float(r["ms_per_token"]) for r in mine])
        spread = np.array([[values[i] - float(r["p10_ms_per_token"]),
                            float(r["p90_ms_per_token"]) - values[i]] for i, r in enumerate(mine)]).T
        bars = ax.bar(range(len(mine)), values, yerr=spread, capsize=3,
                      color=[COLORS[n] for n in names])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(mine)), [n.replace("_", "\n") for n in names], fontsize=8)
        ax.set_ylabel("ms per generated token (log scale)")
        # log: eager is 10-40x the graphed methods, whose bars and the step's floor would
        # otherwise sit flat on the axis
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(f"GPT-2 {setup}, beam {mine[0]['beam']}, to {mine[0]['max_len']} positions",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        if step.get("floor_us") or step.get("ours_step_us"):
            ax.legend(fontsize=7, loc="lower left")   # (the bars' values are at their tops)
    path = common.save_figure(fig, NAME)

    fig, axes = common.new_figure(rows, 1, len(setups), figsize=(5.5 * len(setups), 4.2),
                                  squeeze=False)
    for ax, setup in zip(axes[0], setups):
        mine = by[setup]
        bottom = np.zeros(len(mine))
        for (key, label), color in zip(PHASES, ("C9", "C2", "C4")):
            values = np.array([float(r[key]) for r in mine])
            ax.bar(range(len(mine)), values, bottom=bottom, label=label, color=color)
            bottom += values
        ax.set_xticks(range(len(mine)), [r["method"].replace("_", "\n") for r in mine],
                      fontsize=8)
        ax.set_ylabel("ms per token (phases synchronized)")
        ax.set_title(f"GPT-2 {setup}: where a token's time goes", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(fig, NAME + "_phases")
    _plot_while_kernels()
    return path


# Kernel families for the WHILE figure: the first substring a kernel's name contains.
FAMILIES = [("gemm_decode_nt", "head GEMM"), ("gemm_splitk_reduce", "split-K reduce + layer norm"),
            ("gemm", "layer GEMMs"), ("fused_mlp", "MLP (fused)"), ("mlp_sum", "MLP (fused)"),
            ("attention_combine", "attention combine"),
            ("attention", "attention"), ("embed", "embedding"), ("layernorm", "layer norm"),
            ("log_softmax", "beam top-k"), ("beam_topk", "beam top-k"),
            ("beam_choose", "beam choice"), ("beam_histories", "beam choice"),
            ("check_scores", "beam choice"), ("reorder_rows", "reorder"),
            ("gather_batch", "reorder"), ("set_if", "loop control"), ("_loop", "loop control"),
            ("reset_passes", "loop control"), ("scope", "loop control")]


def kernel_function(name: str) -> str:
    """A profiled kernel's own function name: its mangled or templated name without the
    namespaces, the specialisation and the argument list."""
    return name.split("[")[0].split("(")[0].split("::")[-1]


def kernel_family(name: str) -> str:
    """The family of a profiled kernel, by its function's own name (not its module's:
    kernels::attention:: also holds the reorder kernels)."""
    function = kernel_function(name)
    return next((family for key, family in FAMILIES if key in function), "other")


def _plot_while_kernels() -> None:
    """Figure 3 (end_to_end_while), where the WHILE graph was profiled: one step's kernels
    (replayed alone at the middle position) beside a WHILE token's (the mean over a whole
    generation), stacked by kernel family, with each one's measured time as a tick: what a
    token costs beyond a step, and how much of it no kernel accounts for."""
    path = common.results_dir() / f"{NAME}_kernels.csv"
    if not path.exists():
        return
    kernels = common.read_csv(NAME + "_kernels")
    setups = list(dict.fromkeys(r["setup"] for r in kernels if r["who"] == "ours_while"))
    if not setups:
        return
    steps = {r["setup"]: r for r in common.read_csv(NAME + "_step")}
    per_token = {(r["setup"], r["method"]): float(r["ms_per_token"]) * 1e3
                 for r in common.read_csv(NAME)}
    families = list(dict.fromkeys(f for _, f in FAMILIES)) + ["other"]
    import matplotlib   # (common.new_figure has loaded it)
    tab20 = matplotlib.colormaps["tab20"]
    fig, axes = common.new_figure(kernels, 1, len(setups), figsize=(7.5 * len(setups), 4.6),
                                  squeeze=False)
    for ax, setup in zip(axes[0], setups):
        step_us = steps.get(setup, {}).get("ours_step_us")
        walls = [float(step_us) if step_us else None, per_token.get((setup, "graph_while"))]
        for x, who in enumerate(("ours", "ours_while")):
            sums = dict.fromkeys(families, 0.0)
            for r in kernels:
                if r["setup"] == setup and r["who"] == who:
                    sums[kernel_family(r["kernel"])] += float(r["us_per_step"])
            bottom = 0.0
            for i, family in enumerate(families):
                if sums[family] > 0:
                    # tab20: eleven families, where the default cycle repeats after ten
                    ax.bar(x, sums[family], bottom=bottom, color=tab20(i % 20), label=family)
                    bottom += sums[family]
            if walls[x] is not None:
                ax.hlines(walls[x], x - 0.45, x + 0.45, color="k", linewidth=2,
                          label="measured time" if x == 0 else None)
                ax.annotate(f"{walls[x]:.0f} us measured, {bottom:.0f} us of kernels",
                            (x, walls[x]), textcoords="offset points", xytext=(0, 4),
                            ha="center", fontsize=7)
        # Both bars are kernels timed one after another (the step's in a graph without early
        # launch, the token's in the predicated twin's plain graphs); the lines are the
        # graphs as they run, where early launch overlaps neighbouring kernels.
        ax.set_xticks([0, 1], ["one step\n(replayed alone, middle position;\n"
                               "kernels timed without early launch)",
                               "WHILE graph, per token\n(mean over the generation;\n"
                               "kernels timed in the predicated twin)"], fontsize=8)
        ax.set_ylabel("us")
        ax.set_title(f"GPT-2 {setup}: a WHILE token against one step, by kernel", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))   # (each family once)
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="center left",
                  bbox_to_anchor=(1.0, 0.5))
        ax.margins(y=0.12)   # (room for the annotations above the ticks)
    common.save_figure(fig, NAME + "_while")
