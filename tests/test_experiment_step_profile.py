"""experiments/step_profile.py, end_to_end's child process, without a GPU: its WHILE profile's
arithmetic and refusal (torch.profiler replaced by fixed totals), and how the child and its
parent keep what was measured when a later part fails."""
import dataclasses
import json
import os
import pathlib
import subprocess
from types import SimpleNamespace

import pytest

from experiments import step_profile
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.search_loop import BeamLoop


def _fake_profile(totals: dict, ran: list):
    """A stand-in for torch.profiler: runs the generation once, reports fixed totals."""
    def profile(replay, n=20):
        replay()
        ran.append(n)
        return totals
    return profile


def _while_spec():
    config = GPT2Config(1, 8, 2, 13, 8)
    return dict(label="toy", config=dataclasses.asdict(config), beam=2, prompt_len=5, max_len=8,
                position=4, step={}, torch=True, part="while")   # what the child is given


def _body_launches_per_token(spec) -> float:
    """What the toy loop's body launches a token (its description's count, per step)."""
    config = GPT2Config(**spec["config"])
    model = GPT2(config, random_state_dict(config, seed=0), max_batch=spec["beam"], max_tokens=4)
    with BeamLoop(model, beam=spec["beam"], max_len=spec["max_len"]) as loop:
        return loop.graph.description.count_kernels() / loop.steps_per_pass


def test_while_kernels_are_reported_per_generated_token(monkeypatch):
    """The WHILE graph's profile (GPU only) divides one whole generation's kernel times by the
    tokens it generated: 4 tokens (prompt 5 to position 8) must give a quarter of each."""
    assert _body_launches_per_token(_while_spec()) <= 22   # what the fake profile reports
    ran = []
    monkeypatch.setattr(step_profile, "_kernels", _fake_profile(
        {"step_kernel": (100.0, 80.0), "search_kernel": (20.0, 8.0)}, ran))
    out = step_profile._measure_step(_while_spec())
    assert ran == [1]
    assert out["row"] == {"while_kernel_sum_us_per_token": 30.0, "while_kernels_per_token": 22.0}
    assert [(r["who"], r["kernel"], r["us_per_step"], r["launches_per_step"])
            for r in out["kernels"]] == [("ours_while", "step_kernel", 25.0, 20.0),
                                         ("ours_while", "search_kernel", 5.0, 2.0)]


def test_a_while_profile_that_missed_kernels_is_refused(monkeypatch):
    """On the H200 the profiler saw a WHILE node's first pass only: a profile with fewer
    launches a token than the loop body makes must fail, not be reported (here half a launch
    a token short, over the 4 tokens generated)."""
    spec = _while_spec()
    body = _body_launches_per_token(spec)
    assert 10 <= body <= 20   # (a step of one layer and the search)
    monkeypatch.setattr(step_profile, "_kernels", _fake_profile(
        {"step_kernel": (100.0, 4 * body - 10.0), "search_kernel": (20.0, 8.0)}, []))
    with pytest.raises(RuntimeError, match=f"{body - 0.5:.2f} kernel launches a token where "
                                           f"the loop body makes {body:.1f}"):
        step_profile._measure_step(spec)


def test_the_child_keeps_the_step_when_the_while_profile_fails(tmp_path, monkeypatch):
    """One child measures every setup, its step, then its WHILE profile: an exception in the
    WHILE profile is recorded and the rest kept; a failing step stops the child there."""
    def fake(spec):
        if spec["part"] == "while" or spec["label"] == "broken":
            raise ValueError("no kernels seen")
        return {"row": {"ours_step_us": 5.0}, "kernels": [{"kernel": spec["label"]}]}

    monkeypatch.setattr(step_profile, "_measure_step", fake)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps([{"label": "4L", "parts": ["step"]},
                                {"label": "12L", "parts": ["step", "while"]}]))
    assert step_profile._child(str(spec), str(out)) == 0
    small, large = json.loads(out.read_text())
    assert small == {"row": {"ours_step_us": 5.0}, "kernels": [{"kernel": "4L"}],
                     "done": ["step"], "failed": {}}
    assert large["kernels"] == [{"kernel": "12L"}] and large["done"] == ["step"]
    assert large["failed"] == {"while": "ValueError: no kernels seen"}
    spec.write_text(json.dumps([{"label": "broken", "parts": ["step", "while"]},
                                {"label": "12L", "parts": ["step"]}]))
    assert step_profile._child(str(spec), str(out)) == 1
    assert [o["done"] for o in json.loads(out.read_text())] == [[]]   # stopped at the failure


def test_step_timings_keeps_what_a_dying_child_wrote(monkeypatch):
    """The parent's side: a child that wrote both steps and then died (or ran out of time)
    gives the steps and a reason for the WHILE profile; a step it never wrote is an error."""

    def child(written, outcome):
        def run(argv, **kw):
            if written is not None:
                pathlib.Path(argv[-1]).write_text(json.dumps(written))
            if outcome == "timeout":
                raise subprocess.TimeoutExpired(argv, kw["timeout"])
            return subprocess.CompletedProcess(argv, outcome)
        return run

    config = GPT2Config(1, 8, 2, 13, 8)
    specs = [step_profile.step_spec(label, config, 2, 1, 8, 4, {}, True, parts)
             for label, parts in (("a", ("step",)), ("b", ("step", "while")))]
    step = {"row": {"ours_step_us": 5.0}, "kernels": [], "done": ["step"], "failed": {}}
    monkeypatch.setattr(step_profile.subprocess, "run", child([step, step], -6))
    (row_a, _, failed_a), (row_b, _, failed_b) = step_profile.step_timings(specs)
    assert row_a == row_b == {"ours_step_us": 5.0} and failed_a == {}
    assert list(failed_b) == ["while"] and "exit status -6" in failed_b["while"]
    monkeypatch.setattr(step_profile.subprocess, "run", child([step, step], "timeout"))
    assert "no answer in 4200 s" in step_profile.step_timings(specs)[1][2]["while"]
    monkeypatch.setattr(step_profile.subprocess, "run", child([step], 1))
    with pytest.raises(RuntimeError, match="b's step timing: the child process failed"):
        step_profile.step_timings(specs)


def test_our_step_is_timed_with_early_launch_and_profiled_without(monkeypatch):
    """Under early launch a kernel's profiled span starts while its predecessor runs, so the
    step's kernels are profiled in a second graph lowered with early launch off, while the
    step time is the default graph's; the variable is as it was afterwards."""
    from proto.graph import cuda as graph_cuda
    monkeypatch.delenv("PROTO_EARLY_LAUNCH", raising=False)

    class Model:
        def decode_read_bytes(self, batch, length):
            return 1000, 10 * length

    class Graphed:   # what _step_timings uses of a GraphedDecoder
        num_nodes, num_graphs, batch, model = 7, 1, 2, Model()

        def __init__(self, name):
            self.name, self.lowered_early, self.replays = name, None, 0

        def replayer(self, position):
            self.lowered_early = graph_cuda.early_launch_switched_on()

            def replay():
                self.replays += 1
            replay.owner = self.name
            return replay

    profiled = []
    monkeypatch.setattr(step_profile, "_kernels",
                        lambda replay, n=20: profiled.append(replay.owner) or {"k": (5.0, 2.0)})
    monkeypatch.setattr(step_profile.timing, "copy_bandwidth_GBps", lambda *a, **k: 1000.0)
    alias, plain, rows = Graphed("alias"), Graphed("plain"), []
    row = step_profile._step_timings("toy", 3, alias, plain, None, None, rows,
                                     step=dict(replays=2, warmup=0, reps=3, copy_bytes=1),
                                     profile=True)
    assert alias.lowered_early is True and plain.lowered_early is False
    assert profiled == ["plain"]
    assert alias.replays == 2 * 3   # the timing replays the default graph alone
    assert "PROTO_EARLY_LAUNCH" not in os.environ
    assert row["ours_kernel_sum_us"] == 5.0 and row["ours_kernels_per_step"] == 2.0
    assert rows == [{"setup": "toy", "who": "ours", "kernel": "k", "us_per_step": 5.0,
                     "launches_per_step": 2.0}]


def _event(name, device, start, end, annotation=None):
    """A profiler event as torch's FunctionEvent exposes it (the fields kernel_tally reads);
    `annotation` None: an older torch's event, which has no is_user_annotation."""
    e = SimpleNamespace(name=name, device_type=device,
                        time_range=SimpleNamespace(elapsed_us=lambda: end - start))
    if annotation is not None:
        e.is_user_annotation = annotation
    return e


def test_the_kernel_tally_counts_kernels_and_nothing_else():
    """Over two calls: the kernels' time and launches a call. Not counted: host events, the
    copies and fills, and the ranges record_function draws on the device timeline (the
    optimizer's "Optimizer.step#AdamW.step" spans the very kernels it launched: counting it
    too had added 6.7 ms a step to transformers' Wav2Vec2 profile at 199 frames)."""
    cpu, gpu = "cpu", "cuda"
    events = [_event("gemm", gpu, 0, 30, False), _event("gemm", gpu, 100, 150),
              _event("adamw", gpu, 40, 50, False), _event("adamw", gpu, 160, 170, False),
              _event("Optimizer.step#AdamW.step", gpu, 35, 60, True),
              _event("Optimizer.step#AdamW.step", gpu, 155, 175, True),
              _event("Memcpy HtoD (Pageable -> Device)", gpu, 60, 90, False),
              _event("Memset (Device)", gpu, 90, 95, False),
              _event("aten::mm", cpu, 0, 400, False)]
    got = step_profile.kernel_tally(events, 2, gpu)
    assert got == {"gemm": (40.0, 1.0), "adamw": (10.0, 1.0)}
