"""The on-disk kernel cache's key names a kernel the same in every process: the digest of
its closure (proto.device.backend.closure_digest) for every kernel of the project, computed
in two processes with different string hashing, by the `ptx` backend (compiles for a GPU,
needs none). Numba's own key pickles the closure, and the pickle of an intrinsic carries a
uuid drawn afresh in each process, so about 30 kernels compiled again in every process.
Whether a fresh process then loads them from the disk is tests/test_kernel_cache_gpu.py's."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from proto.device import backend

ROOT = Path(__file__).resolve().parents[1]

DIGESTS = """
import json
from kernels.compile_check import import_all_kernels
from proto.device import backend
import_all_kernels()
print(json.dumps([[f"{fn.__module__}.{fn.__qualname__}", backend.closure_digest(fn)]
                  for fn, _ in backend.KERNEL_SIGNATURES]))
"""


def _digests(seed: int) -> list:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # (the tests')
    env.update(PYTHONPATH=str(ROOT), PROTO_BACKEND="ptx", PROTO_QUIET="1",
               PYTHONHASHSEED=str(seed))
    proc = subprocess.run([sys.executable, "-c", DIGESTS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernels_closure_digest_is_the_same_in_every_process():
    first, second = _digests(1), _digests(2)
    assert len(first) > 150   # (every kernel of the project: compile_check's count)
    differ = [name for (name, a), (_, b) in zip(first, second) if a != b]
    assert [n for n, _ in first] == [n for n, _ in second] and differ == [], differ
    # among them the factories' kernels whose closures hold intrinsics
    names = {n for n, _ in first}
    assert any("gemm_decode_mma_kernel" in n for n in names)
    assert any("gemm_tiled_kernel" in n for n in names)


def test_the_digest_tells_a_factorys_kernels_apart_by_what_they_close_over():
    """Two closures of one function differ by a value they hold, or by a device function's
    own closure; the same values give the same digest."""
    def make(scale, helper):
        def kernel(x):
            return helper(x) * scale
        return kernel

    def make_helper(shift):
        def helper(x):
            return x + shift
        return helper

    digest = backend.closure_digest
    a = digest(make(np.float32(2), make_helper(1)))
    assert a == digest(make(np.float32(2), make_helper(1)))
    assert a != digest(make(np.float32(3), make_helper(1)))
    assert a != digest(make(np.float32(2), make_helper(2)))
