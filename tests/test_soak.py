"""Soak (GPU lane): many capture, replay and close cycles and many whole generations leave
device memory where it was and give the same results every time."""
import numpy as np
import pytest

from proto import graph
from proto.models import generate
from proto.models.gpt2 import GPT2, GPT2Config, random_state_dict
from proto.models.graphed import GraphedDecoder
from tests.helpers import dev
from tests.test_graph import eager, make_step
from tests.test_graph_gpu import free_bytes

pytestmark = pytest.mark.gpu
SLACK = 2 << 20   # the driver's allocation granularity


def test_ten_thousand_capture_replay_close_cycles_give_back_their_memory():
    n = 1000
    rng = np.random.default_rng(0)
    x0, y0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    want_out, want_copy = eager(n, x0, y0)
    x, y = dev(x0), dev(y0)
    step = make_step(n)
    for mode in ("copy", "alias"):   # warm the context, kernels and Numba's pools first
        graph.capture(step, {"x": x, "y": y}, binding=mode, warmup=0).close()
    before = free_bytes()
    for i in range(10_000):
        g = graph.capture(step, {"x": x, "y": y}, binding=("copy", "alias")[i % 2], warmup=0)
        out, y_copy = g.replay(x=x, y=y)
        if i % 1000 == 0:
            np.testing.assert_array_equal(out.copy_to_host(), want_out)
            np.testing.assert_array_equal(y_copy.copy_to_host(), want_copy)
        g.close()
        assert g.closed
    assert free_bytes() >= before - SLACK


def test_two_hundred_generations_give_the_same_tokens_and_back_their_memory():
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)
    model = GPT2(config, random_state_dict(config, 5), max_batch=5, max_tokens=4)
    prompt = np.array([5, 9, 2, 7, 1])
    want = generate.beam_search(model, prompt, beam=5, max_new_tokens=16)
    GraphedDecoder(model, batch=5, max_len=20, build_all=True).close()   # warm up
    before = free_bytes()
    for i in range(200):
        with GraphedDecoder(model, batch=5, max_len=20, strategy=("device", "exact")[i % 2],
                         shared_executables=(None, 1)[i % 2]) as g:
            got = g.beam_search(prompt, max_new_tokens=16)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert got.score == want.score
    assert free_bytes() >= before - SLACK
