"""A decoder's KV cache: every layer's keys and values in one device array, batch first, and
the pair of caches beam search reorders between."""
from __future__ import annotations

import copy

import numpy as np

from kernels import _check, attention
from proto.device.backend import cuda
from proto.models import zeros


class KVCache:
    """Keys and values of every layer: `k[i]`, `v[i]` device arrays (B, H, max_len, hd) of
    `dtype` (float32, or float16 for a half-precision model), views of one array `data`
    (2, L, B, H, max_len, hd). `config`: any decoder's (n_layer, n_head, head_dim,
    n_positions).

    Batch first, so `reorder_into` moves whole beams with kernels.attention.gather_batch, and
    one allocation, so it moves every layer's K and V in one launch (2L launches cost a
    beam-search step 2L graph nodes).
    Beam search keeps two caches and gathers from one into the other, never in place.
    """

    rows = None   # a pair's table of rows (see `pair`; views of a cache have none)

    def __init__(self, config, batch: int, max_len: int, dtype=np.float32):
        _check.positive("batch", batch)
        _check.positive("max_len", max_len, at_most=config.n_positions)
        self.config, self.batch, self.max_len = config, batch, max_len
        self.dtype = np.dtype(dtype)
        if self.dtype not in _check.FLOATS:
            raise TypeError(f"dtype: expected float32 or float16, got {self.dtype}")
        L = config.n_layer
        self.data = zeros((2, L, batch, config.n_head, max_len, config.head_dim), self.dtype)
        self.k = [self.data[0, i] for i in range(L)]
        self.v = [self.data[1, i] for i in range(L)]
        self._capacity = cuda.to_device(np.array([max_len], np.int32))  # reorder's default length

    @classmethod
    def pair(cls, config, batch: int, max_len: int,
             dtype=np.float32) -> tuple["KVCache", "KVCache"]:
        """Two caches of one `data` for beam search, each with a table `rows` (batch,
        max_len): sequence b's position p is in row rows[b, p] (attention's `rows`). A
        reorder then rewrites the other cache's table (a few KB) instead of moving the live
        K and V (hundreds of MB a token at GPT-2 small's size), and the pair needs one cache's
        memory, not two. Call `reset_rows` before a generation's prefill."""
        a = cls(config, batch, max_len, dtype)
        b = copy.copy(a)   # the same data, k and v views
        a.rows, b.rows = zeros((batch, max_len), np.int32), zeros((batch, max_len), np.int32)
        a.reset_rows()
        b.reset_rows()
        return a, b

    def reset_rows(self) -> None:
        """Every sequence in its own row again (a generation's start: the prefill writes each
        beam's prompt into its row)."""
        identity = np.repeat(np.arange(self.batch, dtype=np.int32)[:, None], self.max_len, 1)
        self.rows.copy_to_device(identity)

    def arrays(self) -> list:
        """Every batch-first device array of the cache (what a reorder must move)."""
        return self.k + self.v

    def reorder_into(self, index, dst: "KVCache", stream=0, length=None) -> None:
        """dst[b] = self[index[b]] for every array; `index` device int32 (B,). With `length`
        (device int32 (1,), read on the device) only the live positions [:length[0]] move:
        a beam search's reorder then costs the live prefix, not the capacity."""
        if (dst.config, dst.batch, dst.max_len, dst.dtype) != (self.config, self.batch,
                                                              self.max_len, self.dtype):
            raise ValueError("dst: expected a KVCache of the same config, batch, max_len and dtype")
        if dst is self:
            raise ValueError("dst: must be another KVCache (gather_batch cannot work in place)")
        if length is None:   # the whole capacity moves
            length = self._capacity
        if self.rows is not None:   # a pair: the table moves, the data stays
            if dst.rows is None or dst.data is not self.data:
                raise ValueError("dst: expected the other cache of this KVCache.pair")
            attention.reorder_rows(self.rows, index, dst.rows, length=length, stream=stream)
            return
        attention.gather_batch(self.data, index, dst.data, length=length, stream=stream)


def check_step(tokens, pos, cache, *, config, max_batch: int, max_tokens: int,
               dtype=np.float32) -> tuple[int, int]:
    """A decoder step's arguments, checked before any launch: tokens device int32 (B, T) with
    B <= max_batch and T <= max_tokens, pos device int32 (1,), cache a KVCache of `config`,
    batch B and `dtype` holding T positions at least. Returns (B, T)."""
    _check.device_array("tokens", tokens, dtype=np.int32, ndim=2)
    _check.device_array("pos", pos, dtype=np.int32, shape=(1,))
    B, T = tokens.shape
    _check.positive("tokens.shape[0] (batch)", B, at_most=max_batch)
    _check.positive("tokens.shape[1] (new tokens)", T, at_most=max_tokens)
    if (not isinstance(cache, KVCache) or cache.config != config or cache.batch != B
            or cache.dtype != np.dtype(dtype)):
        raise ValueError(f"cache: expected a KVCache of this model's config, batch {B} "
                         f"and dtype {np.dtype(dtype)}")
    if T > cache.max_len:
        raise ValueError(f"tokens: {T} new tokens exceed cache.max_len={cache.max_len}")
    return B, T
