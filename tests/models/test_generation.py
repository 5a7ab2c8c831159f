"""The generation wing's Python step against the readable one (linformer_lab.models.generation.dynamic_step).

``fast_step`` is ``Transformer.step`` written for speed (no module calls, views of the fused
projection, linear attention's own in-place step with a CPU product for few rows); the readable
``Transformer.step`` is the reference. Every backend with a recurrent form and every feature map
of the linear backends, float64, on both CPU products of the linear step; then ``generate``,
which runs the fast step, against a loop of the readable ``PixelTransformer.step``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import attention_configs, config_id

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.linear import LinearAttention
from linformer_lab.models.generation import dynamic_step, fast_step, sampling, weight_copies_for_steps
from linformer_lab.models.generation.dynamic_step import CPU_MATMUL_MIN_ROWS
from linformer_lab.models.pixel_transformer import PixelTransformer, images_to_sequence
from linformer_lab.models.transformer import Transformer
from linformer_lab.ops.state import SequenceBuffer
from linformer_lab.registry import ATTENTION

D_MODEL, HEADS, LENGTH = 16, 4, 9
RANDOM_MAPS = {"favor": {"num_features": 8}, "random_fourier": {"num_features": 8}}
CONFIGS = attention_configs(feature_map_kwargs=RANDOM_MAPS)
RECURRENT = [c for c in CONFIGS if ATTENTION.get(c.backend).has_recurrent_form]
#: batch sizes whose batch x heads rows fall below and above CPU_MATMUL_MIN_ROWS: both CPU
#: products of the fast linear step
BATCHES = [1, 9]


def _device(config) -> torch.device:
    return torch.device("cuda" if config.backend == "linear_cuda" else "cpu")


def _transformer(config, dtype=torch.float64) -> Transformer:
    torch.manual_seed(0)
    return Transformer(n_layers=2, d_model=D_MODEL, n_heads=HEADS, d_ff=32, attention=config).to(_device(config), dtype).eval()


def _stepped(step, model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """``step(model, x_t, state)`` over the positions of ``x (B, N, d_model)`` -> ``(B, N, d_model)``."""
    state, outs = None, []
    for t in range(x.shape[1]):
        out, state = step(model, x[:, t], state)
        outs.append(out)
    return torch.stack(outs, 1)


def _readable(model: Transformer, x_t: torch.Tensor, state):
    return model.step(x_t, state)


def test_the_batches_cover_both_cpu_products():
    rows = [batch * HEADS for batch in BATCHES]
    assert min(rows) < CPU_MATMUL_MIN_ROWS <= max(rows)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"rows{b * HEADS}")
@pytest.mark.parametrize("config", RECURRENT, ids=config_id)
@pytest.mark.parametrize("copies", [True, False], ids=["inference-mode+copies", "no-grad"])
def test_fast_step_equals_the_readable_step(config, batch, copies):
    """Position by position, float64: fast_step equals Transformer.step, under inference mode
    with the "model" weight copies that generate() makes, and under no_grad without copies."""
    model = _transformer(config)
    x = torch.randn(batch, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x.to(_device(config))
    with torch.no_grad():
        want = _stepped(_readable, model, x)
    context = weight_copies_for_steps(model, "model") if copies else contextlib.nullcontext()
    with (torch.inference_mode() if copies else torch.no_grad()), context:
        got = _stepped(fast_step, model, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # and both are the parallel forward
        torch.testing.assert_close(got, model(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["linear", "softmax"])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "relu"), (False, "gelu")])
def test_fast_step_and_decoders_take_the_authors_post_norm_relu_layers(backend, norm_first, activation):
    """The copy task's authors' recipe (post-norm, ReLU) steps through fast_step, the weight-copy
    block and the decoder choice like the paper's pre-norm GELU stack, equal to the forward."""
    torch.manual_seed(0)
    model = Transformer(n_layers=2, d_model=D_MODEL, n_heads=HEADS, d_ff=32, attention=backend, norm_first=norm_first,
                        activation=activation).double().eval()
    x = torch.randn(9, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), weight_copies_for_steps(model, "model"):
        got = _stepped(fast_step, model, x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-9, atol=1e-9)
    assert sampling.choose_decoder("auto", model, torch.device("cpu")) == "dynamic"
    if not norm_first:
        with pytest.raises(ValueError, match="post-norm"):
            sampling.choose_decoder("graph", model, torch.device("cpu"))


@pytest.mark.parametrize("config", [c for c in RECURRENT if c.backend == "linear"], ids=config_id)
def test_fast_linear_step_takes_its_own_path_after_the_first_position(config, monkeypatch):
    """The comparison above compares two paths: after a sequence's first position (where the
    backend's own step makes the state) fast_step no longer calls the backend's step."""
    model = _transformer(config)
    calls = []
    for layer in model.layers:
        backend = layer.attention.attention
        assert type(backend).step is LinearAttention.step

        def counting(*args, backend=backend, **kwargs):
            calls.append(backend)
            return LinearAttention.step(backend, *args, **kwargs)

        monkeypatch.setattr(backend, "step", counting)
    with torch.inference_mode():
        _stepped(fast_step, model, torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64))
    assert len(calls) == len(model.layers)  # once per layer, at the first position
    calls.clear()
    with torch.no_grad():
        _stepped(_readable, model, torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64))
    assert len(calls) == len(model.layers) * LENGTH


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"rows{b * HEADS}")
def test_fast_step_keeps_the_state_product_in_fp32_under_cpu_autocast(batch):
    """Under CPU bf16 autocast the linear layers run in bf16 alike on both paths, and the product
    with the fp32 state stays fp32 on both CPU products of the fast step, as in the readable one."""
    model = _transformer(AttentionConfig("linear"), dtype=torch.float32)
    x = torch.randn(batch, LENGTH, D_MODEL, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = _stepped(_readable, model, x)
        got = _stepped(fast_step, model, x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-3)


def test_a_stack_without_a_recurrent_form_steps_through_transformer_step():
    """lsh has no recurrent form: fast_step is Transformer.step, which re-runs the stack on the
    prefix it keeps as the state."""
    (config,) = [c for c in CONFIGS if not ATTENTION.get(c.backend).has_recurrent_form]
    model = _transformer(config)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    with torch.inference_mode():
        _, state = fast_step(model, x[:, 0])
        assert isinstance(state, SequenceBuffer)
        torch.testing.assert_close(_stepped(fast_step, model, x), _stepped(_readable, model, x), rtol=0, atol=0)


def test_fast_step_refuses_training_mode_and_autograd():
    model = Transformer(n_layers=1, d_model=D_MODEL, n_heads=HEADS, dropout=0.1)
    x_t = torch.randn(2, D_MODEL)
    with torch.no_grad(), pytest.raises(RuntimeError, match="applies no dropout.*eval mode"):
        fast_step(model.train(), x_t)
    with pytest.raises(RuntimeError, match=r"in place, without autograd.*torch.no_grad\(\)"):
        fast_step(model.eval(), x_t)
    with torch.no_grad():
        out, _ = fast_step(model, x_t)  # eval mode without autograd: allowed
    assert out.shape == (2, D_MODEL)


# ---------------------------------------------------------------- generate: fast against readable
TINY = dict(n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3)
IMAGE = (1, 4, 4)


@pytest.mark.parametrize("prefix_rows", [0, 2], ids=["whole", "completion"])
@pytest.mark.parametrize("config", attention_configs(), ids=config_id)
def test_generate_equals_a_loop_of_the_readable_step(config, prefix_rows):
    """generate() steps with fast_step (a completion from the prefilled state); a loop of
    ``PixelTransformer.step`` (Transformer.step) draws the same images (float64, greedy, so
    rounding cannot flip a bin)."""
    device = _device(config)
    torch.manual_seed(0)
    model = PixelTransformer(config, image_shape=IMAGE, **TINY).double().eval().to(device)
    originals = images_to_sequence(torch.randint(0, 256, (2, *IMAGE), dtype=torch.uint8)).to(device)
    known = prefix_rows * IMAGE[2]
    prefix = originals[:, :known] if known else None
    fast = images_to_sequence(model.generate(2, temperature=0.0, prefix=prefix))
    values, previous, state = [], None, None
    with torch.inference_mode():
        for t in range(model.seq_len):
            params, state = model.step(previous, t, state, batch_size=2)
            previous = originals[:, t] if t < known else model.head.sample(params, temperature=0.0)
            values.append(previous)
    assert torch.equal(fast, torch.stack(values, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_elu_features_equal_the_feature_map(dtype):
    """fast_step's elu + 1 (exp(min(x, 0)) + max(x, 0)) gives EluFeatureMap's values bit for bit,
    from deep negatives (where phi stays > 0 in half precision) to large positives."""
    from linformer_lab.feature_maps.elu import EluFeatureMap

    x = torch.cat([torch.linspace(-40, 40, 801), torch.tensor([0.0, -0.0])]).to(dtype).view(1, 1, -1)
    feature_map = EluFeatureMap(x.shape[-1])
    with torch.inference_mode():
        expected = feature_map(x)
        phi_q, phi_k = dynamic_step._features(feature_map, x, x)
    assert torch.equal(phi_q, expected) and torch.equal(phi_k, expected)
    assert bool((phi_q > 0).all())
