"""Models that run on the kernels: GPT-2 and GPT-J decoders (gpt2, gptj) over a KV cache
(kv_cache), LSTM language model (lstm), their NumPy float64 references (reference), and
search over their steps (generate).

Weights come as a dict of NumPy arrays named as PyTorch/Hugging Face name them, so a torch
model's `state_dict()` loads unchanged. The helpers here check such a dict against the shapes
a config implies, for every model.
"""
from __future__ import annotations

import numpy as np

from kernels import _check, random
from proto.device.backend import cuda


def _check_keys(shapes: dict, state_dict, what: str, ignored) -> None:
    """ValueError naming a key of `shapes` that `state_dict` lacks, or one it has beyond them
    that `ignored` does not excuse."""
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise ValueError(f"{what} state_dict: missing {len(missing)} key(s), first: {missing[:4]}")
    unexpected = [k for k in state_dict if k not in shapes and not ignored(k)]
    if unexpected:
        raise ValueError(f"{what} state_dict: unexpected key(s) {unexpected[:4]} "
                         "(does the config match the checkpoint?)")


def checked_params(shapes: dict[str, tuple[int, ...]], state_dict, *, what: str,
                   ignored=lambda key: False, allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
    """float32 C-contiguous copies of `state_dict[k]` for every k in `shapes`.

    Raises ValueError naming the key when one is missing, misshaped, not numeric (a string,
    an object), holds a NaN or an infinity (also one float32 cannot hold: 1e39), or is
    unexpected (an extra key usually means the config does not match the checkpoint, e.g.
    fewer layers); `ignored(key)` marks extra keys that carry no weights (buffers such as
    causal masks). A non-finite weight would make every output NaN without a word, so it is
    refused unless `allow_nonfinite=True` (to study exactly that).
    """
    _check_keys(shapes, state_dict, what, ignored)
    params = {}
    for key, shape in shapes.items():
        value = np.asarray(state_dict[key])  # also takes CPU torch tensors
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            raise ValueError(f"{what} state_dict[{key!r}]: expected a numeric array, got "
                             f"{type(state_dict[key]).__name__} of dtype {value.dtype}")
        if value.shape != shape:
            raise ValueError(f"{what} state_dict[{key!r}]: expected shape {shape}, "
                             f"got {tuple(value.shape)}")
        with np.errstate(over="ignore"):   # too large for float32: inf, refused below
            params[key] = np.ascontiguousarray(value, dtype=np.float32)
        bad = ~np.isfinite(params[key])
        if bad.any() and not allow_nonfinite:
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{what} state_dict[{key!r}]: {int(bad.sum())} non-finite value(s) "
                             f"as float32, first at {first}: {value[first]!r}; pass "
                             "allow_nonfinite=True to load them anyway")
    return params


def model_dtype(dtype) -> np.dtype:
    """A decoder's storage dtype: float32 or float16 (TypeError otherwise)."""
    dtype = np.dtype(dtype)
    if dtype not in _check.FLOATS:
        raise TypeError(f"dtype: expected float32 or float16, got {dtype}")
    return dtype


def on_device_as(params: dict[str, np.ndarray], dtype, what: str) -> dict:
    """Checked float32 `params` on the device in `dtype`: a weight float16 cannot hold is a
    ValueError, not an infinity."""
    with np.errstate(over="raise"):
        try:
            host = {k: v.astype(dtype) for k, v in params.items()}
        except FloatingPointError:
            raise ValueError(f"{what} state_dict: a weight exceeds {np.dtype(dtype)}'s range") \
                from None
    return {k: cuda.to_device(v) for k, v in host.items()}


def zeros(shape, dtype=np.float32):
    """A zero-filled device array (caches and states must not start as garbage: a NaN read
    from an unwritten slot would survive a multiply by a zero weight)."""
    return cuda.to_device(np.zeros(shape, dtype=dtype))


def param_law(key: str, shape: tuple[int, ...], *, embeddings,
              fan_in_axis: int) -> tuple[float, float, float]:
    """(mean, factor, divisor): a random weight is mean + z * factor / divisor, z standard
    normal (std = factor / divisor), so that activations stay
    unit-scale at every size: the `embeddings` keys N(0, 1), so logits spread like
    sqrt(width) and argmax/top-k decisions are well separated (tests compare tokens with a
    float64 reference); other matrices N(0, 1/fan_in), fan_in = shape[fan_in_axis] (0 for
    GPT-2's Conv1D (in, out), 1 for torch.nn.Linear's (out, in)); layer-norm gains
    1 + N(0, 0.1^2) and every other vector (biases, offsets) N(0, 0.1^2), so a dropped bias
    or gain shows in the output."""
    if key in embeddings:
        return 0.0, 1.0, 1.0
    if len(shape) == 2:
        return 0.0, 1.0, float(np.sqrt(shape[fan_in_axis]))
    if ".ln_" in key and key.endswith("weight"):
        return 1.0, 0.1, 1.0
    return 0.0, 0.1, 1.0


def random_params(shapes: dict[str, tuple[int, ...]], seed: int, *, embeddings,
                  fan_in_axis: int) -> dict[str, np.ndarray]:
    """Random float32 weights for `shapes`, each drawn by `param_law`, on the host."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in shapes.items():
        mean, factor, divisor = param_law(key, shape, embeddings=embeddings,
                                          fan_in_axis=fan_in_axis)
        value = rng.standard_normal(shape) / divisor * factor
        out[key] = (value + mean if mean else value).astype(np.float32)
    return out


def random_device_params(shapes: dict[str, tuple[int, ...]], seed: int, dtype, *,
                         embeddings, fan_in_axis: int) -> dict:
    """The same law drawn on the device (kernels.random), in `dtype`: weights that never
    cross the host. Other values than random_params' (another generator), the same laws."""
    out = {}
    for j, (key, shape) in enumerate(shapes.items()):
        mean, factor, divisor = param_law(key, shape, embeddings=embeddings,
                                          fan_in_axis=fan_in_axis)
        out[key] = cuda.device_array(shape, dtype)
        random.normal(out[key], seed=(seed * 1_000_003 + j) % 2**64, std=factor / divisor,
                      mean=mean)
    return out


def checked_device_params(shapes: dict[str, tuple[int, ...]], state_dict, dtype, *,
                          what: str, ignored=lambda key: False) -> dict:
    """`state_dict[k]` for every k in `shapes`, device arrays of `dtype` taken as they are
    (no copy, no host round trip: their values are not read, so not checked for NaN).
    Raises ValueError naming the key when one is missing, misshaped or unexpected, and
    TypeError for another dtype or a host array among device ones."""
    _check_keys(shapes, state_dict, what, ignored)
    return {k: _check.device_array(f"{what} state_dict[{k!r}]", state_dict[k], dtype=dtype,
                                   shape=shape) for k, shape in shapes.items()}
