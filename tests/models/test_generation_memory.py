"""Memory per generated image (paper §4.2): constant from the first sub-pixel to the last for
``linear``, measured on the path that ``PixelTransformer.generate`` itself runs.

tests/models/test_pixel_transformer.py already checks the linear state's size and buffers along a
hand-written ``model.step`` loop (elu, one grey image size) and that the softmax cache
grows. This file extends that to ``generate`` itself (with its fast step: one thread,
transposed weights), every linear feature map, colour images, a completion prefix, and an
image size that changes nothing; plus the clear errors that the step path still gives after
a sequence's first step, where the full input checks no longer run.
"""

from __future__ import annotations

import pytest
import torch

import linformer_lab as ll
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.generation import dynamic_step
from linformer_lab.models.pixel_transformer import PixelTransformer, images_to_sequence
from linformer_lab.ops.state import LinearState, state_nbytes

TINY = dict(n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3)
HEAD_DIM = TINY["d_model"] // TINY["n_heads"]
FEATURE_MAPS = ll.list_feature_maps()


def _model(feature_map="elu", image_shape=(1, 6, 6), seed=0) -> PixelTransformer:
    torch.manual_seed(seed)
    kwargs = {"num_features": 12} if feature_map in ("favor", "random_fourier") else {}
    config = AttentionConfig(backend="linear", feature_map=feature_map, feature_map_kwargs=kwargs)
    return PixelTransformer(config, image_shape=image_shape, **TINY).eval()


class _Recorder:
    """Wraps ``dynamic_step.fast_step`` (the step ``generate`` runs) inside its ``with`` block and
    records, after every sub-pixel, the state's bytes and the data pointers of its tensors."""

    def __init__(self):
        self.sizes, self.pointers = [], []

    def __call__(self, transformer, x_t, state=None):
        out, state = self.step(transformer, x_t, state)
        self.sizes.append(state_nbytes(state))
        self.pointers.append([t.data_ptr() for layer in state for t in layer])
        return out, state

    def __enter__(self):
        self.step, dynamic_step.fast_step = dynamic_step.fast_step, self  # generate() looks it up on the module
        return self

    def __exit__(self, *exc):
        dynamic_step.fast_step = self.step


def _feature_dim(model) -> int:
    return model.transformer.layers[0].attention.attention.feature_map.output_dim


def _expected_bytes(model, batch) -> int:
    """(S, Z) per layer: B * H * (C * M + C) fp32 numbers."""
    c = _feature_dim(model)
    return TINY["n_layers"] * batch * TINY["n_heads"] * (c * HEAD_DIM + c) * 4


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_generate_keeps_linear_state_constant(feature_map):
    model = _model(feature_map)
    with _Recorder() as rec:
        images = model.generate(3, generator=torch.Generator().manual_seed(0))
    assert images.shape == (3, 1, 6, 6)
    assert len(rec.sizes) == model.seq_len
    assert set(rec.sizes) == {_expected_bytes(model, 3)}  # the same at every sub-pixel
    assert all(p == rec.pointers[0] for p in rec.pointers)  # the very same buffers, updated in place


@pytest.mark.parametrize("prefill", [True, False])
def test_colour_images_and_a_prefix_keep_the_state_constant(prefill):
    """Prefilled in one pass, the prefix's 24 sub-pixels take no step; stepped, all 48 do. Either
    way the state the steps update is the same size throughout, updated in place."""
    model = _model(image_shape=(3, 4, 4))
    prefix = torch.randint(0, 256, (2, 3, 2, 4), dtype=torch.uint8)  # the top two rows
    with _Recorder() as rec:
        completed = model.generate(2, prefix=prefix, generator=torch.Generator().manual_seed(1), prefill=prefill)
    assert torch.equal(completed[:, :, :2], prefix)
    assert model.seq_len == 48
    assert len(rec.sizes) == (24 if prefill else 48)
    assert set(rec.sizes) == {_expected_bytes(model, 2)}
    assert all(p == rec.pointers[0] for p in rec.pointers)


def test_state_size_does_not_depend_on_the_image_length():
    sizes = {}
    for side in (3, 9):  # 9 and 81 sub-pixels
        model = _model(image_shape=(1, side, side))
        with _Recorder() as rec:
            model.generate(1)
        sizes[side] = set(rec.sizes)
    assert sizes[3] == sizes[9] == {_expected_bytes(model, 1)}


def test_linear_state_is_one_buffer_seen_as_s_and_z():
    """The state is still the tuple (S, Z) of eq. 16-19, in one [S | Z] buffer."""
    attn = ll.build_attention("linear", causal=True, query_dim=8)
    q, k, v = (torch.randn(2, 4, 8) for _ in range(3))
    with torch.inference_mode():
        _, state = attn.step(q, k, v)
    assert isinstance(state, LinearState) and isinstance(state, tuple)
    s, z = state
    assert s.shape == (2, 4, 8, 8) and z.shape == (2, 4, 8)
    assert state.joint.shape == (2, 4, 8, 9)
    assert s.data_ptr() == state.joint.data_ptr()
    torch.testing.assert_close(z, torch.nn.functional.elu(k) + 1)  # Z = phi(k) after one step
    assert state_nbytes(state) == (2 * 4 * 8 * 8 + 2 * 4 * 8) * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory counters need a GPU")
def test_cuda_memory_is_the_same_at_the_first_and_last_pixel(monkeypatch):
    model = _model(image_shape=(1, 8, 8)).cuda()
    allocated = []
    step = dynamic_step.fast_step

    def recording_step(transformer, x_t, state=None):
        out, state = step(transformer, x_t, state)
        allocated.append(torch.cuda.memory_allocated())
        return out, state

    monkeypatch.setattr(dynamic_step, "fast_step", recording_step)
    model.generate(4, generator=torch.Generator(device="cuda").manual_seed(0))
    assert allocated[1] == allocated[-1]  # after the first step nothing is allocated for good


def test_generate_restores_threads_and_leaves_no_weight_copies():
    model = _model()
    threads = torch.get_num_threads()
    model.generate(1)
    assert torch.get_num_threads() == threads
    assert not any("_step_weight" in m.__dict__ for m in model.modules())


def test_completion_prefill_keeps_the_threads_and_steps_take_one(monkeypatch):
    """The prefix pass is a large parallel forward: it runs with the process's threads; the
    steps after it run a batch of one with a single thread (generation_kernels)."""
    model = _model()
    seen = {"forward": [], "step": []}
    forward = model.transformer.forward

    def recording(name, fn):
        def call(*args, **kwargs):
            seen[name].append(torch.get_num_threads())
            return fn(*args, **kwargs)
        return call

    model.transformer.forward = recording("forward", forward)
    monkeypatch.setattr(dynamic_step, "fast_step", recording("step", dynamic_step.fast_step))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model.generate(1, prefix=torch.zeros(1, 1, 2, model.image_shape[2], dtype=torch.uint8))
    finally:
        torch.set_num_threads(threads)
        del model.transformer.forward
    assert seen["forward"] == [2]
    assert seen["step"] and set(seen["step"]) == {1}


def test_generate_samples_with_noise_drawn_per_block():
    """At T = 1 generate draws the sampling noise NOISE_BLOCK positions per call: the images
    equal a hand-written loop of model.step that draws it the same way, here over 144 sampled
    positions, so a block boundary is crossed and each image of the batch has its own noise."""
    from linformer_lab.models.generation import NOISE_BLOCK

    model = _model(image_shape=(1, 12, 12)).double()
    assert NOISE_BLOCK < model.seq_len
    fast = images_to_sequence(model.generate(2, generator=torch.Generator().manual_seed(3)))
    generator = torch.Generator().manual_seed(3)
    values, previous, state, noise = [], None, None, None
    with torch.inference_mode():
        for t in range(model.seq_len):
            if t % NOISE_BLOCK == 0:
                noise = model.head.sampling_noise((2, min(NOISE_BLOCK, model.seq_len - t)), generator)
            params, state = model.step(previous, t, state, batch_size=2)
            previous = model.head.sample(params, noise=(noise[0][:, t % NOISE_BLOCK], noise[1][:, t % NOISE_BLOCK]))
            values.append(previous)
    assert torch.equal(fast, torch.stack(values, 1))
    assert not torch.equal(fast[0], fast[1])


# ---------------------------------------------------------------- clear errors after the first step
@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_step_rejects_inputs_that_do_not_fit_the_state(backend):
    """Full input checks run on a sequence's first step only; later steps still say clearly
    when the inputs do not fit the state (here: another batch size mid-sequence)."""
    attn = ll.build_attention(backend, causal=True, query_dim=8)
    q, k, v = (torch.randn(2, 4, 8) for _ in range(3))
    with torch.inference_mode():
        _, state = attn.step(q, k, v)
        with pytest.raises(ValueError, match="first step"):
            attn.step(q[:1], k[:1], v[:1], state)


def test_first_step_still_checks_everything():
    attn = ll.build_attention("linear", causal=True, query_dim=8)
    with pytest.raises(ValueError, match=r"3-d tensor \(batch, heads, dim\)"):
        attn.step(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match="query_dim=8"):
        attn.step(*(torch.randn(2, 4, 6) for _ in range(3)))
