"""``linear_cuda``: the ``linear`` backend with causal attention on our GPU kernels."""

from __future__ import annotations

import torch

from linformer_lab.attention.base import check_cu_seqlens, state_type_error
from linformer_lab.attention.linear import LinearAttention
from linformer_lab.validation import ConfigurationError

#: Why ``linear_cuda`` cannot run off CUDA (``where``: the run's device or the tensors'), and
#: what runs everywhere instead.
_NOT_CUDA = (
    "attention backend 'linear_cuda' runs only on CUDA GPUs, but {where}. "
    "Use the 'linear' backend instead (same arguments, same results, runs on CPU and GPU)."
)


class LinearCudaAttention(LinearAttention):
    """Same arguments, feature maps and RNN mode as ``linear``; causal eq. 9-15 run on the GPU
    kernels whatever the kernel dispatch would choose: the Triton chunk kernel
    (:mod:`linformer_lab.ops.cuda.triton_chunk`: the elu map and the normaliser fused, packed
    sequences in one launch) where Triton runs (compute capability >= 8.0), else the numerator
    on the CUDA C++ kernel of :mod:`linformer_lab.ops.cuda` (compiled on first use; it also runs
    on compute capability 7.x). Non-causal attention and RNN steps are matmuls already and use
    the shared PyTorch code (cuBLAS on GPU).

    Built anywhere (a model built on a CPU and moved to a GPU works); runs on CUDA tensors
    only. :meth:`check_device` lets a task refuse a CPU run before its first batch.
    """

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

    def forward(self, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
        from linformer_lab.ops.cuda.triton_chunk import backend

        self.check_inputs(q, k, v, key_lengths)
        if not (self.causal and backend.accepts(self.feature_map, q, k, v)):
            return super().forward(q, k, v, key_lengths, state, return_state, cu_seqlens)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)
        if state is not None and not isinstance(state, (tuple, list)):
            raise state_type_error(f"{type(self).__name__}.forward", state, "a LinearState (S, Z) or None")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, q.shape[2], q.shape[0], type(self).__name__, keys=k.shape[2])
        return backend.causal_attention(self.feature_map, q, k, v, key_lengths, self.eps, None, state, return_state,
                                        cu_seqlens)

    def causal_dot_product(self, phi_q, phi_k, v, initial_state=None, return_final_state=False):
        """The numerator on the CUDA C++ kernel, where the Triton kernel does not run."""
        from linformer_lab.ops import cuda as cuda_ops

        return cuda_ops.causal_dot_product(phi_q, phi_k, v, initial_state, return_final_state)
