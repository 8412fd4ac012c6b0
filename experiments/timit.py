"""Training batches for Wav2Vec2 CTC: synthetic audio with TIMIT's spread of lengths, or real
audio a user brings.

    batches = synthetic_epoch(config, steps=497, batch=8, seed=0)    # no download
    batches = make_batches(config, waveforms, transcripts, batch=8)  # real audio (16 kHz)

A `Batch` is what one training step reads, on the host: the waveforms zero-padded to the
samples of the batch's longest frame count (`config.samples(T)`), each sample's frames, the
label sequences padded with 0 and their lengths. Every method of an experiment trains on the
same list of batches.

Batches are grouped by length as transformers' Trainer does with `group_by_length=True`
(its LengthGroupedSampler): the utterances are shuffled, cut into mega-batches of 50
batches, each sorted longest first, then cut into batches. So a batch holds utterances of
similar length and the batches' frame counts spread over the whole range: TIMIT-length audio
up to 4 s gives encoder lengths 65..199 frames, about 119 distinct over an epoch.

Real TIMIT: load each utterance's 16 kHz samples as a float32 array (e.g. with soundfile)
and its transcript as label ids (1..vocab-1; 0 is CTC's blank), and pass the lists to
`make_batches`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

MEGABATCH = 50   # transformers' LengthGroupedSampler: mega-batches of 50 batches


@dataclasses.dataclass(frozen=True)
class Batch:
    waveform: np.ndarray       # (B, L) float32, L = config.samples(frames.max())
    frames: np.ndarray         # (B,) int32
    labels: np.ndarray         # (B, S) int32, 0 past each label's length
    label_lengths: np.ndarray  # (B,) int32

    @property
    def length(self) -> int:
        """The batch's frame count: which per-length graph serves it."""
        return int(self.frames.max())


def normalize(x: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance: Wav2Vec2FeatureExtractor's `do_normalize`."""
    x = np.asarray(x, np.float64)
    return ((x - x.mean()) / np.sqrt(x.var() + 1e-7)).astype(np.float32)


def make_batches(config, waveforms, transcripts, *, batch: int = 8, seed: int = 0,
                 max_label: int | None = None) -> list[Batch]:
    """Length-grouped, padded batches of the utterances (each a 1-D array of 16 kHz samples)
    and their label sequences. A remainder that fills no whole batch is dropped."""
    if len(waveforms) != len(transcripts):
        raise ValueError(f"waveforms, transcripts: expected one transcript per utterance, got "
                         f"{len(waveforms)} and {len(transcripts)}")
    frames = np.array([config.frames(len(w)) for w in waveforms])
    short = np.flatnonzero(frames < 1)
    if short.size:
        raise ValueError(f"waveforms[{short[0]}]: {len(waveforms[short[0]])} samples make no frame")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(waveforms))
    mega = batch * MEGABATCH
    grouped = np.concatenate([sorted(order[i:i + mega], key=lambda j: -frames[j])
                              for i in range(0, len(order), mega)]).astype(int)
    out = []
    for i in range(0, len(grouped) - batch + 1, batch):
        idx = grouped[i:i + batch]
        T = int(frames[idx].max())
        L = config.samples(T)
        wave = np.zeros((batch, L), np.float32)
        for r, j in enumerate(idx):
            n = min(len(waveforms[j]), L)
            wave[r, :n] = waveforms[j][:n]
        lens = np.array([len(transcripts[j]) for j in idx], np.int32)
        labels = np.zeros((batch, max_label or max(int(lens.max()), 1)), np.int32)
        for r, j in enumerate(idx):
            labels[r, :lens[r]] = transcripts[j]
        out.append(Batch(wave, frames[idx].astype(np.int32), labels, lens))
    return out


def synthetic_utterances(config, n: int, *, min_frames: int = 65, max_frames: int = 199,
                         seed: int = 0):
    """(waveforms, transcripts) of `n` utterances: frame counts spread over
    [min_frames, max_frames] like TIMIT's durations (a normal about 3 s clipped to the range),
    each waveform exactly config.samples(frames) long (noise and a few tones, normalized),
    each transcript about one label per 4 frames (TIMIT's ~12 characters a second at 50
    frames a second), ids 1..vocab-1."""
    rng = np.random.default_rng(seed)
    mid, spread = 0.6 * max_frames, 0.25 * (max_frames - min_frames)
    counts = np.clip(np.rint(rng.normal(mid, spread, n)), min_frames, max_frames).astype(int)
    waveforms, transcripts = [], []
    for T in counts:
        L = config.samples(int(T))
        t = np.arange(L) / 16000.0
        tones = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 2 * np.pi))
                    for f in rng.uniform(100, 4000, 3))
        waveforms.append(normalize(tones + rng.normal(0, 0.5, L)))
        k = int(np.clip(rng.normal(T / 4, T / 16), 1, T // 2))
        transcripts.append(rng.integers(1, config.vocab, k).astype(np.int32))
    return waveforms, transcripts


def synthetic_epoch(config, *, steps: int = 497, batch: int = 8, seed: int = 0,
                    min_frames: int = 65, max_frames: int = 199) -> list[Batch]:
    """`steps` batches of synthetic TIMIT-like utterances (see `synthetic_utterances`)."""
    waves, texts = synthetic_utterances(config, steps * batch, min_frames=min_frames,
                                        max_frames=max_frames, seed=seed)
    return make_batches(config, waves, texts, batch=batch, seed=seed + 1)
