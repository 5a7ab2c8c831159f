"""``softmax``: exact scaled dot-product attention (paper eq. 2), the quadratic baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.attention.base import Attention, check_cu_seqlens
from linformer_lab.ops.masks import length_mask
from linformer_lab.ops.state import KVCache


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``: ``(B, H, N, D), (B, H, L, D), (B, H, L, M) -> (B, H, N, M)``,
    but for no heads (H = 0), where torch's CPU kernel divides by the head count (the process dies
    of a floating-point exception): the empty result, with nothing to compute."""
    if q.shape[1] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class SoftmaxAttention(Attention):
    """softmax(Q K^T / sqrt(D)) V through ``F.scaled_dot_product_attention`` (flash / memory-
    efficient kernels where the device has them). O(N^2) time; RNN mode keeps a KV cache
    ("stateful softmax", paper §C.1), so step t costs O(t).

    The parallel forward takes and returns the same :class:`KVCache` (``state=``,
    ``return_state=``): new queries attend to the cached keys as to earlier positions.
    Packed sequences (``cu_seqlens``) run one sequence per call, so no padding is computed.
    """

    supports_state = True
    supports_packed = True

    def __init__(self, causal: bool = False, query_dim: int | None = None, feature_map=None, dropout: float = 0.0):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        self.dropout = dropout

    def forward(self, q, k, v, key_lengths=None, state: KVCache | None = None, return_state=False, cu_seqlens=None):
        self.check_inputs(q, k, v, key_lengths)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)
        dropout = self.dropout if self.training else 0.0
        if cu_seqlens is not None:
            if state is not None or return_state:
                raise ValueError("SoftmaxAttention: packed sequences (cu_seqlens) take no state; run them padded "
                                 "with key_lengths to carry a KV cache")
            offsets = check_cu_seqlens(cu_seqlens, q.shape[2], q.shape[0], type(self).__name__, keys=k.shape[2])
            return torch.cat([_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=self.causal, dropout_p=dropout)
                              for a, b in zip(offsets[:-1], offsets[1:])], dim=2)
        return self._attend(q, k, v, key_lengths, state, return_state, dropout)

    def _attend(self, q, k, v, key_lengths, state, return_state, dropout):
        b, _, n, _ = q.shape
        length = k.shape[2]  # L new keys (= N but for non-causal cross attention)
        valid_new = None if key_lengths is None else length_mask(key_lengths, length)  # (B, L)
        if state is None:
            keys, values, valid = k, v, valid_new
        else:
            keys, values = self.with_prefix(state, k, v)
            valid = state.valid
            if valid is not None or valid_new is not None:
                prior = valid if valid is not None else torch.ones(b, state.length, dtype=torch.bool, device=q.device)
                new = valid_new if valid_new is not None else torch.ones(b, length, dtype=torch.bool, device=q.device)
                valid = torch.cat([prior, new], dim=1)
        total = keys.shape[2]
        if valid is None and total == n:  # no cache, no padding: SDPA's own causal mask (and its fast kernels)
            out = _attention(q, keys, values, is_causal=self.causal, dropout_p=dropout)
        else:
            visible = None
            if self.causal:  # query i (absolute position total - n + i) sees keys j <= total - n + i
                visible = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
            if valid is not None:
                visible = valid[:, None, None, :] if visible is None else visible & valid[:, None, None, :]
            out = _attention(q, keys, values, attn_mask=visible, dropout_p=dropout)
        if not return_state:
            return out
        return out, KVCache.from_sequence(keys, values, valid)

    def step(self, q_t, k_t, v_t, state: KVCache | None = None):
        state = self.appended_cache(q_t, k_t, v_t, state)
        valid = state.valid
        mask = None if valid is None else valid[:, None, None, :]
        out = _attention(q_t.unsqueeze(2), state.keys, state.values, attn_mask=mask)
        return out.squeeze(2), state
