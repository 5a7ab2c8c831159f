"""The C++ and CUDA kernels of the causal numerator as ``torch.library`` custom operators.

An operator the dispatcher knows, with a fake-tensor function (output shapes and dtypes without
running it) and its gradient registered beside it, is something ``torch.compile`` records in
its graph as one node; an ``autograd.Function`` calling a pybind function would end the graph
there (a graph break per layer, an error under ``fullgraph=True``).

CPU, the register recurrence (``ops/cpu/causal_recurrence.cpp``), for float32 / float64 inputs
whose C and M are multiples of its register width (``ops/linear_attention/cpu_kernel.py`` pads
the others with zero columns and calls it):

* ``torch.ops.linformer_lab.causal_recurrence_forward(q, k, v, initial_state)``:
  ``q, k (B, H, N, C), v (B, H, N, M), S_0 (B, H, C, M) or None`` ->
  ``(out (B, H, N, M), S_N (B, H, C, M), states (B, H, ceil(N / block), C, M))``, all in q's
  dtype, ``states`` the S before each block of positions (what the backward starts from);
* ``torch.ops.linformer_lab.causal_recurrence_backward(q, k, v, grad_out, states, grad_final)``
  -> ``(grad q, grad k, grad v, grad S_0)``.

The forward's registered gradient calls the backward operator, which has none itself: a second
derivative is an error, not a wrong number.

CUDA (``ops/cuda``): :func:`register_cuda_ops` gives the operators that ``binding.cpp``
defines (``torch.ops.linformer_lab_cuda.causal_dot_product_fwd`` / ``_bwd``) their fake
functions and the forward its gradient; ``ops.cuda.load`` calls it once the library is loaded.
"""

from __future__ import annotations

import threading

import torch

from linformer_lab.ops import cpu

__all__ = ["causal_recurrence_backward", "causal_recurrence_forward", "recurrence_block", "register_cuda_ops"]


def recurrence_block() -> int:
    """Positions per saved state of the recurrence (its ``block()``): the forward keeps S at
    every block start. Builds the extension on the first call."""
    return cpu.CAUSAL_RECURRENCE.load().block()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, X) -> (B H, N, X)``, contiguous (the kernel reads raw rows)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]).contiguous()


@torch.library.custom_op("linformer_lab::causal_recurrence_forward", mutates_args=())
def causal_recurrence_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T) (module docstring for the shapes)."""
    b, h, n, c = q.shape
    m = v.shape[-1]
    # the kernel converts S_0 to q's dtype and copies it contiguous whatever its strides
    initial = None if initial_state is None else initial_state.reshape(b * h, c, m)
    out, final, states = cpu.CAUSAL_RECURRENCE.load().forward(_rows(q), _rows(k), _rows(v), initial)
    return out.view(b, h, n, m), final.view(b, h, c, m), states.view(b, h, states.shape[1], c, m)


@causal_recurrence_forward.register_fake
def _causal_recurrence_forward_fake(q, k, v, initial_state):
    b, h, n, c = q.shape
    m = v.shape[-1]
    blocks = (n + recurrence_block() - 1) // recurrence_block()
    return q.new_empty(b, h, n, m), q.new_empty(b, h, c, m), q.new_empty(b, h, blocks, c, m)


@torch.library.custom_op("linformer_lab::causal_recurrence_backward", mutates_args=())
def causal_recurrence_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                               states: torch.Tensor, grad_final: torch.Tensor | None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`causal_recurrence_forward` (eq. 13-15) from ``grad_out (B, H, N, M)``,
    its ``states`` and ``grad_final`` (grad S_N, or None): ``(grad q, grad k, grad v, grad S_0)``."""
    b, h, n, c = q.shape
    m = v.shape[-1]
    final = None if grad_final is None else grad_final.reshape(b * h, c, m)
    gq, gk, gv, g0 = cpu.CAUSAL_RECURRENCE.load().backward(_rows(q), _rows(k), _rows(v), _rows(grad_out.to(q.dtype)),
                                                           states.reshape(b * h, *states.shape[2:]).contiguous(), final)
    return gq.view(b, h, n, c), gk.view(b, h, n, c), gv.view(b, h, n, m), g0.view(b, h, c, m)


@causal_recurrence_backward.register_fake
def _causal_recurrence_backward_fake(q, k, v, grad_out, states, grad_final):
    b, h, _, c = q.shape
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(b, h, c, v.shape[-1])


def _setup_context(ctx, inputs, output):
    q, k, v, initial_state = inputs
    ctx.save_for_backward(q, k, v, output[2])
    ctx.initial_dtype = None if initial_state is None else initial_state.dtype
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)  # an unused output sends None, not a fresh zero tensor


def _backward(ctx, grad_out, grad_final, _grad_states):
    q, k, v, states = ctx.saved_tensors
    if grad_out is None:  # only S_N was used
        grad_out = torch.zeros_like(v)
    gq, gk, gv, g0 = causal_recurrence_backward(q, k, v, grad_out, states, grad_final)
    return gq, gk, gv, None if ctx.initial_dtype is None else g0.to(ctx.initial_dtype)


torch.library.register_autograd("linformer_lab::causal_recurrence_forward", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------ CUDA

_cuda_registered = False
_cuda_lock = threading.Lock()


def _cuda_forward_fake(q, k, v):
    return torch.empty_like(v)


def _cuda_backward_fake(q, k, v, grad_out, output_mask):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _cuda_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cuda_backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    # every gradient, whatever needs_input_grad: the operator's schema returns three tensors, and
    # a traced graph needs all three defined (attention's q, k, v all take gradients in training)
    return torch.ops.linformer_lab_cuda.causal_dot_product_bwd(q, k, v, grad_out.contiguous(), [True, True, True])


def register_cuda_ops() -> None:
    """Fake functions for ``linformer_lab_cuda::causal_dot_product_fwd`` / ``_bwd`` and the
    forward's gradient; once per process, after the CUDA library defined the operators."""
    global _cuda_registered
    with _cuda_lock:
        if _cuda_registered:
            return
        torch.library.register_fake("linformer_lab_cuda::causal_dot_product_fwd", _cuda_forward_fake)
        torch.library.register_fake("linformer_lab_cuda::causal_dot_product_bwd", _cuda_backward_fake)
        torch.library.register_autograd("linformer_lab_cuda::causal_dot_product_fwd", _cuda_backward,
                                        setup_context=_cuda_setup_context)
        _cuda_registered = True
