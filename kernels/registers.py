"""Registers, spills and shared memory of every kernel as ptxas compiles them, with no GPU.

    PROTO_BACKEND=ptx python -m kernels.registers [part of a kernel's name ...]

How many blocks of a kernel an SM holds at once is set by its registers a thread, its
shared memory and its threads a block, and several decode experiments won or lost on exactly
that (dev/notes/decode.md: a preload that took attention from 64 to 114 registers halved
its blocks an SM). This compiles every kernel of `kernels` for sm_90 as the GPU does (its
launch bounds and its cap on registers included), runs the CUDA toolkit's `ptxas -v` on the
PTX and prints, per kernel: registers a thread, spill stores and loads, static shared
memory, and the blocks an SM that the H200's limits allow at the launch bounds' threads
(where a kernel declares them). It needs `ptxas` on PATH (a CUDA toolkit; the Python packages do not ship it).

Two differences from the GPU's own compilation: PTX from an NVVM newer than the local
ptxas gets its `.version` line lowered to what ptxas accepts (the instructions our kernels
use exist in both), and ptxas refuses more than 48 KB of static shared memory a block,
which the H200's driver has accepted (the 56 KB of gemm's NN_WIDE_K kernel runs there): such
a kernel is reported with its registers and its size, marked, not as a failure.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile

# The H200's (sm_90) limits an SM.
REGISTERS = 65536
REGISTER_UNIT = 256          # registers are allocated to a warp in units of 256
MAX_THREADS = 2048
MAX_BLOCKS = 32
SHARED = 233472              # 228 KB an SM ...
SHARED_PER_BLOCK = 1024      # ... of which the system reserves 1 KB for each resident block
STATIC_SHARED_LIMIT = 48 * 1024   # what ptxas accepts as static shared memory a block


def parse_ptxas(text: str) -> dict:
    """{'registers', 'spill_stores', 'spill_loads', 'shared'} from `ptxas -v`'s output for
    one entry function (bytes for spills and shared memory)."""
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    smem = re.search(r"(\d+) bytes smem", text)
    if regs is None:
        raise ValueError(f"no register count in ptxas output: {text.strip()[:200]!r}")
    return {"registers": int(regs.group(1)),
            "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0,
            "shared": int(smem.group(1)) if smem else 0}


def blocks_per_sm(registers: int, shared: int, threads: int) -> int:
    """Blocks of `threads` threads an SM holds at once, by the tightest of its limits."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS // per_warp) // warps if per_warp else MAX_BLOCKS
    by_shared = SHARED // (shared + SHARED_PER_BLOCK)
    return min(by_registers, by_shared, MAX_THREADS // (32 * warps), MAX_BLOCKS)


def _run_ptxas(ptx: str, cc: tuple, max_registers: int | None = None) -> str:
    """ptxas -v's output (stdout and stderr) for `ptx`, registers capped at `max_registers`
    where the kernel asks (Numba passes its `max_registers` to the linker, not into the PTX)."""
    cap = [] if max_registers is None else [f"-maxrregcount={max_registers}"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-v", *cap, f.name, "-o",
                              "/dev/null"], capture_output=True, text=True)
    return run.stdout + run.stderr


def _ptxas(ptx: str, cc: tuple, max_registers: int | None = None) -> str:
    """ptxas -v's output for `ptx`, its .version lowered if ptxas asks for an older one."""
    out = _run_ptxas(ptx, cc, max_registers)
    newest = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", out)
    if newest:
        out = _run_ptxas(re.sub(r"^\.version [\d.]+", f".version {newest.group(1)}", ptx,
                                count=1, flags=re.M), cc, max_registers)
    return out


def main(argv=None, cc=(9, 0)) -> int:
    from proto.device import backend
    if not backend.PTX_ONLY:
        sys.exit("run with PROTO_BACKEND=ptx (compile only, no device needed)")
    if shutil.which("ptxas") is None:
        sys.exit("ptxas not found on PATH: it comes with a CUDA toolkit")
    from kernels import compile_check
    compile_check.import_all_kernels(cc)
    wanted = list(sys.argv[1:] if argv is None else argv)
    print(f"{'kernel':58s} {'regs':>4s} {'spill st/ld':>11s} {'smem':>7s}  blocks an SM "
          f"(at its launch bounds' threads)")
    failures = 0
    for pyfunc, sig in backend.KERNEL_SIGNATURES:
        name = f"{pyfunc.__module__.removeprefix('kernels.')}.{pyfunc.__qualname__.split('.')[-1]}"
        if wanted and not any(w in name for w in wanted):
            continue
        bounds = backend.LAUNCH_BOUNDS.get(pyfunc)
        ptx, _ = backend.cuda.compile_ptx(pyfunc, sig, cc=cc, launch_bounds=bounds)
        out = _ptxas(ptx, cc, backend.MAX_REGISTERS.get(pyfunc))
        try:
            info = parse_ptxas(out)
        except ValueError as exc:
            failures += 1
            print(f"{name:58s} FAIL {exc}")
            continue
        note = ""
        if bounds:
            note = f"{blocks_per_sm(info['registers'], info['shared'], bounds[0])} at {bounds[0]}"
            if len(bounds) > 1 and bounds[1]:
                note += f" (bounds ask {bounds[1]})"
        if info["shared"] > STATIC_SHARED_LIMIT:
            note += "  [static shared > 48 KB: refused by ptxas, see the module's docstring]"
        spills = f"{info['spill_stores']}/{info['spill_loads']}"
        print(f"{name:58s} {info['registers']:4d} {spills:>11s} {info['shared']:7d}  {note}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
