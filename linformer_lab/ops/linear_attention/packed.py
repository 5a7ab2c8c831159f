"""Linear attention over packed sequences (``cu_seqlens``) in one pass: no loop over the
sequences, and their offsets never read on the host (a GPU is not waited for).

``phi_q, phi_k (1, H, T, C)``, ``v (1, H, T, M)`` hold S sequences back to back and ``cu_seqlens``
(on their device) is ``[0, n_1, n_1 + n_2, ..., T]``, every n_s >= 1. Each sequence attends only
within itself, from its own initial state and to its own final state.

The positions are spread out so that every sequence starts on a chunk boundary: a chunk then
never holds two sequences, and the chunk algorithm of :mod:`.chunk` applies with its states
summed within each sequence only. The spread-out buffer's size follows from T and S alone (the
sequences fill at most T / L + S chunks of L positions), and L is at most the mean length T / S,
so the buffer is under twice T. The chunk states hold S and z together, ``[S | z] (C, M + 1)``
(the layout of :class:`~linformer_lab.ops.linear_attention.recurrent.LinearState`), so one scan
and one product with the queries serve the numerator and the normaliser. Everything is
accumulated in fp32 for half inputs, and autograd differentiates it.

The prefix states within sequences are a scan over chunks in log2(chunks) vectorised steps, not
a difference of running sums, which would cancel the other sequences' sums in rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linformer_lab.ops.linear_attention.chunk import compute_dtype, reference_chunk_size
from linformer_lab.ops.state import LinearState

__all__ = ["PackedChunks", "StatesWithinSequences", "packed_linear_attention"]


@dataclass
class PackedChunks:
    """Where the packed positions go: chunks of ``chunk`` positions, ``chunks`` of them in all.

    ``position (T,)``: each packed position's index in the spread-out ``(chunks chunk,)`` buffer;
    ``sequence (chunks,)``: the sequence each chunk belongs to (the unused chunks at the end, all
    zero, count as the last one's); ``last (S,)``: each sequence's last chunk.
    """

    chunk: int
    chunks: int
    position: torch.Tensor
    sequence: torch.Tensor
    last: torch.Tensor

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, total: int, chunk: int) -> PackedChunks:
        offsets = cu_seqlens.long()
        sequences = offsets.shape[0] - 1
        counts = (offsets[1:] - offsets[:-1] + chunk - 1) // chunk  # chunks per sequence
        ends = counts.cumsum(0)  # one past each sequence's last chunk
        t = torch.arange(total, device=offsets.device)
        of_position = torch.bucketize(t, offsets[1:], right=True)  # (T,) the sequence of each position
        position = t - offsets[of_position] + (ends - counts)[of_position] * chunk
        chunks = (total + sequences * (chunk - 1)) // chunk  # sum_s ceil(n_s / L) <= (T + S (L - 1)) / L
        sequence = torch.bucketize(torch.arange(chunks, device=offsets.device), ends, right=True)
        return cls(chunk, chunks, position, sequence.clamp_(max=sequences - 1), ends - 1)

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, H, T, X) -> (H, chunks, chunk, X)``, zeros between the sequences."""
        h, x_dim = x.shape[1], x.shape[-1]
        buffer = x.new_zeros(h, self.chunks * self.chunk, x_dim).index_copy(1, self.position, x[0])
        return buffer.view(h, self.chunks, self.chunk, x_dim)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(H, chunks, chunk, X) -> (1, H, T, X)``: the packed positions back from the buffer."""
        return x.flatten(1, 2).index_select(1, self.position).unsqueeze(0)


def _chunkwise(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(k,)`` bool mask as ``like``'s dtype, shaped to scale ``(H, k, ...)`` chunk by chunk."""
    return mask.to(like.dtype).view(-1, *[1] * (like.dim() - 2))


def _shifted(x: torch.Tensor, sequence: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Each chunk of ``x (H, chunks, ...)`` takes the previous chunk's value (``reverse``: the next
    one's) where that chunk is of its sequence, else zero."""
    same = _chunkwise(sequence[1:] == sequence[:-1], x)
    out = torch.zeros_like(x)
    if reverse:
        torch.mul(x[:, 1:], same, out=out[:, :-1])
    else:
        torch.mul(x[:, :-1], same, out=out[:, 1:])
    return out


def _summed_within_sequences(x: torch.Tensor, sequence: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Inclusive sums along dim 1 (chunks) of ``x (H, chunks, ...)`` within each sequence (``sequence
    (chunks,)`` non-decreasing), from the first chunk (``reverse``: from the last), in log2(chunks)
    vectorised steps: at step d each chunk adds the partial sum d chunks before it (after it) where
    that chunk is of its sequence. Two buffers besides ``x``, which is only read; no autograd."""
    current, buffers, step = x, [], 1
    while step < x.shape[1]:
        if len(buffers) < 2:
            buffers.append(torch.empty_like(x))
        out = buffers[0] if current is not buffers[0] else buffers[1]
        same = _chunkwise(sequence[step:] == sequence[:-step], x)
        if reverse:  # the last `step` chunks are complete: carried over
            out[:, -step:] = current[:, -step:]
            torch.addcmul(current[:, :-step], current[:, step:], same, out=out[:, :-step])
        else:
            out[:, :step] = current[:, :step]
            torch.addcmul(current[:, step:], current[:, :-step], same, out=out[:, step:])
        current, step = out, step * 2
    return current


class StatesWithinSequences(torch.autograd.Function):
    """``apply(x (H, chunks, C, M'), sequence (chunks,))``: the state before each chunk, the sum of
    the earlier chunks of its sequence (zero at a sequence's first chunk). A linear map whose
    transpose, the backward, sums the gradients of the later chunks of each sequence."""

    @staticmethod
    def forward(ctx, x, sequence):
        ctx.save_for_backward(sequence)
        return _shifted(_summed_within_sequences(x, sequence), sequence)

    @staticmethod
    def backward(ctx, grad):
        (sequence,) = ctx.saved_tensors
        return _summed_within_sequences(_shifted(grad, sequence, reverse=True), sequence, reverse=True), None


def packed_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    eps: float = 1e-6,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
):
    """Causal (eq. 9-12) or non-causal (eq. 5-6) linear attention of every packed sequence alone.

    Args: phi_q, phi_k ``(1, H, T, C)``, v ``(1, H, T, M)``, ``cu_seqlens`` ``(S + 1,)`` (module
    docstring); ``initial_state`` ``(S_0 (S, H, C, M), Z_0 (S, H, C))``, one row per sequence, or
    None; ``chunk_size``: L, by default the chunked numerator's for C and M, at most the mean length.
    Returns ``(1, H, T, M)`` in v's dtype, with ``return_state`` also each sequence's final state as
    a :class:`LinearState` of S rows (fp32 for half inputs). Gradients flow into every input and
    the initial state, and out of the returned state.
    """
    h, total, c = phi_q.shape[1], phi_q.shape[2], phi_q.shape[-1]
    m, sequences = v.shape[-1], cu_seqlens.shape[0] - 1
    compute = compute_dtype(phi_q.dtype)
    chunk = chunk_size or min(reference_chunk_size(c, m), max(1, total // sequences))
    layout = PackedChunks.of(cu_seqlens, total, chunk)
    with torch.autocast(phi_q.device.type, enabled=False):  # the sums stay in fp32 under autocast
        q, k, values = (layout.spread(x.to(compute)) for x in (phi_q, phi_k, v))  # (H, n, L, .)
        # [k^T v | sum k] per chunk: S and z in one state, z a last value column
        chunk_sums = torch.cat([k.transpose(-1, -2) @ values, k.sum(dim=2).unsqueeze(-1)], dim=-1)  # (H, n, C, M + 1)
        start = None
        if initial_state is not None:
            s0, z0 = initial_state
            start = torch.cat([s0, z0.unsqueeze(-1)], dim=-1).to(compute).transpose(0, 1)  # (H, S, C, M + 1)
        if causal:
            before = StatesWithinSequences.apply(chunk_sums, layout.sequence)  # (H, n, C, M + 1)
            final = before[:, layout.last] + chunk_sums[:, layout.last]  # (H, S, C, M + 1)
            if start is not None:
                before, final = before + start[:, layout.sequence], final + start
            scores = (q @ k.transpose(-1, -2)).tril()  # (H, n, L, L)
            result = q @ before  # (H, n, L, M + 1): the earlier chunks' part of numerator and normaliser
            numerator = scores @ values + result[..., :m]
            denominator = scores.sum(dim=-1, keepdim=True) + result[..., m:]
        else:
            final = chunk_sums.new_zeros(h, sequences, c, m + 1).index_add(1, layout.sequence, chunk_sums)
            if start is not None:
                final = final + start
            result = q @ final[:, layout.sequence]
            numerator, denominator = result[..., :m], result[..., m:]
        out = layout.gather(numerator / (denominator + eps)).to(v.dtype)
    return (out, LinearState(final.transpose(0, 1).contiguous())) if return_state else out
