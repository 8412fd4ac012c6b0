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
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

from experiments import common
from proto.models.gpt2 import GPT2Config, load_state_dict


def hf_model(config: GPT2Config, state_dict, device: str = "cuda"):
    """GPT2LMHeadModel with our weights: every parameter loaded, the head tied to wte."""
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
    return model.to(device).eval()


class HFBeamSearch:
    """`generate(prompt, new)` -> tokens (prompt included), by Hugging Face's generate."""

    def __init__(self, config: GPT2Config, state_dict, *, beam: int, compiled: bool,
                 device: str = "cuda"):
        self.beam, self.compiled, self.device = beam, compiled, device
        self.model = hf_model(config, state_dict, device)
        if compiled:
            self.model.forward = torch.compile(self.model.forward, mode="reduce-overhead",
                                               fullgraph=True)

    def generate(self, prompt, new: int) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64)[None], device=self.device)
        extra = {"cache_implementation": "static"} if self.compiled else {}
        with torch.no_grad():
            out = self.model.generate(ids, num_beams=self.beam, num_return_sequences=1,
                                      max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      length_penalty=1.0, early_stopping=False,
                                      eos_token_id=None, pad_token_id=0, **extra)
        return out[0].cpu().numpy()

    def close(self) -> None:
        self.model = None
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
