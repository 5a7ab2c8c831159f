"""Seeded epochs and mid-epoch resume, one protocol for every data module.

Every training sampler of the project derives from :class:`EpochSampler`: what it yields in an
epoch is a function of its seed and the epoch number only, and ``resume(epoch, batches_done)``
makes the next iteration start where a checkpoint left off. :class:`ResumableLoader` is the
DataLoader that Lightning saves and restores (``state_dict`` / ``load_state_dict``), so a run
resumed from any checkpoint, even mid-epoch, sees the same batches in the same order as an
uninterrupted run. The copy task yields batch keys, the image data shuffled sample indices, the
speech data length-bucketed batches; all three are tested the same way (tests/tasks/test_resume.py).

Written for single-device training: under DDP Lightning wraps custom samplers in its own
distributed wrapper (the speech data shards its batches itself; see SpeechDataModule).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Sampler


class EpochSampler(Sampler):
    """Epoch bookkeeping and mid-epoch resume; subclasses define :meth:`__iter__` (starting at
    :meth:`start_batch`) and :attr:`num_batches` (batches per epoch).

    Lightning calls ``set_epoch`` before each epoch on a loader's ``sampler`` and on its
    ``batch_sampler.sampler``; a batch sampler (speech) is reached through :attr:`sampler`,
    which is the sampler itself.
    """

    def __init__(self):
        self.epoch = 0
        self.resume_epoch, self.resume_batch = -1, 0

    @property
    def num_batches(self) -> int:
        raise NotImplementedError

    @property
    def sampler(self) -> EpochSampler:
        # what Lightning's set_epoch hook looks for on a batch sampler
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resume(self, epoch: int, batches_done: int) -> None:
        """Start the next iteration of ``epoch`` at batch ``batches_done``."""
        if batches_done >= self.num_batches:  # saved at the very end of an epoch: go on with the next
            epoch, batches_done = epoch + 1, 0
        self.resume_epoch, self.resume_batch = epoch, batches_done
        # On resume Lightning creates the first iterator *before* calling set_epoch, and with
        # num_workers > 0 that iterator pulls from us right away: set the epoch now.
        self.epoch = epoch

    def start_batch(self) -> int:
        """First batch of the current epoch: 0, or where a resumed epoch left off."""
        return min(self.resume_batch, self.num_batches) if self.epoch == self.resume_epoch else 0


class ResumableLoader(DataLoader):
    """DataLoader over an :class:`EpochSampler` (as ``sampler`` or ``batch_sampler``) that
    Lightning recognises as resumable.

    Lightning saves ``state_dict()`` in every checkpoint and calls ``load_state_dict`` before the
    first ``iter()`` of a resumed run. Set ``loader.datamodule``: its trainer tells how many
    batches the fit loop has finished in the current epoch.
    """

    datamodule = None

    @property
    def epoch_sampler(self) -> EpochSampler:
        for candidate in (self.batch_sampler, self.sampler):
            if isinstance(candidate, EpochSampler):
                return candidate
        raise TypeError(
            f"ResumableLoader needs an EpochSampler as its sampler or batch_sampler, got {type(self.sampler).__name__}"
        )

    def state_dict(self) -> dict:
        trainer = self.datamodule.trainer if self.datamodule is not None else None
        # `processed` counts the training steps finished in this epoch (the one being saved at
        # on_train_batch_end included): after a restart the fit loop's next batch_idx is this
        # number. The loader's own count would be ahead by Lightning's prefetching.
        if trainer is None:
            return {"epoch": self.epoch_sampler.epoch, "batches_done": 0}
        # the trainer's epoch, not the sampler's: a sampler may already have moved on (the speech
        # batch sampler advances when an iteration starts, for loops that never call set_epoch)
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": trainer.current_epoch, "batches_done": done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_sampler.resume(state["epoch"], state["batches_done"])
