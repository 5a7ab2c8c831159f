"""A saved state holds itself and nothing more (issue 43, items 4 and 5).

Softmax's and lsh's states (``KVCache``) and an lsh stack's prefix (``SequenceBuffer``) share
storage with the states stepped on from them, which write their new positions into it. Pickling,
``torch.save``, ``copy.deepcopy`` and ``clone`` of a state must write only its own filled positions
(never the spare room, nor keys a later step appended), and the copy continues exactly as the
original. A ``Transformer``'s state (``StackState``) has ``clone()``, ``detach()`` and ``nbytes``
like every backend state, and round-trips the same ways.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import linformer_lab as ll
from linformer_lab.ops.state import KVCache, LinearState, SequenceBuffer, StackState

D, M, PROMPT, LATER = 4, 4, 10, 40


def _saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loaded(obj):
    return torch.load(io.BytesIO(_saved_bytes(obj)), weights_only=True)


ROUND_TRIPS = {
    "torch.save+load(weights_only)": _loaded,
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "deepcopy": copy.deepcopy,
    "clone": lambda s: s.clone(),
}


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, KVCache):
        return [state.keys, state.values] + ([] if state.valid is None else [state.valid])
    if isinstance(state, SequenceBuffer):
        return [state.filled]
    if isinstance(state, LinearState):
        return [state.joint]
    return [t for s in state for t in _tensors(s)]


def _prompt_and_later(backend: str):
    """An attention backend, its state after a PROMPT-position prefill, and LATER steps taken from
    that state (which append into the storage the prompt state shares)."""
    torch.manual_seed(0)
    attn = ll.build_attention(backend, causal=True, query_dim=D)
    q, v = torch.randn(1, 2, PROMPT, D), torch.randn(1, 2, PROMPT, M)
    k = q if attn.shares_query_key else torch.randn(1, 2, PROMPT, D)
    _, prompt = attn(q, k, v, return_state=True)
    state = prompt
    for _ in range(LATER):
        q_t = torch.randn(1, 2, D)
        _, state = attn.step(q_t, q_t if attn.shares_query_key else torch.randn(1, 2, D), torch.randn(1, 2, M), state)
    return attn, prompt


def _continue(attn, state, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(3):
        q_t = torch.randn(1, 2, D, generator=gen)
        k_t = q_t if attn.shares_query_key else torch.randn(1, 2, D, generator=gen)
        out, state = attn.step(q_t, k_t, torch.randn(1, 2, M, generator=gen), state)
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("backend", ["softmax", "lsh"])
def test_a_saved_prompt_state_writes_its_own_positions_only(backend):
    attn, prompt = _prompt_and_later(backend)
    assert prompt.nbytes == 2 * 2 * PROMPT * D * 4  # keys and values, fp32: 640 bytes
    # the reference: the same tensors saved on their own, in storage exactly their size
    alone = _saved_bytes({"keys": prompt.keys.clone(), "values": prompt.values.clone(), "valid": None})
    saved = _saved_bytes(prompt)
    assert len(saved) <= len(alone) + 512, f"{len(saved)} bytes saved for a {prompt.nbytes}-byte state"
    assert len(pickle.dumps(prompt)) <= len(pickle.dumps({"k": prompt.keys.clone(), "v": prompt.values.clone()})) + 512


@pytest.mark.parametrize("trip", ROUND_TRIPS)
@pytest.mark.parametrize("backend", ["softmax", "lsh"])
def test_a_copied_state_holds_its_positions_only_and_continues_alike(backend, trip):
    attn, prompt = _prompt_and_later(backend)
    copied = ROUND_TRIPS[trip](prompt)
    for original, held in zip(_tensors(prompt), _tensors(copied), strict=True):
        assert torch.equal(original, held)
        assert held.untyped_storage().nbytes() == held.nbytes  # no spare room, no later step's keys
    assert torch.equal(_continue(attn, copied), _continue(attn, prompt))


def test_an_lsh_stack_prefix_saves_its_own_positions_only():
    torch.manual_seed(0)
    stack = ll.Transformer(1, 8, 2, attention={"backend": "lsh", "kwargs": {"bucket_size": 4, "n_buckets": 4}})
    _, prompt = stack(torch.randn(1, PROMPT, 8), return_state=True)
    state = prompt
    for _ in range(LATER):
        _, state = stack.step(torch.randn(1, 8), state)
    for trip in ROUND_TRIPS.values():
        copied = trip(prompt)
        assert copied.filled.untyped_storage().nbytes() == prompt.nbytes == PROMPT * 8 * 4
        x_t = torch.randn(1, 8)
        assert torch.equal(stack.step(x_t, copied)[0], stack.step(x_t, prompt)[0])


# ------------------------------------------------------------------------------- stack state


@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_a_stack_state_clones_detaches_and_round_trips_like_a_backend_state(backend):
    torch.manual_seed(0)
    stack = ll.Transformer(2, 8, 2, attention=backend)
    x = torch.randn(2, 5, 8, requires_grad=True)
    _, from_forward = stack(x, return_state=True)
    _, from_step = stack.step(torch.randn(2, 8))
    x_t = torch.randn(2, 8)
    for state in (from_forward, from_step):
        assert isinstance(state, StackState) and len(state) == 2
        expected = stack.step(x_t, state)[0]
        clone, detached = state.clone(), state.detach()
        assert type(clone) is type(detached) is StackState
        assert clone.nbytes == detached.nbytes == state.nbytes == ll.detach_state(state).nbytes > 0
        for held, mine in zip(_tensors(state), _tensors(clone), strict=True):
            assert torch.equal(held, mine) and held.data_ptr() != mine.data_ptr()
        assert all(not t.requires_grad for t in _tensors(detached))
        assert type(ll.clone_state(state)) is StackState
        for copied in (clone, detached, copy.deepcopy(state.detach()), pickle.loads(pickle.dumps(state.detach())),
                       _loaded(state.detach())):
            assert type(copied) is StackState
            assert torch.equal(stack.step(x_t, copied)[0], expected)


def test_the_package_root_exports_the_state_helpers_and_only_public_names():
    assert ll.clone_state is not None and ll.detach_state is not None
    assert {"clone_state", "detach_state"} <= set(ll.__all__)
    assert not {"annotations", "importlib", "ModuleType"} & set(dir(ll))
