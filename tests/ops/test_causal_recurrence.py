"""The register-resident recurrence (linformer_lab/ops/cpu/causal_recurrence.cpp) against the
float64 O(N^2) reference: outputs, final state and the gradients of q, k, v and S_0, float32 and
float64, every instruction-set version this CPU runs, C and M from 12 to 128 including ones that
take narrower registers (12, 24, 40), N below, at and past the 256-position block and not a
multiple of anything, an initial state given or not, one to three threads (so the backward runs
rows in parallel and, for fewer rows than threads, the two passes of a row in parallel). A spy
asserts that the recurrence is the path taken whether C and M fit it or are zero-padded to it
(D = 7). Helpers come from tests/ops/test_causal_cpu_kernel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_causal_cpu_kernel import _close, _inputs, _recording, _reference, ran  # noqa: F401 - fixtures

from linformer_lab.ops import cpu, kernels
from linformer_lab.ops.cpu import causal_recurrence
from linformer_lab.ops.kernels import causal_dot_product
from linformer_lab.ops.linear_attention import chunk

REPO = Path(__file__).resolve().parents[2]


def _run(tensors, dtype, with_state, n_threads):
    """Out, final state and gradients through causal_dot_product (the public entry point)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in tensors[:4]]
    grad, grad_final = (t.to(dtype) for t in tensors[4:])
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        out, final = causal_dot_product(*leaves[:3], initial_state=leaves[3] if with_state else None,
                                              return_final_state=True)
        ((out * grad).sum() + (final * grad_final).sum()).backward()
    finally:
        torch.set_num_threads(before)
    return [out, final] + [t.grad for t in leaves]


CASES = [  # (B, H, N, C, M): C = M over the benchmark dims, C != M, narrower registers, blocks
    (1, 1, 1, 16, 16),
    (1, 3, 257, 16, 16),
    (2, 2, 600, 32, 32),
    (1, 1, 513, 64, 64),
    (1, 2, 259, 128, 128),
    (2, 1, 77, 24, 24),
    (1, 3, 140, 12, 40),
    (3, 1, 511, 48, 16),
]


@pytest.mark.parametrize("with_state", [True, False], ids=["S0", "no-S0"])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
def test_recurrence_matches_the_float64_reference(causal_isa, ran, shape, dtype, n_threads, with_state):  # noqa: F811
    tensors = list(_inputs(*shape, seed=n_threads))
    if not with_state:
        tensors[3] = torch.zeros_like(tensors[3])
    got = _run(tensors, dtype, with_state, n_threads)
    want = _reference(*tensors)
    _close(got if with_state else got[:5], want if with_state else want[:5], dtype)
    assert ran == [("recurrence", "forward"), ("recurrence", "backward")]


@pytest.mark.parametrize("dims,dtype,padded", [
    ((7, 7), torch.float32, True),     # no register width divides 7
    ((6, 10), torch.float32, True),    # 4 floats do not divide 6
    ((6, 10), torch.float64, False),   # 2 doubles do
    ((16, 8), torch.float32, False),
])
def test_dims_that_do_not_fit_run_zero_padded(causal_extension, ran, dims, dtype, padded):  # noqa: F811
    c, m = dims
    path = "recurrence"
    assert kernels.select("causal", *(torch.empty(1, 1, 1, d, dtype=dtype) for d in (c, c, m))).name == path
    assert (causal_recurrence.recurrence_dims(c, m, dtype) != dims) == padded
    tensors = _inputs(2, 1, 150, c, m)
    _close(_run(tensors, dtype, True, 2), _reference(*tensors), dtype)
    assert ran == [(path, "forward"), (path, "backward")]


def test_register_width_per_shape(causal_isa, causal_extension):
    """The widest register that divides C and M, at most the instruction set's."""
    widest = {"avx512": 64, "avx2": 32, "baseline": 16}[causal_isa]
    fp32, fp64 = torch.empty(0), torch.empty(0, dtype=torch.float64)
    assert causal_extension.width(16, 64, fp32) == min(64, widest)
    assert causal_extension.width(24, 24, fp32) == min(32, widest)
    assert causal_extension.width(12, 40, fp32) == 16
    assert causal_extension.width(8, 8, fp64) == min(64, widest)
    assert causal_extension.width(7, 16, fp32) == 0 and not causal_extension.fits(7, 16, fp32)
    assert causal_extension.width(0, 16, fp32) == 0


def test_only_the_final_state_used(causal_extension, ran):  # noqa: F811
    """No gradient reaches the output (None into the backward): the gradients come from the final state alone."""
    q, k, v, s0, _, grad_final = _inputs(1, 2, 200, 16, 32)
    leaves = [t.float().requires_grad_() for t in (q, k, v, s0)]
    _, final = causal_dot_product(*leaves[:3], initial_state=leaves[3], return_final_state=True)
    (final * grad_final.float()).sum().backward()
    want = _reference(q, k, v, s0, torch.zeros(1, 2, 200, 32, dtype=torch.float64), grad_final)
    assert not leaves[0].grad.any()  # the final state does not depend on q
    for got, expected in zip([final] + [t.grad for t in leaves[1:]], [want[1]] + want[3:]):
        scale = expected.abs().max()
        torch.testing.assert_close(got.double() / scale, expected / scale, rtol=2e-5, atol=2e-5)
    assert ran == [("recurrence", "forward"), ("recurrence", "backward")]


def test_switched_off_runs_the_reference(monkeypatch, causal_extension, ran):  # noqa: F811
    monkeypatch.setenv(kernels.SWITCH, "causal=pytorch")
    assert kernels.select("causal", *(torch.empty(1, 1, 1, 16),) * 3).name == "pytorch"
    tensors = _inputs(1, 2, 100, 16, 16)
    _close(_run(tensors, torch.float32, True, 2), _reference(*tensors), torch.float32)
    assert ran == []


def test_states_kept_for_the_backward_are_one_per_block(causal_extension):
    """Memory O(N): the forward keeps S before each block of 256 positions, S_0 first."""
    q, k, v, s0, *_ = (t.float() for t in _inputs(2, 1, 600, 16, 32))
    rows = [t.reshape(2, *t.shape[2:]).contiguous() for t in (q, k, v, s0)]
    out, final, states = causal_extension.forward(*rows)
    block = causal_extension.block()
    assert block == 256 and states.shape == (2, 3, 16, 32)
    torch.testing.assert_close(states[:, 0], rows[3])
    torch.testing.assert_close(states[:, 1], rows[3] + rows[1][:, :block].transpose(1, 2) @ rows[2][:, :block])
    for got, length in ((states[:, 2], 2 * block), (final, 600)):  # float32 sums of up to 600 terms
        want = rows[3].double() + rows[1][:, :length].double().transpose(1, 2) @ rows[2][:, :length].double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_gradcheck(causal_extension, ran):  # noqa: F811
    """float64 finite differences, S_0 in and S_N out (C = 4, M = 2: registers of 2 doubles)."""
    q, k, v, s0, _, _ = _inputs(1, 2, 11, 4, 2)
    leaves = [t.requires_grad_() for t in (q, k, v, s0)]

    def both(a, b, c, s):
        return causal_recurrence.causal_dot_product(a, b, c, None, s, True)

    assert torch.autograd.gradcheck(both, leaves)
    assert {path for path, _ in ran} == {"recurrence"}


def _pooled_call(q, k, v, grad):
    """(out, grad q, grad k, grad v) of the kernel in float32, and of the pure-PyTorch chunk path in float64."""
    results = []
    for dtype, fn in ((torch.float32, causal_recurrence.causal_dot_product), (torch.float64, chunk.CausalDotProduct.apply)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    return results


def test_large_outputs_come_back_from_the_pool(causal_extension, ran):  # noqa: F811
    """Outputs of 4 MiB and more (output_pool.h) are handed out again once their tensors die. A
    reused buffer holds the last call's numbers, so the second call checks that every element is
    written; the pool then keeps no more than its limit, and none at limit 0."""
    shape = (2, 4, 8192, 32, 32)  # out, grad q, grad k, grad v: 8 MiB each, pooled; the states: 1 MiB, from torch
    mib8 = 8 << 20

    def call(seed):
        q, k, v, _, grad, _ = _inputs(*shape, seed=seed)
        return _pooled_call(q, k, v, grad)

    before = causal_extension.set_pool_limit(0)  # empty to start
    try:
        causal_extension.set_pool_limit(1 << 30)
        _, reused, made = causal_extension.pool_stats()
        call(1)  # its results die at once: their buffers go to the pool
        assert causal_extension.pool_stats() == [4 * mib8, reused, made + 4]
        got, want = call(2)
        assert causal_extension.pool_stats() == [0, reused + 4, made + 4]  # all four reused, nothing fresh
        for name, g, w in zip(["out", "grad q", "grad k", "grad v"], got, want):
            scale = w.abs().max().item()
            torch.testing.assert_close(g.double() / scale, w / scale, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        del got, want, g, w  # (g: the last, grad v)
        assert causal_extension.pool_stats()[0] == 4 * mib8
        causal_extension.set_pool_limit(20 << 20)
        assert causal_extension.pool_stats()[0] == 2 * mib8
        causal_extension.set_pool_limit(0)
        assert causal_extension.pool_stats()[0] == 0
    finally:
        causal_extension.set_pool_limit(before)
    assert ran[:2] == [("recurrence", "forward"), ("recurrence", "backward")]


@pytest.mark.slow
def test_pool_limit_from_the_environment(causal_extension):
    """$LINFORMER_LAB_CPU_POOL_MIB sets the limit (0: no pool, large outputs from torch as any tensor's)."""
    code = ("import torch; from linformer_lab.ops import cpu; from linformer_lab.ops.cpu import causal_recurrence; "
            "m = cpu.CAUSAL_RECURRENCE.load(); q = torch.rand(1, 8, 16384, 64, requires_grad=True); "
            "causal_recurrence.causal_dot_product(q, q, q).sum().backward(); "
            "print(*m.pool_stats(), m.set_pool_limit(0))")
    # out, grad q, grad k, grad v: 32 MiB each, the states 8 MiB; all freed, the pool keeps what fits 48 MiB
    for value, limit in (("0", 0), ("48", 48 << 20)):
        env = {**os.environ, "LINFORMER_LAB_CPU_POOL_MIB": value, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        held, reused, made, got_limit = map(int, done.stdout.split())
        assert got_limit == limit
        if limit:
            assert 32 << 20 <= held <= limit and made >= 4
        else:
            assert (held, reused, made) == (0, 0, 0)


def test_another_build_substitutes_for_the_current_one(causal_extension, ran):  # noqa: F811
    """Extension.substituted (benchmarks time an earlier revision's build beside the current one):
    within the block the kernel calls the given module, after it the process's own again. (A
    stand-in records its calls and passes them to the current build.)"""
    other_calls = []
    other = types.SimpleNamespace(fits=causal_extension.fits,
                                  **{fn: _recording(getattr(causal_extension, fn), ("other", fn), other_calls)
                                     for fn in ("forward", "backward")})
    tensors = _inputs(1, 2, 40, 16, 16)
    with cpu.CAUSAL_RECURRENCE.substituted(other):
        assert cpu.CAUSAL_RECURRENCE.load() is other and cpu.CAUSAL_RECURRENCE.module() is other
        _close(_run(tensors, torch.float32, True, 1), _reference(*tensors), torch.float32)
    assert other_calls == [("other", "forward"), ("other", "backward")]
    assert cpu.CAUSAL_RECURRENCE.load() is causal_extension
