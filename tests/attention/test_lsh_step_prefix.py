"""What lsh's ``step`` equals (issue 43, item 8): the causal forward over the same prefix, not the
causal forward over the whole sequence. Reformer's chunks are cut after sorting by hash bucket,
so a later position can move an earlier one into another chunk and change its output; the README
and ``Attention.step`` say so."""

from __future__ import annotations

import torch
from conftest import assert_close

import linformer_lab as ll

N, D, M = 24, 4, 3


def _steps_and_forwards():
    torch.manual_seed(0)
    lsh = ll.build_attention("lsh", causal=True, query_dim=D, n_hashes=1, bucket_size=4, n_buckets=4).double()
    q, v = torch.randn(2, 2, N, D, dtype=torch.float64), torch.randn(2, 2, N, M, dtype=torch.float64)
    state, steps = None, []
    for t in range(N):
        out, state = lsh.step(q[:, :, t], q[:, :, t], v[:, :, t], state)
        steps.append(out)
    prefix = [lsh(q[:, :, : t + 1], q[:, :, : t + 1], v[:, :, : t + 1])[:, :, t] for t in range(N)]
    return torch.stack(steps, 2), torch.stack(prefix, 2), lsh(q, q, v)


def test_lsh_step_equals_the_causal_forward_over_the_same_prefix():
    steps, prefix_forwards, _ = _steps_and_forwards()
    assert_close("lsh step vs forward over the prefix", prefix_forwards, steps, rtol=1e-12, atol=1e-12)


def test_lsh_step_differs_from_the_forward_over_the_whole_sequence():
    steps, _, whole = _steps_and_forwards()
    assert torch.equal(steps[:, :, -1], whole[:, :, -1])  # the last position sees the same sequence
    assert (steps - whole).abs().max() > 0.1  # earlier positions: later ones changed their chunks
