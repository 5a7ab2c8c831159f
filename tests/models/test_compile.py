"""``torch.compile(model, fullgraph=True)`` traces a Transformer with causal linear attention whole
on CPU: the fused C++ causal attention (feature map, numerator and normaliser; a ``torch.library``
operator, linformer_lab/ops/custom_ops.py) and its state, with no graph break (``fullgraph=True``
makes one an error).
The compiled model's outputs, states and gradients equal eager ones, and the kernel ran inside it.

The graphs are traced by Dynamo and AOT autograd (fake tensors, the operators' fake functions and
registered gradients) and run by the ``aot_eager`` backend; Inductor's code generation adds
nothing to what is checked here and costs minutes on 2 cores.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.transformer import Transformer
from linformer_lab.ops import cpu

pytestmark = pytest.mark.slow  # Dynamo and AOT autograd trace for several seconds per graph


@pytest.fixture
def kernel_calls():
    """Counts the fused C++ attention's forward and backward calls (its module substituted by a spy)."""
    try:
        real = cpu.CAUSAL_RECURRENCE.load()
    except RuntimeError as error:
        if cpu.find_compiler() is not None:
            raise
        pytest.skip(f"needs the causal CPU kernel extension ({error})")
    calls = []

    def counted(name):
        def call(*args):
            calls.append(name.replace("attention_", ""))
            return getattr(real, name)(*args)
        return call

    spy = types.SimpleNamespace(**{name: getattr(real, name) for name in dir(real) if not name.startswith("__")})
    spy.attention_forward, spy.attention_backward = counted("attention_forward"), counted("attention_backward")
    with cpu.CAUSAL_RECURRENCE.substituted(spy):
        yield calls


def model(d_model: int, heads: int, feature_map: str | None = None) -> Transformer:
    torch.manual_seed(0)
    return Transformer(2, d_model, heads, attention=AttentionConfig("linear", feature_map=feature_map), causal=True)


def gradients(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters()] + [x.grad]


@pytest.mark.parametrize("d_model, heads", [(16, 2), (14, 2)], ids=["head dim 8", "head dim 7 (padded)"])
def test_compiled_forward_and_backward_equal_eager(kernel_calls, d_model, heads):
    """elu map, padded sequences (key_lengths), fwd + bwd; head dim 7 runs the kernel zero-padded."""
    eager = model(d_model, heads)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 11, d_model)
    lengths = torch.tensor([11, 7, 1])
    results = []
    for module, fn in ((eager, eager), (compiled_model, compiled)):
        leaf = x.clone().requires_grad_(True)
        out = fn(leaf, key_lengths=lengths)
        (out * torch.linspace(-1, 1, d_model)).sum().backward()
        results.append((out.detach(), gradients(module, leaf)))
    assert kernel_calls.count("forward") == 4 and kernel_calls.count("backward") == 4  # 2 layers, eager + compiled
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for name, (g_c, g_e) in zip([n for n, _ in eager.named_parameters()] + ["input"], zip(grads_c, grads_e)):
        torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6, msg=lambda text, name=name: f"grad {name}: {text}")


def test_compiled_forward_continues_from_a_state(kernel_calls):
    """A prefix's state returned by the compiled forward and carried into the next segment: the
    outputs, the states and the gradients through both segments equal eager ones."""
    eager = model(16, 2)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 10, 16)
    results = []
    for module, fn in ((eager, eager), (compiled_model, compiled)):
        leaf = x.clone().requires_grad_(True)
        first, state = fn(leaf[:, :5], return_state=True)
        second, state = fn(leaf[:, 5:], state=state, return_state=True)  # one length: no dynamic-shape retrace
        (first.sum() + second.square().sum() + sum(s[0].sum() + s[1].sum() for s in state)).backward()
        results.append(([first.detach(), second.detach()] + [t.detach() for s in state for t in s], gradients(module, leaf)))
    assert "forward" in kernel_calls and "backward" in kernel_calls
    (values_e, grads_e), (values_c, grads_c) = results
    for c, e in zip(values_c + grads_c, values_e + grads_e):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
