"""Compile the graph layer's own kernels (predication's scope kernels, the conditional
nodes' condition setters and their CUDA C) for a real GPU with no GPU present, beside
kernels.compile_check:

    PROTO_BACKEND=ptx python -m proto.graph.compile_check
"""
import sys

from kernels import compile_check
from proto.device import backend
from proto.graph import cuda

if __name__ == "__main__":
    if not backend.PTX_ONLY:
        sys.exit("run with PROTO_BACKEND=ptx (compile only, no device needed)")
    status = compile_check.main(packages=("proto.graph",))
    failed = cuda.compile_check()
    for line in failed:
        print(f"FAIL {line}")
    print(f"{len(cuda.CONDITION_KERNELS) + 1 - len(failed)} compiled, {len(failed)} failed "
          "(the conditional nodes' condition setters and their CUDA C)")
    sys.exit(1 if failed or status else 0)
