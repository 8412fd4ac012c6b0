"""Models that run on the kernels: GPT-2-style decoder (gpt2), LSTM language model (lstm),
their NumPy float64 references (reference), and search over their steps (generate).

Weights come as a dict of NumPy arrays named as PyTorch/Hugging Face name them, so a torch
model's `state_dict()` loads unchanged. The helpers here check such a dict against the shapes
a config implies, for every model.
"""
from __future__ import annotations

import numpy as np

from proto.backend import cuda


def checked_params(shapes: dict[str, tuple[int, ...]], state_dict, *, what: str,
                   ignored=lambda key: False) -> dict[str, np.ndarray]:
    """float32 C-contiguous copies of `state_dict[k]` for every k in `shapes`.

    Raises ValueError naming the key when one is missing, misshaped, or unexpected (an extra
    key usually means the config does not match the checkpoint, e.g. fewer layers);
    `ignored(key)` marks extra keys that carry no weights (buffers such as causal masks).
    """
    missing = [k for k in shapes if k not in state_dict]
    if missing:
        raise ValueError(f"{what} state_dict: missing {len(missing)} key(s), first: {missing[:4]}")
    unexpected = [k for k in state_dict if k not in shapes and not ignored(k)]
    if unexpected:
        raise ValueError(f"{what} state_dict: unexpected key(s) {unexpected[:4]} "
                         "(does the config match the checkpoint?)")
    params = {}
    for key, shape in shapes.items():
        value = np.asarray(state_dict[key])  # also takes CPU torch tensors
        if value.shape != shape:
            raise ValueError(f"{what} state_dict[{key!r}]: expected shape {shape}, "
                             f"got {tuple(value.shape)}")
        params[key] = np.ascontiguousarray(value, dtype=np.float32)
    return params


def zeros(shape, dtype=np.float32):
    """A zero-filled device array (caches and states must not start as garbage: a NaN read
    from an unwritten slot would survive a multiply by a zero weight)."""
    return cuda.to_device(np.zeros(shape, dtype=dtype))
