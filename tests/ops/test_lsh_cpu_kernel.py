"""The C++ CPU kernel of lsh attention's window step (linformer_lab/ops/cpu/lsh_window.cpp through
:func:`linformer_lab.ops.kernels.lsh_window` on CPU) against its references.

Checked: the kernel's outputs, log normalisers and gradients against the PyTorch window step
(:func:`~linformer_lab.ops.lsh.window_attention_torch`, autograd for its gradients) in float64
and float32, on every instruction set this CPU has, for the sizes compiled in (D = M = 32 and 64
with chunks of 32) and run-time sizes, one round and several, causal and not, with padding and
with rows that see no key at all; whole lsh attention, outputs and gradients, on both paths
against the one-query-at-a-time definition (``lsh_attention_naive``, autograd); that the kernel
is taken on CPU and ``LINFORMER_LAB_KERNELS=lsh_window=pytorch`` keeps to the PyTorch step; clear errors for
malformed inputs. Tests that need the extension skip where it cannot be built (no compiler).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from linformer_lab.ops import kernels, lsh

TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _window_inputs(b, h, n_chunks, chunk, d, m, n_hashes, dtype, padded):
    """Random sorted-layout inputs of step 4: slots hold positions 0..L-1 once per round, with
    the trailing positions padding where ``padded``; chunk ids as _slot_chunks makes them."""
    torch.manual_seed(n_chunks * 31 + chunk + d + n_hashes)
    length = n_chunks * chunk // n_hashes
    order = torch.stack([torch.stack([torch.cat([torch.randperm(length) + r * length for r in range(n_hashes)])
                                      for _ in range(h)]) for _ in range(b)])  # (B, H, R*L)
    positions = (order % length).reshape(b, h, n_chunks, chunk)
    valid = positions < (length - 3 if padded else length)
    chunks = lsh._slot_chunks(order, n_hashes, length, chunk) if n_hashes > 1 else None
    q = torch.randn(b, h, n_chunks, chunk, d, dtype=dtype) / d ** 0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, n_chunks, chunk, d, dtype=dtype), dim=-1)
    v = torch.randn(b, h, n_chunks, chunk, m, dtype=dtype)
    return q, k, v, positions, valid, chunks


def _run(function, q, k, v, positions, valid, chunks, causal, grad_out, grad_lse):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = function(q, k, v, positions, valid, chunks, causal)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    ((out * grad_out).sum() + (finite * grad_lse).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


SHAPES = [  # (chunks per round, chunk, D, M): compiled-in sizes (W = 64, D = M = 32 / 64) and run-time ones
    (2, 32, 32, 32), (1, 32, 64, 64), (3, 5, 4, 6), (1, 7, 8, 8), (2, 29, 32, 32), (3, 32, 32, 16),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("n_hashes,causal,padded", list(itertools.product([1, 2, 4], [True, False], [False, True])))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{c}x{s}-d{d}-m{m}" for c, s, d, m in SHAPES])
def test_kernel_equals_the_pytorch_window_step(lsh_isa, shape, n_hashes, causal, padded, dtype):
    chunks_per_round, chunk, d, m = shape
    inputs = _window_inputs(2, 3, chunks_per_round * n_hashes, chunk, d, m, n_hashes, dtype, padded)
    grad_out = torch.randn(*inputs[2].shape[:-1], m, dtype=dtype)
    grad_lse = torch.randn(inputs[3].shape, dtype=dtype)
    got = _run(kernels.lsh_window, *inputs, causal, grad_out, grad_lse)
    want = _run(lsh.window_attention_torch, *inputs, causal, grad_out, grad_lse)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype], msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.parametrize("causal", [True, False])
def test_a_nan_query_reaches_the_outputs_it_reaches_in_the_pytorch_window_step(lsh_isa, causal):
    """The kernel's row maximum passed over a NaN score: a row of NaN scores looked like one that
    sees nothing (lse -inf, zeros), and lsh attention gave the token its own value, a finite output."""
    inputs = list(_window_inputs(1, 2, 2, 32, 32, 32, 1, torch.float32, False))
    inputs[0][0, 1, 0, 5, 3] = float("nan")  # one query of the second head
    grad_out = torch.randn(*inputs[2].shape[:-1], 32)
    grad_lse = torch.randn(inputs[3].shape)
    got = _run(kernels.lsh_window, *inputs, causal, grad_out, grad_lse)
    want = _run(lsh.window_attention_torch, *inputs, causal, grad_out, grad_lse)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        same = torch.equal(_nan_rows(a), _nan_rows(b))
        assert same, f"{name}: NaN at {_nan_rows(a).nonzero().tolist()}, the step's at {_nan_rows(b).nonzero().tolist()}"
    assert torch.isnan(want[0]).any()


def _nan_rows(t: torch.Tensor) -> torch.Tensor:
    """The slots of a window result holding a NaN: over the last dim of out, dq, dk, dv (5-d), lse as it is."""
    return torch.isnan(t).any(-1) if t.dim() == 5 else torch.isnan(t)


def test_rows_that_see_nothing_get_minus_infinity_zeros_and_no_gradient(lsh_extension):
    """Causal position 0 in a window of its own (every key masked): lse -inf, a zero output,
    zero gradients, however large the incoming gradient of its normaliser."""
    positions = torch.arange(4).reshape(1, 1, 4)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 4, 3, requires_grad=True), torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 2)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    out, lse = kernels.lsh_window(q[:, :, None], k[:, :, None], v[:, :, None], positions[:, :, None],
                                 valid[:, :, None], None, True)
    assert torch.isinf(lse[0, 0, 0, 0]) and lse[0, 0, 0, 0] < 0 and torch.isfinite(lse[0, 0, 0, 1:]).all()
    assert (out[0, 0, 0, 0] == 0).all()
    grad_lse = torch.ones_like(lse)
    grad_lse[0, 0, 0, 0] = 1e30
    torch.autograd.backward((out, lse), (torch.ones_like(out), grad_lse))
    assert (q.grad[0, 0, 0] == 0).all() and torch.isfinite(q.grad).all() and (q.grad[0, 0, 1:] != 0).any()


@pytest.mark.parametrize("path", ["kernel", "pytorch"])
@pytest.mark.parametrize("n_hashes,causal", list(itertools.product([1, 4], [True, False])))
def test_lsh_attention_and_its_gradients_equal_the_naive_definition(path, n_hashes, causal, monkeypatch, lsh_extension):
    """Whole lsh attention on each path of step 4, against autograd through the one-query-at-a-
    time definition, in float64 (padding from key_lengths and from a partial last chunk)."""
    monkeypatch.setenv(kernels.SWITCH, "" if path == "kernel" else "lsh_window=pytorch")
    torch.manual_seed(n_hashes)
    rotations = torch.randn(8, n_hashes, 4, dtype=torch.float64)
    q0, v0 = torch.randn(2, 2, 21, 8, dtype=torch.float64), torch.randn(2, 2, 21, 5, dtype=torch.float64)
    grad = torch.randn(2, 2, 21, 5, dtype=torch.float64)
    lengths = torch.tensor([21, 13])
    results = []
    fast = functools.partial(lsh.lsh_attention, window=kernels.lsh_window)  # as the lsh backend calls it
    for function in (fast, lsh.lsh_attention_naive):
        q, v = q0.clone().requires_grad_(), v0.clone().requires_grad_()
        out = function(q, v, rotations, 8, causal, lengths)
        (out * grad).sum().backward()
        results.append((out.detach(), q.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_kernel_is_taken_on_cpu_and_the_switch_turns_it_off(monkeypatch, lsh_extension):
    monkeypatch.setenv(kernels.SWITCH, "")
    calls = []
    original = lsh._WindowAttentionCPU.apply
    monkeypatch.setattr(lsh._WindowAttentionCPU, "apply", lambda *args: calls.append(1) or original(*args))
    q, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    rotations = torch.randn(8, 2, 4)
    on = lsh.lsh_attention(q, v, rotations, 8, True, window=kernels.lsh_window)
    assert len(calls) == 1
    monkeypatch.setenv(kernels.SWITCH, "lsh_window=pytorch")
    off = lsh.lsh_attention(q, v, rotations, 8, True, window=kernels.lsh_window)
    assert len(calls) == 1
    torch.testing.assert_close(on, off, **TOLERANCE[torch.float32])


def test_malformed_inputs_name_the_expected_shapes(lsh_extension):
    q = torch.randn(2, 3, 4, 8)
    positions, valid = torch.zeros(2, 3, 4, dtype=torch.int64), torch.ones(2, 3, 4, dtype=torch.bool)
    chunks = torch.zeros(2, 3, 4, 0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"q, k \(G, C, S, D\)"):
        lsh_extension.forward(q, q[:1], q, positions, valid, chunks, True)
    with pytest.raises(RuntimeError, match="positions \\(int64\\) and valid \\(bool\\)"):
        lsh_extension.forward(q, q, q, positions.int(), valid, chunks, True)
    with pytest.raises(RuntimeError, match="chunks int32"):
        lsh_extension.forward(q, q, q, positions, valid, chunks.long(), True)
    with pytest.raises(RuntimeError, match="one round of hashing takes no chunk ids"):
        lsh_extension.forward(q, q, q, positions, valid, torch.zeros(2, 3, 4, 1, dtype=torch.int32), True)
    with pytest.raises(RuntimeError, match="contiguous CPU tensors of one dtype"):
        lsh_extension.forward(q, q.double(), q, positions, valid, chunks, True)
