"""Wav2Vec2 CTC training with a graph pair per input length: ours on one memory tape, against
transformers' eager step and PtGraph's per-length graphs.

One epoch of synthetic TIMIT-like batches (experiments.timit: batch 8, audio up to 4 s,
length-grouped, about 119 distinct encoder lengths from 65 to 199 frames), wav2vec2-base
with random weights, AdamW (lr 1e-4, torch's defaults otherwise), float32. Each method runs
in a process of its own (experiments.isolate), on the same batches from the same weights:

  ours_eager       proto.models.wav2vec2.Wav2Vec2ForCTC.train_step, kernel by kernel;
  ours_unplanned   GraphedTraining, planned=False: per length a forward graph and a backward
                   graph (the step's two phases; CTC loss in the forward, AdamW in the
                   backward), every temporary in the graph's private memory;
  ours_planned     the same graphs with every length's temporaries on one memory tape (the
                   activations the backward reads kept from their forward write);
  hf_eager         transformers' Wav2Vec2ForCTC, forward with the attention mask, backward,
                   torch.optim.AdamW, float32 with TF32 off (cuDNN's default would
                   round the convolutions' products; the CSV's torch_tf32 says) (GPU only);
  hf_amp           the same under float16 autocast with a GradScaler (GPU only);
  ptgraph_private / ptgraph_shared   PtGraph: per length, the forward and backward up to the
                   logits as graphs (torch.cuda.make_graphed_callables), a private memory
                   pool each or one pool for all lengths; CTC loss and AdamW eager (GPU only).

Graphs of every length the epoch needs are captured before it starts, largest first (capture
time reported); gradients and AdamW's moments are allocated before the first memory reading
by every method. A step is timed from its host inputs as a data loader with pinned memory
hands them (collated, in page-locked host memory: transformers' Trainer's default; the
collation and pinning happen before the timer, as a loader does them beside the GPU's work)
to its loss read back, the copies to the device included. Per method: milliseconds per
step over the epoch after `warmup` steps (mean,
median, p10, p90), the epoch's seconds, the loss of every step, and the device memory it
holds beyond its weights, gradients and optimizer state once the epoch is done (free memory,
read in its own process, PyTorch's allocator emptied of blocks no graph pool holds), split
into buffers and executables where the method can tell them apart. Memory is also read
while capturing, at CURVE_POINTS counts of lengths served: memory against lengths served.
Each reading collects Python's garbage first, which takes longer the more objects a method
keeps, so its seconds (meter_s) are not counted as capture. A method that runs out of
memory while capturing reports how many lengths it served.

Two checks, each in a process of its own, right after the summary's three methods (ours
planned, transformers' eager, PtGraph's shared pool; the summary is rewritten as each method
or check ends, naming those not run yet): graphed and eager training give bit-identical
weights after a few steps (`check_bits`), and our loss equals transformers' float32 loss to
the float32 bound step by step, each pair computed from the same weights (`check_loss`;
the bound is twice transformers' float32 loss's largest distance from the same weights'
float64 loss over those steps;
free-running curves part within a few AdamW steps whatever the implementation; the summary
gives how far ours and PtGraph's part from transformers' eager curve as well).

    python -m experiments wav2vec2_train --size full
    python -m experiments wav2vec2_train --size full --methods check_bits,check_loss

`--methods` runs some of the methods and checks, keeping what an earlier run measured at
this commit on this device for the others: a GPU session too short for the epoch runs some,
a later one the rest. A ratio of two methods is taken only where both ran in one run (the
row's `date`; the summary's `runs`).
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from experiments import common, isolate, timit
from experiments.common import drop_mib, free_memory
from proto.device import backend
from proto.models import wav2vec2_config as w2c

NAME = "wav2vec2_train"
# The summary's pairs first (ours planned against transformers' eager step and PtGraph's
# shared pool), then the two checks (`HEADLINE` methods, then checks), so that a run the
# device's time cuts short keeps every figure the summary is judged by; the method that runs
# out of memory last.
METHODS = ["ours_planned", "hf_eager", "ptgraph_shared", "hf_amp", "ours_eager",
           "ptgraph_private", "ours_unplanned"]
HEADLINE = 3
CHECKS = ("check_bits", "check_loss")
TORCH_METHODS = ("hf_eager", "hf_amp", "ptgraph_shared", "ptgraph_private")
SIZES = {
    # (a simulated step of a one-layer model takes about 10 s: one step, timed from the first)
    "toy": dict(config=dataclasses.replace(w2c.TINY, layers=1), batch=1, steps=1, min_frames=3,
                max_frames=5, warmup=0, bits_steps=1, curve_steps=1),
    "full": dict(config=w2c.BASE, batch=8, steps=497, min_frames=65, max_frames=199,
                 warmup=10, bits_steps=5, curve_steps=20),
}
SEED = 0
CURVE_POINTS = 24   # memory readings while capturing, spread over the lengths served


def epoch(size: str) -> list[timit.Batch]:
    cfg = SIZES[size]
    return timit.synthetic_epoch(cfg["config"], steps=cfg["steps"], batch=cfg["batch"],
                                 seed=SEED, min_frames=cfg["min_frames"],
                                 max_frames=cfg["max_frames"])


def on_device(b: timit.Batch) -> tuple:
    """The batch's arrays on the device, in Wav2Vec2ForCTC.train_step's order."""
    return tuple(backend.cuda.to_device(np.ascontiguousarray(a))
                 for a in (b.waveform, b.frames, b.labels, b.label_lengths))


def _model():
    """The model on our kernels, imported where a method of ours runs: importing it loads
    them, which a process measuring transformers has no use for."""
    from proto.models import wav2vec2
    return wav2vec2


class _Ours:
    def __init__(self, method: str, cfg: dict, state: dict, max_label: int):
        w2v = _model()
        self.model = w2v.Wav2Vec2ForCTC(cfg["config"], state)
        # the loader's pinned staging of a waveform, reused: each step has copied it to the
        # device before the next is prepared (no pinned allocation or free inside a step)
        self.staging = backend.cuda.pinned_array(
            cfg["batch"] * cfg["config"].samples(cfg["max_frames"]), np.float32)
        self.g = None
        if method != "ours_eager":
            self.g = w2v.GraphedTraining(self.model, batch=cfg["batch"],
                                         max_frames=cfg["max_frames"], max_label=max_label,
                                         planned=method == "ours_planned")

    def build(self, lengths, after_each) -> None:
        if self.g is not None:
            self.g.build(lengths, after_each)

    def prepare(self, b: timit.Batch) -> timit.Batch:
        """The data loader's part of a step: the waveform in pinned host memory."""
        view = self.staging[:b.waveform.size].reshape(b.waveform.shape)
        view[:] = b.waveform
        return dataclasses.replace(b, waveform=view)

    def step(self, b: timit.Batch) -> float:
        if self.g is not None:
            return float(self.g.step(b).copy_to_host()[0])
        return float(self.model.train_step(*on_device(b)).copy_to_host()[0])

    def info(self) -> dict:
        if self.g is None:
            return {"graphs": 0}
        # host seconds of capture by phase, summed over the lengths (proto.graph.capture)
        phases = {p: round(sum(g.capture_s.get(p, 0.0) for g in self.g.graphs.values()), 2)
                  for p in ("record", "plan", "build")}
        return {"graphs": 2 * self.g.num_graphs,
                **{f"{p}_s": s for p, s in phases.items()},
                "arena_mib": round(self.g.arena_bytes / 2**20, 1),
                "private_mib": round(self.g.private_bytes / 2**20, 1),
                "executables_mib": None if self.g.memory_bytes is None else
                round(self.g.memory_bytes / 2**20, 1)}

    def close(self) -> None:
        if self.g is not None:
            self.g.close()


class _Torch:
    def __init__(self, method: str, cfg: dict, state: dict):
        from experiments import torch_wav2vec2 as tw
        import torch
        self.torch = torch
        if method != "hf_amp":   # float32 beside ours: no TF32 (cuDNN's default rounds convs)
            common.no_tf32()
        if method.startswith("hf"):
            self.t = tw.HFTrainer(cfg["config"], state, amp=method == "hf_amp")
        else:
            self.t = tw.PtGraphTrainer(cfg["config"], state, batch=cfg["batch"],
                                       pool=method.split("_")[1])
        self.reserved0 = torch.cuda.memory_reserved()

    def build(self, lengths, after_each) -> None:
        if hasattr(self.t, "build"):
            self.t.build(lengths, after_each)

    def prepare(self, b: timit.Batch):
        return self.t.prepare(b)

    def step(self, prepared) -> float:
        return self.t.step(prepared)

    def info(self) -> dict:
        graphs = getattr(self.t, "graphed", None)
        return {"graphs": 0 if graphs is None else 2 * len(graphs),
                "pool_mib": round((self.torch.cuda.memory_reserved() - self.reserved0) / 2**20, 1),
                "torch_tf32": common.torch_tf32()}

    def close(self) -> None:
        self.t.close()


COLUMNS = ("method", "layers", "hidden", "batch", "steps", "lengths", "lengths_served",
           "graphs", "capture_s", "meter_s", "record_s", "plan_s", "build_s", "epoch_s",
           "ms_per_step", "median_ms_per_step", "p10_ms_per_step", "p90_ms_per_step", "timed_steps", "state_mib", "kept_mib",
           "arena_mib", "private_mib", "executables_mib", "pool_mib", "torch_tf32", "error")


def measure(method: str, size: str) -> dict:
    """One method in this process: its row, the loss of every step, and its memory after
    each length's capture."""
    cfg = SIZES[size]
    config = cfg["config"]
    batches = epoch(size)
    lengths = sorted({b.length for b in batches}, reverse=True)
    max_label = max(b.labels.shape[1] for b in batches)
    state = w2c.random_state_dict(config, SEED)
    row = dict.fromkeys(COLUMNS) | {"method": method, "layers": config.layers,
                                    "hidden": config.hidden, "batch": cfg["batch"],
                                    "steps": len(batches), "lengths": len(lengths)}
    if method not in TORCH_METHODS:
        _model()   # (our kernels load here: their code stays out of the readings below)
    free0 = free_memory()
    m = _Torch(method, cfg, state) if method in TORCH_METHODS else _Ours(method, cfg, state, max_label)
    free_ready = free_memory()
    curve, meter_s, served = [], [], [0]
    # The memory curve's readings, at CURVE_POINTS counts of lengths served (the last among
    # them), each timed apart from the capture: a reading collects Python's garbage in full,
    # which takes longer the more objects the method keeps alive (on the H100, about 175 s
    # over the 119 lengths of ours, read after every length).
    readings = set(np.linspace(1, len(lengths), min(CURVE_POINTS, len(lengths)))
                   .round().astype(int).tolist())

    def after_each(n):
        served[0] = n
        if n in readings:
            t = time.perf_counter()
            curve.append((n, drop_mib(free_ready, free_memory())))
            meter_s.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    try:
        m.build(lengths, after_each)
    except Exception as exc:   # out of memory (PyTorch's or the driver's): how far it got
        if not any(w in str(exc).lower() for w in ("out of memory", "out_of_memory")):
            raise
        row.update(lengths_served=served[0], error=str(exc).splitlines()[0][:200],
                   state_mib=drop_mib(free0, free_ready), **m.info())
        return {"row": row, "losses": [], "steps": [], "curve": curve}
    capture_s = time.perf_counter() - t0 - sum(meter_s)
    losses, times = [], []
    for b in common.progress(batches, desc=method):
        inputs = m.prepare(b)             # (the data loader's part: before the step's timer)
        t = time.perf_counter()
        losses.append(m.step(inputs))     # (reads the loss: waits for the step)
        times.append(time.perf_counter() - t)
    free_kept = free_memory()
    timed = np.array(times[cfg["warmup"]:]) * 1e3
    row.update(lengths_served=len(lengths), capture_s=round(capture_s, 2),
               meter_s=round(sum(meter_s), 2),
               epoch_s=round(sum(times), 2), ms_per_step=round(float(timed.mean()), 3),
               median_ms_per_step=round(float(np.median(timed)), 3),
               p10_ms_per_step=round(float(np.percentile(timed, 10)), 3),
               p90_ms_per_step=round(float(np.percentile(timed, 90)), 3),
               timed_steps=len(timed), state_mib=drop_mib(free0, free_ready),
               kept_mib=drop_mib(free_ready, free_kept), **m.info())
    m.close()
    # each step's frames and time beside its loss: where a slow step falls in the epoch
    steps = [{"frames": b.length, "ms": round(t * 1e3, 3)} for b, t in zip(batches, times)]
    return {"row": row, "losses": losses, "steps": steps, "curve": curve}


def check_bits(size: str) -> dict:
    """Eager and planned graphed training from the same weights on the epoch's first steps:
    are the weights bit for bit the same after them?"""
    cfg = SIZES[size]
    batches = epoch(size)[:cfg["bits_steps"]]
    state = w2c.random_state_dict(cfg["config"], SEED)
    eager = _Ours("ours_eager", cfg, state, 0)
    for b in batches:
        eager.step(b)
    want = eager.model.params.to_host()
    eager = None
    graphed = _Ours("ours_planned", cfg, state, max(b.labels.shape[1] for b in batches))
    graphed.build(sorted({b.length for b in batches}, reverse=True), None)
    for b in batches:
        graphed.step(b)
    got = graphed.model.params.to_host()
    graphed.close()
    return {"steps": len(batches), "equal": all(np.array_equal(got[k], want[k]) for k in want)}


def check_loss(size: str) -> dict:
    """Our loss against transformers' float32 loss (TF32 off) step by step over the epoch's
    first `curve_steps` batches, each pair from ONE set of weights: transformers takes its
    step (its loss, then AdamW); ours, loaded with the weights transformers had before that
    step, computes its loss on the same batch. Two free-running curves cannot be held to a
    float32 bound: AdamW's first steps move every weight by about lr whatever its gradient's
    size, so a rounding-level difference in a near-zero gradient flips a move of 2 lr, and
    the curves part (transformers' own graphed and eager runs part by 2e-3 within 12 steps
    on the H200). The same weights' loss in float64 throughout (transformers' modules cast
    to float64, `torch_wav2vec2.exact_loss`) gives the exact loss each step, against which
    the float32 bound is measured (`summarize`). A GPU with PyTorch only."""
    from experiments import torch_wav2vec2 as tw
    common.no_tf32()
    cfg = SIZES[size]
    batches = epoch(size)[:cfg["curve_steps"]]
    state = w2c.random_state_dict(cfg["config"], SEED)
    ref = tw.HFTrainer(cfg["config"], state)
    exact = tw.exact_model(cfg["config"], state)
    ours = _model().Wav2Vec2ForCTC(cfg["config"], state)
    mine, theirs, exact_losses = [], [], []
    for b in batches:
        weights = ref.model.state_dict()
        ours.load_state_dict({k: v.detach().cpu().numpy() for k, v in weights.items()})
        exact.hf.load_state_dict(weights)   # (float32 values, exact in float64)
        mine.append(float(ours.train_step(*on_device(b), update=False).copy_to_host()[0]))
        exact_losses.append(tw.exact_loss(exact, cfg["config"], b))
        theirs.append(ref.step(ref.prepare(b)))
    return {"ours": mine, "reference": theirs, "exact": exact_losses}


def choices() -> list[str]:
    """What a run runs, in its order: the names `--methods` picks among (run's `methods`)."""
    return METHODS[:HEADLINE] + list(CHECKS) + METHODS[HEADLINE:]


def run(size: str = "toy", methods=None) -> None:
    """The methods and checks named (None: all, in `choices()`' order), each in its own
    process; what an earlier run measured at this commit on this device is kept for the
    others (rows, loss and memory curves, checks: results/<device>/wav2vec2_train_checks.json),
    so an epoch longer than a GPU session can be completed over several at one commit.
    Every row is stamped with its run's date: a ratio of two methods is taken only where
    both ran in one run."""
    chosen = [m for m in choices() if methods is None or m in methods]
    rows = common.rows_of_this_commit(NAME, chosen)
    curves = common.rows_of_this_commit(f"{NAME}_curve", chosen)
    steps = common.rows_of_this_commit(f"{NAME}_loss", chosen)
    losses = {r["method"]: [s["loss"] for s in steps if s["method"] == r["method"]]
              for r in rows}
    checks = {k: c for k, c in _stored_checks().items()
              if k not in chosen and common.of_this_commit(c)}
    unavailable = {}

    def measured(methods):
        nonlocal rows, curves, steps
        for method, result in isolate.each_method(NAME, methods, f"{__name__}:measure", size,
                                                  baselines=TORCH_METHODS,
                                                  unavailable=unavailable):
            common.report(NAME, result["row"])
            rows.append({**result["row"], "date": common.provenance()["date"]})
            losses[method] = result["losses"]
            curves.extend({"method": method, "lengths_served": n, "mib": mib}
                          for n, mib in result["curve"])
            steps.extend({"method": method, "step": i, "loss": loss, **at}
                         for i, (loss, at) in enumerate(zip(result["losses"], result["steps"])))
            rows, curves, steps = (_in_order(x) for x in (rows, curves, steps))
            # each method's rows as it ends, and the summary so far: a run cut short keeps them
            write_rows(rows, curves, steps)
            _write_summary(rows, losses, checks, unavailable, size)

    def check(name: str) -> None:   # (one that fails is ours failing: raised at the end)
        why = isolate.torch_missing() if name == "check_loss" else None   # (transformers')
        if why:
            unavailable[name] = why
            return
        result = isolate.attempt(NAME, name, f"{__name__}:{name}", {"size": size},
                                 unavailable, ours=True)
        if result is not None:
            checks[name] = {"result": result, **common.provenance()}
            common.write_json(f"{NAME}_checks", checks)

    measured([m for m in METHODS[:HEADLINE] if m in chosen])
    for name in CHECKS:
        if name in chosen:
            check(name)
    _write_summary(rows, losses, checks, unavailable, size)
    measured([m for m in METHODS[HEADLINE:] if m in chosen])
    isolate.raise_failures(NAME, unavailable)


def _stored_checks() -> dict:
    """The checks' results an earlier run stored ({check: {"result": ..., **provenance}})."""
    path = common.results_dir() / f"{NAME}_checks.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _in_order(rows: list[dict]) -> list[dict]:
    """Rows by their method's place in the run's order (a method's own rows as they came)."""
    return sorted(rows, key=lambda r: choices().index(r["method"]))


def _write_summary(rows: list[dict], losses: dict, checks: dict, unavailable: dict,
                   size: str) -> None:
    """The summary of what has run so far at this commit (once a method's row is among it;
    a ratio is None until ours_planned's, every ratio's denominator, is), naming the methods
    and checks not run yet."""
    if not rows:
        return
    done = {r["method"] for r in rows} | set(unavailable) | set(checks)
    result = {k: c["result"] for k, c in checks.items()}
    runs = common.runs(rows + [{"method": k, **c} for k, c in checks.items()])
    common.write_summary(NAME, {**summarize(rows, losses, result.get("check_bits"),
                                            result.get("check_loss"),
                                            SIZES[size]["curve_steps"]),
                                "runs": runs, "unavailable": unavailable,
                                "methods_not_run": [m for m in choices() if m not in done]})


def write_rows(rows: list[dict], curves: list[dict], steps: list[dict]) -> None:
    """The methods' rows, memory against lengths served, and every step's loss, frames and
    milliseconds (`{NAME}_loss`)."""
    common.write_csv(NAME, rows)
    if curves:
        common.write_csv(f"{NAME}_curve", curves)
    common.write_csv(f"{NAME}_loss", steps)


def _max_rel(a: list, ref: list, n: int) -> float | None:
    """The largest |a - ref| / |ref| over the first n steps (None: nothing to compare)."""
    n = min(n, len(a), len(ref))
    if n == 0:
        return None
    a, ref = np.array(a[:n]), np.array(ref[:n])
    return float(np.max(np.abs(a - ref) / np.abs(ref)))


def summarize(rows: list[dict], losses: dict, bits: dict | None, same_weights: dict | None,
              curve_steps: int) -> dict:
    """The figures from the rows and checks so far (a check not run yet: None)."""
    per = {r["method"]: r for r in rows}
    ours = per.get("ours_planned")   # (None: not run yet at this commit)

    def ratio(a, b, key):   # (only of two rows measured in one run: the same date)
        if a is None or b is None or a.get(key) in (None, "") or b.get(key) in (None, "") \
                or a.get("date") != b.get("date"):
            return None
        return round(float(a[key]) / float(b[key]), 3)
    # The float32 bound on two float32 losses of one batch and ONE set of weights: float32's
    # error at this depth and these lengths, E, measured as transformers' float32 loss's
    # largest relative distance from the float64 loss over the compared steps; two float32
    # losses each within E of the exact one agree within 2E.
    same = ref32_error = ours_error = None
    if same_weights:
        same = _max_rel(same_weights["ours"], same_weights["reference"], curve_steps)
        ref32_error = _max_rel(same_weights["reference"], same_weights["exact"], curve_steps)
        ours_error = _max_rel(same_weights["ours"], same_weights["exact"], curve_steps)
    n = min(curve_steps, len(same_weights["ours"])) if same_weights else 0
    ref = losses.get("hf_eager") or []
    return {
        "model": f"Wav2Vec2 ({rows[0]['layers']} layers, d {rows[0]['hidden']}), batch "
                 f"{rows[0]['batch']}, {rows[0]['steps']} steps, {rows[0]['lengths']} lengths, float32",
        "ms_per_step": {m: r["ms_per_step"] for m, r in per.items()},
        "eager_over_ours_step": ratio(per.get("hf_eager"), ours, "ms_per_step"),
        "amp_over_ours_step": ratio(per.get("hf_amp"), ours, "ms_per_step"),
        "ours_eager_over_planned_step": ratio(per.get("ours_eager"), ours, "ms_per_step"),
        "ptgraph_over_ours_memory": ratio(per.get("ptgraph_shared"), ours, "kept_mib"),
        "ptgraph_private_over_ours_memory": ratio(per.get("ptgraph_private"), ours, "kept_mib"),
        "unplanned_over_planned_memory": ratio(per.get("ours_unplanned"), ours, "kept_mib"),
        "kept_mib": {m: r["kept_mib"] for m, r in per.items()},
        "lengths_served": {m: r["lengths_served"] for m, r in per.items()},
        "loss_matches_reference": None if same is None else same <= 2 * ref32_error,
        "loss_steps_compared": n,
        "loss_same_weights_max_rel": same,
        "loss_float32_bound": None if same is None else 2 * ref32_error,
        "loss_reference_vs_float64_max_rel": ref32_error,
        "loss_ours_vs_float64_max_rel": ours_error,
        # the free-running curves over the same steps: ours and PtGraph's each against
        # transformers' eager float32 (PtGraph's: torch's own float32 spread)
        "loss_free_running_max_rel": _max_rel(losses.get("ours_planned") or [], ref, curve_steps),
        "ptgraph_loss_free_running_max_rel": _max_rel(losses.get("ptgraph_shared") or [], ref,
                                                      curve_steps),
        "graphed_equals_eager": bits["equal"] if bits else None,
        "graphed_equals_eager_steps": bits["steps"] if bits else 0,
    }


def plot():
    """Time per step by method; memory against lengths served; the loss curves."""
    rows = common.read_csv(NAME)
    fig, (ax, ax2, ax3) = common.new_figure(rows, 1, 3, figsize=(14, 4))
    timed = [r for r in rows if r.get("ms_per_step") not in (None, "")]
    bars = ax.bar(range(len(timed)), [float(r["ms_per_step"]) for r in timed],
                  color=[f"C{i}" for i in range(len(timed))])
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(timed)))
    ax.set_xticklabels([r["method"] for r in timed], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per training step (mean over the epoch)")
    ax.set_title(f"Wav2Vec2 training, batch {rows[0]['batch']}, float32", fontsize=9)
    curve = common.read_csv(f"{NAME}_curve") if (common.results_dir() / f"{NAME}_curve.csv").exists() else []
    for i, method in enumerate(dict.fromkeys(r["method"] for r in curve)):
        pts = [(int(r["lengths_served"]), float(r["mib"])) for r in curve
               if r["method"] == method and r["mib"] not in (None, "")]
        if pts:
            ax2.plot(*zip(*pts), label=method, color=f"C{i}")
    ax2.set_xlabel("lengths captured (largest first)")
    ax2.set_ylabel("device memory beyond the model's state (MiB)")
    ax2.set_title("memory of the graphs against lengths served", fontsize=9)
    if ax2.lines:
        ax2.legend(fontsize=7)
    else:   # (the simulator reads no device memory)
        ax2.text(0.5, 0.5, "no memory readings (simulator)", ha="center", transform=ax2.transAxes)
    loss = common.read_csv(f"{NAME}_loss")
    for i, method in enumerate(dict.fromkeys(r["method"] for r in loss)):
        pts = [(int(r["step"]), float(r["loss"])) for r in loss if r["method"] == method]
        ax3.plot(*zip(*pts), label=method, color=f"C{i}", lw=0.8, marker=".", ms=3)
    ax3.set_xlabel("step")
    ax3.set_ylabel("CTC loss")
    ax3.set_title("loss curves (same batches, same initial weights)", fontsize=9)
    ax3.legend(fontsize=7)
    return common.save_figure(fig, NAME)
