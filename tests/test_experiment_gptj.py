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
    assert summary["gptj_all_tokens_equal"] is True
    measured = {r["method"] for r in rows}   # PyTorch's methods: measured or said why not
    assert all(m in measured or m in summary["unavailable"]
               for m in ("ptgraph_step", "hf_generate"))
    assert gptj.plot().exists()
