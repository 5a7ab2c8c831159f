"""Feature maps: each kernel phi(q)^T phi(k) against the kernel it claims to compute."""

import math
import re

import pytest
import torch
from conftest import assert_close

import linformer_lab as ll
from linformer_lab.feature_maps import FeatureMap
from linformer_lab.feature_maps.base import KernelForm
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.ops.linear_attention import computed_in, elu_plus_one, naive
from linformer_lab.ops.reference import polynomial_similarity


@pytest.mark.parametrize("name", ll.list_feature_maps())
def test_every_feature_map_builds_with_declared_output_dim(name):
    fm = ll.build_feature_map(name, query_dim=6)
    assert isinstance(fm, FeatureMap)
    x = torch.randn(2, 3, 5, 6)
    out = fm(x)
    assert out.shape == (2, 3, 5, fm.output_dim)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="query_dim=6"):
        fm(torch.randn(2, 7))


@pytest.mark.parametrize("name", ["random_fourier", "favor", "t2r", "hedgehog"])
@pytest.mark.parametrize("num_features", [0, -3, 2.5, True, "8"])
def test_a_bad_num_features_is_named_in_one_line(name, num_features):
    with pytest.raises(ValueError, match=rf"^num_features must be an integer >= 1.*, got {re.escape(repr(num_features))}$"):
        ll.build_feature_map(name, query_dim=6, num_features=num_features)


def test_feature_map_names_include_the_builtins():
    assert {"elu", "poly2", "random_fourier", "favor"} <= set(ll.list_feature_maps())
    assert ll.list_feature_maps() == sorted(ll.list_feature_maps())


def test_elu_matches_definition_and_stays_positive_in_half_precision():
    fm = ll.build_feature_map("elu", query_dim=4)
    x = torch.linspace(-30, 30, 121, dtype=torch.float64).reshape(-1, 1).expand(-1, 4)
    torch.testing.assert_close(fm(x), torch.nn.functional.elu(x) + 1)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.full((3, 4), -20.0, dtype=dtype)
        out = fm(x)
        assert out.dtype == dtype
        assert torch.isfinite(out).all() and (out > 0).all(), f"{dtype}: {out}"
    # the naive formula really does cancel to zero in bf16, which is why we avoid it
    x = torch.full((3, 4), -20.0, dtype=torch.bfloat16)
    assert (torch.nn.functional.elu(x) + 1 == 0).all()
    x = torch.tensor([-20.0, -1.0, 0.5], requires_grad=True)
    fm_scalar = ll.build_feature_map("elu", query_dim=3)
    fm_scalar(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([math.exp(-20.0), math.exp(-1.0), 1.0]))


def test_elu_gradients_are_autograds_of_the_definition_to_second_order():
    """EluPlusOne's written-out backward (min(phi, 1)) against float64 autograd of elu(x) + 1 and of
    elu_plus_one (the one Python phi), first and second order, at points on both sides of 0 and far
    out where exp(x) of the unused branch overflows; gradcheck/gradgradcheck of the map itself; and
    elu_plus_one gives the map's values bit for bit."""
    fm = ll.build_feature_map("elu", query_dim=5)
    x = torch.tensor([[-40.0, -3.0, -0.2, 0.3, 100.0], [-1.0, 0.01, -0.01, 5.0, 1000.0]], dtype=torch.float64,
                     requires_grad=True)
    weights = torch.randn(2, 5, dtype=torch.float64)
    for phi in (fm, lambda t: torch.nn.functional.elu(t) + 1, elu_plus_one):
        (grad,) = torch.autograd.grad((phi(x) * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), x)
        if phi is fm:
            ours = grad.detach(), second
        else:
            torch.testing.assert_close(ours[0], grad.detach(), rtol=1e-12, atol=0)
            torch.testing.assert_close(ours[1], second, rtol=1e-12, atol=0)
    assert torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fm, (x,)) and torch.autograd.gradgradcheck(fm, (x,))
    x = torch.cat([torch.randn(999) * 10, torch.tensor([-1e4, -100.0, -0.0, 0.0, 100.0, 1e4])]).reshape(-1, 5)
    assert torch.equal(elu_plus_one(x), fm(x))


@pytest.mark.parametrize("name", ll.list_feature_maps())
def test_each_map_names_the_kernels_that_compute_it(name):
    """One attribute per map class says which kernels apply it themselves: elu in every kernel, the
    learned t2r and hedgehog (with their projections) in generation's C++ step, the others in none."""
    want = {"elu": ("triton", "cpp", "fused_step"), "t2r": ("fused_step",), "hedgehog": ("fused_step",)}
    fm = ll.build_feature_map(name, query_dim=4)
    assert [k for k in ("triton", "cpp", "fused_step") if computed_in(k, fm)] == list(want.get(name, ()))
    if fm.kernel_form is not None:
        assert fm.kernel_form.name == name
        for projection in fm.kernel_form.projections:
            assert isinstance(getattr(fm, projection), torch.nn.Linear)


def test_a_subclass_is_computed_by_no_kernel_unless_it_says_so():
    """A subclass may change the map, which a kernel would skip: it states its own form or has none."""

    class Scaled(EluFeatureMap):
        def forward(self, x):
            return 2 * super().forward(x)

    class Restated(EluFeatureMap):
        kernel_form = KernelForm("elu", kernels=("cpp",))

    assert not any(computed_in(k, Scaled(4)) for k in ("triton", "cpp", "fused_step"))
    assert computed_in("cpp", Restated(4)) and not computed_in("triton", Restated(4))
    assert not computed_in("cpp", "elu")  # a name is not a map


def test_poly2_is_exactly_the_degree_two_polynomial_kernel():
    d = 7
    fm = ll.build_feature_map("poly2", query_dim=d)
    assert fm.output_dim == 1 + d + d * (d + 1) // 2
    q = torch.randn(3, 11, d, dtype=torch.float64)
    k = torch.randn(3, 13, d, dtype=torch.float64)
    kernel = fm(q) @ fm(k).transpose(-1, -2)
    torch.testing.assert_close(kernel, polynomial_similarity(q, k), rtol=1e-12, atol=1e-12)


def _softmax_kernel_error(name: str, num_features: int, seed: int = 0) -> float:
    d = 8
    fm = ll.build_feature_map(name, query_dim=d, num_features=num_features, seed=seed)
    gen = torch.Generator().manual_seed(123)
    # moderate norms: the estimators' variance grows like exp(|q + k|^2 / sqrt(D)), and with
    # large inputs a single heavy-tailed draw can dominate any finite sample
    q = 0.4 * torch.randn(64, d, generator=gen, dtype=torch.float64)
    k = 0.4 * torch.randn(64, d, generator=gen, dtype=torch.float64)
    exact = torch.exp(q @ k.T / math.sqrt(d))  # the softmax kernel the features estimate without bias
    assert fm.exact_kernel(q, k) is None  # an estimate: the map has no closed form of its own
    estimate = fm(q) @ fm(k).T
    return ((estimate - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("name", ["random_fourier", "favor"])
def test_random_features_converge_to_the_softmax_kernel(name):
    errors = [_softmax_kernel_error(name, m) for m in (16, 256, 8192)]
    # Monte-Carlo error shrinks like 1/sqrt(m): 512x more features, ~22x smaller in theory
    assert errors[2] < errors[0] / 4, errors
    assert errors[2] < 0.05, errors
    assert errors[0] > 0.05, errors  # and the check is not vacuous: few features are visibly off


@pytest.mark.parametrize("name", ["random_fourier", "favor"])
def test_random_features_are_seeded_buffers_that_redraw_on_demand(name):
    a = ll.build_feature_map(name, query_dim=5, num_features=12, seed=3)
    b = ll.build_feature_map(name, query_dim=5, num_features=12, seed=3)
    c = ll.build_feature_map(name, query_dim=5, num_features=12, seed=4)
    assert torch.equal(a.projection, b.projection)
    assert not torch.equal(a.projection, c.projection)
    assert "projection" in a.state_dict()  # a checkpoint reproduces the features
    before = a.projection.clone()
    a.redraw()
    assert not torch.equal(before, a.projection)
    restored = ll.build_feature_map(name, query_dim=5, num_features=12, seed=99)
    restored.load_state_dict(b.state_dict())
    x = torch.randn(4, 5)
    torch.testing.assert_close(restored(x), b(x))


def test_orthogonal_draws_are_orthogonal_within_blocks():
    fm = ll.build_feature_map("favor", query_dim=6, num_features=6, orthogonal=True)
    w = fm.projection.double()
    gram = w @ w.T
    off_diagonal = gram - torch.diag(torch.diag(gram))
    assert off_diagonal.abs().max() < 1e-4


def test_favor_features_are_positive_even_for_large_inputs():
    fm = ll.build_feature_map("favor", query_dim=16, num_features=64)
    x = 4 * torch.randn(100, 16)
    assert (fm(x) > 0).all()
    assert (fm.forward_queries(x) > 0).all() and torch.isfinite(fm.forward_queries(x)).all()


# ---------------------------------------------------------------------- random_fourier at scale


def _softmax_attention(q, k, v, causal):
    """Exact softmax attention in float64, the attention the random features estimate."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.double()


def _fourier_attention(causal, d=32, **feature_map_kwargs):
    return ll.build_attention("linear", causal=causal, query_dim=d, feature_map="random_fourier",
                              feature_map_kwargs=feature_map_kwargs)


@pytest.fixture
def fourier_warning_unset(monkeypatch):
    """The unreliable-input warning is given once per process: unset it for one test."""
    from linformer_lab.feature_maps.random_fourier import RandomFourierFeatureMap

    monkeypatch.setattr(RandomFourierFeatureMap, "_warned_unreliable", False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale, dtype", [(3.0, torch.float32), (4.0, torch.float32), (5.0, torch.float64)])
def test_random_fourier_attention_stays_finite_at_large_input_scales(causal, scale, dtype, fourier_warning_unset):
    """q, k, v (1, 2, 32, 32) with q, k of ``scale`` per dimension. The query features leave out
    their factor exp(|q|^2 / (2 sqrt(D))), which cancels: their product with a key's factor
    overflowed float32 from scale ~3 (NaN attention). A key's own factor still overflows float32
    where |k|^2 / sqrt(D) > ~177 (at scale 5 with D = 32 for a quarter of the keys): there float64
    is finite, and the map has warned long before."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 32, generator=gen, dtype=dtype) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="random_fourier"):
        out = _fourier_attention(causal)(scale * q, scale * k, v)
    assert out.dtype == dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale, num_features, tolerance", [(0.25, 256, 0.02), (0.5, 256, 0.25), (0.5, 4096, 0.06)])
def test_random_fourier_attention_is_close_to_softmax_attention_at_small_scales(causal, scale, num_features, tolerance):
    """Relative error against exact softmax attention where the estimate is good (measured at
    D = 32: 0.008 / 0.12 / 0.03): it grows like sinh(|x|^2 / sqrt(D)) / sqrt(num_features)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    attention = _fourier_attention(causal, num_features=num_features)
    exact = _softmax_attention(scale * q, scale * k, v, causal)
    error = ((attention(scale * q, scale * k, v) - exact).norm() / exact.norm()).item()
    assert error < tolerance, error


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_fourier_query_factor_cancels_in_the_attention(causal):
    """The attention with the bounded query features equals the one with the unbiased features
    of the docstring for queries and keys (float64, no eps): the factor is a per-query constant."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    attention = ll.build_attention("linear", causal=causal, query_dim=8, feature_map="random_fourier", eps=0.0)
    fm = attention.feature_map
    assert fm.forward_queries(q).abs().max() <= 1 / math.sqrt(fm.num_features) + 1e-12
    unbiased = naive.attention_from_similarity(fm(q) @ fm(k).transpose(-1, -2), v, causal)
    assert_close(f"random_fourier causal={causal}", unbiased, attention(q, k, v), rtol=1e-9, atol=1e-9)


def test_random_fourier_warns_once_when_the_input_scale_makes_it_unreliable(fourier_warning_unset):
    import warnings

    fm = ll.build_feature_map("random_fourier", query_dim=32, num_features=256)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 32, generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fm(0.25 * x), fm.forward_queries(0.5 * x)  # expected relative error 0.02 / 0.17: quiet
        fm.forward_queries(1.0 * x)  # ~13: warns
        fm(2.0 * x)  # once per process, not at every call or layer
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "random_fourier" in messages[0] and "unreliable" in messages[0]
    assert "num_features=256" in messages[0] and "'favor'" in messages[0]
    assert fm.expected_relative_error(0.0) == 0.0 and fm.expected_relative_error(800.0) < math.inf
