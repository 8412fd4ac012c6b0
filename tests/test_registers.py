"""kernels.registers' arithmetic: what ptxas -v says, and how many blocks an SM that allows.
The expected occupancies are the H200's, as ncu reported them for our kernels
(dev/notes/decode.md), not recomputed from the formula under test."""
import pytest

from kernels import registers as R

PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN7kernels9attention' for 'sm_90'
ptxas info    : Function properties for _ZN7kernels9attention
    0 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 114 registers, used 1 barriers, 2112 bytes smem, 928 bytes cmem[0]
"""


def test_parse_reads_registers_spills_and_shared_memory():
    assert R.parse_ptxas(PTXAS) == {"registers": 114, "spill_stores": 12, "spill_loads": 16,
                                    "shared": 2112}


def test_parse_refuses_output_without_a_register_count():
    with pytest.raises(ValueError, match="no register count"):
        R.parse_ptxas("ptxas fatal   : Unsupported .version 9.5; current version is '9.0'")


@pytest.mark.parametrize("registers, shared, threads, blocks, seen", [
    (64, 2112, 256, 4, "attention: 64 registers, 4 blocks of 256 an SM, 50% theoretical"),
    (80, 40960, 256, 3, "decode GEMM: 80 registers, 37.5% theoretical occupancy"),
    (114, 2112, 256, 2, "attention with its first batch preloaded: 2 blocks an SM"),
    (128, 256, 512, 1, "reduce + layer norm, launch bounds (512, 1)"),
    (32, 0, 1024, 2, "2048 threads an SM"),
    (64, 65952, 256, 3, "66 KB of shared memory a block"),
    (16, 0, 32, 32, "32 blocks an SM at most"),
])
def test_blocks_per_sm(registers, shared, threads, blocks, seen):
    assert R.blocks_per_sm(registers, shared, threads) == blocks, seen


def test_ptxas_gets_the_kernels_register_cap(monkeypatch):
    """A kernel's `max_registers` reaches the linker, not the PTX, so ptxas must be told it:
    without it the convolutions' 128-register tiles read as 170 registers and no spills."""
    seen = []
    monkeypatch.setattr(R.subprocess, "run", lambda argv, **kw: (
        seen.append(argv), type("Run", (), {"stdout": PTXAS, "stderr": ""})())[1])
    R._ptxas(".version 8.0", (9, 0), 128)
    R._ptxas(".version 8.0", (9, 0))
    assert "-maxrregcount=128" in seen[0] and "-arch=sm_90" in seen[0]
    assert not any(a.startswith("-maxrregcount") for a in seen[1])
