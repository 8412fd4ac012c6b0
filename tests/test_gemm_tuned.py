"""kernels.gemm_tuned: which measured tile choice a product takes, and the files' checks.
The table and the distances are restated here from the rule in the module's docstring."""
import json

import numpy as np
import pytest

from kernels import gemm as G, gemm_tuned
from kernels._tile import Tiles
from tests.helpers import dev, rand
from tests.test_gemm_tf32 import _derived_bound

MMA = Tiles(16, 32, 8, 2, 4, True)
ENTRIES = (((False, True), (960, 3072, 768), MMA, 0, False),
           ((True, False), (768, 768, 960), G.TILE, 2, True),
           ((False, True), (1592, 3072, 768), G.WIDE_TILE, 0, True))


@pytest.mark.parametrize("product,want", [
    ((False, True, 960, 3072, 768), (MMA, 0, False)),           # the entry itself
    ((False, True, 1200, 3072, 768), (MMA, 0, False)),          # nearer 960 than 1592
    ((False, True, 1400, 3072, 768), (G.WIDE_TILE, 0, True)),   # nearer 1592
    ((False, True, 960, 2304, 768), (MMA, 0, False)),           # N within a factor of 2
    ((True, False, 768, 768, 520), (G.TILE, 2, True)),          # K 960 / 520 < 2
    ((True, False, 768, 768, 400), None),                       # K 960 / 400 > 2
    ((False, False, 960, 3072, 768), None),                     # no entry of this layout
    ((False, True, 960, 768, 768), None),                       # N 3072 / 768 = 4
])
def test_a_product_takes_the_nearest_entry_within_a_factor_of_two(product, want):
    assert gemm_tuned.choice(*product, ENTRIES) == want


def test_a_device_without_a_file_has_no_entries():
    assert gemm_tuned.table("no-such-gpu") == ()


def test_a_malformed_entry_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_tuned, "DIR", tmp_path)
    good = dict(trans_a=False, trans_b=True, m=960, n=3072, k=768,
                tile=[128, 128, 8, 8, 8, True], stages=0, whole=False)
    (tmp_path / "gpu-a.json").write_text(json.dumps({"entries": [good]}))
    assert gemm_tuned.table("gpu-a") == (((False, True), (960, 3072, 768),
                                         Tiles(128, 128, 8, 8, 8, True), 0, False),)
    for bad in ({k: v for k, v in good.items() if k != "stages"}, {**good, "stages": 1},
                {**good, "tile": [128, 128]}):
        (tmp_path / "gpu-b.json").write_text(json.dumps({"entries": [bad]}))
        gemm_tuned.table.cache_clear()
        with pytest.raises(ValueError, match="gpu-b.json: malformed entry"):
            gemm_tuned.table("gpu-b")
    gemm_tuned.table.cache_clear()


@pytest.mark.parametrize("whole", [False, True])
def test_gemm_launches_the_tuned_tile_and_still_matches_reference(monkeypatch, whole):
    """With an entry for the product, `tiled` launches the entry's tile, staging and K split
    (a whole-K tensor tile here), and the result is the reference's; a batched product and
    one that a caller splits (split_products) keep the default."""
    launched = []
    real = G.tiled_kernel
    monkeypatch.setattr(G, "tiled_kernel", lambda *a: (launched.append(a), real(*a))[1])
    m, n, k = 40, 24, 64
    monkeypatch.setattr(G, "TUNED", (((False, True), (m, n, k), MMA, 0, whole),))
    rng = np.random.default_rng(0)
    a, b = rand(rng, m, k), rand(rng, n, k)
    out = dev(np.zeros((m, n), np.float32))
    G.gemm(dev(a), dev(b), out, trans_b=True)
    assert launched == [(False, True, MMA, 0)]
    splits = G.tiled_plan(MMA, 1, m, n, k, 1 if whole else None)[0]
    err = np.abs(out.copy_to_host() - a.astype(np.float64) @ b.T)
    assert np.all(err <= _derived_bound(k, splits, None)(np.abs(a) @ np.abs(b).T))
    launched.clear()
    G.gemm(dev(a[None].repeat(2, 0)), dev(b[None].repeat(2, 0)),
           dev(np.zeros((2, m, n), np.float32)), trans_b=True)
    assert [t[2] for t in launched] == [G.tiled_launch_plan(2, m, n, k)[0]]



def test_the_stamp_names_the_table_and_its_contents(tmp_path, monkeypatch):
    import hashlib
    monkeypatch.setattr(gemm_tuned, "DIR", tmp_path)
    assert gemm_tuned.stamp("gpu-a") == "none"
    body = b'{"entries": []}'
    (tmp_path / "gpu-a.json").write_bytes(body)
    assert gemm_tuned.stamp("gpu-a") == f"gpu-a.json:{hashlib.sha256(body).hexdigest()[:12]}"
