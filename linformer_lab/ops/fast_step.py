"""What makes the one-position RNN step (paper §3.4) fast at small batch sizes, in one place.

* :func:`weight_copies_for_steps` / :func:`step_linear`: the weight copy each linear layer of
  the step reads (below);
* :func:`generation_kernels`: the CPU kernel settings a loop of steps runs under (oneDNN off, one
  intra-op thread for small batches);
* :func:`state_nbytes`: how much memory a recurrent state holds (constant for linear attention,
  growing for softmax); defined with the state contract in :mod:`linformer_lab.ops.state` and
  re-exported here.

Weight copies
-------------

A generation step multiplies a handful of rows by every weight matrix of the model, so at
small batch sizes it streams all the weights from memory once per position (25 MB per step
for the 8-layer MNIST model at fp32, 50 MB for the 16-layer CIFAR-10 model) and the time is
set by how fast the matrix-vector products read them, not by arithmetic.

:func:`weight_copies_for_steps` gives every ``nn.Linear`` of a module, for the duration of a
``with`` block (a loop of steps over fixed weights, e.g. ``PixelTransformer.generate``), a copy
of its weight in a format chosen for that, and :func:`step_linear` uses the copy when there is
one. The formats (:data:`STEP_WEIGHT_FORMATS`):

``"model"``
    The model's own weights, dtype and values; the product is the same up to summation
    order. On CPU the copy is the transposed ``(in, out)`` matrix: ``F.linear`` reads the
    ``(out, in)`` parameter markedly slower at one row than ``x @ W^T`` with ``W^T``
    contiguous (benchmarks/NOTES.md, "Measurements behind library defaults"). Elsewhere no
    copy is made.
``"bfloat16"``
    A bfloat16 copy; the layer's input is rounded to bfloat16, the product accumulated in
    fp32 and rounded to bfloat16 by the BLAS, the bias added in the model's dtype. Half the
    bytes per step.
``"int8"``
    Weight-only int8: each output row ``w_i`` stored as ``round(w_i / s_i)`` in int8 with
    one bfloat16 scale ``s_i >= max|w_i| / 127`` (symmetric, per output channel, so every
    weight is within ``s_i / 2`` of its original); the input is rounded to bfloat16 and
    ``torch._weight_int8pack_mm`` dequantizes on the fly (bfloat16 output, the bias added in
    the model's dtype). A quarter of the bytes per step.

The reduced formats change the numbers the step computes (a lossy copy), so they are opt-in;
how much they cost in bits/dim is measured in ``benchmarks/dev/step_weights_quality.py``. The
activations between layers, the attention state and the output head stay in the model's
dtype.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.ops.state import state_nbytes

__all__ = [
    "SINGLE_THREAD_MAX_BATCH",
    "STEP_WEIGHT_FORMATS",
    "check_step_weight_format",
    "generation_kernels",
    "quantize_int8",
    "state_nbytes",
    "step_linear",
    "weight_copies_for_steps",
]

#: The weight formats :func:`weight_copies_for_steps` can make (see the module docstring).
STEP_WEIGHT_FORMATS = ("model", "bfloat16", "int8")

#: ``torch._weight_int8pack_mm`` is only correct for input sizes that are multiples of this.
_INT8_KERNEL_K_MULTIPLE = 16

#: Attribute of an ``nn.Linear`` that holds its step weight inside :func:`weight_copies_for_steps`.
_ATTRIBUTE = "_step_weight"


def step_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` for ``x (B, in)``, through the weight copy that
    :func:`weight_copies_for_steps` holds, if any (no module-call machinery: hooks do not run).
    Returns ``x``'s dtype."""
    copy = linear.__dict__.get(_ATTRIBUTE)
    if copy is None:
        return F.linear(x, linear.weight, linear.bias)
    return copy(x)


def check_step_weight_format(format: str) -> str:
    if format not in STEP_WEIGHT_FORMATS:
        raise ValueError(f"unknown step weight format {format!r}; valid choices: {', '.join(STEP_WEIGHT_FORMATS)}")
    return format


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(out, in)`` -> ``(q int8 (out, in), scale bf16 (out,))``
    with ``|q * scale - weight| <= scale / 2`` elementwise.

    The scale is rounded *up* to bfloat16 (the kernel takes bf16 scales), so
    ``max|w_i| / scale_i <= 127`` and no weight is clipped; a zero row gets scale 1.
    """
    weight = weight.detach().float()
    wanted = weight.abs().amax(dim=1) / 127
    scale = wanted.to(torch.bfloat16)
    low = scale.float() < wanted
    scale[low] = torch.nextafter(scale[low], torch.full_like(scale[low], float("inf")))
    scale[wanted == 0] = 1
    q = torch.round(weight / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class _Transposed:
    """Format ``"model"`` on CPU: ``x @ W^T (+ b)`` with ``W^T`` stored ``(in, out)``."""

    __slots__ = ("weight_t", "bias")
    format = "model"

    def __init__(self, linear: nn.Linear):
        self.weight_t = linear.weight.detach().t().contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


class _Bfloat16:
    """Format ``"bfloat16"``: ``bf16(x) @ bf16(W)^T`` in fp32 accumulation, plus the bias."""

    __slots__ = ("weight", "bias")
    format = "bfloat16"

    def __init__(self, linear: nn.Linear):
        self.weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        product = F.linear(x.to(torch.bfloat16), self.weight)
        # one op for "back to x's dtype, plus bias": type promotion of (bias, bf16 product)
        return product.to(x.dtype) if self.bias is None else torch.add(self.bias, product)


class _Int8:
    """Format ``"int8"``: weight-only int8 with per-output-channel bf16 scales.

    ``torch._weight_int8pack_mm`` (a private ATen kernel) gave wrong outputs or crashed the
    process for input sizes that are not a multiple of :data:`_INT8_KERNEL_K_MULTIPLE` (a grid
    of shapes on torch 2.11, CPU), and it is only used and tested here on CPU. Other layers
    (and other devices) multiply by the dequantized weights ``q * s`` held in fp32: the same
    values and the same bf16 output, up to summation order, without the saving in bytes.
    """

    __slots__ = ("weight", "scale", "bias", "dequantized")
    format = "int8"

    def __init__(self, linear: nn.Linear):
        self.weight, self.scale = quantize_int8(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        use_kernel = linear.weight.device.type == "cpu" and linear.in_features % _INT8_KERNEL_K_MULTIPLE == 0
        self.dequantized = None if use_kernel else (self.weight.float() * self.scale.float()[:, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequantized is None:
            product = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale)
        else:  # rounded to bf16 like the kernel's output
            product = F.linear(x.to(torch.bfloat16).float(), self.dequantized).to(torch.bfloat16)
        return product.to(x.dtype) if self.bias is None else torch.add(self.bias, product)


def _make_copy(linear: nn.Linear, format: str):
    if format == "int8":
        return _Int8(linear)
    if format == "bfloat16":
        return _Bfloat16(linear)
    return _Transposed(linear) if linear.weight.device.type == "cpu" else None


@contextlib.contextmanager
def weight_copies_for_steps(module: nn.Module, format: str = "model", enabled: bool = True):
    """Give every ``nn.Linear`` in ``module`` a weight copy in ``format`` (one of
    :data:`STEP_WEIGHT_FORMATS`) that :func:`step_linear` reads, for the block; removed on
    exit. Memory: one more copy of the linear weights, in that format.

    The weights must not change inside the block (the copies would be stale). Nesting: an
    inner block for a module that already holds copies keeps the outer ones (and their
    format); it is an error to ask for another format there.
    """
    check_step_weight_format(format)
    added = []
    if enabled:
        with torch.no_grad():
            for linear in module.modules():
                if not isinstance(linear, nn.Linear):
                    continue
                held = linear.__dict__.get(_ATTRIBUTE)
                if held is not None:
                    if held.format != format:
                        raise RuntimeError(
                            f"weight_copies_for_steps: a {type(linear).__name__} already holds a {held.format!r} step weight; "
                            f"cannot also use {format!r} inside that block"
                        )
                    continue
                copy = _make_copy(linear, format)
                if copy is not None:
                    linear.__dict__[_ATTRIBUTE] = copy
                    added.append(linear)
    try:
        yield
    finally:
        for linear in added:
            linear.__dict__.pop(_ATTRIBUTE, None)


# ---------------------------------------------------------------- kernels


@contextlib.contextmanager
def generation_kernels(device: torch.device, batch_size: int, recurrent: bool = True):
    """The kernel settings :meth:`~linformer_lab.models.pixel_transformer.PixelTransformer.generate`
    steps under: oneDNN off on CPU (:func:`_native_cpu_kernels`) and one intra-op thread for small recurrent batches
    (:func:`_single_thread_for_small_steps`). Process-global settings, restored on exit.

    Code that steps the model by hand and must draw what ``generate`` draws runs under this
    too: a bf16 step copy goes through oneDNN's bf16 matmul when oneDNN is on (on CPUs with
    bf16 instructions), which rounds differently from the native kernel.
    """
    with _native_cpu_kernels(device), _single_thread_for_small_steps(device, batch_size, recurrent):
        yield


@contextlib.contextmanager
def _native_cpu_kernels(device: torch.device):
    """Turn oneDNN (mkldnn) off while stepping on CPU.

    With oneDNN on, PyTorch runs GELU through oneDNN, which opens a thread-parallel region on
    every call, even for the (B, d_ff) tensor of one RNN step; ATen's own kernel runs such a
    small tensor inline, many times faster (benchmarks/NOTES.md, "Measurements behind library
    defaults"). Nothing else on the fp32 step path uses oneDNN (linear layers go to BLAS), so
    fp32 results are identical; a bf16 step copy does go through oneDNN's bf16 matmul when
    oneDNN is on, which rounds differently. The flag is process-global; it is restored on exit.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True


#: On CPU, :func:`generation_kernels` runs recurrent steps of at most this many sequences with
#: one intra-op thread (restored afterwards). Such a step is a few dozen operations on
#: (B, d_model) rows; a thread-parallel region costs more than the work in it
#: (benchmarks/NOTES.md, "Measurements behind library defaults").
SINGLE_THREAD_MAX_BATCH = 16


@contextlib.contextmanager
def _single_thread_for_small_steps(device: torch.device, batch_size: int, recurrent: bool):
    """One intra-op thread while stepping a small batch on CPU (see
    :data:`SINGLE_THREAD_MAX_BATCH`). Backends without a recurrent form (lsh) re-run the
    whole prefix at every step, which is large enough to use every thread: left as set."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or not recurrent or batch_size > SINGLE_THREAD_MAX_BATCH or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
