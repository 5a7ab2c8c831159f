"""Exported models (tasks/export.py): a task written as model.safetensors + config.json loads back
as the same model, in eval mode, generating the same images from the same seed; a converted model
loads without its source; a crafted folder is refused with one line, its pickle never unpickled."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

import linformer_lab as ll
from linformer_lab.tasks.base import Task
from linformer_lab.tasks.copy_task import CopyTask
from linformer_lab.tasks.export import CONFIG_NAME, TASKS, WEIGHTS_NAME, ExportError, from_pretrained, save_pretrained
from linformer_lab.tasks.image_generation import ImageGenerationTask
from linformer_lab.tasks.speech import SpeechRecognitionTask

IMAGE = {"image_shape": (1, 4, 4), "n_layers": 1, "n_heads": 2, "d_model": 16, "d_ff": 32, "num_mixtures": 2}
COPY = {"vocab_size": 8, "sequence_length": 12, "d_model": 16, "n_layers": 1, "n_heads": 2, "lr_decay_steps": None}


def _image_task(attention, seed: int) -> ImageGenerationTask:
    torch.manual_seed(seed)
    return ImageGenerationTask(attention=attention, **IMAGE).eval()


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("attention", [
    {"backend": "linear", "feature_map": "elu"},
    {"backend": "linear", "feature_map": "favor"},    # random features: a buffer the export must carry
    {"backend": "linear", "feature_map": "t2r"},      # a learned map's weights
    {"backend": "softmax"},
], ids=lambda a: a["backend"] + (f"-{a['feature_map']}" if a.get("feature_map") else ""))
def test_an_exported_image_model_generates_the_images_of_the_original(tmp_path, attention):
    original = _image_task(attention, seed=1)
    original.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["class_path"] == "linformer_lab.tasks.image_generation.ImageGenerationTask"
    assert config["init_args"]["attention"]["backend"] == attention["backend"]
    assert config["init_args"]["image_shape"] == [1, 4, 4] and config["init_args"]["d_model"] == 16

    torch.manual_seed(2)  # loading builds the model under another seed: only the file can make it equal
    loaded = ll.from_pretrained(tmp_path)
    assert type(loaded) is ImageGenerationTask and not loaded.training and _same_weights(original, loaded)
    assert _same_weights(ImageGenerationTask.from_pretrained(tmp_path), original)
    assert _same_weights(Task.from_pretrained(tmp_path), original)

    prompt = torch.randint(0, 256, (2, 1, 2, 4), dtype=torch.uint8)
    images = []
    for task in (original, loaded, _image_task(attention, seed=3)):
        torch.manual_seed(7)
        images.append((task.model.generate(2), task.model.generate(2, prefix=prompt)))
    for kind in (0, 1):
        assert images[0][kind].shape == (2, 1, 4, 4) and images[0][kind].dtype == torch.uint8
        assert torch.equal(images[0][kind], images[1][kind])
    # the weights decide the images: a model of other weights draws others from the same seed
    assert not torch.equal(images[0][0], images[2][0])


def test_the_copy_and_speech_tasks_round_trip(tmp_path):
    torch.manual_seed(0)
    copy = CopyTask(attention={"backend": "linear", "feature_map": "hedgehog"}, **COPY).eval()
    speech = SpeechRecognitionTask(attention="linear", d_model=16, n_layers=1, n_heads=2, dropout=0.0).eval()
    tokens = torch.randint(1, 8, (2, 12))
    features, lengths = torch.randn(2, 20, 40), torch.tensor([20, 13])
    for task, run in ((copy, lambda t: t(tokens)), (speech, lambda t: t(features, lengths)[0])):
        folder = tmp_path / type(task).__name__
        task.save_pretrained(folder)
        torch.manual_seed(1)
        loaded = type(task).from_pretrained(folder)
        assert not loaded.training and _same_weights(task, loaded)
        with torch.no_grad():
            assert torch.equal(run(task), run(loaded))


def test_a_converted_model_exports_as_the_result_and_loads_without_its_source(tmp_path):
    """A softmax copy model converted to linear/t2r (init_from's weight transfer) exports with
    init_from null and distill_steps 0: the folder alone rebuilds it, its new map's weights included."""
    torch.manual_seed(0)
    teacher = CopyTask(attention="softmax", **COPY)
    torch.manual_seed(1)
    converted = CopyTask(attention={"backend": "linear", "feature_map": "t2r"}, init_from="gone/softmax.ckpt",
                         distill_steps=5, **COPY)
    converted.initialise_from({"hyper_parameters": {**teacher.hparams, "_class_path": TASKS[0]},
                               "state_dict": teacher.state_dict()}, "gone/softmax.ckpt")
    save_pretrained(converted.eval(), tmp_path)
    init_args = json.loads((tmp_path / CONFIG_NAME).read_text())["init_args"]
    assert init_args["init_from"] is None and init_args["distill_steps"] == 0
    assert init_args["attention"]["feature_map"] == "t2r"
    loaded = from_pretrained(tmp_path)
    assert _same_weights(converted, loaded) and loaded.hparams["init_from"] is None
    assert any(".feature_map." in name for name in loaded.state_dict())
    tokens = torch.randint(1, 8, (2, 12))
    with torch.no_grad():
        assert torch.equal(converted(tokens), loaded(tokens))


# ---------------------------------------------------------------------- crafted folders


def payload(path) -> bytes:
    """A pickle (protocol 2) whose loading calls ``open(path, "w")``: unpickled, it creates ``path``."""
    return b"\x80\x02cbuiltins\nopen\n(V" + str(path).encode() + b"\nVw\ntR."


def test_the_payload_is_live(tmp_path):
    pickle.loads(payload(tmp_path / "ran")).close()
    assert (tmp_path / "ran").exists()


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "export"
    CopyTask(attention="linear", **COPY).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_the_weights_are_as_readable_as_the_config(tmp_path, umask):
    """safetensors writes its file for its owner alone: an export shared on a cluster had a
    config others could read and weights they could not."""
    import os

    previous = os.umask(umask)
    try:
        CopyTask(attention="linear", **COPY).save_pretrained(tmp_path)
    finally:
        os.umask(previous)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in (CONFIG_NAME, WEIGHTS_NAME)}
    assert modes == {CONFIG_NAME: 0o666 & ~umask, WEIGHTS_NAME: 0o666 & ~umask}


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / CONFIG_NAME).read_text())
    for key, value in changes.items():
        if key in config:
            config[key] = value
        else:
            config["init_args"][key] = value
    (folder / CONFIG_NAME).write_text(json.dumps(config))


def _refusal(folder, load=ll.from_pretrained) -> str:
    with pytest.raises(ExportError) as caught:
        load(folder)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_a_class_outside_the_allow_list_is_refused_naming_the_valid_ones(exported):
    for class_path in ("os.system", "builtins.eval", "linformer_lab.tasks.base.Task", None):
        _edit_config(exported, class_path=class_path)
        message = _refusal(exported)
        assert f"names the class {class_path!r}, which is not a registered task (valid: " in message
        assert all(task in message for task in TASKS)


def test_a_config_that_is_not_a_json_object_is_refused(exported, tmp_path):
    marker = tmp_path / "ran"
    (exported / CONFIG_NAME).write_bytes(payload(marker))
    assert "config.json is not JSON (" in _refusal(exported)
    (exported / CONFIG_NAME).write_text("[1, 2]")
    assert "holds a JSON list, not an object" in _refusal(exported)
    (exported / CONFIG_NAME).unlink()
    assert "is not an exported model: it has no config.json (it holds model.safetensors)" in _refusal(exported)
    assert not marker.exists()


def test_arguments_the_task_does_not_take_or_refuses_are_named(exported):
    _edit_config(exported, evil="rm -rf")
    message = _refusal(exported)
    assert "CopyTask takes no argument 'evil' (valid: attention, vocab_size, sequence_length, d_model" in message
    _edit_config(exported, evil=None)
    config = json.loads((exported / CONFIG_NAME).read_text())
    del config["init_args"]["evil"]
    config["init_args"]["attention"] = {"backend": "softmx"}
    (exported / CONFIG_NAME).write_text(json.dumps(config))
    assert "init_args do not build a CopyTask: " in _refusal(exported) and "softmax" in _refusal(exported)
    _edit_config(exported, export_format=2)
    assert "export_format 2 is not one this version reads (1 to 1)" in _refusal(exported)


def test_weights_of_other_names_or_shapes_are_refused(exported):
    weights = load_file(str(exported / WEIGHTS_NAME))
    name = "head.weight"
    renamed = {("head.weights" if k == name else k): v for k, v in weights.items()}
    save_file(renamed, str(exported / WEIGHTS_NAME))
    message = _refusal(exported)
    assert "model.safetensors does not fit the CopyTask its config.json describes: " in message
    assert "1 weights missing from the file (e.g. head.weight)" in message
    assert "1 weights the model does not have (e.g. head.weights)" in message
    save_file(weights, str(exported / WEIGHTS_NAME))
    _edit_config(exported, d_model=32)
    message = _refusal(exported)
    assert "weights of another shape (e.g. " in message and "file (8, 16), model (8, 32)" in message


def test_a_pickle_in_place_of_the_weights_is_refused_unread(exported, tmp_path):
    marker = tmp_path / "ran"
    for write in (lambda path: path.write_bytes(payload(marker)), lambda path: torch.save({"w": torch.zeros(2)}, path)):
        write(exported / WEIGHTS_NAME)
        assert "it is a pickle (torch.save), not safetensors, and unpickling could run code" in _refusal(exported)
    assert not marker.exists()
    (exported / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": 1")
    assert "cannot read" in _refusal(exported) and "not a safetensors file" in _refusal(exported)
    (exported / WEIGHTS_NAME).unlink()
    assert "has no model.safetensors beside its config.json" in _refusal(exported)


def test_a_task_class_loads_only_its_own_kind(exported):
    assert ("holds an exported CopyTask, and ImageGenerationTask.from_pretrained loads its own class only; "
            "linformer_lab.from_pretrained loads any task") in _refusal(exported, ImageGenerationTask.from_pretrained)


def test_only_the_registered_tasks_are_exported(tmp_path):
    class MyCopyTask(CopyTask):
        pass

    with pytest.raises(ExportError, match=r"only the registered tasks load back \(valid: linformer_lab.tasks.copy_task"):
        MyCopyTask(attention="linear", **COPY).save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())
