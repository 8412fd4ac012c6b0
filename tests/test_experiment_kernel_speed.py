"""The kernel_speed experiment at toy size: it runs every kernel (ours, plus PyTorch where
present), writes its CSV, summary and figure, and the summary carries the headline keys.
Results go to a temporary folder, so a GPU test run never overwrites full-size results."""
from experiments import common, kernel_speed


def test_kernel_speed_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    kernel_speed.run("toy")
    rows = common.read_csv("kernel_speed")
    kernels = {r["kernel"] for r in rows}
    assert {"gemm_decode_nt", "gemm_decode_nn", "gemm_prefill_bias", "layernorm",
            "masked_softmax", "log_softmax", "embed", "gelu", "add"} <= kernels
    for cases in kernel_speed.OPTIONAL.values():  # kernels of modules present in this tree
        assert set(cases) <= kernels
    ours = [r for r in rows if r["impl"] == "ours"]
    assert len(ours) == len(kernels)  # one row per kernel per implementation
    assert all(float(r["median_us"]) > 0 and float(r["eager_us"]) > 0 and int(r["bytes"]) > 0
               for r in ours)
    assert all(r["git_commit"] and r["device"] for r in rows)  # provenance on every row
    summary = common.read_summary("kernel_speed")
    for key in ("decode_gemm_fraction_of_bandwidth", "decode_gemm_over_torch_time",
                "copy_bandwidth_GBps"):
        assert key in summary
    assert summary["copy_bandwidth_GBps"] > 0
    s = kernel_speed.SIZES["toy"]
    expected = (4 * s["V"] * s["D"] / (summary["decode_gemm_us"] * 1e-6) / 1e9
                / summary["copy_bandwidth_GBps"])
    assert abs(summary["decode_gemm_fraction_of_bandwidth"] - expected) <= 1e-9 * expected
    figure = kernel_speed.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)
