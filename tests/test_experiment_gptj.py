"""The gptj experiment at toy size: each method in its own process, its CSV, summary and
figure, the tokens of every method equal, the step against its floor where a GPU measures
one. Results go to a temporary folder."""
import pytest

from experiments import common, gptj


@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_gptj_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(gptj, "METHODS", ["ours_eager", "ours_device", "ptgraph_step",
                                          "hf_generate"])
    gptj.run("toy")
    rows = common.read_csv("gptj")
    assert [r["method"] for r in rows][:2] == ["ours_eager", "ours_device"]
    # (ptgraph_step times one step: no tokens to compare; transformers' may part at a near-tie)
    assert all(r["same_tokens_as_eager"] == "True" for r in rows
               if r["method"] not in ("hf_generate", "ptgraph_step"))
    assert all(r["git_commit"] and r["device"] for r in rows)
    assert all(float(r["ms_per_token"]) > 0 for r in rows if r["method"] != "ptgraph_step")
    assert all(float(r["step_us"]) > 0 for r in rows if r["method"] == "ptgraph_step")
    device = next(r for r in rows if r["method"] == "ours_device")
    assert float(device["step_us"]) > 0 and int(device["step_read_bytes"]) > 0
    summary = common.read_summary("gptj")
    for key in ("gptj_step_over_bandwidth_floor", "gptj_hf_generate_over_ours_per_token",
                "gptj_ours_over_torch_graph_step", "gptj_all_tokens_equal", "unavailable",
                "gptj_ptgraph_over_ours_memory", "gptj_decode_gemm_min_fraction_of_bandwidth"):
        assert key in summary
    assert summary["gptj_all_tokens_equal"] is True and summary["methods_not_run"] == []
    measured = {r["method"] for r in rows}   # PyTorch's methods: measured or said why not
    assert all(m in measured or m in summary["unavailable"]
               for m in ("ptgraph_step", "hf_generate"))
    assert gptj.plot().exists()


def test_a_run_cut_short_keeps_a_summary_naming_the_methods_not_run(tmp_path, monkeypatch):
    """The summary is written as methods end (once the device-length graph's row is there),
    listing the methods not run yet, so a GPU session that ends mid-run keeps its figures."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    base = {"n_layer": 28, "n_embd": 4096, "beam": 5, "prompt_len": 5, "max_len": 1024,
            "graphs_and_caches_mib": 1.0, "graphs_mib": 1.0, "same_tokens_as_eager": True}
    rows = [{**base, "method": "ours_eager", "ms_per_token": 15.0}]
    gptj._write_summary(rows, {})
    assert not (common.results_dir() / "gptj.summary.json").exists()   # (no step row yet)
    rows.append({**base, "method": "ours_device", "ms_per_token": 10.0, "step_us": 9000.0,
                 "floor_us": 4500.0})
    gptj._write_summary(rows, {"ptgraph_step": "needs a GPU"})
    summary = common.read_summary("gptj")
    assert summary["gptj_step_over_bandwidth_floor"] == 2.0
    assert summary["methods_not_run"] == [m for m in gptj.METHODS if m not in
                                          ("ours_eager", "ours_device", "ptgraph_step")]
