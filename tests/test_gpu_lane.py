"""tests.gpu_lane's planning and counting, without running a lane: every test file is run
exactly once, the files that read free memory only in the phase after, each slow file in a
shard of its own, the rest balanced by size; pytest's last lines are summed."""
import pytest
from hypothesis import given, strategies as st

from proto.device import backend
from tests import gpu_lane as L


def _check_partition(files, groups):
    flat = [f for g in groups for f in g]
    assert sorted(flat) == sorted(f for f in files if f not in L.ALONE)
    assert len(flat) == len(set(flat))


def test_every_test_file_of_the_repository_runs_once():
    files = L.test_files()
    assert "tests/test_gpu_lane.py" in files and set(L.ALONE) <= set(files)
    groups = L.shards(files, 4)
    _check_partition(files, groups)
    assert len(groups) == 4 and all([f] in groups for f in L.SLOW)


@given(sizes=st.lists(st.integers(1, 10**5), min_size=0, max_size=40),
       n=st.integers(len(L.SLOW) + 1, 10), with_slow=st.booleans())
def test_shards_partition_and_balance(sizes, n, with_slow):
    files = [f"tests/test_f{i}.py" for i in range(len(sizes))]
    files += list(L.ALONE) + (list(L.SLOW) if with_slow else [])
    size = dict(zip(files, sizes))
    groups = L.shards(files, n, size=lambda f: size.get(f, 10**9))
    _check_partition(files, groups)
    assert len(groups) <= n
    if with_slow:
        assert all([f] in groups for f in L.SLOW)
    loads = [sum(size[f] for f in g) for g in groups if not set(g) & set(L.SLOW)]
    if len(loads) == n - len(L.SLOW) * with_slow:   # every free shard has a file: greedy's bound
        assert max(loads) - min(loads) <= max(sizes)


def test_too_few_shards_are_refused():
    with pytest.raises(ValueError, match=f"--shards: at least {len(L.SLOW) + 1}"):
        L.shards(L.test_files(), len(L.SLOW))


def test_totals_sum_pytests_last_lines():
    outs = ["....\n4 passed, 1 warning in 252.00s (0:04:12)\n",
            "F..\n=== 1 failed, 88 passed, 1 warning in 81.22s (0:01:21) ===\n",
            "s.\n======== 9 passed, 3 skipped in 10.1s ========\n",
            "crashed before any summary\n"]
    assert L.totals(outs) == {"passed": 101, "failed": 1, "skipped": 3, "errors": 0}
    assert L.totals(["E\n1 passed, 2 errors in 3.0s\n"])["errors"] == 2


@pytest.mark.skipif(not backend.SIMULATOR,
                    reason="the refusal is the simulator's; on a GPU main() runs the lane")
def test_the_lane_refuses_the_simulator():
    with pytest.raises(SystemExit, match="needs a real CUDA device"):
        L.main([])


def test_slow_shards_show_their_output_and_the_rest_do_not():
    """A slow file's shard logs its passing tests' output (each experiment method's process
    seconds); every other shard only pytest's summary."""
    for f in L.SLOW:
        assert L._command([f])[-2:] == [*L.SHOW_OUTPUT, f]
    rest = ["tests/test_gemm.py", "tests/test_plan.py"]
    assert not set(L.SHOW_OUTPUT) & set(L._command(rest)) and L._command(rest)[-2:] == rest


def test_phase_one_processes_share_the_cores_among_their_thread_pools(monkeypatch):
    """Each thread pool of a phase-1 process gets its share of the cores (16 over 8 shards:
    2; never 0), and a value the caller set is kept."""
    for k in L.THREAD_POOLS:
        monkeypatch.delenv(k, raising=False)
    env = L.shard_env(8, cores=16)
    assert all(env[k] == "2" for k in L.THREAD_POOLS)
    assert L.shard_env(8, cores=4)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    env = L.shard_env(8, cores=16)
    assert env["OPENBLAS_NUM_THREADS"] == "7" and env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"] == L.os.environ["PATH"]
