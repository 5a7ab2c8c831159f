"""Converting a trained model to another attention (tasks/conversion.py): ``init_from``'s weight
transfer and its refusals, and attention distillation (Hedgehog's first stage) against an
independent float64 form of its loss."""

from __future__ import annotations

import pytest
import torch

from linformer_lab.ops.linear_attention import naive
from linformer_lab.ops.reference import softmax_similarity
from linformer_lab.tasks.conversion import (
    attention_weight_loss,
    check_conversion,
    differing_hparams,
    distill_feature_maps,
    feature_map_parameters,
    transfer_weights,
)
from linformer_lab.tasks.copy_task import CopyTask
from linformer_lab.validation import ConfigurationError

SHAPE = {"vocab_size": 8, "sequence_length": 24, "d_model": 16, "n_layers": 2, "n_heads": 2, "lr_decay_steps": None}


def _task(backend="softmax", feature_map=None, seed=0, **changes):
    torch.manual_seed(seed)
    attention = {"backend": backend, "feature_map": feature_map}
    return CopyTask(attention=attention, **{**SHAPE, **changes})


def _checkpoint(task) -> dict:
    """What the CLI's safe loader returns for a checkpoint of ``task``: its hparams and state dict."""
    return {"hyper_parameters": {**dict(task.hparams), "_class_path": "linformer_lab.tasks.copy_task.CopyTask"},
            "state_dict": task.state_dict()}


def test_init_from_loads_every_matching_weight_and_names_the_new_and_dropped_ones(capsys):
    teacher = _task("softmax")
    student = _task("linear", "hedgehog", seed=1)
    transfer = student.initialise_from(_checkpoint(teacher), "softmax.ckpt")
    map_weights = [n for n in student.state_dict() if ".feature_map." in n]
    assert sorted(transfer.new) == sorted(map_weights) and len(map_weights) == 2 * 4  # 2 layers x q/k weight, bias
    assert transfer.dropped == []
    for name, value in student.state_dict().items():
        if name in transfer.loaded:
            assert torch.equal(value, teacher.state_dict()[name]), name
    assert set(transfer.loaded) | set(transfer.new) == set(student.state_dict())
    printed = capsys.readouterr().out
    assert "attention softmax -> linear/hedgehog" in printed
    assert "new      transformer.layers.*.attention.attention.feature_map.query_map.weight      2" in printed
    # from one learned map to another: the old map's weights are dropped, the new one's are new
    t2r = _task("linear", "t2r")
    transfer = _task("linear", "hedgehog").initialise_from(_checkpoint(t2r), "t2r.ckpt")
    assert sorted(transfer.dropped) == sorted(n for n in t2r.state_dict() if ".feature_map." in n)


def test_init_from_refuses_another_task_or_architecture():
    teacher = _task("softmax")
    other_class = _checkpoint(teacher)
    other_class["hyper_parameters"]["_class_path"] = "linformer_lab.tasks.image_generation.ImageGenerationTask"
    with pytest.raises(ConfigurationError, match="belongs to another task .*ImageGenerationTask"):
        _task("linear").initialise_from(other_class, "mnist.ckpt")
    with pytest.raises(ConfigurationError, match="beyond its attention .*d_model: checkpoint 16, configuration 32"):
        _task("linear", d_model=32).initialise_from(_checkpoint(teacher), "small.ckpt")
    # lsh shares queries and keys: its projection has another shape, which no conversion can fill
    with pytest.raises(ConfigurationError, match="outside the attention have another shape .*attention.qkv.weight"):
        transfer_weights(_task("lsh"), teacher.state_dict(), "softmax.ckpt")


def test_differing_hparams_names_each_nested_entry_and_leaves_out_free_private_and_new_keys():
    saved = {"attention": {"backend": "softmax", "feature_map": None}, "d_model": 16, "lr": 1e-3,
             "kernel_sizes": [3, 5], "_class_path": "a.B", "d_ff": None}
    ours = {"attention": {"backend": "linear", "feature_map": None}, "d_model": 32, "lr": 5e-4,
            "kernel_sizes": (3, 5), "_class_path": "c.D", "d_ff": {}, "segment_length": 8}
    assert differing_hparams(saved, ours, free=("lr",)) == {
        "attention.backend": "attention.backend: checkpoint 'softmax', configuration 'linear'",
        "d_model": "d_model: checkpoint 16, configuration 32",
    }
    assert differing_hparams(saved, ours, free=("lr", "attention", "d_model")) == {}


def test_distillation_needs_init_from_a_softmax_teacher_and_a_learned_map():
    with pytest.raises(ValueError, match="distill_steps=5 needs init_from"):
        check_conversion(None, 5, 1e-3)
    with pytest.raises(ValueError, match="distill_lr must be"):
        check_conversion("x.ckpt", 5, 0.0)
    teacher = _task("softmax")
    with pytest.raises(ConfigurationError, match="elu' has no weights to train"):
        _task("linear", init_from="x.ckpt", distill_steps=3).initialise_from(_checkpoint(teacher), "x.ckpt")
    with pytest.raises(ConfigurationError, match="teacher .* has 'linear' attention"):
        _task("linear", "t2r", init_from="x.ckpt", distill_steps=3).initialise_from(_checkpoint(_task("linear")), "x.ckpt")


def test_attention_weight_loss_is_the_cross_entropy_of_the_row_normalised_maps():
    """Against the weights of both attentions from the O(N^2) forms: eq. 2 / eq. 9 with the identity as
    values (each output row is then that query's attention weights), in float64."""
    from linformer_lab.feature_maps import build_feature_map

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 9, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    fm = build_feature_map("hedgehog", query_dim=4).double()
    identity = torch.eye(9, dtype=torch.float64).expand(2, 3, 9, 9)
    for causal, key_lengths in ((True, None), (False, torch.tensor([9, 5]))):
        teacher = naive.attention_from_similarity(softmax_similarity(q, k), identity, causal, key_lengths)
        student = naive.attention_from_similarity(naive.kernel_similarity(fm.forward_queries(q), fm.forward_keys(k)),
                                                  identity, causal, key_lengths, eps=1e-6)
        want = -(teacher * torch.log(student.clamp_min(1e-300))).sum(-1).mean()
        got = attention_weight_loss(fm, q, k, causal, key_lengths, eps=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("feature_map", ["hedgehog", "t2r"])
def test_distillation_lowers_the_attention_loss_and_trains_only_the_feature_maps(feature_map):
    teacher = _task("softmax").eval().requires_grad_(False)
    with torch.no_grad():  # larger queries and keys: peaked attention, far from what a fresh map gives
        for layer in teacher.transformer.layers:
            layer.attention.qkv.weight.mul_(4.0)
    student = _task("linear", feature_map, seed=1, init_from="x.ckpt", distill_steps=40)
    student.initialise_from(_checkpoint(teacher), "x.ckpt")
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randint(1, 8, (4, 24), generator=gen), None) for _ in range(4)]
    losses = distill_feature_maps(student, teacher, batches, lambda batch: teacher(batch[0]), steps=40, lr=1e-2)
    assert len(losses) == 40
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses
    trained = {id(p) for p in feature_map_parameters(student)}
    for name, p in student.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (id(p) in trained), f"{name}: changed={changed}"


def test_image_task_builds_its_teacher_from_the_checkpoint_and_distills_on_images():
    """ImageGenerationTask: the teacher that initialise_from builds is the checkpoint's softmax model
    (its weights, frozen); distillation on image batches through forward_batch lowers the loss."""
    from linformer_lab.tasks.image_generation import ImageGenerationTask

    shape = dict(image_shape=(1, 4, 4), n_layers=1, n_heads=2, d_model=16, d_ff=32, num_mixtures=2)
    torch.manual_seed(0)
    softmax = ImageGenerationTask(attention="softmax", **shape)
    with torch.no_grad():
        softmax.model.transformer.layers[0].attention.qkv.weight.mul_(4.0)  # peaked attention to learn
    checkpoint = {"hyper_parameters": dict(softmax.hparams), "state_dict": softmax.state_dict()}
    student = ImageGenerationTask(attention={"backend": "linear", "feature_map": "hedgehog"}, init_from="s.ckpt",
                                  distill_steps=30, **shape)
    student.initialise_from(checkpoint, "s.ckpt")
    teacher = student.distillation.teacher
    assert teacher.attention_config.backend == "softmax" and not teacher.training
    assert all(torch.equal(v, softmax.state_dict()[k]) for k, v in teacher.state_dict().items())
    assert not any(p.requires_grad for p in teacher.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (4, 1, 4, 4), generator=gen, dtype=torch.uint8), torch.zeros(4)) for _ in range(3)]
    losses = distill_feature_maps(student, teacher, batches, teacher.forward_batch, steps=30, lr=1e-2)
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
