"""Building blocks for users' own models (issue 39, item 3): ``Transformer``, ``TransformerLayer``,
``MultiHeadAttention`` and ``AttentionConfig`` at the package root, taking the attention the way the
tasks do (a name, a dict, a config; for one layer a built backend), and a small causal language
model composed from them that prefills a prompt in one pass and generates by steps, equal to
re-running the whole sequence.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import linformer_lab as ll
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.feature_maps.elu import EluFeatureMap
from linformer_lab.feature_maps.favor import FavorFeatureMap
from linformer_lab.models.transformer import Transformer, TransformerLayer

REPO = Path(__file__).resolve().parents[2]


def test_the_blocks_are_exported_at_the_root():
    assert ll.Transformer is Transformer and ll.TransformerLayer is TransformerLayer
    assert ll.MultiHeadAttention is MultiHeadAttention
    assert {"Transformer", "TransformerLayer", "MultiHeadAttention", "AttentionConfig"} <= set(ll.__all__)


def test_a_transformer_from_a_backend_name():
    stack = ll.Transformer(6, 128, 4, attention="linear")
    backends = [layer.attention.attention for layer in stack.layers]
    assert len(backends) == 6 and len({id(b) for b in backends}) == 6  # one module per layer
    assert all(type(b).__name__ == "LinearAttention" and b.causal for b in backends)
    assert all(isinstance(b.feature_map, EluFeatureMap) and b.feature_map.query_dim == 32 for b in backends)
    assert stack.attention_config == ll.AttentionConfig("linear")
    assert stack(torch.randn(2, 7, 128)).shape == (2, 7, 128)


def test_multihead_attention_from_a_dict_and_a_layer_from_a_config():
    mha = ll.MultiHeadAttention(128, 4, attention={"backend": "linear", "feature_map": "favor"})
    assert isinstance(mha.attention.feature_map, FavorFeatureMap) and not mha.attention.causal
    assert mha(torch.randn(2, 5, 128)).shape == (2, 5, 128)
    layer = ll.TransformerLayer(64, 4, 128, attention=ll.AttentionConfig("softmax"), causal=False)
    assert type(layer.attention.attention).__name__ == "SoftmaxAttention" and not layer.attention.attention.causal
    built = ll.build_attention("lsh", causal=True, query_dim=16, bucket_size=4, n_buckets=4)
    assert ll.TransformerLayer(64, 4, 128, attention=built).attention.attention is built


def test_bad_attention_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown attention field\(s\) \['backnd'\]; valid fields: backend, feature_map"):
        ll.Transformer(1, 16, 2, attention={"backnd": "linear"})
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4"):
        ll.Transformer(1, 10, 4, attention="softmax")
    with pytest.raises(ValueError, match="attention must be an AttentionConfig, a backend name, a dict"):
        ll.MultiHeadAttention(16, 2, attention=3)


class TinyLM(nn.Module):
    """A causal language model from the blocks: embedding + position table, ``Transformer``, head."""

    def __init__(self, vocab: int, attention, length: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.position = nn.Parameter(0.1 * torch.randn(length, 32))
        self.body = ll.Transformer(2, 32, 4, attention=attention)
        self.head = nn.Linear(32, vocab)

    def forward(self, tokens, state=None, start=0):
        """Logits ``(B, N, vocab)`` and the state after the tokens (continuing ``state``)."""
        x = self.embed(tokens) + self.position[start : start + tokens.shape[1]]
        hidden, state = self.body(x, state=state, return_state=True)
        return self.head(hidden), state

    def step(self, token, position, state):
        hidden, state = self.body.step(self.embed(token) + self.position[position], state)
        return self.head(hidden), state


@pytest.mark.parametrize("attention", ["linear", "softmax", {"backend": "linear", "feature_map": "favor"}], ids=str)
def test_a_small_language_model_prefills_then_steps_like_the_whole_forward(attention):
    """Prompt in one parallel pass, then greedy steps; two samples branched from one prefilled
    state. Every step's logits equal the parallel forward over the whole sequence so far."""
    torch.manual_seed(0)
    model = TinyLM(11, attention).double().eval()
    prompt = torch.randint(0, 11, (2, 6))
    with torch.no_grad():
        logits, prefilled = model(prompt)
        tokens = torch.cat([prompt, logits[:, -1].argmax(-1, keepdim=True)], 1)
        state = prefilled
        for position in range(6, 12):
            step_logits, state = model.step(tokens[:, -1], position, state)
            whole, _ = model(tokens)
            torch.testing.assert_close(step_logits, whole[:, -1], rtol=1e-9, atol=1e-9)
            tokens = torch.cat([tokens, step_logits.argmax(-1, keepdim=True)], 1)
        # branching: another continuation from the same prefilled state, as a fresh run would give
        other = torch.randint(0, 11, (2, 3))
        branch_logits, branch = [], prefilled
        for i in range(3):
            out, branch = model.step(other[:, i], 6 + i, branch)
            branch_logits.append(out)
        fresh, _ = model(torch.cat([prompt, other], 1))
        torch.testing.assert_close(torch.stack(branch_logits, 1), fresh[:, 6:9], rtol=1e-9, atol=1e-9)


def test_the_readmes_own_model_example_runs_as_shown():
    """README, "Building your own model": the causal LM with a prefill, three samples stepped from
    one state (checked there against the parallel forward), and cross attention, run verbatim."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Building your own model"):]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2 and "class CausalLM" in blocks[0] and "context=memory" in blocks[1]
    torch.manual_seed(0)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert [tuple(s.shape) for s in namespace["samples"]] == [(2, 20)] * 3
    assert not torch.equal(namespace["samples"][0], namespace["samples"][1])  # sampled, not one path
    assert namespace["out"].shape == (2, 7, 64)
