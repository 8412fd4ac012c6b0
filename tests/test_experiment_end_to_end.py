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
             {"setup": "12L-fp16", "ours_step_us": 600.0, "floor_us": 150.0}]
    s = end_to_end.half_summary(rows, steps)
    assert s["gpt2_fp16_setup"] == "12L-fp16" and s["gpt2_fp16_all_ours_same_tokens"] is True
    assert s["gpt2_fp16_step_over_bandwidth_floor"] == 4.0
    assert s["gpt2_fp16_hf_generate_over_ours_per_token"] == 20.0
    assert end_to_end.half_summary(rows[:2], steps) == {}
