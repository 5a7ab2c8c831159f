"""phi(x) = elu(x) + 1, the paper's feature map (eq. 7)."""

from __future__ import annotations

import torch

from linformer_lab.feature_maps.base import FeatureMap, KernelForm
from linformer_lab.ops.linear_attention import elu_plus_one


class EluPlusOne(torch.autograd.Function):
    """``phi(x) = elu(x) + 1`` with a backward that needs only ``phi``: the derivative is 1 for
    x > 0 and exp(x) = phi(x) otherwise, i.e. ``min(phi(x), 1)``.

    Autograd through the ``where`` / ``exp`` / ``clamp`` graph keeps several tensors and runs
    several kernels over q and k per layer; this keeps phi and runs a clamp and a product. Twice
    differentiable (the backward is differentiable operations on the saved output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = elu_plus_one(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad * out.clamp(max=1)


class EluFeatureMap(FeatureMap):
    """``elu(x) + 1``, elementwise; ``output_dim == query_dim``.

    Evaluated as ``x + 1`` for x > 0 and ``exp(x)`` otherwise, without the cancellation of
    ``(exp(x) - 1) + 1``, half-precision outputs clamped above 0
    (:func:`~linformer_lab.ops.linear_attention.elu_plus_one`).
    """

    kernel_form = KernelForm("elu", kernels=("triton", "cpp", "fused_step"))

    @property
    def output_dim(self) -> int:
        return self.query_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return EluPlusOne.apply(x)

    def exact_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``(elu(q) + 1)^T (elu(k) + 1)`` from torch's own elu (eq. 7 as written)."""
        return (torch.nn.functional.elu(q) + 1) @ (torch.nn.functional.elu(k) + 1).transpose(-1, -2)
