"""Compile every kernel signature for a real GPU (sm_90) on a machine with no GPU.

The simulator runs kernels as Python, so it accepts code that Numba's CUDA compiler rejects
(typing errors, unsupported NumPy calls). This closes that gap without a device:

    PROTO_BACKEND=ptx python -m kernels.compile_check
"""
from __future__ import annotations

import importlib
import pkgutil
import sys

from proto import backend
from proto.backend import cuda


def main(cc=(9, 0)) -> int:
    if not backend.PTX_ONLY:
        sys.exit("run with PROTO_BACKEND=ptx (compile only, no device needed)")
    # Device functions (cuda.jit(device=True)) ask the current device for its compute
    # capability when they are compiled into a kernel; with no device, answer with `cc`.
    import types
    import numba.cuda.dispatcher as dispatcher
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    import kernels
    for mod in pkgutil.iter_modules(kernels.__path__):
        if not mod.name.startswith("_") and mod.name != "compile_check":
            importlib.import_module(f"kernels.{mod.name}")
    failures = 0
    for pyfunc, sig in backend.KERNEL_SIGNATURES:
        name = f"{pyfunc.__module__}.{pyfunc.__name__}{sig}"
        try:
            cuda.compile_ptx(pyfunc, sig, cc=cc)
        except Exception as exc:  # report every failure, not just the first
            failures += 1
            print(f"FAIL {name}\n     {type(exc).__name__}: {str(exc).splitlines()[0]}")
    # The graph layer's own kernels: the conditional nodes' setters and their CUDA C shim.
    from proto.graph import cuda as graph_cuda
    graph_failures = graph_cuda.compile_check(cc)
    for line in graph_failures:
        print(f"FAIL {line}")
    failures += len(graph_failures)
    total = len(backend.KERNEL_SIGNATURES) + len(graph_cuda.CONDITION_KERNELS) + 1
    print(f"{total - failures} compiled, {failures} failed "
          f"(every kernel, the graph layer's condition setters and their CUDA C)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
