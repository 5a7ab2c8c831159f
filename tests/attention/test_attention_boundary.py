"""The configuration boundary (docs/ARCHITECTURE.md, "The configuration boundary").

What a user writes for ``attention`` (None, a backend name, a dict of the fields, a config; for
one layer a built backend) is coerced once, at the constructor the user called: a task, a whole
model (PixelTransformer, TransformerCTC) or a building block (Transformer, TransformerLayer,
MultiHeadAttention). What it hands down is made already (a config, built backends), so each
path counts one coercion at most, and none where the user gave a config or a backend.
"""

from __future__ import annotations

import pytest
import torch

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.linear import LinearAttention
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.models.ctc import TransformerCTC
from linformer_lab.models.pixel_transformer import PixelTransformer
from linformer_lab.models.transformer import Transformer, TransformerLayer
from linformer_lab.tasks.copy_task import CopyTask
from linformer_lab.tasks.image_generation import ImageGenerationTask
from linformer_lab.tasks.speech import SpeechRecognitionTask

SOFTMAX = {"backend": "softmax"}
TINY = {"n_layers": 1, "n_heads": 2, "d_model": 16}

TASKS = {
    "image": lambda attention: ImageGenerationTask(attention, image_shape=(1, 4, 4), d_ff=16, num_mixtures=2, **TINY),
    "speech": lambda attention: SpeechRecognitionTask(attention=attention, d_ff=16, **TINY),
    "copy": lambda attention: CopyTask(attention, vocab_size=12, sequence_length=8, d_ff=16, **TINY),
}


@pytest.fixture
def coerce_calls(monkeypatch) -> list:
    """Every call of AttentionConfig.coerce from now on, as the argument it got."""
    calls = []
    coerce = AttentionConfig.coerce.__func__

    def counted(cls, attention):
        calls.append(attention)
        return coerce(cls, attention)

    monkeypatch.setattr(AttentionConfig, "coerce", classmethod(counted))
    return calls


@pytest.mark.parametrize("task", list(TASKS))
def test_a_task_coerces_its_attention_once(task, coerce_calls):
    """task -> (PixelTransformer | TransformerCTC) -> Transformer -> MultiHeadAttention: one coercion."""
    built = TASKS[task](dict(SOFTMAX))
    assert coerce_calls == [SOFTMAX]
    assert built.attention_config == AttentionConfig("softmax")
    assert built.hparams["attention"] == AttentionConfig("softmax").to_hparams()  # plain data for the checkpoint
    backends = {type(m.attention).__name__ for m in built.modules() if isinstance(m, MultiHeadAttention)}
    assert backends == {"SoftmaxAttention"}


@pytest.mark.parametrize("task", list(TASKS))
def test_a_task_rebuilt_from_its_hparams_has_the_same_attention(task):
    """What load_from_checkpoint does: the stored dict goes back through the task's edge."""
    built = TASKS[task]("softmax")
    again = TASKS[task](built.hparams["attention"])
    assert again.attention_config == built.attention_config


@pytest.mark.parametrize("form", [None, "softmax", SOFTMAX, AttentionConfig("softmax")], ids=repr)
@pytest.mark.parametrize("model", ["pixel", "ctc"])
def test_whole_models_take_every_user_form(model, form, coerce_calls):
    build = {
        "pixel": lambda: PixelTransformer(form, image_shape=(1, 2, 2), d_ff=16, num_mixtures=2, **TINY),
        "ctc": lambda: TransformerCTC(5, attention=form, d_ff=16, **TINY),
    }[model]
    want = AttentionConfig() if form is None else AttentionConfig("softmax")
    assert build().attention_config == want
    assert len(coerce_calls) == 1


BLOCKS = {
    "Transformer": lambda attention: Transformer(1, 8, 2, attention=attention),
    "TransformerLayer": lambda attention: TransformerLayer(8, 2, 16, attention=attention),
    "MultiHeadAttention": lambda attention: MultiHeadAttention(8, 2, attention=attention),
}


@pytest.mark.parametrize("form", [None, "softmax", SOFTMAX, AttentionConfig("softmax")], ids=repr)
@pytest.mark.parametrize("block", list(BLOCKS))
def test_building_blocks_take_every_user_form_coercing_once(block, form, coerce_calls):
    """A block called by the user coerces a raw form once, a config not at all (it is one), and
    hands built backends down: no second coercion below it."""
    module = BLOCKS[block](dict(form) if isinstance(form, dict) else form)
    backend = "LinearAttention" if form is None else "SoftmaxAttention"
    assert {type(m.attention).__name__ for m in module.modules() if isinstance(m, MultiHeadAttention)} == {backend}
    assert len(coerce_calls) == (0 if isinstance(form, AttentionConfig) else 1)


def test_a_layer_takes_a_built_backend_and_a_stack_does_not(coerce_calls):
    backend = LinearAttention(causal=True, query_dim=4)
    assert MultiHeadAttention(8, 2, attention=backend).attention is backend
    assert TransformerLayer(8, 2, 16, attention=backend).attention.attention is backend
    assert coerce_calls == []
    with pytest.raises(TypeError, match=r"^Transformer builds one attention per layer, so it takes a backend name, .* "
                                        r"not one built LinearAttention \(one module cannot serve every layer"):
        Transformer(2, 8, 2, attention=backend)
    out = TransformerLayer(8, 2, 16, attention=backend)(torch.randn(1, 3, 8))
    assert out.shape == (1, 3, 8)
