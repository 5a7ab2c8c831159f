"""``softmax``: exact scaled dot-product attention (paper eq. 2), the quadratic baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.attention.base import Attention, KVCache
from linformer_lab.ops.masks import length_mask


class SoftmaxAttention(Attention):
    """softmax(Q K^T / sqrt(D)) V through ``F.scaled_dot_product_attention`` (flash / memory-
    efficient kernels where the device has them). O(N^2) time; RNN mode keeps a KV cache
    ("stateful softmax", paper §C.1), so step t costs O(t).
    """

    def __init__(self, causal: bool = False, query_dim: int | None = None, feature_map=None, dropout: float = 0.0):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        self.dropout = dropout

    def forward(self, q, k, v, key_lengths=None):
        self.check_inputs(q, k, v, key_lengths)
        dropout = self.dropout if self.training else 0.0
        if key_lengths is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout)
        n = q.shape[2]
        visible = length_mask(key_lengths, n)[:, None, None, :]  # (B, 1, 1, N)
        if self.causal:
            visible = visible & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout)

    def step(self, q_t, k_t, v_t, state: KVCache | None = None):
        if state is None:  # checked in full on a sequence's first step only (see LinearAttention.step)
            self.check_step_inputs(q_t, k_t, v_t)
            state = KVCache(k_t, v_t)
        state.append(k_t, v_t)
        out = F.scaled_dot_product_attention(q_t.unsqueeze(2), state.keys, state.values)
        return out.squeeze(2), state
