"""The register-resident recurrence behind the fused CPU attention (linformer_lab/ops/cpu/causal_recurrence.cpp,
through causal_recurrence.causal_attention) on its own cases, against the float64 O(N^2) attention of
tests/ops/test_causal_cpu_attention.py (whose helpers it uses): every instruction-set version this
CPU runs, with C and M that take narrower registers (12, 24, 40) and N below, at and past the
256-position block, on one to three threads (items in parallel, or a row's columns and passes);
C, M that fill no register run zero-padded; the register width per shape; the forward keeps S and z
once per block; float64 finite differences of padded C, M; empty inputs; non-contiguous inputs,
state and final gradient; the thread count changing between forward and backward; the pool of
large outputs; another build substituted for the current one; and without the extension, one
warning and the PyTorch form.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_causal_cpu_attention import EPS, assert_close, fused, inputs, naive_attention, results

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.ops import build_cache, cpu, custom_ops, kernels, linear_attention
from linformer_lab.ops.cpu import causal_recurrence

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _reference(leaves, grads):
    return results(naive_attention, leaves, grads, torch.float64)


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


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
def test_every_version_width_block_and_thread_count_matches_the_float64_reference(causal_isa, shape, dtype,
                                                                                    n_threads):
    leaves, grads = inputs(*shape, seed=n_threads)
    with torch_threads(n_threads):
        got = results(fused(), leaves, grads, dtype)
    assert_close(got, _reference(leaves, grads), dtype)


@pytest.mark.parametrize("dims,dtype,padded", [
    ((7, 7), torch.float32, True),     # no register width divides 7
    ((6, 10), torch.float32, True),    # 4 floats do not divide 6
    ((6, 10), torch.float64, False),   # 2 doubles do
    ((16, 8), torch.float32, False),
])
def test_dims_that_fit_no_register_run_zero_padded(causal_extension, dims, dtype, padded):
    c, m = dims
    assert (causal_recurrence.recurrence_dims(c, m, dtype) != dims) == padded
    leaves, grads = inputs(2, 1, 150, c, m)
    with torch_threads(2):
        assert_close(results(fused(), leaves, grads, dtype), _reference(leaves, grads), dtype)


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


def test_states_kept_for_the_backward_are_one_per_block(causal_extension):
    """Memory O(N): the forward keeps S and z before each block of 256 positions, S_0 and z_0 first."""
    leaves, _ = inputs(2, 1, 600, 16, 32)
    q, k, v, s0, z0 = (t.float() for t in leaves)
    _, _, s_n, z_n, states, z_states, _, _ = custom_ops.causal_attention_forward(q, k, v, s0, z0, None, None, 16,
                                                                                EPS, False)
    block = causal_extension.block()
    assert block == 256 and states.shape == (2, 1, 3, 16, 32) and z_states.shape == (2, 1, 3, 16)
    phi_k, v64 = F.elu(leaves[1]) + 1, leaves[2]
    for length, s, z in [(i * block, states[:, :, i], z_states[:, :, i]) for i in range(3)] + [(600, s_n, z_n)]:
        want_s = leaves[3] + phi_k[:, :, :length].transpose(-1, -2) @ v64[:, :, :length]
        want_z = leaves[4] + phi_k[:, :, :length].sum(-2)
        torch.testing.assert_close(s.double(), want_s, rtol=1e-5, atol=1e-4)  # float32 sums of up to 600 terms
        torch.testing.assert_close(z.double(), want_z, rtol=1e-5, atol=1e-4)


def test_gradcheck_of_padded_dims(causal_extension):
    """float64 finite differences through the kernel, C = 3 and M = 5 zero-padded, key lengths, S_0
    and z_0 in, S_N and z_N out."""
    leaves, _ = inputs(2, 2, 11, 3, 5)
    assert causal_recurrence.recurrence_dims(3, 5, torch.float64) != (3, 5)
    assert torch.autograd.gradcheck(fused(torch.tensor([11, 6])), [t.requires_grad_() for t in leaves])


@pytest.mark.parametrize("shape", [(1, 2, 0, 4, 4), (0, 2, 5, 4, 4), (1, 2, 0, 3, 5), (2, 1, 9, 4, 0)],
                         ids=["N=0", "B=0", "N=0 padded", "M=0"])
def test_empty_inputs(causal_extension, shape):
    """Nothing to compute, or no value columns (M padded to one zero register): the reference's
    values, zeros and empty tensors."""
    leaves, grads = inputs(*shape)
    for got, want in zip(results(fused(), leaves, grads, torch.float64), _reference(leaves, grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("c", [16, 7])
def test_non_contiguous_inputs_state_and_final_gradient(causal_extension, c, dtype):
    """q, k, v, S_0 and the gradient of S_N transposed in memory: the kernel reads raw rows, so the
    operators hand it contiguous copies."""
    leaves, grads = inputs(2, 3, 70, c, 16)
    strided = [t.mT.contiguous().mT for t in leaves[:4]] + leaves[4:]  # same values, other strides
    grads[1] = grads[1].mT.contiguous().mT
    assert not any(t.is_contiguous() for t in strided[:4] + grads[1:2])
    with torch_threads(2):
        assert_close(results(fused(), strided, grads, dtype), _reference(leaves, grads), dtype)


@pytest.mark.parametrize("forward_threads,backward_threads", [(2, 1), (1, 2)])
def test_thread_count_changing_between_forward_and_backward(causal_extension, forward_threads, backward_threads):
    """The backward splits one row's passes over 2 threads, or not, whatever the forward did."""
    leaves, grads = inputs(1, 1, 300, 16, 32)
    q, k, v, s0, z0 = (t.detach().float().requires_grad_() for t in leaves)
    with torch_threads(forward_threads):
        outs = fused()(q, k, v, s0, z0)
    with torch_threads(backward_threads):
        torch.autograd.backward(outs, [g.float() for g in grads])
    got = [o.detach() for o in outs] + [t.grad for t in (q, k, v, s0, z0)]
    assert_close(got, _reference(leaves, grads), torch.float32)


def _pooled_call(seed):
    """[out, grad q, grad k, grad v] of the kernel in float32, and of the PyTorch form in float64."""
    leaves, grads = inputs(2, 4, 8192, 32, 32, seed=seed)
    q, k, v = leaves[:3]
    got, want = [], []
    for dtype, run, into in ((torch.float32, causal_recurrence.causal_attention, got),
                             (torch.float64, linear_attention.causal_attention, want)):
        x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = run(EluFeatureMap(32), *x, None, EPS, None)
        out.backward(grads[0].to(dtype))
        into += [out.detach()] + [t.grad for t in x]
    return got, want


def test_large_outputs_come_back_from_the_pool(causal_extension):
    """Outputs of 4 MiB and more (output_pool.h) are handed out again once their tensors die. A
    reused buffer holds the last call's numbers, so the second call checks that every element is
    written; the pool then keeps no more than its limit, and at limit 0 none: large outputs come
    from torch as any tensor's."""
    # out, phi(q), phi(k) (saved for the backward), grad q, grad k, grad v: 8 MiB each, pooled; the
    # states (1 MiB) and den come from torch
    mib8 = 8 << 20
    before = causal_extension.set_pool_limit(0)  # empty to start
    try:
        causal_extension.set_pool_limit(1 << 30)
        _, reused, made = causal_extension.pool_stats()
        _pooled_call(1)  # its results die at once: their buffers go to the pool
        assert causal_extension.pool_stats() == [6 * mib8, reused, made + 6]
        got, want = _pooled_call(2)
        # all six reused, nothing fresh; phi(q), phi(k) back in the pool once the backward freed them
        assert causal_extension.pool_stats() == [2 * mib8, reused + 6, made + 6]
        for name, g, w in zip(["out", "grad q", "grad k", "grad v"], got, want):
            scale = w.abs().max().item()
            torch.testing.assert_close(g.double() / scale, w / scale, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        del got, want, g, w  # (g: the last, grad v)
        assert causal_extension.pool_stats()[0] == 6 * mib8
        causal_extension.set_pool_limit(20 << 20)
        assert causal_extension.pool_stats()[0] == 2 * mib8
        causal_extension.set_pool_limit(0)
        assert causal_extension.pool_stats()[0] == 0
        # at limit 0 large outputs come from torch as any tensor's: none pooled, none made
        q = torch.rand(1, 2, 8192, 64, requires_grad=True)  # 4 MiB: pooled size
        causal_recurrence.causal_attention(EluFeatureMap(64), q, q, q).sum().backward()
        assert causal_extension.pool_stats() == [0, reused + 6, made + 6]
    finally:
        causal_extension.set_pool_limit(before)


@pytest.mark.slow
def test_pool_limit_from_the_environment(causal_extension):
    """$LINFORMER_LAB_CPU_POOL_MIB sets the limit a new process's pool starts with (what a limit
    does: test_large_outputs_come_back_from_the_pool)."""
    # the extension alone: causal_recurrence.py would import torch._dynamo, seconds of a process start
    code = "from linformer_lab.ops import cpu; print(cpu.CAUSAL_RECURRENCE.load().set_pool_limit(0))"
    for value, limit in (("8", 8 << 20), ("0", 0)):  # 0: no pool, not the default
        env = {**os.environ, "LINFORMER_LAB_CPU_POOL_MIB": value, "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == limit, value


def _recording(original, call, calls):
    def spy(*args):
        calls.append(call)
        return original(*args)
    return spy


def test_another_build_substitutes_for_the_current_one(causal_extension):
    """Extension.substituted (benchmarks time an earlier revision's build beside the current one):
    within the block the kernel calls the given module, after it the process's own again. (A
    stand-in records its calls and passes them to the current build.)"""
    calls = []
    other = types.SimpleNamespace(fits=causal_extension.fits, width=causal_extension.width,
                                  **{fn: _recording(getattr(causal_extension, fn), fn, calls)
                                     for fn in ("attention_forward", "attention_backward")})
    leaves, grads = inputs(1, 2, 40, 16, 16)
    with cpu.CAUSAL_RECURRENCE.substituted(other):
        assert cpu.CAUSAL_RECURRENCE.load() is other and cpu.CAUSAL_RECURRENCE.module() is other
        assert_close(results(fused(), leaves, grads, torch.float32), _reference(leaves, grads), torch.float32)
    assert calls == ["attention_forward", "attention_backward"]
    assert cpu.CAUSAL_RECURRENCE.load() is causal_extension


def test_no_extension_falls_back_to_pytorch_with_one_warning(monkeypatch, tmp_path):
    """No cached build and no compiler: the causal layer warns once and keeps to the PyTorch form."""
    monkeypatch.setattr(cpu, "CAUSAL_RECURRENCE", cpu.Extension("linformer_lab_causal_recurrence",
                                                                "causal_recurrence.cpp", cpu.CAUSAL_RECURRENCE.purpose))
    monkeypatch.setenv(build_cache.VARIABLE, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-linformer-lab")
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    layer = LinearAttention(causal=True, query_dim=4)
    leaves, _ = inputs(1, 1, 20, 4, 4)
    q, k, v = leaves[:3]
    with pytest.warns(RuntimeWarning) as record:
        out = layer(q, k, v)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "causal linear attention keeps to PyTorch" in messages[0], messages
    want, _, _ = naive_attention(q, k, v, torch.zeros(1, 1, 4, 4, dtype=q.dtype), torch.zeros(1, 1, 4, dtype=q.dtype),
                                 eps=layer.eps)
    torch.testing.assert_close(out, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(q, k, v)  # not retried, not warned again
    assert kernels.select("causal_attention", layer.feature_map, q, k, v).name == "pytorch"
