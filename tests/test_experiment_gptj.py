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
    """The summary is written as methods end (the step figures once the device-length
    graph's row is there), listing the methods not run yet, so a GPU session that ends
    mid-run keeps its figures."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    base = {"n_layer": 28, "n_embd": 4096, "beam": 5, "prompt_len": 5, "max_len": 1024,
            "graphs_and_caches_mib": 1.0, "graphs_mib": 1.0, "same_tokens_as_eager": True}
    rows = [{**base, "method": "ours_eager", "ms_per_token": 15.0}]
    gptj._write_summary(rows, {})
    summary = common.read_summary("gptj")   # (no step row yet)
    assert summary["gptj_step_over_bandwidth_floor"] is None and summary["gptj_step_us"] is None
    rows.append({**base, "method": "ours_device", "ms_per_token": 10.0, "step_us": 9000.0,
                 "floor_us": 4500.0})
    gptj._write_summary(rows, {"ptgraph_step": "needs a GPU"})
    summary = common.read_summary("gptj")
    assert summary["gptj_step_over_bandwidth_floor"] == 2.0
    assert summary["methods_not_run"] == [m for m in gptj.METHODS if m not in
                                          ("ours_eager", "ours_device", "ptgraph_step")]


BASE = {"n_layer": 1, "n_embd": 8, "beam": 2, "prompt_len": 2, "max_len": 3,
        "graphs_and_caches_mib": 1.0, "graphs_mib": 1.0}


def _row(method: str, date: str, **values) -> dict:
    return {**BASE, "method": method, "date": date, "ms_per_token": None,
            "same_tokens_as_eager": True, **values}


def test_a_ratio_is_taken_only_of_two_methods_of_one_run():
    """Ratios set side by side two rows of one run (one date); each per-token ratio divides
    by the fastest of ours in the other method's run, None where its run had none of ours."""
    rows = [_row("ours_eager", "d1", ms_per_token=15.0),
            _row("ours_device", "d1", ms_per_token=12.0, step_us=9000.0, floor_us=4500.0),
            _row("ptgraph_step", "d2", step_us=7000.0),
            _row("ours_per_length", "d2", ms_per_token=12.5, graphs_mib=100.0),
            _row("ptgraph_shared", "d2", ms_per_token=15.0, graphs_mib=1000.0),
            _row("ours_while", "d3", ms_per_token=10.0),
            _row("hf_generate", "d3", ms_per_token=30.0),
            _row("hf_compiled", "d4", ms_per_token=20.0)]
    s = gptj.summarize(rows)
    assert s["gptj_ours_over_torch_graph_step"] is None   # (d1 against d2)
    assert s["gptj_step_over_bandwidth_floor"] == 2.0     # (one row)
    assert s["gptj_ptgraph_over_ours_memory"] == 10.0
    assert s["gptj_ptgraph_over_ours_per_token"] == {"ptgraph_shared": 1.2}   # over per_length
    assert s["gptj_hf_generate_over_ours_per_token"] == 3.0                   # over while
    assert s["gptj_hf_compiled_over_ours_per_token"] is None
    assert s["best_ours"] == {"ptgraph_shared": "ours_per_length", "hf_generate": "ours_while",
                              "hf_compiled": None}
    assert s["runs"] == {"d1": ["ours_eager", "ours_device"],
                         "d2": ["ptgraph_step", "ours_per_length", "ptgraph_shared"],
                         "d3": ["ours_while", "hf_generate"], "d4": ["hf_compiled"]}
    rows[2]["date"] = "d1"
    assert gptj.summarize(rows)["gptj_ours_over_torch_graph_step"] == round(9000 / 7000, 3)


def test_tokens_are_compared_with_ours_eagers_by_digest_across_runs():
    """Each row keeps its tokens' digest; same_tokens_as_eager compares it with ours_eager's
    row, whichever run measured that; None until there is one, or where a method has no
    tokens."""
    import hashlib

    import numpy as np
    tokens = [[1, 2, 3], [4, 5, 6]]
    want = hashlib.sha256(np.array(tokens, np.int32).tobytes()).hexdigest()[:16]
    assert gptj.tokens_digest(tokens) == want and gptj.tokens_digest(None) is None
    assert gptj.tokens_digest(np.array(tokens, np.int64)) == want
    rows = [_row("ours_while", "d2", tokens_digest=want),
            _row("hf_generate", "d2", tokens_digest=gptj.tokens_digest([[1, 2, 4]])),
            _row("ptgraph_step", "d2", tokens_digest=None)]
    assert [r["same_tokens_as_eager"] for r in gptj.same_tokens_as_eager(rows)] == [None] * 3
    rows.append(_row("ours_eager", "d1", tokens_digest=want))
    rows = gptj.same_tokens_as_eager(rows)
    assert [r["same_tokens_as_eager"] for r in rows] == [True, False, None, True]


def test_a_run_of_some_methods_keeps_the_others_rows_of_this_commit(tmp_path, monkeypatch):
    """Two runs of some methods at one commit make one CSV and one summary, each row with its
    run's date, the tokens compared across them, ratios only within a run; a run at another
    commit starts afresh."""
    from experiments import isolate
    monkeypatch.setattr(common, "ROOT", tmp_path)
    here = {"device": "GPU A", "git_commit": "abc123", "date": "d1"}
    monkeypatch.setattr(common, "provenance", lambda: here)
    monkeypatch.setattr(gptj, "_kernel_speed_figure", lambda: None)
    values = {"ours_eager": 15.0, "ours_device": 12.0, "ptgraph_step": None,
              "ours_while": 10.0, "hf_generate": 30.0}
    ran = []

    def each_method(name, methods, target, size, *, unavailable, **_):
        for m in methods:
            ran.append(m)
            row = {**dict.fromkeys(gptj.COLUMNS), **BASE, "method": m,
                   "ms_per_token": values[m], "step_us": 900.0, "floor_us": 450.0}
            yield m, {"row": row, "tokens": None if m == "ptgraph_step" else
                      [[1, 2, 3 if m != "hf_generate" else 4]]}
    monkeypatch.setattr(isolate, "each_method", each_method)
    gptj.run("toy", methods=["ours_device", "ours_eager", "ptgraph_step"])
    assert ran == ["ours_eager", "ours_device", "ptgraph_step"]   # (in METHODS' order)
    here["date"] = "d2"
    gptj.run("toy", methods=["ours_while", "hf_generate", "ptgraph_step"])
    rows = common.read_csv("gptj")
    assert [(r["method"], r["date"], r["same_tokens_as_eager"]) for r in rows] == [
        ("ours_eager", "d1", "True"), ("ours_device", "d1", "True"),
        ("ptgraph_step", "d2", ""), ("hf_generate", "d2", "False"), ("ours_while", "d2", "True")]
    s = common.read_summary("gptj")
    assert s["runs"] == {"d1": ["ours_eager", "ours_device"],
                         "d2": ["ptgraph_step", "hf_generate", "ours_while"]}
    assert s["gptj_ours_over_torch_graph_step"] is None   # (ptgraph_step ran again in d2)
    assert s["gptj_hf_generate_over_ours_per_token"] == 3.0 and s["best_ours"] == {
        "hf_generate": "ours_while"}
    assert s["gptj_all_tokens_equal"] is True and s["hf_tokens_equal"] is False
    assert s["methods_not_run"] == ["ours_per_length", "ptgraph_shared", "hf_compiled",
                                    "ptgraph_private"]
    here.update(git_commit="def456", date="d3")
    gptj.run("toy", methods=["ours_eager"])
    assert [r["method"] for r in common.read_csv("gptj")] == ["ours_eager"]
