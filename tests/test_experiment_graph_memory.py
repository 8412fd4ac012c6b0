"""The graph_memory experiment: its plumbing (each method in a child process of its own),
its arithmetic (the driver fit, the summary's ratios and breakdown check), and a toy run of
every method of ours with the same tokens. Results go to a temporary folder."""
import json

import numpy as np
import pytest

from experiments import common, graph_memory, isolate
from proto.device import backend
from proto.models import reference
from proto.models.lstm import LSTMConfig, random_state_dict


def test_the_driver_fit_recovers_bytes_a_graph_and_a_node():
    """Probes made from known costs (100 KiB a graph, 2 KiB a node, whole MiB readings as
    free memory moves in steps) give those costs back within the steps' rounding."""
    probes = [{"graphs": n, "graph_nodes": n * k,
               "taken_mib": float(np.ceil((n * 100 * 1024 + n * k * 2048) / 2**21) * 2)}
              for n, k in [(2048, 1), (2048, 8), (512, 64), (256, 256)]]
    per_graph, per_node = graph_memory.fit_driver_bytes(probes)
    assert abs(per_graph - 100 * 1024) < 3 * 1024 and abs(per_node - 2048) < 100
    assert graph_memory.fit_driver_bytes(probes[:1]) is None   # two unknowns, one reading


def _row(model, method, graph, buffers=None, fit=None, ms=None, **kw):
    return {"model": model, "method": method, "graph_mib": graph, "buffers_mib": buffers,
            "driver_mib": None if buffers is None else graph - buffers,
            "driver_fit_mib": fit, "ms_per_token": ms, **kw}


def test_the_summary_divides_graph_memory_and_checks_the_breakdown():
    rows = [_row("gpt2", "ptgraph_shared_pool", 778.0, 10.0, ms=3.0, footprint_mib=2000.0),
            _row("gpt2", "ours_planned_shared", 5.0, 3.0, fit=1.5, ms=1.0, second_kv_mib=360.0,
                 sweep_ms_per_token=1.0),
            # (stopped at the reserve: no generation timed, its sweep of the largest lengths is)
            _row("gpt2", "ours_unplanned", 50000.0, sweep_ms_per_token=1.02),
            _row("gpt2", "ours_device", 4.0, 3.0, fit=1.0),
            _row("gpt2", "ours_planned", 700.0, 3.0, arena_mib=2.84, peak_live_mib=2.8)]
    s = graph_memory.summarize(rows, (100e3, 2e3))
    assert s["ptgraph_over_ours_memory"] == round(778 / 5, 3)
    assert s["ptgraph_over_ours_device_memory"] == round(778 / 4, 3)
    assert s["memory_breakdown_complete"] is True                  # 3 + 1.5 within 4 of 5
    assert s["ours_second_kv_mib"] == 360.0 and s["ptgraph_total_footprint_mib"] == 2000.0
    assert s["planned_over_unplanned_time_per_token"] == round(1.0 / 1.02, 3)
    assert s["driver_bytes_per_node"] == 2000.0
    rows[1]["graph_mib"] = 50.0    # 45 MiB that no part accounts for
    assert graph_memory.summarize(rows, (100e3, 2e3))["memory_breakdown_complete"] is False
    rows[1]["driver_fit_mib"] = None   # no probe: nothing to check the driver's part against
    assert graph_memory.summarize(rows, None)["memory_breakdown_complete"] is None


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_graph_memory_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    graph_memory.run("toy")
    rows = common.read_csv("graph_memory")
    ours = [m for m in graph_memory.METHODS if m.startswith("ours")]
    assert {(r["model"], r["method"]) for r in rows} == \
        {("gpt2", m) for m in ours} | {("lstm", m) for m in ours if m != "ours_device"}
    gpt2 = {r["method"]: r for r in rows if r["model"] == "gpt2"}
    assert all(r["same_tokens"] == "True" for r in gpt2.values())
    lengths = graph_memory.SIZES["toy"]["gpt2"]["n_positions"]
    # alias binding: one graph per length and cache set, plus a reorder graph per direction
    assert int(gpt2["ours_unplanned"]["graphs"]) == 2 * lengths + 2
    assert int(gpt2["ours_device"]["graphs"]) == 2 + 2
    assert all(int(r["shapes_served"]) == lengths for r in gpt2.values())
    assert float(gpt2["ours_planned"]["arena_mib"]) > 0
    assert float(gpt2["ours_planned"]["private_mib"]) == 0 < float(gpt2["ours_unplanned"]["private_mib"])
    for r in rows:   # our capture time by phase: each measured, together within capture_s
        phases = [float(r[f"{p}_s"]) for p in ("record", "plan", "build")]
        assert all(s >= 0 for s in phases) and sum(phases) <= float(r["capture_s"]) + 1e-3
    summary = common.read_summary("graph_memory")
    assert summary["all_tokens_equal"] is True
    assert summary["ptgraph_over_ours_memory"] is None    # no PyTorch, no memory on the simulator
    assert 1.0 <= summary["arena_over_peak_live"] <= 1.10
    assert summary["provenance"]["transformers"]          # (absent here, a version on the GPU)
    assert common.read_csv("graph_memory_driver")         # the probe ran, each in a child
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


@pytest.mark.skipif(backend.SIMULATOR, reason="driver memory exists only on a GPU")
def test_per_length_graphs_uploaded_in_a_fresh_process_hold_a_kib_a_node():
    """The driver's memory for executables, read where nothing freed earlier can hide it: a
    fresh process, N graphs of K kernel nodes, each uploaded. At least 1 KiB a node (2.2-4.5
    KiB were measured on the H100 and H200)."""
    out = isolate.run("experiments.graph_memory:driver_probe", {"graphs": 256, "nodes": 64})
    assert out["taken_mib"] * 2**20 >= 256 * 64 * 1024, json.dumps(out)
