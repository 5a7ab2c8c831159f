"""Context parallelism: one sequence split over the processes of a group, through the state.

Linear attention's state after a prefix, ``[S | Z] = sum_j phi(k_j) [v_j | 1]^T`` ``(B, H, C, M + 1)``,
is a sum over positions of a size fixed by C and M alone (paper §3.4). So P processes each holding
a consecutive segment of one sequence (rank r the positions ``[r N, (r + 1) N)``) need only each
other's segment sums: every rank computes its own ``delta_r``, one all-gather gives all of them,
and rank r runs its segment from the exclusive prefix ``S_0 + sum_{r' < r} delta_r'`` through the
layer's own kernel, exactly as the one-process recurrence would arrive at position ``r N``.
Non-causal attention reads the sum over all ranks. The bytes exchanged per layer do not depend on
the sequence length; softmax and lsh, whose "state" is every key, cannot do this.

Gradients: ``delta_r`` reaches rank r's own prefix never and every later rank's prefix once (and
the returned final state of every rank), so its gradient is ``sum_{r' > r} dprefix_r' + sum_r'
dfinal_r'``: one all-gather of each rank's ``(dprefix, dfinal)`` in the backward.

Tensors replicated on every rank (the weights, an initial state, a returned final state) get on
each rank its share of the gradient; their sum over the group, which DDP's all-reduce forms for
the weights, is the one-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from linformer_lab.attention.base import Attention, check_key_lengths
from linformer_lab.ops.linear_attention import check_linear_state, joint_state, linear_attention
from linformer_lab.ops.linear_attention.chunk import compute_dtype
from linformer_lab.ops.masks import length_mask
from linformer_lab.ops.state import LinearState
from linformer_lab.registry import ATTENTION, PluginError
from linformer_lab.validation import ConfigurationError

__all__ = ["ExclusivePrefix", "SumOverRanks", "context_grid", "context_parallel", "context_segment", "segment_attention"]


def _rank_and_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised (dist.init_process_group) in every "
                           "process of the group")
    return dist.get_rank(group), dist.get_world_size(group)


class ExclusivePrefix(torch.autograd.Function):
    """``delta (...)`` on each rank -> ``(prefix, total)``: the sum of the earlier ranks' deltas and
    the sum of all of them, both in rank order (so ``total`` is the same bits on every rank).
    Forward: one all-gather of ``delta``; backward: one all-gather of ``(dprefix, dtotal)``."""

    @staticmethod
    def forward(ctx, delta: torch.Tensor, group):
        rank, size = _rank_and_size(group)
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(delta) for _ in range(size)]
        dist.all_gather(parts, delta.contiguous(), group=group)
        running, prefix = torch.zeros_like(delta), None
        for r, part in enumerate(parts):  # the running sum in rank order: the recurrence's order
            if r == rank:
                prefix = running
            running = running + part
        return prefix, running

    @staticmethod
    def backward(ctx, grad_prefix: torch.Tensor, grad_total: torch.Tensor):
        both = torch.stack([grad_prefix, grad_total]).contiguous()
        parts = [torch.empty_like(both) for _ in range(ctx.size)]
        dist.all_gather(parts, both, group=ctx.group)
        # delta_r enters the prefix of every later rank and the total of every rank
        grad = torch.zeros_like(grad_prefix)
        for r, part in enumerate(parts):
            grad = grad + (part[0] + part[1] if r > ctx.rank else part[1])
        return grad, None


class SumOverRanks(torch.autograd.Function):
    """``x (...)`` -> the sum over the group's ranks (all-reduce); its gradient is the sum of the
    ranks' gradients (all-reduce again): one collective each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        _rank_and_size(group)
        ctx.group = group
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def context_segment(length: int, group=None) -> tuple[int, int]:
    """``(start, stop)``: the positions of a sequence of ``length`` that this rank holds, the
    ``rank``-th of ``size`` equal consecutive segments of the group."""
    rank, size = _rank_and_size(group)
    if length % size:
        raise ValueError(f"context parallelism splits a sequence into {size} equal segments, one per process; "
                         f"{length} positions do not divide by {size}")
    n = length // size
    return rank * n, (rank + 1) * n


def context_grid(context: int):
    """The process group of this rank in a (data x context) grid of the whole world: every
    ``context`` consecutive ranks hold the segments of one batch's sequences. Every rank calls it
    (``dist.new_group`` is collective), in the same order."""
    rank, world = _rank_and_size(None)
    if context < 1 or world % context:
        raise ValueError(f"context_parallel = {context} must be >= 1 and divide the {world} processes of the run "
                         f"(a data x context grid); valid choices here: "
                         f"{', '.join(str(p) for p in range(1, world + 1) if world % p == 0)}")
    groups = [dist.new_group(list(range(first, first + context))) for first in range(0, world, context)]
    return groups[rank // context]


def _segment_sum(phi_k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``phi_k (B, H, N, C)``, ``v (B, H, N, M)``, ``valid (B, N)`` or None -> ``[S | Z]``
    ``(B, H, C, M + 1)``: the segment's summands of the state, in the state's (compute) dtype."""
    compute = compute_dtype(v.dtype)
    with torch.autocast(v.device.type, enabled=False):
        phi_k, v = phi_k.to(compute), v.to(compute)
        values = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [v | 1]: S and Z in one product
        if valid is not None:
            phi_k = phi_k * valid[:, None, :, None]
        return phi_k.transpose(-1, -2) @ values


def segment_attention(layer, group, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
    """A linear attention layer's forward on this rank's segment of one sequence split over
    ``group`` (the layer's :meth:`attend` computes the segment itself).

    q, k ``(B, H, N, D)``, v ``(B, H, N, M)``: positions ``[r N, (r + 1) N)`` of the sequence, every
    rank the same N; ``key_lengths (B,)`` and ``state`` (the state before position 0, the same on
    every rank) are the whole sequence's. Returns ``(B, H, N, M)``, with ``return_state`` also the
    state after the sequence's last position (the same on every rank).
    """
    name = type(layer).__name__
    if cu_seqlens is not None:
        raise ValueError(f"{name}: packed sequences (cu_seqlens) do not split over context-parallel processes; "
                         "pad the batch and pass key_lengths instead")
    if k.shape[2] != q.shape[2] and layer.causal:
        layer.check_cross_attention(q.shape[2], k.shape[2])
    rank, size = _rank_and_size(group)
    n = k.shape[2]
    local_lengths = valid = None
    if key_lengths is not None:
        check_key_lengths(key_lengths, batch=k.shape[0], seq=size * n, device=k.device, who=f"{name} (context parallel)")
        # the global lengths as this segment's: positions before r N are not here, after it padding
        local = key_lengths - rank * n
        valid = length_mask(local.clamp(0, n), n)
        # a segment wholly past a sequence's end is padding: its outputs are never read, so any
        # length in [1, N] serves the kernel; its keys are kept out of the state by ``valid`` above
        local_lengths = local.clamp(1, n)
    phi_k = layer.feature_map.forward_keys(k)
    delta = _segment_sum(phi_k, v, valid)
    initial = None
    if state is not None:
        s0, z0 = check_linear_state(state, phi_k, v, name)
        initial = joint_state(s0, z0).joint.to(delta.dtype)
    if not layer.causal:
        total = SumOverRanks.apply(delta, group)
        if initial is not None:
            total = initial + total
        total_state = LinearState(total)
        # the keys are all in the summed state: the layer's readout over no further keys
        phi_q = layer.feature_map.forward_queries(q)
        out = linear_attention(phi_q, phi_k[..., :0, :], v[..., :0, :], eps=layer.eps, initial_state=total_state)
        return (out, total_state) if return_state else out
    prefix, total = ExclusivePrefix.apply(delta, group)
    if initial is not None:
        prefix, total = initial + prefix, initial + total
    out = layer.attend(q, k, v, key_lengths=local_lengths, state=LinearState(prefix))
    return (out, LinearState(total)) if return_state else out


def _backend_name(module: Attention) -> str:
    for name in ATTENTION.names():
        try:
            if ATTENTION.get(name) is type(module):
                return name
        except PluginError:
            continue
    return type(module).__name__


def context_parallel(model: nn.Module, group=None) -> nn.Module:
    """Make every linear attention layer of ``model`` read its input as this rank's segment of one
    sequence split over ``group`` (default: every process; rank order = segment order), in place;
    returns ``model``. ``group=False`` undoes it (one process again).

    What the layers do: :func:`segment_attention`. What the caller does: give each rank its
    positions (:func:`context_segment`) with the global positions' embeddings (for example
    ``PixelTransformer.segment_nll(sequence, start, stop)``), and sum the weights' gradients over
    the group (DDP over it does). A backend without a fixed-size state is refused: softmax and lsh
    attention need every earlier key, not a sum of them.
    """
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for module in layers:
        if not hasattr(module, "context_group"):  # the backends that run a segment set it (linear)
            raise ConfigurationError(
                f"context_parallel: attention backend {_backend_name(module)!r} cannot split a sequence over processes "
                "(its state is every earlier key, not a fixed-size sum); use 'linear'")
    if group is not False:
        _rank_and_size(group)
    for module in layers:
        module.context_group = None if group is False else (group or dist.group.WORLD)
    return model
