"""The fused C++ CPU step behind :func:`~linformer_lab.models.generation.dynamic_step.fast_step`: when it
applies and the weights it reads.

At batch 1 a step of the paper's MNIST model runs about 40 small tensor operations per layer,
each costing microseconds of dispatch besides its arithmetic. ``linformer_lab/ops/cpu/fused_step.cpp``
runs the whole stack's step in one call: the norms, feature maps, state update and readout,
biases and residuals as plain loops, the weight products through ATen's CPU ``mm`` (the BLAS of
``fast_step``'s ``addmm``) on the same transposed weights, the GELU through ATen's kernel. Same
arithmetic up to summation order (``tests/models/test_fused_step.py`` holds it to ``Transformer.step``).

:func:`step` takes it when all of these hold, and otherwise leaves the step to ``fast_step``'s
Python path (the reference, which also raises the errors for states that do not fit):

* :mod:`linformer_lab.ops.kernels` picks the C++ candidate of its ``fused_step`` op (CPU,
  float32 or float64, autocast off, at most :data:`FUSED_MAX_BATCH` rows, the extension built
  or buildable, no ``LINFORMER_LAB_KERNELS`` forcing the reference);
* the stack's linear layers hold ``"model"`` weight copies (``weight_copies_for_steps``, as in
  the sampling loop): they say the weights are fixed for the block, and the step reads them
  through the block's :func:`~linformer_lab.models.generation.weights.fused_plan`;
* the stack is of the ``LINEAR_FUSED`` form
  (:func:`~linformer_lab.models.generation.form.why_not_paper_form`), its weights float32 or
  float64 on CPU;
* a state from an earlier step or a prefill (a list of ``LinearState``; a sequence's first step
  makes it on the Python path), inputs of the weights' dtype.

Eval mode and no autograd are checked by ``fast_step`` before.
"""

from __future__ import annotations

import torch

from linformer_lab.models.generation.weights import fused_plan
from linformer_lab.models.transformer import Transformer
from linformer_lab.ops import kernels
from linformer_lab.ops.kernels import FUSED_MAX_BATCH
from linformer_lab.ops.state import LinearState, StackState

__all__ = ["FUSED_MAX_BATCH", "step"]


def step(transformer: Transformer, x_t: torch.Tensor, state):
    """``fast_step(transformer, x_t, state)`` through the fused C++ step: ``(out, state)``, with the
    state's ``[S | Z]`` buffers updated in place; None where it does not apply (module docstring)."""
    kernel = None if state is None else kernels.select("fused_step", x_t)
    if kernel is None or kernel.name == kernels.PYTORCH:
        return None
    plan = fused_plan(transformer, kernel.run)
    if plan is None or plan.stack is None or x_t.dtype != plan.dtype or len(state) != plan.layers:
        return None
    joints = []
    for layer_state in state:
        if type(layer_state) is not LinearState:
            return None
        joints.append(layer_state.joint)
    try:
        out = plan.stack.step(x_t, joints)
    except RuntimeError:  # checked before any state changes: shapes, dtypes, layouts that do not fit
        return None
    return out, StackState(state)
