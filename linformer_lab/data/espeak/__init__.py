"""A small ctypes wrapper over libespeak-ng (shipped by the ``espeakng-loader`` wheel).

:func:`synthesize` turns text into a mono ``np.int16`` waveform at :data:`SAMPLE_RATE` (22 050 Hz),
:func:`phonemize` into an IPA phoneme string (``espeak_TextToPhonemes``); :class:`Speaker` and
:func:`make_speakers` give a deterministic list of synthetic speakers built from the voice
variants in ``espeak-ng-data/voices/!v``. The ctypes binding and the synthesis helper's side live
in :mod:`.library`, which the helper process loads on its own.

Concurrency
-----------
libespeak-ng keeps *global* state (current voice, parameters, one synth callback), so every
in-process call into it is serialised by a module-level re-entrant lock; parallelism comes from
processes, each with its own copy of that state. The library is initialised lazily, so a
DataLoader worker started with ``spawn``/``forkserver`` initialises its own; one started with
``fork`` inherits the parent's, which is safe because eSpeak starts no threads in synchronous
mode (a fork hook re-creates the lock, so a lock held by another parent thread cannot deadlock
the child). Each process starts one synthesis helper per concurrently synthesising thread, up to
the CPU count, so threads *do* synthesise in parallel through :func:`synthesize`.

Determinism
-----------
eSpeak carries hidden state from one utterance to the next (pitch-flutter phase, gain control),
so two identical in-process calls do not give bit-identical samples. By default
:func:`synthesize` therefore runs every request in a fresh fork of a helper process whose eSpeak
was initialised but never used ("pristine"), and re-seeds eSpeak's random generator: the samples
depend only on the arguments. This costs about twice an in-process call and still synthesises
the default corpus far faster than real time. Phonemisation has no such state and runs in-process.
"""

from __future__ import annotations

import atexit
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Pipe

import numpy as np

from linformer_lab.data.espeak import library
from linformer_lab.data.espeak.library import (
    DEFAULT_LANGUAGE,
    SAMPLE_RATE,
    EspeakError,
    data_path,
    initialize,
    list_variants,
    phonemize,
    synthesize_in_process,
    version,
)

__all__ = [
    "DEFAULT_LANGUAGE",
    "EspeakError",
    "SAMPLE_RATE",
    "Speaker",
    "data_path",
    "initialize",
    "list_variants",
    "make_speakers",
    "phonemize",
    "shutdown",
    "synthesize",
    "version",
]


def synthesize(
    text: str,
    voice: str = DEFAULT_LANGUAGE,
    rate: int = 175,
    pitch: int = 50,
    pitch_range: int = 50,
    word_gap: int = 0,
    volume: int = 100,
    seed: int = 0,
    isolated: bool = True,
) -> np.ndarray:
    """Synthesise ``text`` and return the waveform.

    Args:
        text: UTF-8 text (plain, not SSML).
        voice: eSpeak voice name, a language optionally with a variant: ``"en-us+f3"``.
        rate: speaking rate in words per minute (eSpeak accepts 80..450).
        pitch: base pitch 0..100, relative to the variant's own pitch band.
        pitch_range: intonation range 0..100 (0 = monotone).
        word_gap: extra pause between words, in units of 10 ms.
        volume: amplitude 0..200.
        seed: seed of eSpeak's internal random generator (breath noise).
        isolated: synthesise from a pristine library state (module docstring). ``False`` runs in
            this process, in about half the time, but the exact samples then depend on the call history.

    Returns:
        ``np.int16`` array of shape ``(num_samples,)`` at :data:`SAMPLE_RATE` Hz.
    """
    args = (text, voice, int(rate), int(pitch), int(pitch_range), int(word_gap), int(volume), int(seed))
    if isolated and hasattr(os, "fork"):
        return _synthesize_isolated(args)
    return synthesize_in_process(*args)


class _PristineClient:
    """One helper process and the two pipes to it (its stdin and stdout); used by one thread at a time."""

    def __init__(self) -> None:
        boot = (
            "import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('_linformer_lab_espeak_helper', sys.argv[1])\n"
            "mod = importlib.util.module_from_spec(spec)\n"
            "sys.modules[spec.name] = mod\n"  # dataclasses look their module up while executing it
            "spec.loader.exec_module(mod)\n"
            "mod._serve(0, 1)\n"
        )
        helper_stdin, self.requests = Pipe(duplex=False)
        self.answers, helper_stdout = Pipe(duplex=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot, os.path.abspath(library.__file__)],
            stdin=helper_stdin.fileno(),
            stdout=helper_stdout.fileno(),
            close_fds=True,
        )
        helper_stdin.close()  # the helper's ends: only it holds them now
        helper_stdout.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def synthesize(self, args: tuple) -> np.ndarray:
        try:
            self.requests.send(args)
            answer = library.receive(self.answers)
        except OSError as exc:
            answer = ("error", f"lost the eSpeak helper process: {exc}")
        if answer is None:
            answer = ("error", f"eSpeak helper process exited (code {self.proc.poll()})")
        status, payload = answer
        if status != "ok":
            raise EspeakError(payload)
        return np.frombuffer(payload, dtype=np.int16).copy()

    def close(self) -> None:
        self.requests.close()  # EOF ends the helper's loop
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.answers.close()


class _HelperPool:
    """Helpers of one process: one per concurrently synthesising thread, up to ``max_helpers``.

    A thread holds one of the ``max_helpers`` slots while it synthesises and takes an idle
    helper, or starts one if none is idle; helpers alive (idle or in use) never outnumber the
    slots. ``idle`` needs no lock: ``list.append`` and ``list.pop`` are atomic."""

    def __init__(self, max_helpers: int) -> None:
        self.slots = threading.BoundedSemaphore(max(1, max_helpers))
        self.idle: list[_PristineClient] = []

    def _pop_idle(self) -> _PristineClient | None:
        try:
            return self.idle.pop()
        except IndexError:
            return None

    def synthesize(self, args: tuple) -> np.ndarray:
        with self.slots:
            client = self._pop_idle()
            while client is not None and not client.alive():  # died while idle
                client.close()
                client = self._pop_idle()
            client = client or _PristineClient()
            try:
                result = client.synthesize(args)
            except BaseException:
                client.close()  # a helper in an unknown state is not reused
                raise
            self.idle.append(client)
            return result

    def close(self) -> None:
        while (client := self._pop_idle()) is not None:
            client.close()


# One pool per process, by pid: a pool inherited through fork belongs to the parent (its pipes
# are shared with it), so a forked process (e.g. a DataLoader worker) starts helpers of its own.
# dict.setdefault is atomic, so threads starting at once share one pool, with no lock a fork
# could leave held.
_pools: dict[int, _HelperPool] = {}


def _synthesize_isolated(args: tuple) -> np.ndarray:
    pool = _pools.get(os.getpid()) or _pools.setdefault(os.getpid(), _HelperPool(os.cpu_count() or 1))
    return pool.synthesize(args)


def shutdown() -> None:
    """Stop this process's idle synthesis helpers (restarted on demand; also run at exit)."""
    pool = _pools.get(os.getpid())
    if pool is not None:
        pool.close()


atexit.register(shutdown)


@dataclass(frozen=True)
class Speaker:
    """A synthetic speaker: an eSpeak voice variant with fixed prosody settings.

    Attributes:
        speaker_id: index in the speaker list.
        variant: voice variant file name in ``voices/!v`` (timbre: formants, pitch band, breath).
        pitch: eSpeak pitch 0..100.
        rate: words per minute.
        pitch_range: eSpeak intonation range 0..100.
        language: base language voice.
    """

    speaker_id: int
    variant: str
    pitch: int
    rate: int
    pitch_range: int = 50
    language: str = DEFAULT_LANGUAGE

    @property
    def voice(self) -> str:
        """eSpeak voice name ``<language>+<variant>``."""
        return f"{self.language}+{self.variant}"

    def synthesize(self, text: str, seed: int = 0, isolated: bool = True) -> np.ndarray:
        """:func:`synthesize` with this speaker's voice and prosody; ``np.int16 (samples,)`` at 22 050 Hz."""
        return synthesize(
            text,
            voice=self.voice,
            rate=self.rate,
            pitch=self.pitch,
            pitch_range=self.pitch_range,
            seed=seed,
            isolated=isolated,
        )


def make_speakers(
    variants: list[str] | None = None,
    seed: int = 0,
    per_variant: int = 1,
    pitch: tuple[int, int] = (30, 70),
    rate: tuple[int, int] = (140, 210),
    pitch_range: tuple[int, int] = (30, 80),
    language: str = DEFAULT_LANGUAGE,
    first_id: int = 0,
) -> list[Speaker]:
    """Deterministic speaker list: ``per_variant`` speakers per variant with seeded prosody.

    Args:
        variants: variant names (default: all of :func:`list_variants`). The order given is the
            order of the returned speakers, so sort it for reproducibility.
        seed: seed for drawing pitch / rate / range uniformly from the (inclusive) ranges.
        per_variant: speakers generated per variant (different prosody, same timbre).
        pitch, rate, pitch_range: inclusive integer ranges (eSpeak units, rate in words/min).
        language: base language voice.
        first_id: ``speaker_id`` of the first speaker (ids are consecutive).

    Returns:
        ``len(variants) * per_variant`` :class:`Speaker` objects.
    """
    if variants is None:
        variants = list_variants()
    rng = random.Random(f"speakers:{seed}")  # string seeds hash deterministically (sha512)
    speakers = []
    for variant in variants:
        for _ in range(per_variant):
            speakers.append(
                Speaker(
                    speaker_id=first_id + len(speakers),
                    variant=variant,
                    pitch=rng.randint(*pitch),
                    rate=rng.randint(*rate),
                    pitch_range=rng.randint(*pitch_range),
                    language=language,
                )
            )
    return speakers
