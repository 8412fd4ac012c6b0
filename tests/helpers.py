"""Shared test helpers: tolerances, host<->device shortcuts, and running a memory plan."""
from __future__ import annotations

import os

import numpy as np

from proto.device import backend
from proto.device.backend import cuda

# Shape scale: simulated threads cost ~0.1 ms each, so shapes stay tiny there; on a GPU the
# same tests run at model-like sizes, except under compute-sanitizer (tests/sanitize.py sets
# PROTO_TEST_SCALE=1: the tools check every access, so size buys only time). FULL_SIZE: a
# test may then take a model's real shapes (Wav2Vec2-base's, say) instead of scaling small ones.
SCALE = int(os.environ.get("PROTO_TEST_SCALE", 1 if backend.SIMULATOR else 16))
FULL_SIZE = SCALE > 1

# float32 kernels against float64-accumulated NumPy references. Sums of K products carry
# rounding ~ sqrt(K) * eps32 * |terms|; atol 1e-5 + rtol 1e-4 covers K up to a few thousand
# with unit-scale data (checked at the GPU test lane's sizes). Reductions over exp() get more.
TOL = {"elementwise": (1e-6, 1e-5), "reduction": (1e-5, 1e-4), "gemm": (1e-4, 1e-4),
       "softmax": (1e-6, 1e-4), "grad": (1e-4, 1e-3)}


def assert_close(actual, expected, kind: str = "reduction"):
    atol, rtol = TOL[kind]
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else np.asarray(actual)
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol)


def dev(x: np.ndarray):
    # A fresh C-order copy: NumPy calls x[None] C-contiguous with stride 0 on the new axis
    # (NumPy 2.5 keeps it through ascontiguousarray), which Numba's contiguity check refuses.
    return cuda.to_device(np.array(x, order="C"))


def rand(rng: np.random.Generator, *shape, scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def central_differences(loss, args: list, which: int, h: float) -> np.ndarray:
    """d loss(*args) / d args[which], element by element, by central differences of step h
    (float64 arrays; the others held fixed)."""
    grad = np.zeros_like(args[which])
    for i in np.ndindex(grad.shape):
        hi, lo = [a.copy() for a in args], [a.copy() for a in args]
        hi[which][i] += h
        lo[which][i] -= h
        grad[i] = (loss(*hi) - loss(*lo)) / (2 * h)
    return grad


def split_span(k: int, s: int, step: int) -> int:
    """The rows a split takes when a decode GEMM's partials cut K into s splits: ceil(K / s)
    rounded up to whole batches of `step` rows."""
    return -(-(-(-k // s)) // step) * step


def split_counts(k: int, step: int, span_max: int) -> list[int]:
    """Every count S of K splits that a decode GEMM's partials cover K with exactly: the
    split_span at most `span_max`, and ceil(K / span) == S."""
    out = []
    for s in range(1, k + 1):
        span = split_span(k, s, step)
        if span <= span_max and -(-k // span) == s:
            out.append(s)
    return out


# ------------------------------------------------------------------------- memory plans
def relu_output(rng, shape):
    """A ReLU's output: about half its elements exactly 0, and one NaN (a NaN y passes no
    gradient: it is not > 0)."""
    y = np.maximum(rand(rng, *shape), 0).astype(np.float32)
    y.flat[rng.integers(y.size)] = np.nan
    return y


def run_plan(executor, init, steps=2, capture=False):
    """Load, run `steps` steps of a plan executor, return the loss and every persistent
    tensor. capture: make the step one graph first (which runs it once, eagerly, so the
    state is loaded after)."""
    with executor as ex:
        if capture:
            ex.load(init)   # the capture's warm-up then sees real values, not arena garbage
            ex.capture()
        ex.load(init)
        for _ in range(steps):
            ex.step()
        names = ["loss"] + sorted(n for n, t in ex.tape.tensors.items()
                                  if t.kind in ("param", "grad", "state"))
        return {n: ex.read(n) for n in names}


def assert_identical(got, want, label):
    """Bit for bit, and the reference finite (identical NaNs would prove nothing)."""
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{label}: {name} differs"
        assert np.isfinite(want[name]).all()


def spy_on_plan_visits(monkeypatch) -> dict:
    """Every plan visitor's actions, by visitor class name, as `walk` hands them over: how
    the tests show that the checker, the cost model and an executor read the same plan."""
    from proto.vm.walk import Visitor
    seen: dict[str, list] = {}
    visit = Visitor.visit

    def spy(self, act, at):
        seen.setdefault(type(self).__name__, []).append((at.slot, at.op, act))
        visit(self, act, at)

    monkeypatch.setattr(Visitor, "visit", spy)
    return seen


def per_signature(value):
    """A compiled kernel's figure (registers, local or shared memory): Numba returns a dict
    per signature unless the kernel is specialized; the largest of them."""
    return max(value.values()) if isinstance(value, dict) else value


def launches_of(monkeypatch, module) -> list:
    """The kernels `module`'s launcher (its `launch`) launches from now on, in order: which
    variant a call ran."""
    seen = []
    real = module.launch

    def spy(kernel, *args, **kw):
        seen.append(kernel)
        return real(kernel, *args, **kw)
    monkeypatch.setattr(module, "launch", spy)
    return seen
