"""A NaN in q or k reaches the outputs and gradients it reaches in a float64 reference (exactly
those; for a chunked kernel's gradients, at least those), through every kernel that computes
phi = elu + 1 itself: the C++ CPU attention (its vector selects took a NaN for 0, so phi(NaN) was
1) and the Triton kernels on a GPU's arithmetic (its max/min return the operand that is not NaN,
so phi(NaN) was the clamp's smallest normal). A kernel that turns a NaN into a number hides a
diverging model from every check that looks for one.

The reference is the recurrence (eq. 16-20) written out in float64, whose autograd reaches exactly
what each output depends on; the O(N^2) form's masked products would turn 0 * NaN into NaN in
every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_causal_cpu_attention import EPS, fused, inputs, results

# (tensor, row) of the NaN in q or k of a (1, 2, 40, 8) input, column 3 of the second head: row 2,
# and row 21, in the Triton kernel's second chunk of 16
PLACES = [("q", 2), ("k", 2), ("q", 21), ("k", 21)]


def poisoned(which: str, row: int):
    leaves, grads = inputs(1, 2, 40, 8, 6)
    target = leaves[0 if which == "q" else 1]
    target[0, 1, row, 3] = float("nan")
    return leaves, grads


def recurrent_attention(q, k, v, s0, z0):
    """Eq. 16-20 one position at a time, float64: (out, S_N, z_N)."""
    s, z, outs = s0, z0, []
    for t in range(q.shape[2]):
        phi_q, phi_k = F.elu(q[:, :, t]) + 1, F.elu(k[:, :, t]) + 1
        s, z = s + phi_k.unsqueeze(-1) * v[:, :, t].unsqueeze(-2), z + phi_k
        outs.append((phi_q.unsqueeze(-2) @ s).squeeze(-2) / ((phi_q * z).sum(-1, keepdim=True) + EPS))
    return torch.stack(outs, 2), s, z


def nan_rows(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` holds a NaN, reduced over its last dim (a row of out, a state's column...)."""
    return torch.isnan(t).any(-1)


def assert_same_nans(got: list, want: list, gradients_within_a_chunk: bool = False) -> None:
    """NaN where the reference has one and nowhere else; for the gradients of a chunked kernel
    (``gradients_within_a_chunk``), at least there: a chunk's masked products, as the O(N^2)
    form's, make 0 * NaN, which spreads a NaN to the rest of its chunk but never hides one."""
    for i, (name, g, w) in enumerate(zip(["out", "S_N", "z_N", "grad q", "grad k", "grad v", "grad S_0", "grad z_0"],
                                         got, want)):
        g_rows, w_rows = nan_rows(g), nan_rows(w)
        ok = bool((g_rows >= w_rows).all()) if gradients_within_a_chunk and i >= 3 else torch.equal(g_rows, w_rows)
        assert ok, f"{name}: NaN at {g_rows.nonzero()[:, -1].tolist()}, the reference's at {w_rows.nonzero()[:, -1].tolist()}"
    assert nan_rows(want[0]).any()  # the reference's output holds the NaN: the case is one


@pytest.mark.parametrize("which, row", PLACES, ids=lambda p: str(p))
def test_the_cpu_attention_keeps_a_nan_where_the_reference_has_it(which, row):
    leaves, grads = poisoned(which, row)
    want = results(recurrent_attention, leaves, grads, torch.float64)
    got = results(fused(), leaves, grads, torch.float32)
    assert_same_nans(got, want)


@pytest.fixture
def gpu_arithmetic():
    pytest.importorskip("triton")
    from triton_emulation import gpu_arithmetic

    from linformer_lab.ops.cuda.triton_chunk import launch

    if not launch.interpreting():
        pytest.skip("runs under Triton's interpreter")
    with gpu_arithmetic():
        yield


@pytest.mark.parametrize("which, row", PLACES, ids=lambda p: str(p))
def test_the_triton_kernels_keep_a_nan_where_the_reference_has_it(gpu_arithmetic, which, row):
    from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention

    def run(q, k, v, s0, z0):
        out, (s_n, z_n) = chunk_linear_attention(q, k, v, initial_state=(s0, z0), return_final_state=True, chunk_size=16)
        return out, s_n, z_n

    leaves, grads = poisoned(which, row)
    want = results(recurrent_attention, leaves, grads, torch.float64)
    got = results(run, leaves, grads, torch.float32)
    assert_same_nans(got, want, gradients_within_a_chunk=True)


@pytest.mark.parametrize("which", ["q", "k"])
def test_the_triton_step_keeps_a_nan_where_the_recurrence_has_it(gpu_arithmetic, which):
    """The generation step's kernel (``step_kernel.py``) computes phi itself too."""
    from linformer_lab.ops.cuda.triton_chunk.step import linear_attention_step_

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, d, generator=gen) for d in (8, 8, 6))
    (q if which == "q" else k)[1, 2, 5] = float("nan")
    joint = torch.rand(2, 3, 8, 7, generator=gen)
    phi_q, phi_k = F.elu(q.double()) + 1, F.elu(k.double()) + 1
    want_joint = joint.double() + phi_k.unsqueeze(-1) * torch.cat([v.double(), torch.ones(2, 3, 1)], -1).unsqueeze(-2)
    readout = (phi_q.unsqueeze(-2) @ want_joint).squeeze(-2)
    want = readout[..., :6] / (readout[..., 6:] + EPS)
    out = linear_attention_step_(q, k, v, joint, "elu", EPS)
    assert torch.equal(nan_rows(out), nan_rows(want)) and nan_rows(want).any()
    assert torch.equal(torch.isnan(joint).flatten(2).any(-1), torch.isnan(want_joint).flatten(2).any(-1))
