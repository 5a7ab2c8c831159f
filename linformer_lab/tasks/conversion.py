"""Turning a trained model into one with another attention: ``init_from`` and attention distillation.

``init_from`` (:func:`transfer_weights`): a checkpoint of the same task with another attention (a
softmax model, say) gives the new model every weight whose name and shape match; weights only the
new attention has (a learned feature map's) keep their initial values, those only the old had are
dropped. Most linear-attention models are made so today (Kasai et al. 2021, T2R; Zhang et al.
2024, Hedgehog): convert a trained softmax model, then fine-tune briefly.

Attention distillation (:func:`distill_feature_maps`), Hedgehog's first stage: before fine-tuning,
only the feature maps' weights train, so that each layer's linear attention weights
``phi(q_i)^T phi(k_j) / sum_j' phi(q_i)^T phi(k_j')`` match the teacher's softmax weights on the
training data (cross-entropy between the row-normalised maps). The teacher is the checkpoint's own
softmax model; its queries and keys feed both, so every layer learns from the attention it
replaces. Each layer's loss is back-propagated before the next one's ``(B, H, N, N)`` maps form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from linformer_lab.attention.base import Attention
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.tasks.export import init_arguments
from linformer_lab.validation import ConfigurationError, check_at_least, check_positive


@dataclass
class WeightTransfer:
    """What :func:`transfer_weights` did: the state-dict names ``loaded`` from the checkpoint, ``new``
    (the model's, not in the checkpoint, or of another shape inside an attention backend: kept as
    initialised) and ``dropped`` (the checkpoint's that the model has no place for)."""

    loaded: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def table(self, model_state: dict, checkpoint_state: dict) -> str:
        """One table, a row per kind of weight: layer indices folded into ``*`` (``layers.*.attention.qkv.weight``
        stands for one per layer), with how many and their parameter count."""
        rows = [("", "weights", "count", "values")]
        for status, names, state in (("loaded", self.loaded, model_state), ("new", self.new, model_state),
                                     ("dropped", self.dropped, checkpoint_state)):
            groups: dict[str, list[str]] = {}
            for name in names:
                groups.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
            if not groups:
                rows.append((status, "(none)", "0", "0"))
            for pattern, members in groups.items():
                values = sum(state[n].numel() for n in members)
                rows.append((status, pattern, str(len(members)), f"{values:,}"))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join(f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}".rstrip()
                         for a, b, c, d in rows)


def transfer_weights(model: nn.Module, checkpoint_state: dict, source: str) -> WeightTransfer:
    """Load into ``model`` every tensor of ``checkpoint_state`` whose name and shape it has; returns
    what was loaded, new and dropped. A weight outside the attention backends with the same name
    but another shape is a :class:`ConfigurationError` naming it (another architecture: nothing is
    loaded); inside a backend it is new (a feature map of another size)."""
    own = model.state_dict()
    inside_attention = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, Attention))
    mismatched = [name for name, tensor in own.items()
                  if name in checkpoint_state and tuple(checkpoint_state[name].shape) != tuple(tensor.shape)]
    fixed = [name for name in mismatched if not name.startswith(inside_attention)]
    if fixed:
        shapes = "; ".join(f"{n}: checkpoint {tuple(checkpoint_state[n].shape)}, model {tuple(own[n].shape)}"
                           for n in fixed[:3])
        raise ConfigurationError(
            f"init_from {source}: {len(fixed)} weights outside the attention have another shape ({shapes}"
            f"{'; ...' if len(fixed) > 3 else ''}); init_from takes a checkpoint of the same architecture with another "
            f"attention (a backend whose projections differ, such as lsh's shared query/key, cannot be converted)"
        )
    transfer = WeightTransfer(
        loaded=[n for n in own if n in checkpoint_state and n not in mismatched],
        new=[n for n in own if n not in checkpoint_state or n in mismatched],
        dropped=[n for n in checkpoint_state if n not in own or n in mismatched],
    )
    model.load_state_dict({n: checkpoint_state[n] for n in transfer.loaded}, strict=False)
    return transfer


def differing_hparams(saved: dict, ours: dict, free: Iterable[str]) -> dict[str, str]:
    """The hyper-parameters in which a checkpoint's ``saved`` differ from ``ours``, each as
    ``{key: "key: checkpoint X, configuration Y"}`` in key order. Nested dicts (and dataclasses) are
    compared entry by entry (``attention.backend``); keys whose top level is ``free`` or starts with
    ``_`` (Lightning's ``_class_path``), and keys only ``ours`` has, are left out."""
    free = set(free)
    theirs, ours = _flatten(saved), _flatten(ours)
    return {key: f"{key}: checkpoint {theirs[key]!r}, configuration {ours[key]!r}" for key in sorted(theirs)
            if key in ours and key.split(".")[0] not in free and not key.startswith("_") and not _same(theirs[key], ours[key])}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "__dataclass_fields__"):
            v = {f: getattr(v, f) for f in v.__dataclass_fields__}
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a in (None, {}) and b in (None, {}):
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def check_same_settings(saved: dict, ours: dict, free: Iterable[str], source: str) -> None:
    """A :class:`ConfigurationError` naming the hyper-parameters (other than the attention and the
    ``free`` ones, which a converted model may change) in which the checkpoint's ``saved`` differ from ``ours``."""
    differ = list(differing_hparams(saved, ours, {*free, "attention"}).values())
    if differ:
        raise ConfigurationError(
            f"init_from {source}: the checkpoint's model differs from the configured one beyond its attention "
            f"({'; '.join(differ[:4])}{'; ...' if len(differ) > 4 else ''}); set these as the checkpoint has them"
        )


# ---------------------------------------------------------------------- attention distillation


def attention_weight_loss(feature_map: nn.Module, q: torch.Tensor, k: torch.Tensor, causal: bool,
                          key_lengths: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Cross-entropy of the linear attention weights under the softmax weights, per query row, averaged.

    q ``(B, H, N, D)``, k ``(B, H, L, D)`` (the teacher's, no gradient); keys past ``key_lengths[b]``
    and, ``causal``, after the query are invisible to both. Teacher: ``softmax(q k^T / sqrt(D))``;
    student: ``phi(q) phi(k)^T`` over its row sum (+ ``eps``, as the attention adds). Computed in at
    least fp32; the gradient reaches ``feature_map``'s weights only.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k = q.detach().to(compute), k.detach().to(compute)
    n, length = q.shape[-2], k.shape[-2]
    visible = torch.ones(n, length, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    visible = visible.expand(q.shape[0], 1, n, length)
    if key_lengths is not None:
        visible = visible & (torch.arange(length, device=q.device) < key_lengths[:, None])[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    teacher = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # no key: row of 0
    similarity = (feature_map.forward_queries(q) @ feature_map.forward_keys(k).transpose(-1, -2)).to(compute) * visible
    student = similarity / (similarity.sum(-1, keepdim=True) + eps)
    rows = teacher.sum(-1)  # 1 for a query that sees a key, 0 otherwise
    cross_entropy = -(teacher * torch.log(student.clamp_min(torch.finfo(compute).tiny))).sum(-1)
    return cross_entropy.sum() / rows.sum().clamp_min(1)


def feature_map_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the feature maps of ``model``'s attention backends (learned maps: t2r,
    hedgehog, rebased), the only ones distillation trains."""
    found = []
    for module in model.modules():
        if isinstance(module, Attention) and isinstance(getattr(module, "feature_map", None), nn.Module):
            found += [p for p in module.feature_map.parameters() if p.requires_grad]
    return found


def teacher_attention_inputs(teacher: nn.Module, run: Callable[[], object]) -> dict[str, tuple]:
    """``run()`` the teacher (without gradients) and return, per attention backend (by module name),
    the ``(q, k, key_lengths)`` it was called with."""
    seen: dict[str, tuple] = {}
    handles = []
    for name, module in teacher.named_modules():
        if isinstance(module, Attention):
            def keep(module, args, kwargs, name=name):
                seen[name] = (args[0], args[1], kwargs.get("key_lengths"))
            handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def distill_step(student: nn.Module, teacher: nn.Module, run_teacher: Callable[[], object]) -> float:
    """One distillation batch: the teacher's queries and keys of every layer, then per layer the
    :func:`attention_weight_loss` of the student's feature map of the same name, back-propagated at
    once (one layer's maps in memory at a time). Accumulates gradients; returns the mean loss."""
    student_backends = {name: m for name, m in student.named_modules() if isinstance(m, Attention)}
    inputs = teacher_attention_inputs(teacher, run_teacher)
    if not inputs:
        raise ConfigurationError("attention distillation: the teacher ran no attention layer on the batch")
    total = 0.0
    for name, (q, k, key_lengths) in inputs.items():
        backend = student_backends[name]
        loss = attention_weight_loss(backend.feature_map, q, k, backend.causal, key_lengths, getattr(backend, "eps", 1e-6))
        (loss / len(inputs)).backward()
        total += loss.item()
    return total / len(inputs)


def distill_feature_maps(student: nn.Module, teacher: nn.Module, batches: Iterable, run_teacher: Callable,
                         steps: int, lr: float, reduce_gradient: Callable | None = None,
                         report: Callable[[int, float], None] | None = None) -> list[float]:
    """Hedgehog's first stage: ``steps`` Adam updates of the student's feature-map weights alone,
    each on one batch (cycling through ``batches``), ``run_teacher(batch)`` running the teacher on it.
    ``reduce_gradient(tensor) -> tensor`` averages a gradient over processes (DDP); ``report(step,
    loss)`` hears every loss. Returns the losses, one per update."""
    parameters = feature_map_parameters(student)
    optimizer = torch.optim.Adam(parameters, lr=lr)
    losses: list[float] = []
    while len(losses) < steps:
        before = len(losses)
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = distill_step(student, teacher, lambda batch=batch: run_teacher(batch))
            if reduce_gradient is not None:
                for p in parameters:
                    if p.grad is not None:
                        p.grad.copy_(reduce_gradient(p.grad))
            optimizer.step()
            losses.append(loss)
            if report is not None:
                report(len(losses), loss)
            if len(losses) == steps:
                break
        if len(losses) == before:
            raise ConfigurationError("attention distillation: the training data yielded no batch")
    return losses


# ---------------------------------------------------------------- a task's conversion (init_from, distill_steps)


@dataclass
class Distillation:
    """Attention distillation still to run: the frozen ``teacher`` task, the updates and their Adam rate."""

    teacher: nn.Module
    steps: int
    lr: float


def check_conversion(init_from: str | None, distill_steps: int, distill_lr: float) -> None:
    """The task arguments of converting a trained model: ``distill_steps`` needs ``init_from``."""
    check_at_least("distill_steps", distill_steps, 0, "updates of attention distillation")
    check_positive("distill_lr", distill_lr, "Adam learning rate of attention distillation")
    if distill_steps and not init_from:
        raise ValueError(f"distill_steps={distill_steps} needs init_from: the softmax checkpoint whose attention "
                         f"weights the feature maps learn to match")


def initialise_from(task, checkpoint: dict, source: str) -> WeightTransfer:
    """Start ``task`` from ``checkpoint`` (loaded, of the same task with another attention):
    :func:`transfer_weights`, then a table of what was loaded, new and dropped is printed. Another
    task or architecture is a :class:`ConfigurationError`. With ``distill_steps``, the teacher is
    built and kept as ``task.distillation`` for ``on_train_start`` (:func:`distill_attention`)."""
    saved = dict(checkpoint.get("hyper_parameters") or {})
    want = f"{type(task).__module__}.{type(task).__qualname__}"
    if saved.get("_class_path", want) != want:
        raise ConfigurationError(f"init_from {source}: the checkpoint belongs to another task ({saved['_class_path']}); "
                                 f"the configuration builds {want}")
    check_same_settings(saved, dict(task.hparams), task.hparams_free_to_change, source)
    state = checkpoint["state_dict"]
    transfer = transfer_weights(task, state, source)
    teacher_attention = AttentionConfig.coerce(saved.get("attention"))
    steps = int(task.hparams.get("distill_steps") or 0)
    if steps:
        task.distillation = Distillation(_teacher(task, teacher_attention, state, source), steps,
                                         float(task.hparams.get("distill_lr", 1e-3)))
    if rank_zero_only.rank == 0:
        print(f"init_from {source}: attention {_attention_name(teacher_attention)} -> "
              f"{_attention_name(AttentionConfig.coerce(task.hparams.get('attention')))}\n"
              f"{transfer.table(task.state_dict(), state)}")
    task.init_from_applied = True
    return transfer


def _teacher(task, attention: AttentionConfig, state: dict, source: str) -> nn.Module:
    """``task``'s class with the checkpoint's attention and weights, frozen: distillation's teacher."""
    if attention.backend != "softmax":
        raise ConfigurationError(f"distill_steps: the teacher ({source}) has {attention.backend!r} attention; attention "
                                 f"distillation matches softmax attention weights, so init_from must be a softmax model")
    if not feature_map_parameters(task):
        raise ConfigurationError(
            f"distill_steps: feature map {task.hparams['attention'].get('feature_map') or 'elu'!r} has no weights to "
            f"train; distillation needs a learned one (t2r, hedgehog, rebased)")
    teacher = type(task)(**{**init_arguments(task), "attention": attention.to_hparams()})
    teacher.load_state_dict(state)
    return teacher.eval().requires_grad_(False)


def distill_attention(task) -> list[float]:
    """:func:`distill_feature_maps` on ``task``'s training data before its first update, the loss
    printed now and then and logged as ``distill/attention_loss``. Returns the losses."""
    trainer, plan = task.trainer, task.distillation
    teacher = plan.teacher.to(task.device)
    strategy = trainer.strategy

    def report(step: int, loss: float) -> None:
        for logger in trainer.loggers:
            logger.log_metrics({"distill/attention_loss": loss}, step=step - 1)
        if step == 1 or step == plan.steps or step % 100 == 0:
            task.print(f"attention distillation: update {step} of {plan.steps}, loss {loss:.4f}")

    reduce = (lambda grad: strategy.reduce(grad, reduce_op="mean")) if trainer.world_size > 1 else None
    return distill_feature_maps(task, teacher, trainer.train_dataloader,
                                lambda batch: teacher.forward_batch(strategy.batch_to_device(batch)),
                                plan.steps, plan.lr, reduce, report)


def _attention_name(config: AttentionConfig) -> str:
    return config.backend + (f"/{config.feature_map}" if config.feature_map else "")
