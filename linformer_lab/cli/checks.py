"""A command's faults said in one line (exit code 2) before anything is written: jsonargparse's
errors as ``unknown option --x; did you mean --y?`` or ``--x V: expected ...``
(:func:`parse_error_line`), values Lightning would refuse only after the run's folder exists
(:func:`trainer_value_error`), a bad kernel switch; and the precision fallback. No torch or
Lightning at module level (``--help`` and ``plugins`` load neither).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import typing

from linformer_lab.cli.args import (
    COUNT_OR_FRACTION,
    UNSET,
    config_value,
    config_values,
    did_you_mean,
    help_requested,
    known_configs,
)
from linformer_lab.cli.config_help import TRAINER, class_options
from linformer_lab.compat import JSONARGPARSE_MESSAGES as FORMS
from linformer_lab.compat import UNION_REPORT_FRAME

#: exit code of every error the CLI reports before any work (bad config value, checkpoint, run directory)
CHECKPOINT_ERROR_EXIT_CODE = 2


def exit_with_error(message: str) -> typing.NoReturn:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(CHECKPOINT_ERROR_EXIT_CODE)


def suggest_option(flag: str, options: typing.Iterable[str]) -> str:
    """The did-you-mean for an unknown ``--group.name``: compared within its group first (the shared
    ``--trainer.`` prefix would make any two trainer flags look alike), then over all."""
    options = sorted(set(options))
    group, _, rest = flag.rpartition(".")
    same_group = {o[len(group) + 1:]: o for o in options if group and o.startswith(group + ".")}
    close = difflib.get_close_matches(rest, list(same_group), n=1, cutoff=0.6) if rest else []
    return f"; did you mean {same_group[close[0]]}?" if close else did_you_mean(flag, options, cutoff=0.8)


def _option_names(class_path: str, prefix: str) -> list[str]:
    """Every ``--PREFIX.NAME`` of ``class_path``'s arguments, one level into config classes."""
    names = []
    for name, *_, nested in class_options(class_path) or []:
        inner = (class_options(nested) if nested else None) or []
        names += [f"--{prefix}.{name}", *(f"--{prefix}.{name}.{sub}" for sub, *_ in inner)]
    return names


def config_holding(path: list[str], configs: typing.Sequence[str]) -> str | None:
    """The last of the config files ``configs`` that sets the key ``path``, or None."""
    return next((config for config in reversed(configs) if config_value(config, path) is not UNSET), None)


def parse_error_line(message: str, options: typing.Iterable[str], prog: str, argv: typing.Sequence[str] = ()) -> str:
    """One line for a jsonargparse error ``message``: an unknown option (with a did-you-mean over the
    parser's ``options`` and the named class's arguments, and the config file of ``argv`` setting it),
    a value of the wrong type, else the report condensed."""
    unknown = re.match(FORMS["unrecognized"], message)
    in_group = re.search(FORMS["group_option"], message)  # a config's key of a plain group (trainer)
    rejected = list(re.finditer(FORMS["not_accepted"], message))
    candidates, path = list(options), []
    if unknown:
        words = unknown.group(1).split()
        flag = next((word for word in words if word.startswith("-")), words[0]).split("=", 1)[0]
    elif in_group:
        kind, group, option = in_group.groups()
        path = [*(group.split(".") if kind == "Group" else []), *option.split(".")]
        if path[0] == "trainer":  # reported by the top parser, whose options are not the subcommand's
            candidates += _option_names(TRAINER, "trainer")
    elif rejected:
        # the innermost rejection, under the keys that lead to it: 'Parser key "model"' (a group),
        # then 'Parser key "attention"' (a dataclass argument of the model), then the option
        before = message[:rejected[-1].start()]
        path = [*re.findall(FORMS["parser_key"], before), rejected[-1].group(1)]
        class_path = re.search(FORMS["class_path"], before)
        if class_path and len(path) > 1:
            candidates += _option_names(class_path.group(1), path[0])
    else:
        wrong_type = type_error_line(message, argv)
        if wrong_type is None:  # the nested union report without its frame
            lines = [line.strip().lstrip("- ") for line in message.splitlines()]
            wrong_type = "; ".join(dict.fromkeys(x for x in lines if x and not x.startswith(UNION_REPORT_FRAME))) or message
        return f"error: {wrong_type} ({prog} --help lists the options)"
    flag = flag if unknown else "--" + ".".join(path)
    source = path and config_holding(path, config_values(list(argv)))
    tip = "--config NAME --help lists the model's and data's options" if flag.startswith(("--model.", "--data.")) \
        else "--help lists the options"
    return f"error: unknown option {flag}{f' in {source}' if source else ''}{suggest_option(flag, candidates)} ({prog} {tip})"


def type_error_line(message: str, argv: typing.Sequence[str] = ()) -> str | None:
    """jsonargparse's report of a value of the wrong type -> ``--trainer.precision 17: expected one
    of 64, 32, ..., bf16 or null``, the flag as given in ``argv`` (or the config file that set it)."""
    keys = list(re.finditer(FORMS["parser_key"], message))
    if not keys:
        return None
    # a model's or data's argument is reported inside its group's ("data": ... "batch_size": ...)
    key, inner = keys[-1], message[keys[-1].end():]
    given = re.search(FORMS["given_value"], inner, re.MULTILINE)
    nested = re.search(FORMS["nested_value"], message)
    given = given.group(1) if given else nested.group(1).strip("'\"") if nested else None
    expected = re.findall(FORMS["expected"], inner)
    if given is None or not expected:
        return None
    path = [part for k in keys for part in k.group(1).split(".")]
    typed = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    flag = next((a for a in reversed(typed) if a == f"--{key.group(1)}" or a.endswith(f".{key.group(1)}")), None)
    source = None if flag else config_holding(path, config_values(list(argv)))
    kinds = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "list": "a list",
             "dict": "a mapping", "NoneType": "null", "dot import path": "a class path", "path": "a file"}
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
    return (f"{flag or '--' + '.'.join(path)} {given.strip()}{f' in {source}' if source else ''}: "
            f"expected {'one of ' if len(choices) > 2 else ''}{wanted}")


def _whole(low: int):  # a whole number >= low
    return lambda v: v >= low and v == int(v)


#: Trainer arguments whose range Lightning checks only while it builds the Trainer, after the run's
#: folder exists: name -> (test of a number, what is valid).
TRAINER_RANGES: dict[str, tuple[typing.Callable[[float], bool], str]] = {
    "max_steps": (_whole(-1), "-1 (no limit) or a number of updates >= 0"),
    "max_epochs": (_whole(-1), "-1 (no limit), null or a number of epochs >= 0"),
    "min_steps": (_whole(0), "null or a number of updates >= 0"),
    "min_epochs": (_whole(0), "null or a number of epochs >= 0"),
    "accumulate_grad_batches": (_whole(1), "a number of batches >= 1"),
    "check_val_every_n_epoch": (_whole(1), "null or a number of epochs >= 1"),
    "log_every_n_steps": (_whole(0), "null or a number of updates >= 0"),
    "num_sanity_val_steps": (_whole(-1), "-1 (all), null or a number of batches >= 0"),
    "gradient_clip_val": (lambda v: v >= 0, "null or a norm (or value) >= 0"),
    **{name: (lambda v: 0 <= v <= 1 or _whole(1)(v), "a number of batches (an integer >= 1), a fraction in [0.0, 1.0] or null")
       for name in (*COUNT_OR_FRACTION, "overfit_batches")},
}


def trainer_value_error(trainer: typing.Mapping) -> str | None:
    """The first ``--trainer.NAME VALUE`` of :data:`TRAINER_RANGES` out of its range, as one line."""
    for name, (valid, what) in TRAINER_RANGES.items():
        value = trainer.get(name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and not (value == value and abs(value) != float("inf") and valid(value)):  # NaN, inf refused
            return f"--trainer.{name} {value}: expected {what}"
    return None


def kernel_switch_error(argv: list[str]) -> str | None:
    """What is wrong with ``LINFORMER_LAB_KERNELS`` for a command that runs kernels (else the first
    kernel call finds it, after the run's folder exists); None when nothing is."""
    runs_kernels = argv[:1] != ["plugins"] or "--check" in argv
    if not os.environ.get("LINFORMER_LAB_KERNELS") or not runs_kernels or help_requested(argv):
        return None  # imports nothing: --help and plugins answer without torch
    from linformer_lab.ops import kernels

    try:
        kernels.forced()
    except ValueError as err:
        return str(err)
    return None


def linked_argument_error(model_class: type, given: typing.Mapping, datamodule, links: typing.Iterable[str]) -> str | None:
    """A model argument the data sets (``links``) given another value than the data's: an error, not replaced."""
    import inspect

    defaults = {n: p.default for n, p in inspect.signature(model_class.__init__).parameters.items() if p.default is not p.empty}
    for name in links:
        from_data = getattr(datamodule, name, None)
        if given.get(name) not in (None, defaults.get(name)) and from_data is not None and given[name] != from_data:
            return (f"--model.{name} {given[name]} contradicts the data: {type(datamodule).__name__} "
                    f"gives {name}={from_data}, and the model takes it from there. Leave --model.{name} "
                    f"unset and change the data instead (e.g. --data.max_length for the copy task).")
    return None


def resolve_precision(precision, accelerator):
    """A precision the device cannot run (well) -> the closest it can, in one line (docs/cli.md,
    "Precision"): fp16 AMP on CPU -> bf16-mixed; bf16 on a CPU without bf16 units -> 32-true;
    16-true on CPU refused (NaN without loss scaling); bf16 on a pre-Ampere GPU -> 16-mixed."""
    import torch
    from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

    if precision is None:
        return None
    value = str(precision)
    if accelerator in (None, "auto"):
        cpu = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    else:
        cpu = accelerator == "cpu" if isinstance(accelerator, str) else type(accelerator).__name__ == "CPUAccelerator"
    if cpu and value == "16-true":
        exit_with_error("--trainer.precision 16-true: fp16 weights on a CPU train to NaN within a few updates "
                        "(no loss scaling); use 32-true, or bf16-mixed on a CPU with bf16 units")
    if cpu and value in ("16", "16-mixed", "bf16", "bf16-mixed", "bf16-true"):
        from linformer_lab.ops.cpu import isa

        try:
            units = isa.bf16_units()
        except ValueError as err:  # a bad LINFORMER_LAB_CPU_BF16
            exit_with_error(str(err))
        if units is None:
            if rank_zero_only.rank == 0:
                sys.stderr.write(f"precision {value}: this CPU has no bf16 units (AVX512-BF16 or AMX), where bf16 "
                                 f"is slower than fp32: training in fp32 (32-true; docs/cli.md, Precision)\n")
            return "32-true"
        if value in ("16", "16-mixed"):
            rank_zero_warn(f"precision={value!r} (fp16 AMP) is not available on CPU; using 'bf16-mixed' instead")
            return "bf16-mixed"
    if not cpu and value in ("bf16", "bf16-mixed") and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        rank_zero_warn(f"precision={value!r}: this GPU has no bfloat16 support; using '16-mixed' instead")
        return "16-mixed"
    return precision


def experiment_name(config) -> str:
    """Stem of the first --config file, else the model class name (for logs/<name>)."""
    for source in config.get("config") or []:
        path = getattr(source, "relative", None) or getattr(source, "absolute", None) or str(source)
        return os.path.splitext(os.path.basename(str(path)))[0]
    return ((config.get("model") or {}).get("class_path") or "run").rsplit(".", 1)[-1].lower()


def none_strings_to_none(node) -> None:
    """``"None"`` -> None: jsonargparse 4.53 parses ``--model.attention.feature_map=null`` (a ``str |
    None`` field of a dataclass in a subclass-mode class) as the string; from YAML it is None."""
    for key, value in list(node.items() if hasattr(node, "items") else []):
        if value == "None":
            node[key] = None
        elif hasattr(value, "items"):
            none_strings_to_none(value)


def cpu_recipe(config_name: str) -> str | None:
    """The CPU-sized shipped config of a GPU-sized one (``mnist_linear`` -> ``mnist_cpu_linear.yaml``), or None."""
    head, _, rest = config_name.partition("_")
    name = f"{head}_cpu_{rest}.yaml"
    return name if rest and not rest.startswith("cpu_") and name in known_configs() else None
