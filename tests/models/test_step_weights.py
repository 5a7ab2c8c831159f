"""The weight copies that the fast RNN-mode step reads (linformer_lab.models.generation) and
``PixelTransformer.generate(step_weights=...)``.

Each format is checked against an independent float64 product of the values it is meant to
use: the model's weights (``model``), bf16-rounded input and weights (``bfloat16``), and the
bf16-rounded input times the dequantized int8 weights (``int8``). The lossy formats are also
bounded against the exact product, and generate() is checked to run exactly the library's
fast step with the copy in place.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from linformer_lab.models.generation import (
    STEP_WEIGHT_FORMATS,
    dynamic_step,
    fast_step,
    generation_kernels,
    quantize_int8,
    step_linear,
    weight_copies_for_steps,
)
from linformer_lab.models.pixel_transformer import PixelTransformer, images_to_sequence

TINY = dict(n_layers=2, n_heads=2, d_model=32, d_ff=64, num_mixtures=3)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


# ---------------------------------------------------------------- int8 quantization
@pytest.mark.parametrize("shape", [(48, 32), (7, 5), (1, 1024), (30, 256)])
def test_int8_quantization_is_within_half_a_step_and_never_clips(shape):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-3, 1, shape[0])[:, None]  # rows of very different size
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= 127
    s = scale.double()[:, None]
    error = (q.double() * s - weight.double()).abs()
    assert bool((error <= s / 2 * (1 + 1e-6)).all())
    # the scale is not wastefully large: the largest weight of each row uses most of the range
    assert bool((q.abs().amax(1) >= 126).all())


def test_int8_quantization_of_a_zero_row():
    weight = torch.randn(3, 16)
    weight[1] = 0
    q, scale = quantize_int8(weight)
    assert bool((q[1] == 0).all()) and float(scale[1]) == 1.0
    assert torch.isfinite(q.float() * scale.float()[:, None]).all()


# ---------------------------------------------------------------- step_linear per format
def _reference(x: torch.Tensor, linear: nn.Linear, format: str) -> torch.Tensor:
    """float64 product of the values the format is meant to use."""
    w, b = linear.weight.detach().double(), linear.bias.detach().double()
    if format == "model":
        return x.double() @ w.T + b
    if format == "bfloat16":
        return _bf16(x) @ _bf16(w).T + b
    q, scale = quantize_int8(linear.weight)
    return _bf16(x) @ (q.double() * scale.double()[:, None]).T + b


# in_features 256 and 32 take the int8 kernel, 40 and 5 the dequantized fallback
@pytest.mark.parametrize("in_features,out_features", [(256, 768), (32, 30), (40, 24), (5, 7)])
@pytest.mark.parametrize("format", STEP_WEIGHT_FORMATS)
def test_step_linear_matches_a_float64_product_of_its_format(format, in_features, out_features):
    torch.manual_seed(1)
    linear = nn.Linear(in_features, out_features)
    x = torch.randn(3, in_features)
    with torch.inference_mode(), weight_copies_for_steps(linear, format):
        out = step_linear(x, linear)
    assert out.dtype == x.dtype and out.shape == (3, out_features)
    expected = _reference(x, linear, format)
    scale = expected.abs().max()
    # model: fp32 summation; reduced formats: the product is rounded to bf16 (2^-9 relative)
    tolerance = 1e-5 if format == "model" else 2.0**-8
    assert (out.double() - expected).abs().max() <= tolerance * scale
    if format != "model":  # and the lossy copy stays close to the exact layer
        exact = _reference(x, linear, "model")
        assert (out.double() - exact).abs().max() <= 0.05 * exact.abs().max()


def test_step_weights_are_removed_on_exit_and_outside_the_block_step_linear_is_the_module():
    torch.manual_seed(2)
    linear = nn.Linear(32, 16)
    x = torch.randn(2, 32)
    with weight_copies_for_steps(linear, "int8"):
        assert "_step_weight" in linear.__dict__
        lossy = step_linear(x, linear)
    assert "_step_weight" not in linear.__dict__
    exact = step_linear(x, linear)
    torch.testing.assert_close(exact, linear(x))
    assert not torch.equal(lossy, exact)


def test_nested_blocks_keep_the_outer_copies_and_refuse_another_format():
    linear = nn.Linear(32, 16)
    with weight_copies_for_steps(linear, "int8"):
        outer = linear.__dict__["_step_weight"]
        with weight_copies_for_steps(linear, "int8"):
            assert linear.__dict__["_step_weight"] is outer
        assert linear.__dict__["_step_weight"] is outer  # the inner exit removed nothing
        with pytest.raises(RuntimeError, match="already holds a 'int8' step weight"):
            with weight_copies_for_steps(linear, "bfloat16"):
                pass
    assert "_step_weight" not in linear.__dict__


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="valid choices: model, bfloat16, int8"):
        with weight_copies_for_steps(nn.Linear(4, 4), "fp8"):
            pass


# ---------------------------------------------------------------- generate(step_weights=...)
def _model(backend="linear") -> PixelTransformer:
    torch.manual_seed(0)
    return PixelTransformer(backend, image_shape=(1, 4, 4), **TINY).eval()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def _fast_params(model: PixelTransformer, previous, t: int, state, batch_size: int):
    """``model.step`` with :func:`fast_step` in place of ``Transformer.step``: the step that
    generate() runs, and the one that reads the weight copies."""
    x_t = model.step_input(previous, t, model.position_table(), batch_size)
    hidden, state = fast_step(model.transformer, x_t, state)
    return model.head(hidden), state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["linear", "softmax"])
@pytest.mark.parametrize("format", ["bfloat16", "int8"])
def test_generate_runs_the_library_step_with_the_copy(backend, format, device, monkeypatch):
    """generate(step_weights=F) draws what a hand-written loop of the fast step draws inside
    ``weight_copies_for_steps(model.transformer, F)`` (greedy: a pure function of the params)."""
    model = _model(backend).to(device)
    formats_seen = set()

    def recording_step(transformer, x_t, state=None):  # which copy every linear layer holds during generate()
        formats_seen.update(m.__dict__["_step_weight"].format for m in transformer.modules() if isinstance(m, nn.Linear))
        return fast_step(transformer, x_t, state)

    monkeypatch.setattr(dynamic_step, "fast_step", recording_step)
    images = model.generate(2, temperature=0.0, step_weights=format)
    assert formats_seen == {format}
    assert images.dtype == torch.uint8 and images.shape == (2, 1, 4, 4)
    values, previous, state = [], None, None
    # the same kernels as generate(): oneDNN's bf16 matmuls round differently from the native ones
    with torch.inference_mode(), generation_kernels(torch.device(device), batch_size=2), \
            weight_copies_for_steps(model.transformer, format):
        for t in range(model.seq_len):
            params, state = _fast_params(model, previous, t, state, batch_size=2)
            previous = model.head.sample(params, temperature=0.0)
            values.append(previous)
    assert torch.equal(images_to_sequence(images), torch.stack(values, 1).to(images.device))
    assert not any("_step_weight" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("format", ["bfloat16", "int8"])
def test_lossy_step_params_stay_close_to_the_exact_ones(format):
    """Teacher-forced along one sequence, the mixture parameters from the lossy copy differ
    from the exact ones by a small fraction of their size, at every position."""
    model = _model()
    torch.manual_seed(3)
    sequence = torch.randint(0, 256, (2, model.seq_len))

    def params(fmt):
        out, state, previous = [], None, None
        with torch.inference_mode(), weight_copies_for_steps(model.transformer, fmt):
            for t in range(model.seq_len):
                p, state = _fast_params(model, previous, t, state, batch_size=2)
                out.append(p)
                previous = sequence[:, t]
        return torch.stack(out, 1)

    exact, lossy = params("model"), params(format)
    torch.testing.assert_close(exact, model.sequence_params(sequence).detach(), rtol=1e-4, atol=1e-4)
    error = (lossy - exact).abs().amax(-1) / exact.abs().amax(-1)
    assert float(error.max()) < 0.05
    assert float(error.max()) > 0  # the copy is in use


def test_step_weights_need_a_recurrent_backend():
    torch.manual_seed(0)
    model = PixelTransformer("lsh", image_shape=(1, 4, 4), **TINY).eval()
    with pytest.raises(ValueError, match="has no recurrent form"):
        model.generate(1, step_weights="int8")


def test_generate_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="unknown step weight format 'float16'; valid choices"):
        _model().generate(1, step_weights="float16")
