"""Lines that every run printed and that say nothing about it (issue 43, item 9): Lightning's
model-summary warning under mixed precision and its cloud-logger advertisement, torch's "No CUDA
runtime is found" when a C++ kernel is first built (and the silence of that build), and a
traceback when the reader of ``cli.py plugins --json`` stops early. Each test shows the line
where the filter is off, then its absence."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary

from linformer_lab import compat
from linformer_lab.ops import cpu

REPO = Path(__file__).resolve().parents[2]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _trainer_info_lines() -> list[str]:
    """The info lines Lightning logs while a Trainer is made (on the loggers rank_zero_info uses)."""
    records = _Records()
    loggers = [logging.getLogger(name) for name in compat.UPSTREAM_INFO_LOGGERS]
    for logger in loggers:
        logger.addHandler(records)
    try:
        L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    return records.messages


def test_the_cloud_logger_advertisement_is_dropped(monkeypatch):
    for name in compat.UPSTREAM_INFO_LOGGERS:  # as in a fresh process: no filter yet
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    assert any("litlogger" in line for line in _trainer_info_lines())
    compat.ignore_upstream_warnings()
    assert not [line for line in _trainer_info_lines() if "litlogger" in line]


def test_the_mixed_precision_summary_warning_is_dropped():
    model = L.LightningModule()
    model.layer = torch.nn.Linear(2, 2)
    model.trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False, enable_progress_bar=False)

    def summary_warnings(ignore: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ignore:
                compat.ignore_upstream_warnings()
            ModelSummary(model)
        return [str(w.message) for w in caught if "model summary" in str(w.message)]

    assert summary_warnings(ignore=False)
    assert not summary_warnings(ignore=True)


def test_a_first_build_says_it_is_compiling(tmp_path, monkeypatch, capsys):
    if cpu.find_compiler() is None:
        pytest.skip("no C++ compiler: nothing is built")
    monkeypatch.setenv("LINFORMER_LAB_BUILD_DIR", str(tmp_path))
    built = []

    def fake_load(name, **kwargs):  # the compiler itself is not what this test is about
        built.append(name)
        return types.ModuleType(f"{name}_v1")  # a renamed build: not moved into the cache

    monkeypatch.setattr(cpu.import_cpp_extension(), "load", fake_load)
    cpu.Extension("quiet_probe", cpu.LSH_WINDOW.source, "a test").load()
    assert built == ["quiet_probe"]
    err = capsys.readouterr().err
    assert err.splitlines() == [f"compiling the C++ kernel {cpu.LSH_WINDOW.source.name} (once, ~30 s)..."]


@pytest.mark.slow
def test_a_cpu_build_does_not_warn_that_cuda_is_missing(tmp_path):
    """Where a CUDA toolkit is found but no GPU is usable, importing cpp_extension warns; a CPU
    build imports it without that warning. One fresh process: the CPU build's import, then the
    module's code run again (a reload) without the filter."""
    env = dict(os.environ, CUDA_HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    code = ("import importlib, sys; from linformer_lab.ops import cpu; cpu.import_cpp_extension(); "
            "print('filter off:', file=sys.stderr, flush=True); importlib.reload(sys.modules['torch.utils.cpp_extension'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours, bare = done.stderr.split("filter off:\n")
    assert "No CUDA runtime is found" in bare
    assert "No CUDA runtime" not in ours


@pytest.mark.slow
def test_plugins_json_into_a_closed_pipe_ends_without_a_traceback():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line (cli.py plugins --json | head, sooner)
    done = subprocess.Popen([sys.executable, "cli.py", "plugins", "--json"], cwd=REPO, stdout=write,
                            stderr=subprocess.PIPE, text=True)
    os.close(write)
    _, err = done.communicate(timeout=120)
    assert done.returncode == 1 and err == "", err
