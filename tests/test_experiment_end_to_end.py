"""The end_to_end experiment at toy size: it runs, every method generates the eager tokens,
the CSV, summary and both figures are written, and the summary carries the headline keys the
README quotes. Results go to a temporary folder (a GPU test run never overwrites full results).
The decode step alone is timed (and on a GPU profiled) in a child process: this one must never
start torch.profiler, whose CUPTI beside Numba's context aborted the interpreter at exit."""
import numpy as np
import pytest

from experiments import common, end_to_end, step_profile
from proto.device import backend


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_end_to_end_toy_run_writes_results_and_figures(tmp_path, monkeypatch):
    def no_profiling_here(replay, n=20):
        raise AssertionError("torch.profiler ran in the test process, not in the child")

    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(step_profile, "_kernels", no_profiling_here)
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
    half_setup = [] if backend.SIMULATOR else ["toy-1L-d8-fp16"]   # (SIZES["toy"])
    assert [r["setup"] for r in step] == ["toy-1L-d8"] + half_setup
    assert float(step[0]["ours_step_us"]) > 0
    # the step's spread over its samples, as every per-token figure has
    assert float(step[0]["ours_step_p10_us"]) <= float(step[0]["ours_step_us"]) \
        <= float(step[0]["ours_step_p90_us"]) and int(step[0]["step_samples"]) == 2
    assert int(step[0]["ours_graph_nodes"]) > 0
    # The bandwidth floor's bytes, restated: V*d (the tied embedding, once), the final layer
    # norm 2d, one wpe row d, and per layer 12 d^2 + 13 d weights (two layer norms 4d, qkv
    # 3d^2 + 3d, projection d^2 + d, fc 4d^2 + 4d, MLP projection 4d^2 + d); K and V of 1
    # layer, beam 2, d wide, at the step's position 1 (2 live positions).
    d, V = 8, 13
    assert int(step[0]["weight_bytes"]) == 4 * (V * d + 3 * d + 12 * d * d + 13 * d)
    assert int(step[0]["kv_bytes"]) == 4 * 2 * 1 * 2 * d * 2
    if half_setup:   # the float16 setup: the same elements, two bytes each
        assert int(step[1]["weight_bytes"]) == 2 * (V * d + 3 * d + 12 * d * d + 13 * d)
        assert int(step[1]["kv_bytes"]) == 2 * 2 * 1 * 2 * d * 2
        half = [r for r in rows if r["setup"] == "toy-1L-d8-fp16"]
        assert [r["method"] for r in half] == [
            m for m in end_to_end.SIZES["toy"]["half_methods"] if m in methods]
        assert all(r["dtype"] == "float16" for r in half)
    assert float(step[0]["floor_us"]) > 0 and float(step[0]["copy_GBps"]) > 0
    by = {r["method"]: r for r in rows if r["setup"] == "toy-1L-d8"}
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
    assert summary["ours_step_p10_us"] <= summary["ours_step_us"] <= summary["ours_step_p90_us"]
    for key in ("graphed_step_over_kernel_sum", "ours_over_torch_graph_step"):
        assert key in summary  # measured on a GPU only (None on the simulator)
    assert summary["setup"] == "toy-1L-d8"
    if half_setup:
        assert summary["gpt2_fp16_setup"] == "toy-1L-d8-fp16"
        assert summary["gpt2_fp16_step_over_bandwidth_floor"] == \
            float(step[1]["ours_step_us"]) / float(step[1]["floor_us"])
        assert summary["gpt2_fp16_all_ours_same_tokens"] is True
        # (a GPU's toy, the lane's, with torch: our float16 step's kernels profiled too)
        assert summary["gpt2_fp16_graph_nodes_per_step"] == int(step[1]["ours_graph_nodes"])
        assert summary["gpt2_fp16_kernel_sum_us"] > 0
        assert any(k["setup"] == "toy-1L-d8-fp16" and k["who"] == "ours"
                   for k in common.read_csv("end_to_end_kernels"))
    figure = end_to_end.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)
    phases = figure.with_name("end_to_end_phases.png")
    assert phases.exists() and phases.stat().st_size > 10_000


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
        "kernels::mlp::fused_kernel::_3clocals_3e::fused_mlp_kernel[abi:v5]": "MLP (fused)",
        "kernels::mlp::sum_kernel::_3clocals_3e::mlp_sum_kernel[abi:v6]": "MLP (fused)",
        "kernels::softmax::log_softmax_partials_kernel[abi:v1]": "beam top-k",
        "kernels::sampling::beam_choose_kernel[abi:v1]": "beam choice",
        "proto::graph::cuda::continue_loop[abi:v1]": "loop control",
        # the WHILE profile's predicated twins (proto.device.backend.predicated) and scope kernels
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


def test_a_method_that_failed_for_one_setup_is_not_tried_again():
    """hf_compiled failed for the 4-layer setup in minutes of device time; the 12-layer setup
    records why instead of failing the same way again. Other methods are unaffected."""
    unavailable = {"4L-d256/hf_compiled": "TypeError: Pointer argument"}
    assert end_to_end._failed_before("hf_compiled", unavailable) == \
        "not tried: it failed for 4L-d256/hf_compiled (TypeError: Pointer argument)"
    assert end_to_end._failed_before("hf_generate", unavailable) is None
    assert end_to_end._failed_before("hf_compiled", {"4L-d256/while_kernels": "x"}) is None


def test_the_float16_figures_come_from_the_float16_setup():
    """half_summary on rows a GPU run would write: the step over its floor and transformers'
    generate over our WHILE graph, of the float16 setup only; nothing without one."""
    row = lambda setup, dtype, method, ms: {"setup": setup, "dtype": dtype, "method": method,   # noqa: E731
                                            "ms_per_token": ms, "same_tokens_as_eager": "True"}
    rows = [row("12L", "float32", "graph_while", 2.0), row("12L", "float32", "hf_generate", 40.0),
            row("12L-fp16", "float16", "numba_eager", 9.0),
            row("12L-fp16", "float16", "graph_while", 1.5),
            row("12L-fp16", "float16", "hf_generate", 30.0)]
    steps = [{"setup": "12L", "ours_step_us": 900.0, "floor_us": 300.0},
             {"setup": "12L-fp16", "ours_step_us": 600.0, "floor_us": 150.0,
              "ours_graph_nodes": 98, "ours_kernel_sum_us": 650.0}]
    s = end_to_end.half_summary(rows, steps)
    assert s["gpt2_fp16_setup"] == "12L-fp16" and s["gpt2_fp16_all_ours_same_tokens"] is True
    assert s["gpt2_fp16_step_over_bandwidth_floor"] == 4.0
    assert s["gpt2_fp16_graph_nodes_per_step"] == 98 and s["gpt2_fp16_kernel_sum_us"] == 650.0
    assert s["gpt2_fp16_hf_generate_over_ours_per_token"] == 20.0
    assert end_to_end.half_summary(rows[:2], steps) == {}


# ------------------------------------------------------------------ a run of some setups
# Three made-up setups (two float32, one float16) of a made-up size; the methods' rows and
# the child's step timings are made up too: only what run() keeps, writes and summarizes.
FAKE = dict(setups=[("A", end_to_end.TOY, 2, np.float32), ("B", end_to_end.TOY, 2, np.float32),
                    ("H", end_to_end.TOY, 2, np.float16)],
            beam=2, prompt_len=1, build_all=False, reps=2, step={})


def _fake_methods(monkeypatch, tmp_path, here: dict, ms: float, cut_short: bool = False):
    """run() without a model: every method's row says `ms` (eager 4 ms, the rest its share);
    hf_compiled fails; the child times each step at 600 us against a 200 us floor, or
    (`cut_short`) the session ends before it answers."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(common, "provenance", lambda: here)
    monkeypatch.setitem(end_to_end.SIZES, "fake", FAKE)
    monkeypatch.setattr(end_to_end, "random_state_dict", lambda config, seed: {})
    monkeypatch.setattr(end_to_end, "GPT2", lambda *args, **kwargs: None)
    monkeypatch.setattr(end_to_end, "_methods", lambda dtype, half: [
        "numba_eager", "graph_copy_exact", "graph_alias_device", "graph_while",
        *(["hf_compiled"] if np.dtype(dtype) == np.float32 else ["hf_generate"])])
    share = {"numba_eager": 4, "graph_copy_exact": 2, "graph_alias_device": 1,
             "graph_while": 0.5, "hf_generate": 20}

    def measure(method, live, model, state_dict, cfg, max_len, prompt, new, want):
        if method == "hf_compiled":
            raise RuntimeError("no compiler")
        row = {"tokens": 2, "method": method, "ms_per_token": ms * share[method],
               "p10_ms_per_token": 0.0, "p90_ms_per_token": 99.0, "reps": 2, "prep_ms": 0.0,
               "model_ms": 1.0, "search_ms": 0.0, "same_tokens_as_eager": True, "setup_s": 0.1,
               "graphs": 2, "reorder_graphs": 0, "graph_nodes": 9, "graph_memory_mib": 0.0,
               "bytes_copied_per_step": 0, "bind_us_per_step": 1.0}
        return row, None
    monkeypatch.setattr(end_to_end, "_measure", measure)

    def step_timings(specs):
        if cut_short:
            raise KeyboardInterrupt   # (the session's time limit, as the child runs)
        return [({"setup": s["label"], "position": 1, "ours_step_us": 600.0,
                  "ours_step_p10_us": 600.0, "ours_step_p90_us": 600.0, "ours_graph_nodes": 9,
                  "weight_bytes": 1, "kv_bytes": 1, "copy_GBps": 1.0, "floor_us": 200.0},
                 [{"setup": s["label"], "who": "ours", "kernel": "gemm_kernel[abi:v1]",
                   "us_per_step": 500.0, "launches_per_step": 1.0}], {}) for s in specs]
    monkeypatch.setattr(end_to_end, "step_timings", step_timings)


def test_a_run_of_some_setups_keeps_the_others_rows_of_this_commit(tmp_path, monkeypatch):
    """The float16 setup in one run, the float32 ones in another at the same commit: one set
    of CSVs and one summary, each row with its run's date, and each ratio within one setup;
    a run cut short before the step timings keeps its generations; another commit or device
    starts afresh."""
    here = {"device": "GPU A", "git_commit": "abc123", "date": "d1"}
    _fake_methods(monkeypatch, tmp_path, here, ms=1.0)
    end_to_end.run("fake", setups=["H"])
    s = common.read_summary("end_to_end")
    assert s["setup"] == "B" and s["step_over_bandwidth_floor"] is None   # (B not run yet)
    assert s["gpt2_fp16_step_over_bandwidth_floor"] == 3.0
    assert s["gpt2_fp16_hf_generate_over_ours_per_token"] == 40.0
    assert s["setups_not_run"] == ["A", "B"] and s["runs"] == {"d1": ["H"]}

    here["date"] = "d2"
    _fake_methods(monkeypatch, tmp_path, here, ms=2.0)
    end_to_end.run("fake", setups=["B", "A"])
    rows = common.read_csv("end_to_end")
    assert [(r["setup"], r["date"]) for r in rows if r["method"] == "numba_eager"] == [
        ("A", "d2"), ("B", "d2"), ("H", "d1")]
    assert [(r["setup"], r["date"]) for r in common.read_csv("end_to_end_step")] == [
        ("A", "d2"), ("B", "d2"), ("H", "d1")]
    assert [(r["setup"], r["date"]) for r in common.read_csv("end_to_end_kernels")] == [
        ("A", "d2"), ("B", "d2"), ("H", "d1")]
    s = common.read_summary("end_to_end")
    assert s["setup"] == "B" and s["numba_eager_ms_per_token"] == 8.0
    assert s["eager_over_alias_per_token"] == 4.0 and s["step_over_bandwidth_floor"] == 3.0
    assert s["while_per_token_over_step"] == 1.0 / 0.6   # (B's WHILE token over B's step)
    assert s["gpt2_fp16_step_over_bandwidth_floor"] == 3.0   # (H's, kept from d1)
    assert s["gpt2_fp16_ms_per_token"]["numba_eager"] == 4.0
    assert s["ms_per_token_by_setup"]["A"]["numba_eager"] == 8.0
    assert s["runs"] == {"d2": ["A", "B"], "d1": ["H"]} and s["setups_not_run"] == []
    assert s["unavailable"] == {"A/hf_compiled": "RuntimeError: no compiler",
                                "B/hf_compiled": "not tried: it failed for A/hf_compiled "
                                                 "(RuntimeError: no compiler)"}

    here["date"] = "d3"   # H again, cut short as the child times the steps
    _fake_methods(monkeypatch, tmp_path, here, ms=3.0, cut_short=True)
    with pytest.raises(KeyboardInterrupt):
        end_to_end.run("fake", setups=["H"])
    rows = common.read_csv("end_to_end")
    assert [(r["setup"], r["date"]) for r in rows if r["method"] == "numba_eager"] == [
        ("A", "d2"), ("B", "d2"), ("H", "d3")]
    # H's step of d1 went with its rows: no step row of H, and no figure from one
    assert [r["setup"] for r in common.read_csv("end_to_end_step")] == ["A", "B"]
    s = common.read_summary("end_to_end")
    assert s["gpt2_fp16_ms_per_token"]["numba_eager"] == 12.0
    assert "gpt2_fp16_step_over_bandwidth_floor" not in s
    assert s["step_over_bandwidth_floor"] == 3.0 and set(s["unavailable"]) == {
        "A/hf_compiled", "B/hf_compiled"}   # (the float32 run's, kept beside its rows)

    for change in ({"git_commit": "def456"}, {"device": "GPU B"}):
        here.update(date="d4", **change)
        _fake_methods(monkeypatch, tmp_path, here, ms=1.0)
        end_to_end.run("fake", setups=["H"])
        assert {r["setup"] for r in common.read_csv("end_to_end")} == {"H"}
        assert [r["setup"] for r in common.read_csv("end_to_end_step")] == ["H"]
        s = common.read_summary("end_to_end")
        assert s["setups_not_run"] == ["A", "B"] and s["unavailable"] == {}


def test_a_run_of_some_setups_drops_the_other_sizes_rows(tmp_path, monkeypatch):
    """A toy run on the same card at the same commit (the GPU lane's) writes setups of
    another size: a full run of some setups keeps none of them. An unknown label is an
    error naming the size's labels."""
    here = {"device": "GPU A", "git_commit": "abc123", "date": "d1"}
    _fake_methods(monkeypatch, tmp_path, here, ms=1.0)
    common.write_csv("end_to_end", [{"setup": "toy-1L-d8", "method": "numba_eager",
                                     "ms_per_token": 1.0, **here}])
    common.write_csv("end_to_end_step", [{"setup": "toy-1L-d8", "ours_step_us": 1.0, **here}])
    here["date"] = "d2"
    end_to_end.run("fake", setups=["H"])
    assert {r["setup"] for r in common.read_csv("end_to_end")} == {"H"}
    assert {r["setup"] for r in common.read_csv("end_to_end_step")} == {"H"}
    with pytest.raises(ValueError, match=r"unknown fake setup\(s\) \['C'\]; choose from "
                                         r"\['A', 'B', 'H'\]"):
        end_to_end.run("fake", setups=["A", "C"])
