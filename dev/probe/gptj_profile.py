"""Where GPT-J-6B's float16 decode step spends its GPU time: our device-length graph (the
step gptj times against its bandwidth floor) beside PtGraph's graph of the same length, at
one position, beam 5, each kernel's microseconds a step by torch.profiler.

    PYTHONPATH=. python3 -m dev.probe.gptj_profile [POSITION]   (default 512)

Ours is timed in the graph gptj times (early launch on) and profiled in its twin built with
early launch off: under early launch a kernel's span starts while its predecessor runs and
holds its wait, so only the twin gives each kernel its own time. Also prints the step's
bandwidth floor (every weight and the live K and V once at the copy rate measured here).
Random weights drawn on the device (12 GB), viewed by torch without a copy. GPU only; the
process leaves by os._exit (CUPTI beside Numba's context aborts at interpreter teardown).
"""
from __future__ import annotations

import sys

from dev.probe import _profile
from experiments import common
from proto.device import backend, timing
from proto.models.gptj import GPTJ, GPTJ_6B, random_device_state_dict

BEAM, MAX_LEN = 5, 1024


def main(position: int) -> None:
    import torch
    from experiments.torch_gptj import TorchGPTJ
    config = GPTJ_6B
    weights = random_device_state_dict(config, 0)
    model = GPTJ(config, weights, max_batch=BEAM, max_tokens=4)
    _profile.our_step(model, position, BEAM, MAX_LEN)

    dec = TorchGPTJ(config, {k: torch.as_tensor(v, device="cuda") for k, v in weights.items()},
                    batch=BEAM, max_len=MAX_LEN)
    tokens = torch.zeros(BEAM, dtype=torch.int64, device="cuda")
    out = torch.empty(BEAM, config.vocab_size, dtype=dec.dtype, device="cuda")
    graph, _ = common.torch_cuda_graph(lambda: dec.decode_at(tokens, position + 1, out))
    theirs = timing.bench(graph.replay, warmup=3, reps=20)
    _profile.show(f"PtGraph, graph of length {position + 1} (timed: {theirs.median_us:.1f} us)",
                  graph.replay)


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("gptj_profile needs a GPU")
    _profile.run_then_exit(lambda: main(int(sys.argv[1]) if len(sys.argv) > 1 else 512))
