"""The states' one home (issue 46, item 4): every state type and the contract are defined in
``linformer_lab.ops.state``, the places users imported them from still hand out the same objects,
and a state saved while the classes lived elsewhere loads.

A pickle names a class by its module path. Before the move, ``LinearState`` was written as
``linformer_lab.ops.linear_attention.recurrent.LinearState`` and ``KVCache`` / ``SequenceBuffer``
as ``linformer_lab.attention.kv_cache.*``: the tests below write states today and rename the
classes in the pickle to those paths, which gives the bytes the earlier code wrote (the same
opcodes, only the module names differ), and load them with ``pickle`` and with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import ast
import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

import linformer_lab as ll
import linformer_lab.attention
import linformer_lab.attention.base
import linformer_lab.ops.linear_attention
from linformer_lab.ops import state as home
from linformer_lab.ops.state import KVCache, LinearState, SequenceBuffer, StackState

PACKAGE = Path(ll.__file__).parent
#: class -> the module path that pickles written before the move name.
EARLIER_PATHS = {
    LinearState: "linformer_lab.ops.linear_attention.recurrent",
    KVCache: "linformer_lab.attention.kv_cache",
    SequenceBuffer: "linformer_lab.attention.kv_cache",
}


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
    (linformer_lab.attention.base, ["AttentionState", "KVCache", "SequenceBuffer", "check_state"]),
    (linformer_lab.ops.linear_attention, ["LinearState"]),
], ids=lambda x: getattr(x, "__name__", "names"))
def test_the_names_users_imported_are_the_homes_objects(module, names):
    for name in names:
        assert getattr(module, name) is getattr(home, name), f"{module.__name__}.{name}"


def _states() -> dict:
    """One of each built-in state, with numbers a test can recompute (a KVCache with padding)."""
    x = torch.arange(24, dtype=torch.float32)
    linear = LinearState(x[:12].reshape(1, 1, 3, 4))
    kv = KVCache.from_sequence(x[:8].reshape(1, 1, 2, 4), x[8:16].reshape(1, 1, 2, 4), torch.tensor([[True, False]]))
    return {"linear": linear, "kv": kv, "buffer": SequenceBuffer.from_tensor(x[:6].reshape(1, 3, 2), dim=1),
            "stack": StackState([linear, kv])}


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, KVCache):
        return [state.keys, state.values, state.valid]
    if isinstance(state, SequenceBuffer):
        return [state.filled]
    if isinstance(state, LinearState):
        return [state.joint, *state]
    return [t for s in state for t in _tensors(s)]


def _at_earlier_paths(pickled: bytes) -> bytes:
    """``pickled`` (protocol 2: each class as ``module\\nname``) with the moved classes named by
    their earlier modules."""
    for cls, earlier in EARLIER_PATHS.items():
        now = f"{cls.__module__}\n{cls.__name__}\n".encode()
        assert now in pickled, f"{cls.__name__} is not pickled as {cls.__module__}"
        pickled = pickled.replace(now, f"{earlier}\n{cls.__name__}\n".encode())
    return pickled


def _saved_at_earlier_paths(obj) -> bytes:
    """``torch.save(obj)`` with the archive's pickle renamed by :func:`_at_earlier_paths`."""
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(buffer) as saved, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as renamed:
        for info in saved.infolist():
            data = saved.read(info)
            renamed.writestr(info, _at_earlier_paths(data) if info.filename.endswith("/data.pkl") else data)
    return out.getvalue()


LOADS = {
    "pickle": lambda obj: pickle.loads(_at_earlier_paths(pickle.dumps(obj, protocol=2))),
    "torch.load(weights_only)": lambda obj: torch.load(io.BytesIO(_saved_at_earlier_paths(obj)), weights_only=True),
}


@pytest.mark.parametrize("load", LOADS.values(), ids=LOADS.keys())
def test_a_state_saved_under_its_earlier_module_path_loads(load):
    saved, loaded = _states(), load(_states())
    for key, state in saved.items():
        assert type(loaded[key]) is type(state), key
        expected, got = _tensors(state), _tensors(loaded[key])
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), key
    # and they are states to continue from: the loaded cache grows as the original does
    k_t, v_t = torch.ones(1, 1, 4), torch.zeros(1, 1, 4)
    assert torch.equal(loaded["kv"].appended(k_t, v_t).keys, saved["kv"].appended(k_t, v_t).keys)
