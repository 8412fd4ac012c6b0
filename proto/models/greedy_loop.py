"""Greedy generation as ONE graph launch: the decode loop and its stop test on the device.

GraphedGPT2.greedy replays one graph per token and then copies the tokens back so the host
can test for EOS: a synchronization per token, with the GPU idle while Python looks. Here
the loop itself is in the graph (proto.control.while_loop), so one launch generates until
every sequence has produced EOS or the token budget is spent:

    WHILE flag[0] != 0:
        logits = model.step(tokens, pos, cache)   # the position is read on the device
        argmax(logits) -> tokens                  # in place: the next pass's input
        greedy_advance: out[:, t] = tokens (eos once done), done |= eos, pos += 1,
                        flag = t + 1 < max_new and not all done

Everything the loop changes lives in device buffers recorded once (tokens, pos, the KV cache,
out, done, state, flag), so the same graph serves every prompt, budget and EOS id: a run
writes them, launches, and reads `out` once at the end. The prompt's prefill runs eagerly.

    with GreedyLoop(model, batch=5, max_len=1024) as loop:
        gen = loop.generate(prompt, max_new_tokens=100, eos=50256)   # == generate.greedy
"""
from __future__ import annotations

import numpy as np

from kernels import _check, sampling
from proto import control, graph
from proto.backend import cuda
from proto.models import generate
from proto.models.gpt2 import KVCache


class GreedyLoop:
    """`model` has GPT2.step's contract (fixed output buffers, position read on the device)."""

    def __init__(self, model, *, batch: int, max_len: int, executor: str | None = None):
        self.model, config = model, model.config
        self.batch = B = _check.positive("batch", batch)
        self.max_len = _check.positive("max_len", max_len, at_most=config.n_positions)
        self.cache = KVCache(config, B, self.max_len)
        zeros = lambda *shape: cuda.to_device(np.zeros(shape, np.int32))  # noqa: E731
        self.tokens, self.pos, self.out = zeros(B, 1), zeros(1), zeros(B, self.max_len)
        self.done, self.state, self.flag = zeros(B), zeros(3), zeros(1)
        # One pass eagerly first, so that first-call workspaces (the attention's, the argmax's)
        # exist before recording; then record with the flag down (the first replay is empty).
        self._set(0, 1, -1, go=False)
        self._body()
        self.flag.copy_to_device(np.zeros(1, np.int32))
        self.graph = graph.capture(self._loop, {}, executor=executor, warmup=0)

    def _body(self) -> None:
        logits = self.model.step(self.tokens, self.pos, self.cache)
        sampling.argmax(logits.reshape(self.batch, self.model.config.vocab_size),
                        self.tokens.reshape(self.batch))
        sampling.greedy_advance(self.tokens, self.pos, self.out, self.done, self.state, self.flag)

    def _loop(self) -> None:
        control.while_loop(self.flag, self._body)

    def _set(self, pos: int, limit: int, eos: int, go: bool) -> None:
        self.pos.copy_to_device(np.array([pos], np.int32))
        self.done.copy_to_device(np.zeros(self.batch, np.int32))
        self.state.copy_to_device(np.array([0, limit, eos], np.int32))
        self.flag.copy_to_device(np.array([int(go)], np.int32))

    def start(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> np.ndarray:
        """Check the arguments, prefill the prompt (eager) and set the loop's state; returns
        the prompt as int32. `launch()` then runs the whole generation."""
        prompt = generate._check_prompt(prompt, self.model.config.vocab_size, ndim=2)
        if prompt.shape[0] != self.batch:
            raise ValueError(f"prompt: expected {self.batch} rows (batch), got {prompt.shape[0]}")
        T0 = prompt.shape[1]
        need = generate._check_run(self.model, T0, max_new_tokens, eos)
        if need > self.max_len:
            raise ValueError(f"prompt length {T0} + max_new_tokens {max_new_tokens} - 1 "
                             f"exceeds max_len={self.max_len}")
        generate._prefill(self.model.step, prompt, self.pos, self.cache)
        self.tokens.copy_to_device(np.ascontiguousarray(prompt[:, -1:]))
        self._set(T0 - 1, max_new_tokens, -1 if eos is None else eos, go=True)
        return prompt

    def launch(self) -> None:
        """The whole generation: one graph launch (returns before the GPU is done)."""
        self.graph.replay()

    def result(self, prompt: np.ndarray) -> np.ndarray:
        """(B, T0 + n) tokens: the prompt, then the n tokens generated (waits for the GPU)."""
        n = int(self.state.copy_to_host()[0])
        return np.concatenate([prompt, self.out.copy_to_host()[:, :n]], axis=1)

    def generate(self, prompt, *, max_new_tokens: int, eos: int | None = None) -> generate.Generation:
        """generate.greedy's result, from one graph launch."""
        prompt = self.start(prompt, max_new_tokens=max_new_tokens, eos=eos)
        self.launch()
        times = generate.PhaseTimes(synchronized=False)
        times.steps = int(self.state.copy_to_host()[0])
        return generate.Generation(self.result(prompt), 0.0, times)

    def close(self) -> None:
        self.graph.close()

    def __enter__(self) -> "GreedyLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
