"""A local LibriSpeech copy read in its on-disk layout (FLAC audio, .trans.txt transcripts)."""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torchaudio
from torch.utils.data import Dataset

from linformer_lab.data import espeak
from linformer_lab.data.errors import DataNotFoundError
from linformer_lab.data.phonemes import UnknownPhonemeError, phonemes_to_ids
from linformer_lab.data.speech.features import SAMPLE_RATE, compute_log_mel, normalize_features, num_frames

LIBRISPEECH_LAYOUT = (
    "<root>/LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>-<utterance>.flac and "
    "<root>/LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt "
    "(one '<speaker>-<chapter>-<utterance> TRANSCRIPT' line per utterance), i.e. the "
    "LibriSpeech tarballs (OpenSLR resource 12) extracted into <root>"
)


class LibriSpeechNotFoundError(DataNotFoundError):
    """A LibriSpeech subset is missing under the given root (a ``FileNotFoundError`` and a
    ``ConfigurationError`` too, as every :class:`DataNotFoundError`: the CLI reports it as one
    line before training)."""


def check_subset(root: Path, subset: str) -> None:
    """Raise :class:`LibriSpeechNotFoundError` unless ``root/LibriSpeech/subset`` holds FLAC files."""
    subset_dir = root / "LibriSpeech" / subset
    if not subset_dir.is_dir() or next(subset_dir.glob("*/*/*.flac"), None) is None:
        raise LibriSpeechNotFoundError(
            f"LibriSpeech subset {subset!r} not found: {subset_dir} "
            f"{'has no FLAC files' if subset_dir.is_dir() else 'does not exist'}. Expected layout: "
            f"{LIBRISPEECH_LAYOUT}."
        )


class AudioBackendError(ImportError):
    """No installed package can decode the audio file format."""


def load_audio(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """``(waveform (samples,), sample_rate)`` of an audio file (FLAC for LibriSpeech), mono float32
    in [-1, 1); a corpus may take another reader (``LibriSpeechCorpus(audio_loader=...)``).

    Uses ``soundfile`` (libsndfile, bundled in its wheels) when installed, else ``torchaudio.load``,
    which since torchaudio 2.9 delegates to ``torchcodec`` (needs FFmpeg shared libraries).
    """
    try:
        import soundfile
    except ImportError:
        soundfile = None
    if soundfile is not None:
        data, sr = soundfile.read(os.fspath(path), dtype="float32", always_2d=True)
        return torch.from_numpy(data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]), int(sr)
    try:
        wav, sr = torchaudio.load(os.fspath(path))
    except ImportError as exc:
        raise AudioBackendError(
            f"cannot decode {os.fspath(path)!r}: no FLAC reader is installed. Install 'soundfile' "
            f"(pip install soundfile; its wheels bundle libsndfile with FLAC), or 'torchcodec' "
            f"plus system FFmpeg libraries for torchaudio.load. ({exc})"
        ) from exc
    return wav.mean(dim=0), int(sr)


def flac_info(path: str | os.PathLike) -> tuple[int, int]:
    """``(num_samples, sample_rate)`` of a FLAC file from its STREAMINFO block: every utterance's
    length (for length bucketing) from 42 bytes per file instead of decoding hours of audio."""
    with open(path, "rb") as f:
        head = f.read(42)
    if len(head) < 42 or head[:4] != b"fLaC" or (head[4] & 0x7F) != 0:
        raise ValueError(f"{os.fspath(path)!r} is not a FLAC file starting with STREAMINFO")
    # STREAMINFO body starts at byte 8: min/max block size (2+2), min/max frame size (3+3),
    # then 64 bits: sample rate (20), channels-1 (3), bits per sample-1 (5), total samples (36).
    (packed,) = struct.unpack(">Q", head[18:26])
    sample_rate = packed >> 44
    total = packed & ((1 << 36) - 1)
    return int(total), int(sample_rate)


class LibriSpeechCorpus(Dataset):
    """Local LibriSpeech subsets as a speech dataset with eSpeak phoneme targets.

    File discovery and transcripts come from ``torchaudio.datasets.LIBRISPEECH(root,
    url=subset, download=False)``; audio is read with ``audio_loader`` (default
    :func:`load_audio`), resampled to 16 kHz if needed, and turned into normalised log-mel
    features on the fly. Targets: the transcript, lower-cased (eSpeak would spell out
    all-capital words letter by letter), phonemised by :func:`espeak.phonemize` and tokenized
    with :func:`phonemes_to_ids`; they are memoised per process.

    Args:
        root: directory containing ``LibriSpeech/`` (see the layout in the error message).
        subsets: e.g. ``("train-clean-100",)``; several are concatenated.
        audio_loader: ``path -> (waveform float (samples,), sample_rate)``.
        on_unknown_phoneme: ``"drop"`` (default: skip, counted in ``dropped_phonemes``, warned
            once per process) or ``"error"``; eSpeak can emit a rare symbol outside the inventory
            for an odd word.

    Raises:
        LibriSpeechNotFoundError: a subset directory is missing or holds no FLAC files.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        subsets: Sequence[str] = ("train-clean-100",),
        audio_loader: Callable[[str], tuple[torch.Tensor, int]] | None = None,
        on_unknown_phoneme: str = "drop",
    ) -> None:
        from torchaudio.datasets import LIBRISPEECH

        self.root = Path(root).expanduser()
        self.subsets = tuple([subsets] if isinstance(subsets, str) else subsets)
        self.audio_loader = audio_loader or load_audio
        self.on_unknown_phoneme = on_unknown_phoneme
        self.files: list[Path] = []
        self.transcripts: list[str] = []
        lengths = []
        for subset in self.subsets:
            check_subset(self.root, subset)
            ds = LIBRISPEECH(os.fspath(self.root), url=subset, download=False)
            for n in range(len(ds)):
                rel_path, _, transcript, *_ = ds.get_metadata(n)
                path = self.root / "LibriSpeech" / rel_path
                num, sr = flac_info(path)
                self.files.append(path)
                self.transcripts.append(transcript)
                lengths.append(num_frames(round(num * SAMPLE_RATE / sr)))
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.dropped_phonemes = 0
        self._targets: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.files)

    def target_ids(self, i: int) -> torch.Tensor:
        """Phoneme ids ``int64 (S,)`` of utterance ``i``."""
        if i not in self._targets:
            ipa = espeak.phonemize(self.transcripts[i].lower())
            try:
                ids = phonemes_to_ids(ipa)
            except UnknownPhonemeError as exc:
                if self.on_unknown_phoneme == "error":
                    raise
                self.dropped_phonemes += len(exc.symbols)
                if self.dropped_phonemes == len(exc.symbols):  # first time in this process
                    warnings.warn(f"dropping phoneme symbols outside the inventory: {exc}", stacklevel=2)
                ids = phonemes_to_ids(ipa, on_unknown="drop")
            self._targets[i] = torch.tensor(ids, dtype=torch.int64)
        return self._targets[i]

    def waveform(self, i: int) -> torch.Tensor:
        """Float waveform ``(samples,)`` at 16 kHz of utterance ``i``."""
        wav, sr = self.audio_loader(os.fspath(self.files[i]))
        wav = wav.float().reshape(-1)
        if sr != SAMPLE_RATE:
            wav = torchaudio.functional.resample(wav, sr, SAMPLE_RATE)
        return wav

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": normalize_features(compute_log_mel(self.waveform(i))), "targets": self.target_ids(i)}
