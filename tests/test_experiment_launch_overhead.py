"""The launch_overhead experiment at toy size: it runs, writes its CSV, summary and figure,
and the summary carries the headline keys the README quotes. Results go to a temporary
folder, so a GPU test run never overwrites the full-size results/<device>/ files."""
from experiments import common, launch_overhead


def test_launch_overhead_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    launch_overhead.run("toy")
    rows = common.read_csv("launch_overhead")
    counts = launch_overhead.COUNTS["toy"]
    assert sorted({int(r["kernels"]) for r in rows}) == counts
    for method in ("numba_eager", "numba_graph"):
        mine = [r for r in rows if r["method"] == method]
        assert len(mine) == len(counts)
        assert all(float(r["us_per_kernel"]) > 0 for r in mine)
    assert all(r["git_commit"] and r["device"] for r in rows)  # provenance on every row
    summary = common.read_summary("launch_overhead")
    assert summary["kernels"] == counts[-1]
    for key in ("eager_over_graph_per_kernel", "eager_us_per_kernel", "graph_us_per_kernel"):
        assert summary[key] > 0
    at_largest = {r["method"]: float(r["us_per_kernel"]) for r in rows
                  if int(r["kernels"]) == counts[-1]}
    assert summary["eager_us_per_kernel"] == at_largest["numba_eager"]
    assert summary["graph_us_per_kernel"] == at_largest["numba_graph"]
    figure = launch_overhead.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)
