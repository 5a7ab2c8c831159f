"""CTC phoneme recognition (paper §4.3, Table 3) as a LightningModule.

Per utterance::

    features (T, 40) -> acoustic model -> log-probs (T', C)      C = num_phonemes, blank = 0
        transformer: input projection + positions -> non-causal Transformer (any attention
                     backend) -> linear           (linformer_lab.models.ctc.TransformerCTC)
        bilstm:      3 x bidirectional LSTM(320) -> linear  (linformer_lab.models.bilstm.BiLSTMCTC)
    training:   CTC loss (blank 0, per-phoneme mean over the batch, fp32)
    evaluation: greedy (best-path) decoding -> phoneme error rate (PER)

Optimisation as in the paper: RAdam at 1e-4 for the transformers, Adam at 1e-3 for the Bi-LSTM,
the learning rate halved whenever the validation PER stops improving (``ReduceLROnPlateau``).

Batches follow docs/ARCHITECTURE.md, "Contracts": dicts with ``features float (B, T, 40)``,
``feature_lengths (B,)``, ``targets int64 (B, S)`` (0-padded) and ``target_lengths (B,)``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.data.phonemes import NUM_PHONEMES, ids_to_phonemes
from linformer_lab.models.bilstm import BiLSTMCTC
from linformer_lab.models.ctc import PhonemeErrorRate, TransformerCTC, beam_decode, edit_distance, greedy_decode
from linformer_lab.tasks.base import Task, WeightedMean, epoch_ran_to_end
from linformer_lab.validation import check_at_least, check_non_negative, check_positive


class SpeechRecognitionTask(Task):
    """CTC phoneme recogniser with a transformer (any attention backend) or a Bi-LSTM encoder.

    Args:
        encoder: ``"transformer"`` or ``"bilstm"``.
        attention: the transformer's attention (``backend``, ``feature_map``, ``kwargs``), or a
            backend name alone (that backend, the other fields at their defaults); None = linear
            attention with the elu feature map. Must stay None for ``bilstm``.
        num_phonemes: output classes including the CTC blank (id 0), the data module's
            ``num_phonemes``; the default, the project's inventory
            (``linformer_lab.data.phonemes.NUM_PHONEMES``), is every SpeechDataModule corpus's.
        feature_dim: features per frame (the data module's ``feature_dim``, 40).
        d_model, n_layers, n_heads, d_ff (default 4 d_model), dropout: transformer shape
            (paper: 9 layers x 6 heads x 32 dims, d_model 192).
        positions: ``"sinusoidal"`` or ``"learned"`` position encodings (transformer).
        position_scale: factor of the sinusoidal encodings (None = 1/sqrt(d_model); see
            :class:`~linformer_lab.models.ctc.TransformerCTC`).
        max_positions: rows of the learned position table.
        subsample: 1 (paper: one position per frame) or 2 (stride-2 convolution first).
        packed: the transformer layers run on the utterances packed back to back (no padding
            computed; see :class:`~linformer_lab.models.ctc.TransformerCTC`); linear/softmax.
        lstm_hidden, lstm_layers: Bi-LSTM shape (paper: 320 per direction, 3 layers);
            ``dropout`` also applies between LSTM layers.
        lstm_packed: run the Bi-LSTM on packed sequences (True), on padded batches (False,
            same result, far faster on CPU) or packed on CUDA only (None); see BiLSTMCTC.
        optimizer: ``"radam"`` or ``"adam"``; None = the paper's choice for the encoder
            (transformer: RAdam, bilstm: Adam).
        lr: initial learning rate; None = the paper's (transformer 1e-4, bilstm 1e-3).
        warmup_steps: the learning rate rises linearly from ``lr / warmup_steps`` to ``lr``
            over the first optimizer steps (0 = none); the plateau schedule takes over after.
        weight_decay: optimizer weight decay.
        lr_factor, lr_patience, min_lr: ``ReduceLROnPlateau`` on ``val/per`` (paper: halve).
        beam_width: decoding for ``test``/``predict``: 1 = greedy (also what validation always
            uses: it is cheap), > 1 = CTC prefix beam search with that many prefixes.

    ``forward(features (B, T, 40), lengths (B,)) -> (log_probs (B, T', C), out_lengths (B,))``.
    Logged: ``train/loss``, ``train/epoch_time_s`` (wall time of the training epoch, data loading
    included; only for an epoch this process ran whole), ``val/loss``, ``val/per``, ``test/loss``,
    ``test/per``, ``lr`` (at every epoch end).
    """

    monitor = "val/per"
    monitor_mode = "min"
    #: fine-tuning and decoding settings; lstm_packed only picks how the same LSTMs run
    hparams_free_to_change = (
        "optimizer", "lr", "weight_decay", "lr_factor", "lr_patience", "min_lr", "dropout", "beam_width",
        "lstm_packed", "warmup_steps", "packed",
    )
    hparams_of_the_optimizer = ("lr", "weight_decay", "lr_factor", "lr_patience", "min_lr")

    def __init__(
        self,
        encoder: str = "transformer",
        attention: AttentionConfig | str | None = None,
        num_phonemes: int = NUM_PHONEMES,
        feature_dim: int = 40,
        d_model: int = 192,
        n_layers: int = 9,
        n_heads: int = 6,
        d_ff: int | None = None,
        dropout: float = 0.1,
        positions: str = "sinusoidal",
        max_positions: int = 4096,
        subsample: int = 1,
        position_scale: float | None = None,
        packed: bool = False,
        lstm_hidden: int = 320,
        lstm_layers: int = 3,
        lstm_packed: bool | None = None,
        optimizer: str | None = None,
        lr: float | None = None,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        lr_factor: float = 0.5,
        lr_patience: int = 1,
        min_lr: float = 1e-6,
        beam_width: int = 1,
    ):
        super().__init__()
        if encoder not in ("transformer", "bilstm"):
            raise ValueError(f"encoder must be 'transformer' or 'bilstm', got {encoder!r}")
        if encoder == "bilstm" and attention is not None:
            raise ValueError("encoder='bilstm' has no attention; remove the attention setting")
        if optimizer is None:
            optimizer = "radam" if encoder == "transformer" else "adam"
        if optimizer not in ("radam", "adam"):
            raise ValueError(f"optimizer must be 'radam' or 'adam', got {optimizer!r}")
        if lr is None:
            lr = 1e-4 if encoder == "transformer" else 1e-3
        check_positive("lr", lr, "learning rate; None = the paper's for the encoder")
        check_at_least("warmup_steps", warmup_steps, 0, "updates of linear learning-rate warm-up")
        check_non_negative("weight_decay", weight_decay)
        if not (isinstance(lr_factor, (int, float)) and 0 < lr_factor < 1):
            raise ValueError(f"lr_factor must be in (0, 1) (the plateau schedule multiplies the learning rate by it), "
                             f"got {lr_factor!r}")
        check_at_least("lr_patience", lr_patience, 0, "validation epochs without improvement before a decay")
        check_non_negative("min_lr", min_lr)
        check_at_least("beam_width", beam_width, 1, "1 = greedy decoding")
        self.save_hyperparameters()
        # the resolved optimizer and lr, so a checkpoint records what actually ran
        self.hparams["optimizer"], self.hparams["lr"] = optimizer, lr
        self.attention_config = None
        if encoder == "transformer":
            self.model = TransformerCTC(  # coerces the attention argument: the one place on this path
                num_phonemes, feature_dim, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
                dropout=dropout, attention=attention, positions=positions,
                max_positions=max_positions, subsample=subsample, position_scale=position_scale, packed=packed,
            )
            self.store_attention(self.model.attention_config)
        else:
            self.model = BiLSTMCTC(
                num_phonemes, feature_dim, hidden_size=lstm_hidden, n_layers=lstm_layers, dropout=dropout,
                packed=lstm_packed,
            )
        self.val_per = PhonemeErrorRate()
        self.test_per = PhonemeErrorRate()
        self.val_loss, self.test_loss = WeightedMean(), WeightedMean()  # per utterance, over all processes
        self._epoch_start: float | None = None
        self._validation_start: float | None = None
        self._validation_seconds = 0.0

    # ------------------------------------------------------------------ model

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(features, lengths)

    def ctc_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(loss, log_probs (B, T', C), out_lengths (B,))``; loss is CTC per target
        phoneme, averaged over the batch."""
        log_probs, out_lengths = self(batch["features"], batch["feature_lengths"])
        # CTC's forward-backward sums over exponentially many paths: fp32, also under bf16/fp16 autocast
        with torch.autocast(device_type=log_probs.device.type, enabled=False):
            loss = F.ctc_loss(
                log_probs.float().transpose(0, 1),  # (T', B, C), the layout ctc_loss expects
                batch["targets"],
                out_lengths,
                batch["target_lengths"],
                blank=0,
                reduction="mean",
                # more phonemes (plus blanks between repeats) than frames: no valid path, an
                # infinite loss, zeroed rather than poisoning the batch
                zero_infinity=True,
            )
        return loss, log_probs, out_lengths

    @staticmethod
    def references(batch: dict) -> list[list[int]]:
        """The target phoneme ids of every utterance, padding removed."""
        targets, lengths = batch["targets"].cpu(), batch["target_lengths"].cpu()
        return [targets[i, : int(lengths[i])].tolist() for i in range(targets.shape[0])]

    def decode(self, log_probs: torch.Tensor, lengths: torch.Tensor, beam_width: int = 1) -> list[list[int]]:
        """Phoneme ids per utterance: greedy for ``beam_width <= 1``, else prefix beam search."""
        if beam_width <= 1:
            return greedy_decode(log_probs, lengths)
        return beam_decode(log_probs, lengths, beam_width=beam_width)

    # ------------------------------------------------------------------ Lightning

    def on_train_batch_start(self, batch, batch_idx) -> None:
        # linear warm-up written into the optimizer: a LambdaLR beside the plateau scheduler
        # would reset the learning rate at every step, undoing the plateau's halvings
        warmup = self.hparams.get("warmup_steps", 0)
        if warmup and self.trainer.global_step < warmup:
            lr = self.hparams.lr * (self.trainer.global_step + 1) / warmup
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = lr

    def training_step(self, batch, batch_idx):
        loss, _, _ = self.ctc_loss(batch)
        batch_size = batch["features"].shape[0]
        # per utterance over the global batch of all processes (Task.global_mean)
        loss, mean = self.global_mean(loss * batch_size, batch_size)
        self.log("train/loss", mean, prog_bar=True, batch_size=batch_size)
        return loss

    def _evaluate(self, batch, stage: str, metric: PhonemeErrorRate, beam_width: int):
        loss, log_probs, out_lengths = self.ctc_loss(batch)
        batch_size = batch["features"].shape[0]
        metric.update(self.decode(log_probs, out_lengths, beam_width), self.references(batch))
        mean_loss = getattr(self, f"{stage}_loss")
        mean_loss.update(loss, batch_size)
        # Metric objects: Lightning computes them over the epoch and all ranks, then resets them
        self.log(f"{stage}/loss", mean_loss, prog_bar=True, on_step=False, on_epoch=True, batch_size=batch_size)
        self.log(f"{stage}/per", metric, prog_bar=True, on_step=False, on_epoch=True, batch_size=batch_size)
        return loss

    def validation_step(self, batch, batch_idx):
        return self._evaluate(batch, "val", self.val_per, beam_width=1)

    def test_step(self, batch, batch_idx):
        return self._evaluate(batch, "test", self.test_per, beam_width=self.hparams.beam_width)

    #: utterances whose decoding ``predict`` prints at its end
    predict_examples = 3

    def on_predict_epoch_start(self) -> None:
        self._predict_tally = {"errors": 0, "phonemes": 0, "utterances": 0, "examples": []}

    def predict_step(self, batch, batch_idx):
        """``{"predictions", "references"}``: phoneme-id lists per utterance. ``predict`` ends by
        printing the phoneme error rate and a few decoded utterances."""
        log_probs, out_lengths = self(batch["features"], batch["feature_lengths"])
        predictions, references = self.decode(log_probs, out_lengths, self.hparams.beam_width), self.references(batch)
        tally = getattr(self, "_predict_tally", None)
        if tally is not None:
            tally["errors"] += sum(edit_distance(ref, hyp) for hyp, ref in zip(predictions, references))
            tally["phonemes"] += sum(len(ref) for ref in references)
            tally["utterances"] += len(references)
            for hyp, ref in list(zip(predictions, references))[:self.predict_examples - len(tally["examples"])]:
                tally["examples"].append(f"  reference {' '.join(ids_to_phonemes(ref))}\n"
                                         f"  decoded   {' '.join(ids_to_phonemes(hyp))} ({edit_distance(ref, hyp)} edits)")
        return {"predictions": predictions, "references": references}

    def on_predict_epoch_end(self) -> None:
        tally = self.summed_predict_tally(("errors", "phonemes", "utterances"))
        if tally is None:
            return
        decoder = "greedy" if self.hparams.beam_width <= 1 else f"beam search of width {self.hparams.beam_width}"
        self.print(f"phoneme error rate {tally['errors'] / max(tally['phonemes'], 1):.4f} ({tally['errors']} edits "
                   f"for {tally['phonemes']} reference phonemes of {tally['utterances']} utterances, {decoder})")
        for lines in tally["examples"]:
            self.print(lines)

    # Table 3's "time per epoch", measured in the task so every run reports it. Lightning runs the
    # end-of-epoch validation inside the training epoch: its time is subtracted.

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._epoch_start = time.perf_counter()
        self._validation_seconds = 0.0

    def on_validation_epoch_start(self) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_epoch_end(self) -> None:
        # the sanity check runs before any training epoch: nothing to subtract from then
        if self._epoch_start is not None and self._validation_start is not None:
            self._validation_seconds += time.perf_counter() - self._validation_start
        self._validation_start = None

    def on_train_epoch_end(self) -> None:
        super().on_train_epoch_end()
        # no start time: the run resumed mid-epoch, the time of its first part is unknown
        if self._epoch_start is not None and epoch_ran_to_end(self.trainer):
            elapsed = time.perf_counter() - self._epoch_start - self._validation_seconds
            self.log("train/epoch_time_s", elapsed, on_step=False, on_epoch=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=False, on_epoch=True)
        self._epoch_start = None

    def configure_optimizers(self):
        hp = self.hparams
        optimizer_cls = torch.optim.RAdam if hp.optimizer == "radam" else torch.optim.Adam
        optimizer = optimizer_cls(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=hp.lr_factor, patience=hp.lr_patience, min_lr=hp.min_lr
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val/per",
                "interval": "epoch",
                "frequency": 1,
                # runs without validation (limit_val_batches=0) warn instead of failing
                "strict": False,
            },
        }
