"""Synthetic copy task of paper §4.1.1 (sequence duplication, as in Kitaev et al. 2020).

A sample is ``L`` random symbols, a separator, then the same ``L`` symbols again, right-padded
with 0 to a fixed width of ``2 * max_length + 1``:

    tokens       = [s_1 .. s_L, SEP, s_1 .. s_L, 0 .. 0]
    target_mask  = [0   .. 0,   0,   1   .. 1,   0 .. 0]

Token ids: 0 = padding, 1..num_symbols = symbols, num_symbols + 1 = separator. ``target_mask``
marks exactly the copied symbols, the first one (right after SEP) included: with causal masking
the model predicts token ``t`` from tokens ``< t``, and only the copy is predictable (the prefix
is random), so the loss is taken on those positions only.

Data is generated on the fly, one whole batch at a time (vectorised numpy: a batch costs far less
than a training step, so it runs in the main process without workers). Batch ``i`` of epoch ``e``
of a split is a pure function of ``(seed, split, e, i)`` (:class:`CopyBatches`), so nothing
depends on worker processes, iteration order or earlier batches: every epoch sees new sequences
(the task has ~10^128 of them), and a run resumed mid-epoch (linformer_lab/data/sampling.py) sees
bit-identical data to an uninterrupted one (tested in tests/data/test_data_copy.py).

Validation/test batches use a fixed epoch (0): the same ``val_batches`` batches every time, so
validation curves are comparable across epochs and runs with the same seed.

Counts of batches (``train_batches_per_epoch``, ``val_batches``, ``test_batches``) are of
``batch_size`` sequences over all processes: ``p`` processes run ``ceil(n / p)`` global batches
of ``p * batch_size`` sequences, so they train on the sequences one process sees at batch size
``p * batch_size``.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from linformer_lab.data.sampling import EpochSampler, SplitLoaders, process_share, worker_options
from linformer_lab.validation import check_at_least

PAD = 0
TRAIN, VAL, TEST = 0, 1, 2  # split ids, part of every batch's seed so the splits never share a stream


def make_copy_batch(
    rng: np.random.Generator, batch_size: int, max_length: int, num_symbols: int, min_length: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of copy-task sequences: lengths uniform in [min_length, max_length], symbols
    uniform in 1..num_symbols.

    Returns:
        tokens: int64 (batch_size, 2 * max_length + 1), layout ``[s_1..s_L, SEP, s_1..s_L, 0...]``.
        target_mask: bool (batch_size, 2 * max_length + 1), True exactly on the copied symbols.
    """
    lengths = rng.integers(min_length, max_length + 1, size=(batch_size, 1))  # (B, 1)
    symbols = rng.integers(1, num_symbols + 1, size=(batch_size, max_length))  # (B, max_length)

    pos = np.arange(2 * max_length + 1)[None, :]  # (1, N)
    is_prefix = pos < lengths
    is_sep = pos == lengths
    is_copy = (pos > lengths) & (pos <= 2 * lengths)
    # Position p of the prefix holds symbol p; position p of the copy holds symbol p - L - 1.
    src = np.where(is_prefix, pos, pos - lengths - 1).clip(0, max_length - 1)
    tokens = np.take_along_axis(symbols, src, axis=1)
    tokens = np.where(is_prefix | is_copy, tokens, PAD)
    tokens = np.where(is_sep, num_symbols + 1, tokens)
    return torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(is_copy)


class CopyBatches(Dataset):
    """Map-style dataset of whole batches. ``dataset[(split, epoch, i, rank, num_replicas)]`` ->
    (tokens, target_mask), int64 / bool of shape (batch_size, 2 * max_length + 1): the rows
    ``rank::num_replicas`` of the global batch of ``num_replicas * batch_size`` sequences, a pure
    function of (seed, split, epoch, i). ``(split, epoch, i)`` is the key of one process."""

    def __init__(self, seed: int, batch_size: int, max_length: int, num_symbols: int, min_length: int):
        self.seed, self.batch_size = seed, batch_size
        self.max_length, self.num_symbols, self.min_length = max_length, num_symbols, min_length

    def __getitem__(self, key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        split, epoch, index, rank, num_replicas = (*key, 0, 1) if len(key) == 3 else key
        # SeedSequence hashes the whole tuple, so neighbouring keys give independent streams.
        rng = np.random.default_rng([self.seed, split, epoch, index])
        tokens, target_mask = make_copy_batch(rng, num_replicas * self.batch_size, self.max_length,
                                              self.num_symbols, self.min_length)
        return tokens[rank::num_replicas], target_mask[rank::num_replicas]


class BatchKeySampler(EpochSampler):
    """Yields this process's keys ``(split, epoch, i, rank, num_replicas)`` of the global batches
    i = 0..num_batches-1 of the current epoch (from :meth:`start_batch` on when resumed mid-epoch):
    ``batches`` batches of ``batch_size`` are ``ceil(batches / num_replicas)`` global ones.
    Validation and test keys keep epoch 0: the same batches every time."""

    def __init__(self, batches: int, split: int = TRAIN, num_replicas: int = 1, rank: int = 0):
        super().__init__(num_replicas, rank)
        self.split = split
        self._num_batches = -(-batches // num_replicas)

    @property
    def num_batches(self) -> int:
        return self._num_batches
    def __iter__(self):
        epoch = self.epoch if self.split == TRAIN else 0
        for i in range(self.start_batch(), self.num_batches):
            yield (self.split, epoch, i, self.rank, self.num_replicas)


class CopyDataModule(SplitLoaders, L.LightningDataModule):
    """Copy task (paper §4.1.1). Batches: ``(tokens int64 (B, N), target_mask bool (B, N))``, N = 2*max_length+1.

    Args:
        max_length: longest sequence to copy. The batch width is 2 * max_length + 1. The paper's
            Fig. 2 ("maximum length 128") draws 32 to 62 symbols in the authors' script, so that an
            example fits in 128 positions (configs/copy_*.yaml).
        num_symbols: alphabet size (paper: 10); ids 1..num_symbols, separator num_symbols + 1.
        batch_size: sequences per batch and process (paper: 64).
        train_batches_per_epoch: length of a training "epoch" (data is infinite; this only sets
            how often Lightning validates / ends an epoch). Under DDP, batches over all processes.
        val_batches: number of fixed validation batches (test uses ``test_batches`` of its own).
        seed: non-negative int; all data is a function of it (with split, epoch, batch index).
        min_length: shortest sequence to copy; lengths are uniform in [min_length, max_length].
        test_batches: number of fixed test batches.
        num_workers: DataLoader workers; generation is cheap, 0 is usually best.
    """

    def __init__(self, max_length: int = 128, num_symbols: int = 10, batch_size: int = 64,
                 train_batches_per_epoch: int = 1000, val_batches: int = 20, seed: int = 0, min_length: int = 1,
                 test_batches: int = 20, num_workers: int = 0):
        super().__init__()
        check_at_least("batch_size", batch_size, 1, "sequences per batch")
        check_at_least("num_symbols", num_symbols, 1, "alphabet size")
        check_at_least("train_batches_per_epoch", train_batches_per_epoch, 1)
        check_at_least("val_batches", val_batches, 0)
        check_at_least("test_batches", test_batches, 0)
        check_at_least("num_workers", num_workers, 0, "DataLoader worker processes")
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length=} {max_length=}")
        check_at_least("seed", seed, 0, "it seeds numpy's SeedSequence")
        self.save_hyperparameters()
        self.max_length, self.num_symbols, self.min_length = max_length, num_symbols, min_length
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.train_batches_per_epoch, self.val_batches, self.test_batches = (
            train_batches_per_epoch, val_batches, test_batches)
        self.dataset = CopyBatches(seed, batch_size, max_length, num_symbols, min_length)

    @property
    def vocab_size(self) -> int:
        """Padding + symbols + separator."""
        return self.num_symbols + 2

    @property
    def sequence_length(self) -> int:
        """Width N of every batch: prefix, separator and copy at the longest length."""
        return 2 * self.max_length + 1

    @property
    def separator(self) -> int:
        return self.num_symbols + 1

    def _loader(self, split: str, cls: type[DataLoader]) -> DataLoader:
        split_id, batches = {"train": (TRAIN, self.train_batches_per_epoch), "val": (VAL, self.val_batches),
                             "test": (TEST, self.test_batches)}[split]
        sampler = BatchKeySampler(batches, split_id, *process_share(self))
        # batch_size=None: the dataset already returns whole batches, the loader only fetches them.
        return cls(self.dataset, sampler=sampler, batch_size=None, pin_memory=torch.cuda.is_available(),
                   **worker_options(self.num_workers))
