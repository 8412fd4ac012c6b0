"""CNN-shaped training tapes made of elementwise math, for testing memory policies.

The memory pattern is a CNN's: each "conv" saves its input and pre-activation for backward,
each "pool" halves the size and saves its input, and backward walks the layers in reverse,
reading what forward saved. The math is arbitrary but every value depends on every tensor
read, so a policy that hands an op stale or missing data changes the result.

`host_ops=True` computes on the host (fast on the simulator, where a kernel launch costs tens
of milliseconds); `False` launches the project's elementwise kernels on the given stream (for
the GPU, where the streams and events are real).
"""
from __future__ import annotations

import numpy as np

from kernels import elementwise as ew
from proto import graph
from proto.tape import Op, Tape, TensorSpec


def _gelu_host(x: np.ndarray) -> np.ndarray:
    return ew.gelu_ref(x)


def _op(name, phase, reads, writes, fn_host, fn_dev, host_ops, layer):
    """An Op whose run() reads `reads`, computes, writes `writes`."""
    if host_ops:
        def run(arrays, stream):
            graph.require_eager(f"op {name!r} (host_ops=True)")
            outs = fn_host(*[arrays[r].copy_to_host() for r in reads])
            for w, value in zip(writes, outs):
                arrays[w].copy_to_device(np.ascontiguousarray(value, dtype=np.float32))
    else:
        def run(arrays, stream):
            fn_dev(*[arrays[n] for n in reads + writes], stream=stream)
    return Op(name, phase, tuple(reads), tuple(writes), run, layer=layer)


def cnn_tape(n0: int, layers: str, *, host_ops: bool = True, update: bool = True,
             seed: int = 0) -> tuple[Tape, dict[str, np.ndarray]]:
    """A step of a toy CNN on an input of `n0` floats; `layers` is a string of 'c' (conv-like:
    same size, then an activation) and 'p' (pool: halves the size; needs an even size).
    Returns the tape and initial values of its persistent tensors."""
    if not layers or set(layers) - {"c", "p"}:
        raise ValueError(f"layers: expected a non-empty string of 'c' and 'p', got {layers!r}")
    rng = np.random.default_rng(seed)
    tensors: dict[str, TensorSpec] = {}
    init: dict[str, np.ndarray] = {}
    ops: list[Op] = []

    def tensor(name, n, kind):
        tensors[name] = TensorSpec(name, (n,), kind)
        return name

    def op(*args):
        ops.append(_op(*args, host_ops=host_ops, layer=args[0].split(".")[0]))

    h, n = tensor("x", n0, "input"), n0
    init["x"] = rng.standard_normal(n0).astype(np.float32)
    saved = []   # (kind, layer, input, extra) in forward order
    for li, kind in enumerate(layers):
        lay = f"{kind}{li}"
        if kind == "c":
            w, dw = tensor(f"{lay}.w", n, "param"), tensor(f"{lay}.dw", n, "grad")
            init[w] = (0.1 * rng.standard_normal(n)).astype(np.float32)
            c, r = tensor(f"{lay}.pre", n, "activation"), tensor(f"{lay}.out", n, "activation")
            op(f"{lay}.fwd", "forward", [h, w], [c], lambda x, w_: [x + w_], ew.add)
            op(f"{lay}.act", "forward", [c], [r], lambda x: [_gelu_host(x)], ew.gelu)
            saved.append(("c", lay, h, c, w, dw))
            h = r
        else:
            if n % 2:
                raise ValueError(f"layers: pool {lay} needs an even size, got {n}")
            n //= 2
            p = tensor(f"{lay}.out", n, "activation")
            op(f"{lay}.fwd", "forward", [h], [p], lambda x: [x[:len(x) // 2] + x[len(x) // 2:]],
               lambda x, out, stream: ew.add(x[:out.size], x[out.size:], out, stream=stream))
            saved.append(("p", lay, h, None, None, None))
            h = p
    loss = tensor("loss", n, "activation")
    op("head.loss", "loss", [h], [loss], lambda x: [_gelu_host(x)], ew.gelu)
    g = tensor(f"d.{h}", n, "activation")
    op("head.bwd", "backward", [h], [g], lambda x: [_gelu_host(x)], ew.gelu)
    for kind, lay, x, c, w, dw in reversed(saved):
        nx = tensors[x].shape[0]
        if kind == "p":
            gx = tensor(f"d.{x}", nx, "activation")
            op(f"{lay}.bwd", "backward", [g, x], [gx],
               lambda g_, x_: [np.concatenate([g_ + x_[:len(g_)], g_ + x_[len(g_):]])],
               lambda g_, x_, out, stream: (ew.add(g_, x_[:g_.size], out[:g_.size], stream=stream),
                                            ew.add(g_, x_[g_.size:], out[g_.size:], stream=stream)))
            g = gx
            continue
        gc = tensor(f"d.{c}", nx, "activation")
        op(f"{lay}.act_bwd", "backward", [g, c], [gc], lambda g_, c_: [_gelu_host(g_ + c_)],
           lambda g_, c_, out, stream: (ew.add(g_, c_, out, stream=stream), ew.gelu(out, out, stream=stream)))
        op(f"{lay}.dw", "backward", [gc, x], [dw], lambda g_, x_: [g_ + x_], ew.add)
        if tensors[x].kind != "input":
            gx = tensor(f"d.{x}", nx, "activation")
            op(f"{lay}.dx", "backward", [gc], [gx], lambda g_: [_gelu_host(g_)], ew.gelu)
            g = gx
        if update:
            op(f"{lay}.sgd", "update", [w, dw], [w], lambda w_, d_: [w_ + d_],
               lambda w_, d_, out, stream: ew.add(w_, d_, out, stream=stream))
    return Tape(tensors, ops), init
