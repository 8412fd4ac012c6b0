"""One shared timer for every experiment.

Warm-up calls first (they also absorb JIT compilation), then `reps` timed calls, each between
two CUDA events on the same stream, reported as median and spread. On the simulator there
are no GPU events; wall-clock time is returned and flagged, and means nothing.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from proto.device import backend
from proto.device.backend import cuda


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    simulated: bool

    @property
    def median_us(self) -> float:
        return self.median_ms * 1e3


def _summarize(samples_ms, simulated: bool) -> Timing:
    s = np.asarray(samples_ms, dtype=np.float64)
    return Timing(float(np.median(s)), float(np.percentile(s, 10)),
                  float(np.percentile(s, 90)), len(s), simulated)


_flush_buffer = None


def flush_l2() -> None:
    """Overwrite the L2 cache (H200: 60 MiB) so a kernel does not read warm data."""
    global _flush_buffer
    if backend.SIMULATOR:
        return
    if _flush_buffer is None:
        _flush_buffer = cuda.device_array(64 << 20, dtype=np.uint8)  # 64 MiB > L2
    _flush_buffer[:] = 0  # a device memset


def bench(fn, *, warmup: int = 3, reps: int = 20, stream=None, flush: bool = False) -> Timing:
    """Time `fn()` (which launches GPU work on `stream`, default stream if None).

    Each rep is bracketed by its own pair of events, so host overhead between reps is not
    counted but host overhead *inside* `fn` (Python, launch calls) is, when it keeps the GPU
    waiting: that is the cost we study.
    """
    for _ in range(warmup):
        fn()
    backend.synchronize()
    if backend.SIMULATOR:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return _summarize(samples, simulated=True)
    stream = stream if stream is not None else cuda.default_stream()
    starts = [cuda.event() for _ in range(reps)]
    ends = [cuda.event() for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush:
            flush_l2()
        start.record(stream)
        fn()
        end.record(stream)
    ends[-1].synchronize()
    return _summarize([cuda.event_elapsed_time(s, e) for s, e in zip(starts, ends)],
                      simulated=False)


def bench_host(fn, *, warmup: int = 3, reps: int = 20) -> Timing:
    """Wall-clock time of `fn()` including a final device synchronize: for end-to-end loops
    whose own host work (Python, binding, search) is part of what is measured."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summarize(samples, simulated=backend.SIMULATOR)


def copy_bandwidth_GBps(nbytes: int, *, warmup: int = 3, reps: int = 20) -> float:
    """Device-to-device copy of `nbytes`: bytes read + written per second, in GB/s (the
    bandwidth floors of memory-bound kernels and steps are measured against this)."""
    src = cuda.device_array(nbytes // 4, np.float32)
    dst = cuda.device_array(nbytes // 4, np.float32)
    t = bench(lambda: dst.copy_to_device(src), warmup=warmup, reps=reps)
    del src, dst
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9
