"""No launcher accepts an output that overlaps another of its arguments (kernels/__init__.py).

For every public launcher in kernels/ and every (output, other argument) pair, the arrays are
views of one device buffer, the output placed a random number of bytes before or after the
other argument so that they share at least one byte. The launcher must raise ValueError
naming both before anything is launched (a recorder stands in for the device, so nothing
ever runs: the test is as cheap on the simulator as on a GPU). Exact in-place pairs that a
launcher documents (gelu's out may be x, ...) are accepted at offset 0.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import (attention, conv, elementwise, embedding, gemm, layernorm, linear,
                     loss, lstm, pool, relu, sampling, sgd, softmax)
from proto.device import backend
from proto.device.backend import cuda

I32, F32 = np.int32, np.float32


@dataclasses.dataclass(frozen=True)
class Case:
    arrays: dict                    # launcher argument -> (shape, dtype)
    call: Callable[[dict], None]    # calls the launcher with those arrays
    outputs: tuple[str, ...]        # the arguments it writes
    in_place: tuple = ()            # (output, input) pairs it documents as "may be the same"
    aliases: dict = dataclasses.field(default_factory=dict)   # names kernels give an argument


def _f(*shape):
    return shape, F32


def _i(*shape):
    return shape, I32


_BEAM = dict(values=_f(1, 4), indices=_i(1, 4), scores=_f(2, 1), tokens=_i(2, 1), parents=_i(2),
             hist_src=_i(2, 4), hist_dst=_i(2, 4), best=_f(1), best_hist=_i(4), best_meta=_i(3),
             state=_i(5), pos=_i(1), flag=_i(1), bad=_i(1))
# 2 x 8 x 8 = 128 reduction rows: a forced 2-way split stays two even at the widest step (32)
_WGRAD = dict(x=_f(2, 2, 8, 8), dy=_f(2, 3, 8, 8), dw=_f(3, 2, 3, 3), db=_f(3))

CASES = {
    "gelu": Case(dict(x=_f(6), out=_f(6)), lambda a: elementwise.gelu(a["x"], a["out"]),
                 ("out",), (("out", "x"),)),
    "add": Case(dict(a=_f(6), b=_f(6), out=_f(6)),
                lambda a: elementwise.add(a["a"], a["b"], a["out"]), ("out",),
                (("out", "a"), ("out", "b"))),
    "relu": Case(dict(x=_f(2, 3), out=_f(2, 3)), lambda a: relu.relu(a["x"], a["out"]),
                 ("out",), (("out", "x"),)),
    "relu_bwd": Case(dict(y=_f(5), dy=_f(5), dx=_f(5)),
                     lambda a: relu.relu_bwd(a["y"], a["dy"], a["dx"]), ("dx",), (("dx", "dy"),)),
    "embed": Case(dict(tokens=_i(2, 3), wte=_f(7, 4), out=_f(2, 3, 4), wpe=_f(5, 4), pos0=_i(1)),
                  lambda a: embedding.embed(a["tokens"], a["wte"], a["out"], wpe=a["wpe"],
                                            pos0=a["pos0"]), ("out",)),
    "masked_softmax": Case(dict(x=_f(2, 5), length=_i(1), out=_f(2, 5)),
                           lambda a: softmax.masked_softmax(a["x"], a["length"], a["out"]),
                           ("out",), (("out", "x"),)),
    "log_softmax": Case(dict(x=_f(2, 5), out=_f(2, 5)),
                        lambda a: softmax.log_softmax(a["x"], a["out"]), ("out",), (("out", "x"),)),
    "softmax_xent": Case(dict(logits=_f(2, 5), labels=_i(2), loss=_f(1), dlogits=_f(2, 5)),
                         lambda a: loss.softmax_xent(a["logits"], a["labels"], a["loss"],
                                                     a["dlogits"]), ("loss", "dlogits")),
    "lstm_cell": Case(dict(gates=_f(2, 12), c_prev=_f(2, 3), h_out=_f(2, 3), c_out=_f(2, 3)),
                      lambda a: lstm.lstm_cell(a["gates"], a["c_prev"], a["h_out"], a["c_out"]),
                      ("h_out", "c_out"), (("c_out", "c_prev"),)),
    "sgd_step": Case(dict(param=_f(6), grad=_f(6), velocity=_f(6)),
                     lambda a: sgd.sgd_step(a["param"], a["grad"], a["velocity"], lr=0.1,
                                            momentum=0.9), ("param", "velocity")),
    "maxpool2x2": Case(dict(x=_f(1, 2, 4, 4), out=_f(1, 2, 2, 2)),
                       lambda a: pool.maxpool2x2(a["x"], a["out"]), ("out",)),
    "maxpool2x2_bwd": Case(dict(x=_f(1, 2, 4, 4), dy=_f(1, 2, 2, 2), dx=_f(1, 2, 4, 4)),
                           lambda a: pool.maxpool2x2_bwd(a["x"], a["dy"], a["dx"], relu_mask=True),
                           ("dx",), (("dx", "x"),)),
    "linear": Case(dict(x=_f(3, 4), w=_f(5, 4), b=_f(5), out=_f(3, 5)),
                   lambda a: linear.linear(a["x"], a["w"], a["b"], a["out"]), ("out",),
                   aliases=dict(x=("a",), w=("b",), b=("bias",))),
    "linear_bwd_data": Case(dict(dy=_f(3, 5), w=_f(5, 4), dx=_f(3, 4)),
                            lambda a: linear.linear_bwd_data(a["dy"], a["w"], a["dx"]), ("dx",),
                            aliases=dict(dy=("a",), w=("b",), dx=("out",))),
    "linear_bwd_weight": Case(dict(x=_f(3, 4), dy=_f(3, 5), dw=_f(5, 4), db=_f(5)),
                              lambda a: linear.linear_bwd_weight(a["x"], a["dy"], a["dw"], a["db"]),
                              ("dw", "db")),
    "conv2d": Case(dict(x=_f(1, 2, 4, 4), w=_f(3, 2, 3, 3), bias=_f(3), out=_f(1, 3, 4, 4)),
                   lambda a: conv.conv2d(a["x"], a["w"], a["bias"], a["out"], pad=1), ("out",),
                   aliases=dict(x=("src",), out=("dst",))),
    "conv2d_bwd_data": Case(dict(dy=_f(1, 3, 4, 4), w=_f(3, 2, 3, 3), dx=_f(1, 2, 4, 4)),
                            lambda a: conv.conv2d_bwd_data(a["dy"], a["w"], a["dx"], pad=1),
                            ("dx",), aliases=dict(dy=("src",), dx=("dst",))),
    "conv2d_bwd_weight": Case(_WGRAD, lambda a: conv.conv2d_bwd_weight(
        a["x"], a["dy"], a["dw"], a["db"], pad=1, splits=1), ("dw", "db")),
    "conv2d_bwd_weight_split": Case(
        {**_WGRAD, "workspace": _f(conv.wgrad_workspace_size((2, 2, 8, 8), (3, 2, 3, 3), pad=1,
                                                             splits=2))},   # 2 splits of 64
        lambda a: conv.conv2d_bwd_weight(a["x"], a["dy"], a["dw"], a["db"], pad=1, splits=2,
                                         workspace=a["workspace"]), ("dw", "db", "workspace")),
    "topk": Case(dict(x=_f(2, 10), values=_f(2, 3), indices=_i(2, 3)),
                 lambda a: sampling.topk(a["x"], 3, a["values"], a["indices"]),
                 ("values", "indices")),
    "argmax": Case(dict(x=_f(2, 10), out=_i(2)), lambda a: sampling.argmax(a["x"], a["out"]),
                   ("out",)),
    "greedy_advance": Case(dict(tokens=_i(2, 1), pos=_i(1), out=_i(2, 4), done=_i(2), state=_i(3),
                                flag=_i(1)),
                           lambda a: sampling.greedy_advance(*(a[n] for n in (
                               "tokens", "pos", "out", "done", "state", "flag"))),
                           ("pos", "out", "done", "state", "flag")),
    "beam_advance": Case(_BEAM, lambda a: sampling.beam_advance(
        a["values"], a["indices"], 5, *(a[n] for n in list(_BEAM)[2:-1]), floor=-1e30,
        bad=a["bad"]),
        tuple(n for n in _BEAM if n not in ("values", "indices", "hist_src"))),
    "gemm": Case(dict(a=_f(3, 4), b=_f(4, 5), out=_f(3, 5), bias=_f(5)),
                 lambda a: gemm.gemm(a["a"], a["b"], a["out"], bias=a["bias"]), ("out",)),
    "attention": Case(dict(qkv=_f(1, 2, 12), k_cache=_f(1, 2, 4, 2), v_cache=_f(1, 2, 4, 2),
                           pos=_i(1), out=_f(1, 2, 4)),
                      lambda a: attention.attention(a["qkv"], a["k_cache"], a["v_cache"], a["pos"],
                                                    a["out"], n_head=2),
                      ("k_cache", "v_cache", "out")),
    "gather_batch": Case(dict(src=_f(2, 3), index=_i(2), dst=_f(2, 3)),
                         lambda a: attention.gather_batch(a["src"], a["index"], a["dst"]), ("dst",)),
    "layernorm": Case(dict(x=_f(2, 5), gamma=_f(5), beta=_f(5), out=_f(2, 5)),
                      lambda a: layernorm.layernorm(a["x"], a["gamma"], a["beta"], a["out"]),
                      ("out",), (("out", "x"),)),
}

def _pairs():
    for name, case in CASES.items():
        for out in case.outputs:
            for other in case.arrays:
                if other != out:
                    yield pytest.param(name, out, other, id=f"{name}-{out}-{other}")


class _Recorder:
    """Stands in for the device: counts launches, runs nothing."""

    def __init__(self):
        self.launches = 0

    def record_launch(self, *args, **kwargs):
        self.launches += 1

    def record_alloc(self, shape, dtype, name, owner):
        return cuda.device_array(shape, dtype)


def _views(case: Case, out: str, other: str, offset: int) -> dict:
    """Every array in its own slot of one buffer, far apart, except `out`: `offset` bytes
    from the start of `other`."""
    nbytes = {n: int(np.prod(s)) * np.dtype(d).itemsize for n, (s, d) in case.arrays.items()}
    gap = 2 * max(nbytes.values()) + 64
    starts, at = {}, gap
    for n in case.arrays:
        if n != out:
            starts[n] = at
            at += nbytes[n] + gap
    starts[out] = starts[other] + offset
    buf = cuda.to_device(np.zeros(at, np.uint8))
    return {n: buf[starts[n]:starts[n] + nbytes[n]].view(d).reshape(s)
            for n, (s, d) in case.arrays.items()}


def _named(name: str, message: str, case: Case) -> bool:
    return any(re.search(rf"\b{n}\b", message) for n in (name, *case.aliases.get(name, ())))


@pytest.mark.parametrize("name, out, other", list(_pairs()))
@given(data=st.data())
def test_an_output_overlapping_another_argument_is_refused_before_any_launch(
        name, out, other, data, monkeypatch):
    case = CASES[name]
    size = {n: int(np.prod(s)) * np.dtype(d).itemsize for n, (s, d) in case.arrays.items()}
    offset = data.draw(st.integers(-(size[out] - 1), size[other] - 1), label="byte offset")
    arrays = _views(case, out, other, offset)
    rec = _Recorder()
    monkeypatch.setattr(backend, "_recorder", rec)
    if offset == 0 and (out, other) in case.in_place:   # the documented exact alias
        case.call(arrays)
        assert rec.launches > 0
        return
    with pytest.raises(ValueError, match="overlaps") as err:
        case.call(arrays)
    message = str(err.value)
    assert _named(out, message, case) and _named(other, message, case), message
    assert rec.launches == 0, "refused only after launching"


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data())
def test_remembered_extents_are_the_ranges_computed_afresh(shape, data):
    """`extent` remembers each array's byte range (the overlap check asks for the same arrays
    at every launch); every view (slices with steps, reversed) must get the range computed
    afresh, the first time and from memory."""
    base = cuda.to_device(np.zeros(shape, np.float32))
    views = [base]
    for _ in range(3):
        index = tuple(slice(*data.draw(st.tuples(st.integers(0, n - 1), st.integers(1, n),
                                                 st.sampled_from([1, 2, -1]))))
                      for n in shape)
        views.append(base[index])
    want = [backend._extent(v) for v in views]
    assert [backend.extent(v) for v in views] == want
    assert [backend.extent(v) for v in views] == want        # the remembered answers


def test_a_remembered_extent_belongs_to_its_own_array_only():
    """Once an array is gone its id may name another: a remembered range is used only for
    the very object it was computed for."""
    import weakref
    a = cuda.to_device(np.zeros(8, np.float32))
    b = cuda.to_device(np.zeros(3, np.float32))
    backend._extents._values[(id(a), None)] = (weakref.ref(b), (0, 1))   # as if b had had a's id
    assert backend.extent(a) == backend._extent(a) != (0, 1)


def test_a_remembered_view_leaves_with_its_array():
    """`reshaped` gives the same view for the same array and shape, and forgets it when the
    array goes: a remembered view must not keep device memory alive."""
    import gc
    a = cuda.to_device(np.zeros((2, 6), np.float32))
    view = backend.reshaped(a, (1, 2, 6))
    assert view.shape == (1, 2, 6) and backend.reshaped(a, (1, 2, 6)) is view
    assert backend.reshaped(a, (3, 4)) is not view
    key = (id(a), (1, 2, 6))
    assert key in backend._views._values
    del a, view
    gc.collect()
    assert key not in backend._views._values


def test_leading_rows_are_one_view_per_array_and_count():
    """`leading(a, n)` is a[:n], the same object for the same array and n, a distinct view
    for another n or another array, and its writes reach the array's rows."""
    a = cuda.to_device(np.arange(12, dtype=np.float32).reshape(6, 2))
    rows = backend.leading(a, 4)
    assert rows.shape == (4, 2) and backend.leading(a, 4) is rows
    assert backend.leading(a, 3) is not rows and backend.leading(a, 3).shape == (3, 2)
    np.testing.assert_array_equal(rows.copy_to_host(), np.arange(8).reshape(4, 2))
    rows.copy_to_device(np.full((4, 2), -1, np.float32))
    np.testing.assert_array_equal(a.copy_to_host()[:4], -1)
    np.testing.assert_array_equal(a.copy_to_host()[4:], [[8, 9], [10, 11]])
    b = cuda.to_device(np.zeros((6, 2), np.float32))
    assert backend.leading(b, 4) is not rows
    assert backend.reshaped(a, (12,)) is not backend.leading(a, 4)
