"""Seeded epochs, sharding over processes and mid-epoch resume, one protocol for every data module.

Every sampler of the project derives from :class:`EpochSampler`: what it yields in an epoch is
a function of its seed, the epoch number and its share (``num_replicas`` processes, this one
``rank``) only, and ``resume(epoch, batches_done)`` makes the next iteration start where a
checkpoint left off. Lightning, resuming mid-epoch, restores its batch counter but restarts the
loader's iterator, so a plain loader would replay the epoch's start; :class:`ResumableLoader`,
the training DataLoader, is saved and restored with the checkpoint (``state_dict`` /
``load_state_dict``, under ``loops.fit_loop.state_dict.combined_loader``), so a run resumed from
any checkpoint, even mid-epoch, sees the same batches in the same order as an uninterrupted run.
The copy task yields batch keys, the image data sample indices, the speech data length-bucketed
batches; all three are tested the same way (tests/tasks/test_resume.py, tests/tasks/test_ddp.py).

Multi-process training (DDP): the data modules read the process count and rank from their
trainer (:func:`process_share`) and every sampler shards its epoch itself, so that:

* each process sees its own share, and together they see every sample of the epoch once
  (training pads a share with a few repeated samples where the epoch does not divide evenly,
  so that every process runs the same number of steps; evaluation repeats nothing);
* ``p`` processes at batch size ``b`` see, at every step, the samples one process sees at
  batch size ``p * b`` (the "global batch"), so the two train alike (tests/tasks/test_ddp.py);
* the position saved in a checkpoint (epoch, batches done) is the same on every process, so the
  one checkpoint rank 0 writes resumes every rank exactly.

An ``EpochSampler`` is a ``torch.utils.data.DistributedSampler``: Lightning leaves a loader whose
sampler is one as it is (with its default ``use_distributed_sampler=True``, it would otherwise
wrap the sampler in its own distributed wrapper, which knows nothing of resuming).
"""

from __future__ import annotations

import signal

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from linformer_lab.validation import ConfigurationError


class PredictsOnTestSplit:
    """For a data module with no predict split of its own: predict (``cli.py predict``,
    ``trainer.predict(datamodule=...)``) runs on its test split, and says so once per run."""

    def predict_dataloader(self) -> DataLoader:
        # said only when a trainer predicts: Lightning's str() of a data module calls every loader
        # method (jsonargparse formats one for each link the data module has no attribute for)
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.predicting:
            rank_zero_info(f"{type(self).__name__} has no predict split: predicting on its test split")
        return self.test_dataloader()


class SplitLoaders(PredictsOnTestSplit):
    """The train / val / test loaders of a data module that defines ``_loader(split, cls)``
    (``split`` one of "train", "val", "test"; ``cls`` the DataLoader class to build): training
    gets a :class:`ResumableLoader` tied to the module, evaluation a plain DataLoader."""

    def _loader(self, split: str, cls: type[DataLoader]) -> DataLoader:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train", ResumableLoader)
        loader.datamodule = self
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", DataLoader)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", DataLoader)


def worker_options(num_workers: int) -> dict:
    """A data module's DataLoader arguments for ``num_workers`` worker processes: kept across epochs,
    and deaf to Ctrl-C and SIGTERM (:func:`ignore_stop_signals`)."""
    return {"num_workers": num_workers, "persistent_workers": num_workers > 0, "worker_init_fn": ignore_stop_signals}


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker ignores Ctrl-C and SIGTERM, which a terminal or a cluster scheduler sends
    to every process of a job: the training process decides (it stops at the end of the update, see
    ``tasks.checkpointing.StopOnSignal``) and shuts its workers down. A worker that died of the signal
    would fail that update's next batch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def process_share(datamodule) -> tuple[int, int]:
    """``(num_replicas, rank)`` of the run ``datamodule`` is attached to, ``(1, 0)`` without a
    trainer: the trainer's world size and global rank, each divided by the task's
    ``context_parallel`` (that many consecutive processes split the sequences of one batch, so
    they take one share of the data together)."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 1, 0
    context = int(getattr(getattr(trainer, "lightning_module", None), "context_parallel", 1) or 1)
    return int(trainer.world_size) // context, int(trainer.global_rank) // context


class EpochSampler(DistributedSampler):
    """Epoch bookkeeping, this process's share and mid-epoch resume; subclasses define
    :meth:`__iter__` (this share's batches of the current epoch, starting at
    :meth:`start_batch`) and :attr:`num_batches` (this share's batches per epoch, also its ``len()``
    where it yields whole batches; one that yields samples for the DataLoader to batch counts those).

    Lightning calls ``set_epoch`` before each epoch on a loader's ``sampler``; with ``datamodule``
    set (:class:`ResumableLoader` does) the epoch is the trainer's ``current_epoch`` instead of
    the number Lightning passes, its count of epochs begun, which in a run restarted at an epoch's
    end (a ``max_steps`` stop there) is one ahead of the epoch it runs, logs and checkpoints.
    """

    datamodule = None

    def __init__(self, num_replicas: int = 1, rank: int = 0):
        # DistributedSampler.__init__ wants a dataset (and a process group where the counts are
        # not given): it is here for its type, which tells Lightning not to wrap the loader.
        Sampler.__init__(self)
        if not (isinstance(num_replicas, int) and num_replicas >= 1 and isinstance(rank, int)
                and 0 <= rank < num_replicas):
            raise ValueError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas=} {rank=}")
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.resume_epoch, self.resume_batch = -1, 0

    @property
    def num_batches(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        # batches of the whole epoch, also when resuming: Lightning counts the batches already done
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        trainer = getattr(self.datamodule, "trainer", None)
        self.epoch = int(trainer.current_epoch if trainer is not None else epoch)

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

    def layout(self) -> dict:
        """The settings, besides the epoch and the process count, that decide which samples the
        epoch's ``i``-th batch holds: a checkpoint's position in an epoch (its batches done) names the
        same samples only under the same ones. None here (a batch made from its index alone)."""
        return {}


def padded_share(items: list, num_replicas: int, rank: int) -> list:
    """``items[rank::num_replicas]`` after repeating the first items of the list until its length
    divides evenly: every share has the same length (every process runs as many steps), and the
    shares together hold every item at least once."""
    if num_replicas == 1 or not items:
        return list(items)
    total = -(-len(items) // num_replicas) * num_replicas
    padded = (list(items) * (total // len(items) + 1))[:total]
    return padded[rank::num_replicas]


class ResumableLoader(DataLoader):
    """DataLoader over an :class:`EpochSampler` (its ``sampler``) that Lightning recognises as
    resumable: it saves ``state_dict()`` in every checkpoint and calls ``load_state_dict`` before
    the first ``iter()`` of a resumed run. Set ``loader.datamodule``: its trainer tells which epoch
    runs and how many batches the fit loop has finished in it. Under DDP rank 0's state is the
    checkpoint's, which holds for every rank (their shares have as many batches). A checkpoint
    written by another number of processes, or under another :meth:`EpochSampler.layout` (batch
    size, seed, data size), continues only from an epoch's end (the batches of the epoch in progress
    would differ, so its position there would skip or repeat samples); mid-epoch it is refused with
    a :class:`ConfigurationError`.
    """

    @property
    def datamodule(self):
        return self.epoch_sampler.datamodule

    @datamodule.setter
    def datamodule(self, datamodule) -> None:
        self.epoch_sampler.datamodule = datamodule

    @property
    def epoch_sampler(self) -> EpochSampler:
        if isinstance(self.sampler, EpochSampler):
            return self.sampler
        raise TypeError(f"ResumableLoader needs an EpochSampler as its sampler, got {type(self.sampler).__name__}")

    def state_dict(self) -> dict:
        sampler = self.epoch_sampler
        trainer = getattr(self.datamodule, "trainer", None)
        batching = {"world_size": sampler.num_replicas, "layout": sampler.layout()}
        if trainer is None:
            return {"epoch": sampler.epoch, "batches_done": 0, "epoch_done": False, **batching}
        # `processed`: the training steps finished in this epoch (the one saved at
        # on_train_batch_end included), the fit loop's next batch_idx after a restart; the
        # loader's own count is ahead by Lightning's prefetching. The trainer's epoch, not the
        # sampler's, which may have moved on (the speech sampler advances as an iteration starts).
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        # the epoch's batches as the fit loop runs them (limit_train_batches cuts an epoch short)
        batches = min(sampler.num_batches, trainer.num_training_batches)
        return {"epoch": trainer.current_epoch, "batches_done": done, "epoch_done": done >= batches,
                "epoch_batches": batches, **batching}

    def load_state_dict(self, state: dict) -> None:
        sampler = self.epoch_sampler
        epoch, done = state["epoch"], state["batches_done"]
        # checkpoints from before these keys: one process, the layout unknown (taken as unchanged)
        saved = {"processes": int(state.get("world_size", 1)), **state.get("layout", {})}
        running = {"processes": sampler.num_replicas, **sampler.layout()}
        changed = [key for key in running if key in saved and saved[key] != running[key]]
        if changed and done > 0:
            if not state.get("epoch_done", False):
                raise ConfigurationError(_mid_epoch_refusal(changed, saved, running, state))
            epoch, done = epoch + 1, 0  # its count of batches was of other batches
        sampler.resume(epoch, done)


def _mid_epoch_refusal(changed: list[str], saved: dict, running: dict, state: dict) -> str:
    """The one line that refuses a checkpoint written mid-epoch under settings this run has changed."""
    def setting(key, value):
        return f"{value} process(es)" if key == "processes" else f"{key} {value}"

    then = ", ".join(setting(key, saved[key]) for key in changed)
    now = ", ".join(setting(key, running[key]) for key in changed)
    left = f" ({state['epoch_batches'] - state['batches_done']} more batches)" if "epoch_batches" in state else ""
    where = " (trainer.devices x trainer.num_nodes)" if "processes" in changed else ""
    return (f"cannot resume: the checkpoint was written by {then} in the middle of an epoch and this run has {now}: "
            f"the epoch's batches differ, so its position there would skip or repeat samples; resume with "
            f"{then}{where} until the epoch ends{left}, then with {now}, or from a checkpoint written at an epoch's end")
