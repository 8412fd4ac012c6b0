"""Run every experiment, then plot, then print a summary table.

    python -m experiments                 # all, at full size on a GPU, toy size on the simulator
    python -m experiments launch_overhead # just one
    python -m experiments --plot-only     # re-plot from results/<device>/*.csv
    python -m experiments --plot-only --device h200   # re-plot the H200's, on any machine
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from proto import backend

EXPERIMENTS = ["launch_overhead", "kernel_speed", "end_to_end", "search_loop", "graph_memory",
               "autovm"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", default=EXPERIMENTS, help=f"subset of {EXPERIMENTS}")
    ap.add_argument("--plot-only", action="store_true", help="only re-plot existing results")
    ap.add_argument("--size", choices=["toy", "full"],
                    default="toy" if backend.SIMULATOR else "full",
                    help="toy: CI-sized; full: paper-sized (default: full on a GPU)")
    ap.add_argument("--device", help="with --plot-only: the results/<device>/ folder to plot "
                    "(default: this machine's), so a GPU's results can be drawn without one")
    args = ap.parse_args(argv)
    if args.device and not args.plot_only:
        ap.error("--device: only with --plot-only (a run writes this machine's results)")
    unknown = set(args.names) - set(EXPERIMENTS)
    if unknown:
        ap.error(f"unknown experiment(s) {sorted(unknown)}; choose from {EXPERIMENTS}")
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
            mod.run(args.size)
        fig = mod.plot()
        summary = common.read_summary(name)
        headline = {k: v for k, v in summary.items() if k != "provenance"}
        table.append((name, time.perf_counter() - t0, fig, headline))
    print(f"\n{'experiment':<18} {'seconds':>8}  headline figures")
    for name, secs, fig, headline in table:
        print(f"{name:<18} {secs:8.1f}  " + ", ".join(f"{k}={_fmt(v)}" for k, v in headline.items()))
        print(f"{'':<28}figure: {fig}")
    if common.results_dir().name == "sim":   # what was run or plotted, not where
        print("\n" + common.SIM_WARNING)
    return 0


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
