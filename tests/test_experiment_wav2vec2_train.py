"""The wav2vec2_train experiment at toy size: each method in its own process, the CSVs,
summary and figure; the losses of eager and graphed training equal step by step, the
weights bit for bit. Results go to a temporary folder."""
import pytest

from experiments import common, timit, wav2vec2_train as w


def timit_batch(frames: int):
    """A one-utterance batch of `frames` encoder frames (toy model)."""
    import numpy as np
    cfg = w.SIZES["toy"]["config"]
    return timit.Batch(waveform=np.zeros((1, cfg.samples(frames)), np.float32),
                       frames=np.array([frames], np.int32), labels=np.ones((1, 2), np.int32),
                       label_lengths=np.array([2], np.int32))


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_wav2vec2_train_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(w, "METHODS", ["ours_planned", "hf_eager"])
    w.run("toy")
    rows = common.read_csv(w.NAME)
    assert [r["method"] for r in rows][:1] == ["ours_planned"]
    assert all(r["git_commit"] and r["device"] for r in rows)
    assert all(float(r["ms_per_step"]) > 0 and int(r["lengths_served"]) == int(r["lengths"])
               for r in rows)
    planned = next(r for r in rows if r["method"] == "ours_planned")
    lengths = {b.length for b in w.epoch("toy")}
    assert int(planned["graphs"]) == 2 * int(planned["lengths"]) and int(planned["lengths"]) >= 1
    ours = [r for r in common.read_csv(f"{w.NAME}_loss")
            if r["method"] == "ours_planned"]    # (with torch, hf_eager's rows follow)
    assert len(ours) == w.SIZES["toy"]["steps"] and all(float(r["loss"]) > 0 for r in ours)
    assert all(float(r["ms"]) > 0 and int(r["frames"]) in lengths for r in ours)
    summary = common.read_summary(w.NAME)
    assert summary["graphed_equals_eager"] is True
    for key in ("eager_over_ours_step", "ptgraph_over_ours_memory", "loss_matches_reference"):
        assert key in summary
    assert "hf_eager" in summary["unavailable"] or "hf_eager" in summary["ms_per_step"]
    assert w.plot().exists()


def test_summary_ratios_and_the_loss_check():
    """The ratios; the loss check holds where every same-weights pair agrees within twice
    transformers' largest float32 distance from the float64 loss, whatever the free-running
    curves do; no check (no PyTorch) gives None."""
    rows = [{"method": m, "layers": 12, "hidden": 768, "batch": 8, "steps": 3, "lengths": 2,
             "ms_per_step": ms, "kept_mib": mib, "lengths_served": 2}
            for m, ms, mib in (("ours_planned", 50.0, 100.0), ("hf_eager", 80.0, 900.0),
                               ("ptgraph_shared", 70.0, 2500.0))]
    losses = {"ours_planned": [10.0, 9.0, 8.0], "hf_eager": [10.0, 9.0 * (1 + 2e-3), 8.0],
              "ptgraph_shared": [10.0, 9.0 * (1 + 2e-3), 8.0 * 1.5]}
    bits = {"equal": True, "steps": 5}
    # transformers' float32 loss within 1e-6 of the exact one (the steps compared): bound 2e-6
    same = {"ours": [10.0, 9.0 * (1 + 3e-6), 8.0], "reference": [10.0, 9.0, 8.0],
            "exact": [10.0 * (1 + 1e-6), 9.0, 8.0 * (1 + 1e-3)]}
    s = w.summarize(rows, losses, bits, same, curve_steps=2)
    assert s["eager_over_ours_step"] == 1.6 and s["ptgraph_over_ours_memory"] == 25.0
    assert s["loss_matches_reference"] is False and s["loss_steps_compared"] == 2
    assert abs(s["loss_same_weights_max_rel"] - 3e-6) < 1e-12
    assert abs(s["loss_reference_vs_float64_max_rel"] - 1e-6 / (1 + 1e-6)) < 1e-12
    assert abs(s["loss_float32_bound"] - 2e-6 / (1 + 1e-6)) < 1e-12
    assert abs(s["loss_ours_vs_float64_max_rel"] - 3e-6) < 1e-12   # (step 1)
    assert abs(s["loss_free_running_max_rel"] - 2e-3 / (1 + 2e-3)) < 1e-12
    assert s["ptgraph_loss_free_running_max_rel"] == 0.0   # (step 2 lies past curve_steps)
    same["ours"][1] = 9.0 * (1 + 1e-6)
    assert w.summarize(rows, losses, bits, same, 2)["loss_matches_reference"] is True
    none = w.summarize(rows, losses, bits, None, 2)
    assert none["loss_matches_reference"] is None and none["loss_steps_compared"] == 0


def test_a_run_cut_short_keeps_a_summary_naming_what_did_not_run(tmp_path, monkeypatch):
    """After the headline methods, before the checks: the summary holds their ratios, None
    for the checks' figures, and names every method and check still to come, in run order."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    rows = [{"method": m, "layers": 1, "hidden": 8, "batch": 2, "steps": 3, "lengths": 2,
             "ms_per_step": ms, "kept_mib": 10.0, "lengths_served": 2}
            for m, ms in (("ours_planned", 5.0), ("hf_eager", 7.5))]
    w._write_summary(rows, {"ours_planned": [1.0], "hf_eager": [1.0]}, {},
                     {"ptgraph_shared": "no GPU"}, "toy")
    s = common.read_summary(w.NAME)
    assert s["eager_over_ours_step"] == 1.5
    assert s["graphed_equals_eager"] is None and s["loss_matches_reference"] is None
    assert s["methods_not_run"] == ["check_bits", "check_loss"] + w.METHODS[w.HEADLINE:]
    w._write_summary(rows[1:], {}, {}, {}, "toy")   # (no ours_planned row: no ratio)
    assert common.read_summary(w.NAME)["eager_over_ours_step"] is None


def test_a_failing_check_costs_no_later_method_and_fails_the_run(tmp_path, monkeypatch):
    """check_bits failing is ours failing: the methods after it still run, then the run
    raises naming it (and keeps no summary, as for a method of ours that fails)."""
    from experiments import isolate
    monkeypatch.setattr(common, "ROOT", tmp_path)
    asked = []

    def each_method(name, methods, target, size, *, baselines, unavailable):
        for m in methods:
            asked.append(m)
            yield m, {"row": {"method": m, "layers": 1, "hidden": 8, "batch": 2, "steps": 1,
                              "lengths": 1, "ms_per_step": 1.0, "kept_mib": 1.0,
                              "lengths_served": 1},
                      "losses": [1.0], "curve": [], "steps": [{"frames": 4, "ms": 1.0}]}

    def run(target, spec, **_):
        if target.endswith("check_bits"):
            raise isolate.ChildFailed("check_bits: the child process failed")
        return {"ours": [1.0], "reference": [1.0], "exact": [1.0]}
    monkeypatch.setattr(isolate, "each_method", each_method)
    monkeypatch.setattr(isolate, "run", run)
    monkeypatch.setattr(isolate, "torch_missing", lambda *a: None)
    with pytest.raises(isolate.ChildFailed, match="check_bits"):
        w.run("toy")
    assert asked == w.METHODS
    assert not (common.results_dir() / f"{w.NAME}.summary.json").exists()


def test_capture_seconds_leave_out_the_memory_readings(monkeypatch):
    """A method's capture_s is its build's time without the memory curve's readings (whose
    garbage collection grows with what the method keeps), reported apart as meter_s, and its
    steps' times leave out the data loader's part (`prepare`); the
    readings are taken at CURVE_POINTS counts of lengths served, the last among them, and a
    method that runs out of memory between two readings still says how many it served."""
    import time

    class Slow:   # builds in 0.1 s, reading after each of two lengths (the toy epoch
        #           has one: one reading, of 0.3 s)
        def __init__(self, *args):
            pass

        def build(self, lengths, after_each):
            for n in (1, 2):
                time.sleep(0.05)
                after_each(n)

        def prepare(self, batch):   # (the loader's part: 0.2 s, never in a step's time)
            time.sleep(0.2)
            return batch

        def step(self, batch):
            return 1.0

        def info(self):
            return {"graphs": 4}

        def close(self):
            pass
    monkeypatch.setattr(w, "_Ours", Slow)
    monkeypatch.setattr(w, "free_memory", lambda: time.sleep(0.3))
    row = w.measure("ours_planned", "toy")["row"]
    assert 0.1 <= row["capture_s"] < 0.3 and row["meter_s"] >= 0.3
    assert row["ms_per_step"] < 100   # the loader's 0.2 s left out

    class Many(Slow):   # 40 lengths, out of memory after the 30th
        def build(self, lengths, after_each):
            for n in range(1, 41):
                if n == 31:
                    raise RuntimeError("CUDA out of memory")
                after_each(n)
    monkeypatch.setattr(w, "_Ours", Many)
    monkeypatch.setattr(w, "free_memory", lambda: None)
    monkeypatch.setattr(w, "epoch", lambda size: [timit_batch(T) for T in range(60, 100)])
    monkeypatch.setattr(w, "CURVE_POINTS", 4)
    out = w.measure("ours_planned", "toy")
    assert out["row"]["lengths_served"] == 30 and [n for n, _ in out["curve"]] == [1, 14, 27]


def test_the_experiment_and_the_config_load_none_of_our_models_kernels():
    """A process that measures transformers imports this module and the configuration: our
    model's kernels (which a GPU compiles or loads at import) stay out of it."""
    import subprocess
    import sys
    code = ("import sys, experiments.wav2vec2_train, proto.models.wav2vec2_config; "
            "print(sorted(m for m in sys.modules if m in ('kernels.gemm', 'kernels.conv1d', "
            "'kernels.seq_attention', 'proto.models.wav2vec2')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=common.REPO, env=common.child_env(), check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_run_of_some_methods_and_checks_keeps_the_others_of_this_commit(tmp_path,
                                                                          monkeypatch):
    """Two runs at one commit: the second keeps the first's rows, loss and memory curves and
    checks (whose results a JSON file holds), rebuilds the losses from the CSV, and takes no
    ratio across the two runs; one of the same run does. Another commit starts afresh."""
    from experiments import isolate
    monkeypatch.setattr(common, "ROOT", tmp_path)
    here = {"device": "GPU A", "git_commit": "abc123", "date": "d1"}
    monkeypatch.setattr(common, "provenance", lambda: here)
    monkeypatch.setattr(isolate, "torch_missing", lambda *a: None)
    ms = {"ours_planned": 5.0, "hf_eager": 7.5}
    ran = []

    def each_method(name, methods, target, size, *, baselines, unavailable):
        for m in methods:
            ran.append(m)
            yield m, {"row": {"method": m, "layers": 1, "hidden": 8, "batch": 2, "steps": 2,
                              "lengths": 1, "ms_per_step": ms[m], "kept_mib": 1.0,
                              "lengths_served": 1},
                      "losses": [10.0 if m == "ours_planned" else 12.5, 9.0],
                      "curve": [(1, 3.0)], "steps": [{"frames": 4, "ms": 1.0}] * 2}

    def run(target, spec, **_):
        ran.append(target.split(":")[1])
        if target.endswith("check_bits"):
            return {"equal": True, "steps": 1}
        return {"ours": [10.0], "reference": [10.0], "exact": [10.0]}
    monkeypatch.setattr(isolate, "each_method", each_method)
    monkeypatch.setattr(isolate, "run", run)
    w.run("toy", methods=["check_bits", "ours_planned"])
    here["date"] = "d2"
    w.run("toy", methods=["check_loss", "hf_eager"])
    assert ran == ["ours_planned", "check_bits", "hf_eager", "check_loss"]
    assert [(r["method"], r["date"]) for r in common.read_csv(w.NAME)] == [
        ("ours_planned", "d1"), ("hf_eager", "d2")]
    assert [r["method"] for r in common.read_csv(f"{w.NAME}_loss")] == [
        "ours_planned", "ours_planned", "hf_eager", "hf_eager"]
    assert [r["method"] for r in common.read_csv(f"{w.NAME}_curve")] == [
        "ours_planned", "hf_eager"]
    s = common.read_summary(w.NAME)
    assert s["eager_over_ours_step"] is None   # (two runs)
    assert s["graphed_equals_eager"] is True and s["loss_matches_reference"] is True
    assert s["loss_free_running_max_rel"] == 0.2   # (ours_planned's losses, from the CSV)
    assert s["runs"] == {"d1": ["ours_planned", "check_bits"], "d2": ["hf_eager", "check_loss"]}
    assert s["methods_not_run"] == w.METHODS[w.HEADLINE - 1:]
    import json
    stored = json.loads((common.results_dir() / f"{w.NAME}_checks.json").read_text())
    assert {k: c["date"] for k, c in stored.items()} == {"check_bits": "d1", "check_loss": "d2"}
    assert stored["check_bits"]["result"] == {"equal": True, "steps": 1}
    here["date"] = "d3"
    w.run("toy", methods=["ours_planned", "hf_eager"])
    s = common.read_summary(w.NAME)
    assert s["eager_over_ours_step"] == 1.5 and s["graphed_equals_eager"] is True
    here.update(git_commit="def456", date="d4")
    w.run("toy", methods=["ours_planned"])
    s = common.read_summary(w.NAME)
    assert list(s["runs"]) == ["d4"] and s["graphed_equals_eager"] is None
    assert [r["method"] for r in common.read_csv(f"{w.NAME}_loss")] == ["ours_planned"] * 2
