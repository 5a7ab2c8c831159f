"""Multi-head attention with Q/K/V/output projections over any registered backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.base import Attention
from linformer_lab.attention.config import AttentionConfig, layer_attention
from linformer_lab.ops.state import check_state


def head_dims(d_model: int, n_heads: int, query_dim: int | None = None, value_dim: int | None = None) -> tuple[int, int]:
    """Per-head ``(query_dim, value_dim)``: ``d_model // n_heads`` each unless given."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    if d_model % n_heads and (query_dim is None or value_dim is None):
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; set query_dim and value_dim")
    return query_dim or d_model // n_heads, value_dim or d_model // n_heads


class MultiHeadAttention(nn.Module):
    """``(B, N, d_model) -> (B, N, d_model)``; ``step``: ``(B, d_model) -> (B, d_model)``.

    Args:
        d_model: model width.
        n_heads: heads; each gets ``d_model // n_heads`` query and value dims unless
            ``query_dim`` / ``value_dim`` say otherwise.
        attention: a backend name (``"softmax"``), a dict of :class:`AttentionConfig` fields, an
            :class:`AttentionConfig` or None (``linear`` with ``elu``), built here for ``causal``;
            or a built :class:`Attention`, used as it is.
        causal: passed to the backend when it is built here.

    Queries, keys and values come from one fused projection ``qkv``, laid out as
    ``[queries | keys | values]`` (``[queries | values]`` for shared-QK backends (lsh), which have
    no key projection: keys are the queries), each ``n_heads`` blocks of ``query_dim`` or
    ``value_dim``. Cross attention (``forward(x, context=c)``) projects the queries from ``x`` and
    the keys and values from ``c`` with the same weights, so ``context=x`` is self attention.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        attention: AttentionConfig | Attention | str | dict | None = None,
        causal: bool = False,
        query_dim: int | None = None,
        value_dim: int | None = None,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.query_dim, self.value_dim = head_dims(d_model, n_heads, query_dim, value_dim)
        attention = layer_attention(attention, causal=causal, query_dim=self.query_dim)
        self.attention = attention
        self.shares_query_key = attention.shares_query_key
        hq, hv = n_heads * self.query_dim, n_heads * self.value_dim
        self._split = [hq, hv] if self.shares_query_key else [hq, hq, hv]
        self.qkv = nn.Linear(d_model, sum(self._split))
        self.out = nn.Linear(hv, d_model)

    def _project(self, x: torch.Tensor):
        """``(..., d_model) -> q, k, v`` each ``(..., heads, dim)`` through the fused projection."""
        parts = self.qkv(x).split(self._split, dim=-1)
        lead = x.shape[:-1]
        q = parts[0].view(*lead, self.n_heads, self.query_dim)
        k = q if self.shares_query_key else parts[1].view(*lead, self.n_heads, self.query_dim)
        return q, k, parts[-1].view(*lead, self.n_heads, self.value_dim)

    def _project_cross(self, x: torch.Tensor, context: torch.Tensor):
        """Queries from ``x (B, N, d_model)``, keys and values from ``context (B, L, d_model)``, through
        the rows of the fused projection that make each -> q ``(B, N, H, D)``, k ``(B, L, H, D)``, v ``(B, L, H, M)``."""
        if self.shares_query_key:
            raise ValueError(f"{type(self.attention).__name__}: its keys are its queries (shares_query_key), so it takes "
                             f"no context; cross attention takes a backend with separate keys ('linear', 'softmax')")
        if context.dim() != 3 or context.shape[0] != x.shape[0] or context.shape[2] != x.shape[2]:
            raise ValueError(f"MultiHeadAttention: context must be (batch, L, d_model) = ({x.shape[0]}, L, {x.shape[2]}) "
                             f"like x {tuple(x.shape)}; got {tuple(context.shape)}")
        hq = self._split[0]
        weight, bias = self.qkv.weight, self.qkv.bias
        q = F.linear(x, weight[:hq], None if bias is None else bias[:hq])
        kv = F.linear(context, weight[hq:], None if bias is None else bias[hq:])
        k, v = kv.split(self._split[1:], dim=-1)
        return (q.unflatten(-1, (self.n_heads, self.query_dim)), k.unflatten(-1, (self.n_heads, self.query_dim)),
                v.unflatten(-1, (self.n_heads, self.value_dim)))

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None, state=None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, context: torch.Tensor | None = None):
        """x ``(B, N, d_model)``, key_lengths ``(B,)`` -> ``(B, N, d_model)``.

        ``context`` ``(B, L, d_model)``: cross attention, keys and values from it (an encoder's
        output, say), ``key_lengths`` then its lengths; needs a non-causal backend with separate
        keys. ``state`` / ``return_state``: the backend's state in and out (see :class:`Attention`),
        the result then ``(out, state)``. ``cu_seqlens``: x is ``(1, T, d_model)``, packed sequences.
        """
        if context is None:
            q, k, v = self._project(x)
        else:
            q, k, v = self._project_cross(x, context)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, N or L, dim)
        if self.shares_query_key:
            k = q
        extra = {}
        if state is not None or return_state or cu_seqlens is not None:
            # only then: third-party backends need not accept these keywords
            self.attention.check_state_request(state, return_state, cu_seqlens, key_lengths)
            extra = {"state": state, "return_state": return_state, "cu_seqlens": cu_seqlens}
        result = self.attention(q, k, v, key_lengths=key_lengths, **extra)  # (B, H, N, value_dim)
        out, state = result if return_state else (result, None)
        if return_state:  # here the backend is known: a state it cannot detach or size is named with it
            backend = type(self.attention)
            check_state(state, f"attention backend {backend.__qualname__} ({backend.__module__})")
        out = self.out(out.transpose(1, 2).flatten(2))
        return (out, state) if return_state else out

    def step(self, x_t: torch.Tensor, state=None):
        """:meth:`forward` at one position: x_t ``(B, d_model)`` -> ``((B, d_model), state)``, a new
        state (the given one is left as it was)."""
        q, k, v = self._project(x_t)  # (B, H, dim) each; k is q for shared-QK backends
        out, state = self.attention.step(q, k, v, state)  # (B, H, value_dim)
        return self.out(out.flatten(1)), state
