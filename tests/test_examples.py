"""The tour (examples/): every script runs and ends well, on this lane's device."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("[0-9]*.py"))


def test_the_tour_has_its_six_scripts():
    assert [p.name[:2] for p in EXAMPLES] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script):
    env = {**os.environ, "PROTO_QUIET": "1",
           "PYTHONPATH": str(script.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the script printed nothing"
