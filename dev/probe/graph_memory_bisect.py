"""Which part of recording GPT-2's decode step takes device memory that no allocation of ours
explains (dev/notes/graph_memory.md: 320 KiB a graph, none for the LSTM's).

One fresh process, GPT-2 small at beam 5, every reading a drop in free memory after Numba's
queued frees are flushed. Each case records N graphs of one function (nothing is freed in
between: the descriptions are kept), first without planning, then plans and applies them:

    python3 -m dev.probe.graph_memory_bisect [N]      (GPU only; about two minutes)

Cases: the whole step; the embedding alone; one layer's self-attention; one layer's
attention projection (gemm with its layer norm); one layer's MLP; the logits' gemm.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from proto.device import backend
from proto.device.backend import cuda, empty, reshaped
from proto.graph import plan as planner
from proto.graph.record import record


def reading(label: str, start: int | None = None, **extra) -> int:
    free, live = backend.settled_free_memory()
    print(json.dumps({"stage": label, "free_mib": free / 2**20, "numba_live_mib": live / 2**20,
                      "drop_mib": None if start is None else (start - free) / 2**20, **extra}),
          flush=True)
    return free


def main(n: int) -> int:
    from kernels import embedding, gemm, mlp, self_attention
    from proto.models.gpt2 import GPT2, GPT2Config, KVCache, LN_EPS, random_state_dict
    config = GPT2Config(12, 768, 12, 50257, 1024)
    model = GPT2(config, random_state_dict(config, 0), max_batch=5, max_tokens=5)
    cache = KVCache(config, 5, 1024)
    tokens = cuda.to_device(np.zeros((5, 1), np.int32))
    pos = cuda.to_device(np.array([7], np.int32))
    model.step(tokens, pos, cache)          # the warm-up: kernels loaded, eager scratch made
    B, C, L0 = 5, config.n_embd, model.layers[0]

    def t(name, *shape):
        return empty(shape, np.float32, name)

    cases = {
        "step": lambda: model.step(tokens, pos, cache),
        "embedding": lambda: embedding.embed(tokens, model.wte, t("x", B, 1, C), wpe=model.wpe,
                                             pos0=pos),
        "self_attention": lambda: self_attention.self_attention(
            t("ln", B, 1, C), L0.attn_w, L0.attn_b, cache.k[0], cache.v[0], pos, t("att", B, 1, C),
            n_head=config.n_head),
        "attn_proj": lambda: gemm.gemm(reshaped(t("att", B, 1, C), (B, C)), L0.attn_proj_w,
                                       t("x", B, C), bias=L0.attn_proj_b, accumulate=True,
                                       ln_out=(L0.ln_2_w, L0.ln_2_b, LN_EPS, t("ln", B, C))),
        "mlp": lambda: mlp.mlp(t("ln", B, C), L0.fc_w, L0.fc_b, L0.mlp_proj_w, L0.mlp_proj_b,
                               t("x", B, C), ln_out=(L0.ln_1_w, L0.ln_1_b, LN_EPS, t("y", B, C))),
        "logits": lambda: gemm.gemm(t("ln", B, C), model.wte, t("logits", B, config.vocab_size),
                                    trans_b=True),
    }
    for name, fn in cases.items():
        start = reading(f"{name}: before")
        kept = []
        for i in range(1, n + 1):
            with record(private=False) as rec:
                out = fn()
            kept.append((rec.description(), out))
            if i in (1, n // 4) and i < n:   # a fixed cost or one per recording: the slope
                reading(f"{name}: recorded {i}", start)
        reading(f"{name}: recorded {n}", start, nodes=len(kept[0][0].nodes))
        tape = planner.Tape(name)
        kept = [planner.apply(d, tape.plan_graph(d, planner.leaves(o)), tape.arena, o)
                for d, o in kept]
        reading(f"{name}: planned and applied {n}", start, arena_mib=tape.arena_bytes / 2**20)
    return 0


if __name__ == "__main__":
    if backend.SIMULATOR:
        sys.exit("GPU only: free device memory is what it reads")
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 128))
