"""The causal recurrence as ``torch.library`` operators (linformer_lab/ops/custom_ops.py):
``opcheck`` (schema, fake-tensor function, registered gradient, AOT dispatch) on the forward and
backward operators, the recurrence zero-padded at C, M that do not fill whole registers
(ops/cpu/causal_recurrence.py) against the float64 O(N^2) reference with gradients against
autograd of the reference, and the fake functions and gradient given to the CUDA operators.
tests/models/test_compile.py traces whole models through them with torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from linformer_lab.ops import custom_ops
from linformer_lab.ops.cpu import causal_recurrence
from linformer_lab.ops.linear_attention import naive

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def inputs(b, h, n, c, m, dtype=torch.float64, state=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # positive features as from elu + 1, so sums grow with N as they do in attention
    q, k = (torch.rand(b, h, n, c, dtype=dtype, generator=generator) for _ in range(2))
    v = torch.randn(b, h, n, m, dtype=dtype, generator=generator)
    s0 = torch.randn(b, h, c, m, dtype=dtype, generator=generator) if state else None
    return q, k, v, s0


def reference(q, k, v, s0):
    """out_i = q_i^T (S_0 + sum_{j <= i} k_j v_j^T) and S_N in float64, from the O(N^2) form."""
    q, k, v = q.double(), k.double(), v.double()
    out = naive.causal_dot_product_naive(q, k, v)
    final = k.transpose(-1, -2) @ v
    if s0 is not None:
        out, final = out + q @ s0.double(), final + s0.double()
    return out, final


@pytest.mark.slow  # opcheck traces with AOT autograd: several seconds
@pytest.mark.parametrize("state", [False, True])
def test_forward_operator_passes_opcheck(causal_extension, state):
    """Schema, fake function (shapes and dtypes as the kernel's), the registered gradient and
    AOT dispatch, with N past one saved block (two states)."""
    q, k, v, s0 = inputs(2, 2, causal_extension.block() + 3, 4, 8, state=state)
    for t in (q, k, v) + (() if s0 is None else (s0,)):
        t.requires_grad_(True)
    torch.library.opcheck(custom_ops.causal_recurrence_forward, (q, k, v, s0))


@pytest.mark.slow
def test_backward_operator_passes_opcheck(causal_extension):
    q, k, v, s0 = inputs(1, 3, 40, 8, 4, state=True)
    _, final, states = custom_ops.causal_recurrence_forward(q, k, v, s0)
    torch.library.opcheck(custom_ops.causal_recurrence_backward, (q, k, v, torch.randn_like(v), states,
                                                                  torch.randn_like(final)))
    torch.library.opcheck(custom_ops.causal_recurrence_backward, (q, k, v, torch.randn_like(v), states, None))


def test_fake_states_match_the_kernel(causal_extension):
    """The fake function's saved-state shape is the kernel's: one (C, M) state per block begun."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for n in (0, 1, causal_extension.block(), causal_extension.block() + 1):
        q, k, v, _ = inputs(1, 2, n, 4, 4)
        real = custom_ops.causal_recurrence_forward(q, k, v, None)
        with FakeTensorMode() as mode:
            fake = custom_ops.causal_recurrence_forward(*(mode.from_tensor(t) for t in (q, k, v)), None)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("c, m", [(7, 7), (33, 5), (3, 16), (12, 12), (65, 65), (561, 32), (4, 0), (0, 4)])
def test_padded_recurrence_matches_the_float64_reference(causal_extension, dtype, c, m):
    """Odd C, M (head sizes 7, 33, 65; poly2's 561 features at D = 32; 12, which fills 4-float
    registers; an empty C or M, padded to one zero register), with an initial state, the final
    state's gradient and N past one block: outputs, S_N and the gradients of q, k, v and S_0
    against autograd of the float64 reference."""
    n = causal_extension.block() + 9 if c * m < 2000 else 40
    leaves = [t.requires_grad_(True) for t in inputs(2, 1, n, c, m, dtype, state=True)]
    grad_out, grad_final = torch.randn(2, 1, n, m, dtype=dtype), torch.randn(2, 1, c, m, dtype=dtype)
    out, final = causal_recurrence.causal_dot_product(*leaves[:3], initial_state=leaves[3], return_final_state=True)
    got = torch.autograd.grad((out * grad_out).sum() + (final * grad_final).sum(), leaves)
    expected_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    expected_out, expected_final = reference(*expected_leaves)
    expected = torch.autograd.grad((expected_out * grad_out.double()).sum() + (expected_final * grad_final.double()).sum(),
                                   expected_leaves)
    assert out.dtype == final.dtype == dtype and out.shape == (2, 1, n, m) and final.shape == (2, 1, c, m)
    for name, a, e in [("out", out, expected_out), ("final", final, expected_final)] + \
            [(f"grad {x}", a, e) for x, a, e in zip(("q", "k", "v", "S_0"), got, expected)]:
        tol, largest = TOLERANCE[dtype], float(e.abs().max()) if e.numel() else 0.0
        torch.testing.assert_close(a.double(), e, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, largest),
                                   msg=lambda text, name=name: f"{name} (C={c}, M={m}, {dtype}): {text}")


def test_recurrence_dims_fill_whole_registers(causal_extension):
    """Where C, M fit they stay; else the padded sizes fit the kernel, exceed (C, M) by less than
    one of its widest registers, and are the ones with the fewest vector FMAs per position."""
    like = torch.empty(0)
    widest = causal_extension.width(64, 64, like) // 4
    assert causal_recurrence.recurrence_dims(16, 32, torch.float32) == (16, 32)
    assert causal_recurrence.recurrence_dims(7, 7, torch.float16) is None
    for c, m in [(7, 7), (33, 33), (65, 65), (561, 32), (3, 5)]:
        pc, pm = causal_recurrence.recurrence_dims(c, m, torch.float32)
        assert causal_extension.fits(pc, pm, like) and 0 <= pc - c < widest and 0 <= pm - m < widest, (c, m, pc, pm)
        width = causal_extension.width(pc, pm, like) // 4
        for w in (widest, widest // 2, widest // 4):
            if w >= 4:
                assert pc * pm / width <= (-(-c // w) * w) * (-(-m // w) * w) / w


def test_a_second_derivative_is_an_error(causal_extension):
    q, k, v, _ = inputs(1, 1, 5, 4, 4)
    q.requires_grad_(True)
    (grad_q,) = torch.autograd.grad(causal_recurrence.causal_dot_product(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        grad_q.sum().backward()


@pytest.mark.parametrize("operator", ["recurrence", "fused attention"])
def test_a_second_derivative_through_the_gradient_is_an_error(causal_extension, operator):
    """With a grad_out that requires grad (a gradient penalty, say), differentiating grad q again
    raises: the backward operators have no gradient of their own."""
    q, k, v, _ = inputs(1, 2, 9, 4, 4)
    q.requires_grad_(True)
    if operator == "recurrence":
        out = custom_ops.causal_recurrence_forward(q, k, v, None)[0]
    else:
        out = custom_ops.causal_attention_forward(q, k, v, None, None, None, None, 4, 1e-6, False)[0]
    weight = torch.randn_like(out, requires_grad=True)
    (grad_q,) = torch.autograd.grad(out, q, weight, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_q.sum().backward()


@pytest.fixture
def cuda_ops_on_cpu():
    """The CUDA library's two operators (binding.cpp's schemas) defined with CPU functions of the
    float64 definition, where no GPU could load the real ones: what register_cuda_ops adds to them
    is then checked on CPU."""
    if torch.cuda.is_available() or hasattr(torch.ops.linformer_lab_cuda, "causal_dot_product_fwd"):
        pytest.skip("the real CUDA operators are (or may be) loaded in this process")
    library = torch.library.Library("linformer_lab_cuda", "DEF")
    library.define("causal_dot_product_fwd(Tensor q, Tensor k, Tensor v) -> Tensor")
    library.define("causal_dot_product_bwd(Tensor q, Tensor k, Tensor v, Tensor grad_out, bool[3] output_mask)"
                   " -> (Tensor, Tensor, Tensor)")

    def backward(q, k, v, grad, mask):  # out = tril(Q K^T) V, differentiated by hand (no autograd in a kernel)
        scores, grad_scores = (q @ k.transpose(-1, -2)).tril(), (grad @ v.transpose(-1, -2)).tril()
        return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, scores.transpose(-1, -2) @ grad

    library.impl("causal_dot_product_fwd", lambda q, k, v: naive.causal_dot_product_naive(q, k, v), "CPU")
    library.impl("causal_dot_product_bwd", backward, "CPU")
    custom_ops.register_cuda_ops()
    yield torch.ops.linformer_lab_cuda
    library._destroy()


@pytest.mark.slow  # opcheck and torch.compile trace for several seconds
def test_cuda_operators_get_fake_functions_and_a_gradient(cuda_ops_on_cpu):
    q, k, v, _ = inputs(2, 2, 9, 4, 3)
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.library.opcheck(cuda_ops_on_cpu.causal_dot_product_fwd, (q, k, v))
    compiled = torch.compile(lambda a, b, c: cuda_ops_on_cpu.causal_dot_product_fwd(a, b, c).square().sum(),
                             fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(naive.causal_dot_product_naive(q, k, v).square().sum(), (q, k, v))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)
