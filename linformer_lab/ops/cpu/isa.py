"""The CPU's bf16 units, which the command line's precision rule reads (``cli/checks.py``): with
them bf16 runs faster than fp32, without them bf16 is emulated and slower."""

from __future__ import annotations

import functools
import re

import torch

__all__ = ["cpuinfo_flags", "matrix_units", "units_of"]


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
