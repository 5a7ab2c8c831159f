"""Reading a generated :class:`~linformer_lab.data.speech.synthetic.SyntheticSpeechCorpus`: one
split as a :class:`SyntheticSpeechDataset`, and the per-noise-setting log-mel cache it reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from linformer_lab.data.speech.cache import atomic_directory
from linformer_lab.data.speech.features import (
    FEATURE_DIM,
    HOP_LENGTH,
    SAMPLE_RATE,
    add_noise,
    compute_log_mel,
    normalize_features,
    stable_seed,
)

__all__ = ["META", "SPLITS", "SyntheticSpeechDataset", "ensure_feature_cache", "feature_key"]

SPLITS = ("train", "val", "test")
#: A corpus's metadata file: its configuration, speakers and per-split statistics.
META = "meta.json"


class SyntheticSpeechDataset(Dataset):
    """One split of a :class:`SyntheticSpeechCorpus`.

    Items are dicts ``{"features": float32 (T, 40) normalised log-mel, "targets": int64 (S,)}``.
    ``lengths`` (frames per item) drives :class:`LengthBucketBatchSampler`. Audio and feature
    arrays are memory-mapped lazily and left out of pickles, so DataLoader workers (fork or
    spawn) map their own instead of receiving copies.

    Args:
        path: corpus directory.
        split: ``"train"``, ``"val"`` or ``"test"``.
        noise_snr_db: add white noise at this SNR (deterministic per utterance), ``None`` = clean.
        cache_features: read features from the per-noise-setting feature cache (built on first
            use) instead of computing them from the audio for every item.
        progress: show a progress bar while building the feature cache.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str,
        noise_snr_db: float | None = None,
        cache_features: bool = True,
        progress: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.path = Path(path)
        self.split = split
        self.noise_snr_db = noise_snr_db
        self.cache_features = cache_features
        with open(self.path / META) as f:
            self.meta = json.load(f)
        index = np.load(self.path / f"{split}.index.npz")
        self.offsets = index["offsets"]  # (U+1,) sample offsets into the audio file
        self.target_offsets = index["target_offsets"]  # (U+1,)
        self.targets = index["targets"].astype(np.int64)  # concatenated phoneme ids
        self.speaker_ids = index["speaker_ids"]  # (U,)
        self.num_samples = np.diff(self.offsets)
        self.lengths = self.num_samples // HOP_LENGTH + 1  # frames, see num_frames()
        self._audio = None
        self._feats = None
        self._frame_offsets = None
        if cache_features:
            self.feature_dir = ensure_feature_cache(self.path, noise_snr_db, progress=progress)
            self._frame_offsets = np.load(self.feature_dir / f"{split}.frame_offsets.npy")

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_audio"] = None  # memmaps are reopened in the receiving process
        state["_feats"] = None
        return state

    def __len__(self) -> int:
        return len(self.num_samples)

    @property
    def seconds(self) -> float:
        """Total audio duration of the split in seconds."""
        return float(self.num_samples.sum()) / SAMPLE_RATE

    def audio(self, i: int) -> np.ndarray:
        """Clean audio of item ``i``: ``np.int16 (samples,)`` at 16 kHz (a memory-mapped view)."""
        if self._audio is None:
            self._audio = np.memmap(self.path / f"{self.split}.audio.int16", dtype="<i2", mode="r")
        return self._audio[self.offsets[i] : self.offsets[i + 1]]

    def waveform(self, i: int) -> torch.Tensor:
        """Float waveform ``(samples,)`` in [-1, 1) of item ``i``, with the configured noise."""
        wav = torch.from_numpy(np.array(self.audio(i), dtype=np.float32)) / 32768.0
        if self.noise_snr_db is not None:
            gen = torch.Generator().manual_seed(stable_seed("noise", self.meta["seed"], self.split, i))
            wav = add_noise(wav, self.noise_snr_db, gen)
        return wav

    def log_mel(self, i: int) -> torch.Tensor:
        """Un-normalised log-mel features ``(frames, 40)`` float32 of item ``i``."""
        if self._frame_offsets is not None:
            if self._feats is None:
                self._feats = np.load(self.feature_dir / f"{self.split}.feats.npy", mmap_mode="r")
            a, b = self._frame_offsets[i], self._frame_offsets[i + 1]
            return torch.from_numpy(np.asarray(self._feats[a:b], dtype=np.float32))
        return compute_log_mel(self.waveform(i))

    def target_ids(self, i: int) -> torch.Tensor:
        """Phoneme ids ``int64 (S,)`` of item ``i`` (1..NUM_PHONEMES-1)."""
        return torch.from_numpy(self.targets[self.target_offsets[i] : self.target_offsets[i + 1]])

    def text(self, i: int) -> dict:
        """``{"text", "ipa", "speaker_id"}`` of item ``i``."""
        if not hasattr(self, "_texts"):
            with open(self.path / f"{self.split}.text.json") as f:
                self._texts = json.load(f)
        return {**self._texts[i], "speaker_id": int(self.speaker_ids[i])}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": normalize_features(self.log_mel(i)), "targets": self.target_ids(i)}


def feature_key(noise_snr_db: float | None) -> str:
    noise = "clean" if noise_snr_db is None else f"snr{float(noise_snr_db):g}"
    return f"logmel{FEATURE_DIM}-v1-{noise}"


def ensure_feature_cache(corpus: Path, noise_snr_db: float | None, progress: bool = True) -> Path:
    """Build ``corpus/features/<key>/`` (fp16 log-mel of every split) once, atomically."""
    final = corpus / "features" / feature_key(noise_snr_db)
    if (final / "done").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(final) as tmp:
        for split in SPLITS:
            ds = SyntheticSpeechDataset(corpus, split, noise_snr_db=noise_snr_db, cache_features=False)
            frame_offsets = np.zeros(len(ds) + 1, dtype=np.int64)
            frame_offsets[1:] = np.cumsum(ds.lengths)
            feats = np.lib.format.open_memmap(
                tmp / f"{split}.feats.npy", mode="w+", dtype=np.float16, shape=(int(frame_offsets[-1]), FEATURE_DIM)
            )
            bar = tqdm(range(len(ds)), desc=f"log-mel features {split} ({final.name})", disable=not progress, leave=False)
            for i in bar:
                feats[frame_offsets[i] : frame_offsets[i + 1]] = ds.log_mel(i).numpy().astype(np.float16)
            feats.flush()
            del feats
            np.save(tmp / f"{split}.frame_offsets.npy", frame_offsets)
        (tmp / "done").write_text("complete\n")
    return final
