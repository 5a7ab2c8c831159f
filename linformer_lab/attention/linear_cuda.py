"""``linear_cuda``: the ``linear`` backend with the causal numerator on our CUDA kernel."""

from __future__ import annotations

from linformer_lab.attention.linear import LinearAttention


class LinearCudaAttention(LinearAttention):
    """Same arguments, feature maps and RNN mode as ``linear``; causal eq. 9-15 run in the CUDA
    kernel of :mod:`linformer_lab.ops.cuda` (compiled on first use). Non-causal attention
    and RNN steps are matmuls already and use the shared PyTorch code (cuBLAS on GPU).
    """

    def check_inputs(self, q, k, v, key_lengths=None):
        super().check_inputs(q, k, v, key_lengths)
        if q.device.type != "cuda":
            raise RuntimeError(
                f"attention backend 'linear_cuda' needs CUDA tensors, got tensors on {q.device}. "
                f"Use the 'linear' backend on CPU (same arguments, same results)."
            )

    def causal_dot_product(self, phi_q, phi_k, v, initial_state=None, return_final_state=False):
        from linformer_lab.ops import cuda as cuda_ops

        return cuda_ops.causal_dot_product(phi_q, phi_k, v, initial_state, return_final_state)
