"""linear_cuda's numerator (``causal=cuda``) on a GPU (skipped without CUDA): values and gradients
against a float64 reference, long sequences, many heads, streams, devices, error messages, segments
with the state carried.
The other linear_cuda tests and how to run them all: ``tests/ops/linear_cuda_reference.py``.
"""

from __future__ import annotations

import pytest
import torch
from linear_cuda_reference import HAS_GPU, TOL, gpu, make_inputs, reference, rel_err

from linformer_lab.ops import cuda as lcuda

# ------------------------------------------------------------------------------------------------
# GPU tests
# ------------------------------------------------------------------------------------------------


def _check_against_reference(q, k, v, g, dtype, tol=None):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = lcuda.causal_dot_product(q, k, v)
    out.backward(g)
    assert out.dtype == dtype and out.shape == v.shape
    want = reference(q, k, v, g)
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), (out, q.grad, k.grad, v.grad), want):
        assert x.dtype == dtype, name
        assert torch.isfinite(x).all(), name
        err = rel_err(x, ref)
        assert err < (tol or TOL[dtype]), f"{name}: relative error {err:.2e}"


_DIMS = [16, 33, 64, 100, 128, 256]
_SHAPES = [  # (B, H, N, D, M): odd sizes, every D and M above, partial and single chunks
    (2, 3, 1, 16, 16),
    (1, 2, 63, 33, 100),
    (2, 1, 64, 64, 64),
    (1, 1, 65, 100, 33),
    (2, 2, 257, 128, 256),
    (1, 1, 130, 256, 16),
    (1, 2, 1000, 256, 128),
] + [(1, 1, 200, d, m) for d, m in zip(_DIMS, reversed(_DIMS))]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "B{}H{}N{}D{}M{}".format(*s))
def test_matches_float64_reference(shape, dtype):
    _check_against_reference(*make_inputs(*shape, dtype, device="cuda", seed=sum(shape)), dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_random_odd_shapes(dtype):
    gen = torch.Generator().manual_seed(1234)
    for trial in range(6):
        d, m = (_DIMS[i] for i in torch.randint(len(_DIMS), (2,), generator=gen))
        n = int(torch.randint(1, 700, (1,), generator=gen))
        _check_against_reference(*make_inputs(1, 2, n, d, m, dtype, device="cuda", seed=trial), dtype)


def _blockwise_reference(q, k, v, g, block=4096):
    """float64 out, grad_q, grad_k, grad_v by the O(N^2) definitions, a block of rows at a time so
    that N = 65536 fits in memory: out = tril(Q K^T) V, dQ = tril(G V^T) K, dK = triu(V G^T) Q,
    dV = triu(K Q^T) G."""
    q, k, v, g = (t.double() for t in (q, k, v, g))
    n = q.shape[-2]
    out, gq, gk, gv = (torch.empty_like(t) for t in (v, q, k, v))
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        rows = torch.arange(r0, r1, device=q.device)[:, None]
        past = torch.arange(0, r1, device=q.device)[None, :] <= rows  # j <= i, columns 0..r1
        fut = torch.arange(r0, n, device=q.device)[None, :] >= rows  # j >= i, columns r0..n
        out[..., r0:r1, :] = ((q[..., r0:r1, :] @ k[..., :r1, :].mT) * past) @ v[..., :r1, :]
        gq[..., r0:r1, :] = ((g[..., r0:r1, :] @ v[..., :r1, :].mT) * past) @ k[..., :r1, :]
        gv[..., r0:r1, :] = ((k[..., r0:r1, :] @ q[..., r0:, :].mT) * fut) @ g[..., r0:, :]
        gk[..., r0:r1, :] = ((v[..., r0:r1, :] @ g[..., r0:, :].mT) * fut) @ q[..., r0:, :]
    return out, gq, gk, gv


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_long_sequence_stays_finite_and_accurate(dtype):
    """N = 65536 with positive (feature-mapped) q, k, v scaled by the caller so that the
    numerator stays inside fp16's range: no inf/NaN, and the same accuracy as short sequences
    (fp32 gets 5e-5: 1024 chunks of rounding accumulate in the running state)."""
    b, h, n, d, m = 1, 2, 65536, 32, 48
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(b, h, n, d, generator=gen) / d
    k = torch.rand(b, h, n, d, generator=gen)
    v = torch.rand(b, h, n, m, generator=gen) / 64  # out_N ~ N * (1/4) / 64 * 1/2 = 256
    g = torch.randn(b, h, n, m, generator=gen) / 64
    q, k, v, g = (t.to("cuda", dtype) for t in (q, k, v, g))
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = lcuda.causal_dot_product(qr, kr, vr)
    out.backward(g)
    want = _blockwise_reference(q, k, v, g)
    tol = 5e-5 if dtype == torch.float32 else TOL[dtype]
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), (out, qr.grad, kr.grad, vr.grad), want):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < tol, (name, rel_err(x, ref))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_heads(dtype):
    """B * H = 70000 > 65535: the batch*head index must live on grid.x."""
    _check_against_reference(*make_inputs(7, 10000, 3, 8, 5, dtype, device="cuda"), dtype)


@gpu
def test_single_head_long_enough_for_many_chunks():
    _check_against_reference(*make_inputs(1, 1, 3000, 64, 64, torch.float32, device="cuda"), torch.float32)


@gpu
def test_non_contiguous_inputs_and_partial_grads():
    q, k, v, g = make_inputs(2, 5, 40, 16, 24, torch.float32, device="cuda")
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous strides
    assert not qt.is_contiguous()
    vr = v.clone().requires_grad_(True)
    out = lcuda.causal_dot_product(qt, k, vr)  # only v needs a gradient
    out.backward(g)
    _, _, _, want_gv = reference(q, k, v, g)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert rel_err(vr.grad, want_gv) < 1e-5


@gpu
def test_runs_on_the_current_stream():
    """The kernel must run on the caller's stream: if it used another one it would read x
    before the (delayed) copy on the side stream has written it."""
    q, k, v, _ = make_inputs(2, 4, 512, 64, 64, torch.float32, device="cuda")
    want = reference(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.zeros_like(v)
        torch.cuda._sleep(50_000_000)  # keep the side stream busy before the copy
        x.copy_(v)
        out = lcuda.causal_dot_product(q, k, x)
    side.synchronize()
    assert rel_err(out, want) < 1e-5


@gpu
@pytest.mark.skipif(not (HAS_GPU and torch.cuda.device_count() > 1), reason="needs 2 GPUs")
def test_second_device():
    with torch.cuda.device(0):  # inputs on cuda:1 while cuda:0 is current
        q, k, v, g = make_inputs(2, 3, 100, 33, 40, torch.bfloat16, device="cuda:1")
        _check_against_reference(q, k, v, g, torch.bfloat16)


@gpu
def test_error_messages():
    q, k, v, _ = make_inputs(1, 2, 8, 16, 16, torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="expected CUDA tensors.*`linear` backend"):
        lcuda.causal_dot_product(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(RuntimeError, match="expected CUDA tensors"):
        lcuda.causal_dot_product(q, k, v.cpu())
    big = torch.rand(1, 2, 8, 300, device="cuda")
    with pytest.raises(RuntimeError, match=r"D of q and k must be in 1\.\.256, got D = 300"):
        lcuda.causal_dot_product(big, big, v)
    with pytest.raises(RuntimeError, match=r"M of v must be in 1\.\.256, got M = 300"):
        lcuda.causal_dot_product(q, k, torch.rand(1, 2, 8, 300, device="cuda"))
    with pytest.raises(RuntimeError, match="share one dtype"):
        lcuda.causal_dot_product(q, k.half(), v)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        lcuda.causal_dot_product(q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match="4 dimensions"):
        lcuda.causal_dot_product(q[0], k[0], v[0])
    with pytest.raises(RuntimeError, match="same shape"):
        lcuda.causal_dot_product(q, k[..., :8], v)


@gpu
def test_empty_sequence():
    q, k, v, _ = make_inputs(1, 2, 0, 16, 16, torch.float32, device="cuda")
    assert lcuda.causal_dot_product(q, k, v).shape == (1, 2, 0, 16)


@gpu
def test_agrees_with_the_pure_pytorch_backend():
    la = pytest.importorskip("linformer_lab.ops.linear_attention.chunk")  # the PyTorch numerator
    q, k, v, _ = make_inputs(2, 2, 300, 64, 48, torch.float32, device="cuda")
    assert rel_err(lcuda.causal_dot_product(q, k, v), la.causal_dot_product(q, k, v).double()) < 1e-5


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_cuda_segments_with_state_equal_one_pass(dtype):
    """linear_cuda on a GPU: segments with the state carried == one forward, values and the
    gradients of q, k, v, against the float64 one-pass reference of the pure-PyTorch backend."""
    import linformer_lab as ll

    torch.manual_seed(0)
    attn = ll.build_attention("linear_cuda", causal=True, query_dim=32)
    q, k, v = (torch.randn(2, 4, 300, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    state, outs = None, []
    for a, b in ((0, 64), (64, 100), (100, 300)):
        out, state = attn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state=state, return_state=True)
        outs.append(out)
    got = torch.cat(outs, 2)
    reference_attn = ll.build_attention("linear", causal=True, query_dim=32).double()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = reference_attn(*leaves)
    g = torch.randn_like(want)
    got.backward(g.to(dtype))
    want.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(got, want) < tol
    for t, ref in zip((q, k, v), leaves):
        assert rel_err(t.grad, ref.grad) < tol
