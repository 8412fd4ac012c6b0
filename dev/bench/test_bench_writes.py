"""The benches' --write (bench_train_gemm, bench_conv1d): which measured variant becomes an
entry of the per-GPU table (kernels.tuning)."""
from dev.bench.bench_train_gemm import MARGIN, tuned_entries
from kernels import gemm as G, tuning
from kernels._tile import Tiles

MMA = Tiles(16, 32, 8, 2, 4, True)


def test_the_bench_writes_a_shape_only_where_a_tile_beats_the_default_by_the_margin():
    """fc1: the fastest of two tiles that clear the margin; fc2: one that does not."""
    def row(shape, variant, us, tile, stages=0, whole=False, via_nt=False, fold=False):
        return dict(frames=120, shape=shape, variant=variant, us=us, m=960, n=3072, k=768,
                    trans_a=False, trans_b=True, tile=tile, stages=stages, whole=whole,
                    via_nt=via_nt, fold=fold)
    clear, close = 1 - 2 * MARGIN, 1 - MARGIN / 2
    rows = [row("fc1 fwd", "default (64, 64, 16, 4, 4, False) x1", 100.0, G.TILE),
            row("fc1 fwd", "mma s0 whole via NT", 100.0 * clear, MMA, 0, True, True),
            row("fc1 fwd", "mma s3 split fold", 100.0 * (clear + 0.01), MMA, 3, fold=True),
            row("fc2 fwd", "default (64, 64, 16, 4, 4, False) x2", 100.0, G.TILE),
            row("fc2 fwd", "mma s0 split", 100.0 * close, MMA)]
    (entry,) = tuned_entries(rows)
    assert (entry["shape"], entry["tile"], entry["stages"], entry["whole"],
            entry["via_nt"], entry["fold"]) == ("fc1 fwd", list(MMA), 0, True, True, False)
    path_entry = {k: entry[k] for k in ("trans_a", "trans_b", "m", "n", "k", "tile",
                                        "stages", "whole", "via_nt", "fold")}
    assert tuning._gemm_entry(path_entry, None)[2] == (MMA, 0, True, True, False)
    rows[2]["us"] = 100.0 * (clear - 0.01)   # the folded split fastest: an entry that folds
    (entry,) = tuned_entries(rows)
    assert (entry["stages"], entry["whole"], entry["via_nt"], entry["fold"]) == (3, False, False,
                                                                                 True)


def test_the_conv_bench_writes_a_layer_only_where_a_tile_beats_the_default_by_the_margin():
    """k3: the faster of two tiles that clear the margin; k2: one that does not; a tile
    that failed its gross-error check (NaN) is never chosen."""
    from dev.bench.bench_conv1d import MARGIN, conv_entries
    t1, t2 = Tiles(128, 128, 8, 8, 8, True), Tiles(128, 64, 8, 8, 4, True)
    k3, k2 = ("fwd", 512, 512, 1, 3, 2), ("bwd_data", 512, 512, 1, 2, 2)
    totals = {k3: {None: 10.0, t1: 10.0 * (1 - 2 * MARGIN), t2: 10.0 * (1 - 3 * MARGIN)},
              k2: {None: 10.0, t1: 10.0 * (1 - MARGIN / 2), t2: float("nan")}}
    (entry,) = conv_entries(totals)
    assert (entry["op"], entry["s"], entry["tile"]) == ("fwd", 3, list(t2))
    assert tuning._conv_entry(entry, None) == (k3, t2)
