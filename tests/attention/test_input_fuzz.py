"""Property-based fuzzing of the attention API's input checks (issue 43): random tensor shapes,
dtypes, NaN / inf values, empty dimensions and non-tensors given to every built-in backend's
``forward`` and ``step`` (built by ``build_attention``) end either in a result of the documented
shape and dtype, finite where the inputs are, or in one ValueError / TypeError whose message is
one line naming the problem: never another exception, a hang, or output of the wrong shape."""

from __future__ import annotations

import pytest
import torch
from conftest import built_in_attention
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import linformer_lab as ll

BACKENDS = [name for name in built_in_attention() if name != "linear_cuda" or torch.cuda.is_available()]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]
FUZZ = settings(max_examples=40, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw, dims: int | None = None, dtype=None):
    """A tensor of ``dims`` dimensions (random: 0 to 5) of sizes 0 to 4, of ``dtype`` (random), whose
    values may hold NaN or inf; or, now and then, not a tensor at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from([None, 3, [1.0, 2.0], "q"]))
    ndim = dims if dims is not None else draw(st.integers(0, 5))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    dtype = dtype or draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if x.numel() and draw(st.booleans()):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return x.to(dtype) if dtype != torch.bool else x > 0


@st.composite
def attention_calls(draw):
    """(backend, causal, query_dim, q, k, v, key_lengths): well-formed inputs (values with NaN or
    inf now and then, an empty sequence), or one of q, k, v replaced by anything, or all three."""
    backend = draw(st.sampled_from(BACKENDS))
    dtype = draw(st.sampled_from(DTYPES[:4]))
    b, h, d, m = (draw(st.sampled_from([1, 1, 2, 3, 0])) for _ in range(4))  # now and then an empty dimension
    n = draw(st.integers(0, 5))
    q = _shaped(draw, (b, h, n, d), dtype)
    k = q if draw(st.booleans()) else _shaped(draw, (b, h, n, d), dtype)
    v = _shaped(draw, (b, h, n, m), dtype)
    broken = draw(st.sampled_from(["none", "none", "q", "k", "v", "all"]))
    if broken in ("q", "all"):
        q = draw(tensors())
    if broken in ("k", "all"):
        k = draw(tensors())
    if broken in ("v", "all"):
        v = draw(tensors())
    key_lengths = None
    if draw(st.booleans()):
        key_lengths = draw(st.one_of(st.builds(lambda seed: torch.randint(0, n + 2, (b,), generator=torch.Generator()
                                                                           .manual_seed(seed)), st.integers(0, 99)),
                                     st.just(torch.full((b,), n)), tensors(1), tensors()))
    query_dim = draw(st.sampled_from([d, d, d + 1, None]))
    feature_map = draw(st.sampled_from([None, *ll.list_feature_maps()])) if ll.ATTENTION.get(backend).uses_feature_map else None
    return (backend, feature_map), draw(st.booleans()), query_dim, q, k, v, key_lengths


def _shaped(draw, shape, dtype):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if x.numel() and draw(st.integers(0, 3)) == 0:
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
    return x.to(dtype)


def _build(backend: tuple[str, str | None], causal: bool, query_dim):
    name, feature_map = backend
    kwargs = {"bucket_size": 2, "n_buckets": 2} if name == "lsh" else {}
    try:
        return ll.build_attention(name, causal=causal, query_dim=query_dim, feature_map=feature_map, **kwargs)
    except ValueError as err:  # lsh without query_dim, say: a refusal of the same kind
        _assert_one_line(err)
        return None


def _assert_one_line(err: Exception, backend=None) -> None:
    """One line, naming the backend that refused (its class, or its registered name)."""
    message = str(err)
    assert message.strip() and "\n" not in message, f"{type(err).__name__} of more than one line: {message!r}"
    if backend is not None:
        assert type(backend).__name__ in message or any(name in message for name in BACKENDS), message


def _finite(*xs) -> bool:
    return all(not isinstance(x, torch.Tensor) or not x.is_floating_point() or bool(torch.isfinite(x).all()) for x in xs)


@pytest.mark.timeout(120)
@FUZZ
@given(call=attention_calls())
@example(call=(("softmax", None), False, 2, torch.zeros(0, 1, 2, 2), torch.zeros(0, 1, 2, 2), torch.zeros(0, 1, 2, 2),
               torch.zeros(0, dtype=torch.int64)))  # an empty batch with its (empty) key_lengths: a RuntimeError once
@example(call=(("softmax", None), False, 1, torch.zeros(1, 0, 2, 1), torch.zeros(1, 0, 2, 1), torch.zeros(1, 0, 2, 1),
               None))  # no heads: torch's CPU kernel killed the process (a floating-point exception) once
def test_forward_gives_a_result_or_one_line_naming_the_problem(call):
    backend, causal, query_dim, q, k, v, key_lengths = call
    attn = _build(backend, causal, query_dim)
    if attn is None:
        return
    try:
        out = attn(q, k, v, key_lengths=key_lengths)
    except (ValueError, TypeError) as err:
        _assert_one_line(err, attn)
        return
    # a result: (B, H, N, M) in the inputs' dtype, finite where every input is
    assert isinstance(out, torch.Tensor) and out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    if _finite(q, k, v) and q.dtype in (torch.float32, torch.float64) and key_lengths is None:
        assert bool(torch.isfinite(out).all()), f"{backend}: non-finite output from finite inputs"


def _first_position(x):
    """A 4-d input's first position ``(B, H, dim)``; anything else as it is (a malformed step input)."""
    return x[:, :, 0] if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[2] else x


@st.composite
def step_calls(draw):
    backend, _, query_dim, q, k, v, _ = draw(attention_calls())
    return backend, query_dim, _first_position(q), _first_position(k), _first_position(v)


@pytest.mark.timeout(120)
@FUZZ
@given(call=step_calls())
def test_step_gives_a_result_or_one_line_naming_the_problem(call):
    backend, query_dim, q_t, k_t, v_t = call
    attn = _build(backend, True, query_dim)
    if attn is None:
        return
    try:
        out, state = attn.step(q_t, k_t, v_t)
        out2, _ = attn.step(q_t, k_t, v_t, state)
    except (ValueError, TypeError) as err:
        _assert_one_line(err, attn)
        return
    assert out.shape == out2.shape == (*q_t.shape[:2], v_t.shape[-1]) and out.dtype == q_t.dtype
