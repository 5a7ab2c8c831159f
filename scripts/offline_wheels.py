"""Wheels for a GPU node without internet that already has CUDA PyTorch.

Run on a machine with network, from the repository root:

    python scripts/offline_wheels.py DEST [--python 3.12] [--platform manylinux_2_28_x86_64]
                                          [--skip NAME ...] [--skip-installed FREEZE.txt] [--with-fla]

It walks the locked dependency graph of linformer_lab (uv.lock: runtime dependencies only, the
dev group left out) for the target interpreter and platform, leaves out what a CUDA PyTorch
image brings (torch, torchvision, torchaudio, triton, nvidia-*, cuda-*, and whatever only they
need) and what you name with ``--skip`` or list in a ``pip freeze`` of the target
(``--skip-installed``), and downloads one wheel of each remaining package at its locked version
into DEST. ``--with-fla`` adds flash-linear-attention (the kernel comparison of
benchmarks/paper/gpu_check.py). ``--print-only`` lists the selection without downloading.

On the GPU node: ``pip install --no-index --no-deps DEST/*.whl`` (or ``--target DIR`` and
``PYTHONPATH=DIR``), then run from the repository with ``PYTHONPATH=.`` (README, "GPU node
without internet").
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "linformer-lab"
#: What a CUDA PyTorch image provides; the walk does not enter these packages.
PROVIDED_BY_TORCH = ("torch", "torchvision", "torchaudio", "triton")
PROVIDED_PREFIXES = ("nvidia-", "cuda-")
#: Pure-Python or manylinux wheels are enough for every package the walk selects.
DEFAULT_PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
FLA_PACKAGES = ("flash-linear-attention", "fla-core")
SIZE_WARNING_MB = 60


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_environment(python: str, platform: str) -> dict[str, str]:
    """PEP 508 marker variables of the target interpreter (CPython on Linux x86-64)."""
    machine = "aarch64" if "aarch64" in platform else "x86_64"
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python if python.count(".") == 2 else python + ".0",
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine, "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
    }


def marker_holds(marker: str | None, env: dict[str, str]) -> bool:
    if not marker:
        return True
    try:
        from packaging.markers import Marker
    except ModuleNotFoundError:  # a bare interpreter: pip carries its own copy
        from pip._vendor.packaging.markers import Marker

    return Marker(marker).evaluate(env)


def load_lock(path: Path) -> dict[str, list[dict]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise SystemExit("offline_wheels.py reads uv.lock with tomllib: run it with Python >= 3.11") from None
    with open(path, "rb") as f:
        lock = tomllib.load(f)
    packages: dict[str, list[dict]] = {}
    for package in lock["package"]:
        packages.setdefault(normalize(package["name"]), []).append(package)
    return packages


def _entry(packages: dict[str, list[dict]], name: str, version: str | None, env: dict[str, str]) -> dict:
    entries = packages[normalize(name)]
    if version is not None:
        return next(e for e in entries if e["version"] == version)
    if len(entries) == 1:
        return entries[0]
    for entry in entries:  # several locked versions: the one resolved for the target
        if any(marker_holds(m, env) for m in entry.get("resolution-markers", [])):
            return entry
    return entries[-1]


def provided(name: str) -> bool:
    name = normalize(name)
    return name in PROVIDED_BY_TORCH or name.startswith(PROVIDED_PREFIXES)


def select(packages: dict[str, list[dict]], env: dict[str, str], skip: set[str] = frozenset()) -> list[tuple[str, str]]:
    """``(name, version)`` of every runtime dependency of the project that the target needs,
    sorted by name: the locked graph walked from the project's dependencies (with extras, under
    the target's markers), never entering what PyTorch provides or what ``skip`` names."""
    project = _entry(packages, PROJECT, None, env)
    selected: dict[str, str] = {}
    todo = [(dep, None) for dep in project.get("dependencies", [])]
    while todo:
        dep, _ = todo.pop()
        name = normalize(dep["name"])
        if provided(name) or name in skip or not marker_holds(dep.get("marker"), env):
            continue
        entry = _entry(packages, name, dep.get("version"), env)
        if name in selected and not dep.get("extra"):
            continue
        selected[name] = entry["version"]
        deps = list(entry.get("dependencies", []))
        for extra in dep.get("extra", []):
            deps += entry.get("optional-dependencies", {}).get(extra, [])
        todo += [(d, None) for d in deps]
    return sorted(selected.items())


def read_freeze(path: Path) -> set[str]:
    """Names in a ``pip freeze`` / ``pip list --format=freeze`` output."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(normalize(re.split(r"[=<>~! @]", line, maxsplit=1)[0]))
    return names


def pip_command() -> list[str]:
    """This interpreter's pip, else the first pip on PATH (a uv venv has none of its own)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        if shutil.which(name):
            return [shutil.which(name)]
    raise SystemExit("no pip found: run this script with a Python that has pip (python3 -m ensurepip)")


def download(requirement: str, dest: Path, python: str, platforms: list[str]) -> subprocess.CompletedProcess:
    command = [*pip_command(), "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
               "--implementation", "cp", "-d", str(dest), requirement]
    for platform in platforms:
        command += ["--platform", platform]
    return subprocess.run(command, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="folder for the wheels")
    parser.add_argument("--python", default="3.12", help="the GPU node's Python version (default 3.12)")
    parser.add_argument("--platform", action="append", help="pip platform tag (repeatable); default: manylinux x86_64 tags")
    parser.add_argument("--skip", action="append", default=[], metavar="NAME", help="a package the node already has (repeatable)")
    parser.add_argument("--skip-installed", type=Path, metavar="FREEZE",
                        help="`pip freeze` output of the node: skip all it lists")
    parser.add_argument("--with-fla", action="store_true", help="add flash-linear-attention for the kernel comparison")
    parser.add_argument("--lock", type=Path, default=REPO / "uv.lock", help="the lock file (default: the repository's uv.lock)")
    parser.add_argument("--print-only", action="store_true", help="list the selection, download nothing")
    args = parser.parse_args(argv)

    packages = load_lock(args.lock)
    unknown = sorted(n for n in args.skip if normalize(n) not in packages)
    if unknown:
        parser.error(f"--skip names packages that are not in {args.lock.name}: {', '.join(unknown)} "
                     f"(valid: any locked package, e.g. {', '.join(sorted(packages)[:5])}, ...)")
    skip = {normalize(n) for n in args.skip} | (read_freeze(args.skip_installed) if args.skip_installed else set())
    env = target_environment(args.python, (args.platform or DEFAULT_PLATFORMS)[0])
    selection = [f"{name}=={version}" for name, version in select(packages, env, skip)]
    if args.with_fla:
        selection += list(FLA_PACKAGES)  # not locked: the newest wheels
    for requirement in selection:
        print(requirement)
    if args.print_only:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    failed = []
    for requirement in selection:
        done = download(requirement, args.dest, args.python, args.platform or list(DEFAULT_PLATFORMS))
        if done.returncode != 0:
            optional = requirement in FLA_PACKAGES
            failed.append(requirement) if not optional else None
            print(f"{'note' if optional else 'FAILED'}: {requirement}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    wheels = sorted(args.dest.glob("*.whl"))
    size_mb = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size_mb:.1f} MB in {args.dest}")
    if size_mb > SIZE_WARNING_MB:
        print(f"warning: more than {SIZE_WARNING_MB} MB; --skip what the node already has", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
