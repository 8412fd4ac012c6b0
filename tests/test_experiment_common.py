"""Result files are written whole or not at all: an interrupted write leaves the previous
results in place and no temporary file behind; rates keep their leading digits."""
import math
import pathlib

import pytest
from hypothesis import given, strategies as st

from experiments import common


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    return tmp_path


def _leftovers(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


def test_an_interrupted_csv_keeps_the_previous_one(results):
    path = common.write_csv("demo", [{"a": 1}, {"a": 2}])
    before = path.read_text()
    with pytest.raises(ValueError, match="fields not in fieldnames"):
        common.write_csv("demo", [{"a": 3}, {"b": 4}])   # fails after a row is written
    assert path.read_text() == before and not _leftovers(results)
    common.write_csv("demo", [{"a": 5}])
    assert [r["a"] for r in common.read_csv("demo")] == ["5"] and not _leftovers(results)


def test_an_interrupted_summary_keeps_the_previous_one(results, monkeypatch):
    path = common.write_summary("demo", {"ratio": 1.5})
    before = path.read_text()
    real_write = pathlib.Path.write_text

    def write_half_then_stop(self, text, *args, **kwargs):
        real_write(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(pathlib.Path, "write_text", write_half_then_stop)
        common.write_summary("demo", {"ratio": 2.5})
    assert path.read_text() == before and common.read_summary("demo")["ratio"] == 1.5
    assert not _leftovers(results)


def test_an_interrupted_figure_keeps_the_previous_one(results):
    rows = [{"device": "test device"}]
    fig, _ = common.new_figure(rows)
    path = common.save_figure(fig, "demo")
    before = path.read_bytes()
    fig, _ = common.new_figure(rows)

    def savefig_half_then_stop(target, **kwargs):
        pathlib.Path(target).write_bytes(b"\x89PNG truncated")
        raise KeyboardInterrupt

    fig.savefig = savefig_half_then_stop
    with pytest.raises(KeyboardInterrupt):
        common.save_figure(fig, "demo")
    assert path.read_bytes() == before and not _leftovers(results)


@given(st.floats(min_value=1e-6, max_value=1e6), st.integers(min_value=1, max_value=6))
def test_significant_keeps_a_small_rate_nonzero_and_its_leading_digits(x, digits):
    # A 64 KiB copy on the simulator runs at a few hundredths of a GB/s: rounded to fixed
    # decimals it read 0.0 and the bandwidth fractions divided by it.
    got = common.significant(x, digits)
    assert got > 0
    assert abs(got - x) <= 0.5 * 10 ** (math.floor(math.log10(x)) - digits + 1) * (1 + 1e-9)


HERE = {"device": "GPU A", "git_commit": "abc123", "numpy": "2.1",
        "date": "2026-12-08T10:00:00Z"}
EARLIER = {**HERE, "date": "2026-12-07T09:00:00Z"}


def test_a_run_keeps_the_rows_of_its_commit_and_device_for_the_other_methods(results,
                                                                             monkeypatch):
    """A run of some methods keeps an earlier run's rows of the others where that run was at
    this commit on this device, each cell as written, its own date included; rows of the
    methods it runs again, of other commits and of other devices go."""
    monkeypatch.setattr(common, "provenance", lambda: HERE)
    common.write_csv("demo", [
        {"method": "a", "ms": 1.5, "n": 3, "ok": True, "note": None, "digest": "12e4", **EARLIER},
        {"method": "b", "ms": 2.0, "n": 3, "ok": False, "note": "x", "digest": "ab", **EARLIER},
        {"method": "c", "ms": 3.0, "n": 3, "ok": True, "note": "x", "digest": "ab",
         **EARLIER, "git_commit": "0ld0ld"},
        {"method": "d", "ms": 4.0, "n": 3, "ok": True, "note": "x", "digest": "ab",
         **EARLIER, "device": "GPU B"}])
    kept = common.rows_of_this_commit("demo", exclude=["b"], text=("digest",))
    assert kept == [{"method": "a", "ms": 1.5, "n": 3, "ok": True, "note": None,
                     "digest": "12e4", **EARLIER}]   # (numpy's "2.1" too: as written)
    assert common.rows_of_this_commit("demo", ["b"])[0]["digest"] == 12e4   # (not `text`)
    # written again beside this run's row, the kept row keeps its own date and commit
    common.write_csv("demo", kept + [{"method": "b", "ms": 2.5, "n": 3, "ok": True,
                                      "note": None, "digest": "cd"}])
    rows = common.read_csv("demo")
    assert [(r["method"], r["date"]) for r in rows] == [("a", EARLIER["date"]),
                                                        ("b", HERE["date"])]
    assert list(rows[0])[:6] == ["method", "ms", "n", "ok", "note", "digest"]  # (provenance last)
    assert common.rows_of_this_commit("missing") == []


@pytest.mark.parametrize("commit", ["abc123-dirty", "unknown"])
def test_a_dirty_or_unknown_commit_never_merges(results, monkeypatch, commit):
    """Rows stamped with a dirty tree's commit (or none) may come from other code than this
    run's, even where the stamp is the same: never kept."""
    here = {**HERE, "git_commit": commit}
    monkeypatch.setattr(common, "provenance", lambda: here)
    common.write_csv("demo", [{"method": "a", "ms": 1.0, **here, "date": EARLIER["date"]}])
    assert common.rows_of_this_commit("demo", exclude=["b"]) == []
    assert not common.of_this_commit(here)


def test_runs_groups_the_methods_by_their_runs_date(results):
    rows = [{"method": "a", "date": "d1"}, {"method": "b", "date": "d2"},
            {"method": "c", "date": "d1"}]
    assert common.runs(rows) == {"d1": ["a", "c"], "d2": ["b"]}
    # by another column (end_to_end's setups, many rows each), each name once
    rows = [{"setup": "x", "method": m, "date": "d1"} for m in "ab"] + [
        {"setup": "y", "method": "a", "date": "d2"}]
    assert common.runs(rows, key="setup") == {"d1": ["x"], "d2": ["y"]}


def test_a_run_of_some_setups_keeps_the_rows_of_the_others(results, monkeypatch):
    """Keyed by another column than the method (end_to_end's setup): the rows of the setups
    run again go, the others of this commit and device stay, their key as written."""
    monkeypatch.setattr(common, "provenance", lambda: HERE)
    common.write_csv("demo", [{"setup": "12", "method": "a", "ms": 1.0, **EARLIER},
                              {"setup": "12", "method": "b", "ms": 2.0, **EARLIER},
                              {"setup": "fp16", "method": "a", "ms": 3.0, **EARLIER},
                              {"setup": "4", "method": "a", "ms": 4.0, **EARLIER,
                               "device": "GPU B"}])
    kept = common.rows_of_this_commit("demo", exclude=["fp16"], key="setup")
    assert [(r["setup"], r["method"], r["ms"]) for r in kept] == [("12", "a", 1.0),
                                                                  ("12", "b", 2.0)]
