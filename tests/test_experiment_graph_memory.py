"""The graph_memory experiment at toy size: every method of ours runs, gives the same tokens,
and the CSV, summary and figure carry what the README quotes. Results go to a temporary
folder."""
import pytest

from experiments import common, graph_memory
from proto import backend


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
def test_graph_memory_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    graph_memory.run("toy")
    rows = common.read_csv("graph_memory")
    ours = [m for m in graph_memory.METHODS if m.startswith("ours")]
    assert {(r["model"], r["method"]) for r in rows} == \
        {("gpt2", m) for m in ours} | {("lstm", m) for m in ours if m != "ours_device"}
    gpt2 = {r["method"]: r for r in rows if r["model"] == "gpt2"}
    assert all(r["same_tokens"] == "True" for r in gpt2.values())
    toy = graph_memory.SIZES["toy"]
    lengths = toy["gpt2"].n_positions
    # alias binding: one graph per length and cache set, plus a reorder graph per direction
    assert int(gpt2["ours_unplanned"]["graphs"]) == 2 * lengths + 2
    assert int(gpt2["ours_device"]["graphs"]) == 2 + 2
    assert int(gpt2["ours_planned"]["arena_bytes"]) > 0 and int(gpt2["ours_planned"]["private_bytes"]) == 0
    assert int(gpt2["ours_unplanned"]["private_bytes"]) >= 2 * lengths * int(gpt2["ours_planned"]["arena_bytes"]) // 2
    for r in rows:   # our capture time by phase: each measured, together within capture_s
        phases = [float(r[f"{p}_s"]) for p in ("record", "plan", "build")]
        assert all(s >= 0 for s in phases) and sum(phases) <= float(r["capture_s"]) + 1e-3
    assert float(gpt2["ours_unplanned"]["plan_s"]) < float(gpt2["ours_planned"]["plan_s"])
    summary = common.read_summary("graph_memory")
    assert summary["all_tokens_equal"] is True
    assert summary["ptgraph_over_ours_memory"] is None    # no PyTorch, no memory on the simulator
    assert 1.0 <= summary["arena_over_peak_live"] <= 1.10
    assert graph_memory.plot().exists()
