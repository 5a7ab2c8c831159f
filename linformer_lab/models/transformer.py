"""The transformer of paper eq. 1, with a parallel path and a recurrent path (§3.4).

Each layer is pre-norm: ``x = x + attention(norm(x)); x = x + feedforward(norm(x))``.
``forward`` runs a whole sequence (training, evaluation); ``step`` runs one position with a
per-layer state (generation). Both go through the same weights, and a test checks that
they agree for every backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.base import SequenceBuffer
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.ops.fast_step import step_linear


class TransformerLayer(nn.Module):
    """One layer: ``(B, N, d_model) -> (B, N, d_model)``."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        attention: AttentionConfig | str | dict | None = None,
        causal: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.norm_attention = nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, n_heads, attention=attention, causal=causal)
        self.norm_ff = nn.LayerNorm(d_model)
        self.feedforward = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )
        self.dropout = nn.Dropout(dropout)
        # The feed-forward's parts for step() as a plain tuple (not registered twice): unpacking
        # it is cheaper than iterating the Sequential at every position.
        self._feedforward_parts = tuple(self.feedforward)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm_attention(x), key_lengths=key_lengths))
        return x + self.dropout(self.feedforward(self.norm_ff(x)))

    def step(self, x_t: torch.Tensor, state=None):
        """:meth:`forward` at one position: ``(B, d_model) -> ((B, d_model), state)``.

        Written with functional calls (``torch.layer_norm`` directly -- ``F.layer_norm`` also
        reads a backend flag property on every call -- and :func:`step_linear`) instead of
        module calls: the step runs once per position and layer on one row per sequence, where
        the module-call machinery is a large part of the time. Same weights and arithmetic as
        :meth:`forward`, in training mode (dropout) and eval mode alike; module hooks on the
        sub-modules do not run here.
        """
        norm = self.norm_attention
        attended, state = self.attention.step(
            torch.layer_norm(x_t, norm.normalized_shape, norm.weight, norm.bias, norm.eps), state
        )
        x_t = x_t + self._dropout(attended, self.dropout)
        norm = self.norm_ff
        up, activation, inner_dropout, down = self._feedforward_parts
        hidden = step_linear(torch.layer_norm(x_t, norm.normalized_shape, norm.weight, norm.bias, norm.eps), up)
        hidden = self._dropout(F.gelu(hidden, approximate=activation.approximate), inner_dropout)
        return x_t + self._dropout(step_linear(hidden, down), self.dropout), state

    def _dropout(self, x: torch.Tensor, dropout: nn.Dropout) -> torch.Tensor:
        # the identity in eval mode (generation) and at p = 0, without a call
        return F.dropout(x, dropout.p, training=True) if self.training and dropout.p > 0 else x


class Transformer(nn.Module):
    """A stack of :class:`TransformerLayer` plus a final LayerNorm.

    ``forward(x (B, N, d_model), key_lengths=None) -> (B, N, d_model)``;
    ``step(x_t (B, d_model), state=None) -> ((B, d_model), state)`` where ``state`` is a
    list with one backend state per layer (``None`` to start from the empty prefix). For
    backends without a recurrent form (lsh) the state is the input prefix and every step
    re-runs ``forward`` on it, so step outputs equal the forward over the same prefix.

    Args: n_layers, d_model, n_heads, d_ff (default 4 d_model), attention (anything
    :meth:`AttentionConfig.coerce` takes: a config, a backend name, a dict, None for
    ``linear``), causal, dropout.
    """

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        attention: AttentionConfig | str | dict | None = None,
        causal: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        attention = AttentionConfig.coerce(attention)
        self.layers = nn.ModuleList(
            TransformerLayer(d_model, n_heads, d_ff or 4 * d_model, attention=attention, causal=causal, dropout=dropout)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_lengths=key_lengths)
        return self.norm(x)

    @property
    def has_recurrent_form(self) -> bool:
        return all(layer.attention.attention.has_recurrent_form for layer in self.layers)

    def step(self, x_t: torch.Tensor, state: list | None = None):
        # whether the stack has a recurrent form is decided on a sequence's first step; the
        # kind of state says it afterwards (saves walking the layers at every step)
        recurrent = self.has_recurrent_form if state is None else not isinstance(state, SequenceBuffer)
        if not recurrent:
            # lsh: no recurrent form exists, so re-run the whole stack on the prefix (the
            # paper's generation baseline); the state is the prefix of inputs
            state = state if state is not None else SequenceBuffer(x_t, dim=1)
            state.append(x_t)
            return self.forward(state.filled)[:, -1], state
        if state is None:
            state = [None] * len(self.layers)
        new_state = []
        for layer, layer_state in zip(self.layers, state):
            x_t, layer_state = layer.step(x_t, layer_state)
            new_state.append(layer_state)
        norm = self.norm
        return torch.layer_norm(x_t, norm.normalized_shape, norm.weight, norm.bias, norm.eps), new_state
