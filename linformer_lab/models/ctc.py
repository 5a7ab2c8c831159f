"""CTC acoustic modelling (paper §4.3): the transformer acoustic model, decoding and PER.

Everything that turns frames into phoneme posteriors and posteriors into phoneme strings:

* :class:`TransformerCTC` -- frames ``(B, T, 40)`` -> input projection (optionally a 2x
  subsampling convolution) -> positions -> non-causal :class:`~linformer_lab.models.transformer.Transformer`
  over any registered attention backend -> linear -> ``log_softmax`` over phonemes + blank.
  (The Bi-LSTM baseline with the same interface is :class:`linformer_lab.models.bilstm.BiLSTMCTC`.)
* :func:`greedy_decode` -- best path: argmax per frame, collapse repeats, drop blanks.
* :func:`prefix_beam_search` -- CTC prefix beam search (no language model), optional.
* :func:`edit_distance` and :class:`PhonemeErrorRate` -- Levenshtein distance over phoneme ids
  and its corpus-level ratio ``sum(edits) / sum(reference lengths)``.

Blank is id 0 throughout (``linformer_lab.data.phonemes.BLANK_ID``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torchmetrics import Metric

from linformer_lab.attention.base import backends_with
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.transformer import Transformer, sinusoidal_positions
from linformer_lab.ops.masks import length_mask
from linformer_lab.validation import check_at_least, check_transformer_shape

BLANK = 0

# ================================================================================================
# Acoustic model
# ================================================================================================


class TransformerCTC(nn.Module):
    """Non-causal transformer acoustic model with a CTC output layer.

    ``forward(features (B, T, F), lengths (B,)) -> (log_probs (B, T', C) float32, out_lengths (B,))``
    with ``T' = T`` (``ceil(T / 2)`` with ``subsample=2``) and ``C = num_phonemes`` (blank = 0).
    Frames at ``>= out_lengths[b]`` are padding with unspecified values that never influence the
    real frames (attention masks the padded keys, every other layer acts per frame, and the
    subsampling convolution sees zeros beyond the end, as for the utterance alone).

    Args:
        num_phonemes: output classes including the blank.
        feature_dim: input features per frame (40 log-mel energies).
        d_model, n_layers, n_heads, d_ff (default 4 d_model), dropout: transformer shape
            (paper: 9 layers, 6 heads of 32 dims = 192, feed-forward 768).
        attention: anything :meth:`AttentionConfig.coerce` takes (a config, a backend name, a
            dict of its fields, None for ``linear``); kept as ``attention_config``.
        positions: ``"sinusoidal"`` (fixed, any length) or ``"learned"`` (an embedding of
            ``max_positions`` rows; longer inputs are an error).
        position_scale: factor of the sinusoidal encodings; None = ``1 / sqrt(d_model)``. At
            amplitude 1 (Vaswani et al. scale the *embeddings* up instead) the encodings carry as
            much variance as the projected features, and CTC training sits on the all-blank
            plateau while the model learns to see past them (``benchmarks/dev/results/speech_probes.md``:
            not left in 600 updates at 1, left after ~260 at 1/sqrt(d_model)).
        subsample: 1 (the paper: one transformer position per 10 ms frame) or 2 (a stride-2
            convolution first halves the sequence, ~4x cheaper softmax attention).
        packed: run the transformer layers on the utterances packed back to back (one row,
            ``cu_seqlens`` offsets), so no padding is computed; the per-frame projection,
            convolution and positions still run padded, and the output comes back padded. Same
            results; whether it is faster depends on the padding
            (``benchmarks/dev/results/state_benchmarks.md``). Needs a backend with
            ``supports_packed`` (linear, softmax).
    """

    def __init__(
        self,
        num_phonemes: int,
        feature_dim: int = 40,
        d_model: int = 192,
        n_layers: int = 9,
        n_heads: int = 6,
        d_ff: int | None = None,
        dropout: float = 0.0,
        attention: AttentionConfig | str | dict | None = None,
        positions: str = "sinusoidal",
        max_positions: int = 4096,
        subsample: int = 1,
        position_scale: float | None = None,
        packed: bool = False,
    ):
        super().__init__()
        check_transformer_shape(d_model, n_heads, n_layers, d_ff, dropout)
        check_at_least("num_phonemes", num_phonemes, 2, "output classes including the CTC blank")
        check_at_least("feature_dim", feature_dim, 1, "features per frame")
        check_at_least("max_positions", max_positions, 1, "rows of the learned position table")
        if positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {positions!r}")
        if subsample not in (1, 2):
            raise ValueError(f"subsample must be 1 or 2, got {subsample}")
        self.subsample = subsample
        self.positions = positions
        self.d_model = d_model
        self.position_scale = d_model**-0.5 if position_scale is None else float(position_scale)
        if subsample == 1:
            self.input_projection = nn.Linear(feature_dim, d_model)
        else:
            # kernel 3, stride 2: every input frame is seen, neighbouring outputs overlap by one
            self.input_projection = nn.Conv1d(feature_dim, d_model, kernel_size=3, stride=2, padding=1)
        if positions == "learned":
            self.position_embedding = nn.Embedding(max_positions, d_model)
            nn.init.normal_(self.position_embedding.weight, std=0.02)
        self.input_dropout = nn.Dropout(dropout)
        self.attention_config = AttentionConfig.coerce(attention)
        self.transformer = Transformer(
            n_layers, d_model, n_heads, d_ff, causal=False, dropout=dropout, attention=self.attention_config
        )
        self.head = nn.Linear(d_model, num_phonemes)
        self.packed = packed
        backend = self.transformer.layers[0].attention.attention
        if packed and not backend.supports_packed:
            raise ValueError(f"packed=True needs an attention backend that takes packed sequences "
                             f"({backends_with('supports_packed')}); {type(backend).__name__} does not")

    def embed(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, T, F), (B,) -> (B, T', d_model), (B,)``: projection plus positions."""
        if self.subsample == 1:
            x = self.input_projection(features)
        else:
            # Zero the padding first: the window at the last real frame reaches one frame past the
            # end, which must read 0 (as for the utterance alone) whatever the loader padded with.
            features = features * length_mask(lengths, features.shape[1])[..., None].to(features.dtype)
            x = self.input_projection(features.transpose(1, 2)).transpose(1, 2)
            lengths = (lengths + 1) // 2  # ceil(T / 2) frames out of kernel 3, stride 2, padding 1
        n = x.shape[1]
        if self.positions == "sinusoidal":
            x = x + self.position_scale * sinusoidal_positions(n, self.d_model, device=x.device, dtype=x.dtype)
        else:
            if n > self.position_embedding.num_embeddings:
                raise ValueError(
                    f"utterance of {n} positions exceeds max_positions={self.position_embedding.num_embeddings} "
                    f"of the learned position embedding; raise max_positions or use positions='sinusoidal'"
                )
            x = x + self.position_embedding.weight[:n]
        return self.input_dropout(x), lengths

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, out_lengths = self.embed(features, lengths)
        if self.packed:
            valid = length_mask(out_lengths, x.shape[1])  # (B, T')
            offsets = torch.zeros(len(out_lengths) + 1, dtype=torch.long, device=x.device)
            offsets[1:] = out_lengths.cumsum(0)
            packed = self.transformer(x[valid].unsqueeze(0), cu_seqlens=offsets)  # (1, sum T', d)
            x = x.new_zeros(x.shape).masked_scatter(valid[..., None], packed[0])
        else:
            x = self.transformer(x, key_lengths=out_lengths)
        # log_softmax in fp32: under bf16 autocast the logits are bf16, whose 8-bit mantissa
        # would quantise the log-probabilities CTC sums over thousands of paths.
        return torch.log_softmax(self.head(x).float(), dim=-1), out_lengths


# ================================================================================================
# Decoding
# ================================================================================================


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor | None = None, blank: int = BLANK) -> list[list[int]]:
    """Best-path decoding of a batch.

    Args:
        log_probs: ``(B, T, C)`` frame scores (log-probabilities or logits: only the argmax counts).
        lengths: ``(B,)`` real frames per utterance (None = all ``T``).
    Returns:
        one list of label ids per utterance.
    """
    best = log_probs.argmax(dim=-1)  # (B, T)
    b, t = best.shape
    # keep a frame that is not blank, differs from the previous one and lies inside the utterance
    keep = best != blank
    keep[:, 1:] &= best[:, 1:] != best[:, :-1]
    if lengths is not None:
        keep &= length_mask(lengths.to(best.device), t)
    best, keep = best.cpu(), keep.cpu()
    return [best[i][keep[i]].tolist() for i in range(b)]


def _logaddexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


def prefix_beam_search(
    log_probs: torch.Tensor,
    beam_width: int = 8,
    blank: int = BLANK,
    token_prune: int | None = None,
) -> list[int]:
    """CTC prefix beam search for one utterance (no language model).

    Tracks, per surviving label prefix, the log-probability of all its paths ending in a blank
    (``p_b``) or in its last label (``p_nb``): the split lets ``a blank a`` extend a prefix to
    ``a a`` while ``a a`` stays ``a``. With ``beam_width=1`` it is close to, not always equal to,
    greedy decoding (it sums paths instead of following the best one).

    Args:
        log_probs: ``(T, C)`` log-probabilities of one utterance (padding already removed).
        beam_width: prefixes kept after every frame.
        token_prune: labels considered per frame, the most likely ones (default ``beam_width``);
            the blank is always considered.
    Returns:
        the most probable label sequence.
    """
    lp = log_probs.detach().float().cpu().numpy()
    t_max, c = lp.shape
    k = min(c, token_prune or beam_width)
    # prefix (tuple) -> (log p ending in blank, log p ending in its last label)
    beams: dict[tuple[int, ...], tuple[float, float]] = {(): (0.0, -math.inf)}
    for t in range(t_max):
        frame = lp[t]
        candidates = np.argpartition(-frame, k - 1)[:k] if k < c else np.arange(c)
        candidates = [int(x) for x in candidates if x != blank]
        next_beams: dict[tuple[int, ...], list[float]] = {}

        def add(prefix, pb=-math.inf, pnb=-math.inf):
            entry = next_beams.setdefault(prefix, [-math.inf, -math.inf])
            entry[0] = _logaddexp(entry[0], pb)
            entry[1] = _logaddexp(entry[1], pnb)

        for prefix, (pb, pnb) in beams.items():
            total = _logaddexp(pb, pnb)
            add(prefix, pb=total + float(frame[blank]))  # a blank keeps the prefix
            if prefix:  # repeating the last label without a blank between keeps it too
                add(prefix, pnb=pnb + float(frame[prefix[-1]]))
            for token in candidates:
                p = float(frame[token])
                if prefix and token == prefix[-1]:
                    # a repeated label only extends the prefix after a blank
                    add(prefix + (token,), pnb=pb + p)
                else:
                    add(prefix + (token,), pnb=total + p)
        ranked = sorted(next_beams.items(), key=lambda kv: _logaddexp(*kv[1]), reverse=True)
        beams = {prefix: (v[0], v[1]) for prefix, v in ranked[:beam_width]}
    best = max(beams.items(), key=lambda kv: _logaddexp(*kv[1]))[0]
    return list(best)


def beam_decode(log_probs: torch.Tensor, lengths: torch.Tensor, beam_width: int = 8, blank: int = BLANK) -> list[list[int]]:
    """:func:`prefix_beam_search` on every utterance of ``(B, T, C)`` log-probs with lengths ``(B,)``."""
    return [
        prefix_beam_search(log_probs[i, : int(lengths[i])], beam_width=beam_width, blank=blank)
        for i in range(log_probs.shape[0])
    ]


# ================================================================================================
# Phoneme error rate
# ================================================================================================


def edit_distance(reference: Sequence[int], hypothesis: Sequence[int]) -> int:
    """Levenshtein distance (substitutions + insertions + deletions, each costing 1).

    One numpy row per reference token: with ``cand[j]`` the best cost reaching column ``j`` by a
    match/substitution or a deletion, insertion chains give
    ``row[j] = min_{k <= j} cand[k] + (j - k) = j + cummin(cand - arange)[j]``: a few vector
    operations per row instead of a Python loop over the hypothesis.
    """
    hyp = np.asarray(hypothesis, dtype=np.int64)
    n = len(hyp)
    if len(reference) == 0:
        return n
    if n == 0:
        return len(reference)
    steps = np.arange(n + 1)
    row = steps.copy()  # distance from the empty reference prefix: j insertions
    for i, token in enumerate(reference, start=1):
        cand = np.empty(n + 1, dtype=np.int64)
        cand[0] = i  # i deletions
        cand[1:] = np.minimum(row[:-1] + (hyp != token), row[1:] + 1)  # match/substitute, delete
        row = steps + np.minimum.accumulate(cand - steps)
    return int(row[-1])


class PhonemeErrorRate(Metric):
    """Corpus-level PER: ``sum of edit distances / sum of reference lengths``.

    Summing both (rather than averaging per-utterance rates) weights every phoneme equally, the
    standard definition, and lets the ranks' sums combine exactly under DDP.

    ``update(predictions, references)``: two equal-length sequences of label-id sequences
    (lists or 1-d tensors). ``compute()`` -> scalar tensor (0 when no reference phonemes were seen).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("errors", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> None:
        if len(predictions) != len(references):
            raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
        errors = total = 0
        for hyp, ref in zip(predictions, references):
            hyp = hyp.tolist() if isinstance(hyp, torch.Tensor) else hyp
            ref = ref.tolist() if isinstance(ref, torch.Tensor) else ref
            errors += edit_distance(ref, hyp)
            total += len(ref)
        self.errors += errors
        self.total += total

    def compute(self) -> torch.Tensor:
        return (self.errors.double() / self.total.clamp_min(1).double()).float()
