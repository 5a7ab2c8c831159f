"""Attention backends (nn.Modules over :mod:`linformer_lab.ops`), registered by entry point
under ``linformer_lab.attention``, and the multi-head module that works with any of them."""

from linformer_lab.attention.base import Attention, KVCache

__all__ = ["Attention", "KVCache"]
