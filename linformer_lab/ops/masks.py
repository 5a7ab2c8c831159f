"""Masks shared by the fast paths (the naive references in ops/ spell theirs out on purpose), and
the check of the lengths and offsets they are made from that reads nothing back from the device."""

from __future__ import annotations

import torch


def length_mask(lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """``(B,)`` lengths -> bool ``(B, max_length)``, True at positions ``< lengths[b]``."""
    return torch.arange(max_length, device=lengths.device) < lengths[:, None]


def check_on_device(condition: torch.Tensor, message: str, details) -> None:
    """Assert the 0-d bool ``condition`` without a host read (``torch._assert_async``): on a GPU the
    check is queued behind the work already queued, and a failure surfaces at the next
    synchronisation as a device-side assert carrying ``message``; on the CPU it is checked at once
    and raised as a one-line ValueError, ``message`` followed by ``details()``."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError:  # raised here only where the tensor is on the host, at once
        raise ValueError(f"{message}, {details()}") from None
