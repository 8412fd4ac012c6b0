"""Kernels load from Numba's on-disk cache in a fresh process (proto.device.backend._compiled),
also those whose closure holds an intrinsic (whose pickle Numba draws afresh in each process),
and the cache never hands one kernel's code to another: two kernels made by one factory line
that differ only in their launch bounds each compile their own.

Each case runs its own Python processes on a kernel module written to a temporary folder
(the cache lives in its __pycache__), so nothing here touches the project's caches.

    PYTHONPATH=. python3 -m pytest -q tests/test_kernel_cache_gpu.py
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]

MODULE = textwrap.dedent('''
    from proto.device.backend import cuda, jit

    def make(threads):
        @jit("void(float32[::1])", writes=("x",), launch_bounds=(threads, 1))
        def add_threads(x):
            i = cuda.grid(1)
            if i < x.size:
                x[i] += 1
        return add_threads

    small, large = make(64), make(1024)

    from kernels._ptx import instruction
    fence = instruction("membar.cta;")   # an intrinsic, held by the kernel's closure

    def make_fenced(barrier):
        @jit("void(float32[::1])", writes=("x",))
        def add_fenced(x):
            barrier()
            i = cuda.grid(1)
            if i < x.size:
                x[i] += 1
        return add_fenced

    fenced = make_fenced(fence)
''')

REPORT = textwrap.dedent('''
    import json, numpy as np
    from proto.device.backend import cuda, launch
    import cached_kernels as m
    out = {}
    for name in ("small", "large", "fenced"):
        k = m.__dict__[name]
        x = cuda.to_device(np.zeros(1024, np.float32))
        launch(k, 1, 1024 if name == "large" else 64, (x,))
        out[name] = {"hits": sum(k._cache_hits.values()),
                     "misses": sum(k._cache_misses.values()), "sum": float(x.copy_to_host().sum())}
    print(json.dumps(out))
''')


def _run(folder: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{ROOT}", PROTO_QUIET="1")
    proc = subprocess.run([sys.executable, "-c", REPORT], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_cached_kernels_and_launch_bounds_keep_them_apart(tmp_path):
    (tmp_path / "cached_kernels.py").write_text(MODULE)
    first = _run(tmp_path)
    assert [first[k]["misses"] for k in ("small", "large")] == [1, 1], first
    assert [first[k]["hits"] for k in ("small", "large")] == [0, 0], first
    second = _run(tmp_path)
    # both from the disk: and the large one still launches 1024 threads, which the small
    # one's code (bounded to 64) would refuse
    assert [second[k]["hits"] for k in ("small", "large")] == [1, 1], second
    assert [second[k]["misses"] for k in ("small", "large")] == [0, 0], second
    assert second["small"]["sum"] == 64 and second["large"]["sum"] == 1024, second
    # the closure holding an intrinsic: a miss in the first process only
    assert (first["fenced"]["misses"], second["fenced"]["hits"]) == (1, 1), (first, second)
    assert second["fenced"]["misses"] == 0 and second["fenced"]["sum"] == 64, second


def test_an_edit_to_a_kernel_module_recompiles_the_kernels_that_may_use_it(tmp_path,
                                                                             monkeypatch):
    """The key holds a digest of kernels/ and proto/device/: a changed digest is a miss."""
    (tmp_path / "cached_kernels.py").write_text(MODULE)
    _run(tmp_path)
    from proto.device import backend
    digest = backend._code_version()
    script = REPORT.replace("import cached_kernels as m",
                            "import proto.device.backend as b\n"
                            "b._CODE_VERSION = 'edited'\n"
                            "import cached_kernels as m")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", PROTO_QUIET="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    edited = json.loads(proc.stdout.strip().splitlines()[-1])
    assert digest != "edited"
    assert [edited[k]["misses"] for k in ("small", "large")] == [1, 1], edited
