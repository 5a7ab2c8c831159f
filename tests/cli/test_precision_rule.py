"""A precision that does not fit the CPU (issue 54, item 3): a bf16 config on a CPU without bf16
units (AVX512-BF16, AMX) trains in fp32 and says so in one line, on one with them in bf16, and
``16-true`` on a CPU is refused in one line (it trained NaNs silently). ``LINFORMER_LAB_CPU_BF16``
stands for the CPU's units, so each test means the same on any machine; the detection itself is
tested on ``/proc/cpuinfo`` texts and against this machine's."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import yaml
from conftest import run_cli, tiny_copy_args

from linformer_lab.cli.checks import resolve_precision
from linformer_lab.ops.cpu.isa import BF16_UNITS_VARIABLE as CPU_BF16_VARIABLE
from linformer_lab.ops.cpu.isa import bf16_units, cpuinfo_flags, matrix_units, units_of


class RecordPrecision(L.Callback):
    """Writes the precision the trainer trains in (and its plugin's class) to the JSON file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        Path(self.path).write_text(json.dumps([str(trainer.precision), type(trainer.precision_plugin).__name__]))


def fit_recording(root: Path, precision: str) -> tuple[int, str, list[str]]:
    record = root / "precision.json"
    callback = json.dumps({"class_path": f"{__name__}.RecordPrecision", "init_args": {"path": str(record)}})
    code, _, err = run_cli(["fit", *tiny_copy_args(root), "--trainer.max_steps=2", f"--trainer.precision={precision}",
                            f"--trainer.callbacks+={callback}"])
    return code, err, json.loads(record.read_text()) if record.exists() else []


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_a_bf16_config_on_a_cpu_without_bf16_units_trains_in_fp32_and_says_so(tmp_path, monkeypatch, precision):
    monkeypatch.setenv(CPU_BF16_VARIABLE, "none")
    code, err, ran = fit_recording(tmp_path, precision)
    assert code == 0, err
    said = [line for line in err.splitlines() if line.startswith(f"precision {precision}:")]
    assert said == [f"precision {precision}: this CPU has no bf16 units (AVX512-BF16 or AMX), where bf16 is slower "
                    f"than fp32: training in fp32 (32-true; docs/cli.md, Precision)"], err
    assert ran == ["32-true", "Precision"]  # Lightning's fp32 plugin: no autocast, fp32 weights
    saved = yaml.safe_load((tmp_path / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["precision"] == "32-true"  # the saved config records what ran


def test_a_bf16_config_on_a_cpu_with_bf16_units_trains_in_bf16(tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_BF16_VARIABLE, "avx512_bf16")
    code, err, ran = fit_recording(tmp_path, "bf16-mixed")
    assert code == 0, err
    assert ran == ["bf16-mixed", "MixedPrecision"] and "no bf16 units" not in err


def test_16_true_on_a_cpu_is_refused_in_one_line(tmp_path):
    code, out, err = run_cli(["fit", *tiny_copy_args(tmp_path), "--trainer.max_steps=2", "--trainer.precision=16-true"])
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --trainer.precision 16-true: fp16 weights on a CPU train to NaN within a few updates "
                      "(no loss scaling); use 32-true, or bf16-mixed on a CPU with bf16 units"], err
    assert not (tmp_path / "version_0").exists()  # refused before the run's folder is made


def test_the_rule_maps_each_precision(monkeypatch):
    monkeypatch.setenv(CPU_BF16_VARIABLE, "none")
    assert [resolve_precision(p, "cpu") for p in ("bf16", "bf16-mixed", "bf16-true", "16-mixed", 16, "32-true", None)] \
        == ["32-true"] * 5 + ["32-true", None]
    monkeypatch.setenv(CPU_BF16_VARIABLE, "amx")
    assert [resolve_precision(p, "cpu") for p in ("bf16-mixed", "bf16-true", "16-mixed", 16)] \
        == ["bf16-mixed", "bf16-true", "bf16-mixed", "bf16-mixed"]


def test_a_bad_override_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv(CPU_BF16_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"^{CPU_BF16_VARIABLE}='yes': expected one of amx, avx512_bf16, none$"):
        bf16_units()
    with pytest.raises(SystemExit):  # the command line's precision rule reads it: one line, exit code 2
        resolve_precision("bf16-mixed", "cpu")
    assert capsys.readouterr().err == f"error: {CPU_BF16_VARIABLE}='yes': expected one of amx, avx512_bf16, none\n"


XEON_WITHOUT_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\nbugs\t\t: spectre_v1\n"
EPYC_ZEN5 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\nprocessor\t: 1\n"


def test_the_detection_reads_cpuinfo_flags():
    assert [units_of(cpuinfo_flags(text)) for text in (XEON_WITHOUT_BF16, EPYC_ZEN5, SAPPHIRE_RAPIDS, "")] \
        == [None, "avx512_bf16", "amx", None]
    assert "avx512_bf16" not in cpuinfo_flags("flags : avx512_bf16_extra\n")  # whole names only


def test_the_detection_agrees_with_this_machines_cpuinfo(monkeypatch):
    """torch's probe (what matrix_units reads first) and /proc/cpuinfo say the same here."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    if not cpuinfo_flags(text):
        pytest.skip("no x86 flags line in /proc/cpuinfo")
    monkeypatch.delenv(CPU_BF16_VARIABLE)
    assert bf16_units() == matrix_units() == units_of(cpuinfo_flags(text))
