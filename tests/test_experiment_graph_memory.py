"""The graph_memory experiment at toy size: every method of ours runs, gives the same tokens,
and the CSV, summary and figure carry what the README quotes. Results go to a temporary
folder."""
import numpy as np
import pytest

from experiments import common, graph_memory
from proto import backend
from proto.models import reference
from proto.models.lstm import LSTMConfig, random_state_dict


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


@pytest.mark.skipif(backend.SIMULATOR, reason="PtGraph runs PyTorch's cuDNN LSTM on the GPU")
def test_ptgraph_lstm_computes_float32_like_ours(monkeypatch):
    """PtGraph's LSTM graph gives the NumPy reference's logits to float32 accuracy: cuDNN's
    default TF32 (about 1e-3 off) would make its time a comparison of another precision."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)   # PyTorch's defaults
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    config, batch = LSTMConfig(2, 256, 512, 300), 16
    weights = random_state_dict(config, seed=3)
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, batch)
    graphs = graph_memory._TorchLSTMGraphs(config, weights, batch, "shared")
    try:
        assert common.torch_tf32() is False
        graphs.capture(batch)
        graphs.h.zero_()            # capture's warm-up stepped the state: one step from zeros
        graphs.c.zero_()
        graphs.tokens.copy_(torch.from_numpy(tokens).cuda())
        graphs.graphs[batch].replay()
        got = graphs.logits[:batch].cpu().numpy()
    finally:
        graphs.close()
    want, _ = reference.lstm_logits(config, weights, tokens[:, None])
    want = want[:, 0]
    # float32 sums of 512 terms: ~1e-6 of the logits' scale; TF32 gates: ~1e-3
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-5 * np.abs(want).max())
