"""States are values (issue 39, item 1): ``step`` never changes the state it is given, so one state
can be continued several ways (samples from one prompt, beam search, retrying a step), and every
built-in state copies, clones, pickles and saves.

For every registered backend (``attention_configs()``), float64, from a state made by the parallel
prefill and from one made by steps: stepping twice from one state gives the same outputs and
leaves the state as it was; a clone, a detached state and every round trip (copy, deepcopy,
pickle, ``torch.save`` + ``torch.load(weights_only=True)``) continue like the original; branches
stepped in turn from one state equal fresh runs of the same tokens (and, for backends with a
recurrent form, the causal forward over the whole sequence). The same through
``TransformerLayer.step`` / ``Transformer.step``, and the generation fast step, which may update
in place only the states it made.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
from conftest import assert_close, attention_configs, config_id

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.generation import fast_step, weight_copies_for_steps
from linformer_lab.models.transformer import Transformer
from linformer_lab.ops.state import KVCache, LinearState, SequenceBuffer, clone_state

CONFIGS = attention_configs()
D, M, PREFIX, STEPS = 4, 3, 6, 5
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _backend(config):
    """The backend in float64 with its parameters (learned feature maps' weights) frozen: a state made
    from trainable weights is on the autograd graph, and ``copy.deepcopy`` refuses such a tensor
    (as it refuses any non-leaf tensor); the states a generation loop branches are made without it."""
    torch.manual_seed(0)
    return config.build(causal=True, query_dim=D).to(torch.float64).requires_grad_(False)


def _sequence(backend, length: int, seed: int):
    """q, k, v ``(2, 2, length, D / M)``; k is q for shared-QK backends (lsh)."""
    gen = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(2, 2, length, D, generator=gen, dtype=torch.float64)
    k = q if backend.shares_query_key else 0.5 * torch.randn(2, 2, length, D, generator=gen, dtype=torch.float64)
    return q, k, torch.randn(2, 2, length, M, generator=gen, dtype=torch.float64)


def _at(qkv, t):
    return tuple(x[:, :, t] for x in qkv)


def _steps(backend, qkv, state, start=0):
    """Steps positions ``start..`` of ``qkv`` from ``state``: (outputs (B, H, T, M), final state)."""
    outs = []
    for t in range(start, qkv[0].shape[2]):
        out, state = backend.step(*_at(qkv, t), state)
        outs.append(out)
    return torch.stack(outs, 2), state


def _tensors(state) -> list[torch.Tensor]:
    """Every number a state holds, as tensors (cloned: a snapshot)."""
    if isinstance(state, LinearState):
        return [state.joint.clone()]
    if isinstance(state, KVCache):
        return [state.keys.clone(), state.values.clone()] + ([] if state.valid is None else [state.valid.clone()])
    if isinstance(state, SequenceBuffer):
        return [state.filled.clone()]
    if isinstance(state, (list, tuple)):
        return [t for s in state for t in _tensors(s)]
    raise AssertionError(f"unknown state {type(state).__name__}")


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _prefilled(backend, qkv, how: str):
    """The state after the first PREFIX positions: from the parallel forward or from steps."""
    prefix = tuple(x[:, :, :PREFIX] for x in qkv)
    if how == "forward":
        return backend(*prefix, return_state=True)[1]
    return _steps(backend, prefix, None)[1]


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


ROUND_TRIPS = {
    "clone": lambda s: s.clone(),
    "detach": lambda s: s.detach(),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": lambda s: pickle.loads(pickle.dumps(s)),
    "torch.save+load(weights_only)": _saved,
}


@pytest.mark.parametrize("how", ["forward", "steps"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_a_step_leaves_its_state_and_repeats_exactly(config, how):
    backend = _backend(config)
    qkv = _sequence(backend, PREFIX + 1, seed=1)
    state = _prefilled(backend, qkv, how)
    before = _tensors(state)
    first, after_first = backend.step(*_at(qkv, PREFIX), state)
    again, after_again = backend.step(*_at(qkv, PREFIX), state)
    assert _same(_tensors(state), before), f"{config_id(config)}: step changed the state it was given"
    assert torch.equal(first, again), f"{config_id(config)}: two steps from one state differ"
    assert after_first is not state and _same(_tensors(after_first), _tensors(after_again))
    if backend.supports_state:  # the parallel form continuing the state leaves it as it was too
        chunk = tuple(x[:, :, PREFIX:] for x in qkv)
        out, _ = backend(*chunk, state=state, return_state=True)
        assert torch.equal(out, backend(*chunk, state=state)) and _same(_tensors(state), before)


@pytest.mark.parametrize("how", ["forward", "steps"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_branches_stepped_in_turn_equal_fresh_runs(config, how):
    """Two continuations of one prefix, stepped alternately from the one prefilled state (then each
    continued from its own earlier states twice), equal the same tokens run from scratch."""
    backend = _backend(config)
    a, b = _sequence(backend, PREFIX + STEPS, seed=2), _sequence(backend, PREFIX + STEPS, seed=3)
    b = tuple(torch.cat([x[:, :, :PREFIX], y[:, :, PREFIX:]], dim=2) for x, y in zip(a, b))  # the same prefix
    shared = _prefilled(backend, a, how)
    states, outs = {"a": shared, "b": shared}, {"a": [], "b": []}
    for t in range(PREFIX, PREFIX + STEPS):
        for name, qkv in (("a", a), ("b", b)):
            out, states[name] = backend.step(*_at(qkv, t), states[name])
            outs[name].append(out)
    for name, qkv in (("a", a), ("b", b)):
        fresh, _ = _steps(backend, qkv, None)
        assert_close(f"{config_id(config)} branch {name}", fresh[:, :, PREFIX:], torch.stack(outs[name], 2), **TOL)
        if backend.has_recurrent_form:  # and the parallel form over the whole sequence
            whole = backend(*qkv)[:, :, PREFIX:]
            assert_close(f"{config_id(config)} branch {name} vs forward", whole, torch.stack(outs[name], 2), 1e-9, 1e-9)
    # the shared prefix state still continues like a fresh one after both branches grew from it
    again, _ = _steps(backend, a, shared, start=PREFIX)
    assert_close(f"{config_id(config)} prefix state after branching", torch.stack(outs["a"], 2), again, **TOL)


@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_copies_and_round_trips_continue_like_the_original(config, trip):
    backend = _backend(config)
    qkv = _sequence(backend, PREFIX + STEPS, seed=4)
    for how in ("forward", "steps"):
        state = _prefilled(backend, qkv, how)
        copied = ROUND_TRIPS[trip](state)
        assert type(copied) is type(state)
        assert _same(_tensors(copied), _tensors(state))
        from_copy, _ = _steps(backend, qkv, copied, start=PREFIX)
        from_original, _ = _steps(backend, qkv, state, start=PREFIX)  # after the copy was continued
        assert_close(f"{config_id(config)} {trip} ({how})", from_original, from_copy, **TOL)
        assert _same(_tensors(copied), _tensors(state))  # neither continuation changed either state


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_detach_shares_memory_and_clone_copies(config):
    backend = _backend(config)
    qkv = tuple(x.requires_grad_() for x in _sequence(backend, PREFIX, seed=5))
    _, state = backend(*qkv, return_state=True)  # connected to the graph
    detached, cloned = state.detach(), state.clone()
    for original, shared, own in zip(_tensors_live(state), _tensors_live(detached), _tensors_live(cloned)):
        assert not shared.requires_grad and shared.data_ptr() == original.data_ptr()
        assert own.requires_grad == original.requires_grad and own.data_ptr() != original.data_ptr()
        assert torch.equal(own, original)


def _tensors_live(state) -> list[torch.Tensor]:
    """The tensors a state holds (not copies), for memory checks; ``valid`` masks left out."""
    if isinstance(state, LinearState):
        return [state.joint]
    return [state.keys, state.values]


def test_sequence_buffer_appends_in_place_along_a_chain_and_copies_on_a_branch():
    """A chain of appends writes into shared storage (amortised O(1)); appending to an older buffer
    gives it storage of its own and leaves every newer one as it was."""
    rows = [torch.full((2, 3), float(i)) for i in range(6)]
    start = SequenceBuffer(rows[0], dim=1, capacity=4)
    chain = [start]
    for row in rows[:4]:
        chain.append(chain[-1].appended(row))
    assert len({b.filled.data_ptr() for b in chain[1:]}) == 1  # one storage along the chain
    branch = chain[2].appended(rows[5])  # chain[3] already holds position 2
    assert branch.filled.data_ptr() != chain[3].filled.data_ptr()
    torch.testing.assert_close(branch.filled, torch.stack([rows[0], rows[1], rows[5]], 1))
    for i, buffer in enumerate(chain):  # nothing an earlier buffer holds has changed
        assert buffer.length == i
        torch.testing.assert_close(buffer.filled, torch.stack(rows[:i], 1) if i else torch.zeros(2, 0, 3))
    grown = chain[-1].appended(rows[4])  # past the capacity of 4: new storage
    torch.testing.assert_close(grown.filled, torch.stack(rows[:5], 1))
    torch.testing.assert_close(chain[-1].filled, torch.stack(rows[:4], 1))
    again = grown.appended(rows[5])  # and the chain goes on in place in the grown storage
    assert again.filled.data_ptr() == grown.filled.data_ptr()


# ------------------------------------------------------------------------------------------------
# through the layer and the stack, and the generation fast step
# ------------------------------------------------------------------------------------------------


def _stack(config, n_layers=2) -> Transformer:
    torch.manual_seed(0)
    return Transformer(n_layers, 8, 2, d_ff=16, attention=config).to(torch.float64).eval()


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_transformer_and_layer_steps_leave_their_state(config):
    model = _stack(config)
    x = torch.randn(2, PREFIX + STEPS, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        _, state = model(x[:, :PREFIX], return_state=True)
        before = _tensors(state)
        first, _ = model.step(x[:, PREFIX], state)
        again, _ = model.step(x[:, PREFIX], state)
        assert torch.equal(first, again) and _same(_tensors(state), before)
        loaded = _saved(state)  # a stack's state (a list of states) saves and loads as it is
        assert _same(_tensors(loaded), before)
        assert_close(f"{config_id(config)} loaded stack state", first, model.step(x[:, PREFIX], loaded)[0], **TOL)
        if model.has_recurrent_form:  # one layer alone
            layer = model.layers[0]
            _, layer_state = layer(x[:, :PREFIX], return_state=True)
            before = _tensors(layer_state)
            one, _ = layer.step(x[:, PREFIX], layer_state)
            two, _ = layer.step(x[:, PREFIX], layer_state)
            assert torch.equal(one, two) and _same(_tensors(layer_state), before)


@pytest.mark.parametrize("copies", [None, "model"], ids=["python", "weight-copies"])
@pytest.mark.parametrize("backend", ["linear", "softmax"])
def test_the_fast_step_leaves_a_callers_state_and_continues_it_alike(backend, copies):
    """``fast_step`` (what ``generate`` runs; with weight copies on CPU the fused C++ step where it
    builds) continues a prefilled state given to it twice, the same outputs, the state untouched,
    equal to ``Transformer.step``; it updates in place only the states it made itself."""
    model = _stack(AttentionConfig(backend), n_layers=2)
    x = torch.randn(2, PREFIX + STEPS, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        _, prefilled = model(x[:, :PREFIX], return_state=True)
        before = _tensors(prefilled)
        want, state = [], prefilled
        for t in range(PREFIX, x.shape[1]):
            out, state = model.step(x[:, t], state)
            want.append(out)
        runs = []
        for _ in range(2):
            outs, state = [], prefilled
            with weight_copies_for_steps(model, copies) if copies else contextlib.nullcontext():
                for t in range(PREFIX, x.shape[1]):
                    out, state = fast_step(model, x[:, t], state)
                    outs.append(out)
            runs.append(torch.stack(outs, 1))
        assert _same(_tensors(prefilled), before), "fast_step changed the caller's state"
        assert torch.equal(runs[0], runs[1])
        assert_close(f"fast_step {backend}", torch.stack(want, 1), runs[0], 1e-10, 1e-10)
        snapshot, kept = _tensors(state), clone_state(state)  # fast_step may update its own state: a clone keeps it
        fast_step(model, x[:, -1], state)
        assert _same(_tensors(kept), snapshot)


def test_a_cache_prefilled_under_inference_mode_steps_under_no_grad():
    """Storage made under inference mode cannot be written outside it: the append copies instead."""
    backend = _backend(AttentionConfig("softmax"))
    qkv = _sequence(backend, PREFIX + 2, seed=8)
    with torch.inference_mode():
        state = _prefilled(backend, qkv, "forward")
    with torch.no_grad():
        got, _ = _steps(backend, qkv, state, start=PREFIX)
        want, _ = _steps(backend, qkv, None)
    assert_close("softmax after an inference-mode prefill", want[:, :, PREFIX:], got, **TOL)
