"""The end_to_end experiment at toy size: it runs, every method generates the eager tokens,
the CSV, summary and both figures are written, and the summary carries the headline keys the
README quotes. Results go to a temporary folder (a GPU test run never overwrites full results).
The decode step alone is timed (and on a GPU profiled) in a child process: this one must never
start torch.profiler, whose CUPTI beside Numba's context aborted the interpreter at exit."""
import dataclasses
import json
import pathlib
import subprocess

import numpy as np
import pytest

from experiments import common, end_to_end


def test_end_to_end_toy_run_writes_results_and_figures(tmp_path, monkeypatch):
    def no_profiling_here(replay, n=20):
        raise AssertionError("torch.profiler ran in the test process, not in the child")

    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(end_to_end, "_kernels", no_profiling_here)
    end_to_end.run("toy")
    rows = common.read_csv("end_to_end")
    methods = [r["method"] for r in rows]
    assert methods[:4] == end_to_end.METHODS[:4]   # eager, PtGraph, Grape, WHILE graph
    for r in rows:
        assert float(r["ms_per_token"]) > 0 and int(r["tokens"]) == 2
        assert r["same_tokens_as_eager"] == "True"
        assert int(r["reps"]) == 2 and float(r["p10_ms_per_token"]) <= float(r["ms_per_token"]) \
            <= float(r["p90_ms_per_token"])
        assert float(r["model_ms"]) > 0 and min(float(r[k]) for k, _ in end_to_end.PHASES) >= 0
        assert r["git_commit"] and r["device"]  # provenance on every row
    step = common.read_csv("end_to_end_step")   # measured by the child process
    assert [r["setup"] for r in step] == ["toy-1L-d8"] and float(step[0]["ours_step_us"]) > 0
    assert int(step[0]["ours_graph_nodes"]) > 0
    # The bandwidth floor's bytes, restated: V*d (the tied embedding, once), the final layer
    # norm 2d, one wpe row d, and per layer 12 d^2 + 13 d weights (two layer norms 4d, qkv
    # 3d^2 + 3d, projection d^2 + d, fc 4d^2 + 4d, MLP projection 4d^2 + d); K and V of 1
    # layer, beam 2, d wide, at the step's position 1 (2 live positions).
    d, V = 8, 13
    assert int(step[0]["weight_bytes"]) == 4 * (V * d + 3 * d + 12 * d * d + 13 * d)
    assert int(step[0]["kv_bytes"]) == 4 * 2 * 1 * 2 * d * 2
    assert float(step[0]["floor_us"]) > 0 and float(step[0]["copy_GBps"]) > 0
    by = {r["method"]: r for r in rows}
    assert int(by["graph_alias_device"]["bytes_copied_per_step"]) == 0
    # PtGraph copies, at position p, the tokens (beam 2, int32) and the reordered KV cache's
    # live prefix (1 layer, k and v, beam 2, 8 wide, p positions); positions 0 and 1.
    per_step = [2 * 4 + 2 * 2 * 8 * p * 4 for p in range(2)]
    assert int(by["graph_copy_exact"]["bytes_copied_per_step"]) == round(np.mean(per_step))
    summary = common.read_summary("end_to_end")
    assert summary["alias_bytes_copied_per_step"] == 0
    assert 0 <= summary["alias_binding_fraction_of_step"] < 1
    assert summary["copy_exact_graphs"] == 2 and summary["alias_device_graphs"] == 2
    assert summary["all_ours_same_tokens"] is True
    assert summary["while_over_alias_per_token"] > 0 and summary["while_per_token_over_step"] > 0
    assert set(summary["ms_per_token_by_setup"]["toy-1L-d8"]) == set(methods)
    assert summary["step_over_bandwidth_floor"] == \
        float(step[0]["ours_step_us"]) / float(step[0]["floor_us"])
    assert summary["ours_graph_nodes_per_step"] == int(step[0]["ours_graph_nodes"])
    for key in ("graphed_step_over_kernel_sum", "ours_over_torch_graph_step"):
        assert key in summary  # measured on a GPU only (None on the simulator)
    figure = end_to_end.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)
    phases = figure.with_name("end_to_end_phases.png")
    assert phases.exists() and phases.stat().st_size > 10_000


def _fake_profile(totals: dict, ran: list):
    """A stand-in for torch.profiler: runs the generation once, reports fixed totals."""
    def profile(replay, n=20):
        replay()
        ran.append(n)
        return totals
    return profile


def _while_spec():
    from proto.models.gpt2 import GPT2Config
    config = GPT2Config(1, 8, 2, 13, 8)
    return dict(label="toy", config=dataclasses.asdict(config), beam=2, prompt_len=5, max_len=8,
                position=4, step={}, torch=True, part="while")   # what the child is given


def _body_launches_per_token(spec) -> float:
    """What the toy loop's body launches a token (its description's count, per step)."""
    from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
    config = GPT2Config(**spec["config"])
    model = GPT2(config, random_state_dict(config, seed=0), max_batch=spec["beam"], max_tokens=4)
    with end_to_end.BeamLoop(model, beam=spec["beam"], max_len=spec["max_len"]) as loop:
        return loop.graph.description.count_kernels() / loop.steps_per_pass


def test_while_kernels_are_reported_per_generated_token(monkeypatch):
    """The WHILE graph's profile (GPU only) divides one whole generation's kernel times by the
    tokens it generated: 4 tokens (prompt 5 to position 8) must give a quarter of each."""
    assert _body_launches_per_token(_while_spec()) <= 22   # what the fake profile reports
    ran = []
    monkeypatch.setattr(end_to_end, "_kernels", _fake_profile(
        {"step_kernel": (100.0, 80.0), "search_kernel": (20.0, 8.0)}, ran))
    out = end_to_end._measure_step(_while_spec())
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
    monkeypatch.setattr(end_to_end, "_kernels", _fake_profile(
        {"step_kernel": (100.0, 4 * body - 10.0), "search_kernel": (20.0, 8.0)}, []))
    with pytest.raises(RuntimeError, match=f"{body - 0.5:.2f} kernel launches a token where "
                                           f"the loop body makes {body:.1f}"):
        end_to_end._measure_step(spec)


def test_kernel_families_name_the_h200_profiles_kernels():
    """The WHILE figure groups kernels by family from their profiled (mangled) names."""
    names = {
        "kernels::gemm::make_decode_nn::_3clocals_3e::gemm_decode_nn_kernel[abi:v96]": "layer GEMMs",
        "kernels::gemm::gemm_splitk_reduce_ln_kernel[abi:v87][abi:cw51cXTLSUwv1sDU": "split-K reduce + layer norm",
        "kernels::gemm::make_decode_nt::_3clocals_3e::gemm_decode_nt_kernel[abi:v100]": "head GEMM",
        "kernels::attention::make_attention::_3clocals_3e::attention_kernel[abi:v134]": "attention",
        "kernels::attention::attention_combine_kernel[abi:v137]": "attention combine",
        "kernels::attention::reorder_rows_kernel[abi:v1]": "reorder",
        "kernels::embedding::embed_kernel[abi:v139]": "embedding",
        "kernels::softmax::log_softmax_partials_kernel[abi:v1]": "beam top-k",
        "kernels::sampling::beam_choose_kernel[abi:v1]": "beam choice",
        "proto::graph::cuda::continue_loop[abi:v1]": "loop control",
        # the WHILE profile's predicated twins (proto.backend.predicated) and scope kernels
        "kernels::sampling::predicated_beam_topk_kernel[abi:v2]": "beam top-k",
        "kernels::attention::predicated_attention_combine_kernel[abi:v3]": "attention combine",
        "proto::graph::predicate::pass_scope_kernel[abi:v4]": "loop control",
        "void at::native::vectorized_elementwise_kernel<4>": "other",
    }
    assert {n: end_to_end.kernel_family(n) for n in names} == names


def test_while_figure_stacks_a_token_against_a_step(tmp_path, monkeypatch):
    """Drawn from the CSVs alone (a GPU run writes them; here they are made up), and only
    where the WHILE graph was profiled."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    common.write_csv("end_to_end", [{"setup": "12L", "method": "graph_while",
                                     "ms_per_token": 0.84}])
    common.write_csv("end_to_end_step", [{"setup": "12L", "ours_step_us": 664.0}])
    kernels = [{"setup": "12L", "who": "ours", "kernel": "gemm_decode_nn_kernel",
                "us_per_step": 315.0, "launches_per_step": 48},
               {"setup": "12L", "who": "torch", "kernel": "sgemm", "us_per_step": 900.0,
                "launches_per_step": 48}]
    common.write_csv("end_to_end_kernels", kernels)
    end_to_end._plot_while_kernels()
    figure = common.figures_dir() / "end_to_end_while.png"
    assert not figure.exists()   # no WHILE profile: no figure
    kernels += [{"setup": "12L", "who": "ours_while", "kernel": "gemm_decode_nn_kernel",
                 "us_per_step": 316.0, "launches_per_step": 48},
                {"setup": "12L", "who": "ours_while", "kernel": "beam_choose_kernel",
                 "us_per_step": 3.0, "launches_per_step": 1}]
    common.write_csv("end_to_end_kernels", kernels)
    end_to_end._plot_while_kernels()
    assert figure.exists() and figure.stat().st_size > 10_000


def test_the_child_keeps_the_step_when_the_while_profile_fails(tmp_path, monkeypatch):
    """One child measures every setup, its step, then its WHILE profile: an exception in the
    WHILE profile is recorded and the rest kept; a failing step stops the child there."""
    def fake(spec):
        if spec["part"] == "while" or spec["label"] == "broken":
            raise ValueError("no kernels seen")
        return {"row": {"ours_step_us": 5.0}, "kernels": [{"kernel": spec["label"]}]}

    monkeypatch.setattr(end_to_end, "_measure_step", fake)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps([{"label": "4L", "parts": ["step"]},
                                {"label": "12L", "parts": ["step", "while"]}]))
    assert end_to_end._child(str(spec), str(out)) == 0
    small, large = json.loads(out.read_text())
    assert small == {"row": {"ours_step_us": 5.0}, "kernels": [{"kernel": "4L"}],
                     "done": ["step"], "failed": {}}
    assert large["kernels"] == [{"kernel": "12L"}] and large["done"] == ["step"]
    assert large["failed"] == {"while": "ValueError: no kernels seen"}
    spec.write_text(json.dumps([{"label": "broken", "parts": ["step", "while"]},
                                {"label": "12L", "parts": ["step"]}]))
    assert end_to_end._child(str(spec), str(out)) == 1
    assert [o["done"] for o in json.loads(out.read_text())] == [[]]   # stopped at the failure


def test_step_timings_keeps_what_a_dying_child_wrote(monkeypatch):
    """The parent's side: a child that wrote both steps and then died (or ran out of time)
    gives the steps and a reason for the WHILE profile; a step it never wrote is an error."""
    from proto.models.gpt2 import GPT2Config

    def child(written, outcome):
        def run(argv, **kw):
            if written is not None:
                pathlib.Path(argv[-1]).write_text(json.dumps(written))
            if outcome == "timeout":
                raise subprocess.TimeoutExpired(argv, kw["timeout"])
            return subprocess.CompletedProcess(argv, outcome)
        return run

    config = GPT2Config(1, 8, 2, 13, 8)
    specs = [end_to_end.step_spec(label, config, 2, 1, 8, 4, {}, True, parts)
             for label, parts in (("a", ("step",)), ("b", ("step", "while")))]
    step = {"row": {"ours_step_us": 5.0}, "kernels": [], "done": ["step"], "failed": {}}
    monkeypatch.setattr(end_to_end.subprocess, "run", child([step, step], -6))
    (row_a, _, failed_a), (row_b, _, failed_b) = end_to_end.step_timings(specs)
    assert row_a == row_b == {"ours_step_us": 5.0} and failed_a == {}
    assert list(failed_b) == ["while"] and "exit status -6" in failed_b["while"]
    monkeypatch.setattr(end_to_end.subprocess, "run", child([step, step], "timeout"))
    assert "no answer in 4200 s" in end_to_end.step_timings(specs)[1][2]["while"]
    monkeypatch.setattr(end_to_end.subprocess, "run", child([step], 1))
    with pytest.raises(RuntimeError, match="b's step timing: the child process failed"):
        end_to_end.step_timings(specs)
