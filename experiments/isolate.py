"""One measurement, one process: run a function in a fresh Python process, get its result.

Free device memory is the only honest meter of what a method's graphs hold, and it is only
honest in a process of that method alone: the CUDA driver keeps what freed graphs and
buffers held and hands it to the next taker without the free count moving, so a method
measured after another in the same process can read near zero. So each method of a memory
experiment runs as

    result = isolate.run("experiments.graph_memory:measure", {"model": "gpt2", ...})

which starts ``python -m experiments.isolate TARGET SPEC OUT`` (the checkout on its path),
calls ``TARGET(**spec)`` there, and reads back what it returned (JSON). The child's stderr
(progress, tracebacks) passes through; a child that fails, dies or outlives `timeout`
raises ChildFailed naming the target.
"""
from __future__ import annotations

import importlib
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

from experiments import common


class ChildFailed(RuntimeError):
    """The child process raised, died, or gave no answer in time."""


TIMEOUT = 3600   # seconds a child may take unless its caller says otherwise


def run(target: str, spec: dict, *, timeout: float = TIMEOUT, env: dict | None = None) -> dict:
    """`target` ("package.module:function") called with `spec` in a fresh process; returns
    its result (a JSON-able dict)."""
    module, _, function = target.partition(":")
    if not module or not function:
        raise ValueError(f"target: expected 'module:function', got {target!r}")
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = pathlib.Path(folder, "spec.json"), pathlib.Path(folder, "out.json")
        spec_path.write_text(json.dumps(spec))
        try:
            status = subprocess.run([sys.executable, "-m", "experiments.isolate", target,
                                     str(spec_path), str(out_path)], cwd=common.REPO,
                                    timeout=timeout, env=env or common.child_env()).returncode
        except subprocess.TimeoutExpired:
            raise ChildFailed(f"{target}({spec}): no answer in {timeout:.0f} s; stopped") from None
        if status != 0 or not out_path.exists():
            raise ChildFailed(f"{target}({spec}): the child process failed (exit status "
                              f"{status}); its traceback is above")
        return json.loads(out_path.read_text())


def torch_missing(with_transformers: bool = True) -> str | None:
    """Why a PyTorch baseline (torch on CUDA, and transformers if asked) cannot run here;
    None: it can."""
    from proto.device import backend
    if backend.SIMULATOR:
        return "needs a GPU (PyTorch on CUDA)"
    try:
        import torch
        if with_transformers:
            import transformers  # noqa: F401
    except ImportError as exc:
        return f"not installed: {exc}"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def each_method(name: str, methods, target: str, size: str, *, baselines, unavailable: dict,
                transformers=None, timeouts: dict | None = None):
    """(method, result) of `target(method=..., size=size)`, each method in a process of its
    own, in order. A method that cannot run here (a baseline, one of `baselines`, without
    PyTorch; `transformers` names those that need transformers too, None: all), or whose
    child fails or outlives its time (`timeouts`: seconds by method, else TIMEOUT), is
    recorded in `unavailable` with the reason and skipped, so that one failure costs its
    row, not the other methods' (a GPU session is short). Our own methods' failures are
    raised by `raise_failures` once the caller has written the rest."""
    for method in common.progress(methods, desc=name):
        why = None if method not in baselines else torch_missing(
            transformers is None or method in transformers)
        if why is not None:
            unavailable[method] = why
            common.report(name, {"method": method, "unavailable": why})
            continue
        result = attempt(name, method, target, {"method": method, "size": size}, unavailable,
                         ours=method not in baselines,
                         timeout=(timeouts or {}).get(method, TIMEOUT))
        if result is not None:
            yield method, result


def attempt(name: str, label: str, target: str, spec: dict, unavailable: dict, *, ours: bool,
            timeout: float = TIMEOUT) -> dict | None:
    """run(target, spec); or, where the child fails or outlives `timeout`, None, with the
    reason recorded as unavailable[label] and reported under experiment `name`: marked as
    ours failing (OURS_FAILED, which `raise_failures` raises) when `ours`, else a baseline's
    that is only recorded. Either way the process's seconds are reported (where a run's
    time goes)."""
    t0 = time.perf_counter()
    try:
        return run(target, spec, timeout=timeout)
    except ChildFailed as exc:
        why = f"{OURS_FAILED}: {str(exc)[:300]}" if ours else str(exc)[:300]
    finally:
        common.report(name, {"method": label, "process_s": round(time.perf_counter() - t0, 1)})
    unavailable[label] = why
    common.report(name, {"method": label, "unavailable": why})
    return None


OURS_FAILED = "our method failed"


def raise_failures(name: str, unavailable: dict) -> None:
    """ChildFailed naming our methods that failed in `each_method` (their tracebacks are above
    in the log), after removing experiment `name`'s summary, which an earlier run wrote and
    this one could not; nothing when none failed."""
    failed = {m: why for m, why in unavailable.items() if why.startswith(OURS_FAILED)}
    if failed:
        (common.results_dir() / f"{name}.summary.json").unlink(missing_ok=True)
        raise ChildFailed(f"{len(failed)} of our methods failed: " + "; ".join(
            f"{m}: {why}" for m, why in failed.items()))


def _main(argv: list[str]) -> int:
    target, spec_path, out_path = argv
    module, _, function = target.partition(":")
    t0 = time.perf_counter()
    fn = getattr(importlib.import_module(module), function)
    t1 = time.perf_counter()
    try:
        result = fn(**json.loads(pathlib.Path(spec_path).read_text()))
    except BaseException:
        traceback.print_exc()
        return 1
    # (importing a module compiles or loads its kernels: where a child's seconds go)
    print(f"isolate: {target}: import {t1 - t0:.1f} s, call {time.perf_counter() - t1:.1f} s",
          file=sys.stderr, flush=True)
    pathlib.Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m experiments.isolate MODULE:FUNCTION SPEC.json OUT.json")
    sys.exit(_main(sys.argv[1:]))
