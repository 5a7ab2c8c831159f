"""The CPU's bf16 units, which the command line's precision rule reads (``cli/checks.py``): with
them bf16 runs faster than fp32, without them bf16 is emulated and slower."""

from __future__ import annotations

import functools
import os
import re

import torch

__all__ = ["BF16_UNITS_VARIABLE", "bf16_units", "cpuinfo_flags", "matrix_units", "units_of"]

#: Overrides the CPU probe of :func:`bf16_units` (a test's, or a user's who wants bf16 emulated).
BF16_UNITS_VARIABLE = "LINFORMER_LAB_CPU_BF16"
BF16_UNITS_CHOICES = ("amx", "avx512_bf16", "none")


def bf16_units() -> str | None:
    """The CPU's bf16 units: ``"amx"``, ``"avx512_bf16"`` or None; ``LINFORMER_LAB_CPU_BF16`` if set
    (a value other than :data:`BF16_UNITS_CHOICES`: a one-line ValueError)."""
    value = os.environ.get(BF16_UNITS_VARIABLE)
    if not value:
        return matrix_units()
    if value not in BF16_UNITS_CHOICES:
        raise ValueError(f"{BF16_UNITS_VARIABLE}={value!r}: expected one of {', '.join(BF16_UNITS_CHOICES)}")
    return None if value == "none" else value


@functools.cache
def matrix_units() -> str | None:
    """``"amx"`` where the CPU has AMX tiles for bf16, ``"avx512_bf16"`` where it has AVX-512's bf16 dot
    products only, None otherwise; from torch's CPU feature probe, else ``/proc/cpuinfo``'s flags."""
    flags: set[str] = set()
    try:
        capability = torch._C._cpu._get_cpu_capability()
        flags = {name for name, present in capability.items() if present is True}
    except (AttributeError, RuntimeError):
        try:
            with open("/proc/cpuinfo") as info:
                flags = cpuinfo_flags(info.read())
        except OSError:
            pass
    return units_of(flags)


def cpuinfo_flags(text: str) -> set[str]:
    """The CPU flags of the first ``flags`` line of a ``/proc/cpuinfo`` text (empty without one)."""
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def units_of(flags: set[str]) -> str | None:
    """:func:`matrix_units`'s answer for a set of CPU flags (torch's or ``/proc/cpuinfo``'s names)."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None
