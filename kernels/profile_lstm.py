"""Where a token of the LSTM's graphed loop goes on the GPU, beside PtGraph's (cuDNN): both
run graph_memory's shrinking loop (2 layers, 512 -> 1024, vocab 10000; batch 64 down to 1,
one graph a batch size, an argmax after each step), timed (median of 5 loops, wall) and then
profiled (torch.profiler over one loop each, which sees the kernels inside graph replays).
Prints each kernel name's own time and launches a token, both sums, and what the wall time
adds to the kernels' (gaps between them, and host time the GPU waits for).

    PYTHONUNBUFFERED=1 python3 -m kernels.profile_lstm 2>&1 | tee $OUT/profile_lstm.txt

GPU and PyTorch only (it exits with status 2 without them)."""
import os
import re
import statistics
import sys
import time

import numpy as np

from proto import backend

LOOPS = 5


def kernel_name(name: str) -> str:
    """A short name for a profiler event: the last `..._kernel` of a Numba kernel's mangled
    name, else the name up to its argument list; at most 70 characters."""
    found = re.findall(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*_kernel", name)
    return (found[-1] if found else name.split("(")[0])[:70]


def by_kernel(torch, run) -> dict[str, list[float]]:
    """{kernel name: [total us, launches]} of the GPU kernels while `run()` executes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for evt in prof.events():
        if "CUDA" in str(getattr(evt, "device_type", "")):
            entry = out.setdefault(kernel_name(evt.name), [0.0, 0])
            entry[0] += evt.time_range.elapsed_us()
            entry[1] += 1
    return out


def main() -> int:
    from experiments import graph_memory as gm
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
        for _ in range(2):   # warm-up
            run()
        backend.synchronize()
        walls = []
        for _ in range(LOOPS):
            t0 = time.perf_counter()
            run()
            backend.synchronize()
            walls.append((time.perf_counter() - t0) / B * 1e6)
        kernels = by_kernel(torch, run)
        wall = statistics.median(walls)
        total = sum(us for us, _ in kernels.values()) / B
        print(f"\n{name}: {wall:.1f} us a token wall (median of {LOOPS}, min {min(walls):.1f}, "
              f"max {max(walls):.1f}); kernels {total:.1f} us a token, "
              f"{sum(n for _, n in kernels.values()) / B:.1f} launches; "
              f"wall over kernels {wall - total:.1f} us")
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
