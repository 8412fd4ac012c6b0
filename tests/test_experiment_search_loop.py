"""The search_loop experiment at toy size: every method (WHILE node, predication at every
unroll, the host loop, eager) gives the eager result for greedy and beam search, and the CSV,
summary and figure carry what the README quotes. Results go to a temporary folder."""
import pytest

from experiments import common, search_loop
from proto.device import backend


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_search_loop_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    search_loop.run("toy")
    rows = common.read_csv("search_loop")
    cfg = search_loop.SIZES["toy"]
    want = {(s, m, n) for s in search_loop.SEARCHES for m in search_loop.methods(cfg)
            for n in cfg["new"]}
    assert {(r["search"], r["method"], int(r["new_tokens"])) for r in rows} == want
    assert all(r["result_equal"] == "True" and float(r["ms_per_token"]) > 0 for r in rows)
    assert all(r["git_commit"] and r["device"] for r in rows)
    summary = common.read_summary("search_loop")
    assert summary["all_results_equal"] is True
    assert summary["best_unroll"] in cfg["unrolls"]
    assert search_loop.plot().exists()
