"""The smallest conditional graphs, replayed many times, with no tool and under each
compute-sanitizer tool: is a fault under a tool ours or the tool's?

    python -m tests.conditional_repro CASE [REPLAYS]    # one case, in this process
    python -m tests.conditional_repro --all             # every case x (no tool + 4 tools)

GPU machine only for --all. Every body kernel is trivial and in bounds by construction (one
thread, or 32 threads on 32 elements), so a replay that faults under a tool and passes
without one points at the tool. On the H200 (driver 580.159.04, compute-sanitizer
2025.3.1): `while_wide` (ten 32-thread kernels in a WHILE body) and `while_temp` (a planned
temporary in the body) stop with an illegal address under memcheck, `while_temp` under
initcheck too, that the tool attributes to no kernel; without a tool all replays agree.
tests/sanitize.py therefore runs the tests with conditional nodes switched off.
"""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import numpy as np

from proto import graph
from proto.device.backend import cuda, empty, jit, launch
from tests.test_control import Loop, add_kernel, countdown_kernel

CASES = ("while", "if", "nested", "while_wide", "while_temp")
TOOLS = ("none", "memcheck", "racecheck", "initcheck", "synccheck")


@jit("void(float32[::1], float32)")
def fill32(t, v):
    i = cuda.grid(1)
    if i < t.shape[0]:
        t[i] = v + i


@jit("void(float32[::1], float32[::1])")
def sum_into(t, total):
    if cuda.grid(1) == 0:
        s = np.float32(0)
        for i in range(t.shape[0]):
            s += t[i]
        total[0] += s


def run_case(case: str, replays: int) -> int:
    """Replay `case` `replays` times (1..4 passes each); returns how many results were wrong."""
    loop = Loop()
    scratch = cuda.to_device(np.zeros(32, np.float32))

    def count():
        launch(countdown_kernel, 1, 1, (loop.counter, loop.total, loop.flag))

    def wide():
        for _ in range(10):
            launch(fill32, 1, 32, (scratch, np.float32(0.0)))

    def temp():
        t = empty((32,), np.float32, "t")
        launch(fill32, 1, 32, (t, np.float32(0.0)))
        launch(sum_into, 1, 1, (t, scratch[:1]))

    def add_nothing():
        launch(add_kernel, 1, 1, (loop.total, np.float32(0.0)))

    bodies = {
        "while": lambda: graph.while_loop(loop.flag, count, max_passes=8),
        "if": lambda: graph.if_then(loop.go, lambda: launch(add_kernel, 1, 1,
                                                            (loop.total, np.float32(1000.0)))),
        "nested": lambda: graph.while_loop(loop.flag, lambda: (graph.if_then(loop.go, add_nothing),
                                                               count()), max_passes=8),
        "while_wide": lambda: graph.while_loop(loop.flag, lambda: (wide(), count()), max_passes=8),
        "while_temp": lambda: graph.while_loop(loop.flag, lambda: (temp(), count()), max_passes=8),
    }
    g = graph.capture(bodies[case], {}, warmup=0)
    wrong = 0
    for r in range(replays):
        n = 1 + r % 4
        loop.set(n, True)
        g.replay()
        wrong += loop.result() != (1000.0 if case == "if" else n * (n + 1) / 2)
    g.close()
    return wrong


def _under(tool: str, case: str, replays: int) -> str:
    cmd = [sys.executable, "-m", "tests.conditional_repro", case, str(replays)]
    if tool != "none":
        cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
               "--print-limit", "5"] + cmd
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        text, status = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired:
        text, status = "", "timeout"
    lines = text.splitlines()
    verdict = next((ln for ln in lines if "replays" in ln), "")
    summary = next((ln.strip("= ") for ln in reversed(lines) if "SUMMARY" in ln), "")
    fault = next((w for ln in lines for w in ln.split() if "CUDA_ERROR_" in w), "")
    return f"{case:<11} {tool:<9} exit {status!s:<7} {verdict:<32} {summary} {fault}".rstrip()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--all"]:
        replays = int(argv[1]) if len(argv) > 1 else 40
        jobs = [(tool, case) for case in CASES for tool in TOOLS]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            for line in pool.map(lambda job: _under(*job, replays), jobs):
                print(line, flush=True)
        return 0
    if not argv or argv[0] not in CASES:
        sys.exit(f"usage: python -m tests.conditional_repro {{{','.join(CASES)}}} [REPLAYS]"
                 " | --all")
    replays = int(argv[1]) if len(argv) > 1 else 40
    wrong = run_case(argv[0], replays)
    print(f"{argv[0]}: {replays} replays, {wrong} wrong", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
