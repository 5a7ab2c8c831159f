"""Errors that list the backends able to do something take the list from the registry: a plugin
that can appears in it, one that fails to import is left out, and the built-ins are those whose
class says so."""

from __future__ import annotations

import pytest
from conftest import built_in_attention

from linformer_lab.attention.base import Attention, backends_with
from linformer_lab.models.ctc import TransformerCTC
from linformer_lab.registry import ATTENTION, PluginError
from linformer_lab.tasks.base import check_segment_length


class PackedPlugin(Attention):
    """A third-party backend that takes packed sequences and has a recurrent form."""

    supports_packed = True
    has_recurrent_form = True


@pytest.fixture
def built_ins_only(monkeypatch):
    """The registry as this project alone registers it: plugins installed beside it (the README's
    examples) left out, so the lists below are the built-ins' whatever else is installed."""
    ours = built_in_attention()
    monkeypatch.setattr(ATTENTION, "names", lambda: ours)


@pytest.fixture
def with_plugins(built_ins_only, monkeypatch):
    """Registers ``packed_plugin`` and a ``broken_plugin`` that fails to import."""
    names, get = ATTENTION.names, ATTENTION.get

    def fake_get(name):
        if name == "packed_plugin":
            return PackedPlugin
        if name == "broken_plugin":
            raise PluginError("attention backend 'broken_plugin' failed to import")
        return get(name)

    monkeypatch.setattr(ATTENTION, "names", lambda: sorted(names() + ["packed_plugin", "broken_plugin"]))
    monkeypatch.setattr(ATTENTION, "get", fake_get)


def test_the_built_ins_are_listed_by_what_their_classes_declare(built_ins_only):
    assert backends_with("supports_packed") == "'linear', 'linear_cuda', 'softmax'"
    assert backends_with("has_recurrent_form") == "'linear', 'linear_cuda', 'softmax'"
    assert backends_with("uses_feature_map") == "'linear', 'linear_cuda'"
    assert "'lsh'" in backends_with("supports_state")


def test_a_plugin_appears_in_the_errors_and_a_broken_one_does_not(with_plugins):
    assert backends_with("supports_packed") == "'linear', 'linear_cuda', 'packed_plugin', 'softmax'"
    with pytest.raises(ValueError, match=r"packed sequences \('linear', 'linear_cuda', 'packed_plugin', 'softmax'\)"):
        TransformerCTC(num_phonemes=5, feature_dim=4, d_model=8, n_layers=1, n_heads=2, attention="lsh", packed=True)
    lsh = TransformerCTC(num_phonemes=5, feature_dim=4, d_model=8, n_layers=1, n_heads=2, attention="lsh").transformer
    with pytest.raises(ValueError, match=r"'packed_plugin', 'softmax'\); 'lsh' has no recurrent form") as caught:
        check_segment_length(4, lsh, "lsh")
    assert "broken_plugin" not in str(caught.value)
