"""The graph step (linformer_lab.models.generation.graph_step) against the readable paths.

The graph step is the whole generation step on buffers allocated once, the position a device
tensor: on CUDA it is captured as a graph and replayed per position. On CPU it runs eagerly, and
these tests hold it to ``Transformer.step`` and ``fast_step`` position by position (linear and
softmax, float64 and float32), and ``generate(decoder="graph")`` to the ``fast_step`` loop
(``decoder="dynamic"``) image for image, with and without a prefix. The replayed graphs are
checked against the same step run eagerly where a GPU is there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from linformer_lab.models.generation import fast_step, graph_step, sampling, weight_copies_for_steps
from linformer_lab.models.generation.graph_step import SPAN_BLOCK, StaticDecoder
from linformer_lab.models.generation.sampling import choose_decoder, whole_image_noise
from linformer_lab.models.pixel_transformer import PixelTransformer

BACKENDS = ["linear", "softmax"]
SHAPE = (1, 6, 5)  # 30 positions
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _model(backend: str, dtype=torch.float64, device="cpu", image_shape=SHAPE) -> PixelTransformer:
    torch.manual_seed(0)
    model = PixelTransformer(backend, n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3, image_shape=image_shape)
    return model.to(device, dtype).eval()


def _static_hidden(model: PixelTransformer, x: torch.Tensor, span_block: int = SPAN_BLOCK) -> torch.Tensor:
    """StaticDecoder.transformer_step over the positions of ``x (B, N, d_model)``."""
    values = torch.zeros(x.shape[0], model.seq_len, dtype=torch.long, device=x.device)
    static = StaticDecoder(model, values, 0, 1.0, None, span_block=span_block)
    static.load(None, x[:, 0], 0)
    outs = []
    for t in range(x.shape[1]):
        static.x.copy_(x[:, t])
        outs.append(static.transformer_step(static.span(t)).clone())
        static.position.add_(1)
    return torch.stack(outs, 1)


def _stepped(step, transformer, x: torch.Tensor) -> torch.Tensor:
    state, outs = None, []
    for t in range(x.shape[1]):
        out, state = step(transformer, x[:, t], state)
        outs.append(out)
    return torch.stack(outs, 1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("span_block", [4, SPAN_BLOCK], ids=["spans-of-4", "one-span"])
def test_static_step_equals_transformer_step_and_fast_step(backend, dtype, span_block):
    """Position by position: the static step equals the readable Transformer.step and
    fast_step (softmax over spans that end before, at and after the current position)."""
    model = _model(backend, dtype)
    x = torch.randn(3, model.seq_len, model.d_model, dtype=dtype, generator=torch.Generator().manual_seed(1))
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    with torch.inference_mode():
        want = _stepped(lambda t, x_t, s: t.step(x_t, s), model.transformer, x)
        got = _static_hidden(model, x, span_block)
        torch.testing.assert_close(got, want, **tolerance)
        with weight_copies_for_steps(model.transformer, "model"):
            torch.testing.assert_close(got, _stepped(fast_step, model.transformer, x), **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("prefix, prefill", [(0, True), (7, True), (7, False)], ids=["no-prefix", "prefilled", "stepped"])
def test_graph_generate_on_cpu_equals_dynamic_generate(backend, temperature, prefix, prefill):
    """Float64: the same images from the same generator, with and without a prefix (prefilled
    by the parallel pass, or fed through the graph step, run eagerly, without overwriting it)."""
    model = _model(backend)
    kwargs = {"prefix": torch.randint(0, 256, (3, prefix), generator=torch.Generator().manual_seed(2))} if prefix else {}
    images = {decoder: model.generate(3, temperature, generator=torch.Generator().manual_seed(3), decoder=decoder,
                                      prefill=prefill, **kwargs) for decoder in ("dynamic", "graph")}
    assert torch.equal(images["graph"], images["dynamic"])
    if prefix:
        assert torch.equal(images["graph"].flatten(1)[:, :prefix], kwargs["prefix"].to(torch.uint8))
    assert images["graph"].float().std() > 0  # not a constant image


def test_graph_generate_with_bfloat16_weights_equals_dynamic():
    model = _model("linear", torch.float32)
    images = [model.generate(2, generator=torch.Generator().manual_seed(4), decoder=decoder, step_weights="bfloat16")
              for decoder in ("dynamic", "graph")]
    # float32 with bf16 products: summation order may move a value by one level, rarely
    assert (images[0].int() - images[1].int()).abs().max() <= 1
    assert (images[0] == images[1]).float().mean() >= 0.9


def test_whole_image_noise_is_the_dynamic_loops_noise():
    head = _model("linear").head
    positions = sampling.NOISE_BLOCK + 5  # two blocks
    gumbel, logistic = whole_image_noise(head, 2, positions, 1.0, torch.Generator().manual_seed(5), torch.device("cpu"))
    stream = sampling.noise_per_position(head, 2, positions, 1.0, torch.Generator().manual_seed(5), torch.device("cpu"))
    for i, (g, u) in enumerate(stream):
        assert torch.equal(gumbel[:, i], g) and torch.equal(logistic[:, i], u)
    assert whole_image_noise(head, 2, positions, 0.0, None, torch.device("cpu")) is None


def test_decoder_choice_and_refusals():
    linear, lsh = _model("linear"), _model("lsh")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_decoder("auto", linear.transformer, cpu) == "dynamic"
    assert choose_decoder("auto", linear.transformer, cuda) == "graph"
    assert choose_decoder("auto", lsh.transformer, cuda) == "dynamic"
    assert choose_decoder("graph", linear.transformer, cpu) == "graph"  # eager off CUDA
    with pytest.raises(ValueError, match="unknown decoder 'fast'; valid choices: auto, dynamic, graph$"):
        linear.generate(1, decoder="fast")
    with pytest.raises(ValueError, match="layer 0: it uses LSHAttention, which has no static-buffer step"):
        lsh.generate(1, decoder="graph")


def test_spans_grow_in_blocks_for_softmax_only():
    for backend, want in (("softmax", [4, 8, 12, 16, 20, 24, 28, 30]), ("linear", [30])):
        model = _model(backend)
        static = StaticDecoder(model, torch.zeros(1, 30, dtype=torch.long), 0, 1.0, None, span_block=4)
        assert static.spans() == want
        assert all(static.span(p) > p for p in range(30))


# ---------------------------------------------------------------- on a GPU


@GPU
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step_weights", ["model", "bfloat16"])
@pytest.mark.parametrize("prefix", [0, 9])
def test_graphed_generate_equals_ungraphed(backend, step_weights, prefix, monkeypatch):
    """The CUDA graph replays the eager graph step: the same images (float32 and bf16 weight
    copies), with softmax's spans crossing SPAN_BLOCK, and with a prefilled prefix."""
    model = _model(backend, torch.float32, "cuda", image_shape=(1, 16, 10))  # 160 positions: two spans
    kwargs = {"prefix": torch.randint(0, 256, (4, prefix), device="cuda")} if prefix else {}

    def generate(decoder):
        return model.generate(4, generator=torch.Generator("cuda").manual_seed(7), decoder=decoder,
                              step_weights=step_weights, **kwargs)

    images = {"graph": generate("graph"), "dynamic": generate("dynamic")}
    with monkeypatch.context() as patch:  # no capture: each replay runs the step eagerly
        patch.setattr(graph_step, "capture", lambda function, device: SimpleNamespace(replay=function))
        images["eager"] = generate("graph")
    assert torch.equal(images["graph"], images["eager"])
    assert (images["eager"].int() - images["dynamic"].int()).abs().max() <= 1  # other kernels: rarely a level off


@GPU
def test_graphed_step_equals_transformer_step_on_gpu():
    model = _model("softmax", torch.float32, "cuda", image_shape=(1, 16, 10))
    x = torch.randn(2, model.seq_len, model.d_model, device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    with torch.inference_mode():
        want = _stepped(lambda t, x_t, s: t.step(x_t, s), model.transformer, x)
        torch.testing.assert_close(_static_hidden(model, x), want, rtol=1e-4, atol=1e-4)
