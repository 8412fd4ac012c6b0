"""attention against its float64 reference: random shapes and positions (several batches
and splits even on the simulator), prefill then decode, the device-side guard on pos, one
launch configuration for every pos, the wide-head kernel, determinism, gather_batch, and
validation before any launch. Outputs start as NaN, so an unwritten element fails."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import attention
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, per_signature, rand


def _case(rng, B, H, T, Tmax, hd):
    C = H * hd
    return (rand(rng, B, T, 3 * C), rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd))


def _attend(qkv, k_cache, v_cache, pos, n_head):
    """Run the kernel on copies, out poisoned with NaN; return (out, k_cache, v_cache) on
    the host."""
    dk, dv = dev(k_cache), dev(v_cache)
    out = dev(np.full((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3), np.nan, np.float32))
    attention.attention(dev(qkv), dk, dv, dev(np.array([pos], np.int32)), out, n_head=n_head)
    return out.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()


@given(data=st.data(), seed=st.integers(0, 2**16))
def test_attention_matches_reference(data, seed, scale):
    # Simulator: one-warp blocks, 2 positions a batch, so caches of a few dozen positions
    # take several batches and splits; GPU: head dims and caches up to GPT-2's.
    B = data.draw(st.integers(1, 2), "B")
    H = data.draw(st.integers(1, 3 - B), "H")
    hd = data.draw(st.integers(1, 32 if scale == 1 else 128), "hd")
    Tmax = data.draw(st.integers(1, 70 * scale), "Tmax")
    T = data.draw(st.integers(1, min(Tmax, 3 * scale)), "T")
    pos = data.draw(st.integers(0, Tmax - T), "pos")
    qkv, kc, vc = _case(np.random.default_rng(seed), B, H, T, Tmax, hd)
    out, k_after, v_after = _attend(qkv, kc, vc, pos, H)
    want, want_k, want_v = attention.attention_ref(qkv, kc, vc, pos, H)
    np.testing.assert_array_equal(k_after, want_k)  # a copy: exact, untouched elsewhere
    np.testing.assert_array_equal(v_after, want_v)
    # float32 dot products of hd terms and a softmax over <= Tmax scores, against float64:
    # the "reduction" tolerance (atol 1e-5, rtol 1e-4) holds with unit-normal data.
    assert_close(out, want, "reduction")


@settings(max_examples=4)
@given(prompt=st.integers(1, 4), steps=st.integers(1, 3), hd=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_prefill_then_decode_equals_one_prefill(prompt, steps, hd, seed, scale):
    """Prefill `prompt` tokens, then decode one token per step with pos advanced on the device:
    every step's output and the final caches equal one prefill of all the tokens."""
    B, H, Tmax = 1, 1, (prompt + steps) * scale  # (batch and head offsets: the test above)
    total = prompt + steps
    qkv, kc, vc = _case(np.random.default_rng(seed), B, H, total, Tmax, hd)
    full, full_k, full_v = _attend(qkv, kc, vc, 0, H)
    dk, dv, pos = dev(kc), dev(vc), dev(np.zeros(1, np.int32))
    out = cuda.device_array((B, prompt, H * hd), np.float32)
    attention.attention(dev(qkv[:, :prompt]), dk, dv, pos, out, n_head=H)
    outs = [out.copy_to_host()]
    step_out = cuda.device_array((B, 1, H * hd), np.float32)
    for t in range(prompt, total):
        pos.copy_to_device(np.array([t], np.int32))  # what the graph's pos kernel would do
        attention.attention(dev(qkv[:, t:t + 1]), dk, dv, pos, step_out, n_head=H)
        outs.append(step_out.copy_to_host())
    assert_close(np.concatenate(outs, axis=1), full, "reduction")
    np.testing.assert_array_equal(dk.copy_to_host(), full_k)
    np.testing.assert_array_equal(dv.copy_to_host(), full_v)


@pytest.mark.parametrize("Tmax", [20, 70])  # one split, several splits (32-position tiles)
@pytest.mark.parametrize("bad_pos", ["negative", "overflow"])
def test_pos_outside_the_cache_writes_nan_and_leaves_the_cache(Tmax, bad_pos):
    """pos lives on the device, so the host cannot reject it: the kernels guard it."""
    B, H, T, hd = 1, 1, 3, 5
    pos = -1 if bad_pos == "negative" else Tmax - T + 1
    qkv, kc, vc = _case(np.random.default_rng(0), B, H, T, Tmax, hd)
    out, k_after, v_after = _attend(qkv, kc, vc, pos, H)
    assert np.isnan(out).all()
    np.testing.assert_array_equal(k_after, kc)
    np.testing.assert_array_equal(v_after, vc)


class _Recorder:
    """Stands in for the device (backend's recorder hook): records launches, runs nothing."""

    def __init__(self):
        self.launches = []

    def record_launch(self, kernel, griddim, blockdim, args, sharedmem, stream=0):
        self.launches.append((kernel, griddim, blockdim))

    def record_alloc(self, shape, dtype, name, owner):
        return cuda.device_array(shape, dtype)


def test_launch_configuration_does_not_depend_on_pos(monkeypatch):
    """One graph serves every length: the launches recorded at any pos are the same."""
    B, H, T, Tmax, hd = 2, 2, 1, 300, 8  # several splits
    qkv, kc, vc = (dev(a) for a in _case(np.random.default_rng(0), B, H, T, Tmax, hd))
    out = cuda.device_array((B, T, H * hd), np.float32)
    recorded = []
    for p in (0, 33, Tmax - 1):  # recorded, not run: no simulator cost
        rec = _Recorder()
        monkeypatch.setattr(backend, "_recorder", rec)
        attention.attention(qkv, kc, vc, dev(np.array([p], np.int32)), out, n_head=H)
        recorded.append(rec.launches)
    monkeypatch.setattr(backend, "_recorder", None)
    assert len(recorded[0]) == 2  # split attention (writing the cache too), combine
    assert recorded[0] == recorded[1] == recorded[2]


@pytest.mark.parametrize("T,pos", [(1, 17), (2, 0)])
def test_head_dims_past_64_take_the_wide_kernel(T, pos):
    """Head dims above SMALL's 64 lanes-worth run LARGE (8 dims a lane)."""
    B, H, Tmax, hd = 1, 1, 20, 70
    qkv, kc, vc = _case(np.random.default_rng(hd + pos), B, H, T, Tmax, hd)
    assert attention._plan(B, H, T, Tmax, hd)[0] is attention.LARGE
    out, k_after, v_after = _attend(qkv, kc, vc, pos, H)
    want, want_k, want_v = attention.attention_ref(qkv, kc, vc, pos, H)
    np.testing.assert_array_equal(k_after, want_k)
    np.testing.assert_array_equal(v_after, want_v)
    assert_close(out, want, "reduction")


def test_split_attention_is_deterministic():
    """Splits are merged in split order, warps in warp order: bit-identical runs."""
    B, H, T, Tmax, hd = 1, 2, 1, 40, 8
    qkv, kc, vc = _case(np.random.default_rng(9), B, H, T, Tmax, hd)
    assert attention._plan(B, H, T, Tmax, hd)[1] > 1
    first, second = (_attend(qkv, kc, vc, 37, H)[0] for _ in range(2))
    np.testing.assert_array_equal(first, second)


@pytest.mark.gpu
@pytest.mark.parametrize("pos", [0, 1, 500, 1023])
def test_gpt2_beam_decode_shape(pos):
    """GPT-2 small beam search: B=5 beams, H=12, hd=64, a 1024-position cache, one token."""
    B, H, T, Tmax, hd = 5, 12, 1, 1024, 64
    qkv, kc, vc = _case(np.random.default_rng(pos), B, H, T, Tmax, hd)
    out, k_after, _ = _attend(qkv, kc, vc, pos, H)
    want, want_k, _ = attention.attention_ref(qkv, kc, vc, pos, H)
    np.testing.assert_array_equal(k_after, want_k)
    assert_close(out, want, "reduction")


@pytest.mark.gpu
@pytest.mark.parametrize("rows, blocks", [(False, 4), (True, 3)], ids=["plain", "row_table"])
def test_gpt2_attention_kernels_fit_their_blocks_an_sm_without_spilling(rows, blocks):
    """GPT-2's head dim (64): the plain kernel (64 registers) fits 4 blocks of 256 threads an
    SM, the row-table kernel (bounded to 3, which it was timed at) 3, and neither holds
    local memory (a spill inside the position loop would cost more than a block an SM
    gains). Registers are allocated 256 a warp at a time, 64K an SM."""
    variant = attention.kernel_for(64, rows)

    regs = per_signature(variant.kernel.get_regs_per_thread())
    per_warp = -(-regs * 32 // 256) * 256
    assert 65536 // (per_warp * variant.threads // 32) >= blocks
    assert per_signature(variant.kernel.get_local_mem_per_thread()) == 0


@given(B=st.integers(1, 5), tail=st.lists(st.integers(1, 7), min_size=0, max_size=3),
       seed=st.integers(0, 2**16))
def test_gather_batch_matches_numpy(B, tail, seed, scale):
    rng = np.random.default_rng(seed)
    src = rand(rng, B, *tail[:-1], tail[-1] * scale) if tail else rand(rng, B)
    index = rng.integers(0, B, B).astype(np.int32)  # repeats: a beam may be chosen twice
    dst = cuda.device_array(src.shape, np.float32)
    attention.gather_batch(dev(src), dev(index), dst)
    np.testing.assert_array_equal(dst.copy_to_host(), attention.gather_batch_ref(src, index))


def test_gather_batch_out_of_range_index_gives_nan_rows():
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    dst = cuda.device_array((3, 4), np.float32)
    attention.gather_batch(dev(src), dev(np.array([2, 3, -1], np.int32)), dst)
    got = dst.copy_to_host()
    np.testing.assert_array_equal(got[0], src[2])
    assert np.isnan(got[1:]).all()


def _prefix_reference(src, index, n, dst):
    """dst with positions [:n] (axis 2) of each row b replaced by src[index[b]]'s; an index
    or n out of range poisons the whole row with NaN."""
    out = dst.copy()
    for b, i in enumerate(index):
        if 0 <= i < src.shape[0] and 0 <= n <= src.shape[2]:
            out[b, :, :n] = src[i, :, :n]
        else:
            out[b] = np.nan
    return out


@given(B=st.integers(1, 5), H=st.integers(1, 3), T=st.integers(1, 9), hd=st.integers(1, 5),
       n=st.integers(-2, 11), bad_index=st.booleans(), seed=st.integers(0, 2**16))
def test_gather_batch_live_prefix_moves_only_the_prefix(B, H, T, hd, n, bad_index, seed):
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((B, H, T, hd)).astype(np.float32)
    before = rng.standard_normal((B, H, T, hd)).astype(np.float32)   # stale tails stay
    index = rng.integers(0, B, B).astype(np.int32)
    if bad_index:
        index[rng.integers(0, B)] = rng.choice([-1, B])
    dst = dev(before)
    attention.gather_batch(dev(src), dev(index), dst, length=dev(np.array([n], np.int32)))
    np.testing.assert_array_equal(dst.copy_to_host(), _prefix_reference(src, index, n, before))


@given(lead=st.sampled_from([(1,), (2,), (2, 3)]), B=st.integers(1, 4), n=st.integers(-1, 5),
       bad_index=st.booleans(), seed=st.integers(0, 2**16))
def test_gather_batch_moves_stacked_caches_alike(lead, B, n, bad_index, seed):
    """Caches stacked on leading axes (a model's K and V of every layer in one array) move in
    one launch: each stacked cache exactly as if gathered alone."""
    H, T, hd = 2, 4, 3
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((*lead, B, H, T, hd)).astype(np.float32)
    before = rng.standard_normal(src.shape).astype(np.float32)
    index = rng.integers(0, B, B).astype(np.int32)
    if bad_index:
        index[rng.integers(0, B)] = rng.choice([-1, B])
    dst = dev(before)
    attention.gather_batch(dev(src), dev(index), dst, length=dev(np.array([n], np.int32)))
    got = dst.copy_to_host().reshape(-1, B, H, T, hd)
    for g, (s, b) in enumerate(zip(src.reshape(-1, B, H, T, hd), before.reshape(-1, B, H, T, hd))):
        np.testing.assert_array_equal(got[g], _prefix_reference(s, index, n, b))


@given(B=st.integers(1, 4), T=st.integers(1, 2), pos=st.integers(0, 20), bad=st.booleans(),
       hd=st.sampled_from([8, 21]), seed=st.integers(0, 2**16))
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_rows_read_each_position_from_its_row(B, T, pos, bad, hd, seed):
    """With a table of rows (beam search's KVCache.pair), position p < pos of sequence b is
    read from cache row rows[b, p]: the result is the float64 reference over a cache whose
    row b holds those positions (the row-table kernel is another kernel than the plain
    one, so not bit for bit); this step's k, v still go to row b. A row outside the cache
    gives NaN for that sequence only."""
    H, Tmax = 2, 24   # several splits on the simulator
    rng = np.random.default_rng(seed)
    qkv, kc, vc = _case(rng, B, H, T, Tmax, hd)
    pos = min(pos, Tmax - T)
    rows = rng.integers(0, B, (B, Tmax)).astype(np.int32)
    broken = int(rng.integers(0, B))
    if bad and pos > 0:
        rows[broken, int(rng.integers(0, pos))] = B   # a row that does not exist
    gathered_k, gathered_v = kc.copy(), vc.copy()
    for b in range(B):
        for p in range(pos):
            gathered_k[b, :, p] = kc[min(rows[b, p], B - 1), :, p]
            gathered_v[b, :, p] = vc[min(rows[b, p], B - 1), :, p]
    want, want_k, want_v = attention.attention_ref(qkv, gathered_k, gathered_v, pos, H)
    dk, dv = dev(kc), dev(vc)
    out = dev(np.full(want.shape, np.nan, np.float32))
    attention.attention(dev(qkv), dk, dv, dev(np.array([pos], np.int32)), out, n_head=H,
                        rows=dev(rows))
    got = out.copy_to_host()
    if bad and pos > 0:
        assert np.isnan(got[broken]).all()
        keep = [b for b in range(B) if b != broken]
        got, want = got[keep], want[keep]
    assert_close(got, want, "reduction")
    # this step's k, v in row b at pos..pos+T-1; every other cache entry untouched
    new = slice(pos, pos + T)
    np.testing.assert_array_equal(dk.copy_to_host()[:, :, new], want_k[:, :, new])
    np.testing.assert_array_equal(dv.copy_to_host()[:, :, new], want_v[:, :, new])
    rest = np.ones(Tmax, bool)
    rest[new] = False
    np.testing.assert_array_equal(dk.copy_to_host()[:, :, rest], kc[:, :, rest])
    np.testing.assert_array_equal(dv.copy_to_host()[:, :, rest], vc[:, :, rest])


@given(B=st.integers(1, 5), T=st.integers(1, 9), n=st.integers(-1, 10), bad_index=st.booleans(),
       seed=st.integers(0, 2**16))
def test_reorder_rows_matches_numpy(B, T, n, bad_index, seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, B, (B, T)).astype(np.int32)
    before = rng.integers(-5, 5, (B, T)).astype(np.int32)
    index = rng.integers(0, B, B).astype(np.int32)
    if bad_index:
        index[rng.integers(0, B)] = rng.choice([-1, B])
    dst = dev(before)
    attention.reorder_rows(dev(src), dev(index), dst, length=dev(np.array([n], np.int32)))
    np.testing.assert_array_equal(dst.copy_to_host(),
                                  attention.reorder_rows_ref(src, index, n, before))


def test_rejects_bad_input_before_launch():
    B, H, T, Tmax, hd = 1, 2, 2, 6, 4
    qkv, kc, vc = (dev(a) for a in _case(np.random.default_rng(0), B, H, T, Tmax, hd))
    pos = dev(np.zeros(1, np.int32))
    out = cuda.device_array((B, T, H * hd), np.float32)
    with pytest.raises(TypeError, match="qkv: expected a device array"):
        attention.attention(np.zeros((B, T, 3 * H * hd), np.float32), kc, vc, pos, out, n_head=H)
    with pytest.raises(TypeError, match="k_cache: expected dtype float32"):
        attention.attention(qkv, dev(np.zeros((B, H, Tmax, hd))), vc, pos, out, n_head=H)
    with pytest.raises(TypeError, match="pos: expected dtype int32"):
        attention.attention(qkv, kc, vc, dev(np.zeros(1, np.int64)), out, n_head=H)
    with pytest.raises(ValueError, match="multiple of n_head=3"):
        attention.attention(qkv, kc, vc, pos, out, n_head=3)
    with pytest.raises(ValueError, match=r"v_cache: expected shape \(1, 2, 6, 4\)"):
        attention.attention(qkv, kc, dev(np.zeros((B, H, Tmax + 1, hd), np.float32)), pos,
                            out, n_head=H)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 8\)"):
        attention.attention(qkv, kc, vc, pos, cuda.device_array((B, T, 9), np.float32), n_head=H)
    with pytest.raises(ValueError, match="T=8 new positions exceed the cache size Tmax=6"):
        attention.attention(dev(np.zeros((B, 8, 3 * H * hd), np.float32)), kc, vc, pos,
                            cuda.device_array((B, 8, H * hd), np.float32), n_head=H)
    with pytest.raises(ValueError, match="head dim C/n_head = 300"):
        attention.attention(dev(np.zeros((1, 1, 900), np.float32)), kc, vc, pos, out, n_head=1)
    both = dev(np.zeros((2, B, H, Tmax, hd), np.float32))
    with pytest.raises(ValueError, match="output 'k_cache'.* overlaps argument 'v_cache'"):
        attention.attention(qkv, both[0], both[0], pos, out, n_head=H)
    src = dev(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="output 'dst'.* overlaps argument 'src'"):
        attention.gather_batch(src, dev(np.zeros(3, np.int32)), src)
    dst = cuda.device_array((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"index: expected shape \(3,\)"):
        attention.gather_batch(src, dev(np.zeros(2, np.int32)), dst)
    with pytest.raises(ValueError, match=r"dst: expected shape \(3, 4\)"):
        attention.gather_batch(src, dev(np.zeros(3, np.int32)), dst.reshape(2, 6))
    with pytest.raises(ValueError, match="src: a live-prefix gather needs"):
        attention.gather_batch(src, dev(np.zeros(3, np.int32)), dst, length=pos)
    cache = dev(np.zeros((3, 1, 2, 2), np.float32))
    with pytest.raises(TypeError, match="length: expected dtype int32"):
        attention.gather_batch(cache, dev(np.zeros(3, np.int32)), cuda.device_array_like(cache),
                               length=dev(np.zeros(1, np.float32)))
