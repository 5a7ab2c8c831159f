"""The feature maps in the benchmarks: the Fig. 1 scaling script and the CPU grid list every
registered map and time causal linear attention with each."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import built_in_feature_maps

import linformer_lab as ll

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(room: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / room / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaling_runs_linear_attention_with_every_registered_feature_map():
    scaling = _script("paper", "scaling")
    assert set(scaling.FEATURE_MAPS) == set(built_in_feature_maps()) - {"elu"}
    assert scaling._spec("linear/t2r") == ("linear", {"feature_map": "t2r"})
    assert scaling._spec("linear") == ("linear", {}) and scaling._spec("lsh-4")[1]["n_hashes"] == 4
    for feature_map in ("t2r", "taylor"):
        step = scaling._case(f"linear/{feature_map}", 1, 16, "cpu", causal=True)
        step()  # one fwd+bwd; the closure keeps its attention's map
        attention = next(c.cell_contents for c in step.__closure__ if isinstance(c.cell_contents, torch.nn.Module))
        assert type(attention.feature_map) is type(ll.build_feature_map(feature_map, query_dim=scaling.D))


def test_cpu_grid_times_every_registered_feature_map_within_the_element_cap():
    grid = _script("dev", "causal_cpu_grid")
    assert set(grid.FEATURE_MAPS) == set(built_in_feature_maps()) and grid.FEATURE_MAPS[0] == "elu"
    cases = grid.feature_map_cases(torch, (1, 2, 16, 8), grid.FEATURE_MAPS, max_elements=1 << 20)
    assert list(cases) == [f"map_{m}" for m in grid.FEATURE_MAPS]
    for call in cases.values():
        call()
    # taylor's 1 + 8 + 36 features and rebased's 36 exceed 32 numbers per position; elu's 8 do not
    capped = grid.feature_map_cases(torch, (1, 2, 16, 8), ["elu", "taylor", "rebased"], max_elements=2 * 16 * 32)
    assert list(capped) == ["map_elu"]
    assert grid._map_list("t2r,elu") == ["elu", "t2r"] and grid._map_list("none") == []


@pytest.mark.slow
def test_cpu_grid_reports_the_feature_map_table(tmp_path):
    """The script's main, in-process, on one small shape: the table of the maps and their ratios to elu."""
    grid = _script("dev", "causal_cpu_grid")
    grid.main(["--quick", "--shapes", "1x2x64x8", "--feature-maps", "t2r,taylor", "--out", str(tmp_path), "--tag", "_m"])
    report = (tmp_path / "causal_linear_cpu_grid_quick_m.md").read_text()
    assert "### Causal linear attention with each feature map" in report
    assert "| B | H | N | D | elu | t2r | taylor |" in report
    row = next(csv.DictReader((tmp_path / "causal_linear_cpu_grid_quick_m.csv").open()))
    assert float(row["map_taylor_ms"]) > 0 and float(row["map_t2r_over_elu"]) > 0
