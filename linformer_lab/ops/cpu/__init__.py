"""C++ CPU extensions, each an :class:`Extension` (one source, one module):

* :data:`FUSED_STEP` (``fused_step.cpp``): the fused RNN step of a stack of linear-attention
  (elu + 1) layers, which :mod:`linformer_lab.models.generation.cpu_step` calls from
  :func:`~linformer_lab.models.generation.fast_step`;
* :data:`CAUSAL_RECURRENCE` (``causal_recurrence.cpp``): causal linear attention, numerator and
  normaliser, forward and backward, as a register-resident recurrence, which
  :mod:`linformer_lab.ops.cpu.causal_recurrence` calls (C and M zero-padded to whole
  registers) through the operators of :mod:`linformer_lab.ops.custom_ops`;
* :data:`LSH_WINDOW` (``lsh_window.cpp``): the windowed attention step of Reformer's LSH
  attention, forward and backward, which :func:`linformer_lab.ops.lsh.window_attention_cpp` calls.

Compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; the flags
are portable: ``-O3``, no ``-march=native``, so a cached build runs on any CPU of the
architecture) and cached in the ``cpu`` folder of the one build cache
(:mod:`linformer_lab.ops.build_cache`: ``$LINFORMER_LAB_BUILD_DIR`` or ``~/.cache/linformer_lab``),
in a folder named after a hash of the source and of the headers it may include (``simd.h``),
the torch and Python versions, the machine architecture, the compiler and the flags. A later
process loads the cached library without compiling (no compiler needed then).

Nothing here is required: :meth:`Extension.module` returns None (and warns once) where the
extension cannot be built or loaded, and :mod:`linformer_lab.ops.kernels` picks the next
candidate (in the end the ``pytorch`` one).

Public API: :class:`Extension` with :meth:`~Extension.load` (build if needed and import; raises
RuntimeError saying why not) and :meth:`~Extension.module` (the same, None instead of an error);
:func:`load` and :func:`fused_module`, the same for :data:`FUSED_STEP`; :func:`build_dir`,
:func:`find_compiler`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
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

from linformer_lab.ops import build_cache

__all__ = ["CAUSAL_RECURRENCE", "FUSED_STEP", "LSH_WINDOW", "Extension", "build_dir", "cache_root", "find_compiler",
           "fused_module", "import_cpp_extension", "load"]

#: Portable flags (no -march=native): one cached build serves every CPU of the architecture;
#: the causal kernels reach AVX2 / AVX-512 anyway: their hot loops are compiled once per instruction set
#: (GCC target attributes) and the CPU's best is chosen at load.
_CFLAGS = ["-O3"]
_HERE = Path(__file__).resolve().parent


def find_compiler() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would call (``$CXX`` or ``c++``), if on PATH."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_root() -> Path:
    """The C++ extensions' folder of the build cache (:func:`linformer_lab.ops.build_cache.cache_root`)."""
    return build_cache.cache_root("cpu")


def _compiler_identity(compiler: str | None) -> str:
    if compiler is None:
        return "none"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.basename(compiler)} {version.splitlines()[0] if version else ''}".strip()


def build_dir(info: dict | None = None) -> Path:
    """The cache folder of the build for this source, torch, Python, machine, compiler and flags
    (``info`` from :meth:`Extension.build_info`; None: the fused step's with this compiler)."""
    info = info or FUSED_STEP.build_info(find_compiler())
    return cache_root() / f"torch{info['torch']}-py{info['python']}-{info['machine']}-{build_cache.digest(info)}"


def import_cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the warning it logs where a CUDA toolkit is
    installed but no GPU is usable ("No CUDA runtime is found"): these builds are CPU-only."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


class Extension:
    """One C++ source built into one importable module, cached, loaded once per process.

    ``source``: a file name in this folder, or any path (a benchmark builds the source of an
    earlier revision under another module name). ``purpose`` finishes the sentence of the one
    warning :meth:`module` gives where the build fails ("...; <purpose>"), saying what the caller
    does instead.
    """

    def __init__(self, name: str, source: str | Path, purpose: str):
        self.name, self.source, self.purpose = name, _HERE / source, purpose
        self._lock = threading.RLock()
        self._module: ModuleType | None = None
        self._failure: str | None = None  # why it is unavailable in this process, once known

    def source_digest(self) -> str:
        """SHA-256 of the source and of every header beside it (simd.h, ...), which the sources
        include: a header edit must rebuild the modules that include it."""
        digest = hashlib.sha256(self.source.read_bytes())
        for header in sorted(self.source.parent.glob("*.h")):
            digest.update(header.name.encode() + b"\0" + header.read_bytes())
        return digest.hexdigest()

    def build_info(self, compiler: str | None) -> dict:
        return {
            "source_sha256": self.source_digest(),
            "torch": torch.__version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "machine": platform.machine(),
            "compiler": _compiler_identity(compiler),
            "cflags": _CFLAGS,
        }

    def build_dir(self) -> Path:
        return build_dir(self.build_info(find_compiler()))

    def _cached_library(self) -> Path | None:
        """A complete cached build (its build_info.json is written last) for this source, torch,
        Python and machine, whatever the compiler that made it."""
        want = self.build_info(None)
        for folder, info in build_cache.complete_builds(cache_root()):
            library = folder / f"{self.name}.so"
            if all(info.get(key) == want[key] for key in ("source_sha256", "torch", "python", "machine", "cflags")) \
                    and library.is_file():
                return library
        return None

    def _import(self, library: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(self.name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _build(self, verbose: bool) -> ModuleType:
        compiler = find_compiler()
        if compiler is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
        build_cache.ensure_ninja_on_path()
        if shutil.which("ninja") is None:
            raise RuntimeError("ninja is not on PATH (it is a Python dependency of the project: pip install ninja)")
        cpp_extension = import_cpp_extension()
        # the one line a first use prints: the compiler runs for a while and says nothing meanwhile
        sys.stderr.write(f"compiling the C++ kernel {self.source.name} (once, ~30 s)...\n")
        sys.stderr.flush()
        info = self.build_info(compiler)
        out_dir = build_dir(info)
        out_dir.mkdir(parents=True, exist_ok=True)
        # Built in a folder of this process's own, then moved into place: processes building at once
        # do not wait on each other, and an interrupted build leaves no lock behind (torch's
        # build-folder lock file would make every later build wait for it forever).
        scratch = Path(tempfile.mkdtemp(prefix="build-", dir=out_dir))
        try:
            module = cpp_extension.load(name=self.name, sources=[str(self.source)], extra_cflags=_CFLAGS,
                                        build_directory=str(scratch), with_cuda=False, is_python_module=True,
                                        verbose=verbose)
            if module.__name__ == self.name:  # torch renames a second build in one process (name_v1): not cached
                os.replace(Path(module.__file__), out_dir / f"{self.name}.so")  # the loaded library stays mapped
                build_cache.publish(out_dir, info)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return module

    @contextlib.contextmanager
    def substituted(self, module: ModuleType):
        """Within the block, :meth:`load` and :meth:`module` return ``module`` (another build of
        this kernel, from the source before a change, say: benchmarks time the two in one run)
        instead of this process's build."""
        own = self.load()
        with self._lock:
            self._module = module
        try:
            yield module
        finally:
            with self._lock:
                self._module = own

    def load(self, verbose: bool = False) -> ModuleType:
        """The module: a cached build if there is one, else compiled now. Raises RuntimeError
        saying why it cannot be had (no compiler, a failed build)."""
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is None:
                try:
                    library = self._cached_library()
                    self._module = self._import(library) if library is not None else self._build(verbose)
                except Exception as error:  # noqa: BLE001 - any build or import failure means: unavailable
                    lines = str(error).strip().splitlines()
                    raise RuntimeError(f"the {self.source.name} CPU extension is unavailable: "
                                       f"{type(error).__name__}: {lines[-1] if lines else ''}") from error
        return self._module

    def module(self) -> ModuleType | None:
        """:meth:`load`, or None where the extension cannot be had (warned once per process, and
        not tried again in this process)."""
        if self._module is not None:
            return self._module
        if self._failure is not None:
            return None
        try:
            return self.load()
        except RuntimeError as error:
            self._failure = str(error)
            warnings.warn(f"{error}; {self.purpose}", RuntimeWarning, stacklevel=3)
            return None


FUSED_STEP = Extension("linformer_lab_fused_step", "fused_step.cpp",
                       "generation keeps to the Python step (linformer_lab.models.generation.fast_step)")
CAUSAL_RECURRENCE = Extension("linformer_lab_causal_recurrence", "causal_recurrence.cpp",
                              "causal linear attention keeps to PyTorch "
                              "(linformer_lab.ops.linear_attention: causal_attention)")

LSH_WINDOW = Extension("linformer_lab_lsh_window", "lsh_window.cpp",
                       "lsh attention keeps to its pure-PyTorch window step (linformer_lab.ops.lsh.window_attention_torch)")


def load(verbose: bool = False) -> ModuleType:
    """The fused-step module (with the ``FusedStack`` class); see :meth:`Extension.load`."""
    return FUSED_STEP.load(verbose)


def fused_module() -> ModuleType | None:
    """The fused-step module, or None (warned once); see :meth:`Extension.module`."""
    return FUSED_STEP.module()
