"""The synthetic eSpeak NG corpus: generated once per configuration into a cache, reused after."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torchaudio
from tqdm.auto import tqdm

from linformer_lab.data import espeak
from linformer_lab.data.phonemes import PHONEMES, phonemes_to_ids
from linformer_lab.data.speech.cache import atomic_directory
from linformer_lab.data.speech.features import SAMPLE_RATE, stable_seed
from linformer_lab.data.speech.grammar import SentenceGenerator
from linformer_lab.data.speech.synthetic_dataset import META, SPLITS, SyntheticSpeechDataset

DEFAULT_CACHE = Path("~/.cache/linformer_lab")


class SyntheticSpeechCorpus:
    """eSpeak-synthesised English speech with phoneme targets, cached on disk.

    The corpus of a configuration (seed, hours, split fractions, speaker settings, eSpeak
    version, grammar, phoneme inventory) lives in ``<root>/synthetic-s<seed>-<hours>h-<hash>``.
    It is generated on first use like a download (a tqdm bar; written atomically, see
    :mod:`.cache`) and reused by every later construction (``generated`` tells which happened).

    Generation: distinct sentences from :class:`SentenceGenerator` (test, then val, then train,
    never shared between splits), each spoken by a speaker of its split (a voice variant with
    seeded pitch/rate/intonation range, :func:`espeak.make_speakers`). The voice variants are
    partitioned between splits, so test timbres never occur in training. Audio is synthesised
    at 22.05 kHz in a pristine eSpeak state (bit-exact for a seed), resampled to 16 kHz with
    torchaudio's windowed-sinc resampler and stored as int16. Each split is filled until its
    share of ``hours`` is reached (at least one utterance).

    Files: ``meta.json`` (configuration, speakers, per-split statistics),
    ``<split>.audio.int16`` (raw little-endian samples of all utterances), ``<split>.index.npz``
    (``offsets``, ``speaker_ids``, ``targets``, ``target_offsets``), ``<split>.text.json``
    (sentence and IPA per utterance), ``features/<key>/`` (derived feature caches).

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
            if self.path.exists():  # published but damaged (files deleted by hand, disk trouble)
                warnings.warn(f"speech corpus at {self.path} is incomplete; regenerating it", stacklevel=2)
                shutil.rmtree(self.path)
            self._generate()
            self.generated = True
        with open(self.path / META) as f:
            self.meta = json.load(f)

    # --- cache state -------------------------------------------------------------------------------
    @staticmethod
    def is_complete(path: Path) -> bool:
        """Whether ``path`` holds a fully written corpus (meta says complete, all files sized)."""
        try:
            with open(path / META) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return False
        if not meta.get("complete"):
            return False
        for split in SPLITS:
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
        for split in SPLITS:
            speakers[split] = espeak.make_speakers(
                sorted(parts[split]), seed=self.seed, per_variant=self.speakers_per_variant, first_id=next_id
            )
            next_id += len(speakers[split])
        return speakers

    def _generate(self) -> None:
        with atomic_directory(self.path) as tmp:
            t0 = time.perf_counter()
            speakers = self._speakers()
            targets_s = {s: self.hours * 3600.0 * f for s, f in zip(SPLITS, self.split_fractions)}
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
                # Test first, then val, then train from one sentence stream: no sentence repeats
                # across splits, and the held-out sets do not depend on the training size.
                done = 0.0  # seconds of the splits finished, as the bar counts them
                for split in ("test", "val", "train"):
                    stats[split] = self._generate_split(
                        tmp, split, speakers[split], sentences, targets_s[split], resampler, pool, bar, done
                    )
                    done += targets_s[split]
            meta = {
                **self.config,
                "name": self.name,
                "splits": {s: stats[s] for s in SPLITS},
                "speakers": {s: [asdict(sp) for sp in speakers[s]] for s in SPLITS},
                "generation_seconds": round(time.perf_counter() - t0, 2),
                "complete": True,
            }
            with open(tmp / META, "w") as f:
                json.dump(meta, f, indent=1)

    def _generate_split(self, tmp, split, speakers, sentences, target_seconds, resampler, pool, bar, done) -> dict:
        rng = random.Random(f"assign:{self.seed}:{split}")
        window = 4 * self.num_workers
        offsets, speaker_ids, targets, target_offsets, texts = [0], [], [], [0], []
        seconds = 0.0

        def job(i: int, text: str, speaker: espeak.Speaker) -> tuple[np.ndarray, str]:
            audio22 = speaker.synthesize(text, seed=stable_seed("espeak", self.seed, split, i) & 0x7FFFFFFF)
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
                targets.extend(phonemes_to_ids(ipa))
                target_offsets.append(len(targets))
                speaker_ids.append(speaker.speaker_id)
                texts.append({"text": text, "ipa": ipa})
                seconds += len(audio) / SAMPLE_RATE
                # whole seconds, capped at the total: float steps sum past it (a clamping warning, "7200.000000000003")
                bar.update(max(0, min(bar.total, round(done + min(seconds, target_seconds))) - bar.n))
                i += 1
                if seconds >= target_seconds:
                    break
            # Sentences drawn for the look-ahead window but unused go back to the stream: the
            # next split starts at the same sentence whatever the window (worker count).
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
