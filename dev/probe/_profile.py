"""The kernel table the probes print: each kernel's GPU time a call of `replay`, by
torch.profiler (experiments.step_profile._kernels: it sees Numba's kernels and those inside
graph replays), the costliest first, grouped by name with their launches a call."""
from __future__ import annotations

import os
import sys
import traceback

from experiments.step_profile import _kernels
from proto.device import backend, timing
from proto.graph.cuda import early_launch_off
from proto.models.graphed import GraphedDecoder


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


def our_step(model, position: int, beam: int, max_len: int) -> float:
    """Print the decode step's bandwidth floor (every weight and the live K and V once, at the
    copy rate measured here), then time our device-length graph (alias binding) at
    `position` with early launch on and profile its twin built with early launch off (under
    early launch a kernel's span starts while its predecessor runs and holds its wait, so
    only the twin gives each kernel its own time). Returns the timed step's microseconds."""
    copy_GBps = timing.copy_bandwidth_GBps(1 << 30, warmup=3, reps=20)
    weight_bytes, kv_bytes = model.decode_read_bytes(beam, position + 1)
    floor_us = (weight_bytes + kv_bytes) / copy_GBps / 1e3
    print(f"device: {backend.device_name()}  beam {beam}  position {position}  copy "
          f"{copy_GBps:.0f} GB/s  floor {floor_us:.1f} us ({weight_bytes / 1e9:.3f} GB "
          f"weights, {kv_bytes / 1e9:.3f} GB K and V)", flush=True)
    timed = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias",
                           strategy="device")
    step = timing.bench(timed.replayer(position), warmup=3, reps=20)
    with early_launch_off():   # (replayer builds the graph, which lowers it)
        plain = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias",
                               strategy="device")
        plain_replay = plain.replayer(position)
    show(f"ours, device-length graph (timed with early launch: {step.median_us:.1f} us, "
         f"p10 {step.p10_ms * 1e3:.1f}, p90 {step.p90_ms * 1e3:.1f}; "
         f"{step.median_us / floor_us:.2f}x the floor)", plain_replay)
    return step.median_us
