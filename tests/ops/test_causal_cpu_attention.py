"""The fused causal attention on CPU (phi = elu + 1 or any map, numerator and normaliser in one C++ forward and
one backward: ``attention_forward`` / ``attention_backward`` of linformer_lab/ops/cpu/causal_recurrence.cpp,
through the operators of linformer_lab/ops/custom_ops.py and causal_recurrence.causal_attention) against the
float64 O(N^2) attention written out here (torch's own elu), gradients against autograd of it.

Checked: outputs, the final state (S_N, z_N) and the gradients of q, k, v, S_0, z_0 and from both
parts of the final state; C != M, odd C and M (zero-padded: a padded column of q must not enter the
normaliser, though phi(0) = 1); key lengths (masked keys enter neither outputs nor state nor get a
gradient); packed sequences (cu_seqlens) with empty ones, one state row each; one row on two threads
(the forward's column pieces, the backward's split passes); every instruction-set version the CPU
runs; float32 and float64; half inputs run as float32; the layer with the fused kernel equal to the
layer on the ``pytorch`` candidate, and the dispatch taking it for every map; every registered map
through the kernel (phi applied by PyTorch, passed ``mapped``) against its float64 O(N^2) attention,
and packed against ``packed.py``'s form;
the maps phi(q), phi(k) the forward returns for the backward, which needs neither q nor k; the
operators' opcheck (slow).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import built_in_feature_maps

from linformer_lab.attention.linear import LinearAttention
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.ops import custom_ops, kernel_check, kernels
from linformer_lab.ops.cpu import causal_recurrence

EPS = 1e-6
#: relative to the largest entry of each result (sums of up to N products of O(1) numbers)
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=3e-5, atol=3e-5)}
NAMES = ["out", "S_N", "z_N", "grad q", "grad k", "grad v", "grad S_0", "grad z_0"]


def naive_attention(q, k, v, s0, z0, key_lengths=None, eps=EPS):
    """float64 causal linear attention from an initial state, O(N^2): (out, S_N, z_N)."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    if key_lengths is not None:
        valid = (torch.arange(k.shape[2])[None, :] < key_lengths[:, None]).to(q.dtype)[:, None, :, None]
        phi_k, v = phi_k * valid, v * valid
    weights = torch.tril(phi_q @ phi_k.transpose(-1, -2))
    numerator = weights @ v + phi_q @ s0
    denominator = weights.sum(-1, keepdim=True) + phi_q @ z0.unsqueeze(-1) + eps
    return numerator / denominator, s0 + phi_k.transpose(-1, -2) @ v, z0 + phi_k.sum(-2)


def inputs(b, h, n, c, m, s=None, seed=0):
    """q, k, v, S_0, z_0 in float64 and upstream gradients for out, S_N, z_N (S = s or B state rows)."""
    gen = torch.Generator().manual_seed(seed)
    s = b if s is None else s
    q, k = (torch.randn(b, h, n, c, generator=gen, dtype=torch.float64) * 1.5 for _ in range(2))
    v, grad = (torch.randn(b, h, n, m, generator=gen, dtype=torch.float64) for _ in range(2))
    s0, grad_s = (torch.randn(s, h, c, m, generator=gen, dtype=torch.float64) for _ in range(2))
    z0 = torch.rand(s, h, c, generator=gen, dtype=torch.float64) * 4  # a normaliser: positive
    grad_z = torch.randn(s, h, c, generator=gen, dtype=torch.float64)
    return [q, k, v, s0, z0], [grad, grad_s, grad_z]


def results(run, leaves, grads, dtype):
    """[out, S_N, z_N, grad q, k, v, S_0, z_0] of ``run(q, k, v, s0, z0) -> (out, S_N, z_N)`` in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
    outs = run(*leaves)
    torch.autograd.backward(outs, [g.to(dtype) for g in grads])
    return [o.detach() for o in outs] + [t.grad for t in leaves]


def fused(key_lengths=None, cu_seqlens=None):
    def run(q, k, v, s0, z0):
        out, (s_n, z_n) = causal_recurrence.causal_attention(EluFeatureMap(q.shape[-1]), q, k, v, key_lengths, EPS, None,
                                                      (s0, z0), True, cu_seqlens)
        return out, s_n, z_n
    return run


def assert_close(got, want, dtype):
    for name, g, w in zip(NAMES, got, want):
        scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
        torch.testing.assert_close(g.double() / scale, w / scale, **TOLERANCE[dtype], msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def threads():
    """2 threads: one row then splits its columns (forward) and its passes (backward)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


SHAPES = [  # (B, H, N, C, M): one block and several, C != M, odd sizes padded, many rows
    (1, 1, 37, 16, 16),
    (2, 3, 300, 32, 16),
    (1, 1, 600, 64, 64),  # one row, several register columns: split on two threads
    (1, 2, 260, 16, 128),
    (2, 1, 280, 7, 7),
    (1, 2, 90, 33, 5),
    (1, 1, 70, 65, 65),
    (2, 1, 265, 12, 12),  # 12 fills 4-float registers only
    (1, 1, 265, 3, 16),
    (4, 8, 70, 16, 32),  # many rows
    (1, 2, 50, 561, 32),  # poly2's features at D = 32: 1 + 32 + 32 * 33 / 2
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_attention_matches_the_float64_reference(causal_extension, threads, shape, dtype):
    leaves, grads = inputs(*shape)
    assert_close(results(fused(), leaves, grads, dtype), results(naive_attention, leaves, grads, torch.float64), dtype)


@pytest.mark.parametrize("lengths", [[0, 280], [137, 3], [280, 279]], ids=["empty", "short", "one-off"])
def test_masked_keys_enter_nothing(causal_extension, threads, lengths):
    """Keys at positions >= key_lengths add nothing to outputs or state, and get no gradient."""
    key_lengths = torch.tensor(lengths)
    leaves, grads = inputs(2, 2, 280, 16, 32)
    want = results(lambda *x: naive_attention(*x, key_lengths=key_lengths), leaves, grads, torch.float64)
    got = results(fused(key_lengths), leaves, grads, torch.float32)
    assert_close(got, want, torch.float32)
    for row, length in enumerate(lengths):
        assert not got[4][row, :, length:].any() and not got[5][row, :, length:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_packed_sequences_with_empty_ones(causal_extension, threads, dtype):
    """cu_seqlens: each sequence (two of them empty, one past a block) attends within itself from its
    own state row; equal to the reference run on each sequence alone."""
    edges = [0, 0, 100, 100, 400, 401, 433]
    leaves, grads = inputs(1, 3, edges[-1], 16, 32, s=len(edges) - 1)
    cu_seqlens = torch.tensor(edges, dtype=torch.int32)

    def per_sequence(q, k, v, s0, z0):
        outs, states, norms = [], [], []
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
            out, s_n, z_n = naive_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], s0[i : i + 1], z0[i : i + 1])
            outs.append(out), states.append(s_n), norms.append(z_n)
        return torch.cat(outs, 2), torch.cat(states), torch.cat(norms)

    assert_close(results(fused(cu_seqlens=cu_seqlens), leaves, grads, dtype),
                 results(per_sequence, leaves, grads, torch.float64), dtype)


def test_every_instruction_set_version_matches_the_reference(causal_isa):
    leaves, grads = inputs(2, 2, 300, 32, 48)
    key_lengths = torch.tensor([300, 211])
    assert_close(results(fused(key_lengths), leaves, grads, torch.float32),
                 results(lambda *x: naive_attention(*x, key_lengths=key_lengths), leaves, grads, torch.float64),
                 torch.float32)


@pytest.mark.parametrize("used", ["out", "S_N", "z_N"])
def test_gradient_from_one_output_alone(causal_extension, used):
    """Only one of out, S_N, z_N reaches the loss (the others' gradients arrive as None)."""
    leaves, _ = inputs(1, 2, 50, 16, 16)
    index = ["out", "S_N", "z_N"].index(used)
    got = [t.detach().float().requires_grad_() for t in leaves]
    want = [t.detach().clone().requires_grad_() for t in leaves]
    fused()(*got)[index].square().sum().backward()
    naive_attention(*want)[index].square().sum().backward()
    for g, w in zip(got, want):  # a leaf the output does not depend on: no gradient, or zeros
        expected = w.grad if w.grad is not None else torch.zeros_like(w)
        torch.testing.assert_close(g.grad.double() if g.grad is not None else torch.zeros_like(w), expected,
                                   rtol=1e-4, atol=1e-4)


def _layer_results(monkeypatch, switch, dtype, feature_map="elu"):
    if switch:
        monkeypatch.setenv(kernels.SWITCH, switch)
    else:
        monkeypatch.delenv(kernels.SWITCH, raising=False)
    layer = LinearAttention(causal=True, query_dim=24, feature_map=feature_map)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 290, 24, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    state = tuple(x.requires_grad_() for x in (torch.randn(2, 2, 24, 24, generator=gen),
                                                torch.rand(2, 2, 24, generator=gen) * 3))
    out, (s_n, z_n) = layer(q, k, v, key_lengths=torch.tensor([290, 100]), state=state, return_state=True)
    (out.float().square().sum() + s_n.sum() + z_n.square().sum()).backward()
    return [out, s_n, z_n, q.grad, k.grad, v.grad, state[0].grad, state[1].grad]


def test_layer_on_the_fused_kernel_equals_the_layer_on_pytorch(monkeypatch, causal_extension):
    calls = []
    original = causal_recurrence.causal_attention
    monkeypatch.setattr(causal_recurrence, "causal_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    got = _layer_results(monkeypatch, None, torch.float32)
    assert calls, "the layer did not take the fused kernel"
    want = _layer_results(monkeypatch, "causal_attention=pytorch", torch.float64)
    assert len(calls) == 1
    assert_close(got, [w.double() for w in want], torch.float32)


def test_half_inputs_run_as_float32(monkeypatch, causal_extension):
    got = _layer_results(monkeypatch, None, torch.bfloat16)
    want = _layer_results(monkeypatch, "causal_attention=pytorch", torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, g, w in zip(NAMES, got, want):  # the reference maps phi in bf16, the kernel in fp32: bf16's rounding
        scale = w.double().abs().max().item()
        torch.testing.assert_close(g.double() / scale, w.double() / scale, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_dispatch_takes_the_kernel_for_every_map(causal_extension, monkeypatch):
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    x = torch.zeros(1, 1, 4, 8)
    assert kernels.select("causal_attention", EluFeatureMap(8), x, x, x).name == "cpp"
    other = LinearAttention(causal=True, query_dim=8, feature_map="poly2").feature_map
    assert kernels.select("causal_attention", other, x, x, x).name == "cpp"
    assert any(line.startswith("causal_attention op on cpu") and "the normaliser fused" in line
               for line in kernel_check.describe())


@pytest.mark.parametrize("feature_map", built_in_feature_maps())
def test_every_map_on_the_fused_kernel_matches_the_float64_reference(causal_extension, monkeypatch, feature_map):
    """A map other than elu is applied by PyTorch and its phi(q), phi(k) go to the kernel ``mapped``:
    outputs, the final state and every gradient (inputs, state, the map's own weights) equal the
    O(N^2) attention of the same map in float64, with key lengths and a state in."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)
    torch.manual_seed(0)
    layer = LinearAttention(causal=True, query_dim=6, feature_map=feature_map).double()
    b, h, n, m, c = 2, 2, 37, 5, layer.feature_map.output_dim
    q, k, v = torch.randn(b, h, n, 6, dtype=torch.float64), torch.randn(b, h, n, 6, dtype=torch.float64), \
        torch.randn(b, h, n, m, dtype=torch.float64)
    s0, z0 = torch.randn(b, h, c, m, dtype=torch.float64), torch.rand(b, h, c, dtype=torch.float64) * 4
    lengths = torch.tensor([n, 20])
    weight_out, weight_s = torch.randn(b, h, n, m, dtype=torch.float64), torch.randn(b, h, c, m + 1, dtype=torch.float64)

    def run(fused: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, s0, z0)]
        layer.zero_grad()
        if fused:
            calls = []
            original = causal_recurrence.causal_attention
            monkeypatch.setattr(causal_recurrence, "causal_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
            out, state = layer(*leaves[:3], key_lengths=lengths, state=tuple(leaves[3:]), return_state=True)
            monkeypatch.setattr(causal_recurrence, "causal_attention", original)
            assert calls, "the layer did not take the fused kernel"
            joint = state.joint
        else:  # the O(N^2) reference: the map, every pair's weight, the state's part beside it
            phi_q, phi_k = layer.feature_map.forward_queries(leaves[0]), layer.feature_map.forward_keys(leaves[1])
            valid = (torch.arange(n) < lengths[:, None]).to(phi_k.dtype)[:, None, :, None]
            phi_k = phi_k * valid
            weights = torch.tril(phi_q @ phi_k.transpose(-1, -2))
            numerator = weights @ leaves[2] + phi_q @ leaves[3]
            out = numerator / (weights.sum(-1, keepdim=True) + phi_q @ leaves[4].unsqueeze(-1) + EPS)
            joint = torch.cat([leaves[3] + phi_k.transpose(-1, -2) @ leaves[2],
                               (leaves[4] + phi_k.sum(-2)).unsqueeze(-1)], dim=-1)
        real = (torch.arange(n) < lengths[:, None])[:, None, :, None]
        ((out * weight_out * real).sum() + (joint * weight_s).sum()).backward()
        params = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        return [out * real, joint, *(x.grad for x in leaves), *params]

    got, want = run(True), run(False)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().clamp_min(1e-30)
        assert ((g - w).abs().max() / scale).item() < 1e-10, f"{feature_map}: result {i} differs"


@pytest.mark.parametrize("feature_map", built_in_feature_maps())
def test_every_map_packed_on_the_fused_kernel_equals_the_pytorch_packed_form(causal_extension, monkeypatch, feature_map):
    """Packed sequences (``cu_seqlens``, one state row each) of a map applied before the kernel: the
    outputs, final states and gradients of the fused kernel equal ``packed.py``'s in float64."""
    torch.manual_seed(1)
    layer = LinearAttention(causal=True, query_dim=6, feature_map=feature_map).double()
    h, n, m, c = 2, 41, 5, layer.feature_map.output_dim
    cu = torch.tensor([0, 9, 10, 30, 41])
    q, k, v = torch.randn(1, h, n, 6, dtype=torch.float64), torch.randn(1, h, n, 6, dtype=torch.float64), \
        torch.randn(1, h, n, m, dtype=torch.float64)
    s0, z0 = torch.randn(4, h, c, m, dtype=torch.float64), torch.rand(4, h, c, dtype=torch.float64) * 4
    weight_out, weight_s = torch.randn(1, h, n, m, dtype=torch.float64), torch.randn(4, h, c, m + 1, dtype=torch.float64)

    def run(switch: str):
        monkeypatch.setenv(kernels.SWITCH, switch)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, s0, z0)]
        layer.zero_grad()
        out, state = layer(*leaves[:3], state=tuple(leaves[3:]), return_state=True, cu_seqlens=cu)
        ((out * weight_out).sum() + (state.joint * weight_s).sum()).backward()
        return [out, state.joint, *(x.grad for x in leaves), *(p.grad for p in layer.parameters() if p.grad is not None)]

    got, want = run("causal_attention=cpp"), run("causal_attention=pytorch")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = w.abs().max().clamp_min(1e-30)
        assert ((g - w).abs().max() / scale).item() < 1e-10, f"{feature_map}: result {i} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_forward_returns_the_maps_the_backward_uses(causal_extension, dtype):
    """The forward's phi(q), phi(k) (what autograd keeps for the backward in place of q and k) are
    elu + 1 of the inputs, phi(k) 0 at masked keys and both 0 in C's padding columns (from
    ``features`` on), over two blocks and packed sequences, x down to -100 (exp's clamp)."""
    leaves, _ = inputs(1, 2, 300, 16, 16)  # one row: packed sequences run with B = 1
    q, k, v = (t.to(dtype) for t in leaves[:3])
    q[0, 0, :8, 0] = torch.tensor([-100.0, -87.5, -30.0, -1e-3, 0.0, 1e-3, 20.0, -5.0], dtype=dtype)
    key_lengths = torch.tensor([261])
    for cu_seqlens in (None, torch.tensor([0, 100, 300])):
        *_, phi_q, phi_k = custom_ops.causal_attention_forward(q, k, v, None, None, cu_seqlens, key_lengths, 12, EPS,
                                                               False)
        # exp(min(x, 0)) + max(x, 0): float64's elu(x) + 1 loses exp(x) to cancellation far below 0
        want_q, want_k = (torch.exp(x.double().clamp(max=0)) + x.double().clamp(min=0) for x in (q, k))
        want_k[:, :, 261:] = 0
        want_q[..., 12:], want_k[..., 12:] = 0, 0
        tol = TOLERANCE[dtype]["rtol"]
        torch.testing.assert_close(phi_q.double(), want_q, rtol=tol, atol=1e-30)
        torch.testing.assert_close(phi_k.double(), want_k, rtol=tol, atol=1e-30)
        assert (phi_q[..., :12] > 0).all() and phi_q.dtype == phi_k.dtype == dtype


def test_backward_needs_neither_q_nor_k(causal_extension):
    """q and k changed in place after the forward: the gradients are still those of the values the
    forward saw (autograd holds phi(q), phi(k), and would refuse a changed saved q)."""
    leaves, grads = inputs(1, 2, 280, 16, 32)
    want = results(naive_attention, leaves, grads, torch.float64)
    q, k, v, s0, z0 = (t.detach().float().requires_grad_() for t in leaves)
    outs = fused()(q, k, v, s0, z0)
    with torch.no_grad():
        q.mul_(-3.0), k.add_(1.0)
    torch.autograd.backward(outs, [g.float() for g in grads])
    assert_close([o.detach() for o in outs] + [t.grad for t in (q, k, v, s0, z0)], want, torch.float32)


@pytest.mark.slow  # opcheck traces with AOT autograd: several seconds
@pytest.mark.parametrize("case", ["plain", "state-and-lengths", "packed", "mapped"])
def test_operators_pass_opcheck(causal_extension, case):
    leaves, _ = inputs(1 if case == "packed" else 2, 2, 260, 4, 8, s=3 if case == "packed" else None)
    q, k, v, s0, z0 = (t.requires_grad_() for t in leaves)
    cu_seqlens = torch.tensor([0, 7, 7, 260]) if case == "packed" else None
    key_lengths = torch.tensor([260, 9]) if case == "state-and-lengths" else None
    if case in ("plain", "mapped"):
        s0 = z0 = None
    mapped = case == "mapped"  # q, k taken as phi(q), phi(k): positive, as a map's
    if mapped:
        q, k = (x.detach().exp().requires_grad_() for x in (q, k))
    args = (q, k, v, s0, z0, cu_seqlens, key_lengths, 4, EPS, mapped)
    torch.library.opcheck(custom_ops.causal_attention_forward, args)
    out, den, s_n, z_n, states, z_states, phi_q, phi_k = custom_ops.causal_attention_forward(*args)
    for grad_s, grad_z in ((torch.randn_like(s_n), torch.randn_like(z_n)), (None, None)):
        torch.library.opcheck(custom_ops.causal_attention_backward,
                              (phi_q, phi_k, v.detach(), out.detach(), den, torch.randn_like(out), states, z_states,
                               cu_seqlens, grad_s, grad_z, mapped))


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_a_state_that_does_not_fit_is_a_clear_error(causal_extension, packed):
    """One state row per batch entry, or per packed sequence: anything else names the shapes expected."""
    leaves, _ = inputs(1 if packed else 2, 2, 30, 8, 4, s=3 if packed else None)
    q, k, v, s0, z0 = leaves
    cu_seqlens = torch.tensor([0, 10, 30]) if packed else None  # two sequences, three state rows
    if not packed:
        s0, z0 = s0[:1], z0[:1]
    with pytest.raises(ValueError, match="does not fit these inputs"):
        causal_recurrence.causal_attention(EluFeatureMap(8), q, k, v, None, EPS, None, (s0, z0), False, cu_seqlens)
