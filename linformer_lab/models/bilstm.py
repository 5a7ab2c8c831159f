"""The paper's recurrent baseline for speech (§4.3, Table 3): a bidirectional LSTM with CTC output."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from linformer_lab.ops.masks import length_mask
from linformer_lab.validation import check_at_least, check_dropout


def reverse_within_lengths(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse every sequence of ``x (B, T, F)`` inside its own length, leaving padding in place:
    ``[x0 x1 x2 pad pad] -> [x2 x1 x0 pad pad]``; its own inverse. It lets the backward direction
    of a bidirectional LSTM run over a padded batch and still start at each real last frame."""
    t = x.shape[1]
    steps = torch.arange(t, device=x.device)
    lengths = lengths.to(x.device)[:, None]
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)  # (B, T)
    return x.gather(1, index[..., None].expand_as(x))


class BiLSTMCTC(nn.Module):
    """Stacked bidirectional LSTM over frames, then a linear layer to phonemes + blank.

    ``forward(features (B, T, F), lengths (B,)) -> (log_probs (B, T, C) float32, lengths (B,))``,
    the interface of :class:`linformer_lab.models.ctc.TransformerCTC`.

    Each layer has two unidirectional LSTMs, ``left_to_right`` and ``right_to_left``; the second
    reads every utterance reversed within its length (:func:`reverse_within_lengths`), so both
    start and stop at the real ends and a padded utterance gives exactly its outputs alone. Two
    ways to run the LSTMs, same parameters and results:

    * ``packed=True``: packed sequences (``pack_padded_sequence``); cuDNN then skips the padding.
    * ``packed=False``: padded batches, still exact on valid frames (an LSTM is causal in its
      reading direction, and the padding comes last in both readings). The fast path on CPU,
      where the packed-sequence backward runs step by step through autograd.

    Default ``packed=None``: packed on CUDA, padded elsewhere.

    Args:
        num_phonemes: output classes including the blank (id 0).
        feature_dim: input features per frame (40).
        hidden_size: units per direction (paper: 320).
        n_layers: stacked bidirectional layers (paper: 3).
        dropout: between LSTM layers and before the output layer.
        packed: see above.
    """

    def __init__(self, num_phonemes: int, feature_dim: int = 40, hidden_size: int = 320, n_layers: int = 3,
                 dropout: float = 0.0, packed: bool | None = None):
        super().__init__()
        check_at_least("lstm_hidden", hidden_size, 1, "LSTM units per direction")
        check_at_least("lstm_layers", n_layers, 1, "stacked bidirectional LSTM layers")
        check_dropout(dropout)
        self.packed = packed
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            in_dim = feature_dim if i == 0 else 2 * hidden_size
            self.layers.append(
                nn.ModuleDict({
                    "left_to_right": nn.LSTM(in_dim, hidden_size, batch_first=True),
                    "right_to_left": nn.LSTM(in_dim, hidden_size, batch_first=True),
                })
            )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * hidden_size, num_phonemes)

    def _run(self, lstm: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor, packed: bool) -> torch.Tensor:
        if not x.is_cuda and torch.is_autocast_enabled("cpu"):
            # CPU bf16 autocast sends the LSTM to oneDNN's bf16 kernel, which CPUs without bf16
            # instructions reject ("could not create a primitive descriptor"): run it in fp32
            with torch.autocast("cpu", enabled=False):
                return self._run(lstm, x.float(), lengths, packed)
        if not packed:
            return lstm(x)[0]
        sequence = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(lstm(sequence)[0], batch_first=True, total_length=x.shape[1])
        return out

    def encode(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(B, T, F), (B,) -> (B, T, 2 hidden_size)``, zeros at padded frames."""
        packed = features.is_cuda if self.packed is None else self.packed
        valid = length_mask(lengths.to(features.device), features.shape[1])[..., None]
        x = features
        for i, layer in enumerate(self.layers):
            if i:
                x = self.dropout(x)
            left = self._run(layer["left_to_right"], x, lengths, packed)
            right = self._run(layer["right_to_left"], reverse_within_lengths(x, lengths), lengths, packed)
            right = reverse_within_lengths(right, lengths)
            # zero the padded frames as packing does, so the next layer sees the same either way
            x = torch.cat([left, right], dim=-1) * valid.to(left.dtype)
        return x

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.dropout(self.encode(features, lengths))
        # fp32 log_softmax for the CTC sums (see TransformerCTC.forward)
        return torch.log_softmax(self.head(hidden).float(), dim=-1), lengths
