"""``cli.py SUBCOMMAND [--config X] --help`` read from the config and the sources of its classes with
:mod:`ast`, without importing them: importing a task imports Lightning, most of a command's start-up.
The same reading gives the did-you-mean its candidates (:func:`class_options`) and
``--model.attention NAME`` its defaults (:func:`attention_by_name`)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import re
import textwrap
from pathlib import Path

import yaml

from linformer_lab.cli.args import SUBCOMMANDS, config_value, option_places

#: where ``--model.attention NAME`` finds the fields it resets (:func:`attention_by_name`)
ATTENTION_CONFIG = "linformer_lab.attention.config.AttentionConfig"
TRAINER = "lightning.pytorch.trainer.trainer.Trainer"
#: the classes whose arguments are the plain groups of every subcommand, as LightningCLI adds them
SUBCOMMAND_GROUPS = (("trainer", TRAINER), ("checkpoint", "linformer_lab.cli.checkpoints.CheckpointSettings"))
#: the CLI's meaning of an argument where it is not Lightning's (checkpoints.resolve_checkpoint_path)
OWN_DESCRIPTIONS = {
    "ckpt_path": "last: the newest last.ckpt of the configured model's runs under the root (a fit without one starts "
                 "from scratch); best: the best checkpoint that last.ckpt records; or a checkpoint file. Checked against "
                 "the configured model before anything runs (docs/cli.md, Resume).",
}
#: arguments of the Trainer's method of a subcommand that LightningCLI fills itself, not options
FILLED_BY_THE_CLI = {"self", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}
SHOWN = {None: "null", "None": "null", "True": "true", "False": "false", "dict()": "{}", "list()": "[]"}


def source_of(module: str) -> Path | None:
    """The file of ``module``, found without importing it or its packages (whose ``__init__`` may
    import Lightning); None when it is not a plain source file."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return Path(spec.origin) if spec is not None and spec.origin and not rest else None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return next((c for c in (path.with_suffix(".py"), path / "__init__.py") if c.is_file()), None)


def _class_node(module: str, name: str) -> tuple[ast.ClassDef, ast.Module, str] | None:
    source = source_of(module)
    if source is None:
        return None
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, tree, module
        real = _imported_as(node, name)
        if real:
            return _class_node(node.module, real)  # re-exported from another module
    return None


def _imported_as(node: ast.stmt, name: str) -> str | None:
    """The real name of ``name`` when ``node`` is a ``from M import`` of it."""
    if isinstance(node, ast.ImportFrom) and node.module:
        return next((a.name for a in node.names if (a.asname or a.name) == name), None)
    return None


def _module_of(tree: ast.Module, name: str, module: str) -> str:
    """Module that ``name`` comes from in ``tree`` (``module`` itself when defined there)."""
    return next((node.module for node in tree.body if _imported_as(node, name)), module)


def _described(doc: str | None) -> dict[str, str]:
    """``name: text`` entries of a docstring's ``Args:`` / ``Attributes:`` section (``a, b: text``
    describes both; deeper-indented lines continue an entry)."""
    # blank lines inside the section too (Lightning's Trainer separates its entries with them)
    section = re.search(r"^(?:Args|Attributes):\n((?:[ \t]+\S.*\n?|\n(?=[ \t]{4,}\S))*)", doc or "", re.M)
    # a terminal shows no markup: :class:`~a.b.Task` reads as Task, ``x`` as x
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1),
                  section.group(1) if section else "")
    lines = [line for line in re.sub(r"``([^`]+)``", r"\1", text).splitlines() if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    found: dict[str, str] = {}
    names: list[str] = []
    for line in lines:
        if len(line) - len(line.lstrip()) == indent and ": " in line:
            head, _, text = line.strip().partition(": ")
            names = [re.sub(r"\s*\(.*?\)", "", name).strip() for name in head.split(",")]
            found.update(dict.fromkeys(names, text))
        else:
            found.update({name: f"{found[name]} {line.strip()}" for name in names})
    return found


def _arguments(function: ast.FunctionDef) -> list[tuple[str, ast.expr | None, ast.expr | None]]:
    """(name, annotation, default) of every named argument of ``function``."""
    args = function.args.args
    defaults = [None] * (len(args) - len(function.args.defaults)) + list(function.args.defaults)
    return [(a.arg, a.annotation, d) for a, d in
            [*zip(args, defaults), *zip(function.args.kwonlyargs, function.args.kw_defaults)]]


def class_options(class_path: str) -> list[tuple[str, str, str | None, str, str | None]] | None:
    """``(name, type, default, description, nested class path)`` per argument of ``class_path`` (its
    ``__init__``, a parent's where it passes ``**kwargs`` on, or its dataclass fields); None when its
    source cannot be read."""
    module, _, name = class_path.rpartition(".")
    found = _class_node(module, name)
    if found is None:
        return None
    node, tree, module = found
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    # the class's docstring, else its __init__'s (where Lightning's Trainer describes its arguments)
    described = {**(_described(ast.get_docstring(init)) if init else {}), **_described(ast.get_docstring(node))}
    if init is None:  # a dataclass: its annotated fields
        fields = [(f.target.id, f.annotation, f.value) for f in node.body
                  if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)]
    else:
        fields = _arguments(init)[1:]
    options = []
    for field, annotation, default in fields:
        kind = ast.unparse(annotation) if annotation is not None else "Any"
        if isinstance(default, ast.Call) and ast.unparse(default.func) == "field":  # field(default_factory=dict)
            factory = next((k.value for k in default.keywords if k.arg == "default_factory"), None)
            value = f"{ast.unparse(factory)}()" if factory is not None else None
        else:
            value = ast.unparse(default) if default is not None else None
        nested = next((f"{_module_of(tree, n, module)}.{n}" for n in re.findall(r"\b([A-Z]\w*Config)\b", kind)), None)
        options.append((field, kind, value, described.get(field, ""), nested))
    if init is not None and init.args.kwarg is not None and node.bases:  # the rest are the parent's
        base = ast.unparse(node.bases[0])
        own = {option[0] for option in options}
        options += [o for o in class_options(f"{_module_of(tree, base, module)}.{base}") or [] if o[0] not in own]
    return options


def _option_lines(prefix: str, name: str, kind: str, default, text: str) -> list[str]:
    about = f"{text} (type: {kind}, default: {SHOWN.get(default, default) if isinstance(default, str | None) else default})"
    return [f"  --{prefix}{name} {name.upper()}",
            *textwrap.wrap(about.strip(), width=96, initial_indent="      ", subsequent_indent="      ")]


def _section(class_path: str, prefix: str, values: dict) -> list[str]:
    options = class_options(class_path)
    if options is None:
        return [f"--{prefix}.* ({class_path}): its source cannot be read; cli.py fit --{prefix}.help {class_path} lists them."]
    lines, nested = [f"--{prefix}.* ({class_path}):"], []
    for name, kind, default, text, inner in options:
        given = values.get(name)
        lines += _option_lines(f"{prefix}.", name, kind, given if name in values and not isinstance(given, dict) else default,
                               text)
        if inner:
            nested.append((inner, f"{prefix}.{name}", given if isinstance(given, dict) else {}))
    for inner, inner_prefix, inner_values in nested:
        lines += ["", *_section(inner, inner_prefix, inner_values)]
    return lines


def _flat(node, prefix: str) -> list[str]:
    if isinstance(node, dict) and "class_path" not in node and node:
        return [line for key, value in node.items() for line in _flat(value, f"{prefix}.{key}")]
    return [f"  {prefix} {yaml.safe_dump(node, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"]


def _merge(earlier, later):
    """A later config's values over an earlier's, key by key; another class_path replaces the group."""
    if not (isinstance(earlier, dict) and isinstance(later, dict)) or later.get("class_path", earlier.get("class_path")) \
            != earlier.get("class_path"):
        return later
    return {**earlier, **{key: _merge(earlier.get(key), value) for key, value in later.items()}}


def config_help(subcommand: str, config_paths: list[str]) -> str:
    """The help of ``subcommand`` with the config files ``config_paths`` (found, later ones win)."""
    merged: dict = {}
    for path in config_paths:
        content = yaml.safe_load(Path(path).read_text() if Path(path).is_file() else path) or {}
        merged = _merge(merged, content.get(subcommand, content) if isinstance(content, dict) else {})
    lines = [f"usage: cli.py {subcommand} --config {' --config '.join(config_paths)} [--group.option VALUE ...]", "",
             f"set by the config (any can be given again; cli.py {subcommand} --help lists every trainer option):"]
    for key, value in merged.items():
        classed = isinstance(value, dict) and value.get("class_path")
        lines += _flat(value.get("init_args") or {} if classed else value, f"--{key}")
    for group in ("model", "data"):
        node = merged.get(group)
        if isinstance(node, dict) and node.get("class_path"):
            lines += ["", f"{group} options (defaults: the config's values):",
                      *_section(node["class_path"], group, node.get("init_args") or {})]
    return "\n".join(lines) + "\n"


def subcommand_help(subcommand: str) -> str:
    """``cli.py SUBCOMMAND --help`` without a config, read from the sources as the config's help is:
    the general options, those of the Trainer's method of the subcommand, ``--trainer.*`` and
    ``--checkpoint.*``."""
    lines = [f"usage: cli.py {subcommand} --config NAME.yaml [--group.option VALUE ...]", "",
             f"{SUBCOMMANDS[subcommand].capitalize()}. Options (later ones win; a config's values: cli.py {subcommand} "
             f"--config NAME --help):",
             "  -c CONFIG, --config CONFIG",
             "      a config file (yaml or json), looked up as given, in ./configs, then in this checkout's configs/;",
             "      several are merged in order",
             "  --print_config",
             "      print the complete resolved configuration and exit",
             "  --seed_everything SEED_EVERYTHING",
             "      the seed set before the classes are built; true draws one (type: bool | int, default: 0)",
             "  --model CLASS_PATH_OR_NAME, --data CLASS_PATH_OR_NAME",
             "      the task (a LightningModule) and its data (a LightningDataModule), usually from the config",
             "  --optimizer CLASS_PATH_OR_NAME, --lr_scheduler CLASS_PATH_OR_NAME",
             "      a torch optimizer and learning-rate scheduler in place of the task's own (configure_optimizers)"]
    found = _class_node(*TRAINER.rsplit(".", 1))
    method = next((f for f in found[0].body if isinstance(f, ast.FunctionDef) and f.name == subcommand), None) if found else None
    described = _described(ast.get_docstring(method)) if method else {}
    for name, annotation, default in _arguments(method)[:len(method.args.args)] if method else []:
        if name not in FILLED_BY_THE_CLI:
            lines += _option_lines("", name, ast.unparse(annotation) if annotation is not None else "Any",
                                   ast.unparse(default) if default is not None else None,
                                   OWN_DESCRIPTIONS.get(name, described.get(name, "")))
    for prefix, class_path in SUBCOMMAND_GROUPS:
        lines += ["", *_section(class_path, prefix, {})]
    lines += ["", "The model's and data's options: add --config NAME (or --model.help copy; cli.py --help lists the names)."]
    return "\n".join(lines) + "\n"


def attention_by_name(argv: list[str]) -> list[str]:
    """``argv`` with a bare backend name given to ``--model.attention softmax`` (or set in a config
    file, ``attention: softmax``) read as the Python API reads ``attention="softmax"``: that backend
    with every other field of the AttentionConfig at its default, given as the whole mapping so that
    nothing of an earlier config's attention carries over."""
    def is_a_name(value) -> bool:
        return isinstance(value, str) and bool(re.fullmatch(r"[A-Za-z_][\w-]*", value)) and value.lower() not in ("null", "none")

    named = [(i, before, value) for i, _, before, value in option_places(argv, ("--model.attention",)) if is_a_name(value)]
    # (index of a config file's path, the backend it names)
    in_files = [(i, attention) for i, *_, value in option_places(argv)
                if is_a_name(attention := config_value(value, ["model", "attention"]))]
    if not (named or in_files):
        return argv
    defaults = {}
    for name, _, default, _, _ in class_options(ATTENTION_CONFIG) or []:
        with contextlib.suppress(ValueError, SyntaxError):  # a default that is not a literal: the class's own
            defaults[name] = ast.literal_eval({"dict()": "{}", "list()": "[]"}.get(default or "None", default or "None"))
    out = list(argv)
    for i, before, backend in named:
        out[i] = before + json.dumps({**defaults, "backend": backend})
    for i, backend in reversed(in_files):  # from the end, so that the earlier places stay where they are
        out.insert(i + 1, f"--model.attention={json.dumps({**defaults, 'backend': backend})}")
    return out
