"""Cross attention (issue 39, item 2): queries and keys of different lengths (N != L), for every
non-causal backend with separate keys (linear with every feature map, softmax; linear_cuda on a
GPU), with ``key_lengths``, against float64 references written here: for linear attention the
O(N L) similarity form of eq. 3-4 with the backend's feature map, for softmax plain
``softmax(q k^T / sqrt(D)) v``; gradients against autograd of the references. Where a backend
cannot (causal with N != L, lsh's shared queries and keys, packed sequences) the error is one line
naming the problem. Through ``MultiHeadAttention(x, context=c)`` too.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close, attention_configs, config_id

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.multihead import MultiHeadAttention

CROSS = [c for c in attention_configs() if c.backend in ("linear", "linear_cuda", "softmax")]
D, M = 4, 3
SHAPES = [(5, 9), (9, 4), (1, 7)]  # (N queries, L keys)


def _device(config) -> str:
    return "cuda" if config.backend == "linear_cuda" else "cpu"


def _backend(config, causal=False):
    torch.manual_seed(0)
    return config.build(causal=causal, query_dim=D).to(device=_device(config), dtype=torch.float64)


def _inputs(n: int, length: int, device: str, seed: int = 0, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(2, 2, n, D, generator=gen, dtype=torch.float64)
    k = 0.5 * torch.randn(2, 2, length, D, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, length, M, generator=gen, dtype=torch.float64)
    return tuple(t.to(device).requires_grad_(grad) for t in (q, k, v))


def reference(backend, q, k, v, key_lengths=None):
    """``(B, H, N, D), (B, H, L, D), (B, H, L, M) -> (B, H, N, M)`` in the quadratic form."""
    length = k.shape[2]
    visible = torch.ones(q.shape[0], length, dtype=torch.bool, device=q.device)
    if key_lengths is not None:
        visible = torch.arange(length, device=q.device) < key_lengths[:, None]
    visible = visible[:, None, None, :]  # (B, 1, 1, L)
    if backend.uses_feature_map:  # eq. 3-4: sim(q_i, k_j) = phi(q_i)^T phi(k_j), every pair
        phi_q, phi_k = backend.feature_map.forward_queries(q), backend.feature_map.forward_keys(k)
        similarity = torch.einsum("bhnc,bhlc->bhnl", phi_q, phi_k) * visible
        return similarity @ v / (similarity.sum(-1, keepdim=True) + backend.eps)
    scores = torch.einsum("bhnd,bhld->bhnl", q, k) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}-L{s[1]}")
@pytest.mark.parametrize("config", CROSS, ids=config_id)
def test_cross_attention_equals_the_quadratic_reference_with_gradients(config, shape):
    backend = _backend(config)
    n, length = shape
    q, k, v = _inputs(n, length, _device(config), grad=True)
    for key_lengths in (None, torch.tensor([length, max(1, length - 3)], device=q.device)):
        got = backend(q, k, v, key_lengths=key_lengths)
        want = reference(backend, q, k, v, key_lengths)
        name = f"{config_id(config)} N={n} L={length} key_lengths={key_lengths}"
        assert got.shape == (2, 2, n, M)
        assert_close(name, want, got, 1e-10, 1e-10)
        weights = torch.randn_like(want)
        grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
        want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
        for label, g, w in zip("qkv", grads, want_grads):
            assert_close(f"{name}: grad {label}", w, g, 1e-9, 1e-9)


@pytest.mark.parametrize("config", CROSS, ids=config_id)
def test_a_state_of_earlier_context_is_attended_with_the_new_keys(config):
    """Keys and values arriving in two parts (an encoder's memory growing): the state after the
    first part, given with the second, equals attending to both at once."""
    backend = _backend(config)
    q, k1, v1 = _inputs(4, 6, _device(config), seed=1)
    _, k2, v2 = _inputs(4, 3, _device(config), seed=2)
    _, state = backend(q, k1, v1, return_state=True)
    got = backend(q, k2, v2, state=state)
    assert_close(config_id(config), reference(backend, q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)), got,
                 1e-10, 1e-10)


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_causal_cross_attention_is_one_clear_error(backend):
    attention = _backend(AttentionConfig(backend), causal=True)
    q, k, v = _inputs(5, 9, "cpu")
    with pytest.raises(ValueError, match=r"causal attention needs as many keys as queries .*got N = 5 queries and "
                                         r"L = 9 keys\. Cross attention is non-causal: build the backend with causal=False$"):
        attention(q, k, v)


def test_lsh_refuses_cross_attention_in_one_line():
    lsh = AttentionConfig("lsh", kwargs={"bucket_size": 4, "n_buckets": 4}).build(causal=False, query_dim=D).double()
    q, k, v = _inputs(8, 12, "cpu")
    with pytest.raises(ValueError, match=r"^LSHAttention: its keys are its queries \(shares_query_key\), so it cannot "
                                         r"attend from N = 8 queries to L = 12 other keys; cross attention takes"):
        lsh(q, k, v)


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_packed_sequences_and_key_lengths_are_checked_against_the_keys(backend):
    attention = _backend(AttentionConfig(backend))
    q, k, v = _inputs(5, 9, "cpu")
    with pytest.raises(ValueError, match="packed sequences .* must have one length; got 5 queries and 9 keys"):
        attention(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"key_lengths must lie in \[1, 9\]"):
        attention(q, k, v, key_lengths=torch.tensor([9, 10]))
    attention(q, k, v, key_lengths=torch.tensor([9, 7]))  # more than N = 5 keys: fine, they are the keys'


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention(x, context=...)
# ------------------------------------------------------------------------------------------------


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, N, H * d) -> (B, H, N, d)


@pytest.mark.parametrize("config", [c for c in CROSS if c.backend != "linear_cuda"], ids=config_id)
def test_multihead_cross_attention_projects_queries_from_x_and_keys_values_from_the_context(config):
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, attention=config, causal=False).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    context = torch.randn(2, 7, 8, generator=gen, dtype=torch.float64)
    key_lengths = torch.tensor([7, 4])
    w, b = mha.qkv.weight, mha.qkv.bias
    q = _heads(x @ w[:8].T + b[:8], 2)
    k = _heads(context @ w[8:16].T + b[8:16], 2)
    v = _heads(context @ w[16:].T + b[16:], 2)
    attended = reference(mha.attention, q, k, v, key_lengths).transpose(1, 2).flatten(2)
    want = attended @ mha.out.weight.T + mha.out.bias
    assert_close(config_id(config), want, mha(x, key_lengths=key_lengths, context=context), 1e-10, 1e-10)
    assert_close(f"{config_id(config)} context=x is self attention", mha(x), mha(x, context=x), 1e-12, 1e-12)


def test_multihead_cross_attention_errors_are_one_line():
    x, context = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    with pytest.raises(ValueError, match=r"^LSHAttention: its keys are its queries \(shares_query_key\), so it takes no "
                                         r"context"):
        MultiHeadAttention(8, 2, attention=AttentionConfig("lsh", kwargs={"bucket_size": 4}))(x, context=context)
    with pytest.raises(ValueError, match=r"context must be \(batch, L, d_model\) = \(2, L, 8\) like x \(2, 5, 8\); "
                                         r"got \(2, 7, 6\)"):
        MultiHeadAttention(8, 2)(x, context=torch.randn(2, 7, 6))
    with pytest.raises(ValueError, match="causal attention needs as many keys as queries"):
        MultiHeadAttention(8, 2, causal=True)(x, context=context)
