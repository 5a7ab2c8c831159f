"""Speech data for CTC phoneme recognition (paper section 4.3): corpora, features, batching.

Two corpora share one item format and one phoneme inventory (:mod:`linformer_lab.data.phonemes`):

* :class:`SyntheticSpeechCorpus` (:mod:`.synthetic`) -- English sentences from a small grammar
  (:class:`SentenceGenerator`, :mod:`.grammar`) spoken by eSpeak NG voices
  (:mod:`linformer_lab.data.espeak`), generated once per configuration into a cache directory,
  with speakers (voice variants) disjoint across train/val/test.
* :class:`LibriSpeechCorpus` (:mod:`.librispeech`) -- a local LibriSpeech copy, its transcripts
  phonemised by the same eSpeak.

:class:`SpeechDataModule` (:mod:`.datamodule`) wraps either in a LightningDataModule whose
batches are dicts (:func:`collate_speech` over :class:`LengthBucketBatchSampler`'s batches,
:mod:`.batching`): ``features float32 (B, T, 40)``, ``feature_lengths int64 (B,)``,
``targets int64 (B, S)`` (phoneme ids, 0 = CTC blank = padding), ``target_lengths int64 (B,)``.

Features (:mod:`.features`)
---------------------------
40 log-mel filterbank energies (no deltas), as the paper's WSJ setup: 16 kHz audio in [-1, 1),
25 ms Hann window (400 samples, 512-point FFT), 10 ms hop (160 samples), power spectrum,
40 triangular HTK mel filters on 0-8 kHz, ``log(max(mel, 1e-6))``, framed with centering, so an
utterance of ``n`` samples has ``n // 160 + 1`` frames. The floor sits ~50 dB under the median
speech band energy of eSpeak audio; it is what digital silence of clean synthetic audio maps to.

Normalisation is **per utterance** (mean and variance of each mel channel over its frames,
applied when an item is read): it needs no corpus statistics, so it behaves the same on the
synthetic corpus, with or without noise, and on a LibriSpeech subset never scanned in full, and
it removes the large level differences between eSpeak variants.

The synthetic corpus keeps its int16 audio (the "download": noise level and feature settings can
change without re-synthesis) and derives from it on first use a cache of fp16 log-mel features
per noise setting (``features/<key>/``, written atomically like the corpus) that training reads,
4x smaller than the audio (40 fp16 values per hop of 160 int16 samples) and several times
faster to read than computing features on the fly. ``cache_features=False`` computes them on
the fly instead, as the LibriSpeech loader always does.
"""

from linformer_lab.data.speech.batching import LengthBucketBatchSampler, collate_speech
from linformer_lab.data.speech.datamodule import SpeechDataModule
from linformer_lab.data.speech.features import SAMPLE_RATE
from linformer_lab.data.speech.grammar import SentenceGenerator
from linformer_lab.data.speech.librispeech import (
    AudioBackendError,
    LibriSpeechCorpus,
    LibriSpeechNotFoundError,
    flac_info,
    load_audio,
)
from linformer_lab.data.speech.synthetic import SyntheticSpeechCorpus

__all__ = [
    "SAMPLE_RATE",
    "AudioBackendError",
    "LengthBucketBatchSampler",
    "LibriSpeechCorpus",
    "LibriSpeechNotFoundError",
    "SentenceGenerator",
    "SpeechDataModule",
    "SyntheticSpeechCorpus",
    "collate_speech",
    "flac_info",
    "load_audio",
]
