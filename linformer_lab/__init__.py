"""linformer_lab: linear attention from "Transformers are RNNs" (Katharopoulos et al. 2020).

Public API::

    import linformer_lab as ll
    ll.list_feature_maps()                      # ['elu', 'favor', 'poly2', 'random_fourier', ...]
    ll.list_attention()                         # ['linear', 'linear_cuda', 'lsh', 'softmax', ...]
    fm = ll.build_feature_map("elu", query_dim=32)
    attn = ll.build_attention("linear", causal=True, query_dim=32, feature_map="favor")
    out = attn(q, k, v, key_lengths=None)       # (B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)
    out_t, state = attn.step(q_t, k_t, v_t)     # RNN mode: (B, H, D), (B, H, D), (B, H, M) -> (B, H, M)
"""

from __future__ import annotations

from linformer_lab.attention.config import AttentionConfig, build_attention, list_attention
from linformer_lab.feature_maps import build_feature_map, list_feature_maps
from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError

__version__ = "0.1.0"

__all__ = [
    "ATTENTION",
    "AttentionConfig",
    "FEATURE_MAPS",
    "PluginError",
    "build_attention",
    "build_feature_map",
    "list_attention",
    "list_feature_maps",
]
