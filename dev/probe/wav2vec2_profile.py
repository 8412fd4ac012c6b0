"""Where a Wav2Vec2 training step spends its GPU time: ours (eager, kernel by kernel; the
graphed step launches the same kernels) beside transformers' eager float32 step (TF32 off),
at a few frame counts of the epoch, each kernel's microseconds a step by torch.profiler.

    PYTHONPATH=. python3 -m dev.probe.wav2vec2_profile [FRAMES ...]   (default 120 199: the epoch's
    median batch and its longest)

Prints, per frame count and method, the step's wall time (5 steps after 3 warm-up), its
kernels' summed GPU time, and the costliest kernels; the kernels are grouped by name with
their launches a step. GPU only. The process leaves by os._exit: CUPTI beside Numba's
context aborts at interpreter teardown (experiments/step_profile.py says more).
"""
from __future__ import annotations

import sys
import time

from dev.probe import _profile
from experiments import common, timit
from experiments.wav2vec2_train import on_device
from proto.device import backend
from proto.models import wav2vec2 as w2v

SEED, BATCH, STEPS, TOP = 0, 8, 5, 25


def batch_of(config, frames: int) -> timit.Batch:
    """A batch of 8 synthetic utterances of exactly `frames` frames."""
    waves, texts = timit.synthetic_utterances(config, BATCH, min_frames=frames,
                                              max_frames=frames, seed=frames)
    (b,) = timit.make_batches(config, waves, texts, batch=BATCH, seed=SEED)
    assert b.length == frames, (b.length, frames)
    return b


def wall_ms(step, b) -> float:
    for _ in range(3):
        step(b)
    t = time.perf_counter()
    for _ in range(STEPS):
        step(b)
    return (time.perf_counter() - t) * 1e3 / STEPS


def show(label: str, step, b) -> None:
    _profile.show(label, lambda: step(b), wall_ms(step, b), n=STEPS, top=TOP)


def main(frames: list[int]) -> None:
    config = w2v.BASE
    state = w2v.random_state_dict(config, SEED)
    ours = w2v.Wav2Vec2ForCTC(config, state)

    def ours_step(b):
        return float(ours.train_step(*on_device(b)).copy_to_host()[0])

    from experiments import torch_wav2vec2 as tw
    common.no_tf32()
    hf = tw.HFTrainer(config, state)
    print(f"device: {backend.device_name()}  batch {BATCH}  float32, TF32 off "
          f"(torch_tf32={common.torch_tf32()})", flush=True)
    for t in frames:
        b = batch_of(config, t)
        show(f"ours eager, T {t}", ours_step, b)
        prepared = hf.prepare(b)   # (the loader's part, outside the profiled step)
        show(f"transformers eager, T {t}", lambda _: hf.step(prepared), b)


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("wav2vec2_profile needs a GPU")
    _profile.run_then_exit(lambda: main([int(a) for a in sys.argv[1:]] or [120, 199]))
