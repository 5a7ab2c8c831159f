"""The authors' copy-task recipe as CopyTask options (linformer_lab/tasks/copy_task.py,
configs/copy_authors_*.yaml): each option against a hand-computed expectation, its default
keeping our recipe, and both configs trained through the real CLI in a tiny run."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import checkpoint_dir, run_cli, tiny_copy_args

from linformer_lab.data.copy import make_copy_batch
from linformer_lab.tasks.copy_task import CopyTask

TINY = dict(vocab_size=12, sequence_length=25, d_model=16, n_heads=2, n_layers=1)


def _batch(seed: int = 0):
    return make_copy_batch(np.random.default_rng(seed), 3, 12, 10, min_length=2)


@pytest.mark.parametrize("d_model", [16, 10])
def test_concatenated_sinusoid_has_half_the_width_and_the_textbook_values(d_model):
    torch.manual_seed(0)
    task = CopyTask(**{**TINY, "d_model": d_model}, positions="sinusoid_concat")
    half = d_model // 2
    assert task.token_embedding.weight.shape == (12, d_model - half) and task.position_embedding is None
    assert "position_code" not in task.state_dict()  # fixed: rebuilt, not saved
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    embedded = task.embed(tokens, torch.arange(5))
    assert embedded.shape == (1, 5, d_model)
    torch.testing.assert_close(embedded[0, :, : d_model - half], task.token_embedding.weight[tokens[0]])
    for p in range(5):
        for i in range(half):
            angle = p / 10000 ** (2 * (i // 2) / half)
            want = math.sin(angle) if i % 2 == 0 else math.cos(angle)
            assert embedded[0, p, d_model - half + i].item() == pytest.approx(want, abs=1e-6)
    one = task.embed(tokens[:, 2], torch.full((1,), 2))  # the recurrent path's call: one position per row
    torch.testing.assert_close(one, embedded[:, 2])


def test_learned_positions_stay_the_default():
    task = CopyTask(**TINY)
    assert task.position_embedding.weight.shape == (25, 16) and task.token_embedding.weight.shape == (12, 16)
    with pytest.raises(ValueError, match="positions must be one of learned, sinusoid_concat, got 'rope'"):
        CopyTask(**TINY, positions="rope")


def test_clipping_per_parameter_bounds_each_tensor_on_its_own(monkeypatch):
    task = CopyTask(**TINY, clip_per_parameter=1.0)
    trainer_clip = []
    monkeypatch.setattr(L.LightningModule, "configure_gradient_clipping",
                        lambda self, *args: trainer_clip.append(args))
    params = list(task.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    big, small = params[0], params[1]
    big.grad.normal_().mul_(3.0 / big.grad.norm())  # norm 3: scaled to 1
    small.grad.normal_().mul_(0.5 / small.grad.norm())  # norm 0.5: kept (a global clip would scale it by 1/3)
    small_before = small.grad.clone()
    task.configure_gradient_clipping(None, None, None)
    assert big.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(small.grad, small_before)
    assert len(trainer_clip) == 1  # the trainer's own gradient_clip_val still applies after
    unclipped = CopyTask(**TINY)
    for p in unclipped.parameters():
        p.grad = torch.full_like(p, 5.0)
    unclipped.configure_gradient_clipping(None, None, None)
    assert all(bool((p.grad == 5.0).all()) for p in unclipped.parameters())  # the default clips nothing here
    with pytest.raises(ValueError, match="clip_per_parameter must be a positive number"):
        CopyTask(**TINY, clip_per_parameter=0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_decoupled_weight_decay_shrinks_the_weights_by_lr_times_decay(decoupled):
    task = CopyTask(**TINY, weight_decay=0.01, decoupled_weight_decay=decoupled, lr=1e-3)
    optimizer = task.configure_optimizers()["optimizer"]
    weight = task.head.weight
    before = weight.detach().clone()
    for p in task.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only the decay moves the weights
    optimizer.step()
    if decoupled:  # AdamW's form: w <- w (1 - lr wd), the moment estimates stay zero
        torch.testing.assert_close(weight.detach(), before * (1 - 1e-3 * 0.01), rtol=1e-7, atol=0)
    else:  # L2 added to the gradient: RAdam's first steps move w by lr times the (decayed) gradient's momentum
        assert not torch.allclose(weight.detach(), before * (1 - 1e-3 * 0.01), rtol=1e-7, atol=0)


def test_score_separator_adds_the_separator_to_the_training_loss():
    torch.manual_seed(0)
    task = CopyTask(**TINY, score_separator=True)
    tokens, target_mask = _batch()
    copy_loss, _, copy_count = task.copy_loss(tokens, target_mask)
    both_loss, _, both_count = task.copy_loss(tokens, target_mask, score_separator=True)
    assert both_count == copy_count + len(tokens)  # one separator per sequence
    logits = task(tokens[:, :-1]).float()
    separator = tokens[:, 1:] == 11
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    by_hand = (ce[target_mask[:, 1:]].sum() + ce[separator].sum()) / (copy_count + len(tokens))
    torch.testing.assert_close(both_loss, by_hand)
    torch.testing.assert_close(copy_loss, ce[target_mask[:, 1:]].mean())
    # validation keeps to the copy: comparable between the recipes
    monkey = {}
    task.log = lambda name, value, **kwargs: monkey.setdefault(name, value)
    task.validation_step((tokens, target_mask), 0)
    torch.testing.assert_close(monkey["val/loss"].compute(), copy_loss)  # a WeightedMean over copied tokens
    torch.testing.assert_close(task.training_step((tokens, target_mask), 0), both_loss)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "softmax"])
def test_the_authors_configs_train_through_the_cli(tmp_path, method):
    args = ["fit", "--config", f"copy_authors_{method}.yaml", *tiny_copy_args(tmp_path, method)[2:],
            "--trainer.max_steps=2", "--trainer.max_epochs=1"]
    code, _, err = run_cli(args)
    assert code == 0, err
    checkpoint = torch.load(checkpoint_dir(tmp_path) / "last.ckpt", map_location="cpu", weights_only=True)
    hp = checkpoint["hyper_parameters"]
    assert (hp["clip_per_parameter"], hp["weight_decay"], hp["decoupled_weight_decay"]) == (1.0, 0.01, True)
    assert (hp["norm_first"], hp["activation"], hp["positions"], hp["score_separator"]) == (False, "relu",
                                                                                         "sinusoid_concat", True)
    assert hp["attention"]["kwargs"] == ({"dropout": 0.1} if method == "softmax" else {})
    weights = checkpoint["state_dict"]
    assert "transformer.layers.0.norm_after_attention.weight" in weights and "position_embedding.weight" not in weights
    assert weights["token_embedding.weight"].shape == (12, 8)  # d_model 16: 8 for the tokens, 8 for the sinusoid
    optimizer = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert optimizer["decoupled_weight_decay"] and optimizer["weight_decay"] == 0.01
