"""Tests of the speech data layer: eSpeak wrapper, phoneme inventory, synthetic corpus, batching,
resume. The LibriSpeech loader: ``test_data_librispeech.py``."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import fit_saving_every_step

from linformer_lab.data import espeak
from linformer_lab.data import phonemes as P
from linformer_lab.data import speech as S
from linformer_lab.data.speech import grammar as G

TINY_HOURS = 0.012  # ~43 s of audio: a handful of utterances per split
SEED = 123


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("speech_cache")


@pytest.fixture(scope="session")
def corpus(corpus_root) -> S.SyntheticSpeechCorpus:
    """A tiny synthetic corpus, generated once for the whole session."""
    c = S.SyntheticSpeechCorpus(root=corpus_root, hours=TINY_HOURS, seed=SEED, progress=False)
    assert c.generated
    return c


def vocabulary() -> frozenset[str]:
    """Every word the sentence grammar can produce (names capitalised, everything else lower case)."""
    groups = [
        G._NAMES, G._ADJECTIVES, G._ADVERBS, G._PREPOSITIONS, G._DETERMINERS, G._PLURAL_DETERMINERS, G._TIMES,
        G._NUMBERS, G._MODALS, G._DEGREE, G._CONJUNCTIONS, G._COPULA_VERBS, G._SAY_VERBS, G._FUNCTION_WORDS,
        [w for pair in G._NOUNS for w in pair], [w for pair in G._VERBS_T for w in pair],
        [w for pair in G._VERBS_I for w in pair], ("an", "that", "so"),
    ]  # fmt: skip
    return frozenset(word for group in groups for phrase in group for word in phrase.split())


def sentences(seed: int, n: int) -> list[str]:
    """The first ``n`` sentences of the generator of ``seed``."""
    return list(itertools.islice(S.SentenceGenerator(seed=seed), n))


def padding_fraction(batches, lengths) -> float:
    """Fraction of padded frames: ``1 - sum(lengths) / sum(len(batch) * max length in batch)``."""
    lengths = np.asarray(lengths)
    real = sum(int(lengths[batch].sum()) for batch in batches)
    padded = sum(int(lengths[batch].max()) * len(batch) for batch in batches)
    return 1.0 - real / max(padded, 1)


# --- eSpeak ---------------------------------------------------------------------------------------


def test_synthesis_is_deterministic_and_history_free():
    text = "The quiet engineer measured seven golden coins."
    a = espeak.synthesize(text, voice="en-us+f3", rate=160, pitch=60, seed=7)
    # Unrelated synthesis in between (in-process, so the library's hidden state does change).
    espeak.synthesize("Something else entirely.", voice="en-us+m3", isolated=False)
    b = espeak.synthesize(text, voice="en-us+f3", rate=160, pitch=60, seed=7)
    assert a.dtype == np.int16 and a.ndim == 1
    assert np.array_equal(a, b)
    c = espeak.synthesize(text, voice="en-us+f3", rate=220, pitch=60, seed=7)
    assert len(c) < len(a)  # faster speech is shorter


def test_helper_pool_serves_threads_within_its_cap():
    """Six threads synthesising at once through a pool of two helpers get the samples of calls
    made one at a time, and start no third helper (every helper started ends up idle); a helper
    that died while idle is replaced."""
    texts = [f"number {i} is a quiet word" for i in range(6)]
    want = [espeak.synthesize(text, seed=i) for i, text in enumerate(texts)]
    requests = [(text, espeak.DEFAULT_LANGUAGE, 175, 50, 50, 0, 100, i) for i, text in enumerate(texts)]
    pool = espeak._HelperPool(2)
    try:
        with ThreadPoolExecutor(len(texts)) as threads:
            got = list(threads.map(pool.synthesize, requests))
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert 1 <= len(pool.idle) <= 2
        pool.idle[-1].proc.kill()
        pool.idle[-1].proc.wait()
        assert np.array_equal(pool.synthesize(requests[0]), want[0])
        assert all(client.alive() for client in pool.idle) and len(pool.idle) <= 2
    finally:
        pool.close()


def test_audio_non_silent_with_plausible_phoneme_durations():
    for speaker in espeak.make_speakers(["f2", "m1", "klatt"], seed=3):
        text = "Did those modern villages hate your sharp driver?"
        audio = speaker.synthesize(text)
        rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
        assert rms > 300, (speaker, rms)  # int16 units; silence would be ~0
        n_phonemes = len(P.phonemes_to_ids(espeak.phonemize(text)))
        per_phoneme = len(audio) / espeak.SAMPLE_RATE / n_phonemes
        assert 0.03 < per_phoneme < 0.3, (speaker, per_phoneme)


def test_phonemize_ipa_and_separator():
    assert espeak.phonemize("Hello world") == "həlˈoʊ wˈɜːld"
    assert espeak.phonemize("the church", separator="_") == "ð_ə tʃ_ˈɜː_tʃ"
    # Several clauses: espeak_TextToPhonemes advances its text pointer clause by clause.
    assert P.normalize_ipa(espeak.phonemize("One. Two, three!")) == "wʌntuːθɹiː"


def test_speakers_deterministic():
    a = espeak.make_speakers(seed=5, per_variant=2)
    assert a == espeak.make_speakers(seed=5, per_variant=2)
    assert a != espeak.make_speakers(seed=6, per_variant=2)
    assert len(a) == 2 * len(espeak.list_variants()) and len(espeak.list_variants()) > 50
    assert all(140 <= s.rate <= 210 and 30 <= s.pitch <= 70 for s in a)
    assert [s.speaker_id for s in a] == list(range(len(a)))


# --- phoneme inventory -----------------------------------------------------------------------------


def test_inventory_layout():
    assert P.PHONEMES[0] == P.BLANK and P.BLANK_ID == 0
    assert len(set(P.PHONEMES)) == P.NUM_PHONEMES
    for unit in ("aɪ", "eɪ", "oʊ", "tʃ", "dʒ", "iː", "ɜː", "ɚ"):
        assert unit in P.PHONEME_TO_ID
    assert "ˈ" not in P.PHONEMES and "ː" not in P.PHONEMES


def test_tokenizer_conventions_and_round_trip():
    ipa = "ðə tʃˈɪldɹənz fˈaɪɚ dˈɔːɹ bˈɑːɾəl"
    tokens = P.tokenize(ipa)
    assert tokens == ["ð", "ə", "tʃ", "ɪ", "l", "d", "ɹ", "ə", "n", "z", "f", "aɪ", "ɚ",
                      "d", "ɔː", "ɹ", "b", "ɑː", "ɾ", "ə", "l"]  # fmt: skip
    ids = P.phonemes_to_ids(ipa)
    assert 0 not in ids
    assert "".join(P.ids_to_phonemes(ids)) == P.normalize_ipa(ipa)
    assert P.ids_to_phonemes([0, ids[0], 0]) == [tokens[0]]
    assert P.normalize_ipa("wˈiːː") == "wiː"


def test_unknown_symbol_error_names_it():
    with pytest.raises(P.UnknownPhonemeError) as err:
        P.phonemes_to_ids("hˈɛʍloʊ ʘ")
    assert err.value.symbols == ["ʍ", "ʘ"]
    assert "U+028D" in str(err.value) and "ʘ" in str(err.value)
    assert P.phonemes_to_ids("hɛʍ", on_unknown="drop") == P.phonemes_to_ids("hɛ")


def test_every_vocabulary_word_tokenizes_like_espeak_segments():
    """All corpus words tokenize; greedy matches eSpeak's own phoneme segmentation."""
    mismatches = []
    for word in sorted(vocabulary()):
        plain = espeak.phonemize(word)
        ids = P.phonemes_to_ids(plain)  # raises UnknownPhonemeError naming any new symbol
        assert ids, word
        # eSpeak's segmentation, with its compound units (ɔːɹ, əl, ...) split as documented.
        segmented = espeak.phonemize(word, separator="_")
        reference = [u for w in segmented.split() for ph in w.split("_") if ph for u in P.tokenize(ph)]
        if P.tokenize(plain) != reference:
            mismatches.append((word, plain, segmented))
    assert not mismatches


def test_sentences_tokenize(corpus):
    ds = corpus.dataset("train")
    for i in range(len(ds)):
        info = ds.text(i)
        assert ds.target_ids(i).tolist() == P.phonemes_to_ids(info["ipa"])
        assert info["ipa"] == espeak.phonemize(info["text"])
    for sentence in sentences(9, 200):
        P.phonemes_to_ids(espeak.phonemize(sentence))


def test_sentence_generator_deterministic_and_distinct():
    a = sentences(1, 3000)
    assert a == sentences(1, 3000)
    assert len(set(a)) == 3000
    assert a[:50] != sentences(2, 50)
    words = {w.strip(",.?") for s in a for w in s.split()}
    assert {w.lower() for w in words} <= {w.lower() for w in vocabulary()}
    assert all(s[0].isupper() and s[-1] in ".?" for s in a)


# --- synthetic corpus -----------------------------------------------------------------------------


def test_corpus_splits_sizes_and_targets(corpus):
    total = 0.0
    for split in ("train", "val", "test"):
        ds = corpus.dataset(split)
        assert len(ds) >= 1
        total += ds.seconds
        for i in range(len(ds)):
            audio = ds.audio(i)
            rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
            assert rms > 100
            n_ph = len(ds.target_ids(i))
            assert 0.03 < len(audio) / S.SAMPLE_RATE / n_ph < 0.3
            assert n_ph <= ds.lengths[i]  # CTC needs at least one frame per target
    assert TINY_HOURS * 3600 <= total < TINY_HOURS * 3600 + 40  # filled up to the requested size


def test_features_shape_and_values(corpus):
    ds = corpus.dataset("train")
    on_the_fly = corpus.dataset("train", cache_features=False)
    for i in range(len(ds)):
        item = ds[i]
        feats = item["features"]
        n = len(ds.audio(i))
        assert feats.dtype == torch.float32 and feats.shape == (n // 160 + 1, 40)
        assert feats.shape[0] == ds.lengths[i]
        assert abs(feats.shape[0] - n / S.SAMPLE_RATE / 0.010) <= 1.0
        assert torch.isfinite(feats).all()
        assert feats.mean(0).abs().max() < 1e-3 and (feats.std(0, unbiased=False) - 1).abs().max() < 1e-2
        assert item["targets"].dtype == torch.int64
        # The fp16 feature cache matches features computed from the audio.
        ref = on_the_fly.log_mel(i)
        assert torch.allclose(ds.log_mel(i), ref, atol=2e-2, rtol=1e-3)


def test_noise_is_seeded_and_changes_features(corpus):
    clean = corpus.dataset("val", cache_features=False)
    noisy = corpus.dataset("val", noise_snr_db=10.0, cache_features=False)
    w_clean, w_noisy = clean.waveform(0), noisy.waveform(0)
    assert torch.equal(w_noisy, noisy.waveform(0))
    noise = w_noisy - w_clean
    snr = 10 * torch.log10(w_clean.pow(2).mean() / noise.pow(2).mean())
    assert abs(float(snr) - 10.0) < 0.5
    cached = corpus.dataset("val", noise_snr_db=10.0)
    assert torch.allclose(cached.log_mel(0), noisy.log_mel(0), atol=2e-2, rtol=1e-3)


def test_train_and_test_speakers_disjoint(corpus):
    reserved = {s: corpus.speakers(s) for s in ("train", "val", "test")}
    variants = {s: {sp.variant for sp in v} for s, v in reserved.items()}
    ids = {s: {sp.speaker_id for sp in v} for s, v in reserved.items()}
    assert not variants["train"] & variants["test"] and not variants["train"] & variants["val"]
    assert not ids["train"] & ids["test"] and not ids["val"] & ids["test"]
    used = {s: set(corpus.dataset(s).speaker_ids.tolist()) for s in ("train", "test")}
    assert used["train"] <= ids["train"] and used["test"] <= ids["test"]


def test_cache_is_reused(corpus, corpus_root):
    meta = corpus.path / "meta.json"
    mtime = meta.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = S.SyntheticSpeechCorpus(root=corpus_root, hours=TINY_HOURS, seed=SEED, progress=False)
    assert not again.generated
    assert time.perf_counter() - t0 < 1.0
    assert meta.stat().st_mtime_ns == mtime
    assert again.path == corpus.path
    assert S.SyntheticSpeechCorpus.is_complete(corpus.path)
    assert json.loads(meta.read_text())["splits"]["train"]["utterances"] == len(corpus.dataset("train"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_interrupted_generation_is_detected(tmp_path, monkeypatch):
    hours = 0.003
    real = espeak.synthesize
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(espeak, "synthesize", failing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        S.SyntheticSpeechCorpus(root=tmp_path, hours=hours, seed=1, progress=False, num_workers=1)
    assert [p for p in tmp_path.iterdir()] == []  # no corpus published, temp dir cleaned up
    monkeypatch.setattr(espeak, "synthesize", real)

    # A hard kill (no cleanup) leaves a temp dir of a dead process: ignored, then removed.
    c = S.SyntheticSpeechCorpus(root=tmp_path / "probe", hours=hours, seed=1, progress=False)
    name = c.name
    stale = tmp_path / f".{name}.tmp-{socket.gethostname()}-{_dead_pid()}-deadbeef"
    stale.mkdir()
    (stale / "train.audio.int16").write_bytes(b"\0" * 100)
    fresh = S.SyntheticSpeechCorpus(root=tmp_path, hours=hours, seed=1, progress=False)
    assert fresh.generated and not stale.exists()
    assert S.SyntheticSpeechCorpus.is_complete(fresh.path)
    # Same configuration in another root gives a bit-identical corpus.
    assert (fresh.path / "train.audio.int16").read_bytes() == (c.path / "train.audio.int16").read_bytes()

    # A published corpus that lost a file is detected and rebuilt.
    (fresh.path / "test.audio.int16").unlink()
    assert not S.SyntheticSpeechCorpus.is_complete(fresh.path)
    with pytest.warns(UserWarning, match="incomplete"):
        rebuilt = S.SyntheticSpeechCorpus(root=tmp_path, hours=hours, seed=1, progress=False)
    assert rebuilt.generated and S.SyntheticSpeechCorpus.is_complete(rebuilt.path)


# --- batching -------------------------------------------------------------------------------------------


def test_bucket_sampler_covers_every_index_once_and_reduces_padding():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(mean=6.0, sigma=0.5, size=2000).astype(int) + 1
    sampler = S.LengthBucketBatchSampler(lengths, batch_size=16, shuffle=True, seed=3)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        assert len(batches) == len(sampler)
        orders.append(flat)
    assert orders[0] != orders[1]
    sampler.set_epoch(0)
    assert [i for b in sampler for i in b] == orders[0]  # reproducible per (seed, epoch)
    # Without set_epoch calls (Lightning only calls it on a loader's sampler) the order still
    # changes from one pass to the next.
    assert [i for b in sampler for i in b] == orders[1]

    perm = rng.permutation(len(lengths))
    random_batches = [perm[i : i + 16].tolist() for i in range(0, len(lengths), 16)]
    bucketed = padding_fraction(sampler.batches(), lengths)
    unbucketed = padding_fraction(random_batches, lengths)
    assert bucketed < 0.05 and unbucketed > 0.2 and bucketed < unbucketed / 4


def test_bucket_sampler_frame_budget_and_replicas():
    rng = np.random.default_rng(1)
    lengths = rng.integers(50, 1500, size=500)
    lengths[0] = 5000  # longer than the budget: its own batch
    sampler = S.LengthBucketBatchSampler(lengths, batch_size=None, max_frames_per_batch=4000, seed=0)
    batches = sampler.batches()
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) == 1 or len(b) * lengths[b].max() <= 4000
    parts = [
        S.LengthBucketBatchSampler(lengths, batch_size=8, seed=0, num_replicas=2, rank=r).batches() for r in (0, 1)
    ]
    assert len(parts[0]) == len(parts[1])
    covered = {i for p in parts for b in p for i in b}
    assert covered == set(range(500))
    evaluation = S.LengthBucketBatchSampler(lengths, batch_size=8, shuffle=False).batches()
    assert evaluation == S.LengthBucketBatchSampler(lengths, batch_size=8, shuffle=False).batches()


def test_datamodule_batches_follow_contract(corpus, corpus_root):
    dm = S.SpeechDataModule(root=str(corpus_root), hours=TINY_HOURS, seed=SEED, batch_size=3, progress=False)
    assert dm.num_phonemes == P.NUM_PHONEMES and dm.feature_dim == 40
    dm.prepare_data()
    dm.setup("fit")
    seen = 0
    for batch in dm.train_dataloader():
        assert set(batch) == {"features", "feature_lengths", "targets", "target_lengths"}
        f, fl, t, tl = batch["features"], batch["feature_lengths"], batch["targets"], batch["target_lengths"]
        B = f.shape[0]
        assert f.dtype == torch.float32 and f.shape[2] == 40 and f.shape[1] == int(fl.max())
        assert fl.dtype == tl.dtype == t.dtype == torch.int64 and fl.shape == tl.shape == (B,)
        assert t.shape[1] == int(tl.max())
        for b in range(B):
            assert (t[b, : tl[b]] > 0).all() and (t[b, tl[b] :] == 0).all()
            assert (f[b, fl[b] :] == 0).all()
        seen += B
    assert seen == len(dm.datasets["train"])
    val = next(iter(dm.val_dataloader()))
    assert val["features"].shape[0] <= 3


# ---------------------------------------------------------------- mid-epoch resume


class RecordBatches(L.LightningModule):
    """Records which utterances every training step saw."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, batch["feature_lengths"].tolist(), batch["targets"].tolist()))
        return self.w * batch["features"].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs write to their own dirs on purpose
def test_speech_resume_sees_same_batches(corpus_root, tmp_path):
    """The speech train loader resumes mid-epoch like the copy and image loaders (one
    EpochSampler protocol): a run resumed from any step's checkpoint sees exactly the batches
    an uninterrupted run saw from that step on, in the same order."""
    def fit(name, ckpt_path=None):
        dm = S.SpeechDataModule(root=str(corpus_root), hours=TINY_HOURS, seed=SEED, batch_size=4, progress=False)
        model = RecordBatches()
        fit_saving_every_step(model, dm, tmp_path / name, ckpt_path)
        return model.seen

    full = fit("full")
    per_epoch = sum(1 for s in full if s[0] == 0)
    assert per_epoch >= 3 and len(full) == 2 * per_epoch
    assert [s[2:] for s in full[:per_epoch]] != [s[2:] for s in full[per_epoch:]]  # epochs are ordered differently
    for step in [1, per_epoch, per_epoch + 1]:  # mid-epoch, end of epoch, mid second epoch
        assert fit(f"resumed{step}", tmp_path / "full" / f"step={step}.ckpt") == full[step:], step
