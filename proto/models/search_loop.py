"""A whole generation as ONE graph launch: the decode loop and its stop test on the device.

GraphedDecoder replays one graph per token, then copies results back so the host can decide:
greedy tests for EOS, beam search picks the next beams. That is a synchronization per token,
with the GPU idle while Python looks. Here the loop itself is in the graph
(proto.graph.while_loop) and the decisions are kernels, so one launch generates until the
search is over:

    GreedyLoop   WHILE flag:  logits = step(tokens, pos, cache)     (position read on device)
                              argmax(logits) -> tokens              (the next pass's input)
                              greedy_advance: record tokens, done |= eos, pos += 1, flag
    BeamLoop     WHILE flag:  logits = step(tokens, pos, cache)
                              top-k of log_softmax(logits) + scores over beams x vocab
                              (sampling.beam_topk)
                              beam_advance: choose beams in rank order (finished on eos), new
                                            tokens, scores, parents, histories, best finished,
                                            pos += 1, flag
                              reorder by parents the table of cache rows each position of
                              a hypothesis is in (KVCache.pair: the K and V stay where they
                              were written; the table's live prefix, read on the device,
                              goes into the other table)
                              IF flag: the same step with the tables and histories swapped
                              (a graph's body is fixed; two steps a pass bring it back to
                              the tables it started from, so nothing is copied back)

Everything the loop changes lives in device buffers recorded once, so the same graph serves
every prompt, budget and EOS id: a run writes the starting state, launches, and reads the
result once. The prompt's prefill runs eagerly. Results equal generate.greedy's and
generate.beam_search's (the same kernels in the same order; the choices follow the same rules).

    with BeamLoop(model, beam=5, max_len=1024) as loop:
        gen = loop.generate(prompt, max_new_tokens=100, eos=50256)   # == generate.beam_search

`control` picks how the loop runs (proto.graph.capture): "conditional" (a WHILE graph node),
"predicated" (the body unrolled `unroll` times, every kernel testing the loop's flag, the host
relaunching every `unroll` passes) or "host" (the host reads the flag after every pass).
"""
from __future__ import annotations

import numpy as np

from kernels import _check, sampling
from proto.device.backend import cuda
from proto.graph import capture, if_then, while_loop
from proto.models import generate
from proto.models.kv_cache import KVCache


LOWEST = float(np.finfo(np.float32).min)   # a greedy score is only required to be finite


def _zeros(*shape, dtype=np.int32):
    return cuda.to_device(np.zeros(shape, dtype))


class _DeviceLoop:
    """What both searches share: one graph `WHILE flag: body()`, its temporaries planned into
    the graph's own arena. The loop's bound is the most tokens a generation can make,
    `steps_per_pass` of them a pass."""

    steps_per_pass = 1

    def __init__(self, model, batch: int, max_len: int, cache: KVCache | None = None):
        self.model, self.config = model, model.config
        self.batch = _check.positive("batch", batch)
        self.max_len = _check.positive("max_len", max_len, at_most=self.config.n_positions)
        self.cache = cache or KVCache(self.config, self.batch, self.max_len,
                                      generate.model_dtype(model))
        self.tokens, self.pos, self.flag = _zeros(self.batch, 1), _zeros(1), _zeros(1)
        self.bad = _zeros(1)   # set on the device when a step's scores are not finite

    def _capture(self, executor, control: str, unroll: int) -> None:
        passes = -(-self.max_len // self.steps_per_pass)
        self.graph = capture(lambda: while_loop(self.flag, self._body, max_passes=passes),
                             {}, executor=executor, warmup=0, control=control, unroll=unroll)

    def _body(self) -> None:
        raise NotImplementedError

    def _check_need(self, T0: int, max_new_tokens: int, eos) -> None:
        need = generate._check_run(self.model, T0, max_new_tokens, eos)
        if need > self.max_len:
            raise ValueError(f"prompt length {T0} + max_new_tokens {max_new_tokens} - 1 "
                             f"exceeds max_len={self.max_len}")

    def launch(self) -> None:
        """The whole generation: one graph launch (returns before the GPU is done)."""
        self.graph.replay()

    def _times(self, state: np.ndarray) -> generate.PhaseTimes:
        """The step count (state[0]) in generate's result type; phases are not split here.
        Raises where the host search would have: non-finite scores, a step out of range."""
        if state[0] == sampling.STEP_ERROR:
            raise RuntimeError(f"{type(self).__name__}: a step index left its buffer on the "
                               "device; the generation stopped there (see kernels.sampling)")
        if self.bad.copy_to_host()[0]:
            raise FloatingPointError(f"{type(self).__name__}: a step's scores were not all finite "
                                     "(NaN or infinite logits); the tokens would be garbage")
        times = generate.PhaseTimes(synchronized=False)
        times.steps = int(state[0])
        return times

    def close(self) -> None:
        self.graph.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GreedyLoop(_DeviceLoop):
    """Greedy decoding of `batch` rows; `model` has a decoder step's contract (GPT2, GPTJ)."""

    def __init__(self, model, *, batch: int, max_len: int, executor: str | None = None,
                 control: str = "conditional", unroll: int = 16):
        super().__init__(model, batch, max_len)
        self.out = _zeros(self.batch, self.max_len)
        self.done, self.state = _zeros(self.batch), _zeros(3)
        self.top = _zeros(self.batch, 1, dtype=np.float32)   # each row's largest logit
        self._set(0, 1, -1, go=False)
        self._capture(executor, control, unroll)

    def _body(self) -> None:
        logits = self.model.step(self.tokens, self.pos, self.cache)
        sampling.topk(logits.reshape(self.batch, self.config.vocab_size), 1, self.top,
                      self.tokens)                                          # the argmax
        sampling.check_scores(self.top, LOWEST, self.bad)
        sampling.greedy_advance(self.tokens, self.pos, self.out, self.done, self.state, self.flag)

    def _set(self, pos: int, limit: int, eos: int, go: bool) -> None:
        self.pos.copy_to_device(np.array([pos], np.int32))
        self.done.copy_to_device(np.zeros(self.batch, np.int32))
        self.state.copy_to_device(np.array([0, limit, eos], np.int32))
        self.flag.copy_to_device(np.array([int(go)], np.int32))
        self.bad.copy_to_device(np.zeros(1, np.int32))

    def start(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> np.ndarray:
        """Check the arguments, prefill the prompt (B, T0) eagerly and set the loop's state;
        `launch()` then runs the generation. Returns the prompt as int32."""
        prompt = generate._check_prompt(prompt, self.config.vocab_size, ndim=2)
        if prompt.shape[0] != self.batch:
            raise ValueError(f"prompt: expected {self.batch} rows (batch), got {prompt.shape[0]}")
        T0 = prompt.shape[1]
        self._check_need(T0, max_new_tokens, eos)
        generate._prefill(self.model.step, prompt, self.pos, self.cache)
        self.tokens.copy_to_device(np.ascontiguousarray(prompt[:, -1:]))
        self._set(T0 - 1, max_new_tokens, -1 if eos is None else eos, go=True)
        return prompt

    def result(self, prompt: np.ndarray) -> generate.Generation:
        """(B, T0 + n) tokens: the prompt, then the n generated (waits for the GPU)."""
        times = self._times(self.state.copy_to_host())
        tokens = np.concatenate([prompt, self.out.copy_to_host()[:, :times.steps]], axis=1)
        return generate.Generation(tokens, 0.0, times)

    def generate(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> generate.Generation:
        """generate.greedy's result, from one graph launch."""
        prompt = self.start(prompt, max_new_tokens=max_new_tokens, eos=eos)
        self.launch()
        return self.result(prompt)


class BeamLoop(_DeviceLoop):
    """Beam search with `beam` hypotheses from one prompt; `model` has a decoder step's contract (GPT2, GPTJ).
    Two steps a pass (cache sets A -> B, then B -> A), so `unroll` counts pairs of steps."""

    steps_per_pass = 2

    def __init__(self, model, *, beam: int, max_len: int, executor: str | None = None,
                 control: str = "conditional", unroll: int = 16):
        if not isinstance(beam, (int, np.integer)) or not 1 <= beam <= generate.MAX_BEAM:
            raise ValueError(f"beam: expected an integer in 1..{generate.MAX_BEAM}, got {beam!r}")
        # One cache for both steps of a pass, two tables of rows: a reorder rewrites a table
        # (KVCache.pair), the K and V stay where they were written.
        self.cache, self.scratch = KVCache.pair(model.config, beam, max_len,
                                                generate.model_dtype(model))
        super().__init__(model, beam, max_len, cache=self.cache)
        V = self.config.vocab_size
        self.k = generate.topk_width(beam)
        if V < self.k:
            raise ValueError(f"vocab_size {V}: beam search needs at least {self.k} tokens")
        self.scores = _zeros(beam, 1, dtype=np.float32)
        self.values, self.indices = _zeros(1, self.k, dtype=np.float32), _zeros(1, self.k)
        self.parents = _zeros(beam)
        cap = self.max_len + 1                 # a history holds the prompt and every new token
        self.hist, self.hist_next, self.best_hist = _zeros(beam, cap), _zeros(beam, cap), _zeros(cap)
        self.best, self.best_meta, self.state = _zeros(1, dtype=np.float32), _zeros(3), _zeros(5)
        self._set(np.zeros(1, np.int32), 1, -1, go=False)
        self._capture(executor, control, unroll)

    def _body(self) -> None:
        self._step(self.cache, self.scratch, self.hist, self.hist_next)
        if_then(self.flag, lambda: self._step(self.scratch, self.cache, self.hist_next, self.hist))

    def _step(self, cache, other, hist, hist_next) -> None:
        """One token: the step reads `cache` and `hist`, the chosen beams land in `other` and
        `hist_next`."""
        beam, V = self.batch, self.config.vocab_size
        logits = self.model.step(self.tokens, self.pos, cache)
        sampling.beam_topk(logits.reshape(beam, V), self.scores, self.k, self.values,
                           self.indices)   # top k of log_softmax + running scores
        sampling.beam_advance(self.values, self.indices, V, self.scores, self.tokens, self.parents,
                              hist, hist_next, self.best, self.best_hist,
                              self.best_meta, self.state, self.pos, self.flag,
                              floor=generate.DEAD / 2, bad=self.bad)   # the host search's check
        # beam_advance has counted this step's position: pos[0] positions are live
        cache.reorder_into(self.parents, other, length=self.pos)

    def _set(self, prompt: np.ndarray, limit: int, eos: int, go: bool) -> None:
        beam, T0 = self.batch, len(prompt)
        self.tokens.copy_to_device(np.full((beam, 1), prompt[-1], np.int32))
        self.pos.copy_to_device(np.array([T0 - 1], np.int32))
        scores = np.full((beam, 1), generate.DEAD, np.float32)
        scores[0] = 0.0                        # every slot holds the prompt: expand one
        self.scores.copy_to_device(scores)
        hist = np.zeros(self.hist.shape, np.int32)
        hist[:, :T0] = prompt
        self.hist.copy_to_device(hist)
        self.best.copy_to_device(np.array([-np.inf], np.float32))
        self.best_meta.copy_to_device(np.array([-1, 0, 0], np.int32))
        self.state.copy_to_device(np.array([0, limit, eos, T0, 1], np.int32))
        self.flag.copy_to_device(np.array([int(go)], np.int32))
        self.bad.copy_to_device(np.zeros(1, np.int32))

    def start(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> np.ndarray:
        """Check the arguments, prefill the 1-D prompt eagerly and set the loop's state."""
        prompt = generate._check_prompt(prompt, self.config.vocab_size, ndim=1)
        self._check_need(len(prompt), max_new_tokens, eos)
        self.pos.copy_to_device(np.zeros(1, np.int32))
        self.cache.reset_rows()
        self.scratch.reset_rows()
        generate._prefill(self.model.step, np.tile(prompt, (self.batch, 1)), self.pos, self.cache)
        self._set(prompt, max_new_tokens, -1 if eos is None else eos, go=True)
        return prompt

    def result(self) -> generate.Generation:
        """The best of the finished and live hypotheses, finished first on a tie (waits)."""
        state, best_meta = self.state.copy_to_host(), self.best_meta.copy_to_host()
        times = self._times(state)
        best, top_live = float(self.best.copy_to_host()[0]), float(self.scores.copy_to_host()[0, 0])
        live, length = int(state[4]), int(state[3])
        if live == 0 or (best_meta[2] > 0 and best >= top_live):
            return generate.Generation(self.best_hist.copy_to_host()[:best_meta[2]], best, times)
        latest = self.hist_next if times.steps % 2 else self.hist   # odd steps end in A -> B
        return generate.Generation(latest.copy_to_host()[0, :length], top_live, times)

    def generate(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> generate.Generation:
        """generate.beam_search's result, from one graph launch."""
        self.start(prompt, max_new_tokens=max_new_tokens, eos=eos)
        self.launch()
        return self.result()
