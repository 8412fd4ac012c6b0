"""The GPU lane: every test file on the GPU machine, in parallel pytest processes, one log.

    python -m tests.gpu_lane                  # writes results/<device>/gpu_tests_<commit>.txt
    python -m tests.gpu_lane --shards 4 --out lane.txt

GPU machine only. `make test VENV=` runs the same tests in one process; here they take about
a quarter of the time (the lane is mostly compilation and host work, which parallel
processes share out). Phase 1: every test file but ALONE, in --shards pytest processes at
once (SLOW files first, each alone in its shard; the rest by size, largest first onto the
shard with the fewest bytes). Phase 2: the ALONE files, which read the device's free memory,
in one process after every other has exited, so no other test's allocations move what they
measure. Every test file under tests/ is run: a new one joins phase 1 by itself.

The log heads with the device, versions, commit and date, the totals and every process's exit
status; then each shard's command and its whole output. Exit status 0 only when every
process exited 0.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import string
import subprocess
import sys
import time

from tests.sanitize import pytest_summary

TESTS = pathlib.Path(__file__).resolve().parent
ALONE = ("tests/test_graph_gpu.py", "tests/test_graphed_models_gpu.py", "tests/test_soak.py",
         "tests/test_experiment_graph_memory.py")
# minutes each (the H100 at 68919e7: 275, 243 and 116 s): a shard of its own each, since
# together in one shard they set phase 1's length (531 s of its 12.7 minutes)
SLOW = ("tests/test_experiment_end_to_end.py", "tests/test_experiment_wav2vec2_train.py",
        "tests/test_experiment_gptj.py")
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra", "--durations=10"]
# ... and for SLOW's shards, their passing tests' output too: each method's process reports
# the seconds it took (experiments.isolate), which says where a toy run's minutes go (at
# aa0562a 430 to 514 s each, 21 to 27 at 8441a32)
SHOW_OUTPUT = ["-rP"]
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")


def test_files() -> list[str]:
    """Every tests/test_*.py and the lab's dev/**/test_*.py (its benchmarks' kernels), as
    paths relative to the repository root, sorted."""
    root = TESTS.parent
    found = list(TESTS.glob("test_*.py")) + list((root / "dev").rglob("test_*.py"))
    return sorted(str(p.relative_to(root)) for p in found)


def shards(files: list[str], n: int, size=lambda f: (TESTS.parent / f).stat().st_size):
    """Phase 1's files in n lists: each SLOW file alone, then the others by `size`, largest
    first, each onto the list with the least so far (ties: the first). ALONE files are not
    in any (phase 2)."""
    if n < len(SLOW) + 1:
        raise ValueError(f"--shards: at least {len(SLOW) + 1} (one for each of SLOW, and one "
                         f"for the rest), got {n}")
    rest = [f for f in files if f not in ALONE and f not in SLOW]
    out = [[f] for f in SLOW if f in files]
    out += [[] for _ in range(n - len(out))]
    load = [0] * len(out)
    free = [i for i, s in enumerate(out) if not s]
    for f in sorted(rest, key=lambda f: (-size(f), f)):
        i = min(free, key=lambda i: (load[i], i))
        out[i].append(f)
        load[i] += size(f)
    return [s for s in out if s]


def totals(outputs: list[str]) -> dict:
    """Tests passed, failed, skipped and errors, summed over pytest's last lines."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for out in outputs:
        for n, what in _COUNT.findall(pytest_summary(out)):
            key = "errors" if what.startswith("error") else what
            if key in counts:
                counts[key] += int(n)
    return counts


def _command(files: list[str]) -> list[str]:
    return [*PYTEST, *(SHOW_OUTPUT if set(files) <= set(SLOW) else []), *files]


# The CPU thread pools of NumPy's BLAS, OpenMP and PyTorch, in each phase-1 process and the
# children it starts: their share of the machine's cores. Each pool sizes itself to every
# core by default, so 8 shards at once run 8 pools of 16 (whose threads spin while they wait)
# on 16 cores; at aa0562a the transformers child test took 175 s in the lane against 25 s
# at 8441a32 with half the shards.
THREAD_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def shard_env(shards: int, cores: int | None = None) -> dict[str, str]:
    """The environment of a phase-1 process: ours, with each of THREAD_POOLS at its share of
    the cores (at least 1); a value the caller set is kept."""
    share = str(max(1, (cores or os.cpu_count() or 1) // shards))
    return {**{k: share for k in THREAD_POOLS}, **os.environ}


def _run(files: list[str], env: dict | None = None) -> tuple[str, int, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(_command(files), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=TESTS.parent, env=env)
    return proc.stdout, proc.returncode, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shards", type=int, default=8,   # (the GPU machines have 16 cores)
                    help="phase 1's parallel processes")
    ap.add_argument("--out", type=pathlib.Path, help="the log (default: results/<device>/"
                                                     "gpu_tests_<commit>.txt)")
    args = ap.parse_args(argv)
    files = test_files()
    phase1 = shards(files, args.shards)   # (refuses a bad --shards before anything runs)
    from proto.device import backend
    if backend.SIMULATOR:
        sys.exit("gpu_lane: needs a real CUDA device (on the simulator run `make test`)")
    from experiments.common import provenance, results_dir
    made = provenance()
    out = args.out or results_dir() / f"gpu_tests_{made['git_commit'][:7]}.txt"
    names = string.ascii_lowercase
    t0 = time.perf_counter()
    print(f"gpu_lane: phase 1, {len(phase1)} processes; then {len(ALONE)} files alone",
          flush=True)
    env = shard_env(len(phase1))
    with concurrent.futures.ThreadPoolExecutor(len(phase1)) as pool:
        runs = list(pool.map(lambda files: _run(files, env), phase1))
    t1 = time.perf_counter()
    alone = [f for f in ALONE if f in files]
    runs.append(_run(alone))
    t2 = time.perf_counter()
    groups = [*phase1, alone]
    count = totals([r[0] for r in runs])
    statuses = [r[1] for r in runs]
    head = [
        f"# GPU lane (python -m tests.gpu_lane): {len(files)} test files in {len(groups)} pytest "
        f"processes. Phase 1 ran shards {names[0]}-{names[len(phase1) - 1]} at once "
        f"({t1 - t0:.0f} s); phase 2 ran shard {names[len(phase1)]} alone ({', '.join(alone)}: "
        f"the files that read the device's free memory), {t2 - t1:.0f} s. Phase 1's thread "
        f"pools: " + ", ".join(f"{k}={env[k]}" for k in THREAD_POOLS) + ".",
        "# " + ", ".join(f"{k}={v}" for k, v in made.items()),
        f"# total: {count['passed']} passed, {count['skipped']} skipped, {count['failed']} "
        f"failed, {count['errors']} errors; exit status of every shard: "
        + " ".join(str(s) for s in statuses),
    ]
    body = []
    for name, group, (output, status, seconds) in zip(names, groups, runs):
        body += ["", f"# shard {name}: {' '.join(['python3 -m pytest', *_command(group)[3:]])}",
                 output.rstrip(), f"# exit {status} ({seconds:.0f} s)"]
    out.write_text("\n".join(head + body) + "\n")
    print("\n".join(head[2:]), f"\nlog: {out}", flush=True)
    return 0 if all(s == 0 for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
