"""Compile every kernel signature for a real GPU (sm_90) on a machine with no GPU.

The simulator runs kernels as Python, so it accepts code that Numba's CUDA compiler rejects
(typing errors, unsupported NumPy calls). This closes that gap without a device, and refuses
a kernel that computes in float64 (see `float64_instructions`):

    PROTO_BACKEND=ptx python -m kernels.compile_check
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import sys

from proto.device import backend
from proto.device.backend import cuda


def float64_instructions(ptx: str) -> list[str]:
    """The PTX instructions that work on float64. Every kernel is float32; double precision
    slips in silently: a Python float constant (the GELU ran 3x slower than torch's, its tanh
    in double), or an unsigned index compared with a signed shape, which Numba compares in
    float64 (a conversion and a double compare in a GEMM's staging loop)."""
    return [line.split()[0] for line in ptx.splitlines()
            if re.match(r"\s*[a-z]\w*(\.\w+)*\.f64\b", line)]


def import_all_kernels(cc=(9, 0), package: str = "kernels") -> None:
    """Import every module of `package`, so that every kernel registers its signatures."""
    # Device functions (cuda.jit(device=True)) ask the current device for its compute
    # capability when they are compiled into a kernel; with no device, answer with `cc`.
    import types
    import numba.cuda.dispatcher as dispatcher
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    root = importlib.import_module(package)
    for mod in pkgutil.iter_modules(root.__path__):
        if not mod.name.startswith(("_", "test_")) and mod.name != "compile_check":
            importlib.import_module(f"{package}.{mod.name}")


def main(cc=(9, 0), packages=("kernels",)) -> int:
    """Compile every kernel of `packages` (the library's by default; the lab's kernels under
    dev/ are checked by `python -m dev.compile_check`)."""
    if not backend.PTX_ONLY:
        sys.exit("run with PROTO_BACKEND=ptx (compile only, no device needed)")
    for package in packages:
        import_all_kernels(cc, package)
    failures = 0
    mine = [(f, sig) for f, sig in backend.KERNEL_SIGNATURES   # (not what they import)
            if any(f.__module__ == p or f.__module__.startswith(p + ".") for p in packages)]
    for pyfunc, sig in mine:
        name = f"{pyfunc.__module__}.{pyfunc.__name__}{sig}"
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=cc)
        except Exception as exc:  # report every failure, not just the first
            failures += 1
            print(f"FAIL {name}\n     {type(exc).__name__}: {str(exc).splitlines()[0]}")
            continue
        doubles = float64_instructions(ptx)
        if doubles:
            failures += 1
            print(f"FAIL {name}\n     {len(doubles)} float64 instructions ({doubles[0]}, ...)")
    print(f"{len(mine) - failures} compiled, {failures} failed ({', '.join(packages)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
