"""Packed sequences (``cu_seqlens``) in one pass (``ops/linear_attention/packed.py``) against every
sequence on its own in float64: the recurrence of eq. 10-12 from each sequence's initial state,
written with an explicit (N, C, M) cumulative sum, and for non-causal attention the sums of eq.
5-6; gradients by gradcheck (finite differences) into the inputs and the initial state and out of
the final state. The layouts that stress the spreading into chunks: sequences of one position,
lengths at and past chunk multiples, one sequence alone, an explicit chunk longer than the mean.
Packed sequences against the padded ``linear`` layer and softmax: ``test_state.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

import linformer_lab as ll
from linformer_lab.ops.linear_attention import packed_linear_attention

EPS = 1e-6


def per_sequence(phi_q, phi_k, v, lengths, s0, z0, causal):
    """``(out (1, H, T, M), S_N (S, H, C, M), Z_N (S, H, C))``: each sequence alone, from its row of
    (S_0, Z_0), by eq. 10-12 (causal) or eq. 5-6 with the state's keys attended to."""
    outs, finals, normalisers, start = [], [], [], 0
    for i, n in enumerate(lengths):
        q, k, x = (t[0, :, start:start + n] for t in (phi_q, phi_k, v))
        start += n
        s = s0[i].unsqueeze(1) + torch.einsum("hnc,hnm->hncm", k, x).cumsum(1)  # S_t, t = 1..n
        z = z0[i].unsqueeze(1) + k.cumsum(1)
        if not causal:  # every query sees the whole sequence's sums
            s, z = s[:, -1:].expand_as(s), z[:, -1:].expand_as(z)
        out = torch.einsum("hnc,hncm->hnm", q, s) / (torch.einsum("hnc,hnc->hn", q, z).unsqueeze(-1) + EPS)
        outs.append(out)
        finals.append(s[:, -1])
        normalisers.append(z[:, -1])
    return torch.cat(outs, dim=1).unsqueeze(0), torch.stack(finals), torch.stack(normalisers)


def _inputs(lengths, c=3, m=4, heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, s = sum(lengths), len(lengths)
    phi_q, phi_k = (torch.rand(1, heads, t, c, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, heads, t, m, generator=gen, dtype=torch.float64)
    s0 = torch.randn(s, heads, c, m, generator=gen, dtype=torch.float64)
    z0 = torch.rand(s, heads, c, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [x.requires_grad_() for x in (phi_q, phi_k, v, s0, z0)], offsets


#: lengths -> what they test; the default chunk is at most the mean length
LAYOUTS = {
    (5, 1, 12, 7): "mixed lengths",
    (1, 1, 1, 1, 9): "sequences of one position (chunk 2)",
    (8, 8, 16): "lengths at chunk multiples",
    (9, 17, 33): "lengths one past chunk multiples",
    (21,): "one sequence",
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["chunk=default", "chunk=8"])
@pytest.mark.parametrize("lengths", list(LAYOUTS), ids=list(LAYOUTS.values()))
def test_packed_equals_each_sequence_alone_with_its_state(lengths, chunk, causal):
    (phi_q, phi_k, v, s0, z0), offsets = _inputs(lengths, seed=len(lengths))
    out, state = packed_linear_attention(phi_q, phi_k, v, offsets, causal, EPS, (s0, z0), True, chunk)
    want, s_want, z_want = per_sequence(phi_q, phi_k, v, lengths, s0, z0, causal)
    assert_close("out", want, out, 1e-12, 1e-12)
    assert_close("S_N", s_want, state[0], 1e-12, 1e-12)
    assert_close("Z_N", z_want, state[1], 1e-12, 1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths", [(5, 1, 12, 7), (1, 1, 1, 1, 9)], ids=["mixed", "ones"])
def test_packed_gradients_into_the_inputs_and_state_and_from_the_final_state(lengths, causal):
    tensors, offsets = _inputs(lengths, c=2, m=3, seed=3)

    def run(*x):
        out, (s, z) = packed_linear_attention(*x[:3], offsets, causal, EPS, (x[3], x[4]), True)
        return out, s, z

    assert torch.autograd.gradcheck(run, tensors)
    assert torch.autograd.gradcheck(lambda *x: packed_linear_attention(*x, offsets, causal), tensors[:3])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_layer_carries_each_packed_sequence_state_into_the_next_segment(causal):
    """Two packed segments through ``linear``, the second from the first one's per-sequence state,
    equal each whole sequence on its own (float64)."""
    attention = ll.build_attention("linear", causal=causal, query_dim=4).double()
    gen = torch.Generator().manual_seed(4)
    first, second = [3, 10, 1], [6, 2, 9]
    q, k, v = (torch.randn(1, 2, sum(first) + sum(second), 4, generator=gen, dtype=torch.float64) for _ in range(3))
    cut = sum(first)
    out_1, state = attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], return_state=True,
                             cu_seqlens=torch.tensor([0, 3, 13, 14]))
    out_2 = attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], state=state, cu_seqlens=torch.tensor([0, 6, 8, 17]))
    starts_1, starts_2 = [0, 3, 13], [cut, cut + 6, cut + 8]
    for i in range(3):
        rows_1 = slice(starts_1[i], starts_1[i] + first[i])
        rows_2 = slice(starts_2[i], starts_2[i] + second[i])
        whole = torch.cat([torch.arange(cut)[rows_1], torch.arange(q.shape[2])[rows_2]])
        alone = attention(q[:, :, whole], k[:, :, whole], v[:, :, whole])
        if causal:
            got = torch.cat([out_1[:, :, rows_1], out_2[:, :, rows_2.start - cut:rows_2.stop - cut]], dim=2)
            assert_close(f"sequence {i}", alone, got, 1e-12, 1e-12)
        else:  # the second segment's queries see the first segment's keys too
            assert_close(f"sequence {i}", alone[:, :, first[i]:], out_2[:, :, rows_2.start - cut:rows_2.stop - cut],
                         1e-12, 1e-12)


def test_packed_offsets_on_another_device_than_the_inputs_are_named():
    """The packed form computes with the offsets on the inputs' device: a meta-device cu_seqlens is
    refused in one line naming both devices, before anything runs."""
    attention = ll.build_attention("linear", causal=True, query_dim=4)
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match="cu_seqlens is on meta but q, k, v are on cpu") as info:
        attention(q, q, q, cu_seqlens=torch.tensor([0, 2, 6], device="meta"))
    assert "\n" not in str(info.value)
