"""CUDA backend (``linear_cuda``) of causal linear attention: the numerator of eq. 9 of
"Transformers are RNNs" (Katharopoulos et al., 2020) and its gradients (eq. 13-15).

The kernels (``causal_linear_attention.cu``) are compiled on first use with
``torch.utils.cpp_extension`` (nvcc + ninja) for the compute capability of the GPUs present, and
cached in the ``cuda`` folder of the one build cache (:mod:`linformer_lab.ops.build_cache`:
``$LINFORMER_LAB_BUILD_DIR`` or ``~/.cache/linformer_lab``). Clusters whose compute nodes have no
compiler pre-build on a login node::

    python -m linformer_lab.ops.cuda build --arch 8.0 9.0

A later ``load()`` on any machine with the same torch / Python picks up a cached build whose
architectures cover its GPU, without needing nvcc.

The ``linear`` backend runs this kernel for CUDA tensors where it is available
(:mod:`linformer_lab.ops.kernels`, candidate ``cuda`` of the ``causal`` op); ``linear_cuda``
forces it where the Triton kernel does not run.

Public API:

* :func:`causal_dot_product` -- ``(q, k, v) -> out``, differentiable.
* :func:`is_available` -- a CUDA GPU is present and the extension is built or can be built.
* :func:`load` -- build if needed and load; returns the ``torch.ops.linformer_lab_cuda`` namespace.
* :func:`build` -- compile (and load) for given architectures; used by the command line.
"""

from __future__ import annotations

import os

import torch

from linformer_lab.ops import custom_ops
from linformer_lab.ops.cuda import toolchain
from linformer_lab.ops.cuda.toolchain import Arch, build, cache_root, default_archs, find_cuda_home, parse_arch_list
from linformer_lab.ops.linear_attention import dot_product_with_state

__all__ = ["Arch", "build", "cache_root", "causal_dot_product", "default_archs", "find_cuda_home", "is_available", "load",
           "parse_arch_list"]

_ops = None  # the loaded torch.ops namespace


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def is_available() -> bool:
    """True if a CUDA GPU (compute capability >= 7.0) is visible and the extension is loaded,
    cached for it, or can be built here (CUDA toolkit and ninja present). Builds nothing."""
    if not torch.cuda.is_available():
        return False
    if _ops is not None:
        return True
    try:
        caps = toolchain.device_capabilities()
    except RuntimeError:
        return False
    if any(c < toolchain.MIN_CAPABILITY for c in caps):
        return False
    return toolchain.find_prebuilt(caps) is not None or toolchain.can_build_for(caps)


def load(verbose: bool = False):
    """Loads the extension (building it first if no cached build covers the visible GPUs) and
    returns the ``torch.ops.linformer_lab_cuda`` namespace with ``causal_dot_product_fwd`` and
    ``causal_dot_product_bwd``. Raises RuntimeError naming the problem (no GPU, no nvcc...)."""
    global _ops
    if _ops is not None:
        return _ops
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the linear_cuda backend needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). {toolchain.CPU_HINT}"
        )
    caps = toolchain.device_capabilities()
    if any(c < toolchain.MIN_CAPABILITY for c in caps):
        raise RuntimeError(f"the linear_cuda kernel needs compute capability >= 7.0, found {caps}. {toolchain.CPU_HINT}")
    with toolchain.lock:
        if _ops is not None:
            return _ops
        loaded = toolchain.loaded_library()
        prebuilt = toolchain.find_prebuilt(caps) if loaded is None else None
        if loaded is not None:
            # Built earlier in this process (build()): usable only if it targets these GPUs.
            library, archs = loaded
            if not all(any(a.runs_on(c) for a in archs) for c in caps):
                raise RuntimeError(
                    f"the linear_cuda extension loaded in this process ({library}) was built for "
                    f"{', '.join(map(str, archs))}, which does not run on compute capability {caps}"
                )
        elif prebuilt is not None:
            toolchain.load_library(*prebuilt)
        else:
            archs = default_archs()
            uncovered = [c for c in caps if not any(a.runs_on(c) for a in archs)]
            if uncovered:
                raise RuntimeError(
                    f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')!r} does not cover the "
                    f"GPU compute capability {uncovered[0][0]}.{uncovered[0][1]}; add it or unset the variable"
                )
            build(archs, verbose=verbose)
        custom_ops.register_cuda_ops()  # fake functions and the gradient: torch.compile traces through the kernel
        _ops = getattr(torch.ops, toolchain.OPS_NAMESPACE)
    return _ops


# ------------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result  # torch.compile traces the call as its value: loaded once per process
def _loaded() -> bool:
    return load() is not None


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The stateless numerator; its gradient is registered with the operator
    (:func:`linformer_lab.ops.custom_ops.register_cuda_ops`)."""
    _loaded()
    return _ops.causal_dot_product_fwd(q.contiguous(), k.contiguous(), v.contiguous())


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None = None,
                       return_final_state: bool = False):
    """Numerator of causal linear attention (paper eq. 9): ``out_i = sum_{j<=i} (q_i . k_j) v_j``.

    With ``initial_state`` S_0 ``(B, H, D, M)``: ``out_i = q_i^T S_0 + ...``; with
    ``return_final_state``: ``(out, S_N = S_0 + K^T V)`` (fp32 for half inputs). The kernel
    computes the stateless part; the state enters by the exact identity of
    :func:`~linformer_lab.ops.linear_attention.dot_product_with_state` (two cuBLAS matmuls).

    Args:
        q: ``(B, H, N, D)`` feature-mapped queries.
        k: ``(B, H, N, D)`` feature-mapped keys.
        v: ``(B, H, N, M)`` values.
        All CUDA tensors on one device, one dtype (float32, float16 or bfloat16), 1 <= D, M <= 256.

    Returns:
        ``(B, H, N, M)`` in the input dtype (accumulated in float32). Differentiable in all three
        inputs; the backward pass (eq. 13-15) uses O(N (D + M)) memory.
    """
    if initial_state is None and not return_final_state:
        return _kernel(q, k, v)
    return dot_product_with_state(_kernel, q, k, v, initial_state, return_final_state)
