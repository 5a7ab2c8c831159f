"""The recurrent-state contract (docs/ARCHITECTURE.md, "The recurrent state").

Every attention backend's state offers ``detach()``, ``clone()`` and ``nbytes``
(:class:`linformer_lab.attention.AttentionState`), and that is all segmented training with a
detached state, copies of a stack's state and the state-size reports use; a state lacking them is a TypeError naming the
backend and what it lacks; a state of another backend's type given to ``step`` or ``forward``
is a TypeError naming both types. An out-of-tree backend with its own state type
(``examples/third_party_attention``, installed here the way an installer would) trains in
segments with a detached state, reports its state size, and steps as its parallel form runs.
"""

from __future__ import annotations

import importlib
import math
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import assert_close
from torch.utils.data import DataLoader, TensorDataset

import linformer_lab as ll
from linformer_lab.attention import Attention, AttentionState, KVCache
from linformer_lab.attention.config import AttentionConfig
from linformer_lab.attention.multihead import MultiHeadAttention
from linformer_lab.models.transformer import Transformer, detach_state, segmented_forward
from linformer_lab.ops.state import LinearState, SequenceBuffer, StackState, clone_state, state_nbytes
from linformer_lab.registry import ATTENTION
from linformer_lab.tasks.image_generation import ImageGenerationTask

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "third_party_attention"
LSH_SMALL = {"bucket_size": 2, "n_buckets": 4}
DECAY = {"backend": "decayed_linear", "kwargs": {"decay": 0.8}}


def _build(backend: str, query_dim: int = 4):
    return ll.build_attention(backend, causal=True, query_dim=query_dim, **(LSH_SMALL if backend == "lsh" else {}))


def _tensors(state) -> list[torch.Tensor]:
    """The tensors a built-in backend state holds."""
    if isinstance(state, LinearState):
        return [state.joint]
    if isinstance(state, KVCache):
        return [state.keys, state.values]
    return [state.filled]


# ------------------------------------------------------------------------------------------------
# the built-in states
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["linear", "softmax", "lsh"])
def test_builtin_states_meet_the_contract(backend):
    """From forward and from step (under autograd): detach() gives the same type and numbers
    without a graph, and the next step continues from it exactly; nbytes counts what is held."""
    attn = _build(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=gen, requires_grad=True) for _ in range(3))
    k = q if backend == "lsh" else k
    _, from_forward = attn(q, k, v, return_state=True)
    _, from_step = attn.step(q[:, :, 0], k[:, :, 0], v[:, :, 0])
    positions = {"forward": 6, "step": 1}
    for label, state in (("forward", from_forward), ("step", from_step)):
        assert isinstance(state, AttentionState), label
        detached = state.detach()
        assert type(detached) is type(state), label
        for held, cut in zip(_tensors(state), _tensors(detached)):
            assert held.requires_grad and not cut.requires_grad, label
            assert torch.equal(held, cut), label
        if backend == "linear":  # S, Z of fixed size: (B, H, C, M + 1) floats
            assert state.nbytes == 2 * 3 * 4 * 5 * 4, label
        else:  # keys and values of the positions so far
            assert state.nbytes == 2 * (2 * 3 * positions[label] * 4) * 4, label
        # under autograd (q requires grad), so neither step updates the shared buffer in place
        out, _ = attn.step(q[:, :, 1], k[:, :, 1], v[:, :, 1], state)
        out_cut, _ = attn.step(q[:, :, 1], k[:, :, 1], v[:, :, 1], detached)
        assert torch.equal(out, out_cut), label


def test_linear_step_under_autograd_returns_a_linear_state():
    """The step under autograd (out of place) returns a LinearState with the [S | Z] layout, from a
    LinearState or from a plain (S, Z); its outputs, state and gradients match the in-place step
    and the float64 gradcheck."""
    attn = _build("linear").double()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    with torch.inference_mode():
        out_a, state_a = attn.step(q[0], k[0], v[0])
        out_b, state_b = attn.step(q[1], k[1], v[1], state_a)
        want = [out_a.clone(), out_b.clone()]
        want_joint = state_b.joint.clone()
    plain = (torch.zeros(2, 2, 4, 4, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64))
    for start in (None, plain):
        k_g = k.clone().requires_grad_()
        out_a, state = attn.step(q[0], k_g[0], v[0], start)
        out_b, state = attn.step(q[1], k_g[1], v[1], state)
        assert type(state) is LinearState and state.joint.requires_grad
        assert state[0].data_ptr() == state.joint.data_ptr()  # S is a view of the joint buffer
        assert_close("step under autograd", torch.stack(want), torch.stack([out_a, out_b]), 1e-12, 1e-12)
        assert_close("state under autograd", want_joint, state.joint, 1e-12, 1e-12)

    def two_steps(q_, k_, v_):
        out_a, state = attn.step(q_[0], k_[0], v_[0])
        out_b, state = attn.step(q_[1], k_[1], v_[1], state)
        return out_a, out_b, state.joint

    inputs = tuple(t[:2].clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(two_steps, inputs)


@pytest.mark.parametrize("backend", ["linear", "softmax", "lsh"])
def test_stack_states_detach_and_size_generically(backend):
    """A Transformer's state (a StackState of per-layer states; lsh: its input prefix) and a plain
    (S, Z) tuple go through detach_state and state_nbytes with no backend-specific code."""
    model = Transformer(2, 8, 2, attention=AttentionConfig(backend, kwargs=LSH_SMALL if backend == "lsh" else {}))
    x = torch.randn(1, 5, 8, requires_grad=True)
    _, state = model(x, return_state=True)
    _, state = model.step(x[:, 0], state)
    detached = detach_state(state)
    if backend == "lsh":
        assert isinstance(state, SequenceBuffer) and isinstance(detached, SequenceBuffer)
        pieces = [(state, detached)]
    else:
        assert type(detached) is StackState and len(detached) == 2
        pieces = list(zip(state, detached))
    for held, cut in pieces:
        assert type(cut) is type(held)
        assert all(not t.requires_grad for t in _tensors(cut))
    assert state_nbytes(state) == state_nbytes(detached) == sum(held.nbytes for held, _ in pieces) > 0
    assert state_nbytes(None) == 0 and detach_state(None) is None
    s, z = torch.ones(1, 2, 3, 4, requires_grad=True), torch.ones(1, 2, 3)
    cut = detach_state([(s, z)])
    assert type(cut[0]) is tuple and not cut[0][0].requires_grad
    assert state_nbytes([(s, z)]) == (24 + 6) * 4


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


class _Bag:
    """A state with neither member of the contract."""

    def __init__(self, s):
        self.s = s


class _OnlyDetach(_Bag):
    def detach(self):
        return _OnlyDetach(self.s.detach())


class _BagBackend(Attention):
    """A third-party backend whose state does not meet the contract."""

    supports_state = True

    def forward(self, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
        return (v, _Bag(k.sum(2))) if return_state else v

    def step(self, q_t, k_t, v_t, state=None):
        return v_t, _Bag(k_t)


def test_state_lacking_the_contract_is_a_type_error_naming_backend_and_members():
    mha = MultiHeadAttention(8, 2, attention=_BagBackend(causal=True))
    x = torch.randn(1, 3, 8)
    assert mha(x).shape == x.shape  # without a state nothing changes
    with pytest.raises(TypeError, match=r"attention backend _BagBackend \(test_state_contract\): the state _Bag .*"
                                        r"lacks detach\(\), clone\(\) and nbytes of the attention-state contract"):
        mha(x, return_state=True)
    _, stepped = Transformer(2, 8, 2, attention=AttentionConfig("linear")).step(x[:, 0])
    for function in (detach_state, clone_state, state_nbytes):
        with pytest.raises(TypeError, match=rf"{function.__name__}: the state _OnlyDetach \(module test_state_contract\) "
                                            r"lacks clone\(\) and nbytes of the attention-state contract"):
            function([stepped[0], _OnlyDetach(torch.zeros(2))])
    with pytest.raises(TypeError, match=r"state _Bag .* lacks detach\(\), clone\(\) and nbytes"):
        segmented_forward(lambda a, b, state: (None, _Bag(torch.zeros(1))), 4, 2, detach=True)


def test_another_backends_state_is_a_type_error_naming_both_types():
    q = torch.randn(2, 3, 4)
    states = {}
    for backend in ("linear", "softmax"):
        _, states[backend] = _build(backend).step(q, q, q)
    transformer_state = [states["softmax"]]
    cases = [
        ("linear", states["softmax"], r"LinearAttention\.{} got a KVCache state \(from softmax or lsh attention\?\); "
                                      r"it takes a LinearState \(S, Z\) or None"),
        ("softmax", states["linear"], r"SoftmaxAttention\.{} got a LinearState state \(from linear attention\?\); "
                                      r"it takes a KVCache or None"),
        ("softmax", transformer_state, r"SoftmaxAttention\.{} got a list state \(from a Transformer, whose state is a list"),
        ("lsh", states["linear"], r"LSHAttention\.{} got a LinearState state \(from linear attention\?\); "
                                  r"it takes the KVCache of its prefix or None"),
    ]
    for backend, state, message in cases:
        attn = _build(backend)
        with pytest.raises(TypeError, match=message.format("step")):
            attn.step(q, q, q, state)
        with pytest.raises(TypeError, match=message.format("forward")):
            attn(q[:, :, None], q[:, :, None], q[:, :, None], state=state)
    with pytest.raises(TypeError, match=r"got a _Bag state \(from test_state_contract\?\)"):
        _build("linear").step(q, q, q, _Bag(q))


# ------------------------------------------------------------------------------------------------
# an out-of-tree backend with its own state (examples/third_party_attention)
# ------------------------------------------------------------------------------------------------


def _install(example: Path, site: Path) -> None:
    """Install an example package the way an installer would: its package directory plus a
    .dist-info carrying the entry points from its pyproject."""
    import tomllib

    project = tomllib.loads((example / "pyproject.toml").read_text())["project"]
    for package in example.iterdir():
        if (package / "__init__.py").is_file():
            shutil.copytree(package, site / package.name)
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{name} = {target}" for name, target in entries.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")


@pytest.fixture
def decay(tmp_path, monkeypatch):
    """examples/third_party_attention installed on sys.path and discovered through its entry
    point; the plugin module, removed again afterwards."""
    _install(EXAMPLE, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    ATTENTION.refresh()
    yield importlib.import_module("linformer_lab_decay")
    ATTENTION.refresh()
    sys.modules.pop("linformer_lab_decay", None)


def test_out_of_tree_backend_is_found_by_name(decay):
    assert "decayed_linear" in ll.list_attention()
    assert ATTENTION.distributions()["decayed_linear"] == ["linformer-lab-decay==0.1.0"]
    assert ATTENTION.get("decayed_linear") is decay.DecayedLinearAttention
    attn = ll.build_attention("decayed_linear", causal=True, query_dim=4, decay=0.5)
    _, state = attn.step(*(torch.randn(2, 3, 4) for _ in range(3)))
    assert isinstance(state, decay.DecayState) and isinstance(state, AttentionState)


def test_out_of_tree_backend_steps_as_its_parallel_form_runs(decay):
    """float64: the recurrent step equals the parallel forward at every position; the forward
    over segments with the state carried equals one pass; stepping continues a prefill."""
    torch.manual_seed(0)
    model = Transformer(2, 16, 2, attention=AttentionConfig.coerce(DECAY)).double()
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    full = model(x)
    state, stepped = None, []
    for t in range(11):
        out, state = model.step(x[:, t], state)
        stepped.append(out)
    assert_close("step vs forward", full, torch.stack(stepped, 1))
    pieces, state = [], None
    for a, b in [(0, 4), (4, 5), (5, 11)]:
        out, state = model(x[:, a:b], state=state, return_state=True)
        pieces.append(out)
    assert_close("segments vs one pass", full, torch.cat(pieces, 1))
    _, state = model(x[:, :7], return_state=True)
    for t in range(7, 11):
        out, state = model.step(x[:, t], state)
    assert_close("step after prefill", full[:, -1], out)


def test_out_of_tree_backend_reports_its_state_size(decay):
    """state_nbytes reads the plugin's nbytes: S (B, H, D, M) and Z (B, H, D) per layer in fp32,
    the same at the first position and the last, and for the prefill's state."""
    model = Transformer(3, 16, 2, attention=AttentionConfig.coerce(DECAY)).eval()
    x = torch.randn(2, 9, 16)
    expected = 3 * (2 * 2 * 8 * 8 + 2 * 2 * 8) * 4
    sizes, state = [], None
    with torch.inference_mode():
        for t in range(9):
            _, state = model.step(x[:, t], state)
            sizes.append(state_nbytes(state))
        _, prefilled = model(x, return_state=True)
    assert set(sizes) == {expected}
    assert state_nbytes(prefilled) == expected


class _RandomImages(L.LightningDataModule):
    image_shape = (1, 4, 4)

    def train_dataloader(self):
        images = torch.randint(0, 256, (12, *self.image_shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(images, torch.zeros(12, dtype=torch.long)), batch_size=4)


def test_out_of_tree_backend_trains_segmented_with_a_detached_state(decay, monkeypatch, tmp_path):
    """ImageGenerationTask with segment_length and detach_state (the CLI's --model.segment_length
    / --model.detach_state) trains through Lightning: the plugin's state is detached at every
    segment boundary by its own detach(), and the segmented loss is the one-pass loss."""
    torch.manual_seed(0)
    task = ImageGenerationTask(AttentionConfig(**DECAY), image_shape=(1, 4, 4), n_layers=2, n_heads=2, d_model=16,
                               d_ff=32, num_mixtures=3, segment_length=5, detach_state=True)
    detached = []
    original = decay.DecayState.detach
    monkeypatch.setattr(decay.DecayState, "detach", lambda self: detached.append(self) or original(self))
    images = next(iter(_RandomImages().train_dataloader()))[0]
    sequence = task.model.to_sequence(images)
    pieces = segmented_forward(lambda a, b, s: task.model.segment_nll(sequence, a, b, s), 16, 5, detach=True)
    assert_close("segmented nll", task.model.nll(images), torch.cat(pieces, 1), 1e-5, 1e-6)
    assert len(detached) == 3 * 2  # 3 boundaries (at 5, 10, 15), 2 layers
    before = [p.detach().clone() for p in task.parameters()]
    detached.clear()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(task, _RandomImages())
    assert trainer.global_step == 3
    assert len(detached) == 3 * 3 * 2  # per training step as above
    assert math.isfinite(float(trainer.callback_metrics["train/bits_per_dim"]))
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, task.parameters()))
