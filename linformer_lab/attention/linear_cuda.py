"""``linear_cuda``: the ``linear`` backend with the causal numerator on our CUDA kernel."""

from __future__ import annotations

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
    """Same arguments, feature maps and RNN mode as ``linear``; causal eq. 9-15 run in the CUDA
    kernel of :mod:`linformer_lab.ops.cuda` (compiled on first use). Non-causal attention
    and RNN steps are matmuls already and use the shared PyTorch code (cuBLAS on GPU).

    Built anywhere (a model built on a CPU and moved to a GPU works); runs on CUDA tensors
    only. :meth:`check_device` lets a task refuse a CPU run before its first batch.
    """

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or None (``cli.py plugins --check`` asks)."""
        from linformer_lab.ops import cuda as cuda_ops

        if not torch.cuda.is_available():
            return "no CUDA GPU visible (use 'linear' here)"
        if not cuda_ops.is_available():
            return "the CUDA extension cannot be built or loaded here (needs compute capability >= 7.0, CUDA toolkit, ninja)"
        return None

    def check_device(self, device: torch.device | str) -> None:
        """Raise a :class:`~linformer_lab.validation.ConfigurationError` unless ``device`` is a
        CUDA device (the tasks call this from ``setup`` with the run's device)."""
        if torch.device(device).type != "cuda":
            raise ConfigurationError(_NOT_CUDA.format(where=f"this run's device is {device}"))

    def check_inputs(self, q, k, v, key_lengths=None):
        super().check_inputs(q, k, v, key_lengths)
        if q.device.type != "cuda":
            raise RuntimeError(_NOT_CUDA.format(where=f"got tensors on {q.device}"))

    def causal_dot_product(self, phi_q, phi_k, v, initial_state=None, return_final_state=False):
        from linformer_lab.ops import cuda as cuda_ops

        return cuda_ops.causal_dot_product(phi_q, phi_k, v, initial_state, return_final_state)
