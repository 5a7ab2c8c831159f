"""Linear layers of the one-position RNN step (paper §3.4), in the weight layout that is
fastest for a few rows on CPU.

A generation step multiplies a handful of rows by every weight matrix of the model, so on
CPU it streams all the weights from memory once per position (25 MB per step for the
8-layer MNIST model at fp32) and the time is set by how fast the matrix-vector product
reads them. ``F.linear(x, W, b)`` computes ``x W^T`` from the ``(out, in)`` parameter; the
BLAS reads that layout markedly slower at one row than ``x @ W^T`` with ``W^T`` stored
``(in, out)`` contiguous (measured 1.8 ms against 1.3 ms per step for the MNIST model's
linears, one thread, AMD EPYC).

:func:`transposed_weights` stores such a copy next to every ``nn.Linear`` of a module for
the duration of a ``with`` block (a loop of steps over fixed weights, e.g.
``PixelTransformer.generate``), and :func:`step_linear` uses it when present. The result is
the same product, summed in another order (differences at the level of float rounding).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

#: Attribute of an ``nn.Linear`` that holds its transposed weight inside :func:`transposed_weights`.
_ATTRIBUTE = "_step_weight_t"


def step_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` for ``x (B, in)``, through the transposed copy of the weight while
    :func:`transposed_weights` holds one (no module-call machinery: hooks do not run)."""
    weight_t = linear.__dict__.get(_ATTRIBUTE)
    if weight_t is None:
        return F.linear(x, linear.weight, linear.bias)
    if linear.bias is None:
        return x @ weight_t
    return torch.addmm(linear.bias, x, weight_t)


@contextlib.contextmanager
def transposed_weights(module: nn.Module, enabled: bool = True):
    """Give every ``nn.Linear`` in ``module`` a contiguous ``(in, out)`` copy of its weight
    for the block (memory: one more copy of the linear weights), removed on exit. The
    weights must not change inside the block (the copies would be stale); re-entering for a
    module that already holds copies keeps them."""
    added = []
    if enabled:
        with torch.no_grad():
            for linear in module.modules():
                if isinstance(linear, nn.Linear) and _ATTRIBUTE not in linear.__dict__:
                    linear.__dict__[_ATTRIBUTE] = linear.weight.detach().t().contiguous()
                    added.append(linear)
    try:
        yield
    finally:
        for linear in added:
            linear.__dict__.pop(_ATTRIBUTE, None)
