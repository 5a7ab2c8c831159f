"""``cli.py SUBCOMMAND --config X --help`` answered from the config and the sources of its classes,
without importing them (importing a task imports Lightning, whose start-up is most of a second
command's): the options the config sets, then every option of its model's and data's classes
(``--model.*``, ``--model.attention.*``, ``--data.*``) with their types, descriptions and the
config's values as defaults, read from the classes' ``__init__`` / dataclass fields and their
docstrings' ``Args:`` / ``Attributes:`` sections with :mod:`ast`. ``SUBCOMMAND --help`` without a
config lists every trainer option (LightningCLI's own help)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import re
import textwrap
from pathlib import Path

import yaml

from linformer_lab.cli.args import SUBCOMMANDS


def source_of(module: str) -> Path | None:
    """The file of ``module`` found without importing it or its packages (their ``__init__``
    may import Lightning); None when it is not a plain source file."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return Path(spec.origin) if spec is not None and spec.origin and not rest else None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _class_node(module: str, name: str) -> tuple[ast.ClassDef, ast.Module, str] | None:
    source = source_of(module)
    if source is None:
        return None
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, tree, module
        if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            return _class_node(node.module, real)  # re-exported from another module
    return None


def _imported(tree: ast.Module, name: str, module: str) -> str:
    """Module that ``name`` comes from in ``tree`` (``module`` itself when defined there)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
            return node.module
    return module


def _described(doc: str | None) -> dict[str, str]:
    """``name: text`` entries of a docstring's ``Args:`` / ``Attributes:`` section (``a, b: text``
    describes both; deeper-indented lines continue an entry)."""
    # blank lines inside the section too (Lightning's Trainer separates its entries with them)
    section = re.search(r"^(?:Args|Attributes):\n((?:[ \t]+\S.*\n?|\n(?=[ \t]{4,}\S))*)", doc or "", re.M)
    # a Sphinx cross-reference (:class:`~linformer_lab.tasks.base.Task`) reads as the name it shows (Task)
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1),
                  section.group(1) if section else "")
    text = re.sub(r"``([^`]+)``", r"\1", text)  # literal markup, a terminal shows none
    lines = [line for line in text.splitlines() if line.strip()]
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


def class_options(class_path: str) -> list[tuple[str, str, str | None, str, str | None]] | None:
    """``(name, type, default, description, nested class path)`` per argument of ``class_path``
    (its ``__init__``, a parent's where it passes ``**kwargs`` on, or its dataclass fields);
    None when its source cannot be read."""
    module, _, name = class_path.rpartition(".")
    found = _class_node(module, name)
    if found is None:
        return None
    node, tree, module = found
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    # the class's docstring, else its __init__'s (where Lightning's Trainer describes its arguments)
    described = {**(_described(ast.get_docstring(init)) if init else {}), **_described(ast.get_docstring(node))}
    options = []
    if init is None:  # a dataclass: its annotated fields
        fields = [(f.target.id, f.annotation, f.value) for f in node.body
                  if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)]
    else:
        args = init.args.args[1:]
        defaults = [None] * (len(args) - len(init.args.defaults)) + list(init.args.defaults)
        fields = [(a.arg, a.annotation, d) for a, d in zip(args, defaults)]
        fields += [(a.arg, a.annotation, d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults)]
    for field, annotation, default in fields:
        kind = ast.unparse(annotation) if annotation is not None else "Any"
        if isinstance(default, ast.Call) and ast.unparse(default.func) == "field":  # field(default_factory=dict)
            factory = next((k.value for k in default.keywords if k.arg == "default_factory"), None)
            value = f"{ast.unparse(factory)}()" if factory is not None else None
        else:
            value = ast.unparse(default) if default is not None else None
        nested = next((f"{_imported(tree, n, module)}.{n}" for n in re.findall(r"\b([A-Z]\w*Config)\b", kind)), None)
        options.append((field, kind, value, described.get(field, ""), nested))
    if init is not None and init.args.kwarg is not None and node.bases:  # the rest are the parent's
        base = ast.unparse(node.bases[0])
        inherited = class_options(f"{_imported(tree, base, module)}.{base}") or []
        options += [o for o in inherited if o[0] not in {name for name, *_ in options}]
    return options


def _section(class_path: str, prefix: str, values: dict) -> list[str]:
    options = class_options(class_path)
    if options is None:
        return [f"--{prefix}.* ({class_path}): its source cannot be read; cli.py fit --{prefix}.help {class_path} lists them."]
    lines, nested = [f"--{prefix}.* ({class_path}):"], []
    for name, kind, default, text, inner in options:
        shown = values[name] if name in values and not isinstance(values[name], dict) else default
        shown = {None: "null", "None": "null", "True": "true", "False": "false", "dict()": "{}", "list()": "[]"}.get(
            shown if isinstance(shown, str | None) else "", shown)
        lines.append(f"  --{prefix}.{name} {name.upper()}")
        about = f"{text} (type: {kind}, default: {shown})".strip()
        lines += textwrap.wrap(about, width=96, initial_indent="      ", subsequent_indent="      ")
        if inner:
            nested.append((inner, f"{prefix}.{name}", values.get(name) if isinstance(values.get(name), dict) else {}))
    for inner, inner_prefix, inner_values in nested:
        lines += ["", *_section(inner, inner_prefix, inner_values)]
    return lines


def _flat(node, prefix: str) -> list[str]:
    if isinstance(node, dict) and "class_path" not in node and node:
        return [line for key, value in node.items() for line in _flat(value, f"{prefix}.{key}")]
    return [f"  {prefix} {yaml.safe_dump(node, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"]


def _merge(earlier, later):
    """A later config's values over an earlier's, key by key; another class_path replaces the group."""
    if not (isinstance(earlier, dict) and isinstance(later, dict)):
        return later
    if "class_path" in later and later.get("class_path") != earlier.get("class_path"):
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


#: where ``--model.attention NAME`` finds the fields it resets (:func:`attention_by_name`)
ATTENTION_CONFIG = "linformer_lab.attention.config.AttentionConfig"


def attention_by_name(argv: list[str]) -> list[str]:
    """``argv`` with a bare backend name given to ``--model.attention`` (``--model.attention
    softmax``), or set in a config file (``attention: softmax``), read as the Python API reads
    ``attention="softmax"``: that backend with every other field of the AttentionConfig at its
    default. Given as the whole mapping (the file's, right after the file), so that nothing of an
    earlier config's attention (a feature map softmax does not take) carries over, and options of
    the attention given later start from that backend, not from the class's default one; the fields
    and defaults are read from the class's source, as the help reads them."""
    named = [i for i, arg in enumerate(argv) if _bare_name(argv, i)]
    in_files = _configs_naming_a_backend(argv)
    if not (named or in_files):
        return argv
    defaults = {}
    for name, _, default, _, _ in class_options(ATTENTION_CONFIG) or []:
        shown = {"dict()": "{}", "list()": "[]"}.get(default or "None", default or "None")
        with contextlib.suppress(ValueError, SyntaxError):  # a default that is not a literal: the class's own
            defaults[name] = ast.literal_eval(shown)
    out = list(argv)
    for i in named:
        flag, _, value = out[i].partition("=")
        if value:
            out[i] = f"{flag}={json.dumps({**defaults, 'backend': value})}"
        else:
            out[i + 1] = json.dumps({**defaults, "backend": out[i + 1]})
    for i, backend in reversed(in_files):  # from the end, so that the earlier places stay where they are
        out.insert(i + 1, f"--model.attention={json.dumps({**defaults, 'backend': backend})}")
    return out


def _configs_naming_a_backend(argv: list[str]) -> list[tuple[int, str]]:
    """(place in ``argv`` of a config file's path, the backend name) for each config file that sets
    the model's attention to a bare name."""
    found = []
    for i, arg in enumerate(argv):
        value, at = (argv[i + 1], i + 1) if arg in ("-c", "--config") and i + 1 < len(argv) else (arg[9:], i)
        if not (arg in ("-c", "--config") or arg.startswith("--config=")) or not Path(value).is_file():
            continue
        with contextlib.suppress(OSError, yaml.YAMLError, AttributeError):  # not a mapping: the parser says so
            model = (yaml.safe_load(Path(value).read_text()) or {}).get("model")
            if isinstance(model, dict):
                attention = (model.get("init_args") if isinstance(model.get("init_args"), dict) else model).get("attention")
                if isinstance(attention, str) and _is_a_name(attention):
                    found.append((at, attention))
    return found


def _is_a_name(value: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_][\w-]*", value)) and value.lower() not in ("null", "none")


def _bare_name(argv: list[str], i: int) -> bool:
    flag, eq, value = argv[i].partition("=")
    if flag != "--model.attention" or not (eq or i + 1 < len(argv)):
        return False
    return _is_a_name(value if eq else argv[i + 1])


#: the classes whose arguments are the plain groups of every subcommand, as LightningCLI adds them
SUBCOMMAND_GROUPS = (("trainer", "lightning.pytorch.trainer.trainer.Trainer"),
                     ("checkpoint", "linformer_lab.cli.checkpoints.CheckpointSettings"))
#: the CLI's meaning of an argument where it is not Lightning's (cli/checkpoints.py: resolve_checkpoint_path)
OWN_DESCRIPTIONS = {
    "ckpt_path": "last: the newest last.ckpt of the configured model's runs under the root (a fit without one starts "
                 "from scratch); best: the best checkpoint that last.ckpt records; or a checkpoint file. Checked against "
                 "the configured model before anything runs (docs/cli.md, Resume).",
}
#: arguments of the Trainer's method of a subcommand that LightningCLI fills itself, not options
FILLED_BY_THE_CLI = {"self", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}


def subcommand_help(subcommand: str) -> str:
    """``cli.py SUBCOMMAND --help`` without a config, read from the sources as the config's help is
    (LightningCLI's own help first imports Lightning, most of the command's time): the general
    options, those of the Trainer's method of the subcommand (``ckpt_path``, ...), every
    ``--trainer.*`` and ``--checkpoint.*``, and where the model's and data's options are."""
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
    for name, kind, default, text in _method_options("lightning.pytorch.trainer.trainer.Trainer", subcommand):
        text = OWN_DESCRIPTIONS.get(name, text)
        about = f"{text} (type: {kind}, default: {'null' if default in (None, 'None') else default})".strip()
        lines += [f"  --{name} {name.upper()}", *textwrap.wrap(about, width=96, initial_indent="      ",
                                                                subsequent_indent="      ")]
    for prefix, class_path in SUBCOMMAND_GROUPS:
        lines += ["", *_section(class_path, prefix, {})]
    lines += ["", "The model's and data's options: add --config NAME (or --model.help copy; cli.py --help lists the names)."]
    return "\n".join(lines) + "\n"


def _method_options(class_path: str, method: str) -> list[tuple[str, str, str | None, str]]:
    """``(name, type, default, description)`` per argument of ``class_path.method`` that is an option
    of the subcommand (not one LightningCLI fills: the model, the data), read from the source."""
    module, _, name = class_path.rpartition(".")
    found = _class_node(module, name)
    function = next((f for f in found[0].body if isinstance(f, ast.FunctionDef) and f.name == method), None) if found else None
    if function is None:
        return []
    described = _described(ast.get_docstring(function))
    args = function.args.args
    defaults = [None] * (len(args) - len(function.args.defaults)) + list(function.args.defaults)
    return [(a.arg, ast.unparse(a.annotation) if a.annotation is not None else "Any",
             ast.unparse(d) if d is not None else None, described.get(a.arg, ""))
            for a, d in zip(args, defaults) if a.arg not in FILLED_BY_THE_CLI]
