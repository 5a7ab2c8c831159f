"""Speech data for CTC phoneme recognition (paper section 4.3): corpora, features, batching.

Two corpora share one item format and one phoneme inventory (:mod:`.phonemes`):

* :class:`SyntheticSpeechCorpus` -- English sentences from a small grammar (:class:`SentenceGenerator`)
  spoken by eSpeak NG voices (:mod:`.espeak`), generated once per configuration into a cache
  directory and reused, with speakers (voice variants) disjoint across train/val/test.
* :class:`LibriSpeechCorpus` -- a local LibriSpeech copy; phoneme targets from the same eSpeak
  phonemizer applied to the transcripts.

:class:`SpeechDataModule` wraps either in a LightningDataModule whose batches follow
``docs/CONTRACTS.md``: ``features float32 (B, T, 40)``, ``feature_lengths int64 (B,)``,
``targets int64 (B, S)`` (phoneme ids, 0 = CTC blank = padding), ``target_lengths int64 (B,)``.

Features
--------
40 log-mel filterbank energies (no deltas), as the paper's WSJ setup: 16 kHz audio in [-1, 1),
25 ms Hann window (400 samples, 512-point FFT), 10 ms hop (160 samples), power spectrum,
40 triangular HTK mel filters on 0-8 kHz, ``log(max(mel, 1e-6))``, framed with centering, so an
utterance of ``n`` samples has ``n // 160 + 1`` frames. The floor sits ~50 dB under the median
speech band energy (measured on eSpeak audio: median mel power 9e-2, 99th percentile 1.6e2); it
is what digital silence of clean synthetic audio maps to.

Normalisation is **per utterance** (mean and variance of each mel channel over the frames of
the utterance, applied when an item is read). It needs no corpus statistics, so it behaves the
same on the synthetic corpus, with or without noise, and on a LibriSpeech subset that was never
scanned in full; it also removes the large level differences between eSpeak variants.

Cached vs on-the-fly features, measured on this project's 2-core CPU machine (shared, load
average ~7 during the runs; 1 torch thread), one training epoch of the default 3 h corpus
(2088 utterances, 2.4 h) through a DataLoader with batches of 16:

* on the fly (resident int16 audio -> log-mel -> normalise): 8.5 s per epoch, 4.1 ms per
  utterance, 0.98 ms per second of audio;
* cached fp16 log-mel (memory-mapped -> float32 -> normalise): 1.0 s per epoch, 0.49 ms per
  utterance, 0.12 ms per second of audio.

Cached features are also 4x smaller than the audio they come from (40 x 100 fp16 values =
8 kB per second, against 32 kB of int16 at 16 kHz). The synthetic corpus therefore keeps the
int16 audio (the "download": noise level and feature settings can change without
re-synthesis) and derives a feature cache per noise setting from it on first use
(``features/<key>/``, written atomically like the corpus; 14 s for 3 h of audio), from which
training reads. ``cache_features=False`` computes features on the fly instead, as the
LibriSpeech loader always does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import struct
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torchaudio
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from linformer_lab.data import espeak
from linformer_lab.data.phonemes import NUM_PHONEMES, PHONEMES, UnknownPhonemeError, phonemes_to_ids

__all__ = [
    "FEATURE_DIM",
    "HOP_LENGTH",
    "SAMPLE_RATE",
    "AudioBackendError",
    "LengthBucketBatchSampler",
    "LibriSpeechCorpus",
    "LibriSpeechNotFoundError",
    "LogMelFilterbank",
    "SentenceGenerator",
    "SpeechDataModule",
    "SyntheticSpeechCorpus",
    "SyntheticSpeechDataset",
    "VOCABULARY",
    "add_noise",
    "collate_speech",
    "flac_info",
    "load_audio",
    "normalize_features",
    "num_frames",
    "padding_fraction",
]

SAMPLE_RATE = 16000  # Hz, for every corpus
FEATURE_DIM = 40  # mel bands
WIN_LENGTH = 400  # 25 ms
HOP_LENGTH = 160  # 10 ms
N_FFT = 512
LOG_FLOOR = 1e-6

DEFAULT_CACHE = Path("~/.cache/linformer_lab")

# ================================================================================================
# Sentence grammar
# ================================================================================================
#
# A small hand-written grammar: thousands of templates x word choices give ~1e12 distinct,
# grammatical sentences. The word lists deliberately cover every English phoneme eSpeak uses
# (e.g. "measure"/"garage" for ʒ, "boy"/"voice" for ɔɪ, "button"/"kitten" for ʔ n̩, "book" for ʊ).

_NAMES = (
    "Anna", "Ben", "Carlos", "Diana", "Edward", "Fiona", "George", "Hannah", "Isaac", "Julia",
    "Kevin", "Laura", "Martin", "Nora", "Oliver", "Paula", "Quentin", "Rachel", "Samuel", "Teresa",
    "Victor", "Wendy", "Zachary", "Joseph", "Charlotte", "Thomas", "Sophia", "William", "Judith",
    "Arthur", "Helen", "Frederick", "Margaret", "Timothy", "Vivian", "Roger", "Sheila", "Walter",
    "Yvonne", "Matthew", "Joyce", "Hugh", "Ruth", "Jerome", "Beatrice",
)  # fmt: skip
# (singular, plural)
_NOUNS = (
    ("dog", "dogs"), ("cat", "cats"), ("horse", "horses"), ("bird", "birds"), ("fish", "fish"),
    ("child", "children"), ("woman", "women"), ("man", "men"), ("person", "people"),
    ("teacher", "teachers"), ("doctor", "doctors"), ("farmer", "farmers"), ("soldier", "soldiers"),
    ("lawyer", "lawyers"), ("player", "players"), ("driver", "drivers"), ("singer", "singers"),
    ("judge", "judges"), ("king", "kings"), ("queen", "queens"), ("boy", "boys"), ("girl", "girls"),
    ("neighbor", "neighbors"), ("stranger", "strangers"), ("engineer", "engineers"),
    ("book", "books"), ("letter", "letters"), ("table", "tables"), ("chair", "chairs"),
    ("window", "windows"), ("door", "doors"), ("bottle", "bottles"), ("button", "buttons"),
    ("kitten", "kittens"), ("garden", "gardens"), ("mountain", "mountains"), ("river", "rivers"),
    ("bridge", "bridges"), ("village", "villages"), ("church", "churches"), ("castle", "castles"),
    ("garage", "garages"), ("treasure", "treasures"), ("measure", "measures"),
    ("television", "televisions"), ("voice", "voices"), ("toy", "toys"), ("coin", "coins"),
    ("picture", "pictures"), ("question", "questions"), ("answer", "answers"), ("story", "stories"),
    ("song", "songs"), ("ring", "rings"), ("box", "boxes"), ("watch", "watches"),
    ("knife", "knives"), ("leaf", "leaves"), ("wolf", "wolves"), ("mouse", "mice"),
    ("foot", "feet"), ("tooth", "teeth"), ("sheep", "sheep"), ("jacket", "jackets"),
    ("orange", "oranges"), ("cheese", "cheeses"), ("sandwich", "sandwiches"), ("cake", "cakes"),
    ("apple", "apples"), ("potato", "potatoes"), ("tomato", "tomatoes"), ("engine", "engines"),
    ("computer", "computers"), ("telephone", "telephones"), ("machine", "machines"),
    ("key", "keys"), ("map", "maps"), ("boat", "boats"), ("train", "trains"), ("car", "cars"),
    ("truck", "trucks"), ("plane", "planes"), ("bicycle", "bicycles"), ("hat", "hats"),
    ("shoe", "shoes"), ("glove", "gloves"), ("feather", "feathers"), ("stone", "stones"),
    ("flower", "flowers"), ("tree", "trees"), ("forest", "forests"), ("island", "islands"),
    ("ocean", "oceans"), ("cloud", "clouds"), ("star", "stars"), ("moon", "moons"),
    ("hour", "hours"), ("year", "years"), ("idea", "ideas"), ("theory", "theories"),
    ("museum", "museums"), ("problem", "problems"), ("message", "messages"), ("package", "packages"),
    ("curtain", "curtains"), ("pillow", "pillows"), ("blanket", "blankets"), ("wheel", "wheels"),
    ("hammer", "hammers"), ("ladder", "ladders"), ("basket", "baskets"), ("candle", "candles"),
    ("mirror", "mirrors"), ("photograph", "photographs"), ("umbrella", "umbrellas"),
    ("newspaper", "newspapers"), ("pencil", "pencils"), ("envelope", "envelopes"),
)  # fmt: skip
_ADJECTIVES = (
    "big", "small", "old", "young", "new", "red", "blue", "green", "yellow", "purple", "orange",
    "brown", "white", "black", "heavy", "light", "quiet", "loud", "happy", "sad", "angry",
    "tired", "hungry", "curious", "careful", "clever", "strange", "famous", "beautiful", "ugly",
    "wooden", "golden", "silver", "broken", "empty", "dirty", "clean", "warm", "cold", "wet",
    "dry", "soft", "hard", "smooth", "rough", "sharp", "bright", "dark", "enormous", "tiny",
    "ancient", "modern", "usual", "unusual", "pleasant", "nervous", "royal", "noisy", "thirsty",
    "lazy", "busy", "friendly", "gentle", "proud", "honest", "foolish", "expensive", "cheap",
    "delicious", "bitter", "sweet", "fresh", "rotten", "shiny", "narrow", "wide", "thick", "thin",
)  # fmt: skip
# (base, past) transitive verbs
_VERBS_T = (
    ("see", "saw"), ("find", "found"), ("take", "took"), ("bring", "brought"), ("buy", "bought"),
    ("sell", "sold"), ("give", "gave"), ("hold", "held"), ("carry", "carried"), ("push", "pushed"),
    ("pull", "pulled"), ("open", "opened"), ("close", "closed"), ("break", "broke"),
    ("fix", "fixed"), ("paint", "painted"), ("wash", "washed"), ("cook", "cooked"),
    ("eat", "ate"), ("drink", "drank"), ("throw", "threw"), ("catch", "caught"),
    ("watch", "watched"), ("follow", "followed"), ("chase", "chased"), ("visit", "visited"),
    ("measure", "measured"), ("enjoy", "enjoyed"), ("avoid", "avoided"), ("choose", "chose"),
    ("borrow", "borrowed"), ("lend", "lent"), ("hide", "hid"), ("steal", "stole"),
    ("forget", "forgot"), ("remember", "remembered"), ("describe", "described"),
    ("deliver", "delivered"), ("hear", "heard"), ("notice", "noticed"), ("touch", "touched"),
    ("climb", "climbed"), ("draw", "drew"), ("pack", "packed"), ("lift", "lifted"),
    ("drop", "dropped"), ("keep", "kept"), ("leave", "left"), ("love", "loved"), ("hate", "hated"),
    ("admire", "admired"), ("ignore", "ignored"), ("judge", "judged"), ("explore", "explored"),
    ("examine", "examined"), ("study", "studied"), ("photograph", "photographed"),
)  # fmt: skip
# (base, past) intransitive verbs
_VERBS_I = (
    ("sleep", "slept"), ("run", "ran"), ("walk", "walked"), ("sing", "sang"), ("dance", "danced"),
    ("laugh", "laughed"), ("cry", "cried"), ("shout", "shouted"), ("whisper", "whispered"),
    ("wait", "waited"), ("arrive", "arrived"), ("leave", "left"), ("swim", "swam"),
    ("fly", "flew"), ("travel", "traveled"), ("work", "worked"), ("rest", "rested"),
    ("smile", "smiled"), ("listen", "listened"), ("disappear", "disappeared"), ("return", "returned"),
    ("hurry", "hurried"), ("worry", "worried"), ("complain", "complained"), ("agree", "agreed"),
    ("argue", "argued"), ("fall", "fell"), ("sit", "sat"), ("stand", "stood"), ("wander", "wandered"),
)  # fmt: skip
_ADVERBS = (
    "quickly", "slowly", "quietly", "loudly", "carefully", "happily", "sadly", "suddenly",
    "gently", "eagerly", "usually", "rarely", "often", "again", "together", "alone", "early",
    "late", "yesterday", "today", "badly", "easily", "proudly", "nervously", "honestly",
)  # fmt: skip
_PREPOSITIONS = (
    "in", "on", "under", "behind", "near", "beside", "above", "below", "inside", "outside",
    "across", "through", "toward", "around", "beyond", "without", "with", "along",
)  # fmt: skip
_DETERMINERS = ("the", "a", "this", "that", "every", "my", "your", "our", "their", "his", "her")
_PLURAL_DETERMINERS = ("the", "some", "these", "those", "many", "few", "all the", "our", "their")
_TIMES = (
    "on monday", "on tuesday", "on wednesday", "on thursday", "on friday", "on saturday",
    "on sunday", "last night", "last week", "this morning", "in the evening", "at noon",
    "before breakfast", "after dinner", "in january", "in june", "in september", "every day",
    "at midnight", "in the afternoon",
)  # fmt: skip
_NUMBERS = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "a hundred", "a thousand",
)  # fmt: skip
_MODALS = ("will", "can", "should", "might", "must", "could", "would")
_DEGREE = ("very", "quite", "rather", "really", "extremely", "somewhat", "too")
_CONJUNCTIONS = ("and", "but", "because", "while", "so", "although", "when", "after", "before", "until")
_COPULA_VERBS = ("was", "seemed", "looked", "became", "felt")
_SAY_VERBS = ("said", "thought", "believed", "explained", "noticed", "decided")
_FUNCTION_WORDS = ("did", "not", "why", "where", "how", "is", "were", "never", "already", "there")


def _vocabulary() -> frozenset[str]:
    words: set[str] = set()
    groups: list[Sequence[str]] = [
        _NAMES, _ADJECTIVES, _ADVERBS, _PREPOSITIONS, _DETERMINERS, _PLURAL_DETERMINERS, _TIMES,
        _NUMBERS, _MODALS, _DEGREE, _CONJUNCTIONS, _COPULA_VERBS, _SAY_VERBS, _FUNCTION_WORDS,
        [w for pair in _NOUNS for w in pair], [w for pair in _VERBS_T for w in pair],
        [w for pair in _VERBS_I for w in pair], ("an", "that", "so"),
    ]  # fmt: skip
    for group in groups:
        for phrase in group:
            words.update(phrase.split())
    return frozenset(words)


#: Every word the grammar can produce (names capitalised, everything else lower case).
VOCABULARY: frozenset[str] = _vocabulary()


class SentenceGenerator:
    """Deterministic stream of distinct English sentences from a small grammar.

    Args:
        seed: RNG seed; the same seed always yields the same sentence sequence.
        max_clauses: sentences join 1..max_clauses clauses with conjunctions.
        clause_weights: relative probability of 1, 2, ... clauses (default favours 1-2,
            giving ~11 words and ~4 s of speech per sentence on average at 175 words/min).

    Iterating yields sentences such as ``"The tired farmer carried a golden basket across the
    bridge, because anna never whispered."``; each sentence appears at most once per generator
    (``exclude`` in :meth:`take` additionally skips sentences used elsewhere).
    """

    GRAMMAR_VERSION = 1  # bump when word lists/templates change: part of the corpus cache key

    def __init__(self, seed: int = 0, max_clauses: int = 3, clause_weights: Sequence[float] = (0.45, 0.4, 0.15)):
        self.rng = random.Random(f"sentences:{seed}")
        self.max_clauses = max_clauses
        self.clause_weights = list(clause_weights)[:max_clauses]
        self.seen: set[str] = set()
        self._returned: list[str] = []  # sentences handed back with give_back(), served first

    # --- phrase builders ------------------------------------------------------------------------
    def _noun_phrase(self, plural: bool = False) -> str:
        r = self.rng
        singular, plural_form = r.choice(_NOUNS)
        adj = f"{r.choice(_ADJECTIVES)} " if r.random() < 0.6 else ""
        if plural:
            return f"{r.choice(_PLURAL_DETERMINERS)} {adj}{plural_form}"
        det = r.choice(_DETERMINERS)
        if det == "a" and (adj or singular)[0] in "aeiou":
            det = "an"  # eSpeak reads "an" and "a" differently; keep the text grammatical
        return f"{det} {adj}{singular}"

    def _subject(self) -> tuple[str, bool]:
        r = self.rng
        x = r.random()
        if x < 0.3:
            return r.choice(_NAMES), False
        if x < 0.8:
            return self._noun_phrase(), False
        return self._noun_phrase(plural=True), True

    def _object(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.15:
            return r.choice(_NAMES)
        if x < 0.3:
            return f"{r.choice(_NUMBERS)} {r.choice(_ADJECTIVES) + ' ' if r.random() < 0.4 else ''}{r.choice(_NOUNS)[1]}"
        return self._noun_phrase(plural=r.random() < 0.2)

    def _tail(self) -> str:
        r = self.rng
        parts = []
        if r.random() < 0.45:
            parts.append(f"{r.choice(_PREPOSITIONS)} {self._noun_phrase(plural=r.random() < 0.2)}")
        if r.random() < 0.25:
            parts.append(r.choice(_ADVERBS))
        if r.random() < 0.2:
            parts.append(r.choice(_TIMES))
        return (" " + " ".join(parts)) if parts else ""

    def _clause(self) -> str:
        r = self.rng
        subject, plural = self._subject()
        kind = r.random()
        if kind < 0.4:  # subject + transitive verb + object
            return f"{subject} {r.choice(_VERBS_T)[1]} {self._object()}{self._tail()}"
        if kind < 0.6:  # subject + intransitive verb
            return f"{subject} {r.choice(_VERBS_I)[1]}{self._tail()}"
        if kind < 0.72:  # modal
            neg = " not" if r.random() < 0.2 else ""
            return f"{subject} {r.choice(_MODALS)}{neg} {r.choice(_VERBS_T)[0]} {self._object()}{self._tail()}"
        if kind < 0.84:  # copula + adjective
            verb = r.choice(_COPULA_VERBS)
            if verb == "was" and plural:
                verb = "were"
            degree = f"{r.choice(_DEGREE)} " if r.random() < 0.5 else ""
            return f"{subject} {verb} {degree}{r.choice(_ADJECTIVES)}{self._tail()}"
        if kind < 0.92:  # reported speech
            return f"{r.choice(_NAMES)} {r.choice(_SAY_VERBS)} that {subject} {r.choice(_VERBS_T)[1]} {self._object()}"
        return f"{subject} {r.choice(('never', 'already'))} {r.choice(_VERBS_T)[1]} {self._object()}{self._tail()}"

    def _question(self) -> str:
        r = self.rng
        subject, _ = self._subject()
        kind = r.random()
        if kind < 0.5:
            return f"did {subject} {r.choice(_VERBS_T)[0]} {self._object()}{self._tail()}"
        if kind < 0.75:
            return f"{r.choice(('why', 'where', 'how'))} did {subject} {r.choice(_VERBS_I)[0]}{self._tail()}"
        return f"why is {self._noun_phrase()} so {r.choice(_ADJECTIVES)}"

    def sentence(self) -> str:
        """One sentence (may repeat; :meth:`__iter__` removes repeats)."""
        r = self.rng
        if r.random() < 0.12:
            text, end = self._question(), "?"
        else:
            n = r.choices(range(1, len(self.clause_weights) + 1), weights=self.clause_weights)[0]
            text = self._clause()
            for _ in range(n - 1):
                text += f", {r.choice(_CONJUNCTIONS)} {self._clause()}"
            end = "."
        return text[0].upper() + text[1:] + end

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        """The next sentence never returned before (the stream is infinite)."""
        if self._returned:
            return self._returned.pop(0)
        while True:
            s = self.sentence()
            if s not in self.seen:
                self.seen.add(s)
                return s

    def give_back(self, sentences: Sequence[str]) -> None:
        """Return drawn but unused sentences; they are served again, in order, before new ones."""
        self._returned[:0] = list(sentences)

    def take(self, n: int) -> list[str]:
        """The next ``n`` distinct sentences."""
        return [next(self) for _ in range(n)]


# ================================================================================================
# Features
# ================================================================================================


def num_frames(num_samples: int) -> int:
    """Frames of the log-mel features of ``num_samples`` 16 kHz samples (centred 10 ms hop)."""
    return int(num_samples) // HOP_LENGTH + 1


class LogMelFilterbank(torch.nn.Module):
    """40-dim log-mel filterbank energies (see the module docstring for every setting).

    Input: waveform ``(samples,)`` or ``(batch, samples)``, float in [-1, 1), 16 kHz.
    Output: ``(frames, 40)`` or ``(batch, frames, 40)`` float32 log energies (not normalised),
    ``frames = samples // 160 + 1``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(
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

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        spec = self.mel(waveform.float())  # (..., 40, frames)
        return torch.log(spec.clamp_min(LOG_FLOOR)).transpose(-1, -2).contiguous()


def normalize_features(features: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Per-utterance, per-channel mean/variance normalisation of ``(frames, 40)`` features."""
    mean = features.mean(dim=0, keepdim=True)
    std = features.std(dim=0, keepdim=True, unbiased=False)
    return (features - mean) / (std + eps)


_extractors: dict[int, LogMelFilterbank] = {}


def _extractor() -> LogMelFilterbank:
    # One module per process (the mel filter bank is built once); keyed by pid so a forked
    # DataLoader worker does not share the parent's instance in unexpected ways.
    pid = os.getpid()
    if pid not in _extractors:
        _extractors[pid] = LogMelFilterbank()
    return _extractors[pid]


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


def _stable_seed(*parts) -> int:
    # Python's hash() is salted per process; a digest gives the same seed in every process.
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


# ================================================================================================
# Batching
# ================================================================================================


def collate_speech(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Pad a list of items ``{"features": (T_i, 40) float, "targets": (S_i,) int64}``.

    Returns the CONTRACTS.md speech batch: ``features (B, T, 40)`` zero-padded,
    ``feature_lengths (B,)``, ``targets (B, S)`` padded with 0 (= blank), ``target_lengths (B,)``.
    """
    feats = [it["features"] for it in items]
    targs = [it["targets"] for it in items]
    feature_lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    target_lengths = torch.tensor([t.shape[0] for t in targs], dtype=torch.int64)
    features = torch.zeros(len(items), int(feature_lengths.max()), feats[0].shape[1], dtype=torch.float32)
    targets = torch.zeros(len(items), max(int(target_lengths.max()), 1), dtype=torch.int64)
    for i, (f, t) in enumerate(zip(feats, targs)):
        features[i, : f.shape[0]] = f
        targets[i, : t.shape[0]] = t
    return {
        "features": features,
        "feature_lengths": feature_lengths,
        "targets": targets,
        "target_lengths": target_lengths,
    }


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Fraction of padded frames: ``1 - sum(lengths) / sum(len(batch) * max length in batch)``."""
    lengths = np.asarray(lengths)
    real = padded = 0
    for b in batches:
        lb = lengths[np.asarray(b)]
        real += int(lb.sum())
        padded += int(lb.max()) * len(b)
    return 1.0 - real / max(padded, 1)


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length, so padding stays small, with seeded per-epoch shuffling.

    Training (``shuffle=True``): each epoch permutes all indices with ``(seed, epoch)``, cuts the
    permutation into pools of about ``pool_batches`` batches, sorts each pool by length, cuts it
    into batches and finally shuffles the order of all batches. Large pools give batches of
    near-equal lengths; pooling (rather than one global sort) keeps batch composition random
    across epochs. Evaluation (``shuffle=False``): one global sort, deterministic.

    Args:
        lengths: length of every item (frames), the padded dimension.
        batch_size: items per batch (the last batch of a pool may be smaller). With
            ``max_frames_per_batch`` it becomes an upper bound (``None`` = no bound).
        max_frames_per_batch: bound on ``items x longest item`` (the padded size) of a batch;
            an item longer than the bound forms a batch on its own.
        shuffle: see above. ``seed`` and the epoch choose the order; the epoch starts at 0 and
            advances after every full iteration, or is set with :meth:`set_epoch`.
        pool_batches: pool size in batches.
        drop_last: drop batches smaller than ``batch_size`` (fixed-size mode only).
        num_replicas, rank: distributed training: every replica gets the same number of batches
            (the list is padded by repeating batches) and takes ``batches[rank::num_replicas]``.

    Every index appears exactly once per epoch (single replica, ``drop_last=False``).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int | None = 16,
        max_frames_per_batch: int | None = None,
        shuffle: bool = True,
        pool_batches: int = 50,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_size is None and max_frames_per_batch is None:
            raise ValueError("give batch_size, max_frames_per_batch or both")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if isinstance(lengths, Sampler):
            # What Lightning passes when it tries to inject a DistributedSampler under DDP.
            raise TypeError(
                "LengthBucketBatchSampler needs the per-item lengths, not a sampler; for multi-process "
                "training use Trainer(use_distributed_sampler=False) -- SpeechDataModule shards the "
                "batches across ranks itself (num_replicas/rank)"
            )
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.max_frames = max_frames_per_batch
        self.shuffle = shuffle
        self.pool_batches = pool_batches
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields."""
        self.epoch = int(epoch)

    def _split(self, idx: np.ndarray) -> list[list[int]]:
        # `idx` is sorted by length (descending): consecutive items have similar lengths.
        if self.max_frames is None:
            bs = self.batch_size
            return [idx[i : i + bs].tolist() for i in range(0, len(idx), bs)]
        batches, cur, longest = [], [], 0
        for i in idx.tolist():
            new_longest = max(longest, int(self.lengths[i]))
            full = self.batch_size is not None and len(cur) >= self.batch_size
            if cur and (full or new_longest * (len(cur) + 1) > self.max_frames):
                batches.append(cur)
                cur, new_longest = [], int(self.lengths[i])
            cur.append(i)
            longest = new_longest
        if cur:
            batches.append(cur)
        return batches

    def _pool_size(self) -> int:
        if self.max_frames is None:
            per_batch = self.batch_size
        else:
            mean = max(float(self.lengths.mean()) if len(self.lengths) else 1.0, 1.0)
            per_batch = max(1, int(self.max_frames // mean))
            if self.batch_size is not None:
                per_batch = min(per_batch, self.batch_size)
        return max(1, per_batch * self.pool_batches)

    def batches(self) -> list[list[int]]:
        """This epoch's batches for this replica (what iteration yields)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        n = len(self.lengths)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            order = rng.permutation(n)
            pools = [order[i : i + self._pool_size()] for i in range(0, n, self._pool_size())]
        else:
            rng = None
            pools = [np.arange(n)]
        batches: list[list[int]] = []
        for pool in pools:
            # Stable sort on the negated length: longest first, ties keep the (random) pool order.
            ordered = pool[np.argsort(-self.lengths[pool], kind="stable")]
            batches.extend(self._split(ordered))
        if self.drop_last and self.max_frames is None:
            batches = [b for b in batches if len(b) == self.batch_size]
        if rng is not None:
            perm = rng.permutation(len(batches))
            batches = [batches[i] for i in perm]
        if self.num_replicas > 1 and batches:
            per_replica = -(-len(batches) // self.num_replicas)
            batches = (batches * self.num_replicas)[: per_replica * self.num_replicas]
            batches = batches[self.rank :: self.num_replicas]
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        # Lightning calls set_epoch only on a DataLoader's *sampler*, never on its batch sampler,
        # so the sampler advances its epoch itself after each pass (set_epoch still overrides).
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return len(self.batches())


# ================================================================================================
# Synthetic corpus
# ================================================================================================

_SPLITS = ("train", "val", "test")
_META = "meta.json"


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
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        self.path = Path(path)
        self.split = split
        self.noise_snr_db = noise_snr_db
        self.cache_features = cache_features
        with open(self.path / _META) as f:
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
            self.feature_dir = _ensure_feature_cache(self.path, noise_snr_db, progress=progress)
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
            gen = torch.Generator().manual_seed(_stable_seed("noise", self.meta["seed"], self.split, i))
            wav = add_noise(wav, self.noise_snr_db, gen)
        return wav

    def log_mel(self, i: int) -> torch.Tensor:
        """Un-normalised log-mel features ``(frames, 40)`` float32 of item ``i``."""
        if self._frame_offsets is not None:
            if self._feats is None:
                self._feats = np.load(self.feature_dir / f"{self.split}.feats.npy", mmap_mode="r")
            a, b = self._frame_offsets[i], self._frame_offsets[i + 1]
            return torch.from_numpy(np.asarray(self._feats[a:b], dtype=np.float32))
        with torch.no_grad():
            return _extractor()(self.waveform(i))

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


def _feature_key(noise_snr_db: float | None) -> str:
    noise = "clean" if noise_snr_db is None else f"snr{float(noise_snr_db):g}"
    return f"logmel{FEATURE_DIM}-v1-{noise}"


def _ensure_feature_cache(corpus: Path, noise_snr_db: float | None, progress: bool = True) -> Path:
    """Build ``corpus/features/<key>/`` (fp16 log-mel of every split) once, atomically."""
    final = corpus / "features" / _feature_key(noise_snr_db)
    if (final / "done").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent, final.name)
    tmp = final.parent / _tmp_name(final.name)
    tmp.mkdir()
    # One intra-op thread: utterance-sized STFTs gain nothing from more, and on a loaded 2-core
    # machine two OpenMP threads were measured up to 20x slower (spin-waiting on each other).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for split in _SPLITS:
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
        _commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return final


def _tmp_name(name: str) -> str:
    # Host and pid in the name let a later run tell a dead writer's leftovers from a live one.
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_stale_tmp(parent: Path, name: str) -> list[Path]:
    """Delete temp dirs of ``name`` left by dead processes on this host; returns what was removed."""
    removed = []
    host = socket.gethostname()
    if not parent.is_dir():
        return removed
    for p in parent.glob(f".{name}.tmp-*"):
        rest = p.name[len(f".{name}.tmp-") :]
        try:
            p_host, p_pid, _ = rest.rsplit("-", 2)
            pid = int(p_pid)
        except ValueError:
            continue
        if p_host != host:
            continue  # another machine sharing the directory: cannot check, leave it
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True  # exists, owned by someone else
        if not alive:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _commit(tmp: Path, final: Path) -> None:
    """Atomically publish ``tmp`` as ``final``; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


class SyntheticSpeechCorpus:
    """eSpeak-synthesised English speech with phoneme targets, cached on disk.

    The corpus for a configuration (seed, hours, split fractions, speaker settings, eSpeak
    version, grammar and phoneme inventory) lives in ``<root>/synthetic-s<seed>-<hours>h-<hash>``
    and is generated on first use like a download: a tqdm bar, a temporary directory renamed
    into place only when complete (an interrupted run leaves no directory that could be taken
    for a complete corpus; its leftovers are removed by the next run once the writing process is
    gone), and reuse on every later construction (``generated`` tells which happened).

    Generation: distinct sentences from :class:`SentenceGenerator` (test, then val, then train,
    never shared between splits), each spoken by a speaker of its split (a voice variant with
    seeded pitch/rate/intonation range, :func:`espeak.make_speakers`). The voice variants
    themselves are partitioned between splits, so test speakers -- and their timbres -- never
    occur in training. Audio is synthesised at 22.05 kHz in a pristine eSpeak state (bit-exact
    for a seed), resampled to 16 kHz with torchaudio's windowed-sinc resampler and stored as
    int16. Each split is filled until its share of ``hours`` is reached (at least one utterance).

    Files: ``meta.json`` (configuration, speakers, per-split statistics),
    ``<split>.audio.int16`` (raw little-endian samples of all utterances), ``<split>.index.npz``
    (``offsets``, ``speaker_ids``, ``targets``, ``target_offsets``), ``<split>.text.json``
    (sentence and IPA per utterance), ``features/<key>/`` (derived feature caches).

    Measured on the 2-core CPU machine (shared, load average 7-10): the default 3 h corpus
    (2601 utterances of 4.1 s on average, 13.3 s at most; 2088/260/253 per split) took 103 s,
    i.e. 105x real time with two synthesis helpers. Disk: 115.5 MB per hour of audio, plus
    28.9 MB per hour for each feature cache (144 MB per hour in all).

    Args:
        root: cache root (default ``~/.cache/linformer_lab/speech``).
        hours: total audio over all splits, in hours.
        seed: seed of sentences, speakers, eSpeak noise and additive noise.
        split_fractions: shares of ``hours`` for train/val/test.
        speakers_per_variant: speakers (prosody settings) per voice variant.
        variant_fractions: shares of the voice variants for train/val/test.
        num_workers: parallel synthesis helpers (default: CPU count, at most 4).
        progress: show progress bars.
    """

    FORMAT_VERSION = 1

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        hours: float = 3.0,
        seed: int = 0,
        split_fractions: Sequence[float] = (0.8, 0.1, 0.1),
        speakers_per_variant: int = 2,
        variant_fractions: Sequence[float] = (0.8, 0.1, 0.1),
        num_workers: int | None = None,
        progress: bool = True,
    ) -> None:
        if hours <= 0:
            raise ValueError("hours must be positive")
        if len(split_fractions) != 3 or len(variant_fractions) != 3:
            raise ValueError("split_fractions and variant_fractions need 3 values (train, val, test)")
        self.root = Path(root if root is not None else DEFAULT_CACHE / "speech").expanduser()
        self.hours = float(hours)
        self.seed = int(seed)
        self.split_fractions = tuple(float(x) for x in split_fractions)
        self.variant_fractions = tuple(float(x) for x in variant_fractions)
        self.speakers_per_variant = int(speakers_per_variant)
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.progress = progress
        self.config = {
            "format_version": self.FORMAT_VERSION,
            "grammar_version": SentenceGenerator.GRAMMAR_VERSION,
            "seed": self.seed,
            "hours": self.hours,
            "split_fractions": list(self.split_fractions),
            "variant_fractions": list(self.variant_fractions),
            "speakers_per_variant": self.speakers_per_variant,
            "sample_rate": SAMPLE_RATE,
            "espeak_version": espeak.version(),
            "variants": espeak.list_variants(),
            "phonemes": list(PHONEMES),
        }
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()[:10]
        self.name = f"synthetic-s{self.seed}-{self.hours:g}h-{digest}"
        self.path = self.root / self.name
        self.generated = False
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.is_complete(self.path):
            if self.path.exists():
                # Published but damaged (files deleted by hand, disk trouble): rebuild it.
                warnings.warn(f"speech corpus at {self.path} is incomplete; regenerating it", stacklevel=2)
                shutil.rmtree(self.path)
            _remove_stale_tmp(self.root, self.name)
            self._generate()
            self.generated = True
        with open(self.path / _META) as f:
            self.meta = json.load(f)

    # --- cache state -------------------------------------------------------------------------------
    @staticmethod
    def is_complete(path: Path) -> bool:
        """Whether ``path`` holds a fully written corpus (meta says complete, all files sized)."""
        try:
            with open(path / _META) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return False
        if not meta.get("complete"):
            return False
        for split in _SPLITS:
            info = meta["splits"].get(split, {})
            audio = path / f"{split}.audio.int16"
            if not audio.exists() or audio.stat().st_size != 2 * int(info.get("samples", -1)):
                return False
            if not (path / f"{split}.index.npz").exists() or not (path / f"{split}.text.json").exists():
                return False
        return True

    # --- generation ----------------------------------------------------------------------------------
    def _speakers(self) -> dict[str, list[espeak.Speaker]]:
        variants = list(self.config["variants"])
        random.Random(f"variants:{self.seed}").shuffle(variants)
        n = len(variants)
        n_val = max(1, round(n * self.variant_fractions[1]))
        n_test = max(1, round(n * self.variant_fractions[2]))
        parts = {"test": variants[:n_test], "val": variants[n_test : n_test + n_val], "train": variants[n_test + n_val :]}
        speakers, next_id = {}, 0
        for split in _SPLITS:
            speakers[split] = espeak.make_speakers(
                sorted(parts[split]), seed=self.seed, per_variant=self.speakers_per_variant, first_id=next_id
            )
            next_id += len(speakers[split])
        return speakers

    def _generate(self) -> None:
        tmp = self.root / _tmp_name(self.name)
        tmp.mkdir()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # parallelism comes from the worker threads (see _ensure_feature_cache)
        try:
            t0 = time.perf_counter()
            speakers = self._speakers()
            targets_s = {s: self.hours * 3600.0 * f for s, f in zip(_SPLITS, self.split_fractions)}
            total = sum(targets_s.values())
            sentences = SentenceGenerator(self.seed)
            resampler = torchaudio.transforms.Resample(espeak.SAMPLE_RATE, SAMPLE_RATE)
            stats = {}
            bar = tqdm(
                total=round(total),
                unit="s",
                desc=f"Synthesizing {self.hours:g} h of speech into {self.path}",
                disable=not self.progress,
            )
            with bar, ThreadPoolExecutor(self.num_workers) as pool:
                # Test first, then val, then train: one sentence stream, so no sentence repeats
                # across splits, and the held-out sets do not depend on the training size.
                for split in ("test", "val", "train"):
                    stats[split] = self._generate_split(
                        tmp, split, speakers[split], sentences, targets_s[split], resampler, pool, bar
                    )
            meta = {
                **self.config,
                "name": self.name,
                "splits": {s: stats[s] for s in _SPLITS},
                "speakers": {s: [sp.to_dict() for sp in speakers[s]] for s in _SPLITS},
                "generation_seconds": round(time.perf_counter() - t0, 2),
                "complete": True,
            }
            with open(tmp / _META, "w") as f:
                json.dump(meta, f, indent=1)
            _commit(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(threads)

    def _generate_split(self, tmp, split, speakers, sentences, target_seconds, resampler, pool, bar) -> dict:
        rng = random.Random(f"assign:{self.seed}:{split}")
        window = 4 * self.num_workers
        offsets, speaker_ids, targets, target_offsets, texts = [0], [], [], [0], []
        seconds = 0.0

        def job(i: int, text: str, speaker: espeak.Speaker) -> tuple[np.ndarray, str]:
            audio22 = speaker.synthesize(text, seed=_stable_seed("espeak", self.seed, split, i) & 0x7FFFFFFF)
            x = torch.from_numpy(audio22.astype(np.float32))
            y = resampler(x).round_().clamp_(-32768, 32767).to(torch.int16).numpy()
            return y, espeak.phonemize(text)

        with open(tmp / f"{split}.audio.int16", "wb") as audio_file:
            pending: list = []
            i = 0
            # Submit in a sliding window and consume strictly in order: the split ends at the
            # same utterance whatever the number of workers, so the corpus is deterministic.
            while True:
                while len(pending) < window:
                    text = next(sentences)
                    speaker = speakers[rng.randrange(len(speakers))]
                    pending.append((text, speaker, pool.submit(job, i + len(pending), text, speaker)))
                text, speaker, fut = pending.pop(0)
                audio, ipa = fut.result()
                audio.astype("<i2").tofile(audio_file)
                offsets.append(offsets[-1] + len(audio))
                ids = phonemes_to_ids(ipa)
                targets.extend(ids)
                target_offsets.append(len(targets))
                speaker_ids.append(speaker.speaker_id)
                texts.append({"text": text, "ipa": ipa})
                dur = len(audio) / SAMPLE_RATE
                seconds += dur
                bar.update(min(dur, max(0.0, target_seconds - (seconds - dur))))
                i += 1
                if seconds >= target_seconds:
                    break
            # Sentences drawn for the look-ahead window but not used go back to the stream, so
            # the next split starts at the same sentence whatever the window (worker count) was.
            sentences.give_back([text for text, _, _ in pending])
            for *_, fut in pending:
                fut.cancel()
            for *_, fut in pending:
                if not fut.cancelled():
                    fut.exception()  # wait for running jobs before the file is closed
        np.savez(
            tmp / f"{split}.index.npz",
            offsets=np.asarray(offsets, dtype=np.int64),
            speaker_ids=np.asarray(speaker_ids, dtype=np.int32),
            targets=np.asarray(targets, dtype=np.int16),
            target_offsets=np.asarray(target_offsets, dtype=np.int64),
        )
        with open(tmp / f"{split}.text.json", "w") as f:
            json.dump(texts, f, ensure_ascii=False)
        return {
            "utterances": len(texts),
            "samples": int(offsets[-1]),
            "seconds": round(seconds, 3),
            "phonemes": len(targets),
            "speakers": sorted({int(s) for s in speaker_ids}),
        }

    # --- access ----------------------------------------------------------------------------------------
    def dataset(self, split: str, noise_snr_db: float | None = None, cache_features: bool = True) -> SyntheticSpeechDataset:
        """The :class:`SyntheticSpeechDataset` of ``split`` (``"train"``, ``"val"``, ``"test"``)."""
        return SyntheticSpeechDataset(
            self.path, split, noise_snr_db=noise_snr_db, cache_features=cache_features, progress=self.progress
        )

    def speakers(self, split: str) -> list[espeak.Speaker]:
        """Speakers reserved for ``split`` (not all need to occur in a small corpus)."""
        return [espeak.Speaker(**d) for d in self.meta["speakers"][split]]

    def size_on_disk(self) -> int:
        """Bytes used by the corpus directory (audio, index, text, feature caches)."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


# ================================================================================================
# LibriSpeech
# ================================================================================================

_LIBRISPEECH_LAYOUT = (
    "<root>/LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>-<utterance>.flac and "
    "<root>/LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt "
    "(one '<speaker>-<chapter>-<utterance> TRANSCRIPT' line per utterance), i.e. the "
    "LibriSpeech tarballs (OpenSLR resource 12) extracted into <root>"
)


class LibriSpeechNotFoundError(FileNotFoundError):
    """A LibriSpeech subset is missing under the given root."""


class AudioBackendError(ImportError):
    """No installed package can decode the audio file format."""


def load_audio(path: str | os.PathLike) -> tuple[torch.Tensor, int]:
    """Read an audio file (FLAC for LibriSpeech) as mono float32 in [-1, 1).

    This is the single replaceable audio-reading function of the module (also injectable per
    corpus via ``LibriSpeechCorpus(audio_loader=...)``). It uses ``soundfile`` (libsndfile,
    bundled in its wheels) when installed, else ``torchaudio.load``, which since torchaudio 2.9
    delegates to ``torchcodec`` (needs FFmpeg shared libraries on the system).

    Returns:
        ``(waveform (samples,), sample_rate)``.
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
    """``(num_samples, sample_rate)`` of a FLAC file from its STREAMINFO block (no decoding).

    Lets the loader know every utterance's length -- needed for length bucketing -- by reading
    42 bytes per file instead of decoding hours of audio.
    """
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
            once per process) or
            ``"error"``; eSpeak can emit a rare symbol outside the inventory for an odd word.

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
            subset_dir = self.root / "LibriSpeech" / subset
            if not subset_dir.is_dir() or next(subset_dir.glob("*/*/*.flac"), None) is None:
                raise LibriSpeechNotFoundError(
                    f"LibriSpeech subset {subset!r} not found: {subset_dir} "
                    f"{'has no FLAC files' if subset_dir.is_dir() else 'does not exist'}. Expected layout: "
                    f"{_LIBRISPEECH_LAYOUT}."
                )
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
        with torch.no_grad():
            feats = _extractor()(self.waveform(i))
        return {"features": normalize_features(feats), "targets": self.target_ids(i)}


# ================================================================================================
# LightningDataModule
# ================================================================================================


class SpeechDataModule(L.LightningDataModule):
    """Speech batches for CTC phoneme recognition (format in the module docstring).

    Args:
        corpus: ``"synthetic"`` (eSpeak corpus, generated on first use) or ``"librispeech"``.
        root: cache root of the synthetic corpus (default ``~/.cache/linformer_lab/speech``) or
            the directory containing ``LibriSpeech/`` (default ``~/.cache/linformer_lab/librispeech``).
        hours: synthetic corpus size (all splits together).
        seed: corpus seed and batch-order seed.
        batch_size: utterances per batch (upper bound when ``max_frames_per_batch`` is set).
        max_frames_per_batch: bound on padded frames per batch (``batch x longest``); ``None`` =
            fixed-size batches.
        num_workers: DataLoader worker processes.
        noise_snr_db: white noise at this SNR on every split of the synthetic corpus (``None`` = clean).
        librispeech_train, librispeech_val, librispeech_test: LibriSpeech subsets per split.
        bucket_pool_batches: pool size (in batches) of the length-bucketing sampler.
        pin_memory: DataLoader ``pin_memory``.
        progress: show progress bars while generating/caching.

    Multi-process (DDP) training: use ``Trainer(use_distributed_sampler=False)``; the training
    loader shards its length-bucketed batches across ranks itself (each rank gets the same
    number of batches). Validation/test loaders are not sharded (every rank sees all data).
    """

    feature_dim = FEATURE_DIM

    def __init__(
        self,
        corpus: str = "synthetic",
        root: str | None = None,
        hours: float = 3.0,
        seed: int = 0,
        batch_size: int = 16,
        max_frames_per_batch: int | None = None,
        num_workers: int = 0,
        noise_snr_db: float | None = None,
        librispeech_train: Sequence[str] = ("train-clean-100",),
        librispeech_val: Sequence[str] = ("dev-clean",),
        librispeech_test: Sequence[str] = ("test-clean",),
        bucket_pool_batches: int = 50,
        pin_memory: bool = False,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if corpus not in ("synthetic", "librispeech"):
            raise ValueError(f"corpus must be 'synthetic' or 'librispeech', got {corpus!r}")
        self.save_hyperparameters()
        self.corpus = corpus
        self.root = root
        self.hours = hours
        self.seed = seed
        self.batch_size = batch_size
        self.max_frames_per_batch = max_frames_per_batch
        self.num_workers = num_workers
        self.noise_snr_db = noise_snr_db
        self.librispeech_subsets = {
            "train": tuple(librispeech_train),
            "val": tuple(librispeech_val),
            "test": tuple(librispeech_test),
        }
        self.bucket_pool_batches = bucket_pool_batches
        self.pin_memory = pin_memory
        self.progress = progress
        self.datasets: dict[str, Dataset] = {}

    @property
    def num_phonemes(self) -> int:
        """Output classes of the CTC model: phonemes + blank (id 0)."""
        return NUM_PHONEMES

    def _synthetic(self) -> SyntheticSpeechCorpus:
        return SyntheticSpeechCorpus(root=self.root, hours=self.hours, seed=self.seed, progress=self.progress)

    def _librispeech_root(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else (DEFAULT_CACHE / "librispeech").expanduser()

    def prepare_data(self) -> None:
        # Runs on one process per node: the place for the one-time synthesis / feature caching.
        if self.corpus == "synthetic":
            corpus = self._synthetic()
            _ensure_feature_cache(corpus.path, self.noise_snr_db, progress=self.progress)  # all splits
        else:
            for subsets in self.librispeech_subsets.values():
                for subset in subsets:
                    d = self._librispeech_root() / "LibriSpeech" / subset
                    if not d.is_dir():
                        raise LibriSpeechNotFoundError(
                            f"LibriSpeech subset {subset!r} not found: {d} does not exist. "
                            f"Expected layout: {_LIBRISPEECH_LAYOUT}."
                        )

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        if self.corpus == "synthetic":
            corpus = self._synthetic()
            for split in _SPLITS:
                self.datasets[split] = corpus.dataset(split, noise_snr_db=self.noise_snr_db)
        else:
            for split, subsets in self.librispeech_subsets.items():
                self.datasets[split] = LibriSpeechCorpus(self._librispeech_root(), subsets)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if not self.datasets:
            self.setup()
        ds = self.datasets[split]
        replicas, rank = 1, 0
        trainer = getattr(self, "trainer", None)
        if trainer is not None and shuffle:
            replicas, rank = trainer.world_size, trainer.global_rank
        sampler = LengthBucketBatchSampler(
            ds.lengths,
            batch_size=self.batch_size,
            max_frames_per_batch=self.max_frames_per_batch,
            shuffle=shuffle,
            pool_batches=self.bucket_pool_batches,
            seed=self.seed,
            num_replicas=replicas,
            rank=rank,
        )
        return DataLoader(
            ds,
            batch_sampler=sampler,
            collate_fn=collate_speech,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
