"""PixelTransformer: sequence order, bits/dim, and the recurrent (generation) path against the
parallel one for every attention backend that runs on this machine."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import attention_configs, config_id

import linformer_lab as ll
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.pixel_transformer import PixelTransformer, images_to_sequence, sequence_to_images
from linformer_lab.ops.state import state_nbytes

IMAGE = (1, 4, 4)  # 16 positions: long enough for 4 lsh chunks, short enough to be fast
TINY = dict(n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3)
CONFIGS = attention_configs()
IDS = [config_id(c) for c in CONFIGS]


def _model(config, image_shape=IMAGE, dtype=torch.float32, seed=0) -> PixelTransformer:
    torch.manual_seed(seed)
    return PixelTransformer(config, image_shape=image_shape, **TINY).to(dtype).eval()


def _device(config) -> torch.device:
    return torch.device("cuda" if config.backend == "linear_cuda" else "cpu")


def _is_lsh(config) -> bool:
    return config.backend == "lsh"


def _parallel_params(model, sequence, prefix_by_prefix: bool) -> torch.Tensor:
    """Params ``(B, N, 3K)`` of the parallel path. For lsh the output at position t depends on
    where *later* positions hash, so the recurrent path (which has seen only 0..t) is compared
    with a forward over the prefix 0..t, as ``linformer_lab.ops.lsh`` documents."""
    with torch.no_grad():
        if not prefix_by_prefix:
            return model.sequence_params(sequence)
        return torch.stack([model.sequence_params(sequence[:, : t + 1])[:, t] for t in range(sequence.shape[1])], dim=1)


def test_sequence_order_is_rows_columns_channels():
    images = torch.randint(0, 256, (2, 3, 2, 5), dtype=torch.uint8)
    sequence = images_to_sequence(images)
    c_, h_, w_ = images.shape[1:]
    for c in range(c_):
        for h in range(h_):
            for w in range(w_):
                assert torch.equal(sequence[:, (h * w_ + w) * c_ + c], images[:, c, h, w].long())
    assert torch.equal(sequence_to_images(sequence, images.shape[1:]), images)


def test_top_rows_are_the_sequence_prefix():
    # completion relies on this: the first k*W*C elements are exactly the top k rows
    images = torch.randint(0, 256, (2, 3, 6, 4), dtype=torch.uint8)
    assert torch.equal(images_to_sequence(images)[:, : 2 * 4 * 3], images_to_sequence(images[:, :, :2]))


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_step_params_equal_forward_params(config):
    """The RNN step's params equal the parallel forward's, position by position (fp32)."""
    device = _device(config)
    model = _model(config).to(device)
    images = torch.randint(0, 256, (3, *IMAGE), dtype=torch.uint8, device=device)
    sequence = images_to_sequence(images)
    expected = _parallel_params(model, sequence, prefix_by_prefix=_is_lsh(config))

    state, previous, stepped = None, None, []
    table = model.position_table()
    with torch.inference_mode():
        for t in range(model.seq_len):
            params, state = model.step(previous, t, state, batch_size=3, position_table=table)
            stepped.append(params)
            previous = sequence[:, t]
    stepped = torch.stack(stepped, dim=1)
    assert stepped.shape == expected.shape == (3, model.seq_len, 3 * TINY["num_mixtures"])
    assert (stepped - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_greedy_generation_matches_parallel_decoding(config):
    """Generate with temperature 0 through ``step``; the parallel path's temperature-0 choice
    at every position of the result must be the generated value (float64, so rounding to a
    bin cannot flip on the last bit). Also with a prefix (completion)."""
    device = _device(config)
    model = _model(config, dtype=torch.float64).to(device)
    lsh = _is_lsh(config)

    generated = model.generate(2, temperature=0.0)
    assert generated.dtype == torch.uint8 and generated.shape == (2, *IMAGE)
    sequence = images_to_sequence(generated)
    choice = model.head.sample(_parallel_params(model, sequence, lsh), temperature=0.0)
    assert torch.equal(choice, sequence)

    originals = torch.randint(0, 256, (2, *IMAGE), dtype=torch.uint8, device=device)
    completed = model.generate(2, temperature=0.0, prefix=originals[:, :, :2])
    assert torch.equal(completed[:, :, :2], originals[:, :, :2])  # the prefix is kept
    sequence = images_to_sequence(completed)
    choice = model.head.sample(_parallel_params(model, sequence, lsh), temperature=0.0)
    known = 2 * IMAGE[2] * IMAGE[0]
    assert torch.equal(choice[:, known:], sequence[:, known:])


def test_colour_images_step_equals_forward():
    """The channel embedding path (C = 3), softmax and linear."""
    for config in (AttentionConfig("softmax"), AttentionConfig("linear")):
        model = _model(config, image_shape=(3, 2, 3))
        images = torch.randint(0, 256, (2, 3, 2, 3), dtype=torch.uint8)
        sequence = images_to_sequence(images)
        expected = _parallel_params(model, sequence, prefix_by_prefix=False)
        state, previous = None, None
        with torch.inference_mode():
            for t in range(model.seq_len):
                params, state = model.step(previous, t, state, batch_size=2)
                assert (params - expected[:, t]).abs().max().item() < 1e-4
                previous = sequence[:, t]


def _states_during_generation(model, batch_size=2):
    """The bytes of the state after every step of a sampled sequence."""
    sizes = []
    state, previous = None, None
    table = model.position_table()
    with torch.inference_mode():
        for t in range(model.seq_len):
            params, state = model.step(previous, t, state, batch_size=batch_size, position_table=table)
            previous = model.head.sample(params)
            sizes.append(state_nbytes(state))
    return sizes


def test_linear_state_is_constant_in_size():
    """Paper §4.2: constant memory per image from the first pixel to the last (linear)."""
    model = _model(AttentionConfig("linear"), image_shape=(1, 8, 8))
    sizes = _states_during_generation(model)
    assert sizes[0] == sizes[-1] and len(set(sizes)) == 1
    # (S, Z) per layer: (B, H, C, M) + (B, H, C) fp32, C = M = d_model / heads for elu
    head_dim = TINY["d_model"] // TINY["n_heads"]
    per_layer = 2 * TINY["n_heads"] * (head_dim * head_dim + head_dim) * 4
    assert sizes[0] == TINY["n_layers"] * per_layer
    # the readable step returns a new state of this size each position (a value); generate's fast
    # step updates its own in place (test_generation_memory.py)


def test_softmax_state_grows_with_the_sequence():
    model = _model(AttentionConfig("softmax"), image_shape=(1, 8, 8))
    sizes = _states_during_generation(model)
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] == model.seq_len * sizes[0]  # one key and one value per position


def test_generate_restores_mode_and_is_reproducible():
    model = _model(AttentionConfig("linear")).train()
    a = model.generate(3, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = model.generate(3, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert model.training
    assert torch.equal(a, b)
    assert a.dtype == torch.uint8 and a.shape == (3, *IMAGE)


def test_generate_rejects_bad_prefixes():
    model = _model(AttentionConfig("linear"))
    with pytest.raises(ValueError, match="batch_size"):
        model.generate(2, prefix=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="longer"):
        model.generate(1, prefix=torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        model.generate(1, prefix=torch.full((1, 3), 256, dtype=torch.long))
    with pytest.raises(ValueError, match="image prefix"):
        model.generate(1, prefix=torch.zeros(1, 1, 2, 3, dtype=torch.uint8))


def test_forward_checks_image_shape_and_dtype():
    model = _model(AttentionConfig("linear"))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(1, 1, 5, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        model(torch.zeros(1, *IMAGE))


def test_fresh_model_bits_per_dim_is_finite_and_near_uniform():
    """Sanity only: uniform noise costs 8 bits/dim under a uniform model; a fresh model's
    mixtures are wider than [0, 255] (scales ~1 on the [-1, 1] scale), so a bit or so more."""
    model = _model(AttentionConfig("linear"), image_shape=(1, 8, 8))
    images = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
    bpd = model.nll(images).mean() / math.log(2.0)
    assert torch.isfinite(bpd)
    assert 7.0 < bpd.item() < 10.5
    # bits/dim is the mean of the per-sub-pixel NLL (nats) over ln 2
    assert torch.allclose(bpd, model.nll(images).mean() / math.log(2.0))


def test_attention_argument_forms():
    for form in ("softmax", {"backend": "softmax"}, AttentionConfig("softmax")):
        model = PixelTransformer(form, image_shape=IMAGE, **TINY)
        assert model.attention_config.backend == "softmax"
    with pytest.raises(ll.PluginError, match="Valid choices"):
        PixelTransformer("no_such_backend", image_shape=IMAGE, **TINY)


# ---------------------------------------------------------------- position embeddings


def test_row_column_position_table_is_row_plus_column_plus_channel():
    """``position_embedding="row_column"``: sub-pixel (c, h, w) at sequence index
    (h W + w) C + c gets row[h] + column[w] + channel[c]; H + W position vectors in all."""
    c_, h_, w_ = 3, 4, 5
    model = PixelTransformer("linear", image_shape=(c_, h_, w_), position_embedding="row_column", **TINY)
    table = model.position_table()
    assert table.shape == (c_ * h_ * w_, TINY["d_model"])
    for c in range(c_):
        for h in range(h_):
            for w in range(w_):
                expected = model.row_embedding.weight[h] + model.column_embedding.weight[w] + model.channel_embedding.weight[c]
                torch.testing.assert_close(table[(h * w_ + w) * c_ + c], expected)
    assert not hasattr(model, "pixel_position_embedding")
    assert model.row_embedding.num_embeddings == h_ and model.column_embedding.num_embeddings == w_


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_row_column_step_params_equal_forward_params(backend):
    """Both paths read the one position table: the RNN steps equal the parallel forward."""
    torch.manual_seed(0)
    model = PixelTransformer(backend, image_shape=IMAGE, position_embedding="row_column", **TINY).double().eval()
    sequence = images_to_sequence(torch.randint(0, 256, (2, *IMAGE), dtype=torch.uint8))
    expected = _parallel_params(model, sequence, prefix_by_prefix=False)
    state, previous, stepped = None, None, []
    with torch.inference_mode():
        for t in range(model.seq_len):
            params, state = model.step(previous, t, state, batch_size=2)
            stepped.append(params)
            previous = sequence[:, t]
    torch.testing.assert_close(torch.stack(stepped, dim=1), expected, rtol=0, atol=1e-10)


def test_unknown_position_embedding_names_the_choices():
    from linformer_lab.validation import ConfigurationError

    with pytest.raises(ConfigurationError, match="position_embedding must be one of 'pixel', 'row_column', got 'rows'"):
        PixelTransformer("linear", image_shape=IMAGE, position_embedding="rows", **TINY)
