"""Context parallelism: one sequence split over the processes of a group, through the state.

Linear attention's state after a prefix, ``[S | Z] = sum_j phi(k_j) [v_j | 1]^T`` ``(B, H, C, M + 1)``,
is a sum over positions of a size fixed by C and M alone (paper §3.4). So P processes each holding
a consecutive segment of one sequence (rank r the positions ``[r N, (r + 1) N)``) need only each
other's segment sums ``delta_r``, all of them from one all-gather: rank r runs its segment through
the layer's own kernel from the exclusive prefix ``S_0 + sum_{r' < r} delta_r'``, exactly the
one-process recurrence's state at ``r N``; non-causal attention reads the sum over all ranks. The
bytes exchanged per layer do not depend on the sequence length; softmax and lsh, whose "state" is
every key, cannot do this. Packed (causal) sequences work so per sequence. Every collective
carries the segment's length, so segments of unequal length stop every rank with one message.

Gradients: every rank sums the gathered deltas itself (its prefix the earlier ranks' rows, the
final state all of them), so ``delta_r`` reaches rank r's own prefix never and every later rank's
prefix once (and the final state of every rank): its gradient ``sum_{r' > r} dprefix_r' + sum_r'
dfinal_r'`` is the sum over the ranks of their gradients of row r, one all-reduce in the backward.

Tensors replicated on every rank (the weights, an initial state, a returned final state) get on
each rank its share of the gradient; their sum over the group, which DDP's all-reduce forms for
the weights, is the one-process gradient.
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist
from torch import nn

from linformer_lab.attention.base import Attention, check_key_lengths
from linformer_lab.ops.linear_attention import check_linear_state, joint_state, linear_attention
from linformer_lab.ops.linear_attention.chunk import compute_dtype
from linformer_lab.ops.masks import length_mask
from linformer_lab.ops.state import LinearState
from linformer_lab.registry import ATTENTION
from linformer_lab.validation import ConfigurationError

__all__ = ["GatherOverRanks", "check_splittable", "context_grid", "context_parallel", "context_segment",
           "segment_attention"]


def _rank_and_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised (dist.init_process_group) in every "
                           "process of the group")
    return dist.get_rank(group), dist.get_world_size(group)


def _gather(x: torch.Tensor, n: int, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``x``, in rank order (one all-gather), having checked that every rank holds a
    segment of the same ``n`` positions: the length travels in the same message, so every rank
    sees every length and all of them stop together on a mismatch, none left in a collective."""
    flat = torch.cat([x.detach().flatten(), x.new_tensor([float(n)])])
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat, group=group)
    lengths = [int(length) for length in torch.stack([part[-1] for part in parts]).tolist()]  # one read
    if any(length != n for length in lengths):
        raise ValueError(f"context parallelism needs a segment of the same length on every process of the group; "
                         f"got {lengths} positions on ranks 0..{size - 1} (split the sequence with ll.context_segment)")
    return [part[:-1].view_as(x) for part in parts]


class GatherOverRanks(torch.autograd.Function):
    """``x (...)`` on each rank -> ``(P, ...)``, every rank's in rank order (one all-gather, the
    segment's length ``n`` checked equal); one's own row's gradient is the sum over the ranks of
    their gradients of that row (one all-reduce of the ``(P, ...)`` gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, n: int):
        ctx.group, (ctx.rank, size) = group, _rank_and_size(group)
        return torch.stack(_gather(x, n, group, size))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None


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
    state after the sequence's last position (the same on every rank). The layer's forward has
    checked q, k, v.
    """
    name = type(layer).__name__
    rank, size = _rank_and_size(group)
    n = k.shape[2]
    layer.check_state_request(state, return_state, cu_seqlens, key_lengths)
    if cu_seqlens is not None:
        return _packed_segment(layer, group, rank, size, q, k, v, cu_seqlens, state, return_state)
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
    # (P, B, H, C, M + 1), every rank summing them alike: the same bits on every rank and every rerun
    deltas = GatherOverRanks.apply(delta, group, n)
    if not layer.causal:
        total = deltas.sum(dim=0)
        if initial is not None:
            total = initial + total
        total_state = LinearState(total)
        # the keys are all in the summed state: the layer's readout over no further keys
        phi_q = layer.feature_map.forward_queries(q)
        out = linear_attention(phi_q, phi_k[..., :0, :], v[..., :0, :], eps=layer.eps, initial_state=total_state)
        return (out, total_state) if return_state else out
    prefix, total = deltas[:rank].sum(dim=0), deltas.sum(dim=0)
    if initial is not None:
        prefix, total = initial + prefix, initial + total
    out = layer.attend(q, k, v, key_lengths=local_lengths, state=LinearState(prefix))
    return (out, LinearState(total)) if return_state else out


def _packed_segment(layer, group, rank: int, size: int, q, k, v, cu_seqlens, state, return_state):
    """:func:`segment_attention` of packed sequences: ``q, k (1, H, N, D)``, ``v (1, H, N, M)`` are
    positions ``[r N, (r + 1) N)`` of the packed whole, ``cu_seqlens (S + 1,)`` the whole's offsets
    (the same on every rank), ``state`` one row per sequence of the whole. A sequence may start on
    one rank and end on a later one: its part on each rank is a piece, and only a rank's first
    piece starts from the earlier ranks' states (those whose last piece is of the same sequence).
    """
    name = type(layer).__name__
    if not layer.causal:
        raise ValueError(f"{name}: non-causal packed sequences do not split over context-parallel processes; "
                         "pad the batch and pass key_lengths instead")
    n = k.shape[2]
    offsets = cu_seqlens.tolist()  # the host needs the pieces' count: one read per layer
    if offsets[-1] != size * n:
        raise ValueError(f"{name} (context parallel): cu_seqlens ends at {offsets[-1]} positions, but the {size} "
                         f"processes hold {size} x {n}; pass the whole packed sequence's offsets on every process")
    # the sequence of each rank's first and last position
    first = [bisect.bisect_right(offsets, r * n) - 1 for r in range(size)]
    last = [bisect.bisect_right(offsets, (r + 1) * n - 1) - 1 for r in range(size)]
    start = rank * n
    local = [0, *(o - start for o in offsets if start < o < start + n), n]
    tail = local[-2]  # the first position of this rank's last piece: what later ranks may continue
    phi_k = layer.feature_map.forward_keys(k)
    deltas = GatherOverRanks.apply(_segment_sum(phi_k[:, :, tail:], v[:, :, tail:], None), group, n)  # (P, 1, H, C, M + 1)
    # the earlier ranks whose last piece this rank's first piece continues; a product with a 0/1
    # mask, not a selection, so that every rank's backward runs the gather's collective
    carried = deltas.new_tensor([float(r < rank and last[r] == first[rank]) for r in range(size)])
    prefix = (deltas * carried.view(-1, *[1] * (deltas.dim() - 1))).sum(dim=0)
    pieces = len(local) - 1
    initial = prefix.new_zeros(pieces, *prefix.shape[1:])  # (pieces, H, C, M + 1)
    if state is not None:
        s0, z0 = state
        whole = joint_state(s0, z0).joint.to(prefix.dtype)  # (S, H, C, M + 1)
        initial = whole[first[rank] : first[rank] + pieces]
    initial = torch.cat([initial[:1] + prefix, initial[1:]])
    local_cu = torch.tensor(local, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    result = layer.attend(q, k, v, state=LinearState(initial), return_state=return_state, cu_seqlens=local_cu)
    if not return_state:
        return result
    out, final = result
    # each sequence's final state from the rank of its last position, summed into every rank's rows
    ends_here = pieces - (1 if rank + 1 < size and first[rank + 1] == last[rank] else 0)
    rows = final.joint.new_zeros(len(offsets) - 1, *final.joint.shape[1:])
    rows = rows.index_add(0, torch.arange(first[rank], first[rank] + ends_here, device=rows.device),
                          final.joint[:ends_here])
    return out, LinearState(GatherOverRanks.apply(rows, group, n).sum(dim=0))


def _backend_name(module: Attention) -> str:
    return next((name for name, cls in ATTENTION.loadable() if cls is type(module)), type(module).__name__)


def check_splittable(model: nn.Module) -> list[Attention]:
    """``model``'s attention layers, or a ConfigurationError naming the first backend that cannot
    run a segment of a sequence split over processes (softmax and lsh: their state is every
    earlier key, not a fixed-size sum)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for module in layers:
        if not hasattr(module, "context_group"):  # the backends that run a segment set it (linear)
            raise ConfigurationError(
                f"context_parallel: attention backend {_backend_name(module)!r} cannot split a sequence over processes "
                "(its state is every earlier key, not a fixed-size sum); use 'linear'")
    return layers


def context_parallel(model: nn.Module, group=None) -> nn.Module:
    """Make every linear attention layer of ``model`` read its input as this rank's segment of one
    sequence split over ``group`` (default: every process; rank order = segment order), in place;
    returns ``model``. ``group=False`` undoes it (one process again).

    What the layers do: :func:`segment_attention`. What the caller does: give each rank its
    positions (:func:`context_segment`) with the global positions' embeddings (for example
    ``PixelTransformer.segment_nll(sequence, start, stop)``), and sum the weights' gradients over
    the group (DDP over it does). A backend without a fixed-size state is refused (:func:`check_splittable`).
    """
    layers = check_splittable(model)
    if group is not False:
        _rank_and_size(group)
    for module in layers:
        module.context_group = None if group is False else (group or dist.group.WORLD)
    return model
