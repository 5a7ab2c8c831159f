"""The layer options of the authors' copy-task model (models/transformer.py): post-norm layers
and a ReLU feed-forward, each against the layer written out by hand, the recurrent path equal to
the parallel one, and the defaults unchanged (pre-norm, GELU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linformer_lab.models.transformer import Transformer, TransformerLayer


def _layer(norm_first: bool, activation: str, backend: str = "softmax") -> TransformerLayer:
    torch.manual_seed(0)
    layer = TransformerLayer(16, 2, 24, attention=backend, norm_first=norm_first, activation=activation).double().eval()
    with torch.no_grad():  # norms away from (1, 0): their weights must count in the comparison
        for name, parameter in layer.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return layer


def _by_hand(layer: TransformerLayer, x: torch.Tensor, norm_first: bool, act) -> torch.Tensor:
    """The layer from its weights: the feed-forward as its two matrices, the norms as F.layer_norm."""
    up, _, _, down = layer.feedforward

    def ff(h):
        return act(h @ up.weight.T + up.bias) @ down.weight.T + down.bias

    def norm(h, module):
        return F.layer_norm(h, (16,), module.weight, module.bias, module.eps)

    if norm_first:
        x = x + layer.attention(norm(x, layer.norm_attention))
        return x + ff(norm(x, layer.norm_ff))
    x = norm(x + layer.attention(x), layer.norm_after_attention)  # LayerNorm(x + f(x))
    return norm(x + ff(x), layer.norm_after_ff)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation,act", [("gelu", F.gelu), ("relu", torch.relu)])
def test_layer_equals_the_layer_written_by_hand(norm_first, activation, act):
    layer = _layer(norm_first, activation)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _by_hand(layer, x, norm_first, act), rtol=1e-12, atol=1e-12)
    assert isinstance(layer.feedforward[1], {"gelu": torch.nn.GELU, "relu": torch.nn.ReLU}[activation])


def test_post_norm_is_not_pre_norm():
    """The hand-written forms differ on these inputs, so the test above tells the two apart."""
    layer = _layer(False, "relu")
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pre = TransformerLayer(16, 2, 24, attention="softmax").double().eval()
    pre.load_state_dict({k.replace("norm_after_attention", "norm_attention").replace("norm_after_ff", "norm_ff"): v
                         for k, v in layer.state_dict().items()})
    pre.feedforward[1] = torch.nn.ReLU()
    assert (pre(x) - layer(x)).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_post_norm_relu_stack_steps_as_it_runs_in_parallel(backend):
    torch.manual_seed(1)
    model = Transformer(2, 16, 2, 24, attention=backend, norm_first=False, activation="relu").double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    state, steps = None, []
    for t in range(x.shape[1]):
        out, state = model.step(x[:, t], state)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), model(x), rtol=1e-9, atol=1e-9)


def test_defaults_are_pre_norm_gelu_and_bad_activation_names_the_choices():
    layer = TransformerLayer(16, 2, 32)
    assert layer.norm_first and isinstance(layer.norm_attention, torch.nn.LayerNorm)
    assert isinstance(layer.feedforward[1], torch.nn.GELU)
    post = TransformerLayer(16, 2, 32, norm_first=False)
    assert post.norm_attention is None and post.norm_ff is None  # the fast paths' pre-norm reads fail at once
    with pytest.raises(ValueError, match="unknown activation 'tanh'; valid choices: gelu, relu"):
        TransformerLayer(16, 2, 32, activation="tanh")


def test_pre_norm_parameters_keep_the_order_checkpoints_were_saved_in():
    """An optimizer's saved state is keyed by parameter position, so a pre-norm layer lists its
    parameters as checkpoints of every earlier version do: norm, attention, norm, feed-forward.
    (A change of order made resuming a trained MNIST run fail in its first step.)"""
    layer = TransformerLayer(16, 2, 32, attention="linear")
    order = [name.split(".")[0] for name, _ in layer.named_parameters()]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["norm_attention", "attention", "norm_ff", "feedforward"]
