"""State in and out of the parallel form (issue: prefill, carried state, packed sequences): the ops,
the backends, packed sequences, half precision. Through the models and segmented training:
``test_state_models.py``.

References are float64 and independent of the code under test: one forward over the whole
sequence through the O(N^2) similarity form, and for the initial state the recurrence of eq.
10-12 written with an explicit (N, C, M) cumulative sum.
"""

import pytest
import torch
from conftest import assert_close
from test_attention import CONFIGS, _build, _inputs, _reference

import linformer_lab as ll
from linformer_lab.ops.kernels import causal_dot_product
from linformer_lab.ops.linear_attention import (
    causal_linear_attention,
    dot_product_with_state,
    naive,
)
from linformer_lab.ops.state import KVCache

LINEAR = [(b, fm) for b, fm in CONFIGS if b == "linear"]
STATEFUL = [(b, fm) for b, fm in CONFIGS if ll.registry.ATTENTION.get(b).supports_state]


def _id(config):
    backend, fm = config
    return backend if fm is None else f"{backend}/{fm}"


def recurrence_reference(phi_q, phi_k, v, s0, z0, eps):
    """Eq. 10-12 from (S_0, Z_0): every S_i as an explicit (B, H, N, C, M) tensor. Returns
    ``(out, S_N, Z_N)``."""
    s = s0.unsqueeze(2) + torch.einsum("bhnc,bhnm->bhncm", phi_k, v).cumsum(2)
    z = z0.unsqueeze(2) + phi_k.cumsum(2)
    out = torch.einsum("bhnc,bhncm->bhnm", phi_q, s) / (torch.einsum("bhnc,bhnc->bhn", phi_q, z).unsqueeze(-1) + eps)
    return out, s[:, :, -1], z[:, :, -1]


def _segments(n, cuts):
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


# ------------------------------------------------------------------------------------------------
# ops: the chunked Function and the composition used for the CUDA kernel
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 4, 8, 29])
def test_causal_dot_product_initial_and_final_state_gradcheck(chunk):
    """Values against the explicit recurrence; all gradients (into S_0 too, and from S_N back)
    by gradcheck, for chunks that divide N, do not divide it, and cover it whole."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.rand(2, 2, 13, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 13, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    s0 = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    out, final = causal_dot_product(q, k, v, chunk, s0, True)
    want_s = s0.unsqueeze(2) + torch.einsum("bhnc,bhnm->bhncm", k, v).cumsum(2)
    assert_close("numerator", torch.einsum("bhnc,bhncm->bhnm", q, want_s), out, 1e-12, 1e-12)
    assert_close("final state", want_s[:, :, -1], final, 1e-12, 1e-12)
    assert torch.autograd.gradcheck(lambda *x: causal_dot_product(*x[:3], chunk, x[3], True), (q, k, v, s0))
    assert torch.autograd.gradcheck(lambda *x: causal_dot_product(*x[:3], chunk, x[3]), (q, k, v, s0))
    assert torch.autograd.gradcheck(lambda *x: causal_dot_product(*x, chunk, None, True)[1], (q, k, v))


def test_empty_sequence_passes_the_state_through():
    s0 = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    z0 = torch.rand(1, 2, 3, dtype=torch.float64)
    empty = torch.zeros(1, 2, 0, 3, dtype=torch.float64)
    out, (s, z) = causal_linear_attention(empty, empty, torch.zeros(1, 2, 0, 4, dtype=torch.float64),
                                          initial_state=(s0, z0), return_state=True)
    assert out.shape == (1, 2, 0, 4)
    assert torch.equal(s, s0) and torch.equal(z, z0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_state_composition_around_a_stateless_kernel(dtype):
    """dot_product_with_state (how linear_cuda's kernel gets a state) around a stateless
    numerator equals the native chunked state path, values and gradients into S_0, k, v."""
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.rand(2, 3, 21, 5, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(2, 3, 21, 6, generator=gen, dtype=torch.float64).to(dtype)
    s0 = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    g_out = torch.randn(2, 3, 21, 6, generator=gen, dtype=torch.float64).to(dtype)
    g_final = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        state = s0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
        out, final = fn(*leaves, state)
        torch.autograd.backward([out, final], [g_out, g_final.to(final.dtype)])
        return [out, final, *(t.grad for t in leaves), state.grad]

    stateless = lambda a, b, c: naive.causal_dot_product_naive(a.double(), b.double(), c.double()).to(a.dtype)  # noqa: E731
    got = run(lambda a, b, c, s: dot_product_with_state(stateless, a, b, c, s, True))
    want = run(lambda a, b, c, s: causal_dot_product(a, b, c, 8, s, True))
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    for name, w, g in zip(("out", "final", "grad q", "grad k", "grad v", "grad S0"), want, got):
        assert_close(f"{dtype} {name}", w, g, tol, tol * 10)


# ------------------------------------------------------------------------------------------------
# backends: parallel -> state -> step, parallel -> state -> parallel
# ------------------------------------------------------------------------------------------------


def _qkv(backend, n=29, seed=0):
    shared = ll.registry.ATTENTION.get(backend).shares_query_key
    return _inputs(n=n, seed=seed, shared_qk=shared)


@pytest.mark.parametrize("config", STATEFUL, ids=_id)
@pytest.mark.parametrize("prefix", [0, 1, 8, 17])
def test_prefill_then_step_equals_one_forward(config, prefix):
    """forward(prefix, return_state) -> step over the rest == the causal forward over the whole
    sequence (float64 O(N^2) reference); lsh: each step equals the forward over its prefix."""
    backend, fm = config
    attn = _build(backend, fm, causal=True, d=6)
    q, k, v = _qkv(backend)
    with torch.no_grad():
        out, state = attn(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix], return_state=True) if prefix else (None, None)
        steps = []
        for t in range(prefix, q.shape[2]):
            o, state = attn.step(q[:, :, t], k[:, :, t], v[:, :, t], state)
            steps.append(o)
    got = torch.stack(steps, dim=2)
    if attn.has_recurrent_form:
        assert_close(f"{_id(config)} prefill {prefix}", _reference(attn, q, k, v, True)[:, :, prefix:], got)
    else:
        for t in range(prefix, q.shape[2]):
            full = _reference(attn, q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], True)
            assert_close(f"{_id(config)} step {t}", full[:, :, -1], got[:, :, t - prefix])


@pytest.mark.parametrize("config", STATEFUL, ids=_id)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cuts", [[8], [4, 12, 16], [1, 28], [10, 11]])
def test_segments_with_carried_state_equal_one_forward(config, causal, cuts):
    """Segments with the state carried == one forward over the whole sequence: the values of
    the last segment (all segments for backends with a recurrent form and causal attention)
    and the gradients of q, k, v. Cuts at 4, 8, 12, 16 fall on the chunk edges of chunk_size 4
    (set below), the others inside chunks."""
    backend, fm = config
    attn = _build(backend, fm, causal=causal, d=6)
    if hasattr(attn, "chunk_size"):
        attn.chunk_size = 4
    q, k, v = (t.clone().requires_grad_(True) for t in _qkv(backend))
    want = _reference(attn, q, k, v, causal)
    state, outs = None, []
    for a, b in _segments(q.shape[2], cuts):
        out, state = attn(q[:, :, a:b], q[:, :, a:b] if attn.shares_query_key else k[:, :, a:b], v[:, :, a:b],
                          state=state, return_state=True)
        outs.append(out)
    last = cuts[-1]
    # non-causal attention over segments sees only earlier segments: only the last one has
    # seen every key; lsh's outputs depend on later positions, so earlier segments differ too
    exact_all = causal and attn.has_recurrent_form
    got, ref = (torch.cat(outs, 2), want) if exact_all else (outs[-1], want[:, :, last:])
    assert_close(f"{_id(config)} values", ref, got)
    g = torch.randn_like(ref)
    grads_got = torch.autograd.grad(got, (q, v) if attn.shares_query_key else (q, k, v), g)
    grads_want = torch.autograd.grad(ref, (q, v) if attn.shares_query_key else (q, k, v), g)
    for name, w, x in zip("qkv" if not attn.shares_query_key else "qv", grads_want, grads_got):
        assert_close(f"{_id(config)} grad {name}", w, x)


@pytest.mark.parametrize("config", LINEAR, ids=_id)
def test_gradient_into_the_initial_state(config):
    """With a given initial state (S_0, Z_0): outputs, final state and the gradients of q, k,
    v, S_0 and Z_0 against autograd of the explicit recurrence."""
    backend, fm = config
    attn = _build(backend, fm, causal=True, d=6)
    attn.chunk_size = 8
    q, k, v = (t.clone().requires_grad_(True) for t in _inputs(n=21, seed=3))
    with torch.no_grad():
        c = attn.feature_map.forward_keys(k[:, :, :1]).shape[-1]
    gen = torch.Generator().manual_seed(4)
    s0 = torch.randn(2, 3, c, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(2, 3, c, generator=gen, dtype=torch.float64) + 1).requires_grad_(True)
    out, (s, z) = attn(q, k, v, state=(s0, z0), return_state=True)
    phi_q, phi_k = attn.feature_map.forward_queries(q), attn.feature_map.forward_keys(k)
    want_out, want_s, want_z = recurrence_reference(phi_q, phi_k, v, s0, z0, attn.eps)
    for name, w, g in (("out", want_out, out), ("S", want_s, s), ("Z", want_z, z)):
        assert_close(f"{_id(config)} {name}", w, g)
    gens = [torch.randn_like(t) for t in (out, s, z)]
    leaves = (q, k, v, s0, z0)
    got = torch.autograd.grad([out, s, z], leaves, gens)
    want = torch.autograd.grad([want_out, want_s, want_z], leaves, gens)
    for name, w, g in zip(("q", "k", "v", "S0", "Z0"), want, got):
        assert_close(f"{_id(config)} grad {name}", w, g)


@pytest.mark.parametrize("config", STATEFUL, ids=_id)
def test_padding_does_not_enter_the_returned_state(config):
    """With key_lengths, the returned state continues each row exactly like the state of its
    unpadded sequence: stepping on from either gives the same outputs."""
    backend, fm = config
    attn = _build(backend, fm, causal=True, d=6)
    q, k, v = _qkv(backend, n=12)
    # garbage in the padding: it must not matter
    lengths = torch.tensor([12, 12] if backend == "lsh" else [12, 7])
    with torch.no_grad():
        rest = _qkv(backend, n=5, seed=9)
        for row in range(2):
            # made anew per row: steps without autograd update a state in place
            _, padded = attn(q, k, v, key_lengths=lengths, return_state=True)
            n = int(lengths[row])
            one = (q[row : row + 1, :, :n], k[row : row + 1, :, :n], v[row : row + 1, :, :n])
            _, alone = attn(*one, return_state=True)
            state_padded, state_alone = padded, alone
            for t in range(5):
                step = [x[:, :, t] for x in rest]
                out_padded, state_padded = attn.step(*step, state_padded)
                out_alone, state_alone = attn.step(*[x[row : row + 1] for x in step], state_alone)
                assert_close(f"{_id(config)} row {row} step {t}", out_alone, out_padded[row : row + 1])
        if isinstance(padded, tuple) and not isinstance(padded, KVCache):  # linear: compare the states themselves
            _, (s_alone, z_alone) = attn(q[1:, :, :7], k[1:, :, :7], v[1:, :, :7], return_state=True)
            _, (s_pad, z_pad) = attn(q, k, v, key_lengths=lengths, return_state=True)
            assert_close("S of the short row", s_alone, s_pad[1:])
            assert_close("Z of the short row", z_alone, z_pad[1:])


# ------------------------------------------------------------------------------------------------
# packed sequences
# ------------------------------------------------------------------------------------------------

PACKED = [(b, fm) for b, fm in CONFIGS if ll.registry.ATTENTION.get(b).supports_packed]


@pytest.mark.parametrize("config", PACKED, ids=_id)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_sequences_equal_each_sequence_alone(config, causal):
    backend, fm = config
    attn = _build(backend, fm, causal=causal, d=6)
    lengths = [5, 1, 12, 7]
    q, k, v = (t[:1].clone().requires_grad_(True) for t in _inputs(n=sum(lengths), seed=5))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = attn(q, k, v, cu_seqlens=offsets)
    want = torch.cat([_reference(attn, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal)
                      for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())], dim=2)
    assert_close(f"{_id(config)} packed", want, got)
    g = torch.randn_like(want)
    for name, w, x in zip("qkv", torch.autograd.grad(want, (q, k, v), g), torch.autograd.grad(got, (q, k, v), g)):
        assert_close(f"{_id(config)} packed grad {name}", w, x)


@pytest.mark.parametrize("config", LINEAR, ids=_id)
def test_packed_linear_states_are_per_sequence(config):
    backend, fm = config
    attn = _build(backend, fm, causal=True, d=6)
    lengths = [4, 9, 3]
    q, k, v = (t[:1] for t in _inputs(n=sum(lengths), seed=6))
    offsets = torch.tensor([0, 4, 13, 16])
    _, (s, z) = attn(q, k, v, cu_seqlens=offsets, return_state=True)
    assert s.shape[0] == 3
    for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        _, (s_i, z_i) = attn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], return_state=True)
        assert_close(f"sequence {i} S", s_i, s[i : i + 1])
        assert_close(f"sequence {i} Z", z_i, z[i : i + 1])


def test_packed_input_errors():
    attn = ll.build_attention("linear", causal=True, query_dim=4)
    q = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="rise strictly from 0 to T = 10"):
        attn(q, q, q, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="not both"):
        attn(q, q, q, cu_seqlens=torch.tensor([0, 10]), key_lengths=torch.tensor([10]))
    with pytest.raises(ValueError, match="one row"):
        attn(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), cu_seqlens=torch.tensor([0, 10]))
    lsh = ll.build_attention("lsh", causal=True, query_dim=4)
    with pytest.raises(ValueError, match="does not take packed sequences.*'linear', 'linear_cuda', 'softmax'"):
        lsh(q, q, q, cu_seqlens=torch.tensor([0, 10]))


@pytest.mark.parametrize("backend", ["softmax", "lsh"])
def test_forward_state_of_another_shape_is_refused(backend):
    """A KV cache whose batch, heads, key dim or value dim differ from the new positions' is a
    one-line error naming the backend and the expected shapes, not a torch.cat failure."""
    attn = _build(backend, None, causal=True, d=6)
    q, k, v = _inputs(n=5, shared_qk=backend == "lsh")  # (2, 3, 5, 6), values (2, 3, 5, 5)
    _, state = attn(q, k, v, return_state=True)
    fewer_heads = KVCache(state.keys[:, :2], state.values[:, :2])
    smaller_keys = KVCache(state.keys[..., :4], state.values)
    smaller_values = KVCache(state.keys, state.values[..., :4])
    for bad in (fewer_heads, smaller_keys, smaller_values):
        with pytest.raises(ValueError, match=rf"^{type(attn).__name__}: state must be the KVCache of keys "
                                             r"\(B, H, T, 6\) and values \(B, H, T, 5\) with B, H = \(2, 3\)"):
            attn(q, k, v, state=bad)


# ------------------------------------------------------------------------------------------------
# half precision
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["linear", "softmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_segmented_half_precision_matches_float64(backend, dtype):
    """bf16/fp16 segments with the state carried stay as close to the float64 one-pass
    reference (computed from the same rounded inputs) as the one-pass half forward does:
    documented tolerance 3e-2 relative to the largest output (fp32 state accumulation)."""
    attn = _build(backend, "elu" if backend == "linear" else None, causal=True, d=8).to(torch.float32)
    if backend == "linear":
        attn.chunk_size = 16
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 100, 8, generator=gen).to(dtype) for _ in range(3))
    want = _reference(attn.double(), q.double(), k.double(), v.double(), True)
    attn.float()
    state, outs = None, []
    for a, b in _segments(100, [16, 37, 64]):
        out, state = attn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state=state, return_state=True)
        outs.append(out)
    got = torch.cat(outs, 2)
    assert got.dtype == dtype
    scale = want.abs().max()
    assert (got.double() - want).abs().max() / scale < 3e-2
    with torch.no_grad():  # and the steps after a half-precision prefill
        _, state = attn(q[:, :, :50], k[:, :, :50], v[:, :, :50], return_state=True)
        for t in range(50, 60):
            o, state = attn.step(q[:, :, t], k[:, :, t], v[:, :, t], state)
            assert (o.double() - want[:, :, t]).abs().max() / scale < 3e-2
