"""The LightningDataModule over either corpus."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader, Dataset

from linformer_lab.data.phonemes import NUM_PHONEMES
from linformer_lab.data.sampling import SplitLoaders, process_share, worker_options
from linformer_lab.data.speech.batching import ItemLists, LengthBucketBatchSampler, collate_speech
from linformer_lab.data.speech.features import FEATURE_DIM
from linformer_lab.data.speech.librispeech import LibriSpeechCorpus, check_subset
from linformer_lab.data.speech.synthetic import DEFAULT_CACHE, SyntheticSpeechCorpus
from linformer_lab.data.speech.synthetic_dataset import SPLITS, ensure_feature_cache
from linformer_lab.validation import check_at_least, check_positive


class SpeechDataModule(SplitLoaders, L.LightningDataModule):
    """Speech batches for CTC phoneme recognition (format: the :mod:`linformer_lab.data.speech` docstring).

    Args:
        corpus: ``"synthetic"`` (eSpeak corpus, generated on first use) or ``"librispeech"``.
        root: cache root of the synthetic corpus (default ``~/.cache/linformer_lab/speech``) or
            the directory containing ``LibriSpeech/`` (default ``~/.cache/linformer_lab/librispeech``).
        hours: synthetic corpus size (all splits together).
        seed: corpus seed and batch-order seed.
        batch_size: utterances per batch and process (upper bound when ``max_frames_per_batch`` is set).
        max_frames_per_batch: bound on padded frames per batch (``batch x longest``); ``None`` =
            fixed-size batches.
        num_workers: DataLoader worker processes.
        noise_snr_db: white noise at this SNR on every split of the synthetic corpus (``None`` = clean).
        librispeech_train, librispeech_val, librispeech_test: LibriSpeech subsets per split.
        bucket_pool_batches: pool size (in batches) of the length-bucketing sampler.
        pin_memory: DataLoader ``pin_memory``.
        progress: show progress bars while generating/caching.

    Multi-process (DDP): every loader shards its length-bucketed batches across the processes
    itself (:class:`LengthBucketBatchSampler`, ``batch_size`` per process): in training each
    process gets as many batches, in validation and test each utterance is seen once.
    """

    feature_dim = FEATURE_DIM
    #: output classes of the CTC model: phonemes + blank (id 0)
    num_phonemes = NUM_PHONEMES

    def __init__(
        self,
        corpus: str = "synthetic",
        root: str | None = None,
        hours: float = 3.0,
        seed: int = 0,
        batch_size: int = 16,
        max_frames_per_batch: int | None = None,
        num_workers: int = 0,
        noise_snr_db: float | None = None,
        librispeech_train: Sequence[str] = ("train-clean-100",),
        librispeech_val: Sequence[str] = ("dev-clean",),
        librispeech_test: Sequence[str] = ("test-clean",),
        bucket_pool_batches: int = 50,
        pin_memory: bool = False,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if corpus not in ("synthetic", "librispeech"):
            raise ValueError(f"corpus must be 'synthetic' or 'librispeech', got {corpus!r}")
        check_at_least("batch_size", batch_size, 1, "utterances per batch")
        check_at_least("max_frames_per_batch", max_frames_per_batch, 1, "padded frames per batch; None = no bound",
                       allow_none=True)
        check_at_least("num_workers", num_workers, 0, "DataLoader worker processes")
        check_at_least("bucket_pool_batches", bucket_pool_batches, 1)
        check_positive("hours", hours, "size of the synthetic corpus")
        self.save_hyperparameters()  # the settings are read from self.hparams
        self.batch_size = batch_size  # also an attribute: where Lightning's batch-size tuner looks
        self.librispeech_subsets = {
            "train": tuple(librispeech_train),
            "val": tuple(librispeech_val),
            "test": tuple(librispeech_test),
        }
        self.datasets: dict[str, Dataset] = {}

    def _synthetic(self) -> SyntheticSpeechCorpus:
        hp = self.hparams
        return SyntheticSpeechCorpus(root=hp.root, hours=hp.hours, seed=hp.seed, progress=hp.progress)

    def _librispeech_root(self) -> Path:
        root = self.hparams.root
        return Path(root).expanduser() if root is not None else (DEFAULT_CACHE / "librispeech").expanduser()

    def prepare_data(self) -> None:
        # one process per node: the place for the one-time synthesis / feature caching
        if self.hparams.corpus == "synthetic":
            corpus = self._synthetic()
            ensure_feature_cache(corpus.path, self.hparams.noise_snr_db, progress=self.hparams.progress)  # all splits
        else:
            for subsets in self.librispeech_subsets.values():
                for subset in subsets:
                    check_subset(self._librispeech_root(), subset)

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        if self.hparams.corpus == "synthetic":
            corpus = self._synthetic()
            for split in SPLITS:
                self.datasets[split] = corpus.dataset(split, noise_snr_db=self.hparams.noise_snr_db)
        else:
            for split, subsets in self.librispeech_subsets.items():
                self.datasets[split] = LibriSpeechCorpus(self._librispeech_root(), subsets)

    def _loader(self, split: str, cls: type[DataLoader]) -> DataLoader:
        self.setup()  # a no-op once loaded; lets the loaders be used without a Trainer
        ds, hp = self.datasets[split], self.hparams
        replicas, rank = process_share(self)
        sampler = LengthBucketBatchSampler(
            ds.lengths, batch_size=self.batch_size, max_frames_per_batch=hp.max_frames_per_batch, shuffle=split == "train",
            pool_batches=hp.bucket_pool_batches, seed=hp.seed, num_replicas=replicas, rank=rank,
        )
        # the sampler yields whole batches of indices (batch_size=None): as a loader's sampler,
        # rather than its batch_sampler, it is what Lightning checks to leave a sharded loader as it is
        return cls(
            ItemLists(ds),
            sampler=sampler,
            batch_size=None,
            collate_fn=collate_speech,
            pin_memory=hp.pin_memory,
            **worker_options(hp.num_workers),
        )
