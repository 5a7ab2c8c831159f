"""The C++ causal attention and the CUDA numerator as ``torch.library`` custom operators.

An operator the dispatcher knows, with a fake-tensor function (output shapes and dtypes without
running it) and its gradient registered beside it, is something ``torch.compile`` records in
its graph as one node; an ``autograd.Function`` calling a pybind function would end the graph
there (a graph break per layer, an error under ``fullgraph=True``). Each CPU operator here is
defined on a ``torch.library.Library`` with its CPU kernel and fake function; a forward's gradient
is an ``autograd.Function`` registered as its Autograd kernel (see "registration" below), which
calls the backward operator; that one has no gradient itself: a second derivative is an error,
not a wrong number.

CPU, causal attention with the normaliser fused, and phi = elu + 1 too unless ``mapped``
(``ops/cpu/causal_recurrence.cpp``'s ``attention_forward`` / ``attention_backward``, for float32 /
float64 inputs whose C and M are multiples of its register width; ``causal_recurrence.causal_attention``
maps q and k for any other feature map, pads C and M and calls it):

* ``torch.ops.linformer_lab.causal_attention_forward(q, k, v, s0, z0, cu_seqlens, key_lengths,
  features, eps, mapped)``: unmapped ``q, k (B, H, N, C)`` (``mapped``: phi(q), phi(k) of any map),
  ``v (B, H, N, M)``, ``S_0 (S, H, C, M)``, ``z_0 (S, H, C)`` or None (S = B, or the packed
  sequences of ``cu_seqlens [0, n_1, ..., N]`` with B = 1), ``key_lengths (B,)`` or None, C's
  columns from ``features`` on padding ->
  ``(out (B, H, N, M), den (B, H, N), S_N (S, H, C, M), z_N (S, H, C), states, z_states, phi(q),
  phi(k) (B, H, N, C))``, all in q's dtype, den and the last four the backward's (den = phi(q_t)^T
  z_t + eps; S and z at every block start; the maps, 0 at masked keys and padding columns, which
  autograd keeps in place of q and k: 2 C numbers per position and head, more memory only where q,
  k stay alive anyway);
* ``torch.ops.linformer_lab.causal_attention_backward(phi_q, phi_k, v, out, den, grad_out,
  states, z_states, cu_seqlens, grad_s, grad_z, mapped)`` -> ``(grad q, grad k, grad v, grad S_0,
  grad z_0)``: no map to recompute (``mapped``: the gradients of phi(q), phi(k)).

CUDA (``ops/cuda``): :func:`register_cuda_ops` gives the operators that ``binding.cpp``
defines (``torch.ops.linformer_lab_cuda.causal_dot_product_fwd`` / ``_bwd``) their fake
functions and the forward its gradient; ``ops.cuda.load`` calls it once the library is loaded.
"""

from __future__ import annotations

import threading

import torch

from linformer_lab.ops import cpu

__all__ = ["below_autograd", "causal_attention_backward", "causal_attention_forward", "define", "differentiable",
           "register_cuda_ops"]


# ------------------------------------------------------------------------------------------------ registration

# The operators are defined on a plain ``torch.library.Library``, each gradient an ``autograd.Function``
# registered as the operator's Autograd kernel. ``torch.library.custom_op`` does the same behind a
# generic wrapper (argument defaults filled in, pytrees, checks per call) whose Python cost per
# forward+backward was several times the kernels' own at short sequences.
_LIBRARY = torch.library.Library("linformer_lab", "FRAGMENT")


def define(schema: str, kernel, fake_function, dispatch_key: str = "CPU"):
    """The operator ``linformer_lab::<schema's name>`` with ``kernel`` for ``dispatch_key`` (``"CPU"``;
    ``"CompositeExplicitAutograd"``: every device) and ``fake_function`` for fake tensors
    (torch.compile's tracing): its ``OpOverload``."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"linformer_lab::{name}", fake_function, lib=_LIBRARY)
    return getattr(torch.ops.linformer_lab, name).default


def differentiable(name: str, function: type[torch.autograd.Function]) -> None:
    """``function`` (whose forward calls :func:`below_autograd`) as the Autograd kernel of the operator ``name``."""
    _LIBRARY.impl(name, function.apply, "Autograd")


def below_autograd(operator, *args):
    """``operator(*args)`` past its Autograd kernel, to the kernel of the inputs' device (or the fake one)."""
    with torch._C._AutoDispatchBelowAutograd():
        return operator(*args)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, X) -> (B H, N, X)``, contiguous (the kernel reads raw rows)."""
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]).contiguous()


# ------------------------------------------------------------------------------------------------ fused attention


def _segments(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """S: rows of the state, the batch or the packed sequences."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _saved_blocks(n: int, segments: int) -> int:
    """Blocks of states the fused forward saves per row of ``n`` positions in ``segments`` packed
    sequences (1 unpacked): its ``saved_blocks``, a bound from the shapes alone, as the sequences'
    lengths are data."""
    return cpu.CAUSAL_RECURRENCE.load().saved_blocks(n, segments)


def _row_lengths(key_lengths: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """``key_lengths (B,)`` as one length per (B H) row."""
    return None if key_lengths is None else key_lengths.to(torch.int64).repeat_interleave(heads)


def _state_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _attention_forward_cpu(q, k, v, s0, z0, cu_seqlens, key_lengths, features, eps, mapped):
    b, h, n, c = q.shape
    m = v.shape[-1]
    segments = _segments(q, cu_seqlens)
    out, den, s_n, z_n, states, z_states, phi_q, phi_k = cpu.CAUSAL_RECURRENCE.load().attention_forward(
        _rows(q), _rows(k), _rows(v), _state_rows(s0), _state_rows(z0), cu_seqlens, _row_lengths(key_lengths, h),
        features, eps, mapped)
    return (out.view(b, h, n, m), den.view(b, h, n), s_n.view(segments, h, c, m), z_n.view(segments, h, c),
            states.view(b, h, states.shape[1], c, m), z_states.view(b, h, z_states.shape[1], c),
            phi_q.view(b, h, n, c), phi_k.view(b, h, n, c))


def _attention_forward_fake(q, k, v, s0, z0, cu_seqlens, key_lengths, features, eps, mapped):
    b, h, n, c = q.shape
    m, segments = v.shape[-1], _segments(q, cu_seqlens)
    blocks = _saved_blocks(n, 1 if cu_seqlens is None else segments)
    return (q.new_empty(b, h, n, m), q.new_empty(b, h, n), q.new_empty(segments, h, c, m), q.new_empty(segments, h, c),
            q.new_empty(b, h, blocks, c, m), q.new_empty(b, h, blocks, c), q.new_empty(b, h, n, c), q.new_empty(b, h, n, c))


def _attention_backward_cpu(phi_q, phi_k, v, out, den, grad_out, states, z_states, cu_seqlens, grad_s, grad_z, mapped):
    b, h, n, c = phi_q.shape
    m, segments = v.shape[-1], _segments(phi_q, cu_seqlens)
    gq, gk, gv, gs, gz = cpu.CAUSAL_RECURRENCE.load().attention_backward(
        _rows(phi_q), _rows(phi_k), _rows(v), _rows(out), den.reshape(b * h, n).contiguous(),
        _rows(grad_out.to(phi_q.dtype)), states.reshape(b * h, *states.shape[2:]).contiguous(),
        z_states.reshape(b * h, *z_states.shape[2:]).contiguous(), cu_seqlens, _state_rows(grad_s), _state_rows(grad_z),
        mapped)
    return (gq.view(b, h, n, c), gk.view(b, h, n, c), gv.view(b, h, n, m), gs.view(segments, h, c, m),
            gz.view(segments, h, c))


def _attention_backward_fake(phi_q, phi_k, v, out, den, grad_out, states, z_states, cu_seqlens, grad_s, grad_z,
                             mapped):
    h, c, m, segments = phi_q.shape[1], phi_q.shape[-1], v.shape[-1], _segments(phi_q, cu_seqlens)
    return (torch.empty_like(phi_q), torch.empty_like(phi_k), torch.empty_like(v), phi_q.new_empty(segments, h, c, m),
            phi_q.new_empty(segments, h, c))


#: ``causal_attention_forward(q, k, v, s0, z0, cu_seqlens, key_lengths, features, eps, mapped)``:
#: out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), phi = elu + 1, or q and k given as phi(q), phi(k) with
#: ``mapped`` (module docstring for the shapes), differentiable.
causal_attention_forward = define(
    "causal_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? s0, Tensor? z0, Tensor? cu_seqlens, "
    "Tensor? key_lengths, int features, float eps, bool mapped) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _attention_forward_cpu, _attention_forward_fake)
#: ``causal_attention_backward(phi_q, phi_k, v, out, den, grad_out, states, z_states, cu_seqlens, grad_s,
#: grad_z, mapped)``: the forward's gradients from ``grad_out (B, H, N, M)``, its maps, ``out``, ``den`` and
#: states, and ``grad_s``, ``grad_z`` (of S_N, z_N, or None): ``(grad q, grad k, grad v, grad S_0, grad z_0)``.
causal_attention_backward = define(
    "causal_attention_backward(Tensor phi_q, Tensor phi_k, Tensor v, Tensor out, Tensor den, Tensor grad_out, "
    "Tensor states, Tensor z_states, Tensor? cu_seqlens, Tensor? grad_s, Tensor? grad_z, bool mapped) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", _attention_backward_cpu, _attention_backward_fake)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0, z0, cu_seqlens, key_lengths, features, eps, mapped):
        outputs = below_autograd(causal_attention_forward, q, k, v, s0, z0, cu_seqlens, key_lengths, features, eps,
                                 mapped)
        out, den, _, _, states, z_states, phi_q, phi_k = outputs
        # the maps in place of q and k: the backward needs phi and phi' = min(phi, 1), not q, k
        ctx.save_for_backward(phi_q, phi_k, v, out, den, states, z_states, cu_seqlens)
        ctx.state_dtypes = (None if s0 is None else s0.dtype, None if z0 is None else z0.dtype)
        ctx.mapped = mapped
        ctx.mark_non_differentiable(den, states, z_states, phi_q, phi_k)
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_den, grad_s, grad_z, _grad_states, _grad_z_states, _grad_phi_q, _grad_phi_k):
        phi_q, phi_k, v, out, den, states, z_states, cu_seqlens = ctx.saved_tensors
        if grad_out is None:  # only the final state was used
            grad_out = torch.zeros_like(out)
        gq, gk, gv, gs, gz = causal_attention_backward(phi_q, phi_k, v, out, den, grad_out, states, z_states,
                                                       cu_seqlens, grad_s, grad_z, ctx.mapped)
        s_dtype, z_dtype = ctx.state_dtypes
        return (gq, gk, gv, None if s_dtype is None else gs.to(s_dtype), None if z_dtype is None else gz.to(z_dtype),
                None, None, None, None, None)


differentiable("causal_attention_forward", _CausalAttention)


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
