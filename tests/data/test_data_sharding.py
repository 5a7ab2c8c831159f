"""Every data module shards its loaders over the processes of a DDP run itself
(linformer_lab/data/sampling.py): each process gets its own share, the shares together hold every
sample of the epoch, training shares are equally long, and ``p`` processes at batch size ``b``
see at each step what one process sees at ``p * b``. Checked here on the loaders of two ranks
built side by side (a stand-in trainer gives the rank); tests/tasks/test_ddp*.py train with them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from linformer_lab.data import CopyDataModule
from linformer_lab.data.images import ShuffleSampler
from linformer_lab.data.sampling import ResumableLoader, padded_share
from linformer_lab.data.speech import LengthBucketBatchSampler
from linformer_lab.validation import ConfigurationError


def on_rank(datamodule, world_size: int, rank: int, epoch: int = 1):
    """``datamodule`` as the process ``rank`` of ``world_size`` sees it in ``epoch`` (the trainer's
    members the data modules read)."""
    datamodule.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, current_epoch=epoch)
    return datamodule


def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows ``r::p`` of a global batch from the part of each process ``r`` -> the global batch."""
    out = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        out[rank::len(parts)] = part
    return out


@pytest.mark.parametrize("loader", ["train", "val", "test"])
def test_copy_shares_make_the_batches_of_one_process_at_twice_the_batch(loader):
    def batches(world_size, rank, batch_size, batches_per_epoch):
        dm = CopyDataModule(max_length=5, batch_size=batch_size, train_batches_per_epoch=batches_per_epoch,
                            val_batches=batches_per_epoch, test_batches=batches_per_epoch, seed=3)
        made = getattr(on_rank(dm, world_size, rank), f"{loader}_dataloader")()
        assert isinstance(made.sampler, DistributedSampler)  # what keeps Lightning from wrapping it
        made.sampler.set_epoch(1)
        return list(made)

    one = batches(1, 0, batch_size=4, batches_per_epoch=3)
    shares = [batches(2, rank, batch_size=2, batches_per_epoch=6) for rank in (0, 1)]
    assert len(one) == len(shares[0]) == len(shares[1]) == 3
    for step, (tokens, mask) in enumerate(one):
        assert torch.equal(interleave([share[step][0] for share in shares]), tokens)
        assert torch.equal(interleave([share[step][1] for share in shares]), mask)
    # an odd count is rounded up to whole global batches: 5 batches of 2 on 2 processes -> 3 steps
    dm = on_rank(CopyDataModule(max_length=5, batch_size=2, train_batches_per_epoch=5, val_batches=5, test_batches=5), 2, 1)
    assert len(list(getattr(dm, f"{loader}_dataloader")())) == 3


def test_image_training_shares_cover_the_epoch_equally_and_make_the_global_batches():
    n = 15  # odd: one image is repeated so that both processes run 4 steps
    shares = [ShuffleSampler(n, batch_size=2, seed=1, num_replicas=2, rank=rank) for rank in (0, 1)]
    for sampler in shares:
        sampler.set_epoch(4)
    lists = [list(sampler) for sampler in shares]
    assert len(lists[0]) == len(lists[1]) == len(shares[0]) == 8 and shares[0].num_batches == 4
    assert sorted(set(lists[0]) | set(lists[1])) == list(range(n)) and len(lists[0] + lists[1]) == n + 1
    assert not set(lists[0]) & set(lists[1][:-1])  # only the padding repeats
    one = ShuffleSampler(n, batch_size=4, seed=1)
    one.set_epoch(4)
    whole = list(one)
    for step in range(3):  # full global batches: the same images as one process at batch 4
        assert sorted(lists[0][2 * step:2 * step + 2] + lists[1][2 * step:2 * step + 2]) == sorted(whole[4 * step:4 * step + 4])


def test_image_evaluation_shares_repeat_nothing():
    shares = [list(ShuffleSampler(7, batch_size=2, num_replicas=2, rank=rank, shuffle=False)) for rank in (0, 1)]
    assert shares == [[0, 2, 4, 6], [1, 3, 5]]


def lengths(n: int = 203, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(20, 900, size=n)


@pytest.mark.parametrize("max_frames", [None, 3000])
def test_speech_training_shares_split_the_global_batches_of_one_process(max_frames):
    lens = lengths()
    kwargs = dict(max_frames_per_batch=max_frames, pool_batches=4, seed=5)
    one = LengthBucketBatchSampler(lens, batch_size=8, **kwargs)
    shares = [LengthBucketBatchSampler(lens, batch_size=4, num_replicas=2, rank=rank, **kwargs) for rank in (0, 1)]
    for sampler in (one, *shares):
        sampler.set_epoch(2)
    whole, parts = list(one), [list(s) for s in shares]
    assert len(parts[0]) == len(parts[1]) == len(shares[0]) > 0  # every process runs every step
    if max_frames is None:  # the same global batches: the buckets of one process at batch 8
        assert len(whole) == len(parts[0])
        for batch, part0, part1 in zip(whole, *parts):
            assert sorted(part0 + part1) == sorted(batch) or (len(batch) == 1 and part0 == part1 == batch)
    seen = [i for part in parts for batch in part for i in batch]
    assert set(seen) == set(range(len(lens)))
    for part in (p for share in parts for p in share):
        assert len(part) == 1 or max_frames is None or len(part) * lens[part].max() <= max_frames


def test_speech_evaluation_shares_hold_every_utterance_once():
    lens = lengths(n=37)
    parts = [list(LengthBucketBatchSampler(lens, batch_size=4, shuffle=False, num_replicas=2, rank=rank))
             for rank in (0, 1)]
    seen = [i for part in parts for batch in part for i in batch]
    assert sorted(seen) == list(range(37))
    assert len(parts[0]) == 5 and len(parts[1]) == 5  # 37 = 4 global batches of 8 and one of 5


def test_padded_share():
    assert [padded_share(list("abcde"), 2, r) for r in (0, 1)] == [list("ace"), list("bda")]
    assert padded_share([1, 2], 1, 0) == [1, 2]


def test_resume_with_another_process_count():
    sampler = ShuffleSampler(12, batch_size=2)
    loader = ResumableLoader(TensorDataset(torch.arange(12)), batch_size=2, sampler=sampler)
    mid_epoch = {"epoch": 3, "batches_done": 2, "world_size": 2, "epoch_done": False}
    with pytest.raises(ConfigurationError, match=r"written by 2 process\(es\) .* this run has 1"):
        loader.load_state_dict(mid_epoch)
    loader.load_state_dict({**mid_epoch, "epoch_done": True})  # an epoch's end: the next epoch, whole
    assert (sampler.epoch, sampler.start_batch()) == (4, 0)
    loader.load_state_dict({**mid_epoch, "world_size": 1})  # the same count: where it left off
    assert (sampler.epoch, sampler.start_batch()) == (3, 2)


@pytest.mark.parametrize("make, changed, refusal", [
    (lambda **kw: ShuffleSampler(12, **{"batch_size": 2, **kw}), {"batch_size": 3}, "batch_size 2 .* this run has batch_size 3"),
    (lambda **kw: ShuffleSampler(12, **{"batch_size": 2, **kw}), {"seed": 1}, "seed 0 .* this run has seed 1"),
    (lambda **kw: LengthBucketBatchSampler(lengths(n=40), **{"batch_size": 4, **kw}), {"batch_size": 2},
     "batch_size 4 .* this run has batch_size 2"),
    (lambda **kw: LengthBucketBatchSampler(lengths(n=40), **{"batch_size": 4, **kw}), {"max_frames_per_batch": 500},
     "max_frames_per_batch None .* this run has max_frames_per_batch 500"),
], ids=["images-batch_size", "images-seed", "speech-batch_size", "speech-max_frames"])
def test_resume_under_another_batch_layout(make, changed, refusal):
    """A mid-epoch position counts batches: under another batch size (or seed, or frame bound) it
    named other samples, and the resumed epoch skipped or repeated some without a word."""
    saved = ResumableLoader(range(100), sampler=make(), batch_size=None).state_dict()
    mid_epoch = {**saved, "epoch": 3, "batches_done": 2, "epoch_done": False, "epoch_batches": 5}
    sampler = make(**changed)
    loader = ResumableLoader(range(100), sampler=sampler, batch_size=None)
    with pytest.raises(ConfigurationError, match=f"written by {refusal}.*until the epoch ends \\(3 more batches\\)"):
        loader.load_state_dict(mid_epoch)
    loader.load_state_dict({**mid_epoch, "epoch_done": True})  # an epoch's end: the next epoch, whole
    assert (sampler.epoch, sampler.start_batch()) == (4, 0)
    same = make()
    ResumableLoader(range(100), sampler=same, batch_size=None).load_state_dict(mid_epoch)
    assert (same.epoch, same.start_batch()) == (3, 2)
    unknown = make(**changed)  # a checkpoint from before the layout was recorded: taken as unchanged
    ResumableLoader(range(100), sampler=unknown, batch_size=None).load_state_dict(
        {key: value for key, value in mid_epoch.items() if key != "layout"})
    assert (unknown.epoch, unknown.start_batch()) == (3, 2)


@pytest.mark.slow
def test_max_steps_stop_at_an_epoch_end_resumes_with_the_next_epoch(tmp_path):
    """Lightning tells a run restarted at an epoch's end that one more epoch has begun than the
    one it runs; the samplers follow the trainer's epoch, so the resumed run trains on the next
    epoch's batches, as the uninterrupted run does (on the one after, it would not)."""
    from conftest import read_metrics, run_cli, tiny_copy_args

    def fit(root, steps, *resume):
        code, _, err = run_cli(["fit", *tiny_copy_args(root, "linear", f"--trainer.max_steps={steps}"), *resume])
        assert code == 0, err[-3000:]
        return [r["train/loss"] for r in read_metrics(root / f"version_{1 if resume else 0}") if "train/loss" in r]

    straight = fit(tmp_path / "straight", 8)
    fit(tmp_path / "stopped", 6)  # 3 batches an epoch: the end of the second
    assert fit(tmp_path / "stopped", 8, "--ckpt_path", "last") == pytest.approx(straight[6:], abs=1e-6)
