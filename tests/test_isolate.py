"""experiments.isolate: one measurement, one process. The children's targets live here, in
a module that imports no kernels, so each child starts in about a second (the GPU lane's
children of experiments' test modules spent about 40 s each loading every kernel)."""
import pytest

from experiments import common, isolate


def child_report(value: int) -> dict:
    """What a child process returns, with a fact only that process can know."""
    import os
    return {"value": value * 2, "pid": os.getpid()}


def child_fails(message: str) -> dict:
    raise RuntimeError(message)


def child_sleeps(seconds: float) -> dict:
    import time
    time.sleep(seconds)
    return {}


def test_a_child_process_runs_the_target_and_returns_its_result():
    import os
    out = isolate.run("tests.test_isolate:child_report", {"value": 21})
    assert out["value"] == 42 and out["pid"] != os.getpid()   # another process
    with pytest.raises(isolate.ChildFailed, match="child_fails.*exit status 1"):
        isolate.run("tests.test_isolate:child_fails", {"message": "boom"})
    with pytest.raises(isolate.ChildFailed, match="no answer in"):
        isolate.run("tests.test_isolate:child_sleeps", {"seconds": 30},
                    timeout=3)
    with pytest.raises(ValueError, match="target: expected 'module:function'"):
        isolate.run("tests.test_isolate", {})


def child_method(method: str, size: str) -> dict:
    if method.startswith("broken"):
        raise RuntimeError(f"{method} at {size}")
    return {"method": method}


def test_a_failed_method_costs_its_row_and_ours_are_raised_after_the_rest(tmp_path, monkeypatch):
    """One method's failure does not stop the others; a baseline's is only recorded, ours
    are raised once the caller has the rest, and the earlier run's summary goes."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(isolate, "torch_missing", lambda *_: None)
    common.write_summary("exp", {"stale": True})
    unavailable = {}
    done = [m for m, _ in isolate.each_method(
        "exp", ["broken_ours", "ours", "broken_baseline"],
        "tests.test_isolate:child_method", "toy",
        baselines=("broken_baseline",), unavailable=unavailable)]
    assert done == ["ours"]
    assert set(unavailable) == {"broken_ours", "broken_baseline"}
    assert not unavailable["broken_baseline"].startswith(isolate.OURS_FAILED)
    with pytest.raises(isolate.ChildFailed, match="1 of our methods failed: broken_ours"):
        isolate.raise_failures("exp", unavailable)
    assert not (common.results_dir() / "exp.summary.json").exists()
    del unavailable["broken_ours"]
    isolate.raise_failures("exp", unavailable)


def slow_child_method(method: str, size: str) -> dict:
    import time
    time.sleep(60 if method == "slow" else 0)
    return {"method": method}


def test_a_method_that_outlives_its_time_costs_only_its_row(tmp_path, monkeypatch):
    """`timeouts` stops one method's child at its limit; the next method still runs."""
    monkeypatch.setattr(common, "ROOT", tmp_path)
    unavailable = {}
    done = [m for m, _ in isolate.each_method(
        "exp", ["slow", "quick"], "tests.test_isolate:slow_child_method",
        "toy", baselines=(), unavailable=unavailable, timeouts={"slow": 5})]
    assert done == ["quick"]
    assert "no answer in 5 s" in unavailable["slow"]
