"""Backward-compatible home of :class:`AttentionConfig` (now :mod:`linformer_lab.attention.config`)."""

from linformer_lab.attention.config import AttentionConfig

__all__ = ["AttentionConfig"]
