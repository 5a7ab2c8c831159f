"""Attention backends (nn.Modules over :mod:`linformer_lab.ops`), registered by entry point
under ``linformer_lab.attention``, the config that names one, and the multi-head module that
works with any of them."""

from linformer_lab.attention.base import Attention
from linformer_lab.attention.config import AttentionConfig, build_attention, list_attention
from linformer_lab.ops.state import AttentionState, KVCache

__all__ = ["Attention", "AttentionConfig", "AttentionState", "KVCache", "build_attention", "list_attention"]
