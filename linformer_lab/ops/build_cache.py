"""The one build cache of the compiled extensions: the C++ CPU ones (:mod:`linformer_lab.ops.cpu`)
and the CUDA one (:mod:`linformer_lab.ops.cuda`).

Everything lives under :func:`cache_root`, one subfolder per kind; inside, each build has a folder
named after what it was built from (:func:`digest`), complete once :func:`publish` has written its
``build_info.json``: any later process (on any machine with the same torch and Python) loads it
without compiling. What makes up a build's key (sources, flags, architectures) is each kind's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["VARIABLE", "cache_root", "complete_builds", "digest", "ensure_ninja_on_path", "publish"]

#: The environment variable that moves the cache.
VARIABLE = "LINFORMER_LAB_BUILD_DIR"
_INFO = "build_info.json"


def cache_root(kind: str) -> Path:
    """``$LINFORMER_LAB_BUILD_DIR/<kind>`` or ``~/.cache/linformer_lab/<kind>`` (kind: ``cpu``, ``cuda``)."""
    env = os.environ.get(VARIABLE)
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "linformer_lab") / kind


def digest(info: dict) -> str:
    """A short hash of a build's key (its ``build_info``), for its folder name."""
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]


def complete_builds(folder: Path) -> Iterator[tuple[Path, dict]]:
    """``(build folder, its build_info)`` for every complete build directly under ``folder``, in
    name order; unreadable records are skipped."""
    if not folder.is_dir():
        return
    for info_path in sorted(folder.glob(f"*/{_INFO}")):
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict):
            yield info_path.parent, info


def publish(folder: Path, info: dict) -> None:
    """Mark ``folder`` as a complete build of ``info``: its ``build_info.json``, written last and
    atomically (a process that dies while building leaves no record of a build)."""
    tmp = folder / f"{_INFO}.{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, folder / _INFO)


def ensure_ninja_on_path() -> None:
    """Put the interpreter's folder on PATH: ninja is a Python dependency of the project, and its
    binary sits next to the interpreter, which is not on PATH when called by its full path."""
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
