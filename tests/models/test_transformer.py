"""The parallel path (forward) and the recurrent path (step) of the model agree."""

import pytest
import torch
from conftest import built_in_attention

import linformer_lab as ll
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.models.transformer import Transformer

CPU_BACKENDS = [name for name in built_in_attention() if name != "linear_cuda"]
SETTINGS = [(b, None) for b in CPU_BACKENDS] + [("linear", fm) for fm in ll.list_feature_maps() if fm != "elu"]


def _model(backend, feature_map, causal=True):
    torch.manual_seed(0)
    kwargs = {"bucket_size": 4, "n_buckets": 4, "n_hashes": 2} if backend == "lsh" else {}
    fm_kwargs = {"num_features": 32} if feature_map in ("favor", "random_fourier") else {}
    attention = AttentionConfig(backend, feature_map=feature_map, feature_map_kwargs=fm_kwargs, kwargs=kwargs)
    return Transformer(n_layers=2, d_model=16, n_heads=2, attention=attention, causal=causal).double().eval()


@pytest.mark.parametrize("backend,feature_map", SETTINGS)
def test_step_equals_forward(backend, feature_map):
    model = _model(backend, feature_map)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    state = None
    stepped = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            y_t, state = model.step(x[:, t], state)
            stepped.append(y_t)
        stepped = torch.stack(stepped, 1)
        if backend == "lsh":  # RNN mode = forward over the same prefix (see ops/lsh.py)
            want = torch.stack([model(x[:, : t + 1])[:, t] for t in range(x.shape[1])], 1)
        else:
            want = model(x)
    torch.testing.assert_close(stepped, want, rtol=1e-9, atol=1e-9)


def test_shared_qk_backend_has_no_key_projection():
    lsh = MultiHeadAttention(16, 2, attention=AttentionConfig("lsh"), causal=True)
    lin = MultiHeadAttention(16, 2, attention=AttentionConfig("linear"), causal=True)
    assert lsh.qkv.out_features == 2 * 16 and lin.qkv.out_features == 3 * 16


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_padding_does_not_change_valid_outputs(backend):
    """Non-causal encoder: an utterance alone and padded in a batch give the same output."""
    model = _model(backend, None, causal=False)
    if backend == "lsh":
        for layer in model.layers:
            layer.attention.attention.bucket_size = 64  # one chunk: deterministic w.r.t. padding
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    padded = torch.cat([x, torch.randn(1, 6, 16, dtype=torch.float64)], 1)
    batch = torch.cat([padded, torch.randn(1, 15, 16, dtype=torch.float64)])
    with torch.no_grad():
        alone = model(x)
        together = model(batch, key_lengths=torch.tensor([9, 15]))
    torch.testing.assert_close(together[:1, :9], alone, rtol=1e-9, atol=1e-9)


def test_gradients_flow_to_every_parameter():
    model = _model("linear", None).float().train()
    x = torch.randn(2, 10, 16)
    model(x).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_step_equals_forward_in_training_mode(backend):
    """One step path for training and eval: with dropout 0 the training-mode step is the
    forward at each position, gradients included."""
    model = _model(backend, None).train()
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    state, stepped = None, []
    for t in range(x.shape[1]):
        y_t, state = model.step(x[:, t], state)
        stepped.append(y_t)
    stepped = torch.stack(stepped, 1)
    torch.testing.assert_close(stepped, model(x), rtol=1e-9, atol=1e-9)
    grad_step, = torch.autograd.grad(stepped.sum(), x)
    grad_forward, = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(grad_step, grad_forward, rtol=1e-9, atol=1e-9)


def test_step_applies_dropout_in_training_mode_only():
    torch.manual_seed(0)
    model = Transformer(n_layers=1, d_model=16, n_heads=2, attention=AttentionConfig("linear"), dropout=0.5).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        train_out, _ = model.train().step(x)
        eval_out, _ = model.eval().step(x)
        assert not torch.allclose(train_out, eval_out)
        torch.testing.assert_close(eval_out, model(x[:, None])[:, 0], rtol=1e-9, atol=1e-9)


def test_sequence_buffer_grows_and_names_a_misfit():
    from linformer_lab.ops.state import KVCache, SequenceBuffer

    buffer = SequenceBuffer(torch.zeros(2, 3), dim=1, capacity=2)
    rows = [torch.full((2, 3), float(i)) for i in range(5)]
    for row in rows:
        buffer.append(row)  # grows past the capacity of 2 twice
    torch.testing.assert_close(buffer.filled, torch.stack(rows, 1))
    assert buffer.nbytes == 2 * 5 * 3 * 4
    with pytest.raises(ValueError, match=r"position of shape \(2, 4\) does not fit"):
        buffer.append(torch.zeros(2, 4))
    cache = KVCache(torch.zeros(1, 2, 4), torch.zeros(1, 2, 3), capacity=1)
    for i in range(3):
        cache.append(torch.full((1, 2, 4), float(i)), torch.full((1, 2, 3), float(i)))
    assert cache.keys.shape == (1, 2, 3, 4) and cache.values.shape == (1, 2, 3, 3) and cache.length == 3
    assert cache.nbytes == (2 * 3 * 4 + 2 * 3 * 3) * 4

