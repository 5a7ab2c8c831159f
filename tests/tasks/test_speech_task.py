"""CTC speech task (linformer_lab.tasks.speech): padding invariance, loss, logging, configs.

Everything runs on CPU with tiny models and a 0.01 h synthetic corpus (~36 s of audio,
generated once per session in a temporary directory, ~3 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import REPO, read_metrics, run_cli

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.data.phonemes import NUM_PHONEMES, ids_to_phonemes
from linformer_lab.models.bilstm import BiLSTMCTC
from linformer_lab.models.ctc import edit_distance
from linformer_lab.tasks.speech import SpeechRecognitionTask

TINY_HOURS = 0.01
TINY = dict(d_model=24, n_layers=2, n_heads=2, dropout=0.0)


@pytest.fixture(autouse=True)
def one_thread():
    # On the shared 2-core machine, torch's default of one OpenMP thread per core was measured
    # 10-50x slower for these tiny models (threads spin-wait on each other under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def speech_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("speech_task_corpus")


@pytest.fixture(scope="session")
def tiny_datamodule(speech_root):
    from linformer_lab.data.speech import SpeechDataModule

    dm = SpeechDataModule(root=str(speech_root), hours=TINY_HOURS, seed=0, batch_size=4, progress=False)
    dm.prepare_data()
    dm.setup()
    return dm


# ------------------------------------------------------------------ padding invariance

# Attention configurations for the padding test. lsh: with bucket_size >= the padded length,
# every hashing round forms a single chunk holding all positions, so each query attends to
# every real key whatever the hashes are, and the result is exact shared-QK softmax over the
# real keys -- independent of padding. With smaller chunks the batch's padded length moves the
# chunk boundaries of the later hashing rounds (and what the first chunk looks back to), so a
# padded utterance would see different neighbours than alone: approximate by design.
PADDING_CASES = {
    "softmax": dict(attention=AttentionConfig("softmax")),
    "linear": dict(attention=AttentionConfig("linear", feature_map="elu")),
    "lsh": dict(attention=AttentionConfig("lsh", kwargs={"n_hashes": 4, "bucket_size": 64, "n_buckets": 8})),
    "softmax_subsample2": dict(attention=AttentionConfig("softmax"), subsample=2),
    "linear_learned_positions": dict(attention=AttentionConfig("linear"), positions="learned", max_positions=64),
    "bilstm": dict(encoder="bilstm", lstm_hidden=16, lstm_layers=2),
    "bilstm_packed": dict(encoder="bilstm", lstm_hidden=16, lstm_layers=2, lstm_packed=True),
}


@pytest.mark.parametrize("case", list(PADDING_CASES))
def test_padding_never_changes_an_utterance_output(case):
    torch.manual_seed(0)
    model = SpeechRecognitionTask(**TINY, **PADDING_CASES[case]).eval()
    lengths = torch.tensor([37, 50, 20, 1])
    features = torch.randn(4, 50, 40)
    features[torch.arange(50) >= lengths[:, None]] = 7.0  # junk padding: must not leak in
    with torch.no_grad():
        batched, out_lengths = model(features, lengths)
        assert batched.shape[:2] == (4, int(out_lengths.max()))
        for i in range(4):
            alone, alone_length = model(features[i : i + 1, : lengths[i]], lengths[i : i + 1])
            assert int(alone_length) == int(out_lengths[i])
            torch.testing.assert_close(batched[i, : out_lengths[i]], alone[0], rtol=1e-5, atol=1e-5)


def test_bilstm_packed_and_padded_paths_agree_and_zero_padding():
    torch.manual_seed(0)
    model = BiLSTMCTC(NUM_PHONEMES, hidden_size=8, n_layers=2).eval()
    features, lengths = torch.randn(3, 10, 40), torch.tensor([10, 4, 7])
    model.packed = True
    packed = model.encode(features, lengths)
    model.packed = False
    padded = model.encode(features, lengths)
    assert padded.shape == (3, 10, 16)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)
    assert padded[1, 4:].abs().max() == 0 and padded[2, 7:].abs().max() == 0


def test_bilstm_backward_direction_reads_from_the_real_end():
    # The backward half at the last real frame has read that frame only: it must equal a
    # one-step backward LSTM on it, whatever follows in the padding.
    torch.manual_seed(0)
    model = BiLSTMCTC(NUM_PHONEMES, hidden_size=8, n_layers=1, packed=False).eval()
    features = torch.randn(1, 6, 40)
    hidden = model.encode(features, torch.tensor([4]))
    one_step = model.layers[0]["right_to_left"](features[:, 3:4])[0]
    torch.testing.assert_close(hidden[0, 3, 8:], one_step[0, 0])


# ------------------------------------------------------------------ loss, hyper-parameters


def test_ctc_loss_is_fp32_finite_and_trains(tiny_datamodule):
    torch.manual_seed(0)
    model = SpeechRecognitionTask(**TINY, attention=AttentionConfig("linear"), lr=3e-3)
    batch = next(iter(tiny_datamodule.train_dataloader()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, log_probs, out_lengths = model.ctc_loss(batch)
    assert loss.dtype == torch.float32 and log_probs.dtype == torch.float32
    assert torch.isfinite(loss) and torch.equal(out_lengths, batch["feature_lengths"])
    # a few steps on one batch lower the loss: gradients flow through CTC into the model
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(5):
        loss = model.ctc_loss(batch)[0]
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first


def test_impossible_alignment_gives_zero_not_inf():
    # 3 frames cannot emit 5 phonemes: zero_infinity turns the infinite loss into 0
    model = SpeechRecognitionTask(**TINY)
    batch = {
        "features": torch.randn(1, 3, 40),
        "feature_lengths": torch.tensor([3]),
        "targets": torch.tensor([[1, 2, 3, 4, 5]]),
        "target_lengths": torch.tensor([5]),
    }
    loss = model.ctc_loss(batch)[0]
    assert loss.item() == 0.0


def test_paper_defaults_and_validation():
    transformer = SpeechRecognitionTask()
    assert (transformer.hparams.optimizer, transformer.hparams.lr) == ("radam", 1e-4)
    assert transformer.hparams.attention["backend"] == "linear"
    assert transformer.hparams.num_phonemes == NUM_PHONEMES
    layers = transformer.model.transformer.layers
    assert len(layers) == 9 and layers[0].attention.n_heads == 6 and layers[0].attention.query_dim == 32
    bilstm = SpeechRecognitionTask(encoder="bilstm")
    assert (bilstm.hparams.optimizer, bilstm.hparams.lr) == ("adam", 1e-3)
    assert len(bilstm.model.layers) == 3 and bilstm.model.layers[0]["left_to_right"].hidden_size == 320
    assert SpeechRecognitionTask.monitor == "val/per" and SpeechRecognitionTask.monitor_mode == "min"
    # hparams are plain data that rebuild the same model (what load_from_checkpoint does)
    lsh = SpeechRecognitionTask(**TINY, attention=AttentionConfig("lsh", kwargs={"n_hashes": 2}))
    rebuilt = SpeechRecognitionTask(**dict(lsh.hparams))
    assert rebuilt.attention_config == lsh.attention_config
    assert rebuilt.state_dict().keys() == lsh.state_dict().keys()
    with pytest.raises(ValueError, match="no attention"):
        SpeechRecognitionTask(encoder="bilstm", attention=AttentionConfig("softmax"))
    with pytest.raises(ValueError, match="encoder"):
        SpeechRecognitionTask(encoder="gru")


# ------------------------------------------------------------------ Lightning loop


def test_warmup_rises_linearly_then_leaves_the_learning_rate_alone(tiny_datamodule):
    """warmup_steps=3: the optimizer steps at lr/3, 2 lr/3, lr, lr; after that the warm-up no
    longer writes the learning rate, so what a schedule sets (here a callback, standing in for
    the plateau's halving) stays."""
    seen = []

    class RecordLR(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                trainer.optimizers[0].param_groups[0]["lr"] = 1e-7

    torch.manual_seed(0)
    model = SpeechRecognitionTask(**TINY, lr=3e-6, warmup_steps=3)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, limit_train_batches=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[RecordLR()])
    trainer.fit(model, datamodule=tiny_datamodule)
    assert seen == pytest.approx([1e-6, 2e-6, 3e-6, 3e-6, 1e-7, 1e-7])
    with pytest.raises(ValueError, match="warmup_steps"):
        SpeechRecognitionTask(**TINY, warmup_steps=-1)


def test_training_logs_epoch_time_per_and_halves_lr_on_plateau(tiny_datamodule, tmp_path):
    torch.manual_seed(0)
    # lr so small that val/per cannot improve: patience 0 -> ReduceLROnPlateau halves it
    # after the second validation
    model = SpeechRecognitionTask(**TINY, attention=AttentionConfig("softmax"), lr=1e-6, lr_patience=0, min_lr=0.0)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=1, limit_test_batches=1,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name=""), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=tiny_datamodule)
    metrics = trainer.callback_metrics
    assert metrics["train/epoch_time_s"] > 0
    assert 0 <= metrics["val/per"] and torch.isfinite(metrics["val/loss"])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5e-6)
    (result,) = trainer.test(model, datamodule=tiny_datamodule, verbose=False)
    assert {"test/per", "test/loss"} <= set(result)
    rows = read_metrics(Path(trainer.log_dir))
    assert sum("train/epoch_time_s" in r for r in rows) == 2  # one per epoch


# ------------------------------------------------------------------ configs through the CLI

CONFIGS = ["speech_linear", "speech_softmax", "speech_lsh4", "speech_bilstm"]
CPU_CONFIGS = ["speech_cpu_linear", "speech_cpu_softmax", "speech_cpu_lsh4", "speech_cpu_bilstm"]


@pytest.mark.parametrize("name, extra", [(n, []) for n in CONFIGS + CPU_CONFIGS]
                         + [(name, ["--model.packed", "true"]) for name in ("speech_cpu_linear", "speech_cpu_softmax")])
def test_config_fast_dev_run(name, extra, speech_root, tmp_path):
    """``cli.py fit --config configs/NAME.yaml --trainer.fast_dev_run=true`` with a tiny model/corpus;
    the CPU recipe also with ``--model.packed true`` (docs/cli.md)."""
    if name.endswith("bilstm"):
        size = ["--model.lstm_hidden=8", "--model.lstm_layers=1"]
    else:
        size = ["--model.d_model=12", "--model.n_heads=2", "--model.n_layers=1"]
    code, out, err = run_cli([
        "fit", "--config", f"configs/{name}.yaml",
        "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.root={speech_root}", f"--data.hours={TINY_HOURS}", "--data.batch_size=2",
        "--data.progress=false", *size, *extra,
    ])
    assert code == 0, err[-3000:]


def test_librispeech_configs_differ_only_in_data():
    import yaml

    for name in ("linear", "softmax", "lsh4", "bilstm"):
        speech = yaml.safe_load((REPO / "configs" / f"speech_{name}.yaml").read_text())
        libri = yaml.safe_load((REPO / "configs" / f"librispeech_{name}.yaml").read_text())
        assert libri["data"]["init_args"]["corpus"] == "librispeech"
        assert speech["data"]["init_args"]["corpus"] == "synthetic"
        for section in ("model", "seed_everything"):
            assert json.dumps(speech[section], sort_keys=True) == json.dumps(libri[section], sort_keys=True)
        assert libri["trainer"] == speech["trainer"]


def test_readme_speech_commands_fit_then_test_best(speech_root, tmp_path):
    """The README's speech commands, ``fit --config speech_cpu_linear.yaml`` then ``test
    --config speech_cpu_linear.yaml --ckpt_path best``, at toy size through the real CLI: the
    warm-up, the convolution front-end and the CLI's default CSV logger work together, and the
    best checkpoint is tested."""
    common = [
        "--config", "speech_cpu_linear.yaml", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.root={speech_root}", f"--data.hours={TINY_HOURS}", "--data.batch_size=2", "--data.progress=false",
        "--model.d_model=12", "--model.n_heads=2", "--model.n_layers=1",
    ]
    code, out, err = run_cli(["fit", *common, "--trainer.max_epochs=2", "--trainer.limit_train_batches=3",
                              "--model.warmup_steps=4"])
    assert code == 0, err[-3000:]
    assert any(tmp_path.glob("version_0/checkpoints/best-*.ckpt"))
    code, out, err = run_cli(["test", *common, "--ckpt_path", "best"])
    assert code == 0, err[-3000:]
    tested = [r for v in tmp_path.glob("version_*") for r in read_metrics(v) if "test/per" in r]
    assert tested and 0.0 <= tested[-1]["test/per"] <= 10.0


@pytest.mark.slow
def test_predict_prints_the_phoneme_error_rate_and_decoded_phonemes(speech_root, tmp_path):
    """``predict --ckpt_path best`` after a toy fit: the error rate it prints is the one of the
    predictions it saves (edit distance over reference phonemes), and it shows utterances decoded."""
    common = [
        "--config", "speech_cpu_linear.yaml", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}", f"--data.root={speech_root}", f"--data.hours={TINY_HOURS}",
        "--data.batch_size=2", "--data.progress=false", "--model.d_model=12", "--model.n_heads=2", "--model.n_layers=1",
    ]
    code, _, err = run_cli(["fit", *common, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2"])
    assert code == 0, err[-3000:]
    code, out, err = run_cli(["predict", *common, "--ckpt_path", "best", "--trainer.limit_predict_batches=2"])
    assert code == 0, err[-3000:]
    batches = torch.load(next(tmp_path.glob("version_1/predictions.pt")), weights_only=True)
    pairs = [(ref, hyp) for batch in batches for hyp, ref in zip(batch["predictions"], batch["references"])]
    errors, phonemes = sum(edit_distance(ref, hyp) for ref, hyp in pairs), sum(len(ref) for ref, _ in pairs)
    assert (f"phoneme error rate {errors / phonemes:.4f} ({errors} edits for {phonemes} reference phonemes of "
            f"{len(pairs)} utterances, greedy)") in out, out
    reference, decoded = pairs[0][0], pairs[0][1]
    assert f"  reference {' '.join(ids_to_phonemes(reference))}\n  decoded   {' '.join(ids_to_phonemes(decoded))}" in out, out
