"""Chunk-parallel causal linear attention in Triton (the GPU kernel of ``linear`` and
``linear_cuda``): the feature map elu + 1 and the normaliser fused, forward and backward parallel
over (sequence x head, chunk, tile), state in and out, packed sequences.

* :func:`chunk_linear_attention` -- the public function (``op.py``: the ``torch.library``
  operators ``linformer_lab::chunk_linear_attention_fwd`` / ``_bwd`` with fake tensors and
  autograd, so ``torch.compile(fullgraph=True)`` traces through it);
* :func:`chunk_linear_attention_torch` -- the same algorithm and signature in PyTorch
  (``torch_chunk.py``), for tests and as the readable form;
* ``forward.py`` / ``backward.py`` -- the kernels and the derivation of their gradients;
  ``launch.py`` -- compiling and launching them; ``backend.py`` -- the kernel with the arguments
  of the ``causal_attention`` op of :mod:`linformer_lab.ops.kernels`, whose GPU candidate it is.

Without a GPU only the interpreter runs them (the tests patch it to a GPU's arithmetic for bf16
and tf32: ``tests/ops/triton_emulation.py``); a GPU session checks them with
``tests/ops/test_triton_chunk_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import torch

from linformer_lab.ops.cuda.triton_chunk.op import chunk_linear_attention
from linformer_lab.ops.cuda.triton_chunk.torch_chunk import chunk_linear_attention_torch

__all__ = ["chunk_linear_attention", "chunk_linear_attention_torch", "is_available", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine's GPU, or None: needs Triton and a CUDA GPU of
    compute capability 8.0 or later (bf16 products)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability()} < (8, 0)"
    return None


@torch.compiler.assume_constant_result  # a fact of the machine: torch.compile need not trace find_spec
def is_available() -> bool:
    """True when :func:`chunk_linear_attention` can run on this machine's GPU."""
    return unavailable_reason() is None
