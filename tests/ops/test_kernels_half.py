"""The causal op's C++ recurrence on half-precision CPU inputs (float16 / bfloat16 tensors, and
inputs made under CPU bf16 / fp16 autocast): ``select`` picks it, it runs them as float32 as the
reference does, and its output, final state and gradients equal the PyTorch reference's within
half-precision rounding and the float64 O(N^2) definition within half-precision tolerance.

Slow: loads (and may compile) the C++ extension.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from linformer_lab.ops import kernels
from linformer_lab.ops.linear_attention import naive

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("causal_extension")]

HALF = [torch.bfloat16, torch.float16]


def _inputs(c, m, seed=0):
    """float64 q, k (positive, as feature maps make them), v, S_0, grad out, grad S_N."""
    gen = torch.Generator().manual_seed(seed)
    b, h, n = 2, 3, 70
    q, k = (torch.rand(b, h, n, c, generator=gen, dtype=torch.float64) for _ in range(2))
    v, grad = (torch.randn(b, h, n, m, generator=gen, dtype=torch.float64) for _ in range(2))
    s0, grad_final = (torch.randn(b, h, c, m, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, s0, grad, grad_final


def _half_leaves(tensors, dtype, autocast):
    """q, k, v in ``dtype`` as leaves, and the (q, k, v) the op sees: the leaves themselves, or
    under ``autocast`` the outputs of an identity ``linear`` (autocast casts them to ``dtype``)."""
    if autocast:
        leaves = [t.float().requires_grad_() for t in tensors]
        eye = [torch.eye(t.shape[-1]) for t in tensors]
        return leaves, lambda: [torch.nn.functional.linear(t, e) for t, e in zip(leaves, eye)]
    leaves = [t.to(dtype).requires_grad_() for t in tensors]
    return leaves, lambda: leaves


def _run(candidate, tensors, dtype, autocast):
    """(out, S_N, grad q, grad k, grad v, grad S_0) of ``candidate`` on the half-rounded inputs."""
    q, k, v, s0, grad, grad_final = tensors
    leaves, made = _half_leaves((q, k, v), dtype, autocast)
    s0 = s0.float().requires_grad_()
    with torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext():
        hq, hk, hv = made()
        assert hq.dtype == hk.dtype == hv.dtype == dtype
        assert kernels.select("causal", hq, hk, hv, s0).name == "recurrence"
        out, final = candidate.run(hq, hk, hv, None, s0, True)
        assert out.dtype == dtype and final.dtype == torch.float32
        ((out * grad.to(dtype)).sum() + (final * grad_final.float()).sum()).backward()
    assert all(t.grad.dtype == t.dtype for t in (*leaves, s0))
    return out, final, *(t.grad for t in leaves), s0.grad


def _definition(tensors, dtype):
    """The same from the float64 definition on the same half-rounded inputs (autograd of it)."""
    q, k, v, s0, grad, grad_final = tensors
    leaves = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    s0 = s0.float().double().requires_grad_()
    q, k, v = leaves
    out = naive.causal_dot_product_naive(q, k, v) + q @ s0
    final = s0 + k.transpose(-1, -2) @ v
    ((out * grad.to(dtype).double()).sum() + (final * grad_final.float().double()).sum()).backward()
    return out, final, *(t.grad for t in leaves), s0.grad


def _close(got, want, atol):
    """Each result within ``atol`` of the largest entry of its counterpart."""
    for name, g, w in zip(["out", "S_N", "grad q", "grad k", "grad v", "grad S_0"], got, want):
        scale = w.abs().max().double()
        torch.testing.assert_close(g.double() / scale, w.double() / scale, rtol=0, atol=atol,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


@pytest.mark.parametrize("dims", [(32, 32), (7, 5)], ids=["C=M=32", "C=7,M=5 padded"])
@pytest.mark.parametrize("autocast", [False, True], ids=["half tensors", "autocast"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_half_inputs_run_the_recurrence_equal_to_the_reference_and_the_definition(monkeypatch, dtype, autocast,
                                                                                   dims):
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    tensors = _inputs(*dims)
    (recurrence,) = [c for c in kernels.CANDIDATES["causal"] if c.name == "recurrence"]
    ours = _run(recurrence, tensors, dtype, autocast)
    reference = _run(kernels.fallback("causal"), tensors, dtype, autocast)
    eps = torch.finfo(dtype).eps
    # both accumulate the same half-rounded inputs in float32; the results differ by the last bit
    # of the half-precision rounding at most
    _close(ours, reference, atol=eps)
    # against float64: the one rounding of each result (and of grad out) to half precision
    _close(ours, _definition(tensors, dtype), atol=2 * eps)


def test_float32_inputs_under_autocast_stay_float32(monkeypatch):
    """Under autocast the op computes float32 inputs in float32, as the reference does."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    q, k, v, *_ = (t.float() for t in _inputs(8, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernels.select("causal", q, k, v).name == "recurrence"
        out = kernels.causal_dot_product(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive.causal_dot_product_naive(q.double(), k.double(), v.double()),
                               rtol=2e-5, atol=2e-5)
