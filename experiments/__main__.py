"""Run every experiment, then plot, then print a summary table.

    python -m experiments                 # all, at full size on a GPU, toy size on the simulator
    python -m experiments launch_overhead # just one
    python -m experiments --plot-only     # re-plot from results/<device>/*.csv
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
    args = ap.parse_args(argv)
    unknown = set(args.names) - set(EXPERIMENTS)
    if unknown:
        ap.error(f"unknown experiment(s) {sorted(unknown)}; choose from {EXPERIMENTS}")
    from experiments import common
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
    if backend.SIMULATOR:
        print("\n" + common.SIM_WARNING)
    return 0


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
