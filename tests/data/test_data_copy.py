"""Copy-task data module: layout of the sequences, determinism, and exact resume under Lightning."""

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from linformer_lab.data import CopyDataModule
from linformer_lab.data.copy import PAD, make_copy_batch


def first_batches(dm, n, loader="train"):
    it = iter(getattr(dm, f"{loader}_dataloader")())
    return [next(it) for _ in range(n)]


def check_layout(tokens, mask, max_length, num_symbols, min_length=1):
    """Checks every row against [s_1..s_L, SEP, s_1..s_L, 0...]; returns the lengths L."""
    sep = num_symbols + 1
    lengths = []
    for row, m in zip(tokens.tolist(), mask.tolist()):
        assert row.count(sep) == 1
        n = row.index(sep)
        assert min_length <= n <= max_length
        prefix, copy, pad = row[:n], row[n + 1:2 * n + 1], row[2 * n + 1:]
        assert all(1 <= s <= num_symbols for s in prefix)
        assert copy == prefix
        assert all(t == PAD for t in pad)
        assert m == [False] * (n + 1) + [True] * n + [False] * len(pad)
        lengths.append(n)
    return lengths


def test_shapes_and_properties():
    dm = CopyDataModule(max_length=128, num_symbols=10, batch_size=64)
    assert dm.vocab_size == 12 and dm.sequence_length == 257 and dm.separator == 11
    tokens, mask = first_batches(dm, 1)[0]
    assert tokens.shape == mask.shape == (64, 257)
    assert tokens.dtype == torch.int64 and mask.dtype == torch.bool
    assert 0 <= tokens.min() and tokens.max() <= 11
    assert len(dm.train_dataloader()) == 1000 and len(dm.val_dataloader()) == 20 and len(dm.test_dataloader()) == 20


def test_layout_and_length_range():
    max_length, min_length = 7, 3
    dm = CopyDataModule(max_length=max_length, num_symbols=5, batch_size=256, min_length=min_length)
    lengths = []
    for tokens, mask in first_batches(dm, 4) + first_batches(dm, 2, "val"):
        lengths += check_layout(tokens, mask, max_length, 5, min_length)
    assert set(lengths) == set(range(min_length, max_length + 1))  # uniform: every length shows up
    # Full-width sequences end exactly at the last position; fixed-length mode works.
    tokens, mask = make_copy_batch(np.random.default_rng(0), 8, 4, 3, min_length=4)
    assert check_layout(tokens, mask, 4, 3, 4) == [4] * 8
    assert mask[:, -1].all() and (tokens[:, 4] == 4).all()


def test_default_config_layout():
    dm = CopyDataModule()
    tokens, mask = first_batches(dm, 1)[0]
    assert max(check_layout(tokens, mask, 128, 10)) <= 128


def test_deterministic_per_seed_split_epoch():
    def same(a, b):
        return all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))

    a = first_batches(CopyDataModule(max_length=16, batch_size=8, seed=1), 3)
    b = first_batches(CopyDataModule(max_length=16, batch_size=8, seed=1), 3)
    c = first_batches(CopyDataModule(max_length=16, batch_size=8, seed=2), 3)
    assert same(a, b) and not same(a, c)
    assert not torch.equal(a[0][0], a[1][0])  # batches within an epoch differ

    dm = CopyDataModule(max_length=16, batch_size=8, seed=1)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)  # what Lightning does before each epoch
    epoch1 = [next(iter(loader))]
    assert not same(epoch1, a[:1])  # a new epoch draws new sequences...
    loader.sampler.set_epoch(0)
    assert same([next(iter(loader))], a[:1])  # ...and epoch 0 is reproducible

    val = first_batches(dm, 2, "val")
    assert same(val, first_batches(dm, 2, "val"))  # validation is a fixed set
    assert not same(val, a[:2]) and not same(val, first_batches(dm, 2, "test"))


def test_workers_give_same_data():
    a = first_batches(CopyDataModule(max_length=16, batch_size=8, train_batches_per_epoch=4), 4)
    b = first_batches(CopyDataModule(max_length=16, batch_size=8, train_batches_per_epoch=4, num_workers=2), 4)
    assert all(torch.equal(x, y) and torch.equal(m, n) for (x, m), (y, n) in zip(a, b))


class RecordBatches(L.LightningModule):
    """Records a fingerprint of every training batch it sees."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(12, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        tokens, mask = batch
        self.seen.append((self.current_epoch, batch_idx, tuple(tokens.flatten().tolist()), tuple(mask.flatten().tolist())))
        return self.emb(tokens).mean()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(ckpt_dir, ckpt_path=None, num_workers=0):
    dm = CopyDataModule(max_length=8, batch_size=4, train_batches_per_epoch=5, val_batches=2, num_workers=num_workers)
    model = RecordBatches()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoint], accelerator="cpu")
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model.seen


# Checkpoints mid-epoch (3, 6, 12), at the end of an epoch (5, 10) and at the last step (14).
# With workers, the DataLoader pulls sampler keys as soon as Lightning creates the iterator, which
# on resume happens before set_epoch: steps 5 and 6 failed before the sampler took its epoch from
# the checkpoint (worker processes are slow to start, so only those two there).
@pytest.mark.filterwarnings("ignore:The dirpath has changed")  # resumed runs write to their own dirs on purpose
@pytest.mark.parametrize("num_workers, steps", [(0, [3, 5, 6, 10, 12, 14]), (1, [5, 6])])
def test_resume_sees_same_data_as_uninterrupted_run(tmp_path, num_workers, steps):
    full = fit(tmp_path / "full", num_workers=num_workers)
    assert len(full) == 15 and len({s[2:] for s in full}) == 15
    for step in steps:
        resumed = fit(tmp_path / f"resumed{step}", tmp_path / "full" / f"step={step}.ckpt", num_workers=num_workers)
        assert resumed == full[step:], f"resumed from step {step}"
