"""CTC decoding and phoneme error rate (linformer_lab.models.ctc)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from linformer_lab.models.ctc import (
    PhonemeErrorRate,
    beam_decode,
    edit_distance,
    greedy_decode,
    prefix_beam_search,
)

BLANK, A, B, C = 0, 1, 2, 3


def collapse(path: list[int]) -> list[int]:
    """CTC's many-to-one map on one frame path, written out: merge repeats, then drop blanks."""
    out, previous = [], None
    for token in path:
        if token != previous and token != BLANK:
            out.append(token)
        previous = token
    return out


def one_hot_log_probs(path: list[int], num_classes: int = 4, peak: float = 0.9) -> torch.Tensor:
    """(T, C) log-probabilities whose per-frame argmax is ``path``."""
    probs = torch.full((len(path), num_classes), (1 - peak) / (num_classes - 1))
    probs[torch.arange(len(path)), torch.tensor(path)] = peak
    return probs.log()


# ------------------------------------------------------------------ greedy decoding


def test_greedy_collapses_repeats_and_drops_blanks():
    path = [A, A, BLANK, A, B, B, BLANK]
    assert collapse(path) == [A, A, B]  # the blank separates the two a's; b b merges
    assert greedy_decode(one_hot_log_probs(path)[None]) == [[A, A, B]]


def test_greedy_batch_respects_lengths():
    # Utterance 2 is 3 frames long; its padding frames hold a C that must not be decoded.
    paths = [[BLANK, A, A, B, BLANK, C], [B, BLANK, B, C, C, C]]
    log_probs = torch.stack([one_hot_log_probs(p) for p in paths])
    assert greedy_decode(log_probs, torch.tensor([6, 3])) == [[A, B, C], [B, B]]
    assert greedy_decode(log_probs) == [[A, B, C], [B, B, C]]


def test_greedy_edge_cases():
    assert greedy_decode(one_hot_log_probs([BLANK, BLANK, BLANK])[None]) == [[]]
    assert greedy_decode(one_hot_log_probs([C])[None]) == [[C]]
    assert collapse([]) == []


# ------------------------------------------------------------------ beam search


def path_probability(log_probs: torch.Tensor, labels: list[int]) -> float:
    """Brute force: total probability of every frame path that collapses to ``labels``."""
    t, c = log_probs.shape
    total = 0.0
    probs = log_probs.exp()
    for code in range(c**t):
        path, rest = [], code
        for _ in range(t):
            path.append(rest % c)
            rest //= c
        if collapse(path) == labels:
            total += math.prod(float(probs[i, p]) for i, p in enumerate(path))
    return total


def test_beam_search_finds_most_probable_labelling_where_greedy_does_not():
    # Frame-wise best path is blank blank (greedy: empty), but the labelling [a] collects the
    # paths a-, -a and aa whose sum beats blank-blank's 0.6 * 0.6 = 0.36.
    probs = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.6, 0.4, 0.0, 0.0]]).clamp_min(1e-9)
    log_probs = probs.log()
    assert greedy_decode(log_probs[None]) == [[]]
    assert path_probability(log_probs, [A]) > path_probability(log_probs, [])
    assert prefix_beam_search(log_probs, beam_width=4) == [A]


def test_beam_search_matches_brute_force_on_random_posteriors():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        log_probs = torch.randn(4, 3, generator=gen).mul(2).log_softmax(-1)
        labellings = {tuple(collapse(p)) for p in _all_paths(4, 3)}
        best = max(labellings, key=lambda lab: path_probability(log_probs, list(lab)))
        assert prefix_beam_search(log_probs, beam_width=16) == list(best)


def _all_paths(t: int, c: int):
    for code in range(c**t):
        yield [(code // c**i) % c for i in range(t)]


def test_beam_decode_batch_uses_lengths():
    paths = [[BLANK, A, A, B, BLANK, C], [B, BLANK, B, C, C, C]]
    log_probs = torch.stack([one_hot_log_probs(p) for p in paths])
    # confident one-hot posteriors: beam search agrees with greedy
    assert beam_decode(log_probs, torch.tensor([6, 3]), beam_width=4) == [[A, B, C], [B, B]]


# ------------------------------------------------------------------ edit distance and PER


@pytest.mark.parametrize(
    "ref, hyp, expected",
    [
        ([A, B, C], [A, B, C], 0),
        ([A, B, C], [A, C, C], 1),  # substitution
        ([A, B, C], [A, B, B, C], 1),  # insertion
        ([A, B, C], [A, C], 1),  # deletion
        ([A, B, C], [], 3),  # empty hypothesis: all deletions
        ([], [A, B], 2),  # empty reference: all insertions
        ([A, B, C, A], [B, C, A, B], 2),  # delete the first a, insert a b at the end
        ([A, A, A], [B, B, B, B, B], 5),  # 3 substitutions + 2 insertions
    ],
)
def test_edit_distance_hand_computed(ref, hyp, expected):
    assert edit_distance(ref, hyp) == expected
    assert edit_distance(hyp, ref) == expected  # symmetric with unit costs


def _reference_levenshtein(a, b) -> int:
    # The textbook O(|a| |b|) table, to check the vectorised rows against.
    table = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return table[-1][-1]


def test_edit_distance_matches_textbook_table_on_random_strings():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(12))]
        b = [rng.randrange(4) for _ in range(rng.randrange(12))]
        assert edit_distance(a, b) == _reference_levenshtein(a, b)


def test_per_aggregates_edit_sums_across_batches():
    metric = PhonemeErrorRate()
    # batch 1: 1 substitution in 3 + 1 deletion in 2; batch 2: empty hypothesis of 4, 1 insertion in 1
    metric.update([[A, C, C], [A]], [[A, B, C], [A, B]])
    assert metric.compute().item() == pytest.approx(2 / 5)
    metric.update([[], torch.tensor([A, B])], [[C, C, C, C], torch.tensor([A])])
    # corpus-level: (1 + 1 + 4 + 1) / (3 + 2 + 4 + 1), not the mean of per-utterance rates
    assert metric.compute().item() == pytest.approx(7 / 10)
    metric.reset()
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert metric.compute().item() == 0.0  # nothing seen: 0, not a division by zero
    with pytest.raises(ValueError):
        metric.update([[A]], [[A], [B]])


def test_per_states_reduce_by_sum():
    # Two "ranks" merged the way DDP's sync does (dist_reduce_fx="sum") give the pooled PER.
    left, right = PhonemeErrorRate(), PhonemeErrorRate()
    left.update([[A, B]], [[A, B, C]])  # 1 / 3
    right.update([[C]], [[A]])  # 1 / 1
    left.merge_state(right)
    assert left.compute().item() == pytest.approx(2 / 4)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("subsample", [1, 2])
def test_packed_transformer_ctc_equals_padded(attention, subsample, monkeypatch):
    """packed=True (the layers on utterances back to back, cu_seqlens) gives the padded model's
    log-probs and gradients at every real frame, and really runs packed."""
    from linformer_lab.models.ctc import TransformerCTC

    torch.manual_seed(0)
    padded = TransformerCTC(56, attention=attention, d_model=32, n_layers=2, n_heads=2, subsample=subsample).double()
    packed = TransformerCTC(56, attention=attention, d_model=32, n_layers=2, n_heads=2, subsample=subsample,
                            packed=True).double()
    packed.load_state_dict(padded.state_dict())
    features = torch.randn(3, 20, 40, dtype=torch.float64)
    lengths = torch.tensor([20, 7, 13])
    calls = []
    backend = packed.transformer.layers[0].attention.attention
    original = type(backend).forward
    monkeypatch.setattr(type(backend), "forward",
                        lambda self, *a, **k: calls.append(k.get("cu_seqlens")) or original(self, *a, **k))
    (want, want_lengths), (got, got_lengths) = padded(features, lengths), packed(features, lengths)
    assert torch.equal(want_lengths, got_lengths)
    assert calls and calls[-1] is not None and calls[-1].tolist()[-1] == int(got_lengths.sum())
    real = torch.arange(want.shape[1])[None] < want_lengths[:, None]
    assert torch.allclose(want[real], got[real], rtol=1e-10, atol=1e-10)
    g = torch.randn_like(want) * real[..., None]
    for p, q in zip(padded.parameters(), packed.parameters()):
        (gp,) = torch.autograd.grad((want * g).sum(), p, retain_graph=True)
        (gq,) = torch.autograd.grad((got * g).sum(), q, retain_graph=True)
        assert torch.allclose(gp, gq, rtol=1e-9, atol=1e-10)


def test_packed_needs_a_backend_that_takes_packed_sequences():
    from linformer_lab.models.ctc import TransformerCTC

    with pytest.raises(ValueError, match="packed=True needs an attention backend"):
        TransformerCTC(56, attention="lsh", d_model=32, n_layers=1, n_heads=1, packed=True)
