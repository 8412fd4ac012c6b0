"""Normal random numbers made on the device: weights that never cross the host (GPT-J-6B's
12 GB of float16 would take minutes and tens of GB of host memory to draw there).

    random.normal(out, seed=0, std=1.0, mean=0.0)

Element i of `out` (flattened, C order) is mean + std * z, with z standard normal by
Box-Muller from the 64 bits of splitmix64's i-th output for `seed` (Steele, Lea and Flood,
2014: state seed + (i + 1) * 0x9E3779B97F4A7C15, then two xor-shift-multiply rounds): the
top 24 bits give u1 in (0, 1], the next 24 u2 in [0, 1), and z = sqrt(-2 ln u1) cos(pi (2 u2
- 1)). So every element depends on (seed, i) only: any grid gives the same array, and
`normal_ref` restates it in NumPy. float32 arithmetic (the hardware's fast cosine, within
2^-21.4), the result rounded once as it is stored (float32 or float16). |z| <= 5.8 (u1 >=
2^-24).
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import cuda, fast_cosf, jit_per_dtype, launch

if backend.SIMULATOR:   # the simulator multiplies NumPy scalars, which warn where they wrap
    warnings.filterwarnings("ignore", "overflow encountered in scalar (multiply|add)")

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = np.uint64
_TWO_M24 = np.float32(2.0 ** -24)
_PI = np.float32(math.pi)
THREADS = 256


def normal_ref(n: int, seed: int) -> np.ndarray:
    """The n standard normal values of `seed`, float64 (the rule in the module doc)."""
    mask = (1 << 64) - 1
    state = (seed + (np.arange(1, n + 1, dtype=object) * _GOLDEN)) & mask
    z = np.array([int(s) for s in state], dtype=np.uint64)
    z = (z ^ (z >> _U64(30))) * _U64(_M1)
    z = (z ^ (z >> _U64(27))) * _U64(_M2)
    z = z ^ (z >> _U64(31))
    u1 = ((z >> _U64(40)).astype(np.float64) + 1) * 2.0 ** -24
    u2 = ((z >> _U64(16)) & _U64(0xFFFFFF)).astype(np.float64) * 2.0 ** -24
    return np.sqrt(-2 * np.log(u1)) * np.cos(np.pi * (2 * u2 - 1))


@jit_per_dtype("void({t}[::1], uint64, float32, float32)", writes=("out",))
def normal_kernels(out, seed, std, mean):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        z = seed + (_U64(i) + _U64(1)) * _U64(_GOLDEN)
        z = (z ^ (z >> _U64(30))) * _U64(_M1)
        z = (z ^ (z >> _U64(27))) * _U64(_M2)
        z = z ^ (z >> _U64(31))
        u1 = (np.float32(np.uint32(z >> _U64(40))) + np.float32(1)) * _TWO_M24
        u2 = np.float32(np.uint32((z >> _U64(16)) & _U64(0xFFFFFF))) * _TWO_M24
        r = math.sqrt(np.float32(-2) * math.log(u1))
        out[i] = mean + std * (r * fast_cosf(_PI * (np.float32(2) * u2 - np.float32(1))))


def normal(out, *, seed: int = 0, std: float = 1.0, mean: float = 0.0, stream=0) -> None:
    """Fill `out` (a C-contiguous float32 or float16 device array) with mean + std * N(0, 1),
    element i from (seed, i) alone (see the module doc). seed: 0 <= seed < 2**64."""
    dtype = _check.float_dtype("out", out)
    _check.device_array("out", out, dtype=dtype)
    if not (_check._is_integer(seed) and 0 <= seed < 2 ** 64):
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed!r}")
    for name, v in (("std", std), ("mean", mean)):
        if not (isinstance(v, (int, float)) and math.isfinite(v)):
            raise ValueError(f"{name}: expected a finite number, got {v!r}")
    if out.size == 0:
        return
    blocks = min(-(-out.size // THREADS), 4096)
    launch(normal_kernels[dtype], blocks, THREADS,
           (backend.reshaped(out, (out.size,)), _U64(seed), np.float32(std), np.float32(mean)),
           stream)
