"""Where GPT-2 small's float16 decode step spends its GPU time: our device-length graph (the
step end_to_end's 12L-d768-fp16 setup times against its bandwidth floor) at one position,
beam 5, each kernel's microseconds a step by torch.profiler, and the step against its floor.

    PYTHONPATH=. python3 -m dev.probe.gpt2_half_profile [POSITION]   (default 512)

The issue's figure is the step over its floor (at most 3.0): GPT-2 small's float16 weights
(250 MB) and live K and V (94 MB at 512) are read in about 80 us at an H200's copy rate,
so each of a step's launches (about ten a layer) costs a visible share of it. GPU only; the
process leaves by os._exit (CUPTI beside Numba's context aborts at interpreter teardown).
"""
from __future__ import annotations

import sys

import numpy as np

from dev.probe import _profile
from proto.device import backend
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict

BEAM, MAX_LEN = 5, 1024
SMALL = GPT2Config(12, 768, 12, 50257, 1024)   # (end_to_end's)


def main(position: int) -> None:
    model = GPT2(SMALL, random_state_dict(SMALL, seed=0), max_batch=BEAM, max_tokens=4,
                 dtype=np.float16)
    _profile.our_step(model, position, BEAM, MAX_LEN)


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("gpt2_half_profile needs a GPU")
    _profile.run_then_exit(lambda: main(int(sys.argv[1]) if len(sys.argv) > 1 else 512))
