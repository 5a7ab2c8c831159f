"""State in and out of the parallel form through the models: ``Transformer.forward`` with a state,
backends without state support, completion with the prefix prefilled, and segmented training
(values, gradients, detached segments, the CLI). The ops and backends: ``test_state.py``.

References are float64 and independent of the code under test: one pass over the whole sequence.
"""

import pytest
import torch
from conftest import assert_close

import linformer_lab as ll
from linformer_lab.attention.base import Attention
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.pixel_transformer import PixelTransformer
from linformer_lab.models.transformer import Transformer

LSH_SMALL = {"backend": "lsh", "kwargs": {"bucket_size": 4, "n_buckets": 4, "n_hashes": 2}}


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["linear", "softmax", LSH_SMALL], ids=["linear", "softmax", "lsh"])
def test_transformer_forward_with_state(attention):
    torch.manual_seed(0)
    model = Transformer(2, 16, 2, attention=AttentionConfig.coerce(attention), causal=True).double()
    x = torch.randn(3, 20, 16, dtype=torch.float64, requires_grad=True)
    full = model(x)
    first, state = model(x[:, :7], return_state=True)
    second, state = model(x[:, 7:15], state=state, return_state=True)
    third = model(x[:, 15:], state=state)
    assert_close("last segment", full[:, 15:], third)
    if model.has_recurrent_form:
        assert_close("all segments", full, torch.cat([first, second, third], 1))
        g = torch.randn_like(full)
        assert_close("grad x", torch.autograd.grad(full, x, g)[0],
                     torch.autograd.grad(torch.cat([first, second, third], 1), x, g)[0])
    with torch.no_grad():  # a forward state is what step continues from
        _, state = model(x[:, :12], return_state=True)
        for t in range(12, 20):
            out, state = model.step(x[:, t], state)
        assert_close("step after forward", model(x[:, :20])[:, -1], out)


def test_transformer_state_errors():
    model = Transformer(2, 16, 2, attention=AttentionConfig("linear"), causal=True)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="list of 2 per-layer states"):
        model(x, state=[None])
    _, state = model(x, return_state=True)
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.randn(2, 4, 16), state=state)


class _Plain(Attention):
    """A third-party backend that knows nothing of states."""

    def forward(self, q, k, v, key_lengths=None):
        return v


def test_backend_without_state_support_gets_a_clear_error():
    from linformer_lab.attention.multihead import MultiHeadAttention

    mha = MultiHeadAttention(8, 2, attention=_Plain(causal=True))
    x = torch.randn(1, 3, 8)
    assert mha(x).shape == x.shape  # the plain call still works
    with pytest.raises(ValueError, match="_Plain does not take or return a state"):
        mha(x, return_state=True)
    with pytest.raises(ValueError, match="_Plain does not take packed sequences"):
        mha(x, cu_seqlens=torch.tensor([0, 3]))


def test_lsh_state_needs_equal_lengths():
    attn = ll.build_attention("lsh", causal=True, query_dim=4)
    q = torch.randn(2, 1, 6, 4)
    with pytest.raises(ValueError, match="equal length"):
        attn(q, q, q, key_lengths=torch.tensor([6, 3]), return_state=True)


@pytest.mark.parametrize("attention", ["linear", "softmax", LSH_SMALL], ids=["linear", "softmax", "lsh"])
def test_completion_prefill_equals_stepping(attention):
    """PixelTransformer.generate with the prefix prefilled in one pass == fed through step:
    the same images at temperature 0 and the same samples from the same generator."""
    torch.manual_seed(0)
    model = PixelTransformer(attention, n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=2, image_shape=(1, 6, 6))
    prefix = torch.randint(0, 256, (3, 1, 3, 6), dtype=torch.uint8)
    for temperature in (0.0, 1.0):
        a = model.generate(3, temperature, prefix=prefix, prefill=True, generator=torch.Generator().manual_seed(1))
        b = model.generate(3, temperature, prefix=prefix, prefill=False, generator=torch.Generator().manual_seed(1))
        assert torch.equal(a, b)
        assert torch.equal(a[:, :, :3], prefix)
    full = torch.randint(0, 256, (2, 1, 6, 6), dtype=torch.uint8)  # a prefix of the whole image
    assert torch.equal(model.generate(2, 0.0, prefix=full), full)


# ------------------------------------------------------------------------------------------------
# segmented training
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_segmented_pixel_nll_and_gradients_equal_one_pass(attention):
    from linformer_lab.models.transformer import segmented_forward

    torch.manual_seed(0)
    model = PixelTransformer(attention, n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=2,
                             image_shape=(1, 5, 5)).double()
    images = torch.randint(0, 256, (3, 1, 5, 5), dtype=torch.uint8)
    sequence = model.to_sequence(images)
    want = model.nll(images)
    want_grads = torch.autograd.grad(want.sum(), list(model.parameters()))
    for segment in (1, 7, 10, 25, 40):
        pieces = segmented_forward(lambda a, b, s: model.segment_nll(sequence, a, b, s), 25, segment)
        got = torch.cat(pieces, 1)
        # the mixture head computes in fp32 whatever the model's dtype: fp32-level agreement
        assert_close(f"{attention} segments of {segment}: nll", want, got, 1e-5, 1e-6)
        got_grads = torch.autograd.grad(got.sum(), list(model.parameters()))
        for (name, _), w, g in zip(model.named_parameters(), want_grads, got_grads):
            assert_close(f"{attention} segments of {segment}: grad {name}", w, g, 1e-5, 1e-5)


def test_detached_segments_cut_the_gradient_only():
    """detach: the same loss; the gradient of the last segment's loss no longer reaches the
    first segment's inputs (truncated BPTT)."""
    from linformer_lab.models.transformer import segmented_forward

    torch.manual_seed(0)
    model = Transformer(1, 8, 2, attention=AttentionConfig("linear"), causal=True).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64, requires_grad=True)

    def run(a, b, state):
        out, state = model(x[:, a:b], state=state, return_state=True)
        return out, state

    full = torch.cat(segmented_forward(run, 12, 4), 1)
    cut = torch.cat(segmented_forward(run, 12, 4, detach=True), 1)
    assert_close("values", full, cut)
    weights = torch.randn(8, dtype=torch.float64)  # not .sum(): the sum of a LayerNorm output is constant
    (g_full,) = torch.autograd.grad((full[:, -1] @ weights).sum(), x)
    (g_cut,) = torch.autograd.grad((cut[:, -1] @ weights).sum(), x)
    assert g_full[:, :8].abs().sum() > 0
    assert torch.equal(g_cut[:, :8], torch.zeros_like(g_cut[:, :8]))
    assert_close("last segment's own gradient", g_full[:, 8:], g_cut[:, 8:])


def test_segmented_copy_task_step_equals_one_pass():
    from linformer_lab.tasks.copy_task import CopyTask

    torch.manual_seed(0)
    task = CopyTask(attention="linear", vocab_size=12, sequence_length=20, d_model=16, n_layers=2, n_heads=2).double()
    tokens = torch.randint(1, 12, (3, 20))
    mask = torch.rand(3, 20) < 0.5
    want, *_ = task.copy_loss(tokens, mask)
    got, *_ = task.copy_loss(tokens, mask, segment_length=6)
    assert_close("loss", want, got)
    params = list(task.parameters())
    for w, g in zip(torch.autograd.grad(want, params), torch.autograd.grad(got, params)):
        assert_close("grad", w, g)


def test_segment_length_needs_a_recurrent_backend():
    from linformer_lab.tasks.copy_task import CopyTask
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    with pytest.raises(ValueError, match="'lsh' has no recurrent form"):
        CopyTask(attention="lsh", d_model=16, n_heads=2, n_layers=1, segment_length=8)
    with pytest.raises(ValueError, match="positive number of positions"):
        ImageGenerationTask(attention="linear", d_model=16, n_heads=2, n_layers=1, d_ff=16, segment_length=0)


def test_segmented_training_through_the_cli(tmp_path):
    """--model.segment_length and --model.detach_state through the real CLI: the copy task
    trains and logs a finite loss (docs/cli.md shows these flags)."""
    from conftest import read_metrics, run_cli, tiny_copy_args

    for extra in (["--model.segment_length=4"], ["--model.segment_length=4", "--model.detach_state=true"]):
        root = tmp_path / extra[-1].split("=")[0].strip("-").replace(".", "_")
        code, out, err = run_cli(["fit", *tiny_copy_args(root, "linear", "--trainer.max_epochs=1", *extra)])
        assert code == 0, err[-3000:]
        rows = read_metrics(next(root.glob("version_*")))
        losses = [r["train/loss"] for r in rows if "train/loss" in r]
        assert losses and all(torch.isfinite(torch.tensor(losses)))
        hparams = (next(root.glob("version_*")) / "hparams.yaml").read_text()
        assert "segment_length: 4" in hparams


def test_readme_segmented_mnist_command_through_the_cli(tmp_path):
    """The README's ``fit --config mnist_linear.yaml --model.segment_length 196
    --model.detach_state false``, at toy size (1 layer, 8 images): one segmented training
    step on real MNIST through the real CLI, and the settings reach the checkpoint."""
    from conftest import run_cli

    args = ["fit", "--config", "mnist_linear.yaml", "--model.segment_length", "196", "--model.detach_state", "false",
            "--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2", "--model.d_ff=32", "--model.num_mixtures=2",
            "--data.batch_size=4", "--data.limit_train=8", "--data.limit_val=4", "--data.limit_test=4",
            "--trainer.max_steps=2", "--trainer.precision=32-true", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.enable_progress_bar=false", "--trainer.num_sanity_val_steps=0", "--trainer.callbacks=[]",
            f"--trainer.default_root_dir={tmp_path}"]
    code, out, err = run_cli(args)
    assert code == 0, err[-3000:]
    ckpt = torch.load(tmp_path / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["hyper_parameters"]["segment_length"] == 196 and ckpt["hyper_parameters"]["detach_state"] is False
    assert ckpt["global_step"] == 2
