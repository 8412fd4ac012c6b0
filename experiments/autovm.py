"""AutoVM: VGG training step time against a device-memory budget, per memory policy.

Budgets are fractions of the unconstrained step's peak (liveness-based, every tensor freed
after its last use). Policies, each running the same VGG tape (proto.models.vgg):
  unconstrained     everything resident; the step-time floor
  paging            the demand-paging baseline (proto.vm.paging): managed memory, 2 MiB
                    pages pushed out LRU when the budget is reached, faulted back by kernels
  autovm            the AutoVM schedule (proto.vm.plan), timed with op times profiled
                    from the unconstrained step and the measured pinned-link bandwidth
  autovm_recompute  the same, recomputing cheap activations where the link is the bottleneck
  autovm_graph      (GPU) the AutoVM schedule's whole step, compute and both copy streams,
                    captured as one CUDA graph (Executor.capture): one launch per step
  autovm_managed    the AutoVM schedule on managed memory (proto.vm.managed): one unified
                    arena, evictions and prefetches as cuMemPrefetchAsync on the copy streams,
                    planned with the measured prefetch rates and no host copies (every tensor
                    that leaves is copied), the budget counted in pages (re-planned under
                    fewer bytes where the plan would not fit in pages: plan_for_pages); eager,
                    a prefetch has no graph node
  autovm_managed_recompute   the same, recomputing cheap activations where the link is the
                    bottleneck (managed pages leave at a fraction of the pinned rate)
  torch, torch_save_on_cpu   (GPU) torchvision's VGG with the same weights, plainly and
                    under torch.autograd.graph.save_on_cpu(pin_memory=True): an outside anchor
The host-link bound of a budget is max(unconstrained step, time the AutoVM plan's copies
need at the measured pinned bandwidth): no schedule that moves those bytes can beat it.
Every policy's loss and gradients after one step from the same state are compared with the
unconstrained run's, bit for bit: every kernel is deterministic (the conv weight gradient
sums its split reduction in a fixed order, no atomics), so a memory policy that leaves the
math alone gives identical bits, on the simulator and on the GPU. `noise_rel_diff` is the
difference between two unconstrained runs (0 unless a kernel is not deterministic).

Sizes: full = VGG-16 and VGG-19 at the paper's 224x224, batch 256 (unconstrained peak 16.1
and 17.4 GiB: parameters, gradients and momentum are a small part, so what moves is
activations, whose copies overlap compute), the first block in four micro-batches of 64
(every policy, the unconstrained step included, runs that same tape); toy = a tiny VGG-11 on the simulator
whose ops run their kernels' NumPy references (vgg.build_tape(host_math=True): the same
tape and tensors; the simulated conv kernels would take a minute per step). Host
math cannot be recorded into a graph, so the toy run has no autovm_graph rows; the tests check
graphed steps on the simulator with device kernels.

    python -c "from experiments import autovm; autovm.run('full'); autovm.plot()"
"""
from __future__ import annotations

import sys
import time

import numpy as np

from experiments import common
from proto.device import backend, timing
from proto.models import vgg
from proto.vm import (BudgetError, Executor, Liveness, Link, ManagedExecutor, PagingExecutor,
                      estimate_seconds, measure_link, plan, plan_for_pages)

NAME = "autovm"
POLICIES = ["unconstrained", "paging", "autovm", "autovm_recompute", "autovm_graph",
            "autovm_managed", "autovm_managed_recompute", "torch", "torch_save_on_cpu"]
CHECKED = POLICIES[1:7]   # our policies: their results must equal the unconstrained run's
SIZES = {
    "toy": {"depths": [11], "fracs": [1.0, 0.5], "page_bytes": 4096, "host_math": True,
            "config": dict(width=1 / 16, image_size=32, batch=2, num_classes=10, hidden=32,
                           front_splits=2),
            "reps": 1},
    "full": {"depths": [16, 19], "fracs": [1.0, 0.75, 0.5, 0.35], "page_bytes": 2 << 20,
             # Winograd where both channel counts reach 128 (conv2_2 on; VGGConfig's
             # default threshold; kernel_speed times each stage against direct)
             # The first block in 4 micro-batches of 64 images (vgg's module doc): its 6.6 GB
             # of activations then leave and return in quarters
             "host_math": False, "config": dict(width=1.0, image_size=224, batch=256,
                                                convolution="winograd", front_splits=4),
             "reps": 5},
}
HEADLINE_DEPTH = {"toy": 11, "full": 19}
HEADLINE_FRAC = 0.5


# ---------------------------------------------------------------------------- measuring
def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    S = cfg.image_size
    return (rng.standard_normal((cfg.batch, 3, S, S)).astype(np.float32),
            rng.integers(0, cfg.num_classes, cfg.batch).astype(np.int32))


def _rel_diff(got: dict, want: dict) -> float:
    """Largest |got - want| over every tensor, relative to that tensor's largest magnitude."""
    worst = 0.0
    for name, w in want.items():
        scale = max(float(np.abs(w).max()), 1e-30)
        worst = max(worst, float(np.abs(got[name].astype(np.float64) - w).max()) / scale)
    return worst


class _Case:
    """One model: its tape, starting state, and the unconstrained results to compare with."""

    def __init__(self, depth: int, size: str):
        spec = SIZES[size]
        self.cfg = vgg.VGGConfig(depth=depth, **spec["config"])
        self.tape = vgg.build_tape(self.cfg, host_math=spec["host_math"])
        self.live = Liveness(self.tape)
        # which layers the convolution setting gave Winograd's kernels (its workspaces name them)
        self.winograd_layers = len({op.layer for op in self.tape.ops
                                    if any(n.endswith("_winograd") for n in op.writes)})
        self.state = vgg.random_state_dict(self.cfg, seed=depth)
        self.images, self.labels = _batch(self.cfg, seed=depth)
        self.init = vgg.initial_values(self.cfg, self.state, self.images, self.labels)
        self.checked = ["loss"] + [f"{p}.grad" for p in vgg.param_shapes(self.cfg)]
        self.pinned: dict = {}      # host buffers shared by every executor of this tape
        self.spec = spec
        self.ref: dict | None = None
        self.noise = 0.0

    def check(self, ex) -> dict:
        """Load the starting state, run one step, read the loss and every gradient."""
        ex.load(self.init)
        ex.step()
        return ex.read_many(self.checked)

    def time_steps(self, ex, warmup: int = 0 if backend.SIMULATOR else 1) -> timing.Timing:
        return timing.bench_host(ex.step, warmup=warmup, reps=self.spec["reps"])

    def measure(self, ex) -> tuple[timing.Timing, dict]:
        got = self.check(ex)
        return self.time_steps(ex), got

    def row(self, policy, frac, t: timing.Timing | None, got: dict | None, **extra) -> dict:
        row = {"model": f"vgg{self.cfg.depth}", "convolution": self.cfg.convolution,
               "winograd_layers": self.winograd_layers,
               "policy": policy,
               "budget_frac": "" if frac is None else frac,
               "budget_bytes": "" if frac is None else int(frac * self.live.peak),
               "peak_bytes": self.live.peak,
               "step_ms": float("nan") if t is None else round(t.median_ms, 3),
               "p10_ms": float("nan") if t is None else round(t.p10_ms, 3),
               "p90_ms": float("nan") if t is None else round(t.p90_ms, 3),
               "reps": 0 if t is None else t.reps,
               # launchers' own scratch so far (gemm's split-K partials): outside the budget
               "kernel_scratch_bytes": backend.scratch_bytes()}
        if got is not None:
            row.update(loss=float(got["loss"][0]), noise_rel_diff=self.noise)
        if got is not None and self.ref is not None and got is not self.ref:   # not itself
            row.update(loss_equal=bool(np.array_equal(got["loss"], self.ref["loss"])),
                       grads_equal=all(np.array_equal(got[k], self.ref[k]) for k in self.ref),
                       max_rel_diff=_rel_diff(got, self.ref))
        return {**row, **extra}


def _unconstrained(case: _Case) -> tuple[dict, list[float]]:
    with Executor(case.tape, plan(case.tape)) as ex:
        t, got = case.measure(ex)
        case.ref = got
        if not backend.SIMULATOR:   # run-to-run spread of the kernels themselves
            case.noise = _rel_diff(case.check(ex), got)
        ex.load(case.init)
        seconds = ex.profile_ops()
    return case.row("unconstrained", None, t, got, arena_bytes=ex.plan.arena_bytes), seconds


def _paging(case: _Case, frac: float) -> dict:
    budget = int(frac * case.live.peak)
    with PagingExecutor(case.tape, budget, page_bytes=case.spec["page_bytes"]) as ex:
        got = case.check(ex)
        # The check's reads left every page on the host (host I/O resets residency): one
        # untimed step faults the working set back, so the counts below are the timed steps'.
        ex.step()
        before = ex.moved_bytes()
        t = case.time_steps(ex, warmup=0)
        moved = [b - a for a, b in zip(before, ex.moved_bytes())]
        return case.row("paging", frac, t, got, evicted_bytes_per_step=moved[0] // t.reps,
                        faulted_bytes_per_step=moved[1] // t.reps, arena_bytes=ex.plan.arena_bytes)


def _autovm(case: _Case, policy: str, frac: float, seconds, link: Link) -> dict:
    budget = int(frac * case.live.peak)
    t0 = time.perf_counter()
    p = plan(case.tape, budget, op_seconds=seconds, link=link, recompute=policy == "autovm_recompute")
    planning = time.perf_counter() - t0
    with Executor(case.tape, p, pinned=case.pinned) as ex:
        extra = {}
        if policy == "autovm_graph":
            ex.load(case.init)   # the capture's warm-up step reads the state
            t0 = time.perf_counter()
            desc = ex.capture()
            extra = {"graph_nodes": len(desc), "capture_seconds": round(time.perf_counter() - t0, 3)}
        t, got = case.measure(ex)
    unconstrained_ms = sum(seconds) * 1e3
    link_ms = p.link_seconds(link) * 1e3
    return case.row(policy, frac, t, got, **extra,
                    arena_bytes=p.arena_bytes, planned_peak_bytes=p.peak_bytes,
                    d2h_bytes=p.d2h_bytes, h2d_bytes=p.h2d_bytes, offloaded=len(p.offloaded),
                    recomputed=len(p.recomputed), homed=len(p.homed),
                    link_ms=round(link_ms, 3), plan_seconds=round(planning, 3),
                    estimated_ms=round(estimate_seconds(case.tape, p, seconds, link) * 1e3, 3),
                    profiled_compute_ms=round(unconstrained_ms, 3))


def _autovm_managed(case: _Case, policy: str, frac: float, seconds, link: Link) -> dict:
    budget, page = int(frac * case.live.peak), case.spec["page_bytes"]
    t0 = time.perf_counter()
    p = plan_for_pages(case.tape, budget, page_bytes=page, op_seconds=seconds, link=link,
                       recompute=policy == "autovm_managed_recompute")
    planning = time.perf_counter() - t0
    with ManagedExecutor(case.tape, p, budget=budget, page_bytes=page) as ex:
        t, got = case.measure(ex)
        pages = dict(peak_pages=ex.peak_pages, max_pages=ex.max_pages, page_bytes=page,
                     arena_bytes=ex.layout.arena_bytes)
    return case.row(policy, frac, t, got, **pages, planned_budget_bytes=p.budget,
                    planned_peak_bytes=p.peak_bytes, d2h_bytes=p.d2h_bytes,
                    h2d_bytes=p.h2d_bytes, offloaded=len(p.offloaded),
                    recomputed=len(p.recomputed), homed=len(p.homed),
                    link_ms=round(p.link_seconds(link) * 1e3, 3), plan_seconds=round(planning, 3),
                    estimated_ms=round(estimate_seconds(case.tape, p, seconds, link) * 1e3, 3))


def _torch(case: _Case) -> list[dict]:
    """torchvision's VGG with our weights, plainly and with activations saved on the host."""
    try:
        import torch
        import torchvision
    except ImportError:
        return []
    if backend.SIMULATOR or not torch.cuda.is_available() or case.cfg.width != 1.0:
        return []
    nn = torch.nn
    common.no_tf32()   # float32 math, as our kernels
    cfg = case.cfg
    side, hidden = cfg.image_size // 32, cfg.hidden or vgg.HIDDEN
    x = torch.from_numpy(case.images).cuda()
    y = torch.from_numpy(case.labels.astype(np.int64)).cuda()
    model = getattr(torchvision.models, f"vgg{cfg.depth}")()
    model.avgpool = nn.Identity()                  # the tape's classifier reads the flat map
    model.classifier = nn.Sequential(
        nn.Linear(512 * side * side, hidden), nn.ReLU(True), nn.Dropout(0.0),
        nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(0.0), nn.Linear(hidden, cfg.num_classes))
    model.cuda().train()
    rows = []
    for policy in ("torch", "torch_save_on_cpu"):
        model.load_state_dict({k: torch.from_numpy(v) for k, v in case.state.items()})
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay)
        offload = policy == "torch_save_on_cpu"

        def step():
            opt.zero_grad(set_to_none=False)
            if offload:
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = nn.functional.cross_entropy(model(x), y)
            else:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        torch.cuda.reset_peak_memory_stats()
        loss = step().detach().cpu().numpy().reshape(1)
        got = {"loss": loss, **{f"{k}.grad": p.grad.detach().cpu().numpy()
                                for k, p in model.named_parameters()}}
        t = timing.bench_host(step, warmup=1, reps=case.spec["reps"])
        rows.append(case.row(policy, None, t, got, torch_peak_bytes=torch.cuda.max_memory_allocated()))
    model.cpu()
    torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- run / plot
def run(size: str = "toy", deadline_s: float = 1800.0) -> None:
    """Measure every (model, budget, policy); results are written after each model, and
    jobs past `deadline_s` seconds are skipped (recorded as such), so a time-limited GPU run
    always leaves what it measured. The headline model and budget go first (at 600 s, the
    H200 run skipped most of VGG-16's jobs; VGG-19 alone took 8.5 minutes there, so the
    whole run takes about 16)."""
    spec = SIZES[size]
    start = time.perf_counter()
    rates = measure_link()
    # Each memory plans with its own link: pinned copies for the pool, prefetches of managed
    # pages (slower, measured the same way) for managed AutoVM.
    links = {"pinned": Link(), "managed": Link()} if backend.SIMULATOR else {
        "pinned": Link(h2d=rates["pinned_h2d_gbps"] * 1e9, d2h=rates["pinned_d2h_gbps"] * 1e9),
        "managed": Link(h2d=rates["prefetch_h2d_gbps"] * 1e9, d2h=rates["evict_d2h_gbps"] * 1e9)}
    depths = sorted(spec["depths"], key=lambda d: d != HEADLINE_DEPTH[size])
    fracs = sorted(spec["fracs"], key=lambda f: f != HEADLINE_FRAC)
    policies = (["paging", "autovm", "autovm_recompute", "autovm_managed", "autovm_managed_recompute"]
                + ([] if spec["host_math"] else ["autovm_graph"]))
    bar = common.progress(range(len(depths) * (len(policies) * len(fracs) + 2)), desc=NAME)
    rows: list[dict] = []
    op_rows: list[dict] = []
    for depth in depths:
        case = _Case(depth, size)
        row, seconds = _unconstrained(case)
        rows.append(row)
        op_rows.extend(_op_rows(case, seconds))
        bar.update(1)
        # The outside anchor next to the floor it anchors (ours_over_torch_step), before the
        # budgets can use up the time limit.
        if time.perf_counter() < start + deadline_s:
            try:
                rows.extend(_torch(case))
            except Exception as exc:   # an outside anchor must not sink the run
                print(f"[{NAME}] torch anchor for vgg{depth} failed: {exc!r}", file=sys.stderr)
        bar.update(1)
        for frac in fracs:
            for policy in policies:
                rows.append(_job(case, policy, frac, seconds, links, start + deadline_s))
                bar.update(1)
        case.pinned.clear()
        _write(rows, rates, size, op_rows)
    bar.close()


def _op_rows(case: _Case, seconds) -> list[dict]:
    """Where the unconstrained step's time goes: each op's profiled time (the planner's
    timing model), with its layer's kind, so a slow kernel shows by name."""
    kinds = {L.name: L.kind for L in vgg.layers(case.cfg)}
    out = []
    for op, s in zip(case.tape.ops, seconds):
        kind = (f"{kinds[op.layer]} {op.name.rsplit('.', 1)[-1]}"
                if op.name.startswith(op.layer + ".") else op.name)   # "conv bwd_data", "loss"
        out.append({"model": f"vgg{case.cfg.depth}", "op": op.name, "layer": op.layer,
                    "kind": kind, "ms": round(s * 1e3, 4),
                    "gflop": round(op.flops / 1e9, 3),
                    "tflops": round(op.flops / s / 1e12, 2) if s > 0 else float("nan")})
    return out


def _job(case: _Case, policy: str, frac: float, seconds, links: dict[str, Link],
         deadline: float) -> dict:
    if time.perf_counter() > deadline:
        return case.row(policy, frac, None, None, error="skipped: past the run's time limit")
    try:
        if policy == "paging":
            return _paging(case, frac)
        if policy.startswith("autovm_managed"):
            return _autovm_managed(case, policy, frac, seconds, links["managed"])
        return _autovm(case, policy, frac, seconds, links["pinned"])
    except (BudgetError, MemoryError, RuntimeError) as exc:
        print(f"[{NAME}] vgg{case.cfg.depth} {policy} at {frac:.0%}: {exc}", file=sys.stderr)
        return case.row(policy, frac, None, None, error=str(exc)[:200])


def _write(rows: list[dict], rates: dict, size: str, op_rows: list[dict]) -> None:
    out = [{**row, **{k: round(v, 3) for k, v in rates.items()}} for row in rows]
    keys = list(dict.fromkeys(k for row in out for k in row))
    common.write_csv(NAME, [{k: row.get(k, "") for k in keys} for row in out])
    common.write_csv(f"{NAME}_ops", op_rows)
    summary = summarize(out, size)
    by_kind: dict[str, float] = {}
    for r in op_rows:   # the headline model's unconstrained step, by kind of op
        if r["model"] == summary["model"]:
            by_kind[r["kind"]] = round(by_kind.get(r["kind"], 0.0) + r["ms"], 3)
    summary["unconstrained_ms_by_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
    common.write_summary(NAME, summary)


def summarize(rows: list[dict], size: str) -> dict:
    model = f"vgg{HEADLINE_DEPTH[size]}"
    mine = [r for r in rows if r["model"] == model]

    def ms(policy, frac=HEADLINE_FRAC):
        hit = [float(r["step_ms"]) for r in mine if r["policy"] == policy
               and (r["budget_frac"] == "" if frac is None else r["budget_frac"] == frac)]
        return hit[0] if hit else float("nan")

    unc, pag, avm, rec = ms("unconstrained", None), ms("paging"), ms("autovm"), ms("autovm_recompute")
    link = [float(r["link_ms"]) for r in mine if r["policy"] == "autovm"
            and r["budget_frac"] == HEADLINE_FRAC and "link_ms" in r]
    checked = [r for r in rows if "max_rel_diff" in r and r["policy"] in CHECKED]
    if not checked:
        raise ValueError(f"{NAME}: no policy ran to completion")
    summary = {
        "model": model, "budget_frac": HEADLINE_FRAC,
        "paging_over_autovm_step": pag / avm,
        "autovm_over_unconstrained_step": avm / unc,
        "recompute_over_autovm_step": rec / avm,
        "unconstrained_step_ms": unc, "paging_step_ms": pag, "autovm_step_ms": avm,
        "autovm_recompute_step_ms": rec,
        "host_link_bound_ms": max(unc, link[0]) if link else float("nan"),
        "policies_checked": len(checked),
        "all_policies_bit_identical": all(r["loss_equal"] and r["grads_equal"] for r in checked),
        "max_rel_diff_any_policy": max((r["max_rel_diff"] for r in checked), default=float("nan")),
        # device memory the kernels' launchers held for themselves, which no budget counts
        "kernel_scratch_mib": max((int(r.get("kernel_scratch_bytes") or 0) for r in mine),
                                  default=0) / 2**20,
        **{k: rows[0].get(k, float("nan")) for k in
           ("pinned_h2d_gbps", "fault_h2d_gbps", "prefetch_h2d_gbps", "evict_d2h_gbps")},
    }
    graphed = ms("autovm_graph")
    if graphed == graphed:   # present (not NaN)
        summary.update(autovm_graph_step_ms=graphed, autovm_graph_over_autovm_step=graphed / avm)
    managed, managed_rc = ms("autovm_managed"), ms("autovm_managed_recompute")
    summary.update(paging_over_autovm_managed_step=pag / managed, autovm_managed_step_ms=managed,
                   autovm_managed_over_autovm_step=managed / avm,
                   paging_over_autovm_managed_recompute_step=pag / managed_rc,
                   autovm_managed_recompute_step_ms=managed_rc)
    for policy in ("torch", "torch_save_on_cpu"):
        if ms(policy, None) == ms(policy, None):
            summary[f"{policy}_step_ms"] = ms(policy, None)
    if "torch_step_ms" in summary:   # our unconstrained step against torchvision's, same batch
        summary["ours_over_torch_step"] = unc / summary["torch_step_ms"]
    return summary


def plot(device: str | None = None):
    """Figure from results/<device>/autovm.csv (default: this machine's device)."""
    rows = common.read_csv(NAME, device)
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = common.new_figure(rows, 1, len(models), figsize=(5.5 * len(models), 4.3), squeeze=False)
    styles = {"paging": ("C3", "o"), "autovm": ("C0", "s"), "autovm_recompute": ("C2", "^"),
              "autovm_graph": ("C5", "D"), "autovm_managed": ("C6", "v"),
              "autovm_managed_recompute": ("C4", "<")}
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for policy, (color, marker) in styles.items():
            pts = sorted((float(r["budget_frac"]) * 100, float(r["step_ms"])) for r in mine
                         if r["policy"] == policy and r["step_ms"] not in ("", "nan"))
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=policy.replace("_", " + "))
        floor = [float(r["step_ms"]) for r in mine if r["policy"] == "unconstrained"]
        bound = sorted((float(r["budget_frac"]) * 100, max(float(r["link_ms"]), *floor))
                       for r in mine if r["policy"] == "autovm" and r.get("link_ms") not in ("", None))
        if bound:
            ax.plot(*zip(*bound), color="k", linestyle="--", label="host-link bound")
        for policy, color, line in (("unconstrained", "k", "-"), ("torch", "C1", ":"),
                                    ("torch_save_on_cpu", "C4", ":")):
            for r in mine:
                if r["policy"] == policy:
                    ax.axhline(float(r["step_ms"]), color=color, linestyle=line, linewidth=1,
                               label=policy.replace("_", " "))
        # Jobs that did not run (past the time limit, refused, failed) are listed, not drawn.
        missing = dict.fromkeys(f"{float(r['budget_frac']):.0%}: {r['error'].split(':')[0]}"
                                for r in sorted(mine, key=lambda r: -float(r["budget_frac"] or 0))
                                if r.get("error") and r.get("budget_frac"))
        if missing:
            ax.text(0.98, 0.02, "not run or refused\n" + "\n".join(missing), ha="right",
                    va="bottom", fontsize=7, transform=ax.transAxes, color="0.35")
        ax.set_xlabel("device-memory budget (% of the unconstrained peak)")
        ax.set_ylabel("training step time (ms)")
        ax.set_title(f"{model.upper()}: step time vs budget")
        ax.set_xlim(105, 30)   # every budget the experiment knows, largest left
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return common.save_figure(fig, NAME, device)
