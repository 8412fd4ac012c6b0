"""The decode step alone, timed and profiled, and the WHILE graph's kernels: end_to_end's
child process.

For each setup (`step_spec`), in order:

  step    our alias graph (GraphedDecoder, the position read on the device) replayed at one
          position, against PyTorch's graphed steps there (experiments/torch_gpt2.py): the
          graph of that length attending to the live prefix ("torch") and the static-cache
          graph masked over every position ("torch_masked"); with torch, every kernel of each
          is profiled (torch.profiler, which sees Numba's kernels inside graph replays too);
          ours in a second alias graph built with early launch off, since under early launch
          a kernel's span starts while its predecessor runs and holds its wait: the profile
          gives each kernel's own time, the step time is the default graph's;
          and the step's bandwidth floor, its bytes (every weight once, the live K and V) at
          the copy rate measured in the same process;
  while   the WHILE graph's kernels over one whole generation, per token. The profiler does
          not see kernels inside a WHILE node after its first pass, so they are timed in the
          loop's predicated twin (the same kernels, each behind a flag test, in plain graphs
          the host relaunches every pass); a profile that saw fewer launches a token than
          the loop body makes is refused.

Why a child: CUPTI (loaded by the profiler) beside Numba's CUDA context made the whole
process abort at interpreter exit, so only a process that exits without teardown ever loads
it. One child serves every setup and part, so the kernels compile once.

    python -m experiments.step_profile SPEC.json OUT.json   (end_to_end.run starts it)
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import traceback

import numpy as np

from experiments import common
from proto.device import timing
from proto.graph.cuda import early_launch_off
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedDecoder
from proto.models.search_loop import BeamLoop


def _kernels(replay, n: int = 20) -> dict[str, tuple[float, float]]:
    """{kernel name: (GPU us per replay, launches per replay)} of `replay`, by torch.profiler
    (CUPTI sees every kernel of the process, Numba's and those inside graph replays)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    return kernel_tally(prof.events(), n, DeviceType.CUDA)


def kernel_tally(events, n: int, cuda_device) -> dict[str, tuple[float, float]]:
    """{name: (us per call, launches per call)} of the kernels among profiler `events` of
    `n` calls: events on the device (`cuda_device`), but not copies or fills, and not the
    ranges that record_function marks on the device's timeline (`is_user_annotation`:
    transformers' optimizer step and zero_grad appear there as "Optimizer.step#AdamW.step",
    spanning the kernels they launch, which are counted themselves)."""
    per: dict[str, tuple[float, float]] = {}
    for e in events:
        if (e.device_type == cuda_device and not getattr(e, "is_user_annotation", False)
                and not e.name.startswith(("Memcpy", "Memset"))):
            us, count = per.get(e.name, (0.0, 0.0))
            per[e.name] = (us + e.time_range.elapsed_us() / n, count + 1 / n)
    return per


def _kernel_rows(label: str, who: str, kernels: dict, per: int, kernel_rows: list):
    """Append `kernels` ({name: (us, launches)} of `per` steps or tokens) to `kernel_rows`,
    per step or token, the costliest first; return (their us, their launches) summed per
    step or token."""
    for name, (us, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        kernel_rows.append({"setup": label, "who": who, "kernel": name[:90],
                            "us_per_step": round(us / per, 2),
                            "launches_per_step": round(count / per, 3)})
    return (round(sum(us for us, _ in kernels.values()) / per, 2),
            round(sum(c for _, c in kernels.values()) / per, 2))


def _replay_us(replay, replays: int, warmup: int, reps: int) -> tuple[float, float, float]:
    """(median, p10, p90) in us of one replay, over `reps` samples of `replays` replays."""
    t = timing.bench(lambda: [replay() for _ in range(replays)], warmup=warmup, reps=reps)
    return tuple(round(ms * 1e3 / replays, 2) for ms in (t.median_ms, t.p10_ms, t.p90_ms))


def _step_timings(label: str, position: int, alias, plain, masked, live, kernel_rows: list, *,
                  step: dict, profile: bool) -> dict:
    """Our alias graph's replay (GraphedDecoder), its kernels' sum (`profile`: profiled in
    `plain`, the same graph built with early launch off, so each kernel's span is its own
    time), and PyTorch's graphed steps at `position`: the static cache masked over every
    position ("torch_masked", a graphed TorchDecoder) and the graph of this length attending
    to the live prefix ("torch", a PerLengthDecoder); appends each kernel's share of a step
    to `kernel_rows`."""
    row = {"setup": label, "position": position}
    replays = {"ours": alias.replayer(position)}
    profiled = {}   # who -> the replay profiled instead of the timed one
    if plain is not None:
        with early_launch_off():   # (replayer builds the graph, which lowers it)
            profiled["ours"] = plain.replayer(position)
    if masked is not None:
        replays["torch_masked"] = masked.replayer(position)
    if live is not None:
        live.capture(position + 1)   # the graph of length position + 1: one step
        replays["torch"] = live.graphs[position + 1].replay
    for who, replay in replays.items():
        kernels = _kernels(profiled.get(who, replay)) if profile else None
        (row[f"{who}_step_us"], row[f"{who}_step_p10_us"],
         row[f"{who}_step_p90_us"]) = _replay_us(replay, step["replays"], step["warmup"],
                                                 step["reps"])
        row[f"{who}_kernel_sum_us"], row[f"{who}_kernels_per_step"] = (None, None) \
            if kernels is None else _kernel_rows(label, who, kernels, 1, kernel_rows)
    row["step_samples"] = step["reps"]   # (each of step["replays"] replays)
    row["ours_graph_nodes"] = alias.num_nodes // max(alias.num_graphs, 1)
    # The bandwidth floor: the bytes the step must read (every weight once, the live K and V
    # of every layer) at the device-to-device copy rate measured here.
    weights, kv = alias.model.decode_read_bytes(alias.batch, position + 1)
    gbps = timing.copy_bandwidth_GBps(step["copy_bytes"])
    row.update(weight_bytes=weights, kv_bytes=kv, copy_GBps=common.significant(gbps),
               floor_us=round((weights + kv) / (gbps * 1e3), 2))
    return row


def _while_kernels(label: str, model, beam: int, max_len: int, prompt_len: int,
                   kernel_rows: list) -> dict:
    """The WHILE graph's kernels over one whole generation (the run's prompt to `max_len`),
    per token: where its time per token goes beyond one step. Appends them to `kernel_rows`
    as who="ours_while" (us_per_step and launches_per_step are then per token).

    torch's profiler (CUPTI) records a WHILE node's kernels in its first pass only (seen on
    the H200: 0.35 kernels a token), so the loop runs here as its predicated twin with one
    pass a launch: the same kernels, each behind a flag test, in plain graphs. Raises where
    the profile still saw fewer launches a token than the loop body makes."""
    loop = BeamLoop(model, beam=beam, max_len=max_len, control="predicated", unroll=1)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, prompt_len)
    new = max_len - len(prompt) + 1
    body = loop.graph.description.count_kernels() / loop.steps_per_pass
    steps = []
    try:
        kernels = _kernels(lambda: steps.append(
            loop.generate(prompt, max_new_tokens=new).times.steps), n=1)
    finally:
        loop.close()
    seen = sum(count for _, count in kernels.values()) / steps[-1]
    if seen < body:
        raise RuntimeError(f"the profiler saw {seen:.2f} kernel launches a token where the "
                           f"loop body makes {body:.1f}: the profile is incomplete")
    us, launches = _kernel_rows(label, "ours_while", kernels, steps[-1], kernel_rows)
    return {"while_kernel_sum_us_per_token": us, "while_kernels_per_token": launches}


def _measure_step(spec: dict) -> dict:
    """The setup's model (the parent's weights: the same seed), our alias graph and, with
    torch, PyTorch's graphed steps, built afresh; the decode step at spec["position"] timed, and
    profiled where torch is present; or, for spec["part"] == "while", the WHILE graph's
    kernels over a whole generation (`_while_kernels`). Returns {"row": ..., "kernels": [...]}."""
    config, beam, max_len = GPT2Config(**spec["config"]), spec["beam"], spec["max_len"]
    state_dict = random_state_dict(config, seed=0)
    model = GPT2(config, state_dict, max_batch=beam, max_tokens=max(spec["prompt_len"] - 1, 1),
                 dtype=spec.get("dtype", "float32"))
    if spec["part"] == "while":
        kernel_rows: list = []
        row = _while_kernels(spec["label"], model, beam, max_len, spec["prompt_len"],
                             kernel_rows)
        return {"row": row, "kernels": kernel_rows}
    alias = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias", strategy="device")
    masked = live = plain = None
    profile = spec.get("profile", spec["torch"])
    if profile:
        plain = GraphedDecoder(model, batch=beam, max_len=max_len, binding="alias",
                               strategy="device")
    if spec["torch"]:
        from experiments.torch_gpt2 import PerLengthDecoder, TorchDecoder
        masked = TorchDecoder(config, state_dict, batch=beam, max_len=max_len, graphed=True)
        live = PerLengthDecoder(config, state_dict, batch=beam, max_len=max_len, pool="shared")
    kernel_rows: list = []
    try:
        row = _step_timings(spec["label"], spec["position"], alias, plain, masked, live,
                            kernel_rows, step=spec["step"], profile=profile)
    finally:
        for m in (alias, plain, masked, live):
            if m is not None:
                m.close()
    return {"row": row, "kernels": kernel_rows}


def step_spec(label: str, config: GPT2Config, beam: int, prompt_len: int, max_len: int,
              position: int, step: dict, use_torch: bool, parts: tuple = ("step",),
              dtype=np.float32, profile: bool | None = None) -> dict:
    """What the child measures for one setup (JSON): `parts` in order, "step" first; the
    model in `dtype` (PyTorch's steps, `use_torch`, are float32's). `profile`: our step's
    kernels by torch.profiler too (default: with PyTorch's steps; a float16 setup, which has
    none, asks for them where torch is present)."""
    if use_torch and np.dtype(dtype) != np.float32:
        raise ValueError("use_torch: PyTorch's graphed steps here are float32; got dtype "
                         f"{np.dtype(dtype).name}")
    return dict(label=label, config=dataclasses.asdict(config), beam=beam, prompt_len=prompt_len,
                max_len=max_len, position=position, step=step, torch=use_torch,
                profile=use_torch if profile is None else bool(profile), parts=list(parts),
                dtype=np.dtype(dtype).name)


def step_timings(specs: list[dict]) -> list[tuple[dict, list[dict], dict]]:
    """For each setup's spec (`step_spec`), (step row, kernel rows, {part: why it failed}) from
    `_measure_step`, part after part, in ONE child process (`python -m
    experiments.step_profile SPEC OUT`): the caller never loads CUPTI, and the kernels compile
    once for every setup and part. Every "step" part must succeed; a later part that fails (or kills the
    child, or runs out of time) is reported as failed, and what came before it is kept."""
    limit = sum(1800 if part == "step" else 600 for spec in specs for part in spec["parts"])
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = pathlib.Path(folder, "spec.json"), pathlib.Path(folder, "out.json")
        spec_path.write_text(json.dumps(specs))
        try:   # (a hung child must not hang the run)
            status = subprocess.run([sys.executable, "-m", "experiments.step_profile",
                                     str(spec_path), str(out_path)], cwd=common.REPO,
                                    timeout=limit, env=common.child_env()).returncode
            why = f"the child process failed (exit status {status}); its traceback is above"
        except subprocess.TimeoutExpired:
            why = f"the child process gave no answer in {limit} s; it was stopped"
        outs = json.loads(out_path.read_text()) if out_path.exists() else []
    results = []
    for i, spec in enumerate(specs):
        out = outs[i] if i < len(outs) else {"done": [], "failed": {}}
        if "step" not in out["done"]:
            raise RuntimeError(f"{spec['label']}'s step timing: "
                               f"{out['failed'].get('step', why)}")
        failed = {part: out["failed"].get(part, why) for part in spec["parts"]
                  if part not in out["done"]}
        results.append((out["row"], out["kernels"], failed))
    return results


def _child(spec_path: str, out_path: str) -> int:
    """The child's work: every setup's parts in order, all results written after each part
    (so a part that kills the process leaves the earlier ones). Returns the exit status: 1
    when a "step" part failed (the setups after it are not measured), else 0; a later part's
    exception is recorded under its setup's "failed"."""
    outs = []
    for spec in json.loads(pathlib.Path(spec_path).read_text()):
        out = {"row": {}, "kernels": [], "done": [], "failed": {}}
        outs.append(out)
        for part in spec["parts"]:
            try:
                result = _measure_step({**spec, "part": part})
            except Exception as exc:   # noqa: BLE001  (the parent reports it: step_timings)
                traceback.print_exc()
                out["failed"][part] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                out["row"].update(result["row"])
                out["kernels"] += result["kernels"]
                out["done"].append(part)
            pathlib.Path(out_path).write_text(json.dumps(outs))
            if part == "step" and part not in out["done"]:
                return 1
    return 0


# ------------------------------------------------------------------------- the child's entry
if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m experiments.step_profile SPEC.json OUT.json "
                 "(experiments.end_to_end starts it)")
    try:
        status = _child(sys.argv[1], sys.argv[2])
    except BaseException:
        traceback.print_exc()
        status = 1
    if "torch.profiler" in sys.modules:
        # CUPTI (loaded by the profiler) beside Numba's context aborts in the interpreter's
        # teardown, after the results above are written: leave without it. This process
        # exists to contain that; the parent checks the status and the file.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
