"""A/B on the GPU, one process, of two switches of the LSTM's step, each off by default:
- gemm's skinny tiles (LSTMLM(skinny_tiles=True): 16 x 256 for M <= 16, 32 x 128 for M <= 32)
  against TILE (64 x 64) for every 9..32-row product;
- the cell summing the gate GEMMs' K-split partials (LSTMLM(sum_in_cell=True):
  `gemm.split_products`, then `lstm.lstm_cell` with both biases) against each gate GEMM
  reducing its own splits (a reduction launch each, 4 of the step's 15 launches).
Four variants: tile, skinny, cell, both.

Why: the LSTM's graphed step spends most of its time in the tiled GEMM (on the H100 153 us
of a 218 us step), and its steps have 9..64 rows (the shrinking loop's batch 64..1; M <= 8
takes the decode kernels). A 64-row tile computes and stages 64 rows whatever M is: a
9..16-row step wastes 3/4 of its multiply-adds. The skinny tiles keep the 256 threads, the
4 x 4 register tile and the 4096 outputs a block, and split K in their own K steps. The
split-K reductions took 33 us of that step in 5 launches; the cell can absorb 4.

What it times, variants interleaved (7 rounds after a warm-up round, the order alternating):
1. the LSTM's graphed shrinking loop (as dev.ab.ab_lstm_views: LSTMConfig(2, 512, 1024,
   10000), batch 64..1, GraphedLSTM alias/exact, the argmax writing into the token buffer),
   milliseconds a token, each loop from the same state and prompt. Graphs keep the kernels
   chosen when they recorded, so each variant has its own GraphedLSTM, recorded with the
   switch in its position (both built before any timing);
2. the tiled GEMM alone on the LSTM's shapes (x @ W_ih0.T, h @ W_hh.T accumulating, the head
   h @ W_dec.T; each + bias) at M = 9, 16, 24, 32: a CUDA graph per variant of one GEMM on
   each of enough rotating copies of the weight and output to overflow L2, median of 20
   replays, per GEMM (tile and skinny only: the cell's switch does not change gemm);
3. correctness: one step's logits at batch 32, 24, 16 and 9 from the same state and prompt
   under every variant (max abs difference relative to the logits' largest magnitude), and
   the tokens of a whole loop, every step's. First of all, each variant's graphs at those
   batches must launch the tiles its switches choose (else the run stops: it would time the
   same kernels twice).

Decision rules (fixed before any run), each switch on its own:
- flip `SKINNY_TILES`'s default to on only if the loop's median with skinny tiles is below
  every sample of TILE's, no GEMM at M = 16 or M = 32 is more than 2% slower (median over
  median <= 1.02), and the logits agree within 1e-4 relative and the tokens are equal;
- flip `SUM_IN_CELL`'s default to on only if the loop's median of `cell` is below every
  sample of `tile` and the median of `both` below every sample of `skinny` (so it wins
  whichever tiles are chosen), with the logits and tokens of both as above.
The last lines say so, a line a switch: "VERDICT: ... merge ..." or "VERDICT: ... keep off
..." with the reasons.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_lstm_tiles 2>&1 | tee $OUT/ab_lstm_tiles.txt

AB_TOY=1 checks the script on the simulator (tiny sizes; timings meaningless there).
"""
import statistics
import sys
import time

import numpy as np

from kernels import gemm, sampling
from dev.ab._ab_step import TOY, _report, describe
from proto.device import backend, timing
from proto import graph
from proto.device.backend import cuda
from proto.models.graphed import GraphedLSTM
from proto.models.lstm import LSTMConfig, LSTMLM, random_state_dict

# name -> the LSTMLM arguments a variant sets; the first is the base of the ratios and of the
# decision rule
SKINNY, CELL = {"skinny_tiles": True}, {"sum_in_cell": True}
VARIANTS = {"tile": {}, "skinny": SKINNY, "cell": CELL, "both": {**SKINNY, **CELL}}
GEMM_VARIANTS = ("tile", "skinny")   # the variants whose gemm() differs
GEMM_ROWS = (9, 16) if TOY else (9, 16, 24, 32)
GATED_ROWS = (16, 32)     # the GEMM rows the decision rule weighs
LOGIT_BATCHES = (10, 9) if TOY else (32, 24, 16, 9)
LOGIT_TOL, GEMM_SLOWER = 1e-4, 1.02


def skinny(variant: str) -> bool:
    return VARIANTS[variant].get("skinny_tiles", False)


def _l2_copies(nbytes: int) -> int:
    """Copies of `nbytes` of operands that overflow L2 three times (the weights stream from
    memory, as in the LSTM's step, whose weights are about 100 MB)."""
    if TOY or backend.SIMULATOR:
        return 1
    return max(1, min(64, -(-3 * cuda.get_current_device().L2_CACHE_SIZE // nbytes)))


def gemm_shapes(cfg: LSTMConfig):
    """(name, K, N, accumulate) of the LSTM step's GEMMs (trans_b, + bias): proto.models.lstm."""
    E, H, V = cfg.n_embd, cfg.n_hidden, cfg.vocab_size
    return [("x@W_ih0.T", E, 4 * H, False), ("h@W_hh.T", H, 4 * H, True),
            ("head", H, V, False)]


def gemm_graphs(cfg: LSTMConfig, rng) -> dict:
    """(shape name, M, variant) -> (graph, GEMMs in it): each variant's graph recorded with
    its switches on, over the same operands."""
    graphs = {}
    for name, K, N, accumulate in gemm_shapes(cfg):
        w_host = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        copies = _l2_copies(4 * (w_host.size + 2 * max(GEMM_ROWS) * N))
        ws = [cuda.to_device(w_host) for _ in range(copies)]
        bias = cuda.to_device(rng.standard_normal(N).astype(np.float32))
        for m in GEMM_ROWS:
            x = cuda.to_device(rng.standard_normal((m, K)).astype(np.float32))
            outs = [cuda.to_device(np.zeros((m, N), np.float32)) for _ in range(copies)]
            for variant in GEMM_VARIANTS:
                fns = [lambda w=w, out=out, x=x, s=skinny(variant): gemm.gemm(
                    x, w, out, bias=bias, trans_b=True, accumulate=accumulate, skinny=s)
                    for w, out in zip(ws, outs)]
                t, splits, span = gemm.tiled_launch_plan(1, m, N, K, skinny=skinny(variant))
                print(f"{name:10s} M={m:2d} K={K} N={N} {variant:7s}: {tuple(t)}, "
                      f"{splits} K splits of {span}, {copies} copies", flush=True)
                for fn in fns:
                    fn()
                g = graph.capture(lambda fns=fns, **_: [fn() for fn in fns], {},
                                  binding="alias", warmup=0)
                graphs[name, m, variant] = (g, copies)
    return graphs


def recorded_tiles(g: GraphedLSTM, batch: int) -> set:
    """The tiles of the tiled GEMMs that `batch`'s graph launches: what it recorded (read from
    GraphedLSTM's own graphs, `_graphs`: it has no public accessor)."""
    tile_of = {id(k): key[2] for key, k in gemm.TILED_KERNELS.items()}
    nodes = g.graphed.graph(0, batch).description.nodes
    return {tile_of[id(n.kernel)] for n in nodes if id(getattr(n, "kernel", None)) in tile_of}


def main() -> int:
    cfg = LSTMConfig(1, 8, 8, 11) if TOY else LSTMConfig(2, 512, 1024, 10000)
    B, ROUNDS, REPS = (10, 1, 1) if TOY else (64, 7, 5)
    # the loop's batches B..LAST (the toy's two tiled steps only: on the simulator a decode
    # step takes seconds)
    LAST = B - 1 if TOY else 1
    steps = B - LAST + 1
    BENCH = dict(warmup=0, reps=1) if TOY else dict(warmup=3, reps=20)
    names = list(VARIANTS)
    if not TOY:
        for t in (gemm.TILE, *gemm.SKINNY):
            describe(f"tiled {t.bm} x {t.bn} (trans_b)", gemm.TILED_KERNELS[(False, True, t)])
    weights = random_state_dict(cfg, seed=0)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, B).astype(np.int32)
    lstms = {}
    for name, settings in VARIANTS.items():   # each variant a model of its own arguments
        t0 = time.perf_counter()
        model = LSTMLM(cfg, weights, max_batch=B, **settings)
        g = GraphedLSTM(model, max_batch=B, binding="alias", strategy="exact")
        g.build_all()
        lstms[name] = g
        print(f"built {name}'s graphs (batch {B}..1) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    for b in LOGIT_BATCHES:   # each variant's graphs launch the tiles its switches choose
        for name in VARIANTS:
            want = {gemm.tiled_tile(1, b, n, skinny(name))
                    for n in (4 * cfg.n_hidden, cfg.vocab_size)}
            got = recorded_tiles(lstms[name], b)
            print(f"batch {b:2d} {name:7s} graph's tiles: {sorted(map(tuple, got))}", flush=True)
            if got != want:
                raise RuntimeError(f"{name}'s batch {b} graph recorded {got}, not {want}")
    zeros = {n: [np.zeros(a.shape, np.float32) for a in g.state.arrays()]
             for n, g in lstms.items()}

    def start(n):   # every loop from the same state and prompt (each loop advances the state)
        g = lstms[n]
        g.tokens.copy_to_device(prompt)
        for a, z in zip(g.state.arrays(), zeros[n]):
            a.copy_to_device(z)
        backend.synchronize()

    def loop(n, record=None):
        g = lstms[n]
        for b in range(B, LAST - 1, -1):
            sampling.argmax(g.step(g.tokens, b), backend.leading(g.tokens, b))
            if record is not None:
                record.append(g.tokens.copy_to_host()[:b])
        backend.synchronize()

    graphs = {}
    try:
        # correctness first: every step's tokens of a loop, and one step's logits
        tokens = {}
        for n in names:
            start(n)
            tokens[n] = []
            loop(n, tokens[n])
        same_tokens = {n: len(tokens[names[0]]) == len(tokens[n]) and all(
            np.array_equal(x, y) for x, y in zip(tokens[names[0]], tokens[n])) for n in names}
        worst = dict.fromkeys(names, 0.0)
        for b in LOGIT_BATCHES:
            logits = {}
            for n in names:
                start(n)
                logits[n] = lstms[n].step(lstms[n].tokens, b).copy_to_host()
            base = logits[names[0]]
            scale = float(np.abs(base).max()) or 1.0
            for n in names[1:]:
                rel = float(np.abs(logits[n] - base).max()) / scale
                worst[n] = max(worst[n], rel)
                print(f"logits at batch {b:2d}: {n} against {names[0]}: max |diff| / max "
                      f"|logit| = {rel:.2e}", flush=True)

        graphs = gemm_graphs(cfg, np.random.default_rng(3))
        loop_ms = {n: [] for n in names}
        gemm_us = {key: [] for key in graphs}
        for r in range(ROUNDS + 1):   # round 0 warms up
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                ts = []
                for _ in range(REPS):
                    start(n)
                    t0 = time.perf_counter()
                    loop(n)
                    ts.append((time.perf_counter() - t0) / steps * 1e3)
                if r:
                    loop_ms[n].append(statistics.median(ts))
            for key in sorted(graphs, key=lambda k: (k[0], k[1], order.index(k[2]))):
                g, copies = graphs[key]
                us = timing.bench(g.replay, **BENCH).median_us / copies
                if r:
                    gemm_us[key].append(us)
    finally:
        for g in [*lstms.values(), *(g for g, _ in graphs.values())]:
            g.close()

    width = max(len(n) for n in names)
    _report("LSTM shrinking loop", loop_ms, width, ".4f", ".4f", "ms a token")
    slower = []
    for name, _, _, _ in gemm_shapes(cfg):
        for m in GEMM_ROWS:
            samples = {n: gemm_us[name, m, n] for n in GEMM_VARIANTS}
            _report(f"GEMM {name:10s} M={m:2d}", samples, width, "8.2f", ".2f", "us")
            for n in GEMM_VARIANTS[1:]:
                ratio = np.median(samples[n]) / np.median(samples[GEMM_VARIANTS[0]])
                if m in GATED_ROWS and ratio > GEMM_SLOWER:
                    slower.append(f"{name} M={m} {ratio:.3f}x")
    agree = {n: same_tokens[n] and worst[n] <= LOGIT_TOL for n in names}
    for n in names[1:]:
        print(f"{n} against {names[0]}: tokens equal: {same_tokens[n]}; logits within "
              f"{LOGIT_TOL:g}: {worst[n] <= LOGIT_TOL} (worst {worst[n]:.2e})", flush=True)
    toy = " (AB_TOY: timings meaningless)" if TOY else ""

    def faster(new, old) -> list[str]:   # the loop's rule: new's median under every old sample
        if np.median(loop_ms[new]) < min(loop_ms[old]):
            return []
        return [f"the loop's {new} median {np.median(loop_ms[new]):.4f} ms is not below every "
                f"{old} sample (min {min(loop_ms[old]):.4f})"]

    def same(*variants) -> list[str]:
        return [f"{n}'s logits or tokens differ from tile's (worst {worst[n]:.2e}, tokens "
                f"equal {same_tokens[n]})" for n in variants if not agree[n]]

    rules = {  # switch -> the reasons to keep it off (none: flip it on)
        "SKINNY_TILES": faster("skinny", "tile") + (
            [f"GEMMs more than {GEMM_SLOWER - 1:.0%} slower: {', '.join(slower)}"]
            if slower else []) + same("skinny"),
        "SUM_IN_CELL": faster("cell", "tile") + faster("both", "skinny") + same("cell", "both"),
    }
    medians = ", ".join(f"{n} {np.median(loop_ms[n]):.4f}" for n in names)
    for switch, reasons in rules.items():
        if reasons:
            print(f"VERDICT {switch}: keep off: {'; '.join(reasons)}{toy}")
        else:
            print(f"VERDICT {switch}: merge (flip it to True): ms a token {medians}; logits and "
                  f"tokens agree{toy}")
    return 0 if all(agree.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
