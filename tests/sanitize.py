"""compute-sanitizer over the GPU tests: memcheck, racecheck, initcheck and synccheck.

    python -m tests.sanitize                      # every tool over the default test files
    python -m tests.sanitize --tools memcheck tests/test_gemm.py

GPU machine only. The four tools run at once (one process each: a sanitized run is slow and
mostly host-bound), and each tool runs every test file in its own process, so a crash or a
time limit in one file costs that file's log, not the rest. Tests run at simulator-sized
shapes (PROTO_TEST_SCALE=1) and the small hypothesis profile: the tools check every access,
so size buys nothing but time.

A file gets --timeout seconds (300) and the whole run --deadline (900): what has not started
by then is listed as not run, so the lane fits a bounded device session. A tool may deselect
a test that runs past any time limit under it (DESELECT below, with the reason); sanitize.txt
lists every deselection.

Writes results/<device>/sanitize-<tool>.log (every file's output, one after another) and
sanitize.txt: per tool and file, the tool's error count, pytest's last line and the exit
status. Exits 1 if any tool found an error, any test failed, or any file did not finish.
Numba's symbol probes (cuGetProcAddress) are API errors, not bugs: --report-api-errors no.

Conditional graph nodes are switched off under the tools (PROTO_CONDITIONAL_NODES=off: IF
and WHILE run by predication, the same kernels in plain graphs). compute-sanitizer 2025.3.1
stops WHILE bodies of a few trivial in-bounds kernels with an illegal address it attributes
to no kernel, and racecheck crashes on block-wide kernels in an IF nested in a WHILE, while
every replay agrees without a tool
(python -m tests.conditional_repro --all; results/h200/sanitize_conditional_repro.txt). The
conditional nodes themselves are checked by the GPU lane, which runs with them on.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# The graph layer's GPU tests, then every kernel's (convolutions last: the slowest checked).
FILES = ("tests/test_graph_gpu.py", "tests/test_control.py", "tests/test_predicate.py",
         "tests/test_search_loop.py", "tests/test_attention.py", "tests/test_gemm.py",
         "tests/test_sampling.py", "tests/test_softmax.py", "tests/test_layernorm.py",
         "tests/test_elementwise.py", "tests/test_embedding.py", "tests/test_loss.py",
         "tests/test_relu.py", "tests/test_sgd.py", "tests/test_linear.py", "tests/test_lstm.py",
         "tests/test_conv.py", "tests/test_mlp.py", "tests/test_attention_preload.py",
         "tests/test_rotary.py", "tests/test_attention_half.py", "tests/test_random.py",
         # Wav2Vec2 training's kernels
         "tests/test_ctc.py", "tests/test_seq_attention.py", "tests/test_groupnorm.py",
         "tests/test_layernorm_bwd.py", "tests/test_gelu_erf.py", "tests/test_layout.py",
         "tests/test_adamw.py", "tests/test_conv1d.py")
# racecheck tracks every shared-memory access of every block: the VGG-sized determinism test
# (four 786k-pixel weight-gradient reductions) runs past any time limit under it. Its kernel's
# split path is raced-checked by the small hypothesis cases of the same file (splits 1 and 3);
# the other three tools run it.
# The 1-D convolutions' model-sized tests (a 4 s batch through the feature encoder, the
# positional conv at 199 frames) are GPU-lane tests: every tool would spend the whole budget
# on them; the same kernels run at small sizes in the same file, GPU tiles included.
_MODEL_SIZED = ("tests/test_conv1d.py::test_conv1d_at_wav2vec2_feature_encoder_sizes",
                "tests/test_conv1d.py::test_grouped_at_wav2vec2_positional_conv_size")
DESELECT = {"racecheck": ("tests/test_conv.py::test_split_wgrad_at_vgg_size_is_deterministic",
                          *_MODEL_SIZED),
            "memcheck": _MODEL_SIZED, "initcheck": _MODEL_SIZED, "synccheck": _MODEL_SIZED}
_PYTEST_LAST = re.compile(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s")
_ERRORS = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)")


def pytest_summary(out: str) -> str:
    """pytest's last line in a run's output ("3 passed, 1 skipped in 2.10s"), or a note."""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if _PYTEST_LAST.search(ln)), "(no pytest summary)")
    return last.strip("= ")


def _run_file(tool: str, path: str, timeout: float) -> tuple[str, dict]:
    cmd = ["compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE", path]
    cmd += [f"--deselect={t}" for t in DESELECT.get(tool, ()) if t.startswith(path + "::")]
    env = {**os.environ, "HYPOTHESIS_PROFILE": "ci", "PROTO_TEST_SCALE": "1", "PROTO_QUIET": "1",
           "PROTO_CONDITIONAL_NODES": "off"}
    t0 = time.perf_counter()
    # Its own process group: on a time limit the sanitizer and the Python under it both go.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = "timeout"
    counts = [int(n) for n in _ERRORS.findall(out)]
    return out, {"tool": tool, "file": path, "errors": sum(counts) if counts else None,
                 "pytest": pytest_summary(out), "status": status,
                 "seconds": round(time.perf_counter() - t0, 1)}


def _run_tool(tool: str, files, timeout: float, deadline: float, results_dir) -> list[dict]:
    rows = []
    with open(results_dir / f"sanitize-{tool}.log", "w") as log:
        for path in files:
            left = deadline - time.monotonic()
            if left < 10:   # the whole run's time is spent: say so rather than overrun it
                row = {"tool": tool, "file": path, "errors": None, "status": "not run",
                       "pytest": "(the run's deadline passed first)", "seconds": 0.0}
                rows.append(row)
                print(_fmt(row), flush=True)
                continue
            out, row = _run_file(tool, path, min(timeout, left))
            log.write(f"##### {tool} {path}: exit status {row['status']}, {row['seconds']} s\n{out}\n")
            log.flush()
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


def _fmt(row: dict) -> str:
    errors = "no summary" if row["errors"] is None else f"{row['errors']} errors"
    return (f"{row['tool']:<9} {row['file']:<28} {errors:<11} exit {row['status']!s:<7} "
            f"{row['seconds']:>6.0f} s  pytest: {row['pytest']}")


def _clean(row: dict) -> bool:
    return row["errors"] == 0 and row["status"] == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="*", default=list(FILES))
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per tool and file")
    ap.add_argument("--deadline", type=float, default=900.0,
                    help="seconds for the whole run; files not started by then are not run")
    args = ap.parse_args(argv)
    from proto.device import backend
    if backend.SIMULATOR:
        sys.exit("sanitize: needs a real CUDA device (compute-sanitizer checks GPU code)")
    from experiments.common import provenance, results_dir
    out = results_dir()
    made = provenance()   # the device, versions, commit and date the logs belong to
    with concurrent.futures.ThreadPoolExecutor(len(args.tools)) as pool:
        deadline = time.monotonic() + args.deadline
        rows = [r for rs in pool.map(lambda t: _run_tool(t, args.files, args.timeout, deadline, out),
                                     args.tools)
                for r in rs]
    summary = [f"compute-sanitizer over {len(args.files)} test files, one process per tool and file "
               "(PROTO_TEST_SCALE=1, HYPOTHESIS_PROFILE=ci, PROTO_CONDITIONAL_NODES=off: IF/WHILE "
               "by predication, see tests/conditional_repro.py)",
               ", ".join(f"{k}={v}" for k, v in made.items())]
    summary += [f"{tool} deselects {t} (see DESELECT in tests/sanitize.py)"
                for tool, tests in DESELECT.items() if tool in args.tools for t in tests
                if t.split("::")[0] in args.files]
    summary += [_fmt(r) for r in rows]
    for tool in args.tools:
        mine = [r for r in rows if r["tool"] == tool]
        total = sum(r["errors"] or 0 for r in mine)
        unfinished = sum(r["errors"] is None or r["status"] != 0 for r in mine)
        summary.append(f"{tool}: ERROR SUMMARY: {total} errors over {len(mine)} files; "
                       f"{unfinished} files failed a test, crashed, timed out or were not run")
    (out / "sanitize.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary[-len(args.tools):]))
    return 0 if all(_clean(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
