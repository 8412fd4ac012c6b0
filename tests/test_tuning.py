"""kernels.tuning: which measured tile choice a product or a layer takes, and the files'
checks.
The table and the distances are restated here from the rule in the module's docstring."""
import json

import numpy as np
import pytest

from kernels import conv, gemm as G, tuning
from kernels._tile import Tiles
from proto.device import backend
from tests.helpers import dev, rand
from tests.test_gemm_tf32 import _derived_bound

MMA = Tiles(16, 32, 8, 2, 4, True)
Choice = tuning.GemmChoice
ENTRIES = (((False, True), (960, 3072, 768), Choice(MMA, 0, False)),
           ((True, False), (768, 768, 960), Choice(G.TILE, 2, True, True)),
           ((False, True), (1592, 3072, 768), Choice(G.WIDE_TILE, 0, True)))


@pytest.mark.parametrize("product,want", [
    ((False, True, 960, 3072, 768), Choice(MMA, 0, False)),           # the entry itself
    ((False, True, 1200, 3072, 768), Choice(MMA, 0, False)),          # nearer 960 than 1592
    ((False, True, 1400, 3072, 768), Choice(G.WIDE_TILE, 0, True)),  # nearer 1592
    ((False, True, 960, 2304, 768), Choice(MMA, 0, False)),           # N within a factor of 2
    ((True, False, 768, 768, 520), Choice(G.TILE, 2, True, True)),    # K 960 / 520 < 2
    ((True, False, 768, 768, 400), None),                       # K 960 / 400 > 2
    ((False, False, 960, 3072, 768), None),                     # no entry of this layout
    ((False, True, 960, 768, 768), None),                       # N 3072 / 768 = 4
])
def test_a_product_takes_the_nearest_entry_within_a_factor_of_two(product, want):
    assert tuning.gemm_choice(*product, ENTRIES) == want


def test_a_device_without_a_file_has_no_entries():
    assert tuning.table("no-such-gpu") == tuning.Table((), ())


def test_a_malformed_entry_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "DIR", tmp_path)
    tuning.table.cache_clear()
    good = dict(trans_a=False, trans_b=True, m=960, n=3072, k=768,
                tile=[128, 128, 8, 8, 8, True], stages=0, whole=False)
    (tmp_path / "gpu-a.json").write_text(json.dumps({"gemm": {"entries": [good]}}))
    assert tuning.table("gpu-a").gemm == (((False, True), (960, 3072, 768),
                                           Choice(Tiles(128, 128, 8, 8, 8, True), 0, False)),)
    (tmp_path / "gpu-g.json").write_text(json.dumps({"gemm": {"entries": [
        {**good, "via_nt": True, "fold": True}]}}))
    assert tuning.table("gpu-g").gemm[0][2][3:] == (True, True)   # (via_nt, fold)
    for bad in ({k: v for k, v in good.items() if k != "stages"}, {**good, "stages": 1},
                {**good, "tile": [128, 128]}):
        (tmp_path / "gpu-b.json").write_text(json.dumps({"gemm": {"entries": [bad]}}))
        tuning.table.cache_clear()
        with pytest.raises(ValueError, match="gpu-b.json: malformed gemm entry"):
            tuning.table("gpu-b")
    tuning.table.cache_clear()


@pytest.mark.parametrize("whole", [False, True])
def test_gemm_launches_the_tuned_tile_and_still_matches_reference(monkeypatch, whole):
    """With an entry for the product, `tiled` launches the entry's tile, staging and K split
    (a whole-K tensor tile here), and the result is the reference's; a batched product and
    one that a caller splits (split_products) keep the default."""
    launched = []
    real = G.tiled_kernel
    monkeypatch.setattr(G, "tiled_kernel", lambda *a: (launched.append(a), real(*a))[1])
    m, n, k = 40, 24, 64
    monkeypatch.setattr(G, "TUNED", (((False, True), (m, n, k), Choice(MMA, 0, whole)),))
    rng = np.random.default_rng(0)
    a, b = rand(rng, m, k), rand(rng, n, k)
    out = dev(np.zeros((m, n), np.float32))
    G.gemm(dev(a), dev(b), out, trans_b=True)
    assert launched == [(False, True, MMA, 0, False)]
    splits = G.tiled_plan(MMA, 1, m, n, k, 1 if whole else None)[0]
    err = np.abs(out.copy_to_host() - a.astype(np.float64) @ b.T)
    assert np.all(err <= _derived_bound(k, splits, None)(np.abs(a) @ np.abs(b).T))
    launched.clear()
    G.gemm(dev(a[None].repeat(2, 0)), dev(b[None].repeat(2, 0)),
           dev(np.zeros((2, m, n), np.float32)), trans_b=True)
    assert [t[2] for t in launched] == [G.tiled_launch_plan(2, m, n, k)[0]]


@pytest.mark.parametrize("trans_a,trans_b", [(True, False), (False, False), (True, True)])
def test_a_via_nt_entry_transposes_the_operands_and_runs_the_nt_tile(monkeypatch, trans_a,
                                                                      trans_b):
    """An entry with via_nt: the operand(s) not contiguous along K are transposed first (one
    transpose launch each), the product runs on the NT kernel of the entry's tile, and the
    result is the reference's within the tile's derived bound, bias and accumulate
    included."""
    from kernels import layout
    launched = []
    real_tiled, real_launch = G.tiled_kernel, G.launch
    monkeypatch.setattr(G, "tiled_kernel", lambda *a: (launched.append(a), real_tiled(*a))[1])
    transposes = []
    monkeypatch.setattr(layout, "launch",
                        lambda k, *a: (transposes.append(k), real_launch(k, *a))[1])
    m, n, k = 40, 24, 64
    monkeypatch.setattr(G, "TUNED", (((trans_a, trans_b), (m, n, k),
                                      Choice(MMA, 0, False, True)),))
    rng = np.random.default_rng(2)
    a, b, bias, old = rand(rng, m, k), rand(rng, n, k), rand(rng, n), rand(rng, m, n)
    out = dev(old)
    G.gemm(dev(np.ascontiguousarray(a.T) if trans_a else a),
           dev(b if trans_b else np.ascontiguousarray(b.T)), out, bias=dev(bias),
           trans_a=trans_a, trans_b=trans_b, accumulate=True)
    assert launched == [(False, True, MMA, 0, False)]
    assert transposes == [layout.transpose_kernel] * (int(trans_a) + int(not trans_b))
    splits = G.tiled_plan(MMA, 1, m, n, k)[0]
    want = old.astype(np.float64) + a.astype(np.float64) @ b.T + bias
    sizes = np.abs(old) + np.abs(a) @ np.abs(b).T + np.abs(bias)
    assert np.all(np.abs(out.copy_to_host() - want) <= _derived_bound(k, splits, None)(sizes))



def test_the_stamp_names_the_table_and_its_contents(tmp_path, monkeypatch):
    import hashlib
    monkeypatch.setattr(tuning, "DIR", tmp_path)
    assert tuning.stamp("gpu-a") == "none"
    body = b'{"entries": []}'
    (tmp_path / "gpu-a.json").write_bytes(body)
    assert tuning.stamp("gpu-a") == f"gpu-a.json:{hashlib.sha256(body).hexdigest()[:12]}"


CONV_ENTRIES = ((("fwd", 512, 512, 1, 3, 2), conv.SIM_CONV_MMA_TILES[0]),
                (("bwd_data", 512, 512, 1, 2, 2), conv.SIM_CONV_TILES[1]))


@pytest.mark.parametrize("layer,want", [
    (("fwd", 512, 512, 1, 3, 2), conv.SIM_CONV_MMA_TILES[0]),
    (("bwd_data", 512, 512, 1, 2, 2), conv.SIM_CONV_TILES[1]),
    (("bwd_data", 512, 512, 1, 3, 2), None),   # the entry is the forward's
    (("fwd", 512, 512, 1, 3, 1), None),        # another stride
    (("fwd", 256, 512, 1, 3, 2), None),        # other channels
])
def test_a_layer_takes_only_its_own_entry(layer, want):
    assert tuning.conv_choice(*layer, CONV_ENTRIES) == want


def test_a_malformed_conv_entry_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "DIR", tmp_path)
    tuning.table.cache_clear()
    good = dict(op="fwd", c=512, k=512, r=1, s=3, stride=2, tile=[16, 32, 8, 2, 4, True])
    (tmp_path / "gpu-c.json").write_text(json.dumps({"conv": {"entries": [good]}}))
    assert tuning.table("gpu-c").conv == ((("fwd", 512, 512, 1, 3, 2),
                                           Tiles(16, 32, 8, 2, 4, True)),)
    for bad in ({**good, "op": "bwd_weight"}, {k: v for k, v in good.items() if k != "s"}):
        (tmp_path / "gpu-d.json").write_text(json.dumps({"conv": {"entries": [bad]}}))
        tuning.table.cache_clear()
        with pytest.raises(ValueError, match="gpu-d.json: malformed conv entry"):
            tuning.table("gpu-d")
    tuning.table.cache_clear()


def test_writing_a_section_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "DIR", tmp_path)
    monkeypatch.setenv("PROTO_GIT_COMMIT", "abc123")
    tuning.write_section("gpu-e", "gemm", [{"x": 1}], "bench a")
    tuning.write_section("gpu-e", "conv", [{"y": 2}], "bench b")
    body = json.loads((tmp_path / "gpu-e.json").read_text())
    assert body["gemm"]["entries"] == [{"x": 1}] and body["conv"]["entries"] == [{"y": 2}]
    assert body["conv"]["command"] == "bench b" and body["gemm"]["git_commit"] == "abc123"


CONV_MMA_TILES = conv.SIM_CONV_MMA_TILES if backend.SIMULATOR else conv.GPU_CONV_MMA_TILES


@pytest.mark.parametrize("op", ["fwd", "bwd_data"])
def test_a_convolution_launches_its_layers_tuned_tile(monkeypatch, op):
    """With an entry for the layer, conv2d (conv2d_bwd_data) launches the entry's tile, and
    the result is the reference's (the tensor tile within its derived bound)."""
    N, C, K, H, W, R, S, st = 2, 12, 16, 1, 19, 1, 3, 2   # (C R S past the all-taps kernel)
    tile = CONV_MMA_TILES[0]   # (one this backend built: the GPU's tiles are too large to
    #                            simulate, the simulator's are not built on a GPU)
    monkeypatch.setattr(conv, "TUNED", (((op, C, K, R, S, st), tile),))
    launched = []
    real = conv.launch
    monkeypatch.setattr(conv, "launch", lambda k, *a: (launched.append(k), real(k, *a))[1])
    rng = np.random.default_rng(1)
    x, w = rand(rng, N, C, H, W), rand(rng, K, C, R, S)
    P = conv.conv_out_size(W, S, st, 0)
    if op == "fwd":
        out = dev(np.zeros((N, K, H, P), np.float32))
        conv.conv2d(dev(x), dev(w), None, out, stride=st)
        assert launched == [conv._FWD[tile]]
        got, want, terms = out.copy_to_host(), conv.conv2d_ref(x, w, stride=st), C * R * S
        sizes = conv.conv2d_ref(np.abs(x), np.abs(w), stride=st)
    else:
        dy = rand(rng, N, K, H, P)
        dx = dev(np.zeros((N, C, H, W), np.float32))
        conv.conv2d_bwd_data(dev(dy), dev(w), dx, stride=st)
        assert launched == [conv._BWD_DATA[tile, st]]
        got, terms = dx.copy_to_host(), K * R * S
        want = conv.conv2d_bwd_data_ref(dy, w, x.shape, stride=st)
        sizes = conv.conv2d_bwd_data_ref(np.abs(dy), np.abs(w), x.shape, stride=st)
    assert np.all(np.abs(got - want) <= _derived_bound(terms, 1, None)(sizes))


def test_the_table_prints_one_line_an_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "DIR", tmp_path)
    tuning.table.cache_clear()
    gemm = dict(trans_a=True, trans_b=False, m=768, n=3072, k=960,
                tile=[128, 128, 8, 8, 8, True], stages=0, whole=True, via_nt=True)
    layer = dict(op="bwd_data", c=512, k=512, r=1, s=3, stride=2, tile=[128, 64, 8, 8, 4, True])
    (tmp_path / "gpu-f.json").write_text(json.dumps({"gemm": {"entries": [gemm]},
                                                     "conv": {"entries": [layer]}}))
    text = tuning.describe("gpu-f").splitlines()
    assert text[0].startswith("gpu-f: gpu-f.json:") and "1 gemm and 1 conv" in text[0]
    assert text[1] == ("  gemm TN 768 x 3072 x 960: (128, 128, 8, 8, 8, True) stages 0, K whole,"
                       " via NT")
    assert text[2] == "  conv bwd_data 512->512 1x3 stride 2: (128, 64, 8, 8, 4, True)"
    tuning.table.cache_clear()


def test_a_via_nt_product_in_a_graph_replays_the_eager_bits(monkeypatch):
    """The transposes' scratch is kernel scratch of the call (backend.empty): inside a
    recorded graph the planner places it, and a replay on new inputs gives the bits an eager
    call gives on them (a weight gradient's layout, TN)."""
    from proto import graph
    m, n, k = 40, 24, 64
    monkeypatch.setattr(G, "TUNED", (((True, False), (m, n, k), Choice(MMA, 0, False, True)),))
    rng = np.random.default_rng(3)
    out = dev(np.zeros((m, n), np.float32))

    def step(a, b):
        G.gemm(a, b, out, trans_a=True)
        return out

    with graph.capture(step, {"a": dev(rand(rng, k, m)), "b": dev(rand(rng, k, n))},
                       binding="alias") as g:
        a, b = rand(rng, k, m), rand(rng, k, n)
        g.placeholders["a"].copy_to_device(a)
        g.placeholders["b"].copy_to_device(b)
        got = g.replay(**g.placeholders).copy_to_host()
    want = dev(np.zeros((m, n), np.float32))
    G.gemm(dev(a), dev(b), want, trans_a=True)
    np.testing.assert_array_equal(got, want.copy_to_host())
    assert np.any(got != 0)


@pytest.mark.parametrize("tile,accumulate", [(MMA, True), (G.TILE, False)])
def test_a_folded_split_gives_the_reductions_bits_in_one_launch(monkeypatch, tile, accumulate):
    """fold: the K-split launch's last block per tile sums the partials in split order and
    applies the epilogue, as gemm_splitk_reduce_kernels does in a launch of its own: the
    same bits, no reduction launch, and every tile's counter back at zero after."""
    from kernels import _lastblock
    # four tiles (two of them partial), K four of the tile's shortest splits: four splits
    # a tile for 16 blocks, on the simulator and on a GPU alike
    m, n, k = 2 * tile.bm - 3, tile.bn + 5, 4 * G.tiled_min_span(tile)
    target = 16
    rng = np.random.default_rng(4)
    a, b, bias, old = rand(rng, m, k), rand(rng, n, k), rand(rng, n), rand(rng, m, n)
    assert G.tiled_plan(tile, 1, m, n, k, target)[0] == 4
    reductions = []
    real = G.launch
    monkeypatch.setattr(G, "launch", lambda kern, *a: (reductions.append(kern)
                                                      if kern is G.gemm_splitk_reduce_kernels[
                                                          np.dtype(np.float32)] else None,
                                                      real(kern, *a))[1])
    got = {}
    for fold in (False, True):
        out = dev(old[None])
        db = dev(b[None])
        G.tiled(dev(a[None]), db, out, dev(bias), 1, 1, int(accumulate), 0, 1, 0,
                target_blocks=target, tile=tile, fold=fold)
        got[fold] = out.copy_to_host()
    assert len(reductions) == 1   # the unfolded launch's only
    np.testing.assert_array_equal(got[True], got[False])
    want = (old if accumulate else 0) + a.astype(np.float64) @ b.T + bias
    assert np.all(np.isfinite(got[True])) and np.any(got[True] != old)
    sizes = (np.abs(old) if accumulate else 0) + np.abs(a) @ np.abs(b).T + np.abs(bias)
    assert np.all(np.abs(got[True][0] - G.gelu_ref(want)) <= _derived_bound(k, 4, "gelu")(sizes))
    assert not np.any(_lastblock.launch_counters(1).copy_to_host())


def test_a_folded_product_in_a_graph_replays_the_eager_bits(monkeypatch):
    """A tuned entry with fold, inside a recorded graph: a replay on new inputs gives the
    bits of an eager call, folded or not (the unfolded split's reduction launch)."""
    from proto import graph
    m, n, k = 40, 24, 2 * G.tiled_min_span(MMA)
    assert G.tiled_plan(MMA, 1, m, n, k)[0] == 2   # (two of the shortest splits)
    rng = np.random.default_rng(5)
    out = dev(np.zeros((m, n), np.float32))

    def step(a, b):
        G.gemm(a, b, out, trans_b=True)
        return out

    a, b = rand(rng, m, k), rand(rng, n, k)
    eager = []
    for fold in (False, True):
        monkeypatch.setattr(G, "TUNED", (((False, True), (m, n, k),
                                          Choice(MMA, 0, False, False, fold)),))
        got = dev(np.zeros((m, n), np.float32))
        G.gemm(dev(a), dev(b), got, trans_b=True)
        eager.append(got.copy_to_host())
    with graph.capture(step, {"a": dev(rand(rng, m, k)), "b": dev(rand(rng, n, k))},
                       binding="alias") as g:   # (folded: the last entry)
        g.placeholders["a"].copy_to_device(a)
        g.placeholders["b"].copy_to_device(b)
        replayed = g.replay(**g.placeholders).copy_to_host()
    np.testing.assert_array_equal(eager[0], eager[1])
    np.testing.assert_array_equal(eager[1], replayed)
    assert np.any(replayed != 0)


def test_the_tuned_kernels_are_compiled_for_the_layout_they_launch():
    """A via_nt entry launches the NT kernel of its tile (its operands transposed first), a
    folding one the folding kernel: the kernels compiled at import are those."""
    entries = (((True, False), (768, 3072, 960), Choice(MMA, 0, False, True, True)),
               ((False, False), (960, 768, 3072), Choice(G.TILE, 3, True)),
               ((False, True), (960, 3072, 768), Choice(MMA, 0, False, False, True)))
    assert G.tuned_kernels(entries) == [(False, True, MMA, 0, True), (False, False, G.TILE, 3,
                                                                      False)]


@pytest.mark.parametrize("device", sorted(p.stem for p in tuning.DIR.glob("*.json")))
def test_every_shipped_table_parses_and_names_kernels_to_compile(device):
    """What a GPU with this table does at import (kernels.gemm compiles the table's kernels),
    short of compiling: each entry parses and names a layout, tile and staging."""
    tuning.table.cache_clear()
    entries = tuning.table(device).gemm
    assert entries
    for ta, tb, tile, stages, fold in G.tuned_kernels(entries):
        assert isinstance(tile, Tiles) and stages != 1 and isinstance(fold, bool)
        assert (ta, tb) in ((False, False), (False, True), (True, False), (True, True))
