"""Shared by the tests of the linear_cuda backend (linformer_lab.ops.cuda), which come in three files:

* ``test_linear_cuda_build.py`` (CPU, always run): argument parsing, the no-GPU error path, the
  autograd wrapper, and a compile of the extension with the machine's nvcc (``cuda_build``
  marker; sm_80 only, cached in ``~/.cache/linformer_lab/cuda_build_test``: about 2-4 minutes on
  2 cores the first time, then ninja finds it up to date);
* ``test_linear_cuda_emulation.py`` (CPU): the kernel source executed by a CPU emulation of CUDA
  (``cuda_emulation`` marker; the emulator binaries are cached too) against a float64
  reference -- the only check of the kernels' arithmetic that CI can run;
* ``test_linear_cuda_gpu.py`` (skipped without CUDA): values and gradients against a float64
  reference, long sequences, many heads, streams, devices, error messages, segments with state.

Run everything on a GPU machine with ``uv run pytest tests/ops/test_linear_cuda_*.py -v``; leave out
the slow CPU compiles with ``-m "not cuda_build and not cuda_emulation"``.

Here: the float64 references, the tolerances, the inputs and the ``gpu`` marker.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from linformer_lab.ops import cuda as lcuda

REPO = Path(__file__).resolve().parents[2]
CUDA_SRC = REPO / "linformer_lab" / "ops" / "cuda"
CACHE = Path(os.environ.get("LINFORMER_LAB_TEST_CACHE", Path.home() / ".cache" / "linformer_lab"))

HAS_GPU = lcuda.is_available()


def gpu(test):
    """Marks a test that needs the GPU; its time limit covers the first test's JIT build."""
    test = pytest.mark.timeout(1800)(test)
    return pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (and nvcc or a cached build)")(test)


# ------------------------------------------------------------------------------------------------
# float64 references
# ------------------------------------------------------------------------------------------------


def naive_causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """out_i = sum_{j<=i} (q_i . k_j) v_j by the O(N^2) definition; q, k (..., N, D), v (..., N, M)."""
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("...id,...jd->...ij", q, k).masked_fill(~mask, 0)
    return scores @ v


def reference(q, k, v, grad_out=None):
    """float64 output (and gradients by autograd of the naive definition)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(grad_out is not None) for t in (q, k, v))
    out = naive_causal_dot_product(q64, k64, v64)
    if grad_out is None:
        return out.detach()
    out.backward(grad_out.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (the largest error relative to the output's scale)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def make_inputs(b, h, n, d, m, dtype, device="cpu", seed=0):
    """Feature-mapped (positive) q, k scaled by 1/D so scores stay O(1); v, grad_out standard normal."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, d, generator=gen) / d
    k = torch.rand(b, h, n, d, generator=gen)
    v = torch.randn(b, h, n, m, generator=gen)
    g = torch.randn(b, h, n, m, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, g)]
