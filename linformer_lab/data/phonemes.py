"""Phoneme inventory and tokenizer for the US-English IPA output of eSpeak NG.

Inventory
---------
``PHONEMES[0]`` is the CTC blank; ids ``1..NUM_PHONEMES-1`` are the phonemes below: the symbols
eSpeak NG 1.52 (voice ``en-us``) was observed to emit for the synthetic corpus vocabulary, ~40 000
distinct English words and a list of loanwords/names (read with English rules, so only a few
non-English symbols such as ``x``, ``ɬ``, ``nʲ`` or nasal ``ɑ̃`` appear). Multi-character units
are single phonemes:

* length-marked vowels ``iː uː ɑː ɔː ɜː`` (the length mark never stands alone),
* diphthongs ``aɪ aʊ eɪ oʊ ɔɪ``, affricates ``tʃ dʒ``,
* r-coloured vowels ``ɚ`` and ``ɜː`` (eSpeak's rhotic NURSE vowel),
* palatalised ``nʲ``, syllabic ``n̩`` (n + U+0329), nasal ``ɑ̃`` (ɑ + U+0303).

Conventions (one tokenization for every source: synthetic corpus, LibriSpeech, decoding)
-----------------------------------------------------------------------------------------
* **Stress marks** ``ˈ ˌ`` are dropped: stress is prosody, not phoneme identity, and keeping it
  would double the vowel classes with little acoustic evidence in 40-dim filterbanks.
* **Word boundaries** (spaces) are dropped, as in standard phoneme recognition (TIMIT/WSJ PER);
  there is no word-boundary token.
* eSpeak's own *compound* units -- r-coloured ``ɑːɹ ɔːɹ ɛɹ ɪɹ ʊɹ``, syllabic ``əl``, and
  ``iə aɪə aɪɚ`` -- are **not** in the inventory but tokenized as their parts (``ɔːɹ`` ->
  ``ɔː ɹ``, ``əl`` -> ``ə l``, ``aɪɚ`` -> ``aɪ ɚ``), the ARPAbet/CMUdict convention (DOOR =
  D AO R, BOTTLE = B AA T AH L, FIRE = F AY ER). This keeps greedy longest-match unambiguous:
  eSpeak's two phonemes "ɔː" + "ɹ" and its single "ɔːɹ" are the same string.
* A doubled length mark (``iːː``, eSpeak's rendering of drawn-out interjections such as
  "weee") is reduced to one; tie bars (U+0361, from eSpeak's tie mode) are removed.
* Any other symbol raises :class:`UnknownPhonemeError`, which names each unknown symbol with
  its code point, so the inventory can be extended deliberately rather than silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "BLANK",
    "BLANK_ID",
    "CONSONANTS",
    "DIPHTHONGS",
    "NUM_PHONEMES",
    "PHONEMES",
    "PHONEME_TO_ID",
    "UnknownPhonemeError",
    "VOWELS",
    "ids_to_phonemes",
    "normalize_ipa",
    "phonemes_to_ids",
    "tokenize",
]

BLANK = "<blank>"
BLANK_ID = 0

#: Monophthongs (incl. r-coloured ``ɚ``/``ɜː`` and reduced ``ᵻ``/``ɐ``).
VOWELS: tuple[str, ...] = (
    "i", "iː", "ɪ", "ᵻ", "e", "ɛ", "æ", "ɐ", "ə", "ʌ", "ɚ", "ɜː",
    "ɑː", "ɑ̃", "ɔ", "ɔː", "ʊ", "u", "uː",
)  # fmt: skip
#: Diphthongs.
DIPHTHONGS: tuple[str, ...] = ("aɪ", "aʊ", "eɪ", "oʊ", "ɔɪ")
#: Consonants, incl. affricates, the flap ``ɾ``, glottal stop ``ʔ`` and syllabic ``n̩``.
CONSONANTS: tuple[str, ...] = (
    "p", "b", "t", "d", "k", "ɡ", "ʔ", "tʃ", "dʒ", "f", "v", "θ", "ð", "s", "z", "ʃ", "ʒ",
    "x", "h", "m", "n", "nʲ", "n̩", "ŋ", "l", "ɬ", "ɹ", "r", "ɾ", "w", "j",
)  # fmt: skip

#: Full vocabulary; index = token id, index 0 = CTC blank.
PHONEMES: tuple[str, ...] = (BLANK,) + VOWELS + DIPHTHONGS + CONSONANTS
PHONEME_TO_ID: dict[str, int] = {p: i for i, p in enumerate(PHONEMES)}
#: Vocabulary size including the blank (the CTC output dimension).
NUM_PHONEMES = len(PHONEMES)

_MAX_UNIT = max(len(p) for p in PHONEMES[1:])  # longest unit in code points
_DROPPED = {"ˈ", "ˌ", " ", "\t", "\n", "\u0361"}  # stress, word boundaries, tie bar


class UnknownPhonemeError(ValueError):
    """The IPA string contains symbols outside :data:`PHONEMES`.

    Attributes:
        symbols: the unknown symbols, in order of first occurrence.
        ipa: the offending (normalised) string.
    """

    def __init__(self, symbols: Sequence[str], ipa: str) -> None:
        self.symbols = list(symbols)
        self.ipa = ipa
        names = ", ".join(f"{s!r} ({' '.join(f'U+{ord(c):04X}' for c in s)})" for s in self.symbols)
        super().__init__(
            f"unknown phoneme symbol(s) {names} in {ipa!r}; extend linformer_lab.data.phonemes "
            f"if eSpeak legitimately produces them"
        )


def normalize_ipa(ipa: str) -> str:
    """Apply the conventions of the module docstring; returns a string without spaces/stress."""
    out = "".join(c for c in ipa if c not in _DROPPED)
    while "ːː" in out:
        out = out.replace("ːː", "ː")
    return out


def tokenize(ipa: str, on_unknown: str = "error") -> list[str]:
    """Split an eSpeak IPA string into inventory units by greedy longest match.

    Args:
        ipa: IPA as returned by :func:`linformer_lab.data.espeak.phonemize`.
        on_unknown: ``"error"`` raises :class:`UnknownPhonemeError` naming every unknown symbol;
            ``"drop"`` skips them (for large external corpora where one odd word must not stop
            training -- callers should count what they drop).

    Returns:
        The phoneme units, e.g. ``"ðə tʃˈɜːtʃ"`` -> ``["ð", "ə", "tʃ", "ɜː", "tʃ"]``.
    """
    if on_unknown not in ("error", "drop"):
        raise ValueError(f"on_unknown must be 'error' or 'drop', got {on_unknown!r}")
    s = normalize_ipa(ipa)
    units: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(s):
        for width in range(min(_MAX_UNIT, len(s) - i), 0, -1):
            piece = s[i : i + width]
            if piece in PHONEME_TO_ID:
                units.append(piece)
                i += width
                break
        else:
            # Keep combining marks (U+0300..U+036F) with the unknown base symbol in the report.
            j = i + 1
            while j < len(s) and 0x300 <= ord(s[j]) <= 0x36F:
                j += 1
            if s[i:j] not in unknown:
                unknown.append(s[i:j])
            i = j
    if unknown and on_unknown == "error":
        raise UnknownPhonemeError(unknown, s)
    return units


def phonemes_to_ids(ipa: str, on_unknown: str = "error") -> list[int]:
    """Token ids (1..NUM_PHONEMES-1, never the blank) of an IPA string; see :func:`tokenize`."""
    return [PHONEME_TO_ID[u] for u in tokenize(ipa, on_unknown=on_unknown)]


def ids_to_phonemes(ids: Iterable[int], skip_blank: bool = True) -> list[str]:
    """Phoneme symbols of token ids.

    Args:
        ids: token ids (ints or a 1-D tensor/array).
        skip_blank: drop id 0 (padding / CTC blank); if ``False`` it maps to ``"<blank>"``.
    """
    out = []
    for i in ids:
        i = int(i)
        if not 0 <= i < NUM_PHONEMES:
            raise ValueError(f"phoneme id {i} out of range [0, {NUM_PHONEMES})")
        if i == BLANK_ID and skip_blank:
            continue
        out.append(PHONEMES[i])
    return out
