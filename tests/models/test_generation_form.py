"""The one question the generation fast paths ask (linformer_lab.models.generation.form): is this
stack of the paper's form, and if not, why not; each refusal reason on a stack that has just that
one difference from the paper's, and each of the three paths (the Python step, the fused plan,
the graph decoder) following the answer. Then the one Python phi = elu + 1 against torch's elu."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.feature_maps import list_feature_maps
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.feature_maps.learned import T2RFeatureMap
from linformer_lab.models.generation import fast_step, sampling, weight_copies_for_steps, weights
from linformer_lab.models.generation.form import (
    ATTENTION_FORMS,
    LINEAR_FUSED,
    LINEAR_OR_SOFTMAX,
    why_not_paper_form,
)
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.ops.linear_attention import computed_in, elu_plus_one
from linformer_lab.registry import FEATURE_MAPS

D_MODEL, HEADS, D_FF = 16, 4, 32
#: the maps the C++ step computes: those whose class's kernel_form names it
FUSED_STEP_MAPS = [name for name in list_feature_maps() if computed_in("fused_step", FEATURE_MAPS.get(name))]


def _stack(attention="linear", **kwargs) -> Transformer:
    torch.manual_seed(0)
    return Transformer(n_layers=2, d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, attention=attention, **kwargs).double().eval()


class _OwnLayer(TransformerLayer):
    pass


class _OwnAttention(MultiHeadAttention):
    pass


class _OwnT2R(T2RFeatureMap):
    pass


def _learned(feature_map: str, num_features: int | None = None) -> AttentionConfig:
    """Linear attention with ``feature_map``; a learned map with ``num_features`` (elu takes none)."""
    kwargs = {} if feature_map == "elu" else {"num_features": num_features}
    return AttentionConfig("linear", feature_map=feature_map, feature_map_kwargs=kwargs)


def _other_layer(model: Transformer, index: int, attention) -> None:
    model.layers[index] = TransformerLayer(D_MODEL, HEADS, D_FF, attention=attention).double().eval()


def _plain_norm() -> nn.LayerNorm:
    return nn.LayerNorm(D_MODEL, elementwise_affine=False).double()


def _retyped(obj, cls):
    obj.__class__ = cls
    return obj


#: name -> (a stack with one difference from the paper's, the forms that refuse it, the reason's words)
REFUSALS = {
    "layer-subclass": (lambda: _set(_stack(), lambda m: _retyped(m.layers[1], _OwnLayer)),
                       ATTENTION_FORMS, "layer 1: it is a _OwnLayer, not a TransformerLayer"),
    "post-norm": (lambda: _stack(norm_first=False), ATTENTION_FORMS, "layer 0: it is post-norm (norm_first=False)"),
    "norm-without-affine": (lambda: _set(_stack(), lambda m: setattr(m.layers[0], "norm_ff", _plain_norm())),
                            ATTENTION_FORMS, "layer 0: its norms are not LayerNorms with weight and bias"),
    "relu": (lambda: _stack(activation="relu"), ATTENTION_FORMS,
             "layer 0: its feed-forward is Linear-ReLU-Dropout-Linear, not Linear-GELU-Dropout-Linear"),
    "attention-subclass": (lambda: _set(_stack(), lambda m: _retyped(m.layers[0].attention, _OwnAttention)),
                           ATTENTION_FORMS, "layer 0: its attention is a _OwnAttention, not a MultiHeadAttention"),
    "lsh": (lambda: _stack("lsh"), (LINEAR_OR_SOFTMAX, LINEAR_FUSED), "layer 0: it uses LSHAttention"),
    "non-causal-softmax": (lambda: _stack("softmax", causal=False), (LINEAR_OR_SOFTMAX, LINEAR_FUSED),
                           "layer 0: it uses SoftmaxAttention"),
    "softmax": (lambda: _stack("softmax"), (LINEAR_FUSED,),
                "layer 0: it uses SoftmaxAttention, not linear attention with LinearAttention's step"),
    "favor": (lambda: _stack(AttentionConfig("linear", feature_map="favor", feature_map_kwargs={"num_features": 8})),
              (LINEAR_FUSED,), "layer 0: its feature map is Favor"),
    "map-subclass": (lambda: _set(_stack(_learned("t2r")),
                                  lambda m: _retyped(m.layers[0].attention.attention.feature_map, _OwnT2R)),
                     (LINEAR_FUSED,), "layer 0: its feature map is _OwnT2R, not one the fused step computes"),
    "mixed-maps": (lambda: _set(_stack(_learned("t2r")), lambda m: _other_layer(m, 1, _learned("hedgehog"))),
                   (LINEAR_FUSED,), "the layers differ in feature map (HedgehogFeatureMap of 8 features, "
                                    "T2RFeatureMap of 4 features); the fused step takes one"),
    "map-sizes": (lambda: _set(_stack(_learned("t2r")), lambda m: _other_layer(m, 1, _learned("t2r", num_features=6))),
                  (LINEAR_FUSED,), "the layers differ in feature map (T2RFeatureMap of 4 features, T2RFeatureMap of 6"),
    "shared-qk": (lambda: _set(_stack(), lambda m: setattr(m.layers[1].attention, "shares_query_key", True)),
                  (LINEAR_FUSED,), "layer 1: its queries are its keys"),
    "final-norm": (lambda: _set(_stack(), lambda m: setattr(m, "norm", _plain_norm())),
                   ATTENTION_FORMS, "the final norm is not a LayerNorm with weight and bias"),
    "head-sizes": (lambda: _set(_stack(), lambda m: m.layers.__setitem__(
        1, TransformerLayer(D_MODEL, HEADS // 2, D_FF, attention="linear").double().eval())),
                   (LINEAR_FUSED,), "the layers differ in head sizes"),
    "eps": (lambda: _set(_stack(), lambda m: setattr(m.layers[1].attention.attention, "eps", 1e-3)),
            (LINEAR_FUSED,), "the layers differ in attention eps"),
    "gelu-form": (lambda: _set(_stack(), lambda m: setattr(m.layers[1].feedforward[1], "approximate", "tanh")),
                  (LINEAR_FUSED,), "the layers differ in GELU form"),
}


def _set(model, change):
    change(model)
    return model


def test_the_papers_stack_passes_every_form():
    for attention in ATTENTION_FORMS:
        assert why_not_paper_form(_stack(), attention) is None
        for feature_map in FUSED_STEP_MAPS:  # learned ones too
            assert why_not_paper_form(_stack(_learned(feature_map, num_features=3)), attention) is None
    assert why_not_paper_form(_stack("softmax"), LINEAR_OR_SOFTMAX) is None


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_difference_is_refused_with_its_reason(case):
    make, refusing, words = REFUSALS[case]
    model = make()
    for attention in ATTENTION_FORMS:
        why = why_not_paper_form(model, attention)
        if attention in refusing:
            assert why is not None and why.startswith(words), (attention, why)
        else:
            assert why is None, (attention, why)


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="unknown attention form 'fast'; valid choices: any, linear-or-softmax, linear-fused"):
        why_not_paper_form(_stack(), "fast")


@pytest.mark.parametrize("case", [c for c, (_, refusing, _) in REFUSALS.items() if LINEAR_FUSED in refusing and c != "lsh"])
def test_the_fused_plan_builds_no_stack_for_a_refused_stack(case):
    """The C++ step's plan asks the same question: no ``FusedStack`` is built for a stack the
    predicate refuses, one is for the paper's (the builder is a stand-in: no extension needed)."""
    built = []

    def make_stack(*args):
        built.append(args)
        return "stack"

    for model, want in ((_stack(), "stack"), (REFUSALS[case][0](), None)):
        with torch.no_grad(), weight_copies_for_steps(model, "model"):
            plan = weights.fused_plan(model, make_stack)
            assert plan is not None and plan.stack == want
    assert len(built) == 1


def test_the_fused_step_computes_elu_t2r_and_hedgehog():
    assert sorted(FUSED_STEP_MAPS) == ["elu", "hedgehog", "t2r"]


@pytest.mark.parametrize("feature_map", FUSED_STEP_MAPS)
def test_the_fused_plan_passes_the_map_by_name_and_its_weights_after_each_layers(feature_map):
    """``FusedStack`` takes the map's name and, after each layer's twelve tensors, the map's
    ``W (F, D)``, ``b (F)`` as the map holds them (t2r: one pair; hedgehog: queries', then keys')."""
    built = []
    model = _stack(_learned(feature_map, num_features=3))
    with torch.no_grad(), weight_copies_for_steps(model, "model"):
        weights.fused_plan(model, lambda *args: built.append(args) or "stack")
    (tensors, *_, name), = built
    assert name == feature_map
    projections = {"elu": lambda m: (), "t2r": lambda m: (m.projection,), "hedgehog": lambda m: (m.query_map, m.key_map)}
    parameters = [[t for linear in projections[feature_map](layer.attention.attention.feature_map)
                   for t in (linear.weight, linear.bias)] for layer in model.layers]
    per_layer = 12 + len(parameters[0])
    assert len(tensors) == per_layer * len(model.layers) + 2
    for i, wanted in enumerate(parameters):
        got = tensors[i * per_layer + 12:(i + 1) * per_layer]
        assert len(got) == len(wanted) and all(g.data_ptr() == w.data_ptr() for g, w in zip(got, wanted))


@pytest.mark.parametrize("case", ["post-norm", "relu", "layer-subclass", "attention-subclass"])
def test_the_python_step_gives_a_refused_layer_to_its_own_step(case, monkeypatch):
    """fast_step steps a layer that is not of the paper's form through ``TransformerLayer.step``
    (the readable step, right for any layer), and a paper layer without it."""
    for model, refused in ((_stack(), False), (REFUSALS[case][0](), True)):
        calls = []
        for layer in model.layers:
            original = layer.step
            monkeypatch.setattr(layer, "step", lambda *args, original=original: calls.append(1) or original(*args),
                                raising=False)
        x = torch.randn(2, 3, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            state = None
            for t in range(3):
                _, state = fast_step(model, x[:, t], state)
        assert bool(calls) == refused, case


@pytest.mark.parametrize("case", ["post-norm", "relu", "lsh", "final-norm"])
def test_the_graph_decoder_refuses_with_the_reason(case):
    model = REFUSALS[case][0]()
    with pytest.raises(ValueError, match=re.escape(f"decoder='graph' needs static buffers, but {REFUSALS[case][2]}")):
        sampling.choose_decoder("graph", model, torch.device("cpu"))
    assert sampling.choose_decoder("auto", model, torch.device("cuda")) == "dynamic"


# ---------------------------------------------------------------- phi = elu + 1, once


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_elu_plus_one_is_torchs_elu_plus_one(dtype):
    """Against ``F.elu(x) + 1`` in float64 (eq. 7 as written, which rounds at 1 for deep
    negatives) from deep negatives to large positives, within the dtype's rounding; > 0
    everywhere, also where half precision's exp underflows; and the feature map's values bit for bit."""
    x = torch.cat([torch.linspace(-40, 40, 801), torch.tensor([0.0, -0.0, -1e-3, 1e-3])]).to(dtype)
    got = elu_plus_one(x)
    assert got.dtype == dtype
    want = F.elu(x.double()) + 1
    rounding = {torch.float64: 1e-15, torch.float32: 1e-7, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    tiny = torch.finfo(dtype).tiny
    torch.testing.assert_close(got.double(), want.clamp_min(tiny), rtol=rounding, atol=torch.finfo(torch.float64).eps)
    assert bool((got > 0).all())
    with torch.no_grad():
        assert torch.equal(got, EluFeatureMap(x.shape[-1])(x.view(1, 1, -1)).view(-1))


def test_elu_plus_one_makes_no_autograd_graph_and_leaves_its_input():
    x = torch.randn(5, requires_grad=True)
    with torch.no_grad():
        before = x.clone()
        out = elu_plus_one(x)
    assert out.grad_fn is None and torch.equal(x, before)


def test_the_triton_kernels_pytorch_form_reads_the_one_phi(monkeypatch):
    """The Triton kernel's PyTorch form maps with :func:`elu_plus_one`: replaced by a wrong phi, its
    output changes (the Triton and C++ device code keep their own copies, tested against it)."""
    from linformer_lab.ops.cuda.triton_chunk import torch_chunk

    q, k, v = torch.randn(3, 1, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).unbind(0)
    right = torch_chunk.chunk_linear_attention_torch(q, k, v, chunk_size=2)
    monkeypatch.setattr(torch_chunk, "elu_plus_one", lambda t: elu_plus_one(t) ** 2)
    assert not torch.allclose(right, torch_chunk.chunk_linear_attention_torch(q, k, v, chunk_size=2))


def test_the_python_step_reads_the_one_phi(monkeypatch):
    """fast_step's elu features are :func:`elu_plus_one`'s: replaced by a wrong phi, the step changes."""
    from linformer_lab.models.generation import dynamic_step

    model, x = _stack(), torch.randn(2, 2, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, state = fast_step(model, x[:, 0])  # the first step: the backend's own step makes the state
        right, _ = fast_step(model, x[:, 1], [s.clone() for s in state])
        monkeypatch.setattr(dynamic_step, "elu_plus_one", lambda t: elu_plus_one(t) * 2 + 1)
        wrong, _ = fast_step(model, x[:, 1], [s.clone() for s in state])
    assert not torch.allclose(right, wrong)


def test_the_steps_cached_answer_follows_a_replaced_sub_module():
    """The Python step asks the predicate once per layer and keeps the answer (the RNN step's hot
    path); replacing a sub-module after a step makes it ask again, so the answer stays the predicate's."""
    from torch import nn

    from linformer_lab.models.generation.dynamic_step import _is_paper_layer
    from linformer_lab.models.generation.form import ANY_ATTENTION, why_not_paper_layer
    from linformer_lab.models.transformer import Transformer

    layer = Transformer(1, 16, 2, attention="linear", d_ff=32).eval().layers[0]
    assert _is_paper_layer(layer) and _is_paper_layer(layer)
    layer.feedforward[1] = nn.ReLU()
    assert not _is_paper_layer(layer) and why_not_paper_layer(layer, ANY_ATTENTION) is not None
    layer.feedforward[1] = nn.GELU()
    assert _is_paper_layer(layer)
    layer.norm_ff = nn.Identity()
    assert not _is_paper_layer(layer)
