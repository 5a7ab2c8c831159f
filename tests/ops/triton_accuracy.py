"""The half-precision accuracy check of the Triton chunk kernel, shared by the interpreter tests
(``test_triton_chunk.py``) and the GPU tests (``test_triton_chunk_gpu.py``): the kernel's relative
error, output and every gradient, against that of the PyTorch form of the same algorithm in the
same dtype, both measured against the PyTorch form in float64."""

from __future__ import annotations

import torch

from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention, chunk_linear_attention_torch


def half_errors(fn, dtype, t, mean, d=32, chunk=64, seeds=(0,), device="cpu", heads=(1, 1)):
    """Relative errors against the float64 PyTorch form of the output and of the gradients of
    q, k, v, S_0, z_0 (a random linear function of the output), for q, k ~ N(0, 1) and
    v ~ N(mean, 1) in ``dtype``, ``(B, H) = heads``, ``(B, H, t, d)``; pooled over ``seeds``:
    ||all errors|| / ||all exact values||."""
    names = ("out", "q", "k", "v", "S0", "z0")
    error, size = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        q, k, v, weight = (torch.randn(*heads, t, d, generator=gen) for _ in range(4))
        s0, z0 = torch.rand(*heads, d, d, generator=gen) * 4, torch.rand(*heads, d, generator=gen) * 4
        tensors = [q.to(dtype), k.to(dtype), (v + mean).to(dtype), s0, z0]
        tensors = [x.to(device).requires_grad_() for x in tensors]
        exact = [x.detach().double().requires_grad_() for x in tensors]
        out = fn(*tensors[:3], initial_state=tensors[3:], chunk_size=chunk)
        out.backward(weight.to(device, dtype))
        want = chunk_linear_attention_torch(*exact[:3], initial_state=exact[3:], chunk_size=chunk)
        want.backward(weight.to(device, torch.float64))
        pairs = [(out.detach(), want.detach())] + [(x.grad, r.grad) for x, r in zip(tensors, exact)]
        for name, (got, exact_value) in zip(names, pairs):
            assert torch.isfinite(got).all(), f"{name}: non-finite values"
            error[name] += (got.double() - exact_value).norm().item() ** 2
            size[name] += exact_value.norm().item() ** 2
    return {name: (error[name] / size[name]) ** 0.5 for name in names}


def assert_as_exact_as_the_pytorch_form(dtype, t, mean, d=32, device="cpu"):
    """The kernel's error of the output and of every gradient at most 1.5x the PyTorch form's
    in the same dtype (the issue's target; a dq from half-precision outputs or bf16 states was
    10-20x)."""
    got = half_errors(chunk_linear_attention, dtype, t, mean, d, device=device)
    want = half_errors(chunk_linear_attention_torch, dtype, t, mean, d, device=device)
    worse = {name: f"{got[name]:.3g} vs {want[name]:.3g}" for name in got if got[name] > 1.5 * want[name]}
    assert not worse, f"{dtype} T={t} v mean {mean}: kernel error > 1.5x the PyTorch form's: {worse}"
