"""A trained model as a folder: ``model.safetensors`` (the weights) and ``config.json`` (the task
class and its arguments, all that rebuilds the model), Hugging Face's file names, so the folder
can be pushed to the Hub as it is and loaded back with :func:`from_pretrained`.

Loading runs no code from the folder: the weights are read by safetensors (tensors only, no
pickle), the config by ``json``; the class it names must be one of :data:`TASKS`, and the file
must hold that model's weight names and shapes. Anything else is a one-line :class:`ExportError`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
from pathlib import Path

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: the layout of config.json this version writes and reads; a newer one is refused, not guessed at
EXPORT_FORMAT = 1

#: The task classes a config.json may name: the only classes loading builds.
TASKS = (
    "linformer_lab.tasks.copy_task.CopyTask",
    "linformer_lab.tasks.image_generation.ImageGenerationTask",
    "linformer_lab.tasks.speech.SpeechRecognitionTask",
)

#: Arguments that say how a model was made (``init_from``), reset in an export: loading the
#: exported weights needs neither the source checkpoint nor a distillation.
MADE_FROM = {"init_from": None, "distill_steps": 0}

#: The first bytes of the files a pickle-based ``torch.save`` writes (a zip archive; a bare pickle)
PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")


class ExportError(ValueError):
    """A model that cannot be exported, or a folder that does not hold one (the message says why, in one line)."""


def export_config(task: torch.nn.Module) -> dict:
    """What ``config.json`` holds for ``task``: its class path (one of :data:`TASKS`) and the
    arguments that rebuild it (:func:`init_arguments`), as JSON data."""
    class_path = f"{type(task).__module__}.{type(task).__qualname__}"
    if class_path not in TASKS:
        raise ExportError(f"cannot export a {type(task).__name__}: only the registered tasks load back "
                          f"(valid: {', '.join(TASKS)})")
    config = {
        "architectures": [type(task).__name__],
        "class_path": class_path,
        "init_args": init_arguments(task),
        "torch_dtype": str(next(t.dtype for t in task.state_dict().values() if t.is_floating_point())).removeprefix("torch."),
        "export_format": EXPORT_FORMAT,
    }
    try:  # a value JSON cannot hold would be lost or mangled in the file: refused here, while the task is at hand
        return json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ExportError(f"cannot export {type(task).__name__}: an argument is not JSON data ({err})") from None


def init_arguments(task: torch.nn.Module) -> dict:
    """The arguments that rebuild ``task`` as it is: its ``hparams`` that its class's ``__init__``
    takes, :data:`MADE_FROM` reset (the rebuilt task starts from no checkpoint and distils nothing)."""
    accepted = inspect.signature(type(task).__init__).parameters
    init_args = {key: value for key, value in dict(task.hparams).items() if key in accepted and not key.startswith("_")}
    return {**init_args, **{key: value for key, value in MADE_FROM.items() if key in init_args}}


def save_pretrained(task: torch.nn.Module, folder: str | Path) -> Path:
    """Write ``folder/model.safetensors`` (``task.state_dict()``, every tensor on the CPU in its
    own memory) and ``folder/config.json`` (:func:`export_config`); returns ``folder``."""
    config = export_config(task)
    # safetensors refuses tensors that share memory (tied weights, views): each is saved as a copy
    weights = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in task.state_dict().items()}
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    # safetensors writes its file readable by its owner alone (0600): give it the mode the umask gives
    # the config, so that an export shared on a cluster is readable wherever its config is
    shutil.copymode(folder / CONFIG_NAME, folder / WEIGHTS_NAME)
    return folder


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an exported model's ``config.json``."""
    return Path(path).is_dir() and (Path(path) / CONFIG_NAME).is_file()


def read_config(folder: str | Path) -> tuple[str, dict]:
    """``(class_path, init_args)`` of the exported model in ``folder``, the class one of :data:`TASKS`."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in Path(folder).iterdir())[:4]) if Path(folder).is_dir() else ""
        holds = f" (it holds {found})" if found else ""
        raise ExportError(f"{folder} is not an exported model: it has no {CONFIG_NAME}{holds}; "
                          f"cli.py export writes {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"{path} is not JSON ({err}); an exported model's config is a JSON object") from None
    if not isinstance(config, dict):
        raise ExportError(f"{path} holds a JSON {type(config).__name__}, not an object with class_path and init_args")
    if not isinstance(config.get("export_format"), int) or config["export_format"] > EXPORT_FORMAT:
        raise ExportError(f"{path}: export_format {config.get('export_format')!r} is not one this version reads "
                          f"(1 to {EXPORT_FORMAT}); a newer linformer_lab wrote it")
    class_path = config.get("class_path")
    if class_path not in TASKS:
        raise ExportError(f"{path} names the class {class_path!r}, which is not a registered task (valid: {', '.join(TASKS)})")
    init_args = config.get("init_args")
    if not isinstance(init_args, dict):
        raise ExportError(f"{path}: init_args is a {type(init_args).__name__}, not an object of the task's arguments")
    return class_path, init_args


def build_task(class_path: str, init_args: dict, source: str | Path) -> torch.nn.Module:
    """The task ``class_path`` (one of :data:`TASKS`: only this package's classes are imported) built
    from ``init_args``; an argument it does not take, or a value it refuses, is an :class:`ExportError` naming ``source``."""
    if class_path not in TASKS:
        raise ExportError(f"{class_path!r} is not a registered task (valid: {', '.join(TASKS)})")
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    accepted = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    unknown = sorted(set(init_args) - set(accepted))
    if unknown:
        raise ExportError(f"{source}: {cls.__name__} takes no argument {', '.join(map(repr, unknown))} "
                          f"(valid: {', '.join(accepted)})")
    try:
        return cls(**init_args)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{source}: its init_args do not build a {cls.__name__}: {str(err).splitlines()[0]}") from None


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/model.safetensors``, on the CPU; a file that is not safetensors (a
    pickle of ``torch.save`` among them, which is never unpickled) is an :class:`ExportError`."""
    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        raise ExportError(f"{folder} is not an exported model: it has no {WEIGHTS_NAME} beside its {CONFIG_NAME}")
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header
    header_length = int.from_bytes(head[:8], "little")
    safetensors_like = head[8:9] == b"{" and 0 < header_length <= path.stat().st_size - 8
    if not safetensors_like and head.startswith(PICKLE_MAGIC):
        raise ExportError(f"refused {path}: it is a pickle (torch.save), not safetensors, and unpickling could run "
                          f"code; export the model with cli.py export, which writes safetensors")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"cannot read {path}: {str(err).splitlines()[0]}; it is truncated or not a safetensors file") from None


def weight_problems(expected: dict[str, torch.Tensor], found: dict, source: str = "file") -> list[str]:
    """What keeps ``found`` (the tensors of a ``source``: file, checkpoint) from loading into a model
    whose state dict is ``expected``: missing names, unexpected names, other shapes; empty when it fits."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    shapes = [f"{name}: {source} {tuple(found[name].shape)}, model {tuple(tensor.shape)}"
              for name, tensor in expected.items()
              if name in found and hasattr(found[name], "shape") and tuple(found[name].shape) != tuple(tensor.shape)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weights missing from the {source} (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} weights the model does not have (e.g. {', '.join(unexpected[:3])})")
    if shapes:
        problems.append(f"{len(shapes)} weights of another shape (e.g. {'; '.join(shapes[:3])})")
    return problems


def from_pretrained(folder: str | Path, expected: type | None = None, device: str | torch.device = "cpu"):
    """The task exported to ``folder`` (``cli.py export``, :func:`save_pretrained`), its weights
    loaded, in eval mode on ``device``: ``task.model.generate(n)`` samples ``(n, C, H, W)`` uint8
    images from an image task. ``expected``: the task class the folder must hold (None: any of
    :data:`TASKS`). Raises :class:`ExportError`."""
    class_path, init_args = read_config(folder)
    cls_name = class_path.rpartition(".")[2]
    if expected is not None and class_path != f"{expected.__module__}.{expected.__qualname__}":
        raise ExportError(f"{folder} holds an exported {cls_name}, and {expected.__name__}.from_pretrained loads its "
                          f"own class only; linformer_lab.from_pretrained loads any task")
    task = build_task(class_path, init_args, Path(folder) / CONFIG_NAME)
    weights = read_weights(folder)
    problems = weight_problems(task.state_dict(), weights)
    if problems:
        raise ExportError(f"{Path(folder) / WEIGHTS_NAME} does not fit the {cls_name} its {CONFIG_NAME} describes: "
                          + "; ".join(problems))
    task.load_state_dict(weights)
    return task.to(device).eval()
