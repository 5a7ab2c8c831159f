"""The C++ causal attention and the CUDA numerator as ``torch.library`` operators
(linformer_lab/ops/custom_ops.py): the fake function's shapes against the kernel's, the padded sizes
of C, M that fill no whole register (ops/cpu/causal_recurrence.py), a second derivative an error, and
the fake functions and gradient given to the CUDA operators. tests/ops/test_causal_cpu_attention.py runs
``opcheck`` on the CPU operators; tests/models/test_compile.py traces whole models through them with
torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from linformer_lab.ops import custom_ops
from linformer_lab.ops.cpu import causal_recurrence
from linformer_lab.ops.linear_attention import naive


def inputs(b, h, n, c, m):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, c, dtype=torch.float64, generator=generator) for _ in range(2))
    v = torch.randn(b, h, n, m, dtype=torch.float64, generator=generator)
    return q, k, v


def test_fake_shapes_match_the_kernel(causal_extension):
    """The fake function's outputs have the kernel's shapes: the saved states one per block begun,
    for packed sequences the bound the shapes alone give (spare blocks zero)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = causal_extension.block()
    for n, cu_seqlens in [(0, None), (1, None), (block, None), (block + 1, None), (block + 1, [0, 3, block + 1])]:
        b = 1 if cu_seqlens else 2
        q, k, v = inputs(b, 2, n, 4, 4)
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
        real = custom_ops.causal_attention_forward(q, k, v, None, None, cu, None, 4, 1e-6, False)
        with FakeTensorMode() as mode:
            fake = custom_ops.causal_attention_forward(*(mode.from_tensor(t) for t in (q, k, v)), None, None,
                                                       None if cu is None else mode.from_tensor(cu), None, 4, 1e-6,
                                                       False)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], (n, cu_seqlens)


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


def test_a_second_derivative_through_the_gradient_is_an_error(causal_extension):
    """With a grad_out that requires grad (a gradient penalty, say), differentiating grad q again
    raises: the backward operator has no gradient of its own."""
    q, k, v = inputs(1, 2, 9, 4, 4)
    q.requires_grad_(True)
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
    q, k, v = inputs(2, 2, 9, 4, 3)
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.library.opcheck(cuda_ops_on_cpu.causal_dot_product_fwd, (q, k, v))
    compiled = torch.compile(lambda a, b, c: cuda_ops_on_cpu.causal_dot_product_fwd(a, b, c).square().sum(),
                             fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(naive.causal_dot_product_naive(q, k, v).square().sum(), (q, k, v))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)
