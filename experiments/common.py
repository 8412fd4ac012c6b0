"""What every experiment shares: where results go (results/<device>/, figures/<device>/), the provenance stamped on every CSV row,
the summary file, and the simulator warning on figures (a plot reads only the data a run wrote).

Every result file is written whole or not at all: to a temporary name in the same folder,
then renamed over the old one (`_atomic`), so a run interrupted mid-write (Ctrl-C, a crash,
a time limit) leaves the previous results intact rather than a truncated CSV."""
from __future__ import annotations

import contextlib
import csv
import datetime
import functools
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys

from kernels import tuning
from proto.device import backend

ROOT = pathlib.Path(__file__).resolve().parent.parent
REPO = ROOT   # the checkout (ROOT is where results go; tests point it elsewhere)
DEVICE = None  # results/<DEVICE>/ and figures/<DEVICE>/ instead of this machine's (--device)
SIM_WARNING = "Numba CUDA simulator: timings are NOT meaningful (toy size, Python threads)"


def results_dir(device: str | None = None) -> pathlib.Path:
    d = ROOT / "results" / (device or DEVICE or backend.device_name())
    d.mkdir(parents=True, exist_ok=True)
    return d


def figures_dir(device: str | None = None) -> pathlib.Path:
    d = ROOT / "figures" / (device or DEVICE or backend.device_name())
    d.mkdir(parents=True, exist_ok=True)
    return d


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _git_commit() -> str:
    """HEAD's short hash, '-dirty' when tracked files differ from it. A copy of the tree
    without .git (what the GPU machine gets) is told its commit in PROTO_GIT_COMMIT."""
    if os.environ.get("PROTO_GIT_COMMIT"):
        return os.environ["PROTO_GIT_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def host_cpu() -> str:
    """The host's processor, by name: an eager PyTorch step's time depends on it (each
    launch costs host time), so two runs on the same GPU model can differ by their host."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """Columns stamped on every row: which device, software and commit produced it, and when."""
    return {
        "device": backend.describe(),
        "host_cpu": host_cpu(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "numba_cuda": _version("numba-cuda"),
        "cuda_core": _version("cuda-core"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "git_commit": _git_commit(),
        # the per-GPU tile table the kernels ran with (kernels.tuning): data, not code
        "tuned_tiles": tuning.stamp(backend.device_name()),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


@contextlib.contextmanager
def _atomic(path: pathlib.Path):
    """Yield a temporary path beside `path`; only when the block completes is it renamed over
    `path` (one rename within a folder: atomic). Otherwise it is removed and `path` is left
    as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_csv(name: str, rows: list[dict]) -> pathlib.Path:
    """Write rows (dicts with the same keys) plus provenance columns to results/<device>/<name>.csv.
    A row that already has provenance columns (one kept from an earlier run at this commit:
    `rows_of_this_commit`) keeps its own, its date above all; the columns stay in the row's
    order, provenance last."""
    if not rows:
        raise ValueError(f"{name}: no rows to write")
    path = results_dir() / f"{name}.csv"
    stamped = [{**provenance(), **row} for row in rows]
    fields = [k for k in stamped[0] if k not in provenance()] + list(provenance())
    with _atomic(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(stamped)
    return path


def read_csv(name: str, device: str | None = None) -> list[dict]:
    with (results_dir(device) / f"{name}.csv").open() as f:
        return list(csv.DictReader(f))


def of_this_commit(stamp: dict) -> bool:
    """Whether a stored row or result (`stamp`: its provenance columns) was measured at this
    run's commit on this run's device, where that commit is a clean one: a '-dirty' tree or
    an 'unknown' commit cannot vouch that its earlier results ran the same code, so they
    never merge with a later run's."""
    here = provenance()
    commit = here["git_commit"]
    return (commit != "unknown" and not commit.endswith("-dirty")
            and stamp.get("git_commit") == commit and stamp.get("device") == here["device"])


def rows_of_this_commit(name: str, exclude=(), text=(), key: str = "method") -> list[dict]:
    """The rows of results/<device>/<name>.csv that a run of some methods keeps: those an
    earlier run measured at this commit on this device (`of_this_commit`: clean commits
    only), except those whose `key` column (a method; end_to_end's: a setup) is in `exclude`
    (this run measures them again). So an experiment longer than a GPU session can run its
    methods over several sessions at one commit; rows of other commits and devices are
    dropped (the CSV is rewritten). Each cell comes back as the value written (None, bool,
    int, float; provenance columns, "method", `key` and those named in `text` as written)."""
    path = results_dir() / f"{name}.csv"
    if not path.exists():
        return []
    as_written = {*provenance(), "method", key, *text}
    return [{k: v if k in as_written else _cell(v) for k, v in row.items()}
            for row in read_csv(name)
            if of_this_commit(row) and row.get(key) not in exclude]


def runs(rows: list[dict], key: str = "method") -> dict:
    """{date: [method, ...]}: which of `rows` ran together, in one run (the date it stamped
    on its rows), each row's `key` (a method; end_to_end's: a setup) once. A summary says it
    beside its ratios, which only set side by side two methods of one run (same machine,
    same hour)."""
    together: dict = {}
    for r in rows:
        names = together.setdefault(r.get("date"), [])
        if r[key] not in names:
            names.append(r[key])
    return together


def _cell(text: str | None):
    """A CSV cell as the value a run wrote: '' is None, True/False, an int or float, else
    the text itself."""
    if text in ("", None):
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def write_json(name: str, data) -> pathlib.Path:
    """results/<device>/<name>.json, written whole or not at all."""
    path = results_dir() / f"{name}.json"
    with _atomic(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_summary(name: str, summary: dict) -> pathlib.Path:
    return write_json(f"{name}.summary", {**summary, "provenance": provenance()})


def read_summary(name: str, device: str | None = None) -> dict:
    return json.loads((results_dir(device) / f"{name}.summary.json").read_text())


def is_simulated(rows: list[dict]) -> bool:
    return any("simulator" in r.get("device", "").lower() for r in rows)


def new_figure(rows: list[dict], *args, **kwargs):
    """A matplotlib figure whose title says when its data came from the simulator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(*args, **kwargs)
    if is_simulated(rows):
        fig.text(0.5, 0.5, "SIMULATOR\ntimings not meaningful", ha="center", va="center",
                 fontsize=28, color="red", alpha=0.25, rotation=20, transform=fig.transFigure)
        fig.suptitle(SIM_WARNING, color="red", fontsize=9)
    else:
        fig.suptitle(rows[0]["device"], fontsize=9)
    return fig, axes


def save_figure(fig, name: str, device: str | None = None) -> pathlib.Path:
    path = figures_dir(device) / f"{name}.png"
    import matplotlib.pyplot as plt
    try:
        fig.tight_layout()
        with _atomic(path) as tmp:
            fig.savefig(tmp, dpi=130, format="png")
    finally:
        plt.close(fig)
    return path


def child_env() -> dict:
    """The environment for a child `python -m experiments...` of this checkout: the repo on
    its path, the backend's banner off."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PROTO_QUIET": "1"}


def no_tf32() -> None:
    """PyTorch's float32 must mean float32 beside our kernels: TF32 matmuls and convolutions
    would differ by ~1e-3 and run on other units."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def torch_tf32() -> bool:
    """Whether PyTorch may round float32 products to TF32 now, read from its flags: the CSV
    column `torch_tf32`, never assumed (cuDNN's TF32 default once slipped in)."""
    import torch
    return bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def release_torch_cache() -> int | None:
    """Give the blocks PyTorch's allocator caches but no graph's pool holds back to the
    driver, as a user can ask (torch.cuda.empty_cache); PyTorch's reserved bytes after, or
    None where this process never started PyTorch's CUDA (a method of ours)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def free_memory() -> int | None:
    """Free device bytes once every dropped buffer is freed, Numba's and PyTorch's alike
    (None on the simulator): the one meter of what a method keeps, read in the method's own
    process (experiments.isolate)."""
    if backend.SIMULATOR:
        return None
    release_torch_cache()
    return backend.settled_free_memory()[0]


def significant(x: float, digits: int = 4) -> float:
    """`x` rounded to `digits` significant figures: a rate rounded to fixed decimals reads 0
    where it is small (a copy on the simulator runs at a few MB/s), and a ratio taken of it
    then divides by zero."""
    return float(f"{x:.{digits}g}")


def drop_mib(before: int | None, after: int | None) -> float | None:
    """MiB the free memory fell from `before` to `after` (None if either was not read)."""
    return None if before is None or after is None else round((before - after) / 2**20, 1)


def torch_cuda_graph(fn, pool=None):
    """Capture `fn()` (PyTorch ops) as a torch.cuda.CUDAGraph; returns (graph, fn's result).
    `pool`: a graph_pool_handle() to share with other graphs (None: the graph's own pool).

    Warms up on a side stream first, as torch.cuda.graphs asks: lazy initializations (cuBLAS
    handles, workspaces) must happen before capture, never inside it."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = fn()
    return graph, result


def progress(iterable, desc: str, total: int | None = None):
    """A progress bar on stderr (tqdm) for long runs."""
    from tqdm import tqdm
    # (a log that is not a terminal gets no bars: each redraw would be a line of it)
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def report(name: str, row: dict) -> None:
    """One finished measurement, printed on stderr above the progress bar as soon as it is
    known: a long run that is interrupted still leaves what it measured in its log."""
    from tqdm import tqdm
    shown = {k: v for k, v in row.items() if v is not None and v != ""}
    tqdm.write(f"{name}: " + ", ".join(f"{k}={v}" for k, v in shown.items()), file=sys.stderr)
