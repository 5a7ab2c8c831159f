"""The package's layers import only downward, no module reads another's private names, files stay
small, and comments (Python, C++, CUDA) say why without timing diaries (docs/ARCHITECTURE.md, "Layers").

Read from the source with ``ast``, so imports inside functions (the usual way to hide a cycle)
count too. The layers, bottom to top::

    registry, validation, compat  <  ops  <  feature_maps  <  attention  <  models, data  <  tasks  <  cli

A module may import its own layer and the layers below it, except that ``models`` and ``data``
do not import each other. Nothing imports the package root ``linformer_lab`` (its
``__init__``) from inside the package: the root only re-exports.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "linformer_lab"

LAYER_OF = {
    "registry": 0, "validation": 0, "compat": 0,
    "ops": 1,
    "feature_maps": 2,  # poly2's exact kernel is ops.reference.polynomial_similarity
    "attention": 3,
    "models": 4, "data": 4,
    "tasks": 5,
    "cli": 6,  # the command line's wing: entry, Lightning CLI, checkpoints, plugins --check
}
#: Pairs of one layer that stay apart: (importer, imported).
SEPARATE = {("models", "data"), ("data", "models")}


def _layer(module: str) -> int | None:
    """``linformer_lab.a.b`` -> the layer of ``a``; None for the package root."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] not in LAYER_OF:
        raise AssertionError(f"{module}: top-level module {parts[1]!r} has no layer in LAYER_OF; "
                             "add it (and to docs/ARCHITECTURE.md)")
    return LAYER_OF[parts[1]]


def _module_name(path: Path, package: Path) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, package_dir: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every first-party import in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    name = _module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "linformer_lab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "linformer_lab":
                found.append((node.lineno, module))
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import that points to a higher layer or to the package root, as readable lines."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        importer = _module_name(path, package)
        own = _layer(importer)
        if own is None:  # the root __init__ re-exports; it may import anything
            continue
        for line, module in _imports(path, package):
            target = _layer(module)
            if target is None:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports the package root ({module})")
            elif target > own:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {module} (layer {target} > {own})")
            elif (pair := (importer.split(".")[1], module.split(".")[1])) in SEPARATE:
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {module} ({pair[0]} and {pair[1]} "
                           "are one layer and do not import each other)")
    return bad


def test_no_upward_imports():
    bad = upward_imports()
    assert not bad, "imports against the layer order (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


def fake_package(tmp_path, files: dict[str, str]):
    """A ``linformer_lab`` package under ``tmp_path`` holding ``files`` (path -> source), with
    an empty ``__init__.py`` in every folder that lacks one: input for the checkers' self-tests."""
    pkg = tmp_path / "linformer_lab"
    for name, source in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(source)
    for folder in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        if not (folder / "__init__.py").exists():
            (folder / "__init__.py").write_text("")
    return pkg


def test_the_checker_sees_nested_and_relative_imports(tmp_path):
    pkg = fake_package(tmp_path, {
        "ops/a.py": "def f():\n    from linformer_lab.tasks import x\n    import linformer_lab\n    from ..models import y\n",
        "data/__init__.py": "from linformer_lab.models import z\n",
    })
    bad = upward_imports(pkg)
    assert len(bad) == 4, bad
    assert any("linformer_lab.tasks" in b for b in bad)
    assert any("package root" in b for b in bad)
    assert any("ops/a.py" in b and "linformer_lab.models" in b for b in bad)
    assert any("data/__init__.py" in b and "do not import each other" in b for b in bad)


def test_every_layer_exists():
    """LAYER_OF names what the package holds, no phantom layers (docs/ARCHITECTURE.md lists the same)."""
    present = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert present == set(LAYER_OF)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(dotted: str, package: Path) -> bool:
    path = package.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_reads(package: Path = PACKAGE) -> list[str]:
    """``from linformer_lab.x import _name`` and ``module._name`` where ``module`` is a first-party
    module bound by an import: one module reading another's private names."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        name = _module_name(path, package)
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        module_aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "linformer_lab":
                        module_aliases.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_package.split(".")[: len(own_package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module.split(".")[0] != "linformer_lab":
                    continue
                for alias in node.names:
                    if _is_private(alias.name):
                        bad.append(f"{path.relative_to(package.parent)}:{node.lineno} imports {alias.name} from {module}")
                    elif _is_module(f"{module}.{alias.name}", package):
                        module_aliases.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in module_aliases:
                    bad.append(f"{path.relative_to(package.parent)}:{node.lineno} reads {ast.unparse(node)}")
    return bad


def test_no_module_reads_another_modules_private_names():
    bad = private_reads()
    assert not bad, "private names read across modules (give the owner a public name for it):\n" + "\n".join(bad)


def test_the_private_check_sees_attribute_reads_and_imports(tmp_path):
    pkg = fake_package(tmp_path, {
        "ops/tool.py": "_hidden = 1\n",
        "ops/user.py": "from linformer_lab.ops import tool\nfrom linformer_lab.ops.tool import _hidden\n"
                       "import linformer_lab.ops.tool as t\nimport torch\n"
                       "x = tool._hidden + t._hidden + torch._C + tool.__name__\n"
                       "def f(self):\n    return self._own\n",
    })
    bad = private_reads(pkg)
    assert len(bad) == 3, bad


#: Folders whose Python files stay under MAX_LINES: the library, the benchmarks and the tests.
SMALL_FILE_ROOTS = ("linformer_lab", "benchmarks", "tests")
MAX_LINES = 460


def python_files(roots=SMALL_FILE_ROOTS, repo: Path = PACKAGE.parent) -> list[Path]:
    return sorted(p for root in roots for p in (repo / root).rglob("*.py"))


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_files_stay_small(path):
    # A file past this is split along its seams (docs/ARCHITECTURE.md, "Layers"):
    # a library module by concern, a benchmark into its measurement and its report, a test file
    # by the part of the code it tests, with shared helpers in conftest.py or a helper module.
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines; split it along its seams"


def test_the_size_rule_covers_benchmarks_and_tests():
    covered = {p.relative_to(PACKAGE.parent).parts[0] for p in python_files()}
    assert covered == set(SMALL_FILE_ROOTS)
    assert any(p.parent.name in ("paper", "dev") for p in python_files(("benchmarks",)))  # the rooms' subfolders too


# ---------------------------------------------------------------- lab notes by question
NOTES = PACKAGE.parent / "benchmarks" / "NOTES.md"
NOTES_MAX_LINES = 800


def test_lab_notes_stay_short_and_name_every_dev_script():
    """benchmarks/NOTES.md holds one section per decision and stays readable; every script in
    benchmarks/dev/ guards a decision, so NOTES names it (``dev/<script>.py``) beside its question.
    A script that guards nothing is deleted, its NOTES row citing the last commit that has it."""
    text = NOTES.read_text()
    lines = len(text.splitlines())
    assert lines <= NOTES_MAX_LINES, (f"benchmarks/NOTES.md has {lines} lines (at most {NOTES_MAX_LINES}): drop "
                                      "superseded detail and cite the commit where it lives")
    scripts = sorted(p.name for p in (NOTES.parent / "dev").glob("*.py"))
    unnamed = [name for name in scripts if f"dev/{name}" not in text]
    assert scripts and not unnamed, f"benchmarks/dev/ scripts that no question of NOTES.md names: {unnamed}"


# ---------------------------------------------------------------- comments say why, not what was measured
#: Suffixes of the library's sources whose comments the rule below reads: Python (``#`` comments and
#: docstrings) and the C++ / CUDA extensions (``//`` and ``/* */``).
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh")
_NUMBER = r"\b\d+(?:\.\d+)?"
_TIME_UNIT = r"(?:ns|µs|us|ms|s|seconds|min|minutes)"
_FIGURE = _NUMBER + rf"(?:x|×|\s?%|\s?{_TIME_UNIT})(?!\w)"
_SPEED_WORD = r"\b(?:faster|slower|took|takes|speed-?up|measured|timed|ran)\b"
#: The house's allowed form of a time in a comment: a duration of the data, with what it is the duration of
#: beside it ("25 ms Hann window", "10 ms hop", "4 s of speech", "in units of 10 ms"), or a literal in backticks
#: (``45 s``, what a function prints). Any other duration is how long something took: a timing figure.
_OF_THE_DATA = r"(?:hop|window|frame|pause|speech|audio)s?\b"
_DURATION = rf"(?<!`)(?<!units of ){_NUMBER}\s?{_TIME_UNIT}(?![\w`])(?!\s+(?:of\s+)?(?:[\w-]+\s+)?{_OF_THE_DATA})"
_TIMING = (
    rf"{_FIGURE}.*{_SPEED_WORD}|{_SPEED_WORD}.*{_FIGURE}",  # "ran 7x slower", "took 1.3x", "10 % faster"
    rf"\d\s?->\s?{_NUMBER}\s?(?:ms|µs|us|s)\b",  # before -> after diaries
    r"\d\s?(?:GFLOP/s|GB/s)",  # 200 GFLOP/s
    _DURATION,  # "12 ms", "2.31 s with it, 2.00 s without": no speed word needed
    r"\b\d+\.\d+\s?(?:x|×)(?!\w)",  # a factor with decimals is a measured one: "1.8×", "3.2x" ("4x smaller" is arithmetic)
    r"\d\s?%\s+of\s+(?:[\w-]+\s+){0,4}?(?:step|call|update|iteration|epoch|forward|backward|run)s?\b",  # "8 % of a step"
)
#: What a library comment may not carry (docs/ARCHITECTURE.md): figures, machines and dates go to
#: benchmarks/NOTES.md, and no comment points there; the reason stays in the comment.
FORBIDDEN = {
    "a timing figure": "|".join(f"(?:{pattern})" for pattern in _TIMING),
    "a machine name": r"\b(?:Zen\s?\d|EPYC|Xeon|Ryzen|Threadripper|Intel\(R\))",
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a NOTES.md citation": r"NOTES\.md",
}


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment line of a source: ``#`` comments and the docstrings of modules,
    classes and functions in Python; ``//`` and ``/* */`` in C++ and CUDA."""
    source = path.read_text()
    if path.suffix != ".py":
        return [(source.count("\n", 0, m.start()) + 1 + i, text)
                for m in re.finditer(r"//[^\n]*|/\*.*?\*/", source, flags=re.S) for i, text in enumerate(m.group(0).splitlines())]
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found += [(first.lineno + i, text) for i, text in enumerate(first.value.value.splitlines())]
    return found


def comment_findings(package: Path = PACKAGE) -> list[str]:
    """Every comment line of the library that carries something of FORBIDDEN, as readable lines."""
    bad = []
    for path in sorted(p for p in package.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        for line, text in comments(path):
            bad += [f"{path.relative_to(package.parent)}:{line}: {what}: {text.strip()[:100]}"
                    for what, pattern in FORBIDDEN.items() if re.search(pattern, text)]
    return bad


def test_library_comments_carry_no_timings_machines_dates_or_notes_citations():
    bad = comment_findings()
    assert not bad, ("library and C++ comments say why; timing figures, machines and dates go to benchmarks/NOTES.md, "
                     "uncited (docs/ARCHITECTURE.md):\n" + "\n".join(bad))


def test_the_comment_check_reads_python_and_cpp_comments(tmp_path):
    pkg = fake_package(tmp_path, {
        "ops/a.py": '"""Fast: 2.45x faster per update (benchmarks/NOTES.md)."""\n'
                    "x = 1  # on an AMD EPYC, 2026-11-26\n"
                    "y = '1.5x faster'  # a string, not a comment\n"
                    "def f():\n    \"\"\"(B, H, N) x (N, M); 10 ms hop; 2 x 64 tiles; ~4x smaller.\"\"\"\n",
        "ops/cpu/k.cpp": "// fwd + bwd 78.7 -> 59.6 ms\nint x; /* ran up to 1.4x slower\n   on Zen 5 */\n",
        "ops/cpu/k.h": "// 64 x 64 tile, 16-byte loads\n",
    })
    bad = comment_findings(pkg)
    kinds = sorted((b.split(":")[0].rsplit("/", 1)[-1], b.split(": ")[1]) for b in bad)
    assert kinds == [("a.py", "a NOTES.md citation"), ("a.py", "a date"), ("a.py", "a machine name"),
                     ("a.py", "a timing figure"), ("k.cpp", "a machine name"), ("k.cpp", "a timing figure"),
                     ("k.cpp", "a timing figure")], bad


#: Comment lines that carry a timing figure without a speed word, and lines of the allowed form beside them.
TIMINGS_WITHOUT_A_SPEED_WORD = ["one layer: 2.31 s with it, 2.00 s without", "12 ms per call", "the kernel wins 1.8×",
                                "3.2x over the loop", "8 % of a batch-64 MNIST step", "about 40 us each"]
ALLOWED_TIMES = ["a 25 ms Hann window, 10 ms hop (160 samples)", "~4 s of speech per sentence", "in units of 10 ms",
                 "one position per 10 ms frame", "``45 s``, ``3 h 20 min``", "2 x 64 tiles, ~4x smaller, ~97% of its mass",
                 "silently change memory and speed by 2x"]


def test_the_comment_check_catches_timing_figures_without_a_speed_word(tmp_path):
    lines = TIMINGS_WITHOUT_A_SPEED_WORD + ALLOWED_TIMES
    pkg = fake_package(tmp_path, {"ops/a.py": "".join(f"x{i} = 1  # {text}\n" for i, text in enumerate(lines))})
    flagged = {int(b.split(":")[1]) - 1 for b in comment_findings(pkg) if "a timing figure" in b}
    assert [lines[i] for i in sorted(flagged)] == TIMINGS_WITHOUT_A_SPEED_WORD
