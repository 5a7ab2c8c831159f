"""``linear_cuda``: the ``linear`` backend with its causal attention forced onto our GPU kernels."""

from __future__ import annotations

from typing import ClassVar

import torch

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.validation import ConfigurationError

#: Why ``linear_cuda`` cannot run off CUDA (``where``: the run's device or the tensors'), and
#: what runs everywhere instead.
_NOT_CUDA = (
    "attention backend 'linear_cuda' runs only on CUDA GPUs, but {where}. "
    "Use the 'linear' backend instead (same arguments, same results, runs on CPU and GPU)."
)


class LinearCudaAttention(LinearAttention):
    """``linear`` (same arguments, feature maps, RNN mode, packed sequences and code) with the
    GPU kernels forced, as ``LINFORMER_LAB_KERNELS=causal_attention=triton,causal=cuda`` would
    force them for this layer alone (:attr:`forced_kernels`): causal eq. 9-12 on the Triton chunk
    kernel (:mod:`linformer_lab.ops.cuda.triton_chunk`: the elu map and the normaliser fused,
    packed sequences in one launch) where Triton runs (compute capability >= 8.0), else the
    numerator on the CUDA C++ kernel of :mod:`linformer_lab.ops.cuda` (compiled on first use; it
    also runs on compute capability 7.x); where neither applies (:meth:`unavailable_reason` says
    why) the PyTorch reference computes the same. Non-causal attention and RNN steps are matmuls
    already and use the shared PyTorch code (cuBLAS on GPU).

    Built anywhere (a model built on a CPU and moved to a GPU works); runs on CUDA tensors
    only. :meth:`check_device` lets a task refuse a CPU run before its first batch.
    """

    forced_kernels: ClassVar[dict[str, str]] = {"causal_attention": "triton", "causal": "cuda"}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or None (``cli.py plugins --check`` asks)."""
        from linformer_lab.ops import cuda as cuda_ops
        from linformer_lab.ops.cuda import triton_chunk

        if not torch.cuda.is_available():
            return "no CUDA GPU visible (use 'linear' here)"
        if triton_chunk.is_available() or cuda_ops.is_available():
            return None
        return (f"neither GPU kernel runs here: Triton's ({triton_chunk.unavailable_reason()}), nor the CUDA "
                "extension (needs compute capability >= 7.0, CUDA toolkit, ninja)")

    def check_device(self, device: torch.device | str) -> None:
        """Raise a :class:`~linformer_lab.validation.ConfigurationError` unless ``device`` is a
        CUDA device (the tasks call this from ``setup`` with the run's device)."""
        if torch.device(device).type != "cuda":
            raise ConfigurationError(_NOT_CUDA.format(where=f"this run's device is {device}"))

    def check_inputs(self, q, k, v, key_lengths=None):
        super().check_inputs(q, k, v, key_lengths)
        if q.device.type != "cuda":
            raise RuntimeError(_NOT_CUDA.format(where=f"got tensors on {q.device}"))
