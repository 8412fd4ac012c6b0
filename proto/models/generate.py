"""Greedy and beam-search generation around a model step (the eager path).

`model` is anything with `.config` (a GPT2Config or GPTJConfig: vocab, positions and the
KV-cache shape), optionally `.dtype` (its logits' and KV cache's: float32 unless it says
float16) and, unless a `step` is passed, `.step`. The search only calls
`step(tokens, pos, cache) -> logits (B, T, V)` (GPT2.step by default),
always with the same `tokens` (B, 1) and `pos` (1,) device buffers (`DecodeInputs`), so a
graphed step with the same signature replaces the eager one without touching the search.

Rules (proto.models.reference implements the same ones independently):
- Prefill runs prompt[:-1]; every search step then feeds one token per sequence (T = 1), so
  each step's logits are contiguous (B, V) rows and one step shape serves the whole search.
- Greedy: next token = argmax (ties: lowest id). A row that emitted `eos` is done and padded
  with `eos`; generation stops when every row is done or after `max_new_tokens`.
- Non-finite scores are an error, not a token: a greedy row whose largest logit is not finite
  (all NaN, say) or a beam step whose top k candidates are not all finite raises
  FloatingPointError (top-k ranks NaN as -inf, so the search would otherwise go on, or stop
  on an `eos` chosen from garbage, without a word).
- Beam search (one prompt, `beam` hypotheses, scores = summed log-probabilities):
  candidates are the top k = min(2*beam, 8) of score[b] + log_softmax(logits[b])[v] over all
  (b, v) (ties: lower b*V + v first). In rank order, a candidate ending in `eos` becomes a
  finished hypothesis; the others fill the next beams until `beam` are live. Slots left over
  are dead (score DEAD: no candidate of theirs can reach the top k). The search stops when
  the best finished score >= the best live score (scores only fall, so no live beam can win
  any more), when no beam is live, or after `max_new_tokens`. The result is the best of all
  finished and live hypotheses, finished first on a tie.

Per search step the clock splits host time into three phases: input preparation (token and
position copies, the KV-cache reorder), model (the step) and search (log-softmax, score add,
top-k, the host read and the choice of beams). Without `timed`, GPU work is not waited for:
`model_s` is then launch time, and the GPU's wait lands in the phase that first reads a result
(search). With `timed=True` every phase ends with backend.synchronize().
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from kernels import _check, sampling
from proto.device import backend
from proto.device.backend import cuda
from proto.models.kv_cache import KVCache

MAX_BEAM = 8      # kernels.sampling.topk returns at most 8 candidates
DEAD = -1e30      # score of an empty beam slot: finite, so score + log-prob never makes NaN


def topk_width(beam: int) -> int:
    """Candidates examined per step: 2*beam (room for eos candidates), at most topk's 8."""
    return min(2 * beam, MAX_BEAM)


@dataclasses.dataclass
class PhaseTimes:
    """Host wall-clock seconds per phase, summed over the search steps (see module doc)."""
    prep_s: float = 0.0
    model_s: float = 0.0
    search_s: float = 0.0
    steps: int = 0
    synchronized: bool = False

    def per_token_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"prep_ms": 1e3 * self.prep_s / n, "model_ms": 1e3 * self.model_s / n,
                "search_ms": 1e3 * self.search_s / n}


class _Clock:
    def __init__(self, times: PhaseTimes):
        self.times, self.t0 = times, time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.times.synchronized:
            backend.synchronize()
        now = time.perf_counter()
        setattr(self.times, phase, getattr(self.times, phase) + now - self.t0)
        self.t0 = now


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The step's input buffers: tokens device int32 (B, 1), pos device int32 (1,)."""
    tokens: object
    pos: object

    @classmethod
    def allocate(cls, batch: int) -> "DecodeInputs":
        return cls(cuda.device_array((batch, 1), np.int32), cuda.device_array(1, np.int32))


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # greedy: (B, T0 + n); beam: the best hypothesis (T0 + n,), prompt first
    score: float        # beam: summed log-probability of `tokens`; greedy: 0.0
    times: PhaseTimes


def _check_prompt(prompt, vocab: int, ndim: int, name: str = "prompt") -> np.ndarray:
    try:
        prompt = np.asarray(prompt)
    except ValueError:   # ragged nested lists
        raise ValueError(f"{name}: expected a {ndim}-D integer array, got ragged rows") from None
    if prompt.ndim != ndim or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"{name}: expected a non-empty {ndim}-D integer array, "
                         f"got {prompt.dtype} shape {prompt.shape}")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"{name}: token ids must lie in [0, {vocab}), got "
                         f"{prompt.min()}..{prompt.max()}")
    return prompt.astype(np.int32)


def _check_run(model, prompt_len: int, max_new_tokens: int, eos, batch: int | None = None) -> int:
    """Validate the common arguments (before anything is allocated); return the cache length
    the run needs. `batch`: rows per step, checked against the model's `max_batch` (and the
    prefill's prompt_len - 1 tokens against its `max_tokens`) where it has them."""
    _check.positive("max_new_tokens", max_new_tokens)
    V = model.config.vocab_size
    if eos is not None and not (_check._is_integer(eos) and 0 <= eos < V):
        raise ValueError(f"eos: expected an id in [0, {V}) or None, got {eos!r}")
    # the last generated token is never fed back, so the cache holds prompt + new - 1 positions
    need = prompt_len + max_new_tokens - 1
    if need > model.config.n_positions:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} - 1 "
                         f"exceeds n_positions={model.config.n_positions}")
    max_batch, max_tokens = getattr(model, "max_batch", None), getattr(model, "max_tokens", None)
    if batch is not None and max_batch is not None and batch > max_batch:
        raise ValueError(f"batch {batch} exceeds the model's max_batch={max_batch}")
    if max_tokens is not None and prompt_len - 1 > max_tokens:
        raise ValueError(f"prompt length {prompt_len}: its prefill of {prompt_len - 1} tokens "
                         f"exceeds the model's max_tokens={max_tokens}")
    return need


def _check_inputs(inputs, batch: int) -> None:
    if inputs is not None and (tuple(inputs.tokens.shape) != (batch, 1)
                               or tuple(inputs.pos.shape) != (1,)):
        raise ValueError(f"inputs: expected tokens ({batch}, 1) and pos (1,), got "
                         f"{tuple(inputs.tokens.shape)} and {tuple(inputs.pos.shape)}")


def _check_caches(caches, batch: int, need: int) -> None:
    for cache in caches:
        if not (hasattr(cache, "batch") and hasattr(cache, "max_len")):
            raise ValueError(f"caches: expected KVCache objects, got {type(cache).__name__}")
        if cache.batch != batch or cache.max_len < need:
            raise ValueError(f"caches: expected batch {batch} and max_len >= {need}, got batch "
                             f"{cache.batch} max_len {cache.max_len}")


def model_dtype(model) -> np.dtype:
    """A model's storage dtype, its logits' and its KV cache's: `model.dtype`, float32 where
    it has none (GPT-2, the LSTM)."""
    return np.dtype(getattr(model, "dtype", np.float32))


def _logits(step, tokens, pos, cache, batch: int, vocab: int, dtype):
    """step(...)'s logits as (batch, vocab) rows, after checking the step kept its contract."""
    logits = step(tokens, pos, cache)
    if getattr(logits, "shape", None) != (batch, 1, vocab) or logits.dtype != dtype:
        raise ValueError(f"step: expected {dtype} logits of shape ({batch}, 1, {vocab}), got "
                         f"{type(logits).__name__} {getattr(logits, 'dtype', '')} "
                         f"{getattr(logits, 'shape', '')}")
    return backend.reshaped(logits, (batch, vocab))   # (the same view every step)


def _prefill(step, prompt_rows: np.ndarray, pos, cache) -> None:
    """Run prompt[:, :-1] from position 0 (nothing when the prompt is one token)."""
    if prompt_rows.shape[1] > 1:
        pos.copy_to_device(np.zeros(1, np.int32))
        step(cuda.to_device(np.ascontiguousarray(prompt_rows[:, :-1])), pos, cache)


def greedy(model, prompt, *, max_new_tokens: int, eos: int | None = None, step=None,
           cache: KVCache | None = None, inputs: DecodeInputs | None = None,
           timed: bool = False) -> Generation:
    """Argmax decoding of `prompt` (B, T0) token ids; see the module doc for the rules.

    The argmax kernel writes each next token straight into `inputs.tokens`, the next step's
    input; the host reads it back every step (for eos and the result): the eager path.
    """
    V = model.config.vocab_size
    prompt = _check_prompt(prompt, V, ndim=2)
    B, T0 = prompt.shape
    need = _check_run(model, T0, max_new_tokens, eos, batch=B)
    if cache is not None:
        _check_caches([cache], B, need)
    _check_inputs(inputs, B)
    dtype = model_dtype(model)
    cache = cache or KVCache(model.config, B, need, dtype)
    step = step or model.step
    inputs = inputs or DecodeInputs.allocate(B)
    times = PhaseTimes(synchronized=timed)
    # Each step's largest logit per row, kept on the device and read once at the end: a
    # non-finite one means the argmax chose from garbage (no per-step transfer added).
    best = cuda.device_array((max_new_tokens, B), np.float32)

    _prefill(step, prompt, inputs.pos, cache)
    inputs.tokens.copy_to_device(np.ascontiguousarray(prompt[:, -1:]))
    next_tokens = inputs.tokens  # (B, 1): the argmax writes the next step's input
    out, done = [prompt], np.zeros(B, dtype=bool)
    clock = _Clock(times)
    for t in range(max_new_tokens):
        inputs.pos.copy_to_device(np.array([T0 - 1 + t], np.int32))
        clock.lap("prep_s")
        logits = _logits(step, inputs.tokens, inputs.pos, cache, B, V, dtype)
        clock.lap("model_s")
        sampling.topk(logits, 1, best[t].reshape(B, 1), next_tokens)  # argmax
        tok = next_tokens.copy_to_host()[:, 0]
        if eos is not None:
            tok = np.where(done, eos, tok)
            done |= tok == eos
        out.append(tok[:, None].astype(np.int32))
        clock.lap("search_s")
        times.steps += 1
        if eos is not None and done.all():
            break
    top = best[:times.steps].copy_to_host()
    if not np.isfinite(top).all():
        t, row = (int(i) for i in np.argwhere(~np.isfinite(top))[0])
        raise FloatingPointError(f"greedy: the logits of row {row} at step {t} have no finite "
                                 f"maximum ({top[t, row]}): the model computes NaN or infinity "
                                 "(check its weights); its tokens mean nothing")
    return Generation(np.concatenate(out, axis=1), 0.0, times)


class _BeamBuffers:
    """Device buffers of the search side, allocated once per run (none inside the loop)."""

    def __init__(self, beam: int, vocab: int, k: int):
        self.scores = cuda.device_array((beam, 1), np.float32)        # running score per beam
        self.values = cuda.device_array((1, k), np.float32)
        self.indices = cuda.device_array((1, k), np.int32)
        self.parents = cuda.device_array(beam, np.int32)


def beam_search(model, prompt, *, beam: int, max_new_tokens: int, eos: int | None = None,
                step=None, caches: tuple[KVCache, KVCache] | None = None,
                inputs: DecodeInputs | None = None, timed: bool = False) -> Generation:
    """Beam search from a 1-D `prompt` of token ids; see the module doc for the rules.

    `caches` are two KVCache of batch `beam`: each step reads one and the reorder gathers the
    chosen beams into the other (gather_batch cannot work in place), alternating.
    """
    V = model.config.vocab_size
    prompt = _check_prompt(prompt, V, ndim=1)
    if not _check._is_integer(beam) or not 1 <= beam <= MAX_BEAM:
        raise ValueError(f"beam: expected an integer in 1..{MAX_BEAM}, got {beam!r}")
    k = topk_width(beam)
    if V < k:
        raise ValueError(f"vocab_size {V}: beam search needs at least {k} tokens")
    T0 = len(prompt)
    need = _check_run(model, T0, max_new_tokens, eos, batch=beam)
    if caches is not None:
        if len(caches) != 2:
            raise ValueError(f"caches: expected two KVCache (read one, reorder into the other), "
                             f"got {len(caches)}")
        _check_caches(caches, beam, need)
    _check_inputs(inputs, beam)
    dtype = model_dtype(model)
    caches = caches or tuple(KVCache(model.config, beam, need, dtype) for _ in range(2))
    step = step or model.step
    inputs = inputs or DecodeInputs.allocate(beam)
    buf = _BeamBuffers(beam, V, k)
    times = PhaseTimes(synchronized=timed)

    _prefill(step, np.tile(prompt, (beam, 1)), inputs.pos, caches[0])
    live = [list(prompt)]                     # live hypotheses, best first (slot order)
    tokens = np.full((beam, 1), prompt[-1], np.int32)
    scores = np.full((beam, 1), DEAD, np.float32)
    scores[0] = 0.0                           # all slots hold the prompt: expand one
    parents = None
    finished: list[tuple[float, list]] = []
    cur = 0
    clock = _Clock(times)
    for t in range(max_new_tokens):
        inputs.tokens.copy_to_device(tokens)
        inputs.pos.copy_to_device(np.array([T0 - 1 + t], np.int32))
        buf.scores.copy_to_device(scores)
        if parents is not None:
            buf.parents.copy_to_device(parents)
            # positions 0..pos-1 are live: inputs.pos, already set for this step, says how many
            caches[cur].reorder_into(buf.parents, caches[1 - cur], length=inputs.pos)
            cur = 1 - cur
        clock.lap("prep_s")
        logits = _logits(step, inputs.tokens, inputs.pos, caches[cur], beam, V, dtype)  # (B, V)
        clock.lap("model_s")
        # the top k of log_softmax(logits) + each beam's running score, over beams x vocab
        sampling.beam_topk(logits, buf.scores, k, buf.values, buf.indices)
        values, indices = buf.values.copy_to_host()[0], buf.indices.copy_to_host()[0]
        # Finite logits give k finite candidates from live beams. NaN ranks as -inf, so a
        # NaN row lets -inf, or an empty slot's DEAD + log-prob, into the top k.
        if not (np.isfinite(values) & (values > DEAD / 2)).all():
            raise FloatingPointError(f"beam_search: step {t}: top-{k} candidate scores "
                                     f"{values.tolist()} are not all finite scores of live "
                                     "beams: the model computes NaN or infinity (check its "
                                     "weights)")
        nxt, parent_list, token_list, score_list = [], [], [], []
        for value, index in zip(values, indices):
            b, tok = divmod(int(index), V)
            if tok == eos:
                finished.append((float(value), live[b] + [tok]))
            elif len(nxt) < beam:
                nxt.append(live[b] + [tok])
                parent_list.append(b)
                token_list.append(tok)
                score_list.append(value)
        live = nxt
        dead = beam - len(live)  # empty slots copy slot 0 and can never be chosen
        parents = np.array(parent_list + [0] * dead, np.int32)
        tokens = np.array(token_list + [0] * dead, np.int32).reshape(beam, 1)
        scores = np.array(score_list + [DEAD] * dead, np.float32).reshape(beam, 1)
        clock.lap("search_s")
        times.steps += 1
        best_finished = max((s for s, _ in finished), default=-np.inf)
        if not live or best_finished >= scores[0, 0]:
            break
    hypotheses = finished + [(float(s), h) for s, h in zip(scores[:len(live), 0], live)]
    score, best = max(hypotheses, key=lambda sh: sh[0])
    return Generation(np.array(best, np.int32), score, times)
