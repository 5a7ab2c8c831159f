"""The ``causal_attention`` op's C++ kernel on half-precision CPU inputs (float16 / bfloat16 tensors,
and inputs made under CPU bf16 / fp16 autocast): ``select`` picks it, it runs them as float32 (the
state comes back in float32, the output and the gradients of q, k, v in the inputs' dtype), and its
output, final state and gradients equal the float64 O(N^2) attention of the same half-rounded inputs
within half-precision tolerance; for a map that PyTorch applies first (relu, exact in half precision)
they equal the ``pytorch`` candidate's within half-precision rounding, as both accumulate the same
half-rounded features in float32.

Slow: loads (and may compile) the C++ extension.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import linformer_lab as ll
from linformer_lab.ops import kernels

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("causal_extension")]

HALF = [torch.bfloat16, torch.float16]
EPS = 1e-6
NAMES = ["out", "S_N", "z_N", "grad q", "grad k", "grad v", "grad S_0", "grad z_0"]


def _inputs(c, m, seed=0):
    """float64 unmapped q, k, v, S_0, z_0 and the gradients of out, S_N, z_N."""
    gen = torch.Generator().manual_seed(seed)
    b, h, n = 2, 3, 70
    q, k = (torch.randn(b, h, n, c, generator=gen, dtype=torch.float64) for _ in range(2))
    v, grad = (torch.randn(b, h, n, m, generator=gen, dtype=torch.float64) for _ in range(2))
    s0, grad_s = (torch.randn(b, h, c, m, generator=gen, dtype=torch.float64) for _ in range(2))
    z0, grad_z = torch.rand(b, h, c, generator=gen, dtype=torch.float64) * 4, torch.randn(b, h, c, generator=gen,
                                                                                         dtype=torch.float64)
    return q, k, v, s0, z0, grad, grad_s, grad_z


def _half_leaves(tensors, dtype, autocast):
    """q, k, v in ``dtype`` as leaves, and the (q, k, v) the op sees: the leaves themselves, or
    under ``autocast`` the outputs of an identity ``linear`` (autocast casts them to ``dtype``)."""
    if autocast:
        leaves = [t.float().requires_grad_() for t in tensors]
        eye = [torch.eye(t.shape[-1]) for t in tensors]
        return leaves, lambda: [torch.nn.functional.linear(t, e) for t, e in zip(leaves, eye)]
    leaves = [t.to(dtype).requires_grad_() for t in tensors]
    return leaves, lambda: leaves


def _run(name, feature_map, tensors, dtype, autocast):
    """(out, S_N, z_N, grad q, k, v, S_0, z_0) of the candidate ``name`` on the half-rounded inputs."""
    q, k, v, s0, z0, grad, grad_s, grad_z = tensors
    leaves, made = _half_leaves((q, k, v), dtype, autocast)
    state = [s0.float().requires_grad_(), z0.float().requires_grad_()]
    (candidate,) = [c for c in kernels.CANDIDATES["causal_attention"] if c.name == name]
    with torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext():
        hq, hk, hv = made()
        assert hq.dtype == hk.dtype == hv.dtype == dtype
        assert kernels.select("causal_attention", feature_map, hq, hk, hv).name == "cpp"
        out, (s_n, z_n) = candidate.run(feature_map, hq, hk, hv, None, EPS, kernels.causal_dot_product, tuple(state),
                                        True)
        assert out.dtype == dtype and s_n.dtype == z_n.dtype == torch.float32
        ((out * grad.to(dtype)).sum() + (s_n * grad_s.float()).sum() + (z_n * grad_z.float()).sum()).backward()
    assert all(t.grad.dtype == t.dtype for t in (*leaves, *state))
    return out, s_n, z_n, *(t.grad for t in leaves), *(t.grad for t in state)


def _definition(feature_map, tensors, dtype):
    """The same from the float64 O(N^2) attention on the same half-rounded inputs (autograd of it)."""
    q, k, v, s0, z0, grad, grad_s, grad_z = tensors
    leaves = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    state = [t.float().double().requires_grad_() for t in (s0, z0)]
    (q, k, v), (s0, z0) = leaves, state
    phi_q, phi_k = feature_map.forward_queries(q), feature_map.forward_keys(k)
    weights = torch.tril(phi_q @ phi_k.transpose(-1, -2))
    out = (weights @ v + phi_q @ s0) / (weights.sum(-1, keepdim=True) + phi_q @ z0.unsqueeze(-1) + EPS)
    s_n, z_n = s0 + phi_k.transpose(-1, -2) @ v, z0 + phi_k.sum(-2)
    ((out * grad.to(dtype).double()).sum() + (s_n * grad_s.float().double()).sum()
     + (z_n * grad_z.float().double()).sum()).backward()
    return out, s_n, z_n, *(t.grad for t in leaves), *(t.grad for t in state)


def _close(got, want, atol):
    """Each result within ``atol`` of the largest entry of its counterpart."""
    for name, g, w in zip(NAMES, got, want, strict=True):
        scale = w.abs().max().double()
        torch.testing.assert_close(g.double() / scale, w.double() / scale, rtol=0, atol=atol,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("dims", [(32, 32), (7, 5)], ids=["C=M=32", "C=7,M=5 padded"])
@pytest.mark.parametrize("autocast", [False, True], ids=["half tensors", "autocast"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_half_inputs_run_the_cpp_kernel_equal_to_the_definition_and_the_pytorch_form(monkeypatch, dtype, autocast,
                                                                                      dims, feature_map):
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    tensors = _inputs(*dims)
    phi = ll.build_feature_map(feature_map, query_dim=dims[0])
    ours = _run("cpp", phi, tensors, dtype, autocast)
    eps = torch.finfo(dtype).eps
    # against float64: the one rounding of each result (and of grad out) to half precision
    _close(ours, _definition(phi, tensors, dtype), atol=2 * eps)
    if feature_map == "relu":  # both take the same half-precision features and accumulate them in float32
        _close(ours, _run("pytorch", phi, tensors, dtype, autocast), atol=eps)


def test_float32_inputs_under_autocast_stay_float32(monkeypatch):
    """Under autocast the op computes float32 inputs in float32, as the PyTorch form does."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    tensors = [t.float() for t in _inputs(8, 8)]
    phi = ll.build_feature_map("elu", query_dim=8)
    q, k, v, s0, z0 = tensors[:5]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chosen = kernels.select("causal_attention", phi, q, k, v)
        assert chosen.name == "cpp"
        out = chosen.run(phi, q, k, v, None, EPS, kernels.causal_dot_product, (s0, z0))
    assert out.dtype == torch.float32
    want = _definition(phi, [t.double() for t in tensors], torch.float64)[0]
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
