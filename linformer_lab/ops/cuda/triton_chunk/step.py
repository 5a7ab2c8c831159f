"""One generation step of causal linear attention in one Triton kernel (eq. 18-20 for every
(batch row, head) at once): phi = elu + 1 of the query and key (or the mapped inputs as given), the
state update S += phi(k) v^T, Z += phi(k) in place, and the readout
phi(q)^T S / (phi(q)^T Z + eps).

PyTorch spends about a dozen kernels on this per layer, each in a batch-1 generation step a
launch of almost no work, so the step's time is their count; here it is one launch per layer.

``linformer_lab::linear_attention_step_`` is a ``torch.library`` operator (fake function included)
that writes the state in place, so ``torch.compile`` traces the graph step through it; the kernel
is ``step_kernel.py``'s, compiled with the chunk kernels (``launch.kernels``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from linformer_lab.ops import custom_ops
from linformer_lab.ops.cuda.triton_chunk.op import MAX_WIDTH


def _step(q: Tensor, k: Tensor, v: Tensor, joint: Tensor, feature_map: str, eps: float) -> Tensor:
    from linformer_lab.ops.cuda.triton_chunk import launch

    b, h, c = q.shape
    m = v.shape[-1]
    out = torch.empty_like(v)
    if b * h == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    with launch.on_device(q.device):
        launch.kernels(launch.interpreting()).linear_attention_step[(b * h,)](
            q, k, v, joint, out, h, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), float(eps), launch.tiny(q.dtype), C=c, M=m, BC=launch.pow2(c),
            BM=launch.pow2(m), ELU=feature_map == "elu")
    return out


def _step_fake(q, k, v, joint, feature_map, eps):
    return torch.empty_like(v)


#: ``linear_attention_step_(q, k, v, joint, feature_map, eps)``: q, k ``(B, H, C)``, v ``(B, H, M)``
#: -> ``(B, H, M)`` in v's dtype; ``joint`` ``(B, H, C, M + 1)`` fp32 contiguous, [S | Z], updated in place
linear_attention_step_ = custom_ops.define(
    "linear_attention_step_(Tensor q, Tensor k, Tensor v, Tensor(a!) joint, str feature_map, float eps) -> Tensor",
    _step, _step_fake, "CompositeExplicitAutograd")


def runs_for(joint: Tensor) -> bool:
    """Where the kernel runs: a CUDA GPU with Triton, for an fp32 contiguous joint state ``(B, H, C,
    M + 1)`` (a float64 model keeps float64 state, which the kernel does not hold) whose C and M are
    at most :data:`~.op.MAX_WIDTH` (one program holds the whole C x M state)."""
    from linformer_lab.ops.cuda import triton_chunk

    return (joint.dtype == torch.float32 and joint.is_contiguous() and joint.device.type == "cuda"
            and max(joint.shape[-2], joint.shape[-1] - 1) <= MAX_WIDTH and triton_chunk.is_available())
