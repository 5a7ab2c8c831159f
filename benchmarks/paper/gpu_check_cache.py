"""What ``gpu_check.py`` carries into a device run and back out of it: the previous revision of
the Triton chunk kernel (timed beside the working tree's, so a change is judged by what one run
shows), and the compiled code of the last run (Triton's cache, the C++ and CUDA extensions), so
that no part waits on a compiler.

* The previous kernel: :func:`export_previous` (on a machine with the git history, which the
  device's copy of the working tree lacks) writes ``launch.py`` of
  ``linformer_lab/ops/cuda/triton_chunk/`` at a revision and the modules of that package it
  imports (the kernels) into a folder, their imports of each other made relative;
  :func:`previous_kernel` loads that folder as a package of another name and calls the launch
  functions directly. ``op.py`` stays behind: its ``torch.library`` operators have the working
  tree's names, and a second definition fails.
* The compiled code: :func:`save_triton_cache` / :func:`restore_triton_cache` (each compiled
  kernel's metadata and cubin, Triton's launcher modules, the autotune results; intermediate IR
  left out), :func:`save_extensions` / :func:`restore_extensions` (the build cache's libraries
  and their records). Each archive stays under its cap (:data:`ARCHIVE_CAP`, :data:`EXTENSIONS_CAP`):
  the device tool returns files of at most 16 MiB, and a call takes along at most 64 MiB, of
  which the wheels are ~33 MB and the working tree ~6 MB.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIR = "linformer_lab/ops/cuda/triton_chunk"
#: The module of a revision's kernel that the export starts from (with what it imports of its package).
LAUNCH = "launch.py"
#: The package name the previous kernel is loaded under (the working tree's is taken).
PREVIOUS_PACKAGE = "triton_chunk_prev"
#: Where the device command finds what it carries, relative to the repository root (git-ignored).
CACHE_DIR = ".gpu_cache"
PREVIOUS_DIR = "triton_chunk_prev"
TRITON_ARCHIVE, EXTENSIONS_ARCHIVE = "triton_cache.tar.gz", "extensions.tar.gz"
#: Largest archives written: Triton's cache (what is left out compiles again) and the extensions'
#: builds (over it, none are saved).
ARCHIVE_CAP, EXTENSIONS_CAP = 12 * 2**20, 8 * 2**20
#: What of a compiled Triton kernel a later run loads without compiling: its metadata (``.json``,
#: the group file among them), the binary, and the launcher modules Triton builds with a C compiler.
TRITON_KEPT = (".json", ".cubin", ".so")
EPS = 1e-6


# ---------------------------------------------------------------- the previous kernel
def export_previous(rev: str, folder: Path) -> str:
    """:data:`LAUNCH` of ``rev`` and the modules of its package it imports, directly or through
    each other, into ``folder`` (its earlier files removed), importable as a package of any name:
    returns the short commit. Raises ValueError where one of them imports more of
    ``linformer_lab`` (it would not run apart from its revision)."""
    commit = common.resolve_commit(rev)
    archive = subprocess.run(["git", "archive", commit, KERNEL_DIR], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                 if m.isfile() and m.name.endswith(".py") and Path(m.name).parent.as_posix() == KERNEL_DIR}
    wanted, todo = {}, [LAUNCH]
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted[name] = files[name]
            todo += [f"{module}.py" for module in package_imports(files[name]) if f"{module}.py" in files]
    sources = {name: relative_imports(text, name) for name, text in wanted.items()}
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.py"):
        stale.unlink()
    for name, text in sources.items():
        (folder / name).write_text(text)
    (folder / "__init__.py").write_text(
        f'"""The Triton chunk kernel of revision {commit} ({", ".join(sorted(sources))}), exported by\n'
        f'benchmarks/paper/gpu_check.py --export-previous for timing beside the working tree\'s."""\n\n'
        f'REVISION = "{commit}"\n')
    return commit


def package_imports(text: str) -> set[str]:
    """The modules of the kernel package that ``text`` imports (``from PACKAGE import a, b``,
    ``from PACKAGE.c import ...``)."""
    package, found = KERNEL_DIR.replace("/", "."), set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module == package:
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(package + "."):
            found.add(node.module[len(package) + 1:].split(".")[0])
    return found


def relative_imports(text: str, name: str) -> str:
    """``text`` with its imports of the kernel package's modules made relative
    (``from linformer_lab.ops.cuda.triton_chunk import forward`` -> ``from . import forward``)."""
    package = KERNEL_DIR.replace("/", r"\.")
    text = re.sub(rf"^(\s*)from {package}(\.\w+)? import", lambda m: f"{m.group(1)}from .{(m.group(2) or '')[1:]} import",
                  text, flags=re.M)
    for node in ast.walk(ast.parse(text)):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(m.split(".")[0] == "linformer_lab" for m in modules):
            raise ValueError(f"{name} of that revision imports {', '.join(modules)}: it does not run apart from its "
                             "package; export a revision whose kernel files import only each other")
    return text


def load_previous(folder: Path, name: str = PREVIOUS_PACKAGE):
    """The exported package in ``folder`` as ``name`` (once per process), and its ``launch`` module."""
    folder = Path(folder).resolve()
    package = sys.modules.get(name)
    if package is None or Path(package.__file__).parent != folder:
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
        for module in [m for m in sys.modules if m.startswith(f"{name}.")]:  # those of a package of that name before
            del sys.modules[module]
    return package, importlib.import_module(f"{name}.launch")


def previous_kernel(folder: Path, name: str = PREVIOUS_PACKAGE) -> tuple[Callable, str]:
    """``(f(q, k, v) on (B, T, H, D) with elu + 1 and the normaliser, differentiable, its
    revision)``: the exported kernel through its launch functions. Two launch interfaces are
    known: the state walk and output kernels of revisions up to 10c4e5b (``run_states_forward``,
    ``run_output_forward``, chunk 64) and the super-chunk walks after (``run_forward``, the chunk
    of the working tree's ``default_chunk``)."""
    import torch

    package, launch = load_previous(folder, name)
    walks = hasattr(launch, "run_states_forward")
    if not walks and not hasattr(launch, "run_forward"):
        raise ValueError(f"revision {package.REVISION}: its launch.py has neither run_states_forward nor run_forward")

    def layout(q, v):
        if walks:
            return launch.layout(q, v, None, 64, False)
        from linformer_lab.ops.cuda.triton_chunk.op import default_chunk

        return launch.layout(q, v, None, default_chunk(q.shape[-1], v.shape[-1], q.dtype), False)

    class Previous(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            lay = layout(q, v)
            with launch.on_device(q.device):
                if walks:
                    states, zstates, _, _ = launch.run_states_forward(k, v, None, None, lay, True)
                    out, den = launch.run_output_forward(q, k, v, states, zstates, lay, True, EPS)
                    kept = ()
                else:
                    out, den, _, _, *kept = launch.run_forward(q, k, v, None, None, lay, True, EPS)
            ctx.save_for_backward(q, k, v, out, den, *kept)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, den, *kept = ctx.saved_tensors
            lay, grad_out = layout(q, v), grad_out.to(v.dtype)
            with launch.on_device(q.device):
                if walks:
                    dq, dk, dv, _, _ = launch.run_backward(q, k, v, out, den, grad_out, None, None, None, None, lay, True)
                else:
                    dq, dk, dv, _, _ = launch.run_backward(q, k, v, out, den, grad_out, None, None, None, None, *kept,
                                                           lay, True)
            return dq, dk, dv

    return Previous.apply, package.REVISION


# ---------------------------------------------------------------- compiled code from run to run
def triton_cache_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir)


def save_triton_cache(archive: Path, used: set[str] = frozenset(), cap: int = ARCHIVE_CAP) -> dict:
    """Triton's cache into ``archive`` for :func:`restore_triton_cache`: every autotune result,
    then the compiled kernels the timed parts used (``used``: their cache folders' names), then
    the others, newest first, as many as stay under ``cap`` bytes. Each group file's paths are
    stored relative to its folder. Returns ``{"autotune", "kernels", "used", "left_out", "bytes"}``
    (no archive when the cache is empty)."""
    root = triton_cache_dir()
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    tuned = [p for p in folders if any(p.glob("*.autotune.json"))]
    compiled = sorted((p for p in folders if p not in tuned and any(p.glob("*.json"))),
                      key=lambda p: (p.name not in used, -p.stat().st_mtime))
    count = len(compiled)
    while True:
        with tarfile.open(archive, "w:gz") as tar:
            for folder in tuned + compiled[:count]:
                _add_folder(tar, folder)
        size = archive.stat().st_size
        if size <= cap or count == 0:
            break
        count = int(count * cap / size * 0.9)  # the compressed size grows about in proportion
    if not tuned and not count:
        archive.unlink()
    return {"autotune": len(tuned), "kernels": count, "used": sum(p.name in used for p in compiled[:count]),
            "left_out": len(compiled) - count, "bytes": archive.stat().st_size if archive.exists() else 0}


def _add_folder(tar: tarfile.TarFile, folder: Path) -> None:
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not path.name.endswith(TRITON_KEPT):
            continue
        data = path.read_bytes()
        if path.name.startswith("__grp__"):  # the paths of its files, absolute in the cache: made relative
            group = json.loads(data)
            group["child_paths"] = {k: Path(v).name for k, v in group.get("child_paths", {}).items()
                                    if Path(v).name.endswith(TRITON_KEPT) and (folder / Path(v).name).is_file()}
            data = json.dumps(group).encode()
        info = tarfile.TarInfo(f"{folder.name}/{path.name}")
        info.size, info.mtime = len(data), int(path.stat().st_mtime)
        tar.addfile(info, io.BytesIO(data))


def restore_triton_cache(archive: Path | None) -> dict:
    """Unpack :func:`save_triton_cache`'s archive into Triton's cache, each group file's paths
    made absolute there again: ``{"autotune", "kernels"}`` restored (zeros without an archive)."""
    if archive is None or not Path(archive).is_file():
        return {"autotune": 0, "kernels": 0}
    root = triton_cache_dir()
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tar.extractall(root, members=members, filter="data")
    for group in root.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        paths = {k: str(group.parent / Path(v).name) for k, v in data.get("child_paths", {}).items()}
        group.write_text(json.dumps({**data, "child_paths": paths}))
    return {"autotune": sum(m.name.endswith(".autotune.json") for m in members),
            "kernels": sum(Path(m.name).name.startswith("__grp__") for m in members)}


def build_root() -> Path:
    """The build cache's root (``LINFORMER_LAB_BUILD_DIR`` or its default), one folder per kind."""
    from linformer_lab.ops import build_cache

    return build_cache.cache_root("cpu").parent


def save_extensions(archive: Path, cap: int = EXTENSIONS_CAP) -> int:
    """Every complete build of the build cache (its library and ``build_info.json``, not the
    objects) into ``archive``: the number of builds (no archive when none, or over ``cap``)."""
    root = build_root()
    records = sorted(root.glob("*/**/build_info.json")) if root.is_dir() else []
    if not records:
        return 0
    with tarfile.open(archive, "w:gz") as tar:
        for record in records:
            for path in [*record.parent.glob("*.so"), record]:
                tar.add(path, arcname=str(path.relative_to(root)))
    if archive.stat().st_size > cap:
        archive.unlink()
        return 0
    return len(records)


def restore_extensions(archive: Path | None) -> int:
    """Unpack :func:`save_extensions`' archive into the build cache: the builds restored."""
    if archive is None or not Path(archive).is_file():
        return 0
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tar.extractall(build_root(), members=members, filter="data")
    return sum(m.name.endswith("build_info.json") for m in members)


def record_compilations(path: Path) -> None:
    """Append the cache folder of every Triton compilation in this process (cache hits too) to
    ``path``, for :func:`save_triton_cache`'s ``used``; a no-op without Triton."""
    try:
        import triton
    except ImportError:
        return

    def listener(*, metadata_group, **_):
        folders = {Path(p).parent.name for p in metadata_group.values()}
        with open(path, "a") as f:
            f.writelines(f"{folder}\n" for folder in folders)

    triton.knobs.compilation.listener = listener


def exported_revision(folder: Path) -> str | None:
    """The revision :func:`export_previous` wrote into ``folder``, or None (nothing exported there)."""
    init = Path(folder) / "__init__.py"
    found = re.search(r'^REVISION = "(\w+)"', init.read_text(), flags=re.M) if init.is_file() else None
    return found.group(1) if found else None


def autotune_results() -> int:
    """Autotune results in Triton's cache (restored from an earlier run, or this machine's own)."""
    root = triton_cache_dir()
    return sum(1 for _ in root.glob("*/*.autotune.json")) if root.is_dir() else 0
