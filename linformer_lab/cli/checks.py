"""The CLI's checks of a command before it runs, each found at its cause and reported as one
line (exit code 2) before anything is written, and the precision fallback:

* :func:`type_error_line`: jsonargparse's report of a value of the wrong type, as
  ``--trainer.precision 17: expected one of ...``;
* :func:`trainer_value_error`: trainer values out of range (:data:`TRAINER_RANGES`), which
  Lightning finds only while building the Trainer, after the run's folder exists;
* :func:`kernel_switch_error`: an unknown ``LINFORMER_LAB_KERNELS`` value, which the first
  kernel call would find inside the run;
* :func:`resolve_precision`: a precision the device cannot run (well) -> the closest one it can;
* :func:`exit_with_error`: how every such check stops a command (one line, exit code 2).

Nothing at module level imports torch or Lightning (``cli.py --help`` and ``plugins`` load neither).
"""

from __future__ import annotations

import os
import re
import sys
import typing

from linformer_lab.cli.args import COUNT_OR_FRACTION, config_holding, config_values, help_requested, known_configs
from linformer_lab.cli.compat import JSONARGPARSE_MESSAGES

#: exit code of every error the CLI reports before any work (bad config value, checkpoint, run directory)
CHECKPOINT_ERROR_EXIT_CODE = 2


def exit_with_error(message: str):
    """One paragraph on stderr and exit code 2 (:data:`CHECKPOINT_ERROR_EXIT_CODE`): the CLI's
    way to stop on a checkpoint or run-directory fault before any work is done."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(CHECKPOINT_ERROR_EXIT_CODE)


#: Trainer arguments whose range Lightning checks only while it builds the Trainer, after the
#: run's folder exists: name -> (test of a number, what is valid). Checked before anything is
#: written (:func:`trainer_value_error`); other types (a time-based ``val_check_interval``)
#: are left to Lightning.
TRAINER_RANGES: dict[str, tuple[typing.Callable[[float], bool], str]] = {
    "max_steps": (lambda v: v >= -1 and v == int(v), "-1 (no limit) or a number of updates >= 0"),
    "max_epochs": (lambda v: v >= -1 and v == int(v), "-1 (no limit), null or a number of epochs >= 0"),
    "min_steps": (lambda v: v >= 0 and v == int(v), "null or a number of updates >= 0"),
    "min_epochs": (lambda v: v >= 0 and v == int(v), "null or a number of epochs >= 0"),
    "accumulate_grad_batches": (lambda v: v >= 1 and v == int(v), "a number of batches >= 1"),
    "check_val_every_n_epoch": (lambda v: v >= 1 and v == int(v), "null or a number of epochs >= 1"),
    "log_every_n_steps": (lambda v: v >= 0 and v == int(v), "null or a number of updates >= 0"),
    "num_sanity_val_steps": (lambda v: v >= -1 and v == int(v), "-1 (all), null or a number of batches >= 0"),
    "gradient_clip_val": (lambda v: v >= 0, "null or a norm (or value) >= 0"),
    **{name: (lambda v: 0 <= v <= 1 or (v > 1 and v == int(v)),
              "a number of batches (an integer >= 1), a fraction in [0.0, 1.0] or null")
       for name in (*COUNT_OR_FRACTION, "overfit_batches")},
}


def type_error_line(message: str, argv: typing.Sequence[str] = ()) -> str | None:
    """jsonargparse's report of a value of the wrong type (``Parser key "trainer.precision": ...
    Expected a typing.Literal[...] ... Given value: 17``) -> ``--trainer.precision 17: expected one
    of 64, 32, ..., bf16 or null``: the flag as given in ``argv``, the value, the valid types and
    choices once each; None for a message of another kind."""
    keys = list(re.finditer(JSONARGPARSE_MESSAGES["parser_key"], message))
    if not keys:
        return None
    # a model's or data's argument is reported inside its group's ("data": ... "batch_size": ...)
    key, inner = keys[-1], message[keys[-1].end():]
    given = re.search(JSONARGPARSE_MESSAGES["given_value"], inner, re.MULTILINE)
    given = given.group(1) if given else None
    if given is None:
        nested = re.search(JSONARGPARSE_MESSAGES["nested_value"], message)
        given = nested.group(1).strip("'\"") if nested else None
    expected = re.findall(JSONARGPARSE_MESSAGES["expected"], inner)
    if not (given is not None and expected):
        return None
    # "batch_size" for --data.batch_size (a subclass-mode group names the bare argument): the flag as
    # typed; a value from a config file has none, and its keys from the outermost make the flag
    path = [part for k in keys for part in k.group(1).split(".")]
    typed = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    flag = next((a for a in reversed(typed) if a == f"--{key.group(1)}" or a.endswith(f".{key.group(1)}")), None)
    source = None if flag else config_holding(path, config_values(list(argv)))
    flag = flag or "--" + ".".join(path)
    kinds = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
             "list": "a list", "dict": "a mapping", "NoneType": "null", "dot import path": "a class path",
             "path": "a file"}
    choices: list[str] = []
    for item in expected:
        literal = re.match(r"typing\.Literal\[(.*)\]", item)
        if literal:
            choices += [value.strip().strip("'\"") for value in literal.group(1).split(",")]
        else:
            name = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", item)
            choices.append(kinds.get(name, name))
    choices = list(dict.fromkeys(choices))
    wanted = choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    return f"{flag} {given.strip()}{f' in {source}' if source else ''}: expected {'one of ' if len(choices) > 2 else ''}{wanted}"


def trainer_value_error(trainer: typing.Mapping) -> str | None:
    """The first ``--trainer.NAME VALUE`` of :data:`TRAINER_RANGES` out of its range, as one line
    naming what is valid; None when all are valid."""
    for name, (valid, what) in TRAINER_RANGES.items():
        value = trainer.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and not (value == value and abs(value) != float("inf") and valid(value)):  # NaN, inf refused
            return f"--trainer.{name} {value}: expected {what}"
    return None


def kernel_switch_error(argv: list[str]) -> str | None:
    """What is wrong with ``LINFORMER_LAB_KERNELS`` (which kernel computes each op,
    :mod:`linformer_lab.ops.kernels`), checked before a command that runs kernels (a run, ``plugins
    --check``) starts: the first kernel call would fail deep inside the run, after its folder
    exists. None when it is unset or valid, or the command runs no kernel."""
    runs_kernels = argv[:1] != ["plugins"] or "--check" in argv
    if not os.environ.get("LINFORMER_LAB_KERNELS") or not runs_kernels or help_requested(argv):
        return None  # imports nothing: --help and plugins answer without torch
    from linformer_lab.ops import kernels

    try:
        kernels.forced()
    except ValueError as err:
        return str(err)
    return None



def accelerator_is_cpu(accelerator) -> bool:
    """Whether a run with ``--trainer.accelerator`` ``accelerator`` runs on the CPU."""
    import torch

    if accelerator in (None, "auto"):
        return not (torch.cuda.is_available() or torch.backends.mps.is_available())
    if isinstance(accelerator, str):
        return accelerator == "cpu"
    return type(accelerator).__name__ == "CPUAccelerator"


#: Overrides what :func:`cpu_bf16_units` reports (a test's, or a user's who wants bf16 emulated):
#: "amx", "avx512_bf16" or "none".
CPU_BF16_VARIABLE = "LINFORMER_LAB_CPU_BF16"
CPU_BF16_CHOICES = ("amx", "avx512_bf16", "none")


def cpu_bf16_units() -> str | None:
    """The CPU's bf16 units as the precision rule reads them: ``"amx"``, ``"avx512_bf16"`` or None
    (``LINFORMER_LAB_CPU_BF16`` if set, else torch's CPU probe or ``/proc/cpuinfo``)."""
    value = os.environ.get(CPU_BF16_VARIABLE)
    if value:
        if value not in CPU_BF16_CHOICES:
            exit_with_error(f"{CPU_BF16_VARIABLE}={value!r}: expected one of {', '.join(CPU_BF16_CHOICES)}")
        return None if value == "none" else value
    from linformer_lab.ops.cpu import isa

    return isa.matrix_units()


def resolve_precision(precision, accelerator):
    """Map a precision the chosen device cannot run well to the closest one it can (one line each).

    * fp16 AMP (``16-mixed``/``16``) on CPU -> ``bf16-mixed``: autocast on CPU exists for bf16
      only; bf16 keeps the intent (mixed precision, half-size activations).
    * bf16 (``bf16-mixed``/``bf16-true``/``bf16``, or fp16 AMP mapped to it) on a CPU without bf16
      units (AVX512-BF16 or AMX) -> ``32-true``: emulated bf16 is slower than fp32 there, while
      with the units it is faster (docs/cli.md, "Precision").
    * ``16-true`` on CPU: refused (exit 2): fp16 weights without loss scaling train to NaN.
    * bf16 (``bf16-mixed``/``bf16``) on a CUDA GPU without bf16 support (pre-Ampere) -> ``16-mixed``.
    Anything else is returned unchanged (Lightning validates it).
    """
    import torch
    from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

    if precision is None:
        return None
    value = str(precision)
    cpu = accelerator_is_cpu(accelerator)
    if cpu and value == "16-true":
        exit_with_error("--trainer.precision 16-true: fp16 weights on a CPU train to NaN within a few updates "
                        "(no loss scaling); use 32-true, or bf16-mixed on a CPU with bf16 units")
    if cpu and value in ("16", "16-mixed", "bf16", "bf16-mixed", "bf16-true"):
        if cpu_bf16_units() is None:
            if rank_zero_only.rank == 0:
                sys.stderr.write(f"precision {value}: this CPU has no bf16 units (AVX512-BF16 or AMX), where bf16 "
                                 f"is slower than fp32: training in fp32 (32-true; docs/cli.md, Precision)\n")
            return "32-true"
        if value in ("16", "16-mixed"):
            rank_zero_warn(f"precision={value!r} (fp16 AMP) is not available on CPU; using 'bf16-mixed' instead")
            return "bf16-mixed"
    if (
        not cpu
        and value in ("bf16", "bf16-mixed")
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        rank_zero_warn(f"precision={value!r}: this GPU has no bfloat16 support; using '16-mixed' instead")
        return "16-mixed"
    return precision


def linked_argument_error(model_class: type, given: typing.Mapping, datamodule, links: typing.Iterable[str]) -> str | None:
    """A model argument the data sets (``links``, e.g. ``vocab_size``) that the user set (in
    ``given``, the model's init_args) to another value than the data's: an error, not silently
    replaced by the data's. None when there is none."""
    import inspect

    parameters = inspect.signature(model_class.__init__).parameters.items()
    defaults = {n: p.default for n, p in parameters if p.default is not p.empty}
    for name in links:
        if name not in given or given[name] is None or given[name] == defaults.get(name):
            continue
        from_data = getattr(datamodule, name, None)
        if from_data is not None and given[name] != from_data:
            return (f"--model.{name} {given[name]} contradicts the data: {type(datamodule).__name__} "
                    f"gives {name}={from_data}, and the model takes it from there. Leave --model.{name} "
                    f"unset and change the data instead (e.g. --data.max_length for the copy task).")
    return None


# ---------------------------------------------------------------------- configuration fix-ups


def experiment_name(config) -> str:
    """Stem of the first --config file, else the model class name (for logs/<name>)."""
    for source in config.get("config") or []:
        path = getattr(source, "relative", None) or getattr(source, "absolute", None) or str(source)
        return os.path.splitext(os.path.basename(str(path)))[0]
    class_path = (config.get("model") or {}).get("class_path") or "run"
    return class_path.rsplit(".", 1)[-1].lower()


def none_strings_to_none(node) -> None:
    """Turn the string "None" back into None inside the model's arguments.

    jsonargparse 4.53 parses ``--model.attention.feature_map=null`` (a ``str | None`` field of a
    dataclass nested in a subclass-mode class) as the string "None"; from YAML it is None.
    """
    items = node.items() if hasattr(node, "items") else []
    for key, value in list(items):
        if value == "None":
            node[key] = None
        elif hasattr(value, "items"):
            none_strings_to_none(value)


def cpu_recipe(config_name: str) -> str | None:
    """The shipped config that trains a GPU-sized config's model at CPU size, by name:
    ``mnist_linear`` -> ``mnist_cpu_linear.yaml``; None when there is none."""
    head, _, rest = config_name.partition("_")
    name = f"{head}_cpu_{rest}.yaml"
    return name if rest and not rest.startswith("cpu_") and name in known_configs() else None
