"""C++ CPU extension: the fused RNN step of a stack of linear-attention (elu + 1) layers
(``fused_step.cpp``), which :mod:`linformer_lab.models.fused_step` calls from
:func:`~linformer_lab.models.generation.fast_step`.

Compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; the flags
are portable: ``-O3``, no ``-march=native``, so a cached build runs on any CPU of the
architecture) and cached under ``$LINFORMER_LAB_CPU_BUILD_DIR`` or
``~/.cache/linformer_lab/cpu``, in a folder named after a hash of the source, the torch and
Python versions, the machine architecture, the compiler and the flags. A later process loads
the cached library without compiling (no compiler needed then).

Nothing here is required: :func:`fused_module` returns None (and warns once) where the
extension cannot be built or loaded, and the caller keeps to the Python step.

Public API: :func:`load` (build if needed and import; raises RuntimeError saying why not),
:func:`fused_module` (the same, None instead of an error), :func:`build_dir`,
:func:`find_compiler`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

from linformer_lab.ops.cuda.toolchain import ensure_ninja_on_path

__all__ = ["build_dir", "cache_root", "find_compiler", "fused_module", "load"]

_NAME = "linformer_lab_fused_step"
_SOURCE = Path(__file__).resolve().parent / "fused_step.cpp"
#: Portable flags (no -march=native): one cached build serves every CPU of the architecture.
_CFLAGS = ["-O3"]

_lock = threading.RLock()
_module: ModuleType | None = None
_failure: str | None = None  # why the extension is unavailable in this process, once known


def find_compiler() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would call (``$CXX`` or ``c++``), if on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_root() -> Path:
    """``$LINFORMER_LAB_CPU_BUILD_DIR`` or ``~/.cache/linformer_lab/cpu``."""
    env = os.environ.get("LINFORMER_LAB_CPU_BUILD_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "linformer_lab" / "cpu"


def _compiler_identity(compiler: str | None) -> str:
    if compiler is None:
        return "none"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.basename(compiler)} {version.splitlines()[0] if version else ''}".strip()


def _build_info(compiler: str | None) -> dict:
    return {
        "source_sha256": hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "compiler": _compiler_identity(compiler),
        "cflags": _CFLAGS,
    }


def build_dir(info: dict | None = None) -> Path:
    """The cache folder of the build for this source, torch, Python, machine, compiler and flags."""
    info = info or _build_info(find_compiler())
    digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"torch{info['torch']}-py{info['python']}-{info['machine']}-{digest}"


def _cached_library() -> Path | None:
    """A complete cached build (its build_info.json is written last) for this source, torch,
    Python and machine, whatever the compiler that made it."""
    root = cache_root()
    if not root.is_dir():
        return None
    want = _build_info(None)
    for info_path in sorted(root.glob("*/build_info.json")):
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        library = info_path.parent / f"{_NAME}.so"
        if all(info.get(key) == want[key] for key in ("source_sha256", "torch", "python", "machine", "cflags")) \
                and library.is_file():
            return library
    return None


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(verbose: bool) -> ModuleType:
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
    ensure_ninja_on_path()
    if shutil.which("ninja") is None:
        raise RuntimeError("ninja is not on PATH (it is a Python dependency of the project: pip install ninja)")
    from torch.utils import cpp_extension

    info = _build_info(compiler)
    out_dir = build_dir(info)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built in a folder of this process's own, then moved into place: processes building at once
    # do not wait on each other, and an interrupted build leaves no lock behind (torch's
    # build-folder lock file would make every later build wait for it forever).
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
    try:
        module = cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                                    build_directory=str(scratch), with_cuda=False, is_python_module=True, verbose=verbose)
        if module.__name__ == _NAME:  # torch renames a second build in one process (name_v1): not cached
            os.replace(Path(module.__file__), out_dir / f"{_NAME}.so")  # the loaded library stays mapped
            tmp = out_dir / f"build_info.json.{os.getpid()}"
            tmp.write_text(json.dumps(info, indent=2))
            os.replace(tmp, out_dir / "build_info.json")  # last and atomic: marks a complete build
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return module


def load(verbose: bool = False) -> ModuleType:
    """The extension module (with the ``FusedStack`` class): a cached build if there is one, else
    compiled now. Raises RuntimeError saying why it cannot be had (no compiler, a failed build)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            try:
                library = _cached_library()
                _module = _import(library) if library is not None else _build(verbose)
            except Exception as error:  # noqa: BLE001 - any build or import failure means: unavailable
                lines = str(error).strip().splitlines()
                raise RuntimeError(f"the fused CPU step extension is unavailable: {type(error).__name__}: "
                                   f"{lines[-1] if lines else ''}") from error
    return _module


def fused_module() -> ModuleType | None:
    """:func:`load`, or None where the extension cannot be had (warned once per process, and not
    tried again in this process)."""
    global _failure
    if _module is not None:
        return _module
    if _failure is not None:
        return None
    try:
        return load()
    except RuntimeError as error:
        _failure = str(error)
        warnings.warn(f"{error}; generation keeps to the Python step (linformer_lab.models.generation.fast_step)",
                      RuntimeWarning, stacklevel=2)
        return None
