"""The kernel_speed experiment at toy size: it runs every kernel (ours, plus PyTorch where
present), writes its CSV, summary and figure, and the summary carries the headline keys.
Results go to a temporary folder, so a GPU test run never overwrites full-size results."""
import pytest

from experiments import common, kernel_speed


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_kernel_speed_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    kernel_speed.run("toy")
    rows = common.read_csv("kernel_speed")
    kernels = {r["kernel"] for r in rows}
    assert {*kernel_speed.DECODE_GEMMS, *kernel_speed.GPTJ_GEMMS, "gemm_decode_nn", "gemm_prefill_bias", "layernorm",
            "masked_softmax", "log_softmax", "embed", "gelu", "add"} <= kernels
    for cases in kernel_speed.OPTIONAL.values():  # kernels of modules present in this tree
        assert set(cases) <= kernels
    # a layer of each VGG stage in the size, each of its three convolutions; the first
    # layer's forward and weight gradient; the pool's backward
    convs = {f"{stage}_{kind}" for stage in kernel_speed.SIZES["toy"]["convs"]
             for kind in kernel_speed.conv_kinds(stage)}
    assert len(convs) == 8 and convs <= kernels and "maxpool_bwd" in kernels
    assert "conv1_1_bwd_data" not in kernels
    # Winograd beside the direct convolutions of every layer but the first
    winograd = {f"{stage}_{kind}_winograd" for stage in kernel_speed.SIZES["toy"]["convs"]
                if stage != "conv1_1" for kind in kernel_speed.WINOGRAD_KINDS}
    assert len(winograd) == 6 and winograd <= kernels
    ours = [r for r in rows if r["impl"] == "ours"]
    assert len(ours) == len(kernels)  # one row per kernel per implementation
    assert all(float(r["median_us"]) > 0 and float(r["eager_us"]) > 0 and int(r["bytes"]) > 0
               for r in ours)
    assert all(r["git_commit"] and r["device"] for r in rows)  # provenance on every row
    summary = common.read_summary("kernel_speed")
    for key in ("decode_gemm_fraction_of_bandwidth", "decode_gemm_over_torch_time",
                "copy_bandwidth_GBps", "decode_gemm_min_fraction_of_bandwidth",
                "attention_decode_fraction_of_bandwidth",
                "decode_self_attention_fraction_of_bandwidth",
                "gptj_decode_gemm_min_fraction_of_bandwidth"):
        assert key in summary
    assert summary["copy_bandwidth_GBps"] > 0
    assert set(summary["gptj_decode_gemm_fractions_of_bandwidth"]) == set(kernel_speed.GPTJ_GEMMS)
    toy = kernel_speed.SIZES["toy"]
    B, D, V = toy["B"], toy["gptj"]["D"], toy["gptj"]["V"]
    head = next(r for r in ours if r["kernel"] == "gemm_gptj_head")   # float16: 2 bytes each
    assert int(head["bytes"]) == 2 * (V * D + B * D + B * V + V)
    # the model's paired launches: qkv and fc_in reading one input and both weights, writing
    # both outputs; the attention output and fc_out reading both weights and both inputs,
    # reading and writing the residual; each product alone beside them
    F = toy["gptj"]["F"]
    outs = next(r for r in ours if r["kernel"] == "gemm_gptj_qkv_fc_in")
    assert int(outs["bytes"]) == 2 * (3 * D * D + F * D + B * D + B * (3 * D + F) + F)
    both = next(r for r in ours if r["kernel"] == "gemm_gptj_attn_out_fc_out")
    assert int(both["bytes"]) == 2 * (D * D + D * F + B * D + B * F + 2 * B * D + D)
    assert set(summary["gptj_products_alone_fractions"]) == set(kernel_speed.GPTJ_ALONE)
    assert set(kernel_speed.GPTJ_ALONE) <= kernels
    assert summary["gptj_decode_gemm_min_fraction_of_bandwidth"] == min(
        summary["gptj_decode_gemm_fractions_of_bandwidth"].values())
    assert set(summary["conv_over_cudnn_time"]) == convs
    assert {f"{c}_winograd" for c in summary["winograd_over_direct_time"]} == winograd
    # Each fraction is the row's bytes / its time over the copy bandwidth; the headline
    # minimum is over GPT-2's five decode shapes.
    by_kernel = {r["kernel"]: r for r in ours}
    fractions = summary["decode_gemm_fractions_of_bandwidth"]
    assert set(fractions) == set(kernel_speed.DECODE_GEMMS)
    for kernel, got in fractions.items():
        row = by_kernel[kernel]
        expected = (int(row["bytes"]) / (float(row["median_us"]) * 1e-6) / 1e9
                    / summary["copy_bandwidth_GBps"])
        assert abs(got - expected) <= 1e-9 * expected
    assert summary["decode_gemm_min_fraction_of_bandwidth"] == min(fractions.values())
    assert summary["decode_gemm_fraction_of_bandwidth"] == fractions[kernel_speed.HEADLINE]
    s = kernel_speed.SIZES["toy"]  # the head's bytes: the tied embedding, x and logits
    assert int(by_kernel[kernel_speed.HEADLINE]["bytes"]) == 4 * (s["V"] * s["D"] + s["B"] * (
        s["D"] + s["V"]))
    figure = kernel_speed.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)
