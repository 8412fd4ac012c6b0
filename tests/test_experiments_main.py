"""`python -m experiments --plot-only --device NAME` draws another machine's results (the
H200's, committed) on this one: into figures/NAME/, stamped with the rows' device, and
without touching this machine's own results folder."""
import shutil

import pytest

from experiments import __main__ as cli
from experiments import common

COMMITTED = common.REPO / "results" / "h200"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(common, "DEVICE", None)   # main() sets it for the process
    return tmp_path


def test_plot_only_draws_the_named_devices_results(root, capsys):
    (root / "results" / "h200").mkdir(parents=True)
    for f in ("launch_overhead.csv", "launch_overhead.summary.json"):
        shutil.copy(COMMITTED / f, root / "results" / "h200" / f)
    assert cli.main(["launch_overhead", "--plot-only", "--device", "h200"]) == 0
    figure = root / "figures" / "h200" / "launch_overhead.png"
    assert figure.stat().st_size > 10_000
    assert sorted(p.name for p in (root / "results").iterdir()) == ["h200"]
    assert sorted(p.name for p in (root / "figures").iterdir()) == ["h200"]
    out = capsys.readouterr().out
    assert str(figure) in out and common.SIM_WARNING not in out


def test_device_without_plot_only_is_refused(root, capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch_overhead", "--device", "h200"])
    assert "--device: only with --plot-only" in capsys.readouterr().err


def test_a_device_without_results_is_refused(root, capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch_overhead", "--plot-only", "--device", "h100"])
    assert "--device: no folder results/h100/" in capsys.readouterr().err
    assert not (root / "results").exists()


@pytest.mark.parametrize("argv, error", [
    (["gptj", "wav2vec2_train", "--methods", "ours_eager"], "name exactly one experiment"),
    (["--methods", "ours_eager"], "name exactly one experiment"),
    (["kernel_speed", "--methods", "x"],
     "--methods: kernel_speed runs all its methods; only gptj, wav2vec2_train take --methods"),
    (["gptj", "--methods", "ours_eager,nope"], "unknown gptj method(s) ['nope']; choose from"),
    (["wav2vec2_train", "--methods", ","], "unknown wav2vec2_train method(s) []"),
    (["gptj", "--plot-only", "--methods", "ours_eager"], "--methods: not with --plot-only"),
])
def test_methods_is_refused_where_it_cannot_mean_anything(root, capsys, argv, error):
    with pytest.raises(SystemExit):
        cli.main(argv)
    err = capsys.readouterr().err
    assert error in err
    if "choose from" in error:
        assert "ptgraph_private" in err   # (the experiment's methods, listed)
    assert not (root / "results").exists()


def test_methods_reaches_the_experiments_run(root, monkeypatch):
    """--methods picks among wav2vec2_train's methods and its checks; run gets them."""
    from experiments import wav2vec2_train as w
    asked = []

    def run(size, methods=None):
        asked.append(methods)
        common.write_summary(w.NAME, {})
    monkeypatch.setattr(w, "run", run)
    monkeypatch.setattr(w, "plot", lambda: "figure.png")
    assert cli.main(["wav2vec2_train", "--methods", "check_bits, hf_eager"]) == 0
    assert asked == [["check_bits", "hf_eager"]]


@pytest.mark.parametrize("argv, error", [
    (["end_to_end", "--size", "full", "--setups", "12L-d768-fp16,12L"],
     "--setups: unknown end_to_end setup(s) ['12L'] at size full; choose from "
     "['4L-d256', '12L-d768', '12L-d768-fp16']"),
    (["end_to_end", "--size", "toy", "--setups", "12L-d768"],   # (a full size's label)
     "--setups: unknown end_to_end setup(s) ['12L-d768'] at size toy; choose from ['toy-1L-d8"),
    (["end_to_end", "--setups", " , "], "--setups: unknown end_to_end setup(s) []"),
    (["gptj", "--setups", "4L-d256"],
     "--setups: gptj runs all its setups; only end_to_end takes --setups"),
    (["end_to_end", "gptj", "--setups", "4L-d256"], "--setups: name exactly one experiment"),
    (["end_to_end", "--plot-only", "--setups", "4L-d256"], "--setups: not with --plot-only"),
    (["end_to_end", "--methods", "numba_eager"],
     "--methods: end_to_end runs all its methods; only gptj, wav2vec2_train take --methods"),
])
def test_setups_is_refused_where_it_cannot_mean_anything(root, capsys, argv, error):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert error in capsys.readouterr().err
    assert not (root / "results").exists()


def test_setups_reaches_end_to_ends_run(root, monkeypatch):
    """--setups picks among the labels of --size's setups; run gets them, in the order named
    (run keeps SIZES' order)."""
    from experiments import end_to_end as e
    asked = []

    def run(size, setups=None):
        asked.append((size, setups))
        common.write_summary(e.NAME, {})
    monkeypatch.setattr(e, "run", run)
    monkeypatch.setattr(e, "plot", lambda: "figure.png")
    assert cli.main(["end_to_end", "--size", "full", "--setups", "12L-d768,4L-d256"]) == 0
    assert cli.main(["end_to_end", "--size", "full"]) == 0
    assert asked == [("full", ["12L-d768", "4L-d256"]), ("full", None)]
