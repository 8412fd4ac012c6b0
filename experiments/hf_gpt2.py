"""GPT-2 beam search as a Hugging Face user runs it: the end_to_end baselines from outside.

Hugging Face's own `GPT2LMHeadModel`, loaded with our state dict (its names), float32 with
TF32 off, searched by `model.generate(num_beams=beam, do_sample=False)` with no end-of-text
token, so every run generates the same number of tokens. Without an eos, generate's beam
search keeps the best `beam` of the beam x vocabulary candidates each step and returns the
best final beam: the rules of proto.models.generate.beam_search, so the tokens can be compared
(they differ only where two candidates tie to within float32 rounding). Two ways:

  eager     generate with its default dynamic cache: what a user gets by default;
  compiled  the strongest a user would pick: the model's forward compiled with
            torch.compile(mode="reduce-overhead") (CUDA graphs under the hood) and
            generate(cache_implementation="static"), Hugging Face's recipe for fast decoding.

Only the host sees tokens here: prompt in, tokens out (NumPy), so the module runs on the CPU
too (tests, without compiling).

`HFChild` runs the search in a child process (`python -m experiments.hf_gpt2 --serve`), as a
Hugging Face user runs it: a process of PyTorch's alone, with no Numba context beside it.
torch.compile's CUDA graphs died with a segmentation fault in the process that also held our
graphs; in a child, a crash costs that method, not the run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import select
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import torch
import transformers

from experiments import common
from proto.models.gpt2 import GPT2Config, load_state_dict


def hf_model(config: GPT2Config, state_dict, device: str = "cuda", dtype="float32"):
    """GPT2LMHeadModel with our weights in `dtype` (float32 or float16, as a user would load
    it with torch_dtype): every parameter loaded, the head tied to wte."""
    common.no_tf32()
    hf_config = transformers.GPT2Config(
        n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
        vocab_size=config.vocab_size, n_positions=config.n_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.GPT2LMHeadModel(hf_config)
    weights = {k: torch.from_numpy(np.ascontiguousarray(v))
               for k, v in load_state_dict(config, state_dict).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"state_dict: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.tie_weights()   # lm_head is wte, as in GPT-2 and in ours
    return model.to(device, dtype=getattr(torch, np.dtype(dtype).name)).eval()


def compile_for_decoding(model) -> None:
    """Hugging Face's recipe for fast decoding, the model's half: its forward under
    torch.compile(mode="reduce-overhead") (CUDA graphs under the hood). generate's half is
    cache_implementation="static" (beam_generate's static_cache)."""
    # Inductor's static CUDA launcher died with a segmentation fault on the H200 (torch 2.11)
    # while CUDA graph trees recorded the second generation; Triton's own launcher does the
    # same launches. Replays launch neither.
    import torch._inductor.config as inductor
    inductor.use_static_cuda_launcher = False
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)


def beam_generate(model, prompt, new: int, *, beam: int, static_cache: bool, device):
    """The (1, prompt + new) token tensor of `model.generate`'s beam search: exactly `new`
    tokens (no end-of-text), as every method of the experiments searches."""
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64)[None], device=device)
    extra = {"cache_implementation": "static"} if static_cache else {}
    with torch.no_grad():
        return model.generate(ids, num_beams=beam, num_return_sequences=1, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, length_penalty=1.0,
                              early_stopping=False, eos_token_id=None, pad_token_id=0, **extra)


class HFBeamSearch:
    """`generate(prompt, new)` -> tokens (prompt included), by Hugging Face's generate."""

    def __init__(self, config: GPT2Config, state_dict, *, beam: int, compiled: bool,
                 device: str = "cuda", dtype="float32"):
        self.beam, self.compiled, self.device = beam, compiled, device
        self.model = hf_model(config, state_dict, device, dtype)
        if compiled:
            compile_for_decoding(self.model)

    def generate(self, prompt, new: int) -> np.ndarray:
        return beam_generate(self.model, prompt, new, beam=self.beam,
                             static_cache=self.compiled, device=self.device)[0].cpu().numpy()

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


class HFChild:
    """HFBeamSearch in a child process: the same `generate(prompt, new)` -> tokens; the child
    loads the parent's weights from a file. A child that dies raises RuntimeError with its
    exit status (its traceback is on stderr); one that gives no answer in `timeout_s` is
    stopped and raises too."""

    def __init__(self, config: GPT2Config, state_dict, *, beam: int, compiled: bool,
                 device: str = "cuda", timeout_s: float = 1800.0, dtype="float32"):
        self.compiled, self.timeout_s = compiled, timeout_s
        self._folder = tempfile.TemporaryDirectory()
        weights = pathlib.Path(self._folder.name, "weights.npz")
        np.savez(weights, **state_dict)
        spec = {"config": dataclasses.asdict(config), "beam": beam, "compiled": compiled,
                "device": device, "weights": str(weights), "dtype": np.dtype(dtype).name}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.hf_gpt2", "--serve", json.dumps(spec)],
            cwd=common.REPO, env=common.child_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self._ask({"ready": True})

    def _ask(self, request: dict) -> dict:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            # a child that hangs must not hang the run: wait at most timeout_s for its reply
            ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
            if not ready:
                self._proc.kill()
                self._proc.wait()
                raise RuntimeError(f"the Hugging Face child process gave no answer in "
                                   f"{self.timeout_s:g} s; it was stopped")
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            status = self._proc.wait()
            raise RuntimeError(f"the Hugging Face child process died (exit status {status}"
                               f"{', signal ' + str(-status) if status < 0 else ''})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the Hugging Face child process: {reply['error']}")
        return reply

    def generate(self, prompt, new: int) -> np.ndarray:
        reply = self._ask({"prompt": np.asarray(prompt).tolist(), "new": int(new)})
        return np.asarray(reply["tokens"], np.int64)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._folder.cleanup()


def _serve(spec: dict) -> None:
    """The child: one HFBeamSearch; a JSON request per stdin line, a JSON reply per line on
    the real stdout (anything the libraries print goes to stderr)."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    with np.load(spec["weights"]) as f:
        state_dict = {k: f[k] for k in f.files}
    search = HFBeamSearch(GPT2Config(**spec["config"]), state_dict, beam=spec["beam"],
                          compiled=spec["compiled"], device=spec["device"],
                          dtype=spec.get("dtype", "float32"))
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ready": True} if request.get("ready") else \
                {"tokens": search.generate(request["prompt"], request["new"]).tolist()}
        except Exception as exc:   # noqa: BLE001  the parent raises it, with its message
            traceback.print_exc()    # the whole story on stderr, which the run's log keeps
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    search.close()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--serve":
        sys.exit("usage: python -m experiments.hf_gpt2 --serve SPEC_JSON (HFChild starts it)")
    _serve(json.loads(sys.argv[2]))
