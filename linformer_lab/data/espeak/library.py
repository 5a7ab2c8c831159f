"""The ctypes binding of libespeak-ng and the helper-process side of pristine synthesis.

Self-contained on purpose (standard library and numpy only): the synthesis helper process
loads this one file by path (see :mod:`linformer_lab.data.espeak`), not the package.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

import numpy as np

#: Output sample rate of eSpeak NG (Hz); :func:`initialize` checks the library agrees.
SAMPLE_RATE = 22050
#: Base voice used for both synthesis and phonemisation.
DEFAULT_LANGUAGE = "en-us"

# --- constants from espeak-ng's speak_lib.h (stable public ABI) ---------------------------------
_AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: synth returns when all audio went to the callback
_INITIALIZE_DONT_EXIT = 0x8000  # report errors instead of calling exit() inside the library
_POS_CHARACTER = 1  # espeak_POSITION_TYPE
_CHARS_UTF8 = 1  # text encoding flag, for espeak_Synth and espeak_TextToPhonemes
_PHONEMES_IPA = 0x02  # phonememode bit: IPA instead of eSpeak's ASCII mnemonics
# espeak_PARAMETER
_PARAM_RATE = 1  # words per minute, 80..450 (175 default)
_PARAM_VOLUME = 2  # 0..200 (100 default)
_PARAM_PITCH = 3  # 0..100 (50 default), relative inside the variant's pitch range
_PARAM_RANGE = 4  # 0..100 (50 default), intonation range; 0 = monotone
_PARAM_WORDGAP = 7  # extra pause between words, units of 10 ms at default speed
_EE_OK = 0

# int cb(short *wav, int numsamples, espeak_EVENT *events); returns 0 to go on, 1 to abort.
# The events are not used, so they stay a void*.
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class EspeakError(RuntimeError):
    """libespeak-ng could not be loaded/initialised or rejected a request."""


_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_chunks: list[bytes] = []  # audio collected by the callback for the synthesis in progress
_callback_ref = None  # keeps the ctypes trampoline alive for as long as the library may call it


def _renew_lock_after_fork() -> None:
    # A lock held by another parent thread at fork time would stay locked forever in the child;
    # the state it guards is consistent, since no library call is half-way through in the child.
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock_after_fork)


def _on_audio(wav, numsamples, events):  # noqa: ARG001 - signature fixed by the C callback type
    # Called inside espeak_Synth on the calling thread (synchronous mode); a NULL buffer or zero
    # count ends synthesis. The buffer is valid only during the call, so its bytes are copied.
    if numsamples > 0 and wav:
        _chunks.append(ctypes.string_at(wav, numsamples * ctypes.sizeof(ctypes.c_short)))
    return 0


def _declare_signatures(lib: ctypes.CDLL) -> None:
    # Explicit signatures: ctypes would otherwise pass Python ints as C int and truncate
    # pointers / size_t on 64-bit platforms.
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Initialize.restype = ctypes.c_int
    lib.espeak_Info.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
    lib.espeak_Info.restype = ctypes.c_char_p
    lib.espeak_SetSynthCallback.argtypes = [_SYNTH_CALLBACK]
    lib.espeak_SetSynthCallback.restype = None
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetVoiceByName.restype = ctypes.c_int
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_SetParameter.restype = ctypes.c_int
    lib.espeak_Synth.argtypes = [
        ctypes.c_void_p,  # const void *text
        ctypes.c_size_t,  # size_t size (bytes, including the terminating NUL)
        ctypes.c_uint,  # unsigned int position
        ctypes.c_int,  # espeak_POSITION_TYPE position_type
        ctypes.c_uint,  # unsigned int end_position (0 = no end)
        ctypes.c_uint,  # unsigned int flags
        ctypes.POINTER(ctypes.c_uint),  # unsigned int *unique_identifier (may be NULL)
        ctypes.c_void_p,  # void *user_data
    ]
    lib.espeak_Synth.restype = ctypes.c_int
    lib.espeak_Synchronize.argtypes = []
    lib.espeak_Synchronize.restype = ctypes.c_int
    # const char *espeak_TextToPhonemes(const void **textptr, int textmode, int phonememode):
    # translates ONE clause, then advances *textptr to the next clause (NULL at the end). The
    # pointer therefore has to be passed by reference and must point into a buffer we own.
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
    lib.espeak_ng_SetRandSeed.restype = None


def data_path() -> Path:
    """Directory ``espeak-ng-data`` shipped with ``espeakng-loader``."""
    import espeakng_loader

    return Path(espeakng_loader.get_data_path())


def initialize() -> ctypes.CDLL:
    """The library handle, loaded and initialised once per process (thread-safe); raises
    :class:`EspeakError` when the library is missing or its initialisation fails."""
    global _lib, _callback_ref
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        try:
            import espeakng_loader

            lib = ctypes.CDLL(espeakng_loader.get_library_path())
            path = espeakng_loader.get_data_path()
        except (ImportError, OSError, RuntimeError) as exc:
            raise EspeakError(f"cannot load libespeak-ng from espeakng-loader: {exc}") from exc
        _declare_signatures(lib)
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, path.encode(), _INITIALIZE_DONT_EXIT)
        if rate != SAMPLE_RATE:
            raise EspeakError(
                f"espeak_Initialize(data path {path!r}) returned {rate}, expected sample rate {SAMPLE_RATE}"
            )
        _callback_ref = _SYNTH_CALLBACK(_on_audio)
        lib.espeak_SetSynthCallback(_callback_ref)
        _lib = lib
        return lib


def version() -> str:
    """eSpeak NG version string, e.g. ``"1.52.0"`` (part of cache keys: output may change with it)."""
    lib = initialize()
    with _lock:
        return lib.espeak_Info(None).decode()


def _set_voice(lib: ctypes.CDLL, voice: str) -> None:
    if lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
        raise EspeakError(f"unknown eSpeak voice {voice!r} (expected e.g. 'en-us' or 'en-us+f3')")


def _set_param(lib: ctypes.CDLL, param: int, value: int, name: str) -> None:
    if lib.espeak_SetParameter(param, int(value), 0) != _EE_OK:
        raise EspeakError(f"espeak_SetParameter({name}={value}) failed")


def synthesize_in_process(
    text: str, voice: str, rate: int, pitch: int, pitch_range: int, word_gap: int, volume: int, seed: int
) -> np.ndarray:
    lib = initialize()
    data = text.encode("utf-8")
    buf = ctypes.create_string_buffer(data)  # NUL-terminated copy owned by us
    with _lock:
        _set_voice(lib, voice)  # first: selecting a voice resets the prosody parameters
        _set_param(lib, _PARAM_RATE, rate, "rate")
        _set_param(lib, _PARAM_PITCH, pitch, "pitch")
        _set_param(lib, _PARAM_RANGE, pitch_range, "pitch_range")
        _set_param(lib, _PARAM_WORDGAP, word_gap, "word_gap")
        _set_param(lib, _PARAM_VOLUME, volume, "volume")
        lib.espeak_ng_SetRandSeed(int(seed) & 0x7FFFFFFF)
        _chunks.clear()
        try:
            err = lib.espeak_Synth(buf, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
            if err != _EE_OK:
                raise EspeakError(f"espeak_Synth failed with error {err} for text {text[:60]!r}")
            lib.espeak_Synchronize()
            audio = np.frombuffer(b"".join(_chunks), dtype=np.int16).copy()
        finally:
            _chunks.clear()
    return audio


# --- pristine-state synthesis -----------------------------------------------------------------
#
# libespeak-ng keeps synthesis state in C statics that no API resets (wavegen.c: the pitch
# "flutter" phase Flutter_ix, the automatic gain control, the roughness cycle counter), so two
# identical espeak_Synth calls in one process differ slightly: inaudible, but not bit-exact.
# Re-seeding or re-initialising does not help.
#
# So a helper process initialises eSpeak and never synthesises itself; each request is served by
# a forked child, which starts from that pristine state, pipes the samples back and exits. The
# helper is a separate interpreter started with subprocess (multiprocessing would re-import the
# user's __main__) that loads only this file, numpy and the standard library; single-threaded, it
# forks safely. Messages on the pipes are multiprocessing Connection messages (pickled objects).


def receive(connection: Connection):
    """The next message on ``connection``, or ``None`` once the other end has closed its side
    (at a message boundary or half-way through one)."""
    try:
        return connection.recv()
    except (EOFError, OSError):
        return None


def _fork_synthesis_child(close_in_child: tuple[Connection, ...]) -> tuple[int, Connection, Connection]:
    """Fork a child that waits for one request, answers it and exits; ``(pid, requests,
    answers)``, the parent's ends of its two pipes. Forked *before* the request arrives, off the
    request's critical path."""
    req_r, req_w = Pipe(duplex=False)
    ans_r, ans_w = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # child: a pristine copy of the helper's library state
        try:
            req_w.close()
            ans_r.close()
            for connection in close_in_child:
                connection.close()  # the helper's client pipes are not the child's business
            request = receive(req_r)
            if request is not None:
                try:
                    answer = ("ok", synthesize_in_process(*request).tobytes())
                except BaseException as exc:  # noqa: BLE001 - reported to the client
                    answer = ("error", f"{type(exc).__name__}: {exc}")
                ans_w.send(answer)
        finally:
            os._exit(0)
    req_r.close()
    ans_w.close()
    return pid, req_w, ans_r


def _serve(in_fd: int = 0, out_fd: int = 1) -> None:
    """Helper main loop: each request is served by a fresh fork, until EOF on ``in_fd``."""
    # Ctrl-C reaches the whole process group; the client handles it and closes the pipe, which
    # ends this loop cleanly instead of leaving a half-written answer.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client_requests = Connection(in_fd, writable=False)
    client_answers = Connection(out_fd, readable=False)
    lib = initialize()
    # Selecting the base language here loads its dictionary once for every child; the helper
    # stays pristine, since the history-dependent statics change only while synthesising.
    with _lock:
        _set_voice(lib, DEFAULT_LANGUAGE)
    child = _fork_synthesis_child((client_requests, client_answers))
    while True:
        request = receive(client_requests)
        pid, requests, answers = child
        if request is None:
            requests.close()  # EOF: the waiting child exits without synthesising
            answers.close()
            os.waitpid(pid, 0)
            return
        requests.send(request)
        requests.close()
        answer = receive(answers)
        answers.close()
        if answer is None:
            _, status = os.waitpid(pid, 0)
            answer = ("error", f"synthesis child died (wait status {status})")
            pid = None
        client_answers.send(answer)
        # Reap and pre-fork the next child after answering, while the client is busy.
        if pid is not None:
            os.waitpid(pid, 0)
        child = _fork_synthesis_child((client_requests, client_answers))


def phonemize(text: str, voice: str = DEFAULT_LANGUAGE, separator: str | None = None) -> str:
    """Convert text to IPA phonemes with eSpeak's own letter-to-sound rules and dictionary.

    Args:
        text: UTF-8 text; may contain several clauses/sentences.
        voice: language voice that decides the pronunciation (``"en-us"``); a variant suffix
            is accepted but does not change the phonemes.
        separator: if given (one character), eSpeak inserts it between the phonemes of each
            word -- its own segmentation, used to build and check the phoneme inventory.

    Returns:
        IPA string: words and clauses separated by single spaces (punctuation dropped), with
        stress marks (``ˈ``, ``ˌ``) as eSpeak writes them.
    """
    lib = initialize()
    mode = _PHONEMES_IPA
    if separator is not None:
        if len(separator) != 1:
            raise ValueError("separator must be a single character")
        mode |= ord(separator) << 8  # bits 8..23 of phonememode hold the separator code point
    buf = ctypes.create_string_buffer(text.encode("utf-8"))
    pieces: list[str] = []
    with _lock:
        _set_voice(lib, voice)
        cursor = ctypes.c_void_p(ctypes.addressof(buf))
        # Each call consumes one clause and moves `cursor` forward; it becomes NULL at the end.
        while cursor.value:
            out = lib.espeak_TextToPhonemes(ctypes.byref(cursor), _CHARS_UTF8, mode)
            if out:
                piece = out.decode("utf-8").strip()
                if piece:
                    pieces.append(piece)
    return " ".join(pieces)


def list_variants() -> list[str]:
    """Sorted names of the voice variants in ``espeak-ng-data/voices/!v``, except those with
    whitespace (not addressable as ``lang+variant``)."""
    vdir = data_path() / "voices" / "!v"
    return sorted(p.name for p in vdir.iterdir() if p.is_file() and not any(c.isspace() for c in p.name))
