"""Argument checks shared by the tasks, models and data modules.

Every check raises a ValueError that names the argument as the user writes it (``d_model``,
``n_heads``, ``batch_size``...), the value it got and what is valid, at the public edge (a
task's or data module's constructor), so a bad configuration stops while the classes are
built, with one line, instead of as a traceback from deep inside the model or, worse, as a
run that trains nonsense. The CLI prints such a ValueError as one line and exits with 2.

:class:`ConfigurationError` is for the checks that need the run itself (the device, the data
module next to the model): raised from ``Task.setup``, before the first batch.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "ConfigurationError",
    "check_at_least",
    "check_dropout",
    "check_non_negative",
    "check_positive",
    "check_transformer_shape",
]


class ConfigurationError(ValueError):
    """A configuration that cannot run, found before running it (e.g. from ``Task.setup``):
    the model and the data disagree, or the backend cannot run on the run's device. The
    message names the arguments and what would be valid."""


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name: str, value, what: str = "") -> None:
    """Raise unless ``value`` is a finite number > 0. ``what`` says what the argument counts
    (``"learning rate"``, ``"sequences per batch"``), for the message."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        kind = f" ({what})" if what else ""
        raise ValueError(f"{name} must be a positive number{kind}, got {value!r}")


def check_non_negative(name: str, value, what: str = "") -> None:
    """Raise unless ``value`` is a finite number >= 0."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        kind = f" ({what})" if what else ""
        raise ValueError(f"{name} must be a number >= 0{kind}, got {value!r}")


def check_at_least(name: str, value, minimum: int, what: str = "", allow_none: bool = False) -> None:
    """Raise unless ``value`` is an integer >= ``minimum`` (or None with ``allow_none``)."""
    if value is None and allow_none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        kind = f" ({what})" if what else ""
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{none}{kind}, got {value!r}")


def check_dropout(value, name: str = "dropout") -> None:
    """Raise unless ``value`` is a probability in [0, 1) (1 would drop everything)."""
    if not _is_number(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}")


def check_transformer_shape(d_model, n_heads, n_layers, d_ff=None, dropout=0.0) -> None:
    """Check a transformer's shape arguments under the names the tasks give them.

    ``d_model`` must split evenly into ``n_heads`` heads (each head gets ``d_model // n_heads``
    query and value dimensions); the message then suggests head counts that divide d_model,
    and d_model values that n_heads divides.
    """
    check_at_least("d_model", d_model, 1, "width of the model")
    check_at_least("n_heads", n_heads, 1, "attention heads per layer")
    check_at_least("n_layers", n_layers, 1, "transformer layers; 0 would leave only the embedding and the output head")
    check_at_least("d_ff", d_ff, 1, "feed-forward width; None = 4 d_model", allow_none=True)
    check_dropout(dropout)
    if d_model % n_heads:
        divisors = [d for d in range(1, d_model + 1) if d_model % d == 0]  # the four nearest n_heads, ascending
        heads = ", ".join(str(h) for h in sorted(sorted(divisors, key=lambda d: (abs(d - n_heads), d))[:4]))
        below = d_model - d_model % n_heads
        widths = " or ".join(str(w) for w in (below, below + n_heads) if w > 0)
        raise ValueError(
            f"d_model ({d_model}) must be divisible by n_heads ({n_heads}): every head gets d_model / n_heads "
            f"dimensions; e.g. n_heads {heads}, or d_model {widths}"
        )
