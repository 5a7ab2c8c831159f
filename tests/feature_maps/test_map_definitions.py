"""The feature maps beyond the paper (relu, squared_relu, dpfp, taylor, rebased, t2r, hedgehog): each
against its paper's definition written out independently in float64, and every registered map on
every CPU kernel of causal linear attention, in fp32 / bf16 / fp16, against the float64 reference."""

import copy
import math

import pytest
import torch
from conftest import assert_close

import linformer_lab as ll
from linformer_lab.ops import kernels
from linformer_lab.ops.linear_attention import naive

FEATURE_MAPS = ll.list_feature_maps()
#: maps with weights of their own (nn.Parameters), trained with the model
LEARNED = ("hedgehog", "rebased", "t2r")


def _pairs(d=5, n=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, n, d, generator=gen, dtype=torch.float64),
            torch.randn(2, n + 2, d, generator=gen, dtype=torch.float64))


def _similarity(fm, q, k):
    return fm.forward_queries(q) @ fm.forward_keys(k).transpose(-1, -2)


def _perturbed(fm):
    """``fm`` in float64 with its learned weights moved off their initial values (identity, ones,
    zeros), so a definition that ignored one of them would be caught."""
    fm = fm.double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return fm


def _dpfp_by_index(x, nu):
    """Schlag et al. 2021 eq. 37 as written: phi_(i nu + j) = r_i r_(i + j) (indices mod 2D), a loop."""
    r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], dim=-1)
    two_d = r.shape[-1]
    return torch.stack([r[..., i] * r[..., (i + j) % two_d] for i in range(two_d) for j in range(1, nu + 1)], dim=-1)


def _layer_norm_by_hand(x, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def test_relu_and_squared_relu_are_their_definitions():
    q, k = _pairs()
    relu, squared = ll.build_feature_map("relu", query_dim=5), ll.build_feature_map("squared_relu", query_dim=5)
    positive = lambda x: torch.where(x > 0, x, torch.zeros_like(x))  # noqa: E731
    assert_close("relu", positive(q) @ positive(k).transpose(-1, -2), _similarity(relu, q, k), rtol=1e-12, atol=1e-12)
    assert_close("squared_relu", (positive(q) * positive(q)) @ (positive(k) * positive(k)).transpose(-1, -2),
                 _similarity(squared, q, k), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_is_eq_37_up_to_the_order_of_its_features(nu):
    q, k = _pairs()
    fm = ll.build_feature_map("dpfp", query_dim=5, nu=nu)
    assert fm.output_dim == 2 * 5 * nu
    want = _dpfp_by_index(q, nu) @ _dpfp_by_index(k, nu).transpose(-1, -2)
    assert_close(f"dpfp nu={nu}", want, _similarity(fm, q, k), rtol=1e-12, atol=1e-12)
    assert torch.equal(fm(q).sort(-1).values, _dpfp_by_index(q, nu).sort(-1).values)
    with pytest.raises(ValueError, match="nu must be"):
        ll.build_feature_map("dpfp", query_dim=5, nu=10)


def test_taylor_is_exp_to_second_order():
    d = 6
    fm = ll.build_feature_map("taylor", query_dim=d)
    assert fm.output_dim == 1 + d + d * (d + 1) // 2
    q, k = _pairs(d)
    t = torch.einsum("bnd,bld->bnl", q, k) / math.sqrt(d)
    assert_close("taylor", 1 + t + t**2 / 2, _similarity(fm, q, k), rtol=1e-12, atol=1e-12)
    # and it is the series of exp: the remainder is third order in t
    small_q, small_k = 0.05 * q, 0.05 * k
    t = torch.einsum("bnd,bld->bnl", small_q, small_k) / math.sqrt(d)
    remainder = (_similarity(fm, small_q, small_k) - torch.exp(t)).abs()
    assert (remainder <= t.abs() ** 3 / 6 * math.exp(t.abs().max().item()) + 1e-15).all()
    assert (_similarity(fm, 10 * q, 10 * k) >= 0.5 - 1e-12).all()  # ((t + 1)^2 + 1) / 2 >= 1/2


def test_rebased_is_the_squared_dot_product_of_affine_normalised_inputs():
    d = 5
    fm = _perturbed(ll.build_feature_map("rebased", query_dim=d))
    assert fm.output_dim == d * (d + 1) // 2
    q, k = _pairs(d)
    affine = lambda x: (fm.gamma * _layer_norm_by_hand(x, fm.eps) + fm.beta) / d**0.25  # noqa: E731
    want = (affine(q) @ affine(k).transpose(-1, -2)) ** 2
    assert_close("rebased", want, _similarity(fm, q, k), rtol=1e-10, atol=1e-12)


def test_t2r_is_relu_of_a_learned_affine_map_shared_by_queries_and_keys():
    fm = _perturbed(ll.build_feature_map("t2r", query_dim=5, num_features=9))
    assert fm.output_dim == 9
    q, k = _pairs()
    w, b = fm.projection.weight, fm.projection.bias
    features = lambda x: (torch.einsum("fd,bnd->bnf", w, x) + b).clamp_min(0)  # noqa: E731
    assert_close("t2r", features(q) @ features(k).transpose(-1, -2), _similarity(fm, q, k), rtol=1e-12, atol=1e-12)
    assert torch.equal(fm.forward_queries(q), fm.forward_keys(q))  # one map (Kasai et al. eq. 4)


def test_hedgehog_is_a_learned_softmax_pair_with_queries_and_keys_apart():
    fm = ll.build_feature_map("hedgehog", query_dim=5).double()
    q, k = _pairs()
    # identity at initialisation: the features are the softmax of the input and of its negation
    assert_close("hedgehog at init", torch.cat([torch.softmax(q, -1), torch.softmax(-q, -1)], -1),
                 fm.forward_queries(q), rtol=1e-12, atol=1e-12)
    fm = _perturbed(fm)

    def features(x, layer):
        logits = torch.einsum("fd,bnd->bnf", layer.weight, x) + layer.bias
        plus, minus = torch.exp(logits), torch.exp(-logits)
        return torch.cat([plus / plus.sum(-1, keepdim=True), minus / minus.sum(-1, keepdim=True)], -1)

    want = features(q, fm.query_map) @ features(k, fm.key_map).transpose(-1, -2)
    assert_close("hedgehog", want, _similarity(fm, q, k), rtol=1e-12, atol=1e-12)
    assert not torch.equal(fm.forward_queries(q), fm.forward_keys(q))  # separate maps once trained
    assert torch.equal(fm(k), fm.forward_keys(k))


@pytest.mark.parametrize("name", LEARNED)
def test_learned_maps_weights_are_parameters_in_the_models_state_dict(name):
    """A linear model's state dict holds each layer's map weights (a checkpoint restores them); a model
    built from the same attention settings (its hparams, with the map's kwargs) loads them and computes
    the same outputs; the loss's gradient reaches every map weight."""
    kwargs = {"num_features": 6} if name != "rebased" else {}
    config = ll.AttentionConfig(backend="linear", feature_map=name, feature_map_kwargs=kwargs)
    torch.manual_seed(0)
    model = ll.Transformer(2, 16, 2, 32, causal=True, attention=config)
    map_weights = [k for k in model.state_dict() if ".feature_map." in k]
    own = {k for k, _ in model.layers[0].attention.attention.feature_map.named_parameters()}
    assert own and len(map_weights) == 2 * len(own), map_weights
    model = _perturbed(model).float()
    rebuilt = ll.Transformer(2, 16, 2, 32, causal=True, attention=ll.AttentionConfig.coerce(config.to_hparams()))
    rebuilt.load_state_dict(model.state_dict())
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(rebuilt(x), model(x))
    model(x).square().mean().backward()
    for key, p in model.named_parameters():
        if ".feature_map." in key:
            assert p.grad is not None and p.grad.abs().sum() > 0, key


# --------------------------------------------------------------- every map, every CPU kernel, every dtype

def _attention(name, d, dtype):
    """Causal linear attention with map ``name`` (its learned weights perturbed) in ``dtype``."""
    torch.manual_seed(1)
    attn = ll.build_attention("linear", causal=True, query_dim=d, feature_map=name)
    _perturbed(attn.feature_map)
    return attn.to(dtype)


def _float64_copy(fm):
    return copy.deepcopy(fm).double()


def _reference(attn, q, k, v):
    """Eq. 9 in float64 from the similarity matrix of the map's features (the map's weights as the
    attention has them, rounded to its dtype)."""
    fm = _float64_copy(attn.feature_map)
    similarity = naive.kernel_similarity(fm.forward_queries(q.double()), fm.forward_keys(k.double()))
    return naive.attention_from_similarity(similarity, v.double(), causal=True, eps=attn.eps)


def _inputs(dtype, d=8, n=21, scale=1.0, seed=2, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(2, 3, n, d, generator=gen) for _ in range(2))
    v = torch.randn(2, 3, n, 5, generator=gen)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def _cpu_causal_kernels():
    q = torch.zeros(1, 1, 2, 2)
    return [c.name for c in kernels.CANDIDATES["causal"] if c.applies(q, q, q)]


@pytest.mark.parametrize("kernel", _cpu_causal_kernels())
@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_every_map_on_every_cpu_kernel_matches_float64_with_gradients(name, kernel, monkeypatch):
    """fp32 on each CPU candidate of the causal op: outputs and the gradients of q, k, v and of the
    map's own weights against autograd of the float64 O(N^2) form."""
    monkeypatch.setenv(kernels.SWITCH, f"causal={kernel}")
    attn = _attention(name, d=8, dtype=torch.float32)
    q, k, v = _inputs(torch.float32, requires_grad=True)
    out = attn(q, k, v)
    reference_map = _float64_copy(attn.feature_map)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive.attention_from_similarity(
        naive.kernel_similarity(reference_map.forward_queries(leaves[0]), reference_map.forward_keys(leaves[1])),
        leaves[2], causal=True, eps=attn.eps)
    assert_close(f"{name} on {kernel}", ref, out, rtol=1e-4, atol=1e-5)
    grad_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, [q, k, v, *attn.feature_map.parameters()], grad_out.float())
    want = torch.autograd.grad(ref, [*leaves, *reference_map.parameters()], grad_out)
    for label, g, w in zip(["q", "k", "v"] + [n for n, _ in reference_map.named_parameters()], got, want):
        # relative to the whole gradient: single entries near zero carry fp32 rounding of their larger terms
        error = ((g.double() - w).norm() / w.norm()).item()
        assert error < 1e-4, f"{name} on {kernel}: gradient of {label}: relative error {error:.3g}"


@pytest.mark.parametrize("mode", ["half_inputs", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_every_map_in_half_precision_is_finite_and_close(name, dtype, mode):
    """q, k, v standard normal (the scale of the attention suite), forward and RNN step: no inf or
    NaN, and within a few of the dtype's rounding units of float64 on the same half-rounded inputs.
    fp16 under CPU autocast is not a PyTorch mode; half inputs cover it."""
    if mode == "autocast" and dtype == torch.float16:
        pytest.skip("CPU autocast runs bfloat16 only")
    attn = _attention(name, d=8, dtype=torch.float32)
    q, k, v = (t.to(dtype) for t in _inputs(torch.float32))
    if mode == "autocast":
        with torch.autocast("cpu", dtype=dtype):
            out = attn(q.float(), k.float(), v.float())
            step_out, _ = attn.step(q[:, :, 0].float(), k[:, :, 0].float(), v[:, :, 0].float())
    else:
        attn = attn.to(dtype)
        out = attn(q, k, v)
        step_out, _ = attn.step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
        assert out.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(step_out).all(), name
    ref = _reference(attn, q, k, v)
    error = ((out.double() - ref).norm() / ref.norm()).item()
    assert error < (0.05 if dtype == torch.bfloat16 else 0.01), error
    torch.testing.assert_close(step_out.double(), out[:, :, 0].double(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["dpfp", "hedgehog", "rebased", "relu", "sigmoid", "squared_relu", "t2r", "taylor"])
def test_maps_beyond_the_paper_stay_finite_at_four_times_the_scale(name, dtype):
    """Half inputs of 4 standard deviations: the products of taylor, rebased and dpfp (and the
    fourth powers of squared_relu in the kernel) stay within fp16's range, hedgehog's softmax is
    bounded; the attention has no inf or NaN and stays near float64."""
    attn = _attention(name, d=8, dtype=dtype)
    q, k, v = (t.to(dtype) for t in _inputs(torch.float32, scale=4.0))
    out = attn(q, k, v)
    assert torch.isfinite(out).all(), name
    ref = _reference(attn, q, k, v)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.05


def _triton_device() -> str | None:
    """Where the Triton chunk kernels run in this process: the CPU under Triton's interpreter (set
    by tests/conftest.py without a GPU), a CUDA GPU, or None (no Triton)."""
    try:
        from linformer_lab.ops.cuda.triton_chunk import launch
    except ImportError:
        return None
    if launch.interpreting():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in FEATURE_MAPS if m not in ("elu", "poly2")])  # those two: tests/ops
def test_every_map_through_the_triton_chunk_kernel(name):
    """The GPU candidate of the causal attention op (``ops/cuda/triton_chunk/backend.py``), which fuses
    elu alone and applies any other map before its kernels: outputs, the final state and the gradients
    of q, k, v and the map's weights equal the op's PyTorch reference (under Triton's interpreter on a
    machine without a GPU). A map wider than the kernels take (random_fourier's 512 features) is refused
    in one line: the op gives it to its PyTorch candidate (``tests/ops/test_triton_chunk.py``)."""
    device = _triton_device()
    if device is None:
        pytest.skip("needs Triton")
    from linformer_lab.ops.cuda.triton_chunk import backend, op

    attention = _attention(name, d=4, dtype=torch.float32).to(device)
    assert not backend.fuses(attention.feature_map)
    # one row of 21 positions: two chunks of the interpreter's 16, each program run in Python
    q, k, v = (t[:1, :1].to(device).requires_grad_() for t in _inputs(torch.float32, d=4, n=21))
    if attention.feature_map.output_dim > op.MAX_WIDTH:
        with pytest.raises(ValueError, match=f"must each be at most {op.MAX_WIDTH}"):
            backend.causal_attention(attention.feature_map, q, k, v)
        return
    results = []
    for run in (backend.causal_attention, kernels.fallback("causal_attention").run):
        out, state = run(attention.feature_map, q, k, v, None, attention.eps, attention.causal_dot_product, None, True)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], device=device)).sum() + state[0].sum(),
                                    [q, k, v, *attention.feature_map.parameters()])
        results.append((out, state[0], *grads))
    labels = ["out", "state", "q", "k", "v"] + [n for n, _ in attention.feature_map.named_parameters()]
    assert len(labels) == len(results[0])
    for label, got, want in zip(labels, *results):
        error = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert error < 1e-4, f"{name}: {label}: relative error {error:.3g}"


def test_sigmoid_is_its_definition_and_bounded():
    q, k = _pairs()
    fm = ll.build_feature_map("sigmoid", query_dim=5)
    logistic = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    assert_close("sigmoid", logistic(q) @ logistic(k).transpose(-1, -2), _similarity(fm, q, k), rtol=1e-12, atol=1e-12)
    features = fm(50 * q)
    assert ((features >= 0) & (features <= 1)).all()
