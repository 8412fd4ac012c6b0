"""The greedy_loop experiment at toy size: every method generates the eager tokens, and the
CSV, summary and figure carry what the README quotes. Results go to a temporary folder."""
import pytest

from experiments import common, greedy_loop
from proto import backend


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
def test_greedy_loop_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    greedy_loop.run("toy")
    rows = common.read_csv("greedy_loop")
    assert sorted({r["method"] for r in rows}) == sorted(greedy_loop.METHODS)
    assert {int(r["new_tokens"]) for r in rows} == set(greedy_loop.SIZES["toy"]["new"])
    assert all(r["tokens_equal_eager"] == "True" and float(r["ms_per_token"]) > 0 for r in rows)
    assert all(r["git_commit"] and r["device"] for r in rows)
    summary = common.read_summary("greedy_loop")
    assert summary["all_tokens_equal"] is True and summary["per_step_over_while_per_token"] > 0
    assert greedy_loop.plot().exists()
