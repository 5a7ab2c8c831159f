"""Batches of utterances: padding collate and length-bucketed batch sampling."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from linformer_lab.data.sampling import EpochSampler


def collate_speech(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Pad a list of items ``{"features": (T_i, 40) float, "targets": (S_i,) int64}``.

    Returns the speech batch of docs/ARCHITECTURE.md: ``features (B, T, 40)`` zero-padded,
    ``feature_lengths (B,)``, ``targets (B, S)`` padded with 0 (= blank), ``target_lengths (B,)``.
    """
    feats = [it["features"] for it in items]
    targs = [it["targets"] for it in items]
    feature_lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    target_lengths = torch.tensor([t.shape[0] for t in targs], dtype=torch.int64)
    features = torch.zeros(len(items), int(feature_lengths.max()), feats[0].shape[1], dtype=torch.float32)
    targets = torch.zeros(len(items), max(int(target_lengths.max()), 1), dtype=torch.int64)
    for i, (f, t) in enumerate(zip(feats, targs)):
        features[i, : f.shape[0]] = f
        targets[i, : t.shape[0]] = t
    return {
        "features": features,
        "feature_lengths": feature_lengths,
        "targets": targets,
        "target_lengths": target_lengths,
    }


class LengthBucketBatchSampler(EpochSampler):
    """Batches of similar length, so padding stays small, with seeded per-epoch shuffling; yields
    lists of item indices (a DataLoader takes it as its ``sampler`` with ``batch_size=None``
    over :class:`ItemLists`).

    Training (``shuffle=True``): each epoch permutes all indices with ``(seed, epoch)``, cuts the
    permutation into pools of about ``pool_batches`` batches, sorts each pool by length, cuts it
    into batches and shuffles the order of all batches. Large pools give batches of near-equal
    lengths; pooling (rather than one global sort) keeps batch composition random across epochs.
    Evaluation (``shuffle=False``): one global sort, deterministic.

    Distributed: the batches are global ones of ``num_replicas * batch_size`` items (the frame
    bound holding for every process's part), of which process ``rank`` takes ``rank::num_replicas``:
    every process gets similar lengths at every step, and ``p`` processes at batch size ``b`` see
    what one sees at ``p * b``. In training a global batch of fewer items than processes (a pool's
    end) repeats its items, so that every process runs every step; in evaluation a process simply
    has no part in it.

    Args:
        lengths: length of every item (frames), the padded dimension.
        batch_size: items per batch and process (the last batch of a pool may be smaller). With
            ``max_frames_per_batch`` it becomes an upper bound (``None`` = no bound).
        max_frames_per_batch: bound on ``items x longest item`` (the padded size) of a batch
            (of each process's part); an item longer than the bound forms a part on its own.
        shuffle: see above.
        pool_batches: pool size in (global) batches.
        seed: with the epoch, chooses the order; the epoch starts at 0 and advances after every
            iteration, or is set with :meth:`set_epoch` (Lightning does, before each epoch).
        drop_last: drop batches smaller than ``batch_size`` (fixed-size mode only).
        num_replicas, rank: the processes and this one's rank (see above).

    Every index appears exactly once per epoch (one process, ``drop_last=False``).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int | None = 16,
        max_frames_per_batch: int | None = None,
        shuffle: bool = True,
        pool_batches: int = 50,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if batch_size is None and max_frames_per_batch is None:
            raise ValueError("give batch_size, max_frames_per_batch or both")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if isinstance(lengths, Sampler):
            raise TypeError("LengthBucketBatchSampler needs the per-item lengths, not a sampler")
        super().__init__(num_replicas, rank)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.max_frames = max_frames_per_batch
        self.shuffle = shuffle
        self.pool_batches = pool_batches
        self.seed = seed
        self.drop_last = drop_last
        self._cache: tuple[int, list[list[int]]] | None = None

    def _split(self, idx: np.ndarray) -> list[list[int]]:
        # `idx` is sorted by length (descending): consecutive items have similar lengths.
        replicas = self.num_replicas
        if self.max_frames is None:
            bs = self.batch_size * replicas
            return [idx[i : i + bs].tolist() for i in range(0, len(idx), bs)]
        batches, cur, longest = [], [], 0
        for i in idx.tolist():
            new_longest = max(longest, int(self.lengths[i]))
            # each process's part of a batch of k items holds ceil(k / replicas) of them
            per_process = -(-(len(cur) + 1) // replicas)
            full = self.batch_size is not None and len(cur) >= self.batch_size * replicas
            if len(cur) >= replicas and (full or new_longest * per_process > self.max_frames):
                batches.append(cur)
                cur, new_longest = [], int(self.lengths[i])
            cur.append(i)
            longest = new_longest
        if cur:
            batches.append(cur)
        return batches

    def _pool_size(self) -> int:
        if self.max_frames is None:
            per_batch = self.batch_size
        else:
            mean = max(float(self.lengths.mean()) if len(self.lengths) else 1.0, 1.0)
            per_batch = max(1, int(self.max_frames // mean))
            if self.batch_size is not None:
                per_batch = min(per_batch, self.batch_size)
        return max(1, per_batch * self.num_replicas * self.pool_batches)

    def global_batches(self) -> list[list[int]]:
        """This epoch's batches of all processes together (one process: what iteration yields)."""
        n = len(self.lengths)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch])
            order = rng.permutation(n)
            pools = [order[i : i + self._pool_size()] for i in range(0, n, self._pool_size())]
        else:
            rng = None
            pools = [np.arange(n)]
        batches: list[list[int]] = []
        for pool in pools:
            # Stable sort on the negated length: longest first, ties keep the (random) pool order.
            ordered = pool[np.argsort(-self.lengths[pool], kind="stable")]
            batches.extend(self._split(ordered))
        if self.drop_last and self.max_frames is None:
            batches = [b for b in batches if len(b) == self.batch_size * self.num_replicas]
        if rng is not None:
            perm = rng.permutation(len(batches))
            batches = [batches[i] for i in perm]
        return batches

    def batches(self) -> list[list[int]]:
        """This epoch's batches for this process (what iteration yields)."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        replicas, parts = self.num_replicas, []
        for batch in self.global_batches():
            if self.shuffle and len(batch) < replicas:  # training: every process takes every step
                batch = (batch * replicas)[:replicas]
            part = batch[self.rank :: replicas]
            if part:
                parts.append(part)
        self._cache = (self.epoch, parts)
        return parts

    @property
    def num_batches(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()[self.start_batch():]
        self.epoch += 1  # for loops that never call set_epoch
        return iter(batches)

    def layout(self) -> dict:
        return {"batch_size": self.batch_size, "max_frames_per_batch": self.max_frames, "bucket_pool_batches": self.pool_batches,
                "seed": self.seed, "utterances": len(self.lengths)}


class ItemLists(Dataset):
    """``dataset[[i, j, ...]]`` -> ``[dataset[i], dataset[j], ...]``: the items of one batch, fetched
    by a DataLoader with ``batch_size=None`` whose sampler yields lists of indices (a
    :class:`LengthBucketBatchSampler`); its ``collate_fn`` (:func:`collate_speech`) pads them."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __getitem__(self, indices: list[int]) -> list:
        return [self.dataset[i] for i in indices]
