"""Run every experiment, then plot, then print a summary table.

    python -m experiments                 # all, at full size on a GPU, toy size on the simulator
    python -m experiments launch_overhead # just one
    python -m experiments --plot-only     # re-plot from results/<device>/*.csv
    python -m experiments --plot-only --device h200   # re-plot the H200's, on any machine
    python -m experiments gptj --methods ours_eager,ours_device,ptgraph_step
        # some of one experiment's methods (gptj, wav2vec2_train); the rows its other methods
        # had at this commit on this device are kept, so a long run spans GPU sessions
    python -m experiments end_to_end --setups 12L-d768-fp16
        # some of end_to_end's setups (labels of --size's), keeping its other setups' rows
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from proto.device import backend

EXPERIMENTS = ["launch_overhead", "kernel_speed", "end_to_end", "search_loop", "graph_memory",
               "gptj", "wav2vec2_train", "autovm"]
# The experiments whose run(size, methods) runs a subset of their methods (`--methods`)
WITH_METHODS = ("gptj", "wav2vec2_train")
# The experiments whose run(size, setups) runs a subset of their setups (`--setups`)
WITH_SETUPS = ("end_to_end",)
# The figures each experiment is judged by, and their goals (the summary JSON has the rest)
HEADLINES = {
    "launch_overhead": [("eager_over_graph_per_kernel", "")],
    "kernel_speed": [("decode_gemm_min_fraction_of_bandwidth", ">= 0.7")],
    "end_to_end": [("step_over_bandwidth_floor", "<= 2.5"), ("ours_over_torch_graph_step", "<= 0.5"),
                   ("while_per_token_over_step", "<= 1.15"),
                   ("hf_generate_over_ours_per_token", ">= 10"),
                   ("gpt2_fp16_step_over_bandwidth_floor", "<= 3.0"),
                   ("gpt2_fp16_hf_generate_over_ours_per_token", ">= 10")],
    "search_loop": [("predicated_over_while_per_token", "")],
    "graph_memory": [("ptgraph_over_ours_memory", ">= 36.43"),
                     ("memory_breakdown_complete", "true"),
                     ("planned_over_unplanned_time_per_token", "<= 1.05"),
                     ("arena_over_peak_live", "<= 1.10")],
    "gptj": [("gptj_step_over_bandwidth_floor", "<= 1.3"),
             ("gptj_hf_generate_over_ours_per_token", ">= 2.5"),
             ("gptj_ours_over_torch_graph_step", "<= 0.95"),
             ("gptj_ptgraph_over_ours_memory", ">= 36.43"),
             ("gptj_decode_gemm_min_fraction_of_bandwidth", ">= 0.85"),
             ("gptj_all_tokens_equal", "true")],
    "wav2vec2_train": [("eager_over_ours_step", ">= 1.3"), ("ptgraph_over_ours_memory", ">= 10"),
                       ("loss_matches_reference", "true"), ("graphed_equals_eager", "true")],
    "autovm": [("paging_over_autovm_managed_step", ">= 2.5")],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", default=EXPERIMENTS, help=f"subset of {EXPERIMENTS}")
    ap.add_argument("--plot-only", action="store_true", help="only re-plot existing results")
    ap.add_argument("--size", choices=["toy", "full"],
                    default="toy" if backend.SIMULATOR else "full",
                    help="toy: CI-sized; full: paper-sized (default: full on a GPU)")
    ap.add_argument("--device", help="with --plot-only: the results/<device>/ folder to plot "
                    "(default: this machine's), so a GPU's results can be drawn without one")
    ap.add_argument("--methods", help="comma-separated: run only these methods of ONE "
                    f"experiment ({', '.join(WITH_METHODS)}), keeping the rows its other "
                    "methods have at this commit on this device")
    ap.add_argument("--setups", help="comma-separated: run only these setups (labels of "
                    f"--size's) of ONE experiment ({', '.join(WITH_SETUPS)}), keeping the rows "
                    "its other setups have at this commit on this device")
    args = ap.parse_args(argv)
    if args.device and not args.plot_only:
        ap.error("--device: only with --plot-only (a run writes this machine's results)")
    unknown = set(args.names) - set(EXPERIMENTS)
    if unknown:
        ap.error(f"unknown experiment(s) {sorted(unknown)}; choose from {EXPERIMENTS}")
    methods = None if args.methods is None else _subset(ap, args, "methods", WITH_METHODS)
    setups = None if args.setups is None else _subset(ap, args, "setups", WITH_SETUPS)
    from experiments import common
    if args.device:
        if not (common.ROOT / "results" / args.device).is_dir():
            ap.error(f"--device: no folder results/{args.device}/")
        common.DEVICE = args.device
    print(f"device: {backend.describe()}  size: {args.size}", file=sys.stderr)
    table = []
    for name in args.names:
        mod = importlib.import_module(f"experiments.{name}")
        t0 = time.perf_counter()
        if not args.plot_only:
            if methods is not None:
                mod.run(args.size, methods=methods)
            elif setups is not None:
                mod.run(args.size, setups=setups)
            else:
                mod.run(args.size)
        fig = mod.plot()
        summary = common.read_summary(name)
        headline = {k: v for k, v in summary.items() if k != "provenance"}
        table.append((name, time.perf_counter() - t0, fig, headline))
    print(f"\n{'experiment':<16} {'seconds':>8}  {'headline':<40} {'value':>10}  {'goal':<9} figure")
    for name, secs, fig, headline in table:
        for i, (key, goal) in enumerate(HEADLINES.get(name, [])):
            print(f"{name if i == 0 else '':<16} {f'{secs:8.1f}' if i == 0 else '':>8}  {key:<40} "
                  f"{_fmt(headline.get(key)):>10}  {goal:<9} {fig if i == 0 else ''}")
    if common.results_dir().name == "sim":   # what was run or plotted, not where
        print("\n" + common.SIM_WARNING)
    return 0


def _subset(ap, args, option: str, takers: tuple) -> list[str]:
    """--methods' or --setups' (`option`) names, checked against the one experiment named,
    which must be one of `takers` (an error otherwise); a setup's labels are --size's."""
    what = option[:-1]   # (method, setup)
    if args.plot_only:
        ap.error(f"--{option}: not with --plot-only (a plot draws every row)")
    if len(args.names) != 1:
        ap.error(f"--{option}: name exactly one experiment")
    name = args.names[0]
    if name not in takers:
        ap.error(f"--{option}: {name} runs all its {option}; only {', '.join(takers)} "
                 f"take{'s' if len(takers) == 1 else ''} --{option}")
    mod = importlib.import_module(f"experiments.{name}")
    choices = mod.choices() if option == "methods" else mod.choices(args.size)
    names = [m.strip() for m in getattr(args, option).split(",") if m.strip()]
    unknown = [m for m in names if m not in choices]
    if unknown or not names:   # (none named: as unknown, with the list to choose from)
        size = f" at size {args.size}" if option == "setups" else ""
        ap.error(f"--{option}: unknown {name} {what}(s) {unknown}{size}; choose from {choices}")
    return names


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
