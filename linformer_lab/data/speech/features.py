"""Audio -> 40 log-mel filterbank energies (see the package docstring for the settings)."""

from __future__ import annotations

import functools
import hashlib

import torch
import torchaudio

SAMPLE_RATE = 16000  # Hz, for every corpus
FEATURE_DIM = 40  # mel bands
WIN_LENGTH = 400  # a 25 ms window
HOP_LENGTH = 160  # a 10 ms hop
N_FFT = 512
LOG_FLOOR = 1e-6


def num_frames(num_samples: int) -> int:
    """Frames of the log-mel features of ``num_samples`` 16 kHz samples (centred 10 ms hop)."""
    return int(num_samples) // HOP_LENGTH + 1


@functools.cache
def _mel_spectrogram() -> torchaudio.transforms.MelSpectrogram:
    # Built once per process (the mel filter bank). It holds only CPU buffers and starts no
    # threads, so the copy a forked DataLoader worker inherits is safe to use there.
    return torchaudio.transforms.MelSpectrogram(
        sample_rate=SAMPLE_RATE,
        n_fft=N_FFT,
        win_length=WIN_LENGTH,
        hop_length=HOP_LENGTH,
        f_min=0.0,
        f_max=SAMPLE_RATE / 2,
        n_mels=FEATURE_DIM,
        power=2.0,
        center=True,
        mel_scale="htk",
    )


def compute_log_mel(waveform: torch.Tensor) -> torch.Tensor:
    """40-dim log-mel filterbank energies (settings: the package docstring), without autograd.

    Args:
        waveform: ``(samples,)`` or ``(batch, samples)``, float in [-1, 1), 16 kHz.

    Returns:
        ``(frames, 40)`` or ``(batch, frames, 40)`` float32 log energies (not normalised),
        ``frames = samples // 160 + 1``.
    """
    with torch.no_grad():
        spec = _mel_spectrogram()(waveform.float())  # (..., 40, frames)
        return torch.log(spec.clamp_min(LOG_FLOOR)).transpose(-1, -2).contiguous()


def normalize_features(features: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Per-utterance, per-channel mean/variance normalisation of ``(frames, 40)`` features."""
    mean = features.mean(dim=0, keepdim=True)
    std = features.std(dim=0, keepdim=True, unbiased=False)
    return (features - mean) / (std + eps)


def add_noise(waveform: torch.Tensor, snr_db: float, generator: torch.Generator) -> torch.Tensor:
    """Add white Gaussian noise at a given signal-to-noise ratio.

    Args:
        waveform: ``(samples,)`` float.
        snr_db: ``10 log10(P_signal / P_noise)`` with powers averaged over the whole utterance.
        generator: seeded torch generator (the noise is a function of its seed).
    """
    signal_power = waveform.pow(2).mean().clamp_min(1e-12)
    noise_power = signal_power / (10.0 ** (snr_db / 10.0))
    noise = torch.randn(waveform.shape, generator=generator, dtype=torch.float32)
    return waveform + noise * noise_power.sqrt()


def stable_seed(*parts) -> int:
    # Python's hash() is salted per process; a digest gives the same seed in every process.
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
