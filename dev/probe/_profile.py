"""The kernel table the probes print: each kernel's GPU time a call of `replay`, by
torch.profiler (experiments.step_profile._kernels: it sees Numba's kernels and those inside
graph replays), the costliest first, grouped by name with their launches a call."""
from __future__ import annotations

import os
import sys
import traceback

from experiments.step_profile import _kernels


def run_then_exit(main) -> None:
    """main(), then leave by os._exit (CUPTI, loaded by the profiler, beside Numba's context
    aborts at interpreter teardown), status 1 after printing main's exception."""
    status = 1
    try:
        main()
        status = 0
    except BaseException:   # noqa: BLE001 (printed: os._exit would swallow it)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def show(label: str, replay, wall_ms: float | None = None, n: int = 5, top: int = 25) -> float:
    """Print `replay`'s kernels (n calls profiled) under `label`; returns their summed GPU
    milliseconds a call."""
    kernels = _kernels(replay, n=n)
    total = sum(us for us, _ in kernels.values())
    launches = sum(c for _, c in kernels.values())
    wall = "" if wall_ms is None else f"{wall_ms:.3f} ms a call (wall), "
    print(f"\n== {label}: {wall}kernels {total / 1e3:.3f} ms GPU, {launches:.0f} launches",
          flush=True)
    for name, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  x{count:5.1f}  {name[:100]}")
    return total / 1e3
