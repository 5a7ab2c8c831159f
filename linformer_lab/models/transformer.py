"""The transformer of paper eq. 1, with a parallel path and a recurrent path (§3.4).

Each layer is pre-norm by default: ``x = x + attention(norm(x)); x = x + feedforward(norm(x))``;
``norm_first=False`` makes it post-norm, as in Vaswani et al. and the authors' copy-task model:
``x = norm(x + attention(x)); x = norm(x + feedforward(x))``. The feed-forward's activation is GELU
by default, ReLU on request. ``forward`` runs a whole sequence, ``step`` one position with a
per-layer state (generation); a test checks that they agree for every backend.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from linformer_lab.attention.base import Attention
from linformer_lab.attention.config import AttentionConfig, as_config
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.ops.state import SequenceBuffer, StackState, detach_state

#: The feed-forward activations a layer offers (``activation``).
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class TransformerLayer(nn.Module):
    """One layer: ``(B, N, d_model) -> (B, N, d_model)``; ``attention`` as for
    :class:`~linformer_lab.attention.multihead.MultiHeadAttention`: a backend name, a dict of
    :class:`AttentionConfig` fields, a config, None (the default), or a built :class:`Attention`.
    ``norm_first`` (default True): pre-norm; False: post-norm (module docstring). ``activation``:
    ``"gelu"`` (default) or ``"relu"``.

    A post-norm layer keeps its norms as ``norm_after_attention`` / ``norm_after_ff`` and its
    ``norm_attention`` / ``norm_ff`` are None: the generation fast paths read those two as the
    pre-norm's, so on a post-norm stack they fail at once instead of computing another function.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        attention: AttentionConfig | Attention | str | dict | None = None,
        causal: bool = True,
        dropout: float = 0.0,
        norm_first: bool = True,
        activation: str = "gelu",
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"TransformerLayer: unknown activation {activation!r}; valid choices: {', '.join(ACTIVATIONS)}")
        self.norm_first = norm_first
        # Registration order is the order of parameters(), which an optimizer's saved state is keyed
        # by: norm, attention, norm, feed-forward, as checkpoints have always had it.
        self.norm_attention = nn.LayerNorm(d_model) if norm_first else None
        self.attention = MultiHeadAttention(d_model, n_heads, attention=attention, causal=causal)
        self.norm_ff = nn.LayerNorm(d_model) if norm_first else None
        if not norm_first:
            self.norm_after_attention, self.norm_after_ff = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.feedforward = nn.Sequential(
            nn.Linear(d_model, d_ff), ACTIVATIONS[activation](), nn.Dropout(dropout), nn.Linear(d_ff, d_model)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None, state=None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        """``(B, N, d_model) -> (B, N, d_model)``, with ``return_state`` ``(out, attention state)``."""
        attended = self.attention(self.norm_attention(x) if self.norm_first else x, key_lengths=key_lengths, state=state,
                                  return_state=return_state, cu_seqlens=cu_seqlens)
        attended, state = attended if return_state else (attended, None)
        x = self._feedforward_block(x, attended)
        return (x, state) if return_state else x

    def _feedforward_block(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer once the attention ran: both residuals, the feed-forward, the norms."""
        if self.norm_first:
            x = x + self.dropout(attended)
            return x + self.dropout(self.feedforward(self.norm_ff(x)))
        x = self.norm_after_attention(x + self.dropout(attended))
        return self.norm_after_ff(x + self.dropout(self.feedforward(x)))

    def step(self, x_t: torch.Tensor, state=None):
        """:meth:`forward` at one position: ``(B, d_model) -> ((B, d_model), state)``; the attention's
        state is None at a sequence's first position, and a new one is returned."""
        attended, state = self.attention.step(self.norm_attention(x_t) if self.norm_first else x_t, state)
        return self._feedforward_block(x_t, attended), state


class Transformer(nn.Module):
    """A stack of :class:`TransformerLayer` plus a final LayerNorm.

    ``forward(x (B, N, d_model), key_lengths=None) -> (B, N, d_model)``;
    ``step(x_t (B, d_model), state=None) -> ((B, d_model), state)`` where ``state`` is a
    :class:`~linformer_lab.ops.state.StackState`, one backend state per layer (``None``: the empty
    prefix). For backends without a recurrent form (lsh) the state is the input prefix and every
    step re-runs ``forward`` on it.

    Both paths share that state: ``forward(x, state=s, return_state=True) -> (out, state)``
    continues from ``s`` (from ``step`` or an earlier ``forward``; None = empty) and returns the
    state after ``x``. So a prompt is prefilled in one pass, and a long sequence can run in
    segments (truncated back-propagation through time when the carried state is detached).
    ``cu_seqlens`` runs packed sequences (``x (1, T, d_model)``, see :class:`Attention`).

    The state is a value: ``step`` and ``forward(state=...)`` return a new one and leave the given
    one as it was, so a prefilled state can be continued several ways (branching samples, beam
    search); ``state.clone()`` / ``state.detach()`` (or ``clone_state`` / ``detach_state`` for any
    backend's state) copy or detach it, and ``torch.save`` / ``torch.load(..., weights_only=True)``
    keep it.

    Args: n_layers, d_model, n_heads, d_ff (default 4 d_model), attention (a backend name such as
    ``"softmax"``, a dict of :class:`AttentionConfig` fields, a config, or None for the default
    ``linear`` with ``elu``; coerced here once, kept as :attr:`attention_config`, and built once per
    layer), causal, dropout, norm_first and activation (each layer's: :class:`TransformerLayer`).
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
        norm_first: bool = True,
        activation: str = "gelu",
    ):
        super().__init__()
        self.attention_config = as_config(attention, "Transformer")
        self.layers = nn.ModuleList(  # each layer builds its own backend from the config
            TransformerLayer(d_model, n_heads, d_ff or 4 * d_model, attention=self.attention_config, causal=causal,
                             dropout=dropout, norm_first=norm_first, activation=activation)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None, state: list | None = None,
                return_state: bool = False, cu_seqlens: torch.Tensor | None = None):
        if state is None and not return_state:
            for layer in self.layers:
                x = layer(x, key_lengths=key_lengths, cu_seqlens=cu_seqlens)
            return self.norm(x)
        if not self.has_recurrent_form:
            return self._forward_prefix(x, key_lengths, state, return_state)
        if state is not None and (not isinstance(state, (list, tuple)) or len(state) != len(self.layers)):
            raise ValueError(f"Transformer: state must be a list of {len(self.layers)} per-layer states (from step or "
                             f"forward(..., return_state=True)), got {type(state).__name__}")
        new_state = []
        for layer, layer_state in zip(self.layers, state or [None] * len(self.layers)):
            x, layer_state = layer(x, key_lengths=key_lengths, state=layer_state, return_state=True, cu_seqlens=cu_seqlens)
            new_state.append(layer_state)
        x = self.norm(x)
        return (x, StackState(new_state)) if return_state else x

    def _forward_prefix(self, x, key_lengths, state, return_state):
        """``forward`` with a state for stacks without a recurrent form (lsh): the state is the
        input prefix (what ``step`` keeps), and the stack re-runs over prefix + x."""
        if state is not None and not isinstance(state, SequenceBuffer):
            raise ValueError("Transformer: a stack without a recurrent form (lsh) takes as state the input prefix "
                             "that step or forward(..., return_state=True) returned")
        if key_lengths is not None and bool((key_lengths != x.shape[1]).any()):
            raise ValueError("Transformer: a state for a stack without a recurrent form (lsh) needs sequences of equal "
                             "length (key_lengths all equal to the sequence length)")
        full = x if state is None else torch.cat([state.filled, x], dim=1)
        out = self.forward(full)[:, full.shape[1] - x.shape[1]:]
        return (out, SequenceBuffer.from_tensor(full, dim=1)) if return_state else out

    @property
    def has_recurrent_form(self) -> bool:
        return all(layer.attention.attention.has_recurrent_form for layer in self.layers)

    def step(self, x_t: torch.Tensor, state: list | None = None):
        """One position: ``x_t (B, d_model) -> (out (B, d_model), state)`` (class docstring); the
        readable form :func:`~linformer_lab.models.generation.fast_step` is tested equal to."""
        if not self.has_recurrent_form:
            # lsh: re-run the whole stack on the input prefix (the paper's generation baseline)
            state = (state if state is not None else SequenceBuffer(x_t, dim=1)).appended(x_t)
            return self.forward(state.filled)[:, -1], state
        new_state = []
        for layer, layer_state in zip(self.layers, state or [None] * len(self.layers)):
            x_t, layer_state = layer.step(x_t, layer_state)
            new_state.append(layer_state)
        return self.norm(x_t), StackState(new_state)


def segmented_forward(run_segment, length: int, segment_length: int, detach: bool = False) -> list:
    """``run_segment(start, stop, state) -> (output, state)`` over consecutive segments
    ``[0, L), [L, 2L), ...`` of a sequence of ``length`` positions, the state carried across;
    returns the outputs in order (callers concatenate them along the sequence).

    With autograd on, every segment runs under activation checkpointing: the forward keeps only
    each segment's output, boundary state and inputs, and the backward recomputes one segment at
    a time, so peak training memory follows ``segment_length``, not ``length`` (for a
    constant-size state: causal linear attention), for one more forward per segment. Outputs
    should be small (a per-position loss, not hidden states) for that to hold. The gradient is
    that of one pass over the whole sequence, unless ``detach`` cuts it at every boundary
    (truncated back-propagation through time, same forward values) through
    :func:`~linformer_lab.ops.state.detach_state`.
    """
    if segment_length < 1:
        raise ValueError(f"segment_length must be >= 1, got {segment_length}")
    outputs, state = [], None
    for start in range(0, length, segment_length):
        stop = min(length, start + segment_length)
        if detach:
            state = detach_state(state)
        if torch.is_grad_enabled():
            output, state = checkpoint(run_segment, start, stop, state, use_reentrant=False)
        else:
            output, state = run_segment(start, stop, state)
        outputs.append(output)
    return outputs


def sinusoidal_positions(length: int, dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The fixed position code of Vaswani et al.: ``(length, dim)``, column 2i sin(p / 10000^(2i / dim)),
    column 2i + 1 its cosine (an odd ``dim`` ends on a sine)."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    half = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
    angle = position * torch.exp(-math.log(10000.0) * half / dim)  # (length, ceil(dim/2))
    out = torch.zeros(length, dim, device=device, dtype=torch.float32)
    out[:, 0::2] = torch.sin(angle)
    out[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return out.to(dtype)
