"""The autovm experiment at toy size: every policy runs the tiny VGG-11 tape, matches the
unconstrained run bit for bit, and the CSV, summary and figure carry what the README quotes.
Results go to a temporary folder, so a GPU test run never overwrites full-size results."""
import math

import pytest

from experiments import autovm, common
from proto import backend


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
def test_autovm_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    autovm.run("toy")
    rows = common.read_csv("autovm")
    spec = autovm.SIZES["toy"]
    for policy in ("paging", "autovm", "autovm_recompute"):
        mine = [r for r in rows if r["policy"] == policy]
        assert sorted(float(r["budget_frac"]) for r in mine) == sorted(spec["fracs"])
        assert all(float(r["step_ms"]) > 0 and not r.get("error") for r in mine)
    # same kernels (here: the same host math) in the same order => the same bits
    assert all(r["loss_equal"] == "True" and r["grads_equal"] == "True" for r in rows)
    tight = [r for r in rows if r["policy"] == "autovm" and float(r["budget_frac"]) < 1]
    assert all(int(r["d2h_bytes"]) > 0 and int(r["arena_bytes"]) <= int(r["budget_bytes"]) for r in tight)
    paged = [r for r in rows if r["policy"] == "paging" and float(r["budget_frac"]) < 1]
    assert all(int(r["faulted_bytes_per_step"]) > 0 for r in paged)
    assert all(r["git_commit"] and r["device"] for r in rows)  # provenance on every row
    summary = common.read_summary("autovm")
    assert summary["all_policies_bit_identical"] is True
    by = {(r["policy"], r["budget_frac"]): float(r["step_ms"]) for r in rows}
    assert math.isclose(summary["paging_over_autovm_step"],
                        by[("paging", "0.5")] / by[("autovm", "0.5")])
    assert math.isclose(summary["autovm_over_unconstrained_step"],
                        by[("autovm", "0.5")] / by[("unconstrained", "")])
    figure = autovm.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)


def test_host_math_keeps_the_tape_and_changes_only_how_ops_compute():
    from proto.models import vgg
    cfg = vgg.VGGConfig(depth=11, **autovm.SIZES["toy"]["config"])
    tape = vgg.build_tape(cfg)
    host = autovm.host_math(tape, cfg)
    assert host.tensors is tape.tensors
    assert [(o.name, o.reads, o.writes, o.flops) for o in host.ops] == \
        [(o.name, o.reads, o.writes, o.flops) for o in tape.ops]
    assert all(a.run is not b.run for a, b in zip(host.ops, tape.ops))
