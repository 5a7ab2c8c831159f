"""Masks shared by the fast paths (the naive references in ops/ spell theirs out on purpose)."""

from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``(B,)`` lengths -> bool ``(B, max_length)``, True at positions ``< lengths[b]``."""
    return torch.arange(max_length, device=lengths.device) < lengths[:, None]
