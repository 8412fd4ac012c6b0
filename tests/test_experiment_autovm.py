"""The autovm experiment at toy size: every policy runs the tiny VGG-11 tape, matches the
unconstrained run bit for bit, and the CSV, summary and figure carry what the README quotes.
Results go to a temporary folder, so a GPU test run never overwrites full-size results."""
import pytest

from experiments import autovm, common
from proto.device import backend


@pytest.mark.skipif(not backend.SIMULATOR, reason="the toy size is the simulator's")
def test_autovm_toy_run_writes_results_and_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    autovm.run("toy")
    rows = common.read_csv("autovm")
    spec = autovm.SIZES["toy"]
    for policy in ("paging", "autovm", "autovm_recompute", "autovm_managed",
                   "autovm_managed_recompute"):
        mine = [r for r in rows if r["policy"] == policy]
        assert sorted(float(r["budget_frac"]) for r in mine) == sorted(spec["fracs"])
        assert all(float(r["step_ms"]) > 0 and not r.get("error") for r in mine)
    # same kernels (here: the same host math) in the same order => the same bits; the
    # unconstrained run is the reference, never compared with itself
    ours = [r for r in rows if r["policy"] != "unconstrained"]
    assert all(r["loss_equal"] == "True" and r["grads_equal"] == "True" for r in ours)
    assert [r["loss_equal"] for r in rows if r["policy"] == "unconstrained"] == [""]
    tight = [r for r in rows if r["policy"] == "autovm" and float(r["budget_frac"]) < 1]
    assert all(int(r["d2h_bytes"]) > 0 and int(r["arena_bytes"]) <= int(r["budget_bytes"]) for r in tight)
    paged = [r for r in rows if r["policy"] == "paging" and float(r["budget_frac"]) < 1]
    assert all(int(r["faulted_bytes_per_step"]) > 0 for r in paged)
    # at 100% the budget is the arena's size (the unconstrained plan's): nothing leaves
    whole = [r for r in rows if r["policy"] == "paging" and float(r["budget_frac"]) == 1]
    assert [int(r["arena_bytes"]) <= int(r["budget_bytes"]) for r in whole] == [True]
    assert [(r["evicted_bytes_per_step"], r["faulted_bytes_per_step"]) for r in whole] == [("0", "0")]
    assert all(r["git_commit"] and r["device"] for r in rows)  # provenance on every row
    summary = common.read_summary("autovm")
    assert summary["all_policies_bit_identical"] is True
    assert summary["policies_checked"] == len(ours) == 5 * len(spec["fracs"])
    managed = [r for r in rows if r["policy"].startswith("autovm_managed")]
    assert all(0 < int(r["peak_pages"]) <= int(r["max_pages"]) for r in managed)
    by = {(r["policy"], r["budget_frac"]): float(r["step_ms"]) for r in rows}
    assert summary["autovm_managed_step_ms"] == by[("autovm_managed", "0.5")]
    assert summary["paging_over_autovm_managed_step"] == pytest.approx(
        by[("paging", "0.5")] / by[("autovm_managed", "0.5")])
    assert summary["paging_over_autovm_managed_recompute_step"] == pytest.approx(
        by[("paging", "0.5")] / by[("autovm_managed_recompute", "0.5")])
    assert summary["paging_step_ms"] == by[("paging", "0.5")]
    assert summary["autovm_step_ms"] == by[("autovm", "0.5")]
    assert summary["unconstrained_step_ms"] == by[("unconstrained", "")]
    # which convolutions ran, per row: the toy's widths (4-32 channels) are all below
    # Winograd's threshold, and its host math runs no kernels
    assert {r["convolution"] for r in rows} == {"direct"}
    assert {r["winograd_layers"] for r in rows} == {"0"}
    # the launchers' own scratch, which no budget counts, is reported (host math: none)
    assert summary["kernel_scratch_mib"] == max(int(r["kernel_scratch_bytes"]) for r in rows) / 2**20
    # where the unconstrained step's time goes: one row per op of the tape, by kind
    ops = common.read_csv("autovm_ops")
    tape_ops = [op.name for op in autovm._Case(11, "toy").tape.ops]
    assert [r["op"] for r in ops] == tape_ops and all(float(r["ms"]) >= 0 for r in ops)
    assert {"conv fwd", "conv bwd_data", "conv bwd_weight", "pool fwd", "loss"} <= {r["kind"] for r in ops}
    assert sum(summary["unconstrained_ms_by_kind"].values()) == pytest.approx(
        sum(float(r["ms"]) for r in ops), rel=1e-3)
    figure = autovm.plot()
    assert figure.exists() and figure.stat().st_size > 10_000
    assert figure.is_relative_to(tmp_path)


def test_summary_picks_the_headline_rows_and_counts_only_real_comparisons():
    """Decoys at other budgets and models must not leak into the headline ratios; a policy
    whose bits differ turns the verdict; the unconstrained run is not a comparison."""
    def row(model, policy, frac, ms, equal=True):
        r = {"model": model, "policy": policy, "budget_frac": frac, "step_ms": ms,
             "pinned_h2d_gbps": 50.0, "fault_h2d_gbps": 10.0}
        if policy != "unconstrained":
            r.update(loss_equal=equal, grads_equal=equal, max_rel_diff=0.0 if equal else 1e-3)
        return r

    rows = [row("vgg11", "unconstrained", "", 10.0), row("vgg11", "paging", 0.5, 80.0),
            row("vgg11", "autovm", 0.5, 20.0), row("vgg11", "autovm_recompute", 0.5, 25.0),
            row("vgg11", "paging", 1.0, 11.0), row("vgg11", "autovm", 1.0, 10.5),
            row("vgg13", "paging", 0.5, 999.0), row("vgg13", "autovm", 0.5, 1.0)]
    s = autovm.summarize(rows, "toy")
    assert (s["paging_over_autovm_step"], s["autovm_over_unconstrained_step"],
            s["recompute_over_autovm_step"]) == (4.0, 2.0, 1.25)
    assert s["policies_checked"] == 7 and s["all_policies_bit_identical"] is True
    rows[5] = row("vgg11", "autovm", 1.0, 10.5, equal=False)
    s = autovm.summarize(rows, "toy")
    assert s["all_policies_bit_identical"] is False and s["max_rel_diff_any_policy"] == 1e-3
