"""The states' one home (issue 46, item 4): every state type and the contract are defined in
``linformer_lab.ops.state``, and the public places that re-export them hand out the same objects.
Saving and loading states is ``tests/ops/test_state_saving.py``'s."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import linformer_lab as ll
import linformer_lab.attention
import linformer_lab.ops.linear_attention
from linformer_lab.ops import state as home

PACKAGE = Path(ll.__file__).parent


def test_every_state_type_and_the_contract_are_defined_in_ops_state():
    for name in home.__all__:
        assert getattr(home, name).__module__ == "linformer_lab.ops.state", name
    defined_elsewhere = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("*.py")) if path != Path(home.__file__)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in home.__all__
    ]
    assert not defined_elsewhere, f"state types or contract functions defined outside ops/state.py: {defined_elsewhere}"


@pytest.mark.parametrize("module, names", [
    (ll, ["clone_state", "detach_state"]),
    (linformer_lab.attention, ["AttentionState", "KVCache"]),
    (linformer_lab.ops.linear_attention, ["LinearState"]),
], ids=lambda x: getattr(x, "__name__", "names"))
def test_the_public_re_exports_are_the_homes_objects(module, names):
    for name in names:
        assert getattr(module, name) is getattr(home, name), f"{module.__name__}.{name}"
