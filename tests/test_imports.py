"""The import drawing of the package: module by module, no loops and no arrow pointing up
(docs/ARCHITECTURE.md, "Layers").

Every first-party import of every module inside ``linformer_lab/`` is an arrow, imports inside
functions included (the usual way to hide a loop). ``from package import name`` points at the
module ``package.name`` where there is one, else at ``package``. A module's floor is its top-level
layer (``LAYER_OF`` of ``tests/test_architecture.py``) and, inside ``ops/``, its floor there
(``OPS_FLOORS``): the building blocks, the extensions' loaders, the implementations, the GPU
implementations (which reuse the PyTorch forms' state helpers), and the router ``ops/kernels.py``
on top, which imports the implementations and which nothing below the layers imports back (the
causal numerator reaches ``ops.linear_attention`` as an argument). An arrow may point to its own
floor or below; a loop is wrong on any floor.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_architecture import LAYER_OF, PACKAGE, fake_package

#: ``ops/`` bottom to top: a module (or a package and everything in it) -> its floor. The longest
#: name that matches a module decides; every module of ``ops/`` needs one.
OPS_FLOORS = {
    "ops": 0, "ops.masks": 0, "ops.build_cache": 0, "ops.state": 0,
    "ops.cpu": 1, "ops.custom_ops": 1, "ops.cuda.toolchain": 1,
    "ops.linear_attention": 2, "ops.lsh": 2, "ops.reference": 2,
    "ops.cuda": 3,  # the CUDA numerator and the Triton kernel: their states are linear_attention's
    "ops.cpu.causal_recurrence": 3,  # the C++ attention's Python: its PyTorch forms are linear_attention's
    "ops.kernels": 4,  # the router
    "ops.kernel_check": 5,  # the router's candidates against their references (plugins --check, describe)
}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the first-party modules it imports (nested and relative imports included)."""
    modules = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = own_package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                targets |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
        targets = {t for t in targets if t.split(".")[0] == package.name}
        # importing a.b.c first runs the packages a and a.b, unless they hold the importer (then
        # they are running already): an arrow to each
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        targets |= {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)} - ancestors
        graph[name] = targets - {name}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def floor(module: str) -> tuple[int, int]:
    """(top-level layer, floor inside ``ops/``) of ``linformer_lab.a.b...``; the package root sits above all."""
    parts = module.split(".")[1:]
    if not parts:
        return (max(LAYER_OF.values()) + 1, 0)
    if parts[0] not in LAYER_OF:
        raise AssertionError(f"{module}: top-level module {parts[0]!r} has no layer in LAYER_OF")
    if parts[0] != "ops":
        return (LAYER_OF[parts[0]], 0)
    names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    matched = next((n for n in names if n in OPS_FLOORS and (n != "ops" or len(parts) == 1)), None)
    if matched is None:
        raise AssertionError(f"{module} has no floor in OPS_FLOORS (tests/test_imports.py); give it one")
    return (LAYER_OF["ops"], OPS_FLOORS[matched])


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every arrow into a higher floor, as ``importer -> imported``; the root's re-exports excepted."""
    return [f"{importer} -> {target}" for importer, targets in sorted(graph.items()) if "." in importer
            for target in sorted(targets) if floor(target) > floor(importer)]


def test_the_import_drawing_has_no_loops():
    found = loops(import_graph())
    assert not found, "import loops (each a group of modules that import each other):\n" + "\n".join(map(str, found))


def test_the_import_drawing_has_no_upward_arrows():
    found = upward_arrows(import_graph())
    assert not found, "imports that point up (docs/ARCHITECTURE.md, 'Layers'):\n" + "\n".join(found)


def test_the_drawing_sees_loops_and_upward_arrows_inside_ops(tmp_path):
    pkg = fake_package(tmp_path, {
        "ops/kernels.py": "def pick():\n    from linformer_lab.ops.linear_attention import chunk\n",
        "ops/linear_attention/__init__.py": "from linformer_lab.ops.kernels import pick\n",
        "ops/linear_attention/chunk.py": "from . import naive\n",
        "ops/linear_attention/naive.py": "",
        "ops/lsh.py": "from linformer_lab.ops import masks\n",
        "ops/masks.py": "",
    })
    graph = import_graph(pkg)
    assert graph["linformer_lab.ops.kernels"] == {"linformer_lab.ops.linear_attention",  # run before its chunk
                                                  "linformer_lab.ops.linear_attention.chunk"}
    assert graph["linformer_lab.ops.linear_attention.chunk"] == {"linformer_lab.ops.linear_attention.naive"}
    assert graph["linformer_lab.ops.lsh"] == {"linformer_lab.ops.masks"}
    assert loops(graph) == [["linformer_lab.ops.kernels", "linformer_lab.ops.linear_attention"]]
    assert upward_arrows(graph) == ["linformer_lab.ops.linear_attention -> linformer_lab.ops.kernels"]
