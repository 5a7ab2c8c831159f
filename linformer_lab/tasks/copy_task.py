"""The copy task of paper §4.1.1 (sequence duplication) as a LightningModule.

A causal transformer reads ``[s_1 .. s_L, SEP, s_1 .. s_L, 0 ..]`` and is trained to predict
every token from the ones before it; only the copy is predictable, so the loss is the
cross-entropy on the copied positions alone (``target_mask`` of the batch, docs/ARCHITECTURE.md, "Contracts").

Model (paper: "a 4 layer transformer with 8 attention heads"; the width is not given, so we
use the image experiments' 256 = 8 heads x 32 dims, feed-forward 4 x 256):

    tokens (B, N) -> token embedding + learned position embedding (B, N, d_model)
                  -> Transformer (causal, any registered attention) -> Linear -> logits (B, N, V)

Optimisation as in the paper: RAdam, lr 1e-3, divided by 10 after 3000 optimizer updates.

**The authors' recipe.** Their copy-task script differs from ours in six places, each an option
(see Args) whose default keeps ours; ``configs/copy_authors_{linear,softmax}.yaml`` turn them all on:
``clip_per_parameter=1.0``, ``weight_decay=0.01`` with ``decoupled_weight_decay=True``, the softmax
backend's ``dropout: 0.1`` on the attention weights (``attention.kwargs``), ``norm_first=False``
with ``activation="relu"``, ``positions="sinusoid_concat"`` and ``score_separator=True``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.transformer import Transformer, segmented_forward, sinusoidal_positions
from linformer_lab.tasks.base import Task, WeightedMean, check_segment_length
from linformer_lab.tasks.conversion import check_conversion
from linformer_lab.validation import check_at_least, check_non_negative, check_positive, check_transformer_shape

#: ``positions``: a learned embedding added to the tokens' (ours), or the authors' fixed sinusoid concatenated
POSITIONS = ("learned", "sinusoid_concat")


class CopyTask(Task):
    """Causal transformer on the copy task.

    Args:
        attention: which attention every layer uses (``backend``, ``feature_map``, ``kwargs``), or a
            backend name alone (``softmax``: that backend, the other fields at their defaults).
        vocab_size: number of token ids: padding 0, symbols, separator (CopyDataModule.vocab_size;
            the CLI links it from the data module).
        sequence_length: width N of the batches (CopyDataModule.sequence_length, linked by the CLI);
            sizes the position embedding.
        d_model, n_layers, n_heads, d_ff (default 4 d_model), dropout: transformer shape.
        lr: initial RAdam learning rate.
        lr_decay_steps: optimizer updates after which the learning rate is multiplied by
            ``lr_decay_factor`` (paper: 3000 and 0.1); None keeps it constant.
        weight_decay: RAdam weight decay.
        segment_length: train on consecutive segments of this many tokens with the attention
            state carried across (None: the whole sequence at once); peak memory then follows the
            segment (:func:`~linformer_lab.models.transformer.segmented_forward`).
        detach_state: cut the gradient at segment boundaries (truncated back-propagation
            through time).
        init_from: a checkpoint of this task with another attention (a trained softmax copy
            model, ``configs/copy_convert_*.yaml``) to start ``fit`` from: every weight whose name
            and shape match is loaded and a table of what loaded is printed; the rest (a learned
            feature map's) keeps its initial values. A run resumed from its own checkpoint does not read it.
        distill_steps: before the first update, this many updates of attention distillation
            (Hedgehog's first stage): only the feature maps' weights train, to match the softmax
            attention weights of the ``init_from`` model on the copy sequences; 0 = none.
        distill_lr: Adam learning rate of those updates.
        decoupled_weight_decay: RAdam's weight decay applied to the weights directly (AdamW's),
            not added to the gradient.
        clip_per_parameter: clip the gradient of every parameter tensor to this norm on its own
            (None: no clipping; the trainer's ``gradient_clip_val`` still clips the global norm).
        norm_first, activation: pre-norm (True) or post-norm layers; ``"gelu"`` or ``"relu"``.
        positions: ``"learned"`` (an embedding added to the tokens') or ``"sinusoid_concat"``
            (Vaswani et al.'s fixed sinusoid of d_model // 2 dimensions after a token embedding of the rest).
        score_separator: the training loss also scores the separator (its position is the
            random length); validation and test keep to the copy, comparable across recipes.
        context_parallel: P, the processes that split every sequence of a batch into P
            consecutive segments (:func:`~linformer_lab.attention.context_parallel.context_parallel`),
            P consecutive ranks per batch, P dividing the processes; 1: whole sequences. Losses,
            metrics and weights are those of one process on the same global batch; generation
            (``predict``) runs whole sequences on every process.

    Batches: ``(tokens int64 (B, N), target_mask bool (B, N))``. ``forward(tokens (B, n)) ->
    logits (B, n, vocab_size)`` for any n <= sequence_length.
    """

    monitor = "val/loss"
    monitor_mode = "min"
    hparams_free_to_change = ("lr", "lr_decay_steps", "lr_decay_factor", "weight_decay", "dropout", "segment_length",
                              "detach_state", "init_from", "distill_steps", "distill_lr",
                              "decoupled_weight_decay", "clip_per_parameter", "score_separator", "context_parallel")
    hparams_of_the_optimizer = ("lr", "lr_decay_steps", "lr_decay_factor", "weight_decay", "decoupled_weight_decay")

    def __init__(
        self,
        attention: AttentionConfig | str | None = None,
        vocab_size: int = 12,
        sequence_length: int = 257,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 8,
        d_ff: int | None = None,
        dropout: float = 0.0,
        lr: float = 1e-3,
        lr_decay_steps: int | None = 3000,
        lr_decay_factor: float = 0.1,
        weight_decay: float = 0.0,
        segment_length: int | None = None,
        detach_state: bool = False,
        init_from: str | None = None,
        distill_steps: int = 0,
        distill_lr: float = 1e-3,
        decoupled_weight_decay: bool = False,
        clip_per_parameter: float | None = None,
        norm_first: bool = True,
        activation: str = "gelu",
        positions: str = "learned",
        score_separator: bool = False,
        context_parallel: int = 1,
    ):
        super().__init__()
        check_transformer_shape(d_model, n_heads, n_layers, d_ff, dropout)
        if clip_per_parameter is not None:
            check_positive("clip_per_parameter", clip_per_parameter, "largest gradient norm of one parameter tensor")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, got {positions!r}")
        if positions == "sinusoid_concat" and d_model < 2:
            raise ValueError(f"positions='sinusoid_concat' splits d_model between tokens and positions: d_model >= 2, "
                             f"got {d_model}")
        check_at_least("vocab_size", vocab_size, 2, "token ids: padding, symbols and separator")
        check_at_least("sequence_length", sequence_length, 1, "positions of the position embedding")
        check_positive("lr", lr, "learning rate")
        check_at_least("lr_decay_steps", lr_decay_steps, 1, "optimizer updates before the decay", allow_none=True)
        check_positive("lr_decay_factor", lr_decay_factor, "factor applied to the learning rate")
        check_non_negative("weight_decay", weight_decay)
        check_conversion(init_from, distill_steps, distill_lr)
        self.save_hyperparameters()
        # the public edge: the user's form becomes a config here, the Transformer takes that
        attention = self.store_attention(AttentionConfig.coerce(attention))
        self.sequence_length = sequence_length

        learned = positions == "learned"
        self.token_embedding = nn.Embedding(vocab_size, d_model if learned else d_model - d_model // 2)
        self.position_embedding = nn.Embedding(sequence_length, d_model) if learned else None
        self.transformer = Transformer(
            n_layers, d_model, n_heads, d_ff, causal=True, dropout=dropout, attention=attention, norm_first=norm_first,
            activation=activation,
        )
        self.head = nn.Linear(d_model, vocab_size)
        check_segment_length(segment_length, self.transformer, attention.backend)
        self.set_context_parallel(context_parallel, segment_length=segment_length)
        # evaluation loss and accuracy per copied token, over all processes
        self.eval_means = nn.ModuleDict({f"{stage}_{name}": WeightedMean()
                                         for stage in ("val", "test") for name in ("loss", "accuracy")})
        if learned:
            # GPT-style small embeddings (std 0.02 rather than nn.Embedding's N(0, 1)): the residual
            # stream then starts at the scale of what the layers add to it.
            nn.init.normal_(self.token_embedding.weight, std=0.02)
            nn.init.normal_(self.position_embedding.weight, std=0.02)
        else:  # the authors': nn.Embedding's N(0, 1) beside the unit sinusoid, which is fixed (rebuilt, not saved)
            self.register_buffer("position_code", sinusoidal_positions(sequence_length, d_model // 2), persistent=False)

    # ------------------------------------------------------------------ model

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: int64 of shapes that broadcast to S -> (*S, d_model)."""
        if self.position_embedding is not None:
            return self.token_embedding(tokens) + self.position_embedding(positions)
        embedded, code = self.token_embedding(tokens), self.position_code[positions]
        shape = torch.broadcast_shapes(embedded.shape[:-1], code.shape[:-1])
        return torch.cat([embedded.expand(*shape, -1), code.to(embedded.dtype).expand(*shape, -1)], dim=-1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 (B, n) -> logits (B, n, vocab_size); position i sees tokens <= i (under context
        parallelism: tokens is this rank's segment, and it sees the earlier ranks' too)."""
        n = tokens.shape[1]
        start = 0 if self.context_group is None else dist.get_rank(self.context_group) * n
        if start + n > self.sequence_length:
            raise ValueError(
                f"CopyTask was built for sequences of at most sequence_length={self.sequence_length} "
                f"tokens, got {start + n}; set model.sequence_length (the data module's sequence_length)"
            )
        positions = torch.arange(start, start + n, device=tokens.device)
        return self.head(self.transformer(self.embed(tokens, positions)))

    def segment_logits(self, tokens: torch.Tensor, start: int, stop: int, state=None):
        """Logits of positions ``start..stop-1`` given the state after ``< start``:
        ``((B, stop - start, vocab_size), state)``; chained over segments it equals :meth:`forward`."""
        positions = torch.arange(start, stop, device=tokens.device)
        hidden, state = self.transformer(self.embed(tokens[:, start:stop], positions), state=state, return_state=True)
        return self.head(hidden), state

    def copy_loss(self, tokens: torch.Tensor, target_mask: torch.Tensor, segment_length: int | None = None,
                  score_separator: bool = False):
        """Teacher-forced next-token loss on the copied positions (and the separator's, with
        ``score_separator``).

        Returns ``(loss, correct, count)``: mean cross-entropy over the scored tokens, and how many
        of the ``count`` scored tokens the greedy argmax predicts right.
        """
        if score_separator:
            target_mask = target_mask | (tokens == self.hparams.vocab_size - 1)
        # token t+1 from tokens <= t: the last column is never an input
        inputs = tokens[:, :-1]
        targets, mask = tokens[:, 1:], target_mask[:, 1:]
        if self.context_group is not None:
            start, stop = self.context_positions(inputs.shape[1])
            logits = self(inputs[:, start:stop])
            targets, mask = targets[:, start:stop], mask[:, start:stop]
        elif segment_length:
            pieces = segmented_forward(lambda a, b, state: self.segment_logits(inputs, a, b, state), inputs.shape[1],
                                       segment_length, self.hparams.detach_state)
            logits = torch.cat(pieces, dim=1)
        else:
            logits = self(inputs)  # (B, N-1, V)
        picked_logits, picked_targets = logits[mask].float(), targets[mask]  # (T, V), (T,)
        if self.context_group is not None:  # a segment may hold no copied token: a loss of 0, not NaN
            loss = F.cross_entropy(picked_logits, picked_targets, reduction="sum") / max(picked_targets.numel(), 1)
        else:
            loss = F.cross_entropy(picked_logits, picked_targets)
        correct = (picked_logits.argmax(-1) == picked_targets).sum()
        return loss, correct, picked_targets.numel()

    def forward_batch(self, batch) -> torch.Tensor:
        tokens, target_mask = batch
        return self.copy_loss(tokens, target_mask)[0]

    # ------------------------------------------------------------------ Lightning

    def training_step(self, batch, batch_idx):
        tokens, target_mask = batch
        loss, _, count = self.copy_loss(tokens, target_mask, self.hparams.get("segment_length"),
                                        self.hparams.get("score_separator", False))
        # per copied token over the global batch of all processes (Task.global_mean)
        loss, mean = self.global_mean(loss * count, count)
        self.log("train/loss", mean, prog_bar=True, batch_size=tokens.shape[0])
        return loss

    def _evaluate(self, batch, stage: str):
        tokens, target_mask = batch
        loss, correct, count = self.copy_loss(tokens, target_mask)
        # weighted by the copied tokens: the epoch's value is the mean over all of them, however batched
        mean_loss, accuracy = self.eval_means[f"{stage}_loss"], self.eval_means[f"{stage}_accuracy"]
        mean_loss.update(loss, count)
        accuracy.update(correct / max(count, 1), count)
        self.log(f"{stage}/loss", mean_loss, prog_bar=True, on_epoch=True, batch_size=tokens.shape[0])
        self.log(f"{stage}/accuracy", accuracy, on_epoch=True, batch_size=tokens.shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test")

    #: decoded sequences ``predict`` prints at its end
    predict_examples = 3

    def on_predict_epoch_start(self) -> None:
        self._predict_tally = {"correct": 0, "copied": 0, "exact": 0, "sequences": 0, "examples": []}

    def predict_step(self, batch, batch_idx):
        """Greedy copy through the recurrent path: ``{"tokens", "predicted", "target_mask",
        "exact"}``, ``predicted`` holding the model's copy at the copy positions, ``exact`` (B,)
        whether a sequence was copied without an error. ``predict`` ends by printing the accuracy
        and a few decoded sequences."""
        tokens, target_mask = batch
        predicted = self.generate_copy(tokens, target_mask)
        errors = (predicted != tokens) & target_mask
        exact = ~errors.any(dim=1)
        tally = getattr(self, "_predict_tally", None)
        # under context parallelism every process of a group predicts the same batch: one counts it
        if tally is not None and (self.context_group is None or dist.get_rank(self.context_group) == 0):
            tally["correct"] += int((target_mask & ~errors).sum())
            tally["copied"] += int(target_mask.sum())
            tally["exact"] += int(exact.sum())
            tally["sequences"] += len(tokens)
            for row in range(min(len(tokens), self.predict_examples - len(tally["examples"]))):
                tally["examples"].append(self.describe_copy(tokens[row], predicted[row], target_mask[row]))
        return {"tokens": tokens, "predicted": predicted, "target_mask": target_mask, "exact": exact}

    def on_predict_epoch_end(self) -> None:
        tally = self.summed_predict_tally(("correct", "copied", "exact", "sequences"))
        if tally is None:
            return
        self.print(f"copy accuracy {tally['correct'] / max(tally['copied'], 1):.4f} ({tally['correct']} of "
                   f"{tally['copied']} copied symbols, greedy from the prefix alone); "
                   f"{tally['exact']} of {tally['sequences']} sequences copied without an error")
        for line in tally["examples"]:
            self.print(line)

    def describe_copy(self, tokens: torch.Tensor, predicted: torch.Tensor, target_mask: torch.Tensor) -> str:
        """One sequence as text: ``given 3 1 4 | copied 3 1 5 (1 wrong: 5 for 4)``; symbols are
        their ids 1..num_symbols, ``|`` the separator. tokens, predicted int64 (N,), target_mask bool (N,)."""
        separator = self.hparams.vocab_size - 1
        given = [int(t) for t, m in zip(tokens.tolist(), target_mask.tolist()) if not m and t not in (0, separator)]
        want = tokens[target_mask].tolist()
        got = predicted[target_mask].tolist()
        wrong = [f"{g} for {w}" for g, w in zip(got, want) if g != w]
        verdict = "exact" if not wrong else f"{len(wrong)} wrong: {', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}"
        return f"  given {' '.join(map(str, given))} | copied {' '.join(map(str, got))} ({verdict})"

    @torch.no_grad()
    def generate_copy(self, tokens: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
        """Autoregressive greedy decoding with ``Transformer.step`` (paper §3.4), the readable loop
        (:mod:`linformer_lab.models.generation` holds the fast one).

        The model reads each sequence up to and including its separator, then is fed its own argmax
        predictions. Returns int64 (B, N): ``tokens`` with the copy positions generated.
        """
        b, n = tokens.shape
        out = tokens.clone()
        state, x_t = None, tokens[:, 0]
        for t in range(n - 1):
            positions = torch.full((b,), t, device=tokens.device)
            hidden, state = self.transformer.step(self.embed(x_t, positions), state)
            guess = self.head(hidden).argmax(-1)  # prediction for position t + 1
            # the prefix, separator and trailing padding are given (padding follows the copy: no help)
            out[:, t + 1] = torch.where(target_mask[:, t + 1], guess, tokens[:, t + 1])
            x_t = out[:, t + 1]
        return out

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """``clip_per_parameter``'s clipping (the authors' recipe), then the trainer's ``gradient_clip_val``."""
        limit = self.hparams.get("clip_per_parameter")
        if limit is not None:
            for parameter in self.parameters():
                if parameter.grad is not None:
                    nn.utils.clip_grad_norm_(parameter, limit)
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.RAdam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay,
                                      decoupled_weight_decay=hp.get("decoupled_weight_decay", False))
        if hp.lr_decay_steps is None:
            return optimizer
        # interval "step": the paper's schedule counts gradient updates, not epochs.
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[hp.lr_decay_steps], gamma=hp.lr_decay_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
