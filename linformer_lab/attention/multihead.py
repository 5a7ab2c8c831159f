"""Multi-head attention with Q/K/V/output projections over any registered backend."""

from __future__ import annotations

import torch
from torch import nn

from linformer_lab.attention.base import Attention, check_state
from linformer_lab.attention.config import AttentionConfig, require_config


class MultiHeadAttention(nn.Module):
    """``(B, N, d_model) -> (B, N, d_model)``; ``step``: ``(B, d_model) -> (B, d_model)``.

    Args:
        d_model: model width.
        n_heads: heads; each gets ``d_model // n_heads`` query and value dims unless
            ``query_dim`` / ``value_dim`` say otherwise.
        attention: an :class:`AttentionConfig` (None: the default, ``linear`` with ``elu``) or a
            built :class:`Attention`. A backend name or a dict is a TypeError: make a config with
            :meth:`AttentionConfig.coerce` (this is a building block; see ``attention/config.py``).
        causal: passed to the backend when it is built here.

    Queries, keys and values come from one fused projection ``qkv``, laid out as
    ``[queries | keys | values]`` (``[queries | values]`` for shared-QK backends (lsh), which have
    no key projection: keys are the queries), each ``n_heads`` blocks of ``query_dim`` or
    ``value_dim``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        attention: AttentionConfig | Attention | None = None,
        causal: bool = False,
        query_dim: int | None = None,
        value_dim: int | None = None,
    ):
        super().__init__()
        if d_model % n_heads and (query_dim is None or value_dim is None):
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; set query_dim and value_dim")
        self.n_heads = n_heads
        self.query_dim = query_dim or d_model // n_heads
        self.value_dim = value_dim or d_model // n_heads
        attention = require_config(attention, "MultiHeadAttention", allow_module=True)
        if isinstance(attention, AttentionConfig):
            attention = attention.build(causal=causal, query_dim=self.query_dim)
        self.attention = attention
        self.shares_query_key = attention.shares_query_key
        hq, hv = n_heads * self.query_dim, n_heads * self.value_dim
        self._split = [hq, hv] if self.shares_query_key else [hq, hq, hv]
        self.qkv = nn.Linear(d_model, sum(self._split))
        self.out = nn.Linear(hv, d_model)

    def _project(self, x: torch.Tensor):
        """``(..., d_model) -> q, k, v`` each ``(..., heads, dim)``."""
        return self._split_projection(self.qkv(x))

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None, state=None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        """x ``(B, N, d_model)``, key_lengths ``(B,)`` -> ``(B, N, d_model)``.

        ``state`` / ``return_state``: the backend's state in and out (see :class:`Attention`),
        then the result is ``(out, state)``. ``cu_seqlens``: x is ``(1, T, d_model)`` holding
        packed sequences with these offsets.
        """
        q, k, v = (t.transpose(1, 2) for t in self._project(x))  # (B, H, N, dim)
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
        """One position: x_t ``(B, d_model)`` -> ``((B, d_model), state)``; :meth:`forward` at
        one position, with the backend's state."""
        q, k, v = self._project(x_t)  # (B, H, dim) each; k is q for shared-QK backends
        out, state = self.attention.step(q, k, v, state)  # (B, H, value_dim)
        return self.out(out.flatten(1)), state

    def _split_projection(self, qkv: torch.Tensor):
        """The fused projection ``(..., sum(split))`` -> q, k, v each ``(..., heads, dim)``."""
        parts = qkv.split(self._split, dim=-1)
        lead = qkv.shape[:-1]
        q = parts[0].view(*lead, self.n_heads, self.query_dim)
        k = q if self.shares_query_key else parts[1].view(*lead, self.n_heads, self.query_dim)
        return q, k, parts[-1].view(*lead, self.n_heads, self.value_dim)
