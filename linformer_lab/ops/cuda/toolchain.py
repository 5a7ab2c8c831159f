"""Building the ``linear_cuda`` extension: target architectures, the CUDA toolchain, its builds in
the one build cache (:mod:`linformer_lab.ops.build_cache`; a build's folder is named after the
torch/Python ABI and the architectures, its record holds the sources' hash) and loading a built library.
The user's entry points are re-exported by :mod:`linformer_lab.ops.cuda`; the other public
names here (``device_capabilities``, ``find_prebuilt``, ``can_build_for``, ``loaded_library``,
``load_library``, ``lock``, ``MIN_CAPABILITY``, ``CPU_HINT``, ``OPS_NAMESPACE``) are what its
``load`` / ``is_available`` need; everything with a leading underscore stays in this module."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from linformer_lab.ops import build_cache
from linformer_lab.ops.build_cache import ensure_ninja_on_path

OPS_NAMESPACE = "linformer_lab_cuda"
_EXTENSION_NAME = "linformer_lab_cuda_ext"
_SOURCE_DIR = Path(__file__).resolve().parent
_SOURCES = ("binding.cpp", "causal_linear_attention.cu")
MIN_CAPABILITY = (7, 0)  # WMMA-free FMA path needs Volta; tensor cores need 8.0
CPU_HINT = (
    "Use the `linear` backend, which runs on CPU and GPU without compiling anything."
)

lock = threading.RLock()  # serialises building and loading within this process
_loaded_library: Path | None = None  # the library loaded into this process, and its targets
_loaded_archs: list[Arch] = []


# ------------------------------------------------------------------------------------------------
# Architectures
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Arch:
    """One compilation target: compute capability ``major.minor`` (+ ``a`` for arch-specific
    features such as 9.0a), with ``ptx`` also embedding PTX that newer GPUs can JIT-compile."""

    major: int
    minor: int
    variant: str = ""
    ptx: bool = False

    @property
    def code(self) -> str:
        return f"{self.major}{self.minor}{self.variant}"

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.variant}" + ("+PTX" if self.ptx else "")

    def gencode_flags(self) -> list[str]:
        flags = [f"-gencode=arch=compute_{self.code},code=sm_{self.code}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.code},code=compute_{self.code}")
        return flags

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether code built for this target runs on a GPU of ``capability``: machine code runs
        on the same major version with an equal or higher minor one (arch-specific 'a' targets
        only on their exact GPU); PTX on any later GPU."""
        if self.variant:
            return (self.major, self.minor) == capability
        if self.ptx and (self.major, self.minor) <= capability:
            return True
        return self.major == capability[0] and self.minor <= capability[1]


_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d+))?([a-z]?)(\+ptx)?$", re.IGNORECASE)


def parse_arch_list(spec: str | Iterable[str]) -> list[Arch]:
    """Parses ``"8.0;9.0+PTX"``, ``"8.0 8.6"``, ``["80", "9.0a"]`` or ``"sm_90"`` into targets.

    Raises ValueError for names torch also accepts (``Ampere``...) but this kernel does not, and
    for capabilities below 7.0.
    """
    items = re.split(r"[;,\s]+", spec) if isinstance(spec, str) else list(spec)
    archs: list[Arch] = []
    for raw in (i.strip() for i in items):
        if not raw:
            continue
        m = _ARCH_RE.match(raw)
        if m is None:
            raise ValueError(f"unrecognised CUDA architecture {raw!r}: expected e.g. 8.0, 9.0, 8.6+PTX, 9.0a or 90")
        major_s, minor_s, variant, ptx = m.groups()
        if minor_s is None:  # "90" -> 9.0, "120" -> 12.0
            if len(major_s) < 2:
                raise ValueError(f"unrecognised CUDA architecture {raw!r}: expected e.g. 8.0 or 80")
            major, minor = int(major_s[:-1]), int(major_s[-1])
        else:
            major, minor = int(major_s), int(minor_s)
        if (major, minor) < MIN_CAPABILITY:
            raise ValueError(
                f"CUDA architecture {raw!r} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, "
                "the oldest this kernel supports"
            )
        arch = Arch(major, minor, variant.lower(), bool(ptx))
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError(f"no CUDA architecture in {spec!r}")
    return sorted(archs)


def device_capabilities() -> list[tuple[int, int]]:
    """The distinct compute capabilities of the visible GPUs, sorted."""
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


def default_archs() -> list[Arch]:
    """``TORCH_CUDA_ARCH_LIST`` if set, else the visible GPUs' capabilities (the highest also as
    PTX, so a newer GPU can still JIT-compile the kernel)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return parse_arch_list(env)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA GPU to detect the target architecture from: pass --arch (e.g. --arch 8.0 9.0) "
            "or set TORCH_CUDA_ARCH_LIST"
        )
    caps = device_capabilities()
    too_old = [c for c in caps if c < MIN_CAPABILITY]
    if too_old:
        raise RuntimeError(
            f"GPU compute capability {too_old[0][0]}.{too_old[0][1]} is below 7.0, which the "
            f"linear_cuda kernel needs. {CPU_HINT}"
        )
    archs = [Arch(major, minor) for major, minor in caps]
    archs[-1] = Arch(archs[-1].major, archs[-1].minor, ptx=True)
    return archs


# ------------------------------------------------------------------------------------------------
# Toolchain
# ------------------------------------------------------------------------------------------------


def find_cuda_home() -> str | None:
    """A CUDA toolkit root holding both nvcc and the runtime headers.

    torch guesses CUDA_HOME as the parent of the directory of the `nvcc` on PATH; that is wrong
    when `nvcc` is a wrapper script outside the toolkit (e.g. /usr/local/bin/nvcc exec'ing
    /usr/local/cuda-13.0/bin/nvcc), so candidates are checked for the headers too.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").is_file() and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return home
    return None


def _nvcc_gpu_codes(cuda_home: str) -> set[str] | None:
    """The sm_XX targets this nvcc can compile for (None if it cannot say)."""
    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--list-gpu-code"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    codes = set(out.stdout.split())
    return codes if out.returncode == 0 and codes else None


def can_build_for(capabilities: Sequence[tuple[int, int]]) -> bool:
    """Whether this machine can compile the extension for these GPU capabilities: a CUDA toolkit
    and ninja are present, and the toolkit's nvcc targets every one (CUDA 13 cannot compile for
    sm_70, for example). Compiles nothing."""
    ensure_ninja_on_path()
    cuda_home = find_cuda_home()
    if cuda_home is None or shutil.which("ninja") is None:
        return False
    supported = _nvcc_gpu_codes(cuda_home)
    return supported is None or all(f"sm_{major}{minor}" in supported for major, minor in capabilities)


# ------------------------------------------------------------------------------------------------
# Build cache
# ------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """The CUDA extension's folder of the build cache (:func:`linformer_lab.ops.build_cache.cache_root`)."""
    return build_cache.cache_root("cuda")


def _sources_digest() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((_SOURCE_DIR / name).read_bytes())
    return h.hexdigest()


def _abi_tag() -> str:
    # A build only loads into the torch / Python it was compiled against.
    return f"torch{torch.__version__}-cuda{torch.version.cuda}-py{sys.version_info.major}{sys.version_info.minor}"


def _build_dir(root: Path, archs: Sequence[Arch]) -> Path:
    arch_tag = "_".join(f"sm{a.code}" + ("ptx" if a.ptx else "") for a in archs)
    return root / _abi_tag() / arch_tag


def _compile_flags(archs: Sequence[Arch]) -> tuple[list[str], list[str]]:
    # The C++ standard comes from torch's own flags (the sources need C++17).
    cflags = ["-O3"]
    cuda_flags = ["-O3", "-lineinfo"]
    for arch in archs:
        cuda_flags += arch.gencode_flags()
    return cflags, cuda_flags


def _build_info(archs: Sequence[Arch]) -> dict:
    cflags, cuda_flags = _compile_flags(archs)
    return {
        "sources_sha256": _sources_digest(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "archs": [str(a) for a in archs],
        "cflags": cflags,
        "cuda_cflags": cuda_flags,
    }


def _library_path(build_dir: Path) -> Path:
    return build_dir / f"{_EXTENSION_NAME}.so"


def find_prebuilt(capabilities: Sequence[tuple[int, int]], root: Path | None = None) -> tuple[Path, list[Arch]] | None:
    """A cached library built from these sources for this torch / Python whose architectures
    cover every given GPU capability, with those architectures."""
    digest = _sources_digest()
    for folder, info in build_cache.complete_builds((root or cache_root()) / _abi_tag()):
        try:
            archs = parse_arch_list(info["archs"])
        except (ValueError, KeyError, TypeError):
            continue
        library = _library_path(folder)
        if (
            info.get("sources_sha256") == digest
            and info.get("torch") == torch.__version__
            and library.is_file()
            and all(any(a.runs_on(c) for a in archs) for c in capabilities)
        ):
            return library, archs
    return None


def loaded_library() -> tuple[Path, list[Arch]] | None:
    """The library this process has loaded (by :func:`build` or :func:`load_library`) and the
    architectures it was built for; None before any."""
    return None if _loaded_library is None else (_loaded_library, list(_loaded_archs))


def load_library(path: Path, archs: list[Arch]) -> None:
    """Load a built library into this process; a second, different library is an error (one
    process registers the operator namespace once)."""
    global _loaded_library, _loaded_archs
    if _loaded_library is not None and _loaded_library != path:
        # One process can register the operator namespace only once.
        raise RuntimeError(
            f"the linear_cuda extension is already loaded from {_loaded_library}; cannot also load "
            f"{path} in the same process (build other architectures in a fresh process: "
            "python -m linformer_lab.ops.cuda build ...)"
        )
    torch.ops.load_library(str(path))  # a no-op for a library this process already loaded
    _loaded_library, _loaded_archs = path, list(archs)


def build(
    archs: str | Iterable[str] | Sequence[Arch] | None = None,
    build_dir: str | os.PathLike | None = None,
    verbose: bool = False,
    ptxas_verbose: bool = False,
) -> Path:
    """Compiles the extension for ``archs`` (default: :func:`default_archs`) and loads it into
    this process; returns the library path. Needs nvcc and ninja, not a GPU.

    build_dir: cache root (default :func:`cache_root`); the library lands in a subfolder named
    after torch / Python and the architectures. ptxas_verbose prints per-kernel register, shared
    memory and spill counts (with verbose).
    """
    if archs is None:
        targets = default_archs()
    elif isinstance(archs, str) or not all(isinstance(a, Arch) for a in archs):
        targets = parse_arch_list(archs)  # type: ignore[arg-type]
    else:
        targets = sorted(archs)  # type: ignore[arg-type]

    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise RuntimeError(
            "cannot build the linear_cuda extension: no CUDA toolkit found (need bin/nvcc and "
            "include/cuda_runtime.h under $CUDA_HOME, the nvcc on PATH, or /usr/local/cuda). Install "
            "the CUDA toolkit matching torch.version.cuda="
            f"{torch.version.cuda}, or pre-build on a machine that has one with "
            f"`python -m linformer_lab.ops.cuda build --arch ...`. {CPU_HINT}"
        )
    supported = _nvcc_gpu_codes(cuda_home)
    if supported is not None:
        missing = [str(a) for a in targets if f"sm_{a.major}{a.minor}" not in supported]
        if missing:
            raise RuntimeError(
                f"the nvcc in {cuda_home} cannot compile for {', '.join(missing)} (it supports "
                f"{', '.join(sorted(supported))}); CUDA 13 dropped sm_70/sm_72, use a CUDA 12.x "
                "toolkit (and a matching torch) for Volta GPUs"
            )

    from torch.utils import cpp_extension

    # torch resolves nvcc and the include/library folders through this module-level value, which
    # it guessed at import time; point it at the toolkit found above.
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    ensure_ninja_on_path()

    root = Path(build_dir).expanduser() if build_dir is not None else cache_root()
    out_dir = _build_dir(root, targets)
    library = _library_path(out_dir)
    info = _build_info(targets)
    cuda_flags = list(info["cuda_cflags"]) + (["-Xptxas=-v"] if ptxas_verbose else [])
    with lock:
        if _loaded_library is not None and _loaded_library != library:
            load_library(library, targets)  # raises the one-library-per-process error
        out_dir.mkdir(parents=True, exist_ok=True)
        # Compiles (ninja skips up-to-date objects; torch's file lock serialises processes that
        # share out_dir) and loads the library into this process.
        cpp_extension.load(
            name=_EXTENSION_NAME,
            sources=[str(_SOURCE_DIR / s) for s in _SOURCES],
            extra_cflags=info["cflags"],
            extra_cuda_cflags=cuda_flags,
            build_directory=str(out_dir),
            verbose=verbose,
            with_cuda=True,
            is_python_module=False,
        )
        load_library(library, targets)
        build_cache.publish(out_dir, info)  # last: marks a complete build for find_prebuilt
    return library
