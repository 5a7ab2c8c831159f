"""The C++ CPU kernel of the causal numerator (linformer_lab/ops/cpu/causal_recurrence.cpp through
linformer_lab/ops/cpu/causal_recurrence.py) against the float64 O(N^2) reference;
tests/ops/test_causal_recurrence.py covers the recurrence's own cases (register widths, blocks,
thread splits), tests/ops/test_custom_ops.py its operators.

Checked: outputs, gradients of q, k, v, an initial state and a final state, C != M, C and M from
16 to 128 and ones that fill no whole register (7, 33, 65; poly2's 561 features at D = 32: zero-
padded), one row and many, float32 and float64, non-contiguous inputs, empty inputs; that
``causal_dot_product`` takes the kernel on CPU (a spy; float16 / bfloat16 too, run as float32) and
keeps to the pure-PyTorch reference when switched off or without the extension (one warning). The tests that need
the extension skip, saying why, where it cannot be built (no C++ compiler); CI has one, so there
they run (and build it).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from linformer_lab.ops import build_cache, cpu, kernels
from linformer_lab.ops.cpu import causal_recurrence
from linformer_lab.ops.kernels import causal_dot_product
from linformer_lab.ops.linear_attention import chunk, naive

#: against the float64 reference: fp32 rounding of sums of up to N products of O(1) numbers
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


@pytest.fixture
def taken(monkeypatch):
    """(C, M) of every call that went through the kernel's entry point (causal_recurrence.causal_dot_product)."""
    calls, original = [], causal_recurrence.causal_dot_product

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-1], v.shape[-1]))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(causal_recurrence, "causal_dot_product", spy)
    return calls


@pytest.fixture
def kernel(monkeypatch, causal_extension):
    """The C++ path by its candidate's name, whatever the environment's switch."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    return "recurrence"


@pytest.fixture
def ran(monkeypatch, causal_extension):
    """(path, "forward" / "backward") of every call into the extension."""
    calls = []
    ext = cpu.CAUSAL_RECURRENCE.load()
    for fn in ("forward", "backward"):
        monkeypatch.setattr(ext, fn, _recording(getattr(ext, fn), ("recurrence", fn), calls))
    return calls


def _recording(original, call, calls):
    def spy(*args):
        calls.append(call)
        return original(*args)
    return spy


@pytest.fixture
def threads():
    """Runs a test with 2 threads (so fewer rows than threads split a row's work), restoring the
    count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def _inputs(b, h, n, c, m, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # positive features as from elu + 1, so sums grow with N as they do in attention
    q, k = (torch.rand(b, h, n, c, generator=gen, dtype=torch.float64) for _ in range(2))
    v, grad = (torch.randn(b, h, n, m, generator=gen, dtype=torch.float64) for _ in range(2))
    s0, grad_final = (torch.randn(b, h, c, m, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, s0, grad, grad_final


def _reference(q, k, v, s0, grad, grad_final):
    """float64 out, final state and gradients of <out, grad> + <final, grad_final>."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s0)]
    out = naive.causal_dot_product_naive(*leaves[:3]) + leaves[0] @ leaves[3]
    final = leaves[3] + leaves[1].transpose(-1, -2) @ leaves[2]
    ((out * grad).sum() + (final * grad_final).sum()).backward()
    return [out, final] + [t.grad for t in leaves]


def _kernel(q, k, v, s0, grad, grad_final, dtype, chunk_size=None, with_state=True):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, s0)]
    if with_state:
        out, final = causal_dot_product(*leaves[:3], chunk_size, initial_state=leaves[3], return_final_state=True)
        ((out * grad.to(dtype)).sum() + (final * grad_final.to(dtype)).sum()).backward()
        return [out, final] + [t.grad for t in leaves]
    out = causal_dot_product(*leaves[:3], chunk_size)
    (out * grad.to(dtype)).sum().backward()
    return [out] + [t.grad for t in leaves[:3]]


def _close(got, want, dtype, scale_by_reference=True):
    for name, g, w in zip(["out", "final", "grad q", "grad k", "grad v", "grad S_0"], got, want):
        # relative to the largest entry: outputs and gradients are sums whose size grows with N
        scale = w.abs().max().item() if scale_by_reference and w.numel() else 1.0
        torch.testing.assert_close(g.double() / scale, w / scale, **TOLERANCE[dtype], msg=lambda m, n=name: f"{n}: {m}")


SHAPES = [  # (B, H, N, C, M, chunk): C != M; C, M from 16 to 128; odd ones padded; the chunk is unused
    (1, 1, 37, 16, 16, None),
    (1, 1, 64, 32, 32, 64),
    (2, 3, 130, 32, 16, None),
    (1, 2, 200, 16, 64, 32),
    (1, 1, 150, 128, 128, None),
    (3, 2, 97, 64, 128, 16),
    (4, 8, 70, 16, 32, None),
    (2, 1, 300, 7, 7, None),  # odd head sizes: zero-padded to whole registers
    (1, 2, 90, 33, 5, None),
    (1, 1, 80, 65, 65, None),
    (1, 2, 50, 561, 32, None),  # poly2's features at D = 32: 1 + 32 + 32 * 33 / 2
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-L{s[5]}")
def test_kernel_matches_the_float64_reference(kernel, ran, taken, threads, shape, dtype):
    *bhncm, chunk_size = shape
    tensors = _inputs(*bhncm)
    _close(_kernel(*tensors, dtype, chunk_size), _reference(*tensors), dtype)
    assert len(taken) == 1
    assert ran == [(kernel, "forward"), (kernel, "backward")]


@pytest.mark.parametrize("c", [16, 7])
def test_without_states_and_non_contiguous_inputs(kernel, taken, threads, c):
    q, k, v, s0, grad, grad_final = _inputs(2, 3, 70, c, 16)
    q, k, v = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k, v))  # same values, other strides
    assert not q.is_contiguous()
    got = _kernel(q, k, v, s0, grad, grad_final, torch.float32, with_state=False)
    want = _reference(q, k, v, torch.zeros_like(s0), grad, torch.zeros_like(grad_final))
    _close(got, [want[0]] + want[2:5], torch.float32)
    assert len(taken) == 1


def test_non_contiguous_initial_state_and_final_gradient(kernel, ran, threads):
    """A transposed S_0 and a transposed gradient of S_N: the kernel reads raw rows, so the
    operator hands it contiguous copies."""
    q, k, v, s0, grad, grad_final = _inputs(1, 2, 70, 16, 16)
    s0, grad_final = (t.transpose(2, 3).contiguous().transpose(2, 3) for t in (s0, grad_final))
    assert not s0.is_contiguous() and not grad_final.is_contiguous()
    _close(_kernel(q, k, v, s0, grad, grad_final, torch.float64), _reference(q, k, v, s0, grad, grad_final),
           torch.float64)
    assert ran == [(kernel, "forward"), (kernel, "backward")]


def test_gradcheck(causal_extension, threads):
    q, k, v, s0, _, _ = _inputs(1, 2, 11, 3, 5)
    leaves = [t.requires_grad_() for t in (q, k, v, s0)]

    def both(a, b, c, s):
        return causal_recurrence.causal_dot_product(a, b, c, None, s, True)  # C = 3, M = 5 fit no register: padded

    assert torch.autograd.gradcheck(both, leaves)


@pytest.mark.parametrize("shape", [(1, 2, 0, 4, 4), (0, 2, 5, 4, 4), (1, 2, 0, 3, 5)], ids=["N=0", "B=0", "N=0 padded"])
def test_empty_inputs(kernel, taken, shape):
    tensors = _inputs(*shape)
    got = _kernel(*tensors, torch.float64, 4)
    want = _reference(*tensors)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert taken == [shape[3:]]


def test_same_result_as_the_chunk_path(kernel, threads):
    """The kernel and the pure-PyTorch reference path agree with each other in float32 too."""
    q, k, v, s0, grad, grad_final = _inputs(2, 4, 257, 32, 32)
    args = [t.float() for t in (q, k, v)]
    ours = causal_recurrence.causal_dot_product(*args, None, s0.float(), True)
    reference = chunk.CausalDotProduct.apply(*args, 64, s0.float(), True)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["switched off", "float16", "bfloat16"])
def test_half_inputs_take_the_kernel_and_switched_off_the_chunk_path(monkeypatch, taken, case):
    dtype = torch.float32
    if case == "switched off":
        monkeypatch.setenv(kernels.SWITCH, "causal=pytorch")
    else:
        dtype = getattr(torch, case)
    q, k, v, *_ = _inputs(1, 2, 40, 8, 8)
    out = causal_dot_product(q.to(dtype), k.to(dtype), v.to(dtype))
    assert taken == ([] if case == "switched off" else [(8, 8)])  # half inputs run as float32
    assert out.dtype == dtype
    want = naive.causal_dot_product_naive(*(t.to(dtype).double() for t in (q, k, v)))
    scale = want.abs().max()  # half-precision outputs: rounded to ~3 digits of the largest
    torch.testing.assert_close(out.double() / scale, want / scale, rtol=0, atol=1e-2)


def test_no_extension_falls_back_with_one_warning(monkeypatch, tmp_path, taken):
    """No cached build and no compiler: the causal op warns once and keeps to the pure-PyTorch
    chunk path."""
    monkeypatch.setattr(cpu, "CAUSAL_RECURRENCE", cpu.Extension("linformer_lab_causal_recurrence",
                                                                "causal_recurrence.cpp", cpu.CAUSAL_RECURRENCE.purpose))
    monkeypatch.setenv(build_cache.VARIABLE, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-linformer-lab")
    q, k, v, *_ = _inputs(1, 1, 20, 4, 4)
    with pytest.warns(RuntimeWarning) as record:
        out = causal_dot_product(q, k, v)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "keeps to PyTorch" in messages[0], messages
    torch.testing.assert_close(out, naive.causal_dot_product_naive(q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        causal_dot_product(q, k, v)  # not retried, not warned again
    assert taken == []


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_every_instruction_set_version_matches_the_reference(kernel, ran, threads, isa):
    """The hot loops exist once per instruction set; the CPU's best runs by default, and every
    version this CPU can run gives the reference (CI thus checks the ones its CPU has)."""
    causal_extension = cpu.CAUSAL_RECURRENCE.load()
    try:
        before = causal_extension.set_instruction_set(isa)
    except RuntimeError as error:
        pytest.skip(str(error))
    try:
        assert causal_extension.instruction_set() == isa
        for shape in [(1, 1, 100, 16, 48, 32), (2, 4, 70, 32, 32, 64), (1, 2, 60, 7, 9, None)]:
            *bhncm, chunk_size = shape
            tensors = _inputs(*bhncm)
            _close(_kernel(*tensors, torch.float32, chunk_size), _reference(*tensors), torch.float32)
    finally:
        causal_extension.set_instruction_set(before)
    assert {path for path, _ in ran} == {kernel}


def test_double_backward_is_an_error_not_a_wrong_answer(causal_extension):
    q, k, v, *_ = _inputs(1, 1, 8, 4, 4)
    q.requires_grad_()
    (grad_q,) = torch.autograd.grad(causal_dot_product(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula|does not require grad"):
        grad_q.sum().backward()


@pytest.mark.parametrize("forward_threads,backward_threads", [(2, 1), (1, 2)])
def test_thread_count_changing_between_forward_and_backward(kernel, forward_threads, backward_threads):
    """The backward splits one row's passes over 2 threads, or not, whatever the forward did."""
    tensors = _inputs(1, 1, 200, 16, 32)
    before = torch.get_num_threads()
    leaves = [t.detach().float().requires_grad_() for t in tensors[:4]]
    try:
        torch.set_num_threads(forward_threads)
        out, final = causal_recurrence.causal_dot_product(*leaves[:3], None, leaves[3], True)
        torch.set_num_threads(backward_threads)
        ((out * tensors[4].float()).sum() + (final * tensors[5].float()).sum()).backward()
    finally:
        torch.set_num_threads(before)
    _close([out, final] + [t.grad for t in leaves], _reference(*tensors), torch.float32)
