"""Tests of the LibriSpeech loader of the speech data layer, on a tiny directory in LibriSpeech's
exact layout (eSpeak audio written as FLAC by a minimal writer). The rest of the speech data
layer: ``test_data_speech.py``."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torchaudio

from linformer_lab.data import espeak
from linformer_lab.data import phonemes as P
from linformer_lab.data import speech as S


def _crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def _utf8_number(n: int) -> bytes:
    # FLAC codes frame numbers like (extended) UTF-8 code points.
    if n < 0x80:
        return bytes([n])
    for length, first in ((2, 0xC0), (3, 0xE0), (4, 0xF0), (5, 0xF8), (6, 0xFC)):
        if n < 1 << (5 * length + 1):
            out = [0x80 | ((n >> (6 * k)) & 0x3F) for k in range(length - 1)][::-1]
            return bytes([first | (n >> (6 * (length - 1)))] + out)
    raise ValueError(n)


def write_flac_verbatim(path: Path, samples: np.ndarray, sample_rate: int = 16000, block: int = 4096) -> None:
    """Minimal valid FLAC writer: mono 16-bit, uncompressed (VERBATIM) subframes."""
    samples = np.asarray(samples, dtype=np.int16)
    n = len(samples)
    block = min(block, max(n, 16))
    info = struct.pack(">HH", block, block) + b"\0" * 6
    info += struct.pack(">Q", (sample_rate << 44) | (0 << 41) | (15 << 36) | n) + b"\0" * 16
    out = bytearray(b"fLaC" + bytes([0x80, 0, 0, len(info)]) + info)
    rate_code = 0b0101 if sample_rate == 16000 else 0
    for frame, start in enumerate(range(0, n, block)):
        chunk = samples[start : start + block]
        header = bytes([0xFF, 0xF8, (0b0111 << 4) | rate_code, 0b1000]) + _utf8_number(frame)
        header += struct.pack(">H", len(chunk) - 1)
        body = header + bytes([_crc8(header), 0x02]) + chunk.astype(">i2").tobytes()
        out += body + struct.pack(">H", _crc16(body))
    path.write_bytes(bytes(out))


def read_flac_verbatim(path: str) -> tuple[torch.Tensor, int]:
    """Decoder for what write_flac_verbatim writes (stands in for soundfile in these tests)."""
    data = Path(path).read_bytes()
    total, rate = S.flac_info(path)
    pos = 4 + 4 + 34
    samples = []
    while pos < len(data):
        pos += 4
        lead = data[pos]
        pos += 1 if lead < 0x80 else bin(lead).index("0", 2) - 2  # frame number length
        count = struct.unpack(">H", data[pos : pos + 2])[0] + 1
        pos += 2 + 1  # block size, CRC-8
        assert data[pos] == 0x02
        pos += 1
        samples.append(np.frombuffer(data[pos : pos + 2 * count], dtype=">i2"))
        pos += 2 * count + 2  # samples, CRC-16
    audio = np.concatenate(samples).astype(np.float32) / 32768.0
    assert len(audio) == total
    return torch.from_numpy(audio), rate


@pytest.fixture(scope="session")
def librispeech_root(tmp_path_factory) -> tuple[Path, dict]:
    """Tiny LibriSpeech-layout directory: 2 speakers x 1 chapter, eSpeak audio as FLAC."""
    root = tmp_path_factory.mktemp("librispeech")
    transcripts = {
        "19-198-0000": "THE BOY'S VOICE WAS QUIET AND PLEASANT",
        "19-198-0001": "SHE MEASURED THE GARDEN WITH A ROPE",
        "26-495-0000": "WHY DID THE KING HIDE HIS GOLDEN CROWN",
    }
    resampler = torchaudio.transforms.Resample(espeak.SAMPLE_RATE, 16000)
    for uid, text in transcripts.items():
        spk, chap, _ = uid.split("-")
        d = root / "LibriSpeech" / "dev-clean" / spk / chap
        d.mkdir(parents=True, exist_ok=True)
        audio = espeak.synthesize(text.lower(), voice="en-us+m2" if spk == "19" else "en-us+f4")
        audio16 = resampler(torch.from_numpy(audio.astype(np.float32))).round().clamp(-32768, 32767)
        write_flac_verbatim(d / f"{uid}.flac", audio16.numpy().astype(np.int16))
        with open(d / f"{spk}-{chap}.trans.txt", "a") as f:
            f.write(f"{uid} {text}\n")
    return root, transcripts


def test_librispeech_loader_on_exact_layout(librispeech_root):
    root, transcripts = librispeech_root
    ds = S.LibriSpeechCorpus(root, ("dev-clean",), audio_loader=read_flac_verbatim)
    assert len(ds) == 3
    assert sorted(p.stem for p in ds.files) == sorted(transcripts)
    for i in range(len(ds)):
        uid = ds.files[i].stem
        wav, sr = read_flac_verbatim(str(ds.files[i]))
        assert sr == 16000 and S.flac_info(ds.files[i]) == (len(wav), 16000)
        item = ds[i]
        assert item["features"].shape == (ds.lengths[i], 40) == (len(wav) // 160 + 1, 40)
        assert torch.isfinite(item["features"]).all()
        expected = P.phonemes_to_ids(espeak.phonemize(transcripts[uid].lower()))
        assert item["targets"].tolist() == expected
    batch = S.collate_speech([ds[0], ds[1]])
    assert batch["features"].shape[0] == 2 and batch["targets"].dtype == torch.int64


def test_flac_reading_backend(librispeech_root):
    """The default reader decodes FLAC when a backend exists, else names the missing package."""
    root, _ = librispeech_root
    path = next((root / "LibriSpeech" / "dev-clean").glob("*/*/*.flac"))
    try:
        import soundfile  # noqa: F401
    except ImportError:
        soundfile = None
    if soundfile is None:
        try:
            S.load_audio(path)
        except S.AudioBackendError as exc:
            assert "soundfile" in str(exc)
            return
        # torchaudio/torchcodec can decode here: fall through and check the result.
    wav, sr = S.load_audio(path)
    ref, _ = read_flac_verbatim(str(path))
    assert sr == 16000 and torch.allclose(wav, ref, atol=1e-4)


def test_librispeech_missing_directory_error(tmp_path):
    with pytest.raises(S.LibriSpeechNotFoundError) as err:
        S.LibriSpeechCorpus(tmp_path / "nowhere", ("train-clean-100",))
    assert isinstance(err.value, FileNotFoundError)
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "LibriSpeech" / "train-clean-100") in message
    assert "<speaker>-<chapter>-<utterance>.flac" in message and ".trans.txt" in message
    dm = S.SpeechDataModule(corpus="librispeech", root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError):
        dm.prepare_data()
