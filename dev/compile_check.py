"""Compile the lab's kernels (dev/bench's) for a real GPU with no GPU present, as
kernels.compile_check does for the library's:

    PROTO_BACKEND=ptx python -m dev.compile_check
"""
import sys

from kernels import compile_check

if __name__ == "__main__":
    sys.exit(compile_check.main(packages=("dev.bench", "dev.ab", "dev.profile")))
