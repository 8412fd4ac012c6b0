"""Where a token of the LSTM's graphed loop goes on the GPU, beside PtGraph's (cuDNN): both
run graph_memory's shrinking loop (2 layers, 512 -> 1024, vocab 10000; batch 64 down to 1,
one graph a batch size, an argmax after each step), timed (median of 5 loops, wall) and then
profiled (torch.profiler over one loop each, which sees the kernels inside graph replays).
Prints each kernel function's own time and launches a token (copies left out), both sums,
and what the wall time adds to the kernels' (gaps between them, and host time the GPU
waits for).

    PYTHONUNBUFFERED=1 python3 -m dev.profile.profile_lstm 2>&1 | tee $OUT/profile_lstm.txt

GPU and PyTorch only (it exits with status 2 without them)."""
import os
import sys

import numpy as np

from proto.device import timing

LOOPS = 5


def main() -> int:
    from experiments import end_to_end, graph_memory as gm, step_profile
    torch = gm._torch()
    if torch is None:
        print("profile_lstm: needs a GPU and PyTorch")
        return 2
    from proto.models.graphed import GraphedLSTM
    from proto.models.lstm import LSTMConfig, LSTMLM, random_state_dict
    config, B = LSTMConfig(2, 512, 1024, 10000), 64
    state_dict = random_state_dict(config, seed=0)
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, B)
    ours = GraphedLSTM(LSTMLM(config, state_dict, max_batch=B), max_batch=B, binding="alias",
                       strategy="exact")
    ours.build_all()
    theirs = gm._TorchLSTMGraphs(config, state_dict, B, "shared")
    for b in range(B, 0, -1):
        theirs.capture(b)
    loops = {"ours (planned, alias, exact)": lambda: gm._ours_lstm_shrinking(ours, prompt),
             "PtGraph (cuDNN, shared pool)": lambda: theirs.shrinking(prompt)}
    for name, run in loops.items():
        wall = timing.bench_host(run, warmup=2, reps=LOOPS)
        kernels: dict[str, list[float]] = {}   # {function: [us, launches]} of one loop
        for full, (us, n) in step_profile._kernels(run, n=1).items():
            entry = kernels.setdefault(end_to_end.kernel_function(full)[:70], [0.0, 0.0])
            entry[0] += us
            entry[1] += n
        token = wall.median_us / B
        total = sum(us for us, _ in kernels.values()) / B
        print(f"\n{name}: {token:.1f} us a token wall (median of {LOOPS}, p10-p90 "
              f"{wall.p10_ms * 1e3 / B:.1f}-{wall.p90_ms * 1e3 / B:.1f}); kernels {total:.1f} us "
              f"a token, {sum(n for _, n in kernels.values()) / B:.1f} launches; "
              f"wall over kernels {token - total:.1f} us")
        for kname, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
            print(f"  {us / B:8.2f} us  {n / B:5.2f} a token  {kname}")
    ours.close()
    theirs.close()
    return 0


if __name__ == "__main__":
    code = main()
    # torch.profiler's CUPTI beside Numba's CUDA context aborts the interpreter's teardown
    # (seen on the H200): everything is printed; leave now.
    sys.stdout.flush()
    os._exit(code)
