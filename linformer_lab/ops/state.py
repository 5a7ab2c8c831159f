"""Every recurrent state type and the contract they meet, in one place.

A backend's ``step`` and ``forward(..., return_state=True)`` return a state of its own type:
linear attention's :class:`LinearState`, softmax's and lsh's :class:`KVCache` (two
:class:`SequenceBuffer`, which also hold the input prefix a stack without a recurrent form
re-runs), a stack's :class:`StackState`, a plugin's own class. Only the backend looks inside it;
the code around the backends (truncated back-propagation through time, branching a generation,
state-size reports) calls the members of :class:`AttentionState` and nothing else, through
:func:`detach_state`, :func:`clone_state` and :func:`state_nbytes`, which also walk plain lists
and tuples of states. A tensor meets the contract as it is.

Every built-in state copies, pickles and saves; ``torch.load(..., weights_only=True)`` reads it
back (the classes are registered safe globals). The module is in ops/, the lowest layer that makes a
state; ``linformer_lab.attention`` (``AttentionState``, ``KVCache``) and the package root
(``clone_state``, ``detach_state``) re-export names from it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["AttentionState", "KVCache", "LinearState", "SequenceBuffer", "StackState", "check_state", "clone_state",
           "detach_state", "state_nbytes"]


# ---------------------------------------------------------------- the contract
@runtime_checkable
class AttentionState(Protocol):
    """What an attention backend's recurrent state offers (structural: no base class to derive).

    A state is a value: the backend's ``step`` and ``forward(state=...)`` never change the state
    they are given (they return a new one), so one state can be continued several ways (samples
    from one prompt, beam search, retrying a step) and continuing it twice gives the same outputs.

    ``detach()``: the same type and numbers cut from the autograd graph (what truncated
    back-propagation through time carries into the next segment), usable wherever the original
    was. It may share memory, as ``Tensor.detach()`` does: no step writes into a state it was given.

    ``clone()``: the same type and numbers in memory of its own, still in the autograd graph (as
    ``Tensor.clone()``): a state to keep while an in-place step (the generation loop's) runs on.

    ``nbytes``: the bytes held for the sequence so far (filled positions, not spare capacity):
    constant for linear attention, growing for softmax.
    """

    def detach(self) -> AttentionState: ...

    def clone(self) -> AttentionState: ...

    @property
    def nbytes(self) -> int: ...


#: The members of :class:`AttentionState`, as an error names them.
_MEMBERS = (("detach", "detach()"), ("clone", "clone()"), ("nbytes", "nbytes"))


def _lacks(state) -> list[str]:
    """The members of the contract that ``state`` lacks."""
    # the class first: hasattr on the state would compute nbytes, which a traced (symbolic) tensor cannot
    return [label for name, label in _MEMBERS if not (hasattr(type(state), name) or hasattr(state, name))]


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _is_container(state) -> bool:
    # exactly list / tuple: a tuple subclass (LinearState, a NamedTuple) is a state of its own
    return type(state) is list or type(state) is tuple


def check_state(state, who: str) -> None:
    """Raise a TypeError naming ``who`` (the backend that made the state, or the function given
    it) and the members ``state`` lacks, unless it is None, meets :class:`AttentionState`, or is a
    list / tuple of such states."""
    if state is None:
        return
    if _is_container(state):
        for s in state:
            check_state(s, who)
        return
    lacks = _lacks(state)
    if lacks:
        cls = type(state)
        raise TypeError(
            f"{who}: the state {cls.__qualname__} (module {cls.__module__}) lacks {_listed(lacks)} of the "
            f"attention-state contract (linformer_lab.attention.AttentionState). Every backend's state offers "
            f"detach() (the same state cut from the autograd graph), clone() (the same state in memory of its "
            f"own) and nbytes (the bytes it holds); see docs/ARCHITECTURE.md, 'The recurrent state'"
        )


def _map_states(state, method: str):
    """``state`` (one backend's, a list / tuple of them, or None) with ``method`` (``"detach"`` or
    ``"clone"``) applied to each backend state."""
    if state is None:
        return None
    if _is_container(state):
        return type(state)(_map_states(s, method) for s in state)
    check_state(state, f"{method}_state")
    return getattr(state, method)()


def detach_state(state):
    """``state`` (one backend's, or a stack's list of them; None) cut from the autograd graph."""
    return _map_states(state, "detach")


def clone_state(state):
    """``state`` (one backend's, or a stack's list of them; None) in memory of its own."""
    return _map_states(state, "clone")


def state_nbytes(state) -> int:
    """Bytes held by a recurrent state (one backend's, or a stack's list of them, as
    ``Transformer.step`` returns; None holds none): the sum of the states' ``nbytes``."""
    if state is None:
        return 0
    if _is_container(state):
        return sum(state_nbytes(s) for s in state)
    check_state(state, "state_nbytes")
    return int(state.nbytes)


# ---------------------------------------------------------------- linear attention's fixed-size state
class LinearState(tuple):
    """The RNN state ``(S (B, H, C, M), Z (B, H, C))`` of eq. 16-19: a plain 2-tuple to every
    reader, whose two members are views of one ``(B, H, C, M + 1)`` buffer, ``joint = [S | Z]``
    (Z is the last column), so one matmul ``phi(q)^T [S | Z]`` gives the numerator and the
    normaliser of eq. 20 together.

    Meets :class:`AttentionState`; copies, pickles and saves as its one buffer (``copy.copy``
    shares it, ``copy.deepcopy`` / ``pickle`` / ``torch.save`` copy it).
    """

    joint: torch.Tensor

    def __new__(cls, joint: torch.Tensor):
        m = joint.shape[-1] - 1
        self = super().__new__(cls, (joint[..., :m], joint[..., m]))
        self.joint = joint
        return self

    def __reduce__(self):
        # rebuilt from the buffer alone: S and Z are views of it (a tuple subclass would
        # otherwise be rebuilt from the pair (S, Z), which __new__ does not take)
        return (LinearState, (self.joint,))

    def detach(self) -> LinearState:
        return LinearState(self.joint.detach())

    def clone(self) -> LinearState:
        return LinearState(self.joint.clone())

    @property
    def nbytes(self) -> int:
        """Bytes of S and Z: fixed by (B, H, C, M), whatever the sequence length."""
        return self.joint.nbytes


# ---------------------------------------------------------------- the states that grow with the sequence
def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """``x`` if it is all of its storage, else a compact copy: what a saved or deep-copied state
    holds, since ``pickle``, ``torch.save`` and ``copy.deepcopy`` of a view write its whole storage."""
    if x.is_contiguous() and x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.nbytes:
        return x
    return x.clone(memory_format=torch.contiguous_format)


class _Storage:
    """Memory shared by buffers that extend one another: ``data`` holds positions ``[0, used)``
    along the buffer's axis. Only a buffer of length ``used`` writes position ``used`` in place:
    no other buffer holds that position, so every earlier buffer keeps its values."""

    __slots__ = ("data", "used")

    def __init__(self, data: torch.Tensor, used: int):
        self.data, self.used = data, used


class SequenceBuffer:
    """A tensor that grows along its sequence axis ``dim``, one position at a time, as a value:
    :meth:`appended` returns a new buffer and leaves this one as it was. :attr:`filled` is a view
    of the ``T`` positions held.

    Appending is amortised O(1) all the same: buffers that extend one another share storage that
    doubles when full, and the newest one writes its next position in place (a position no
    other buffer holds). Appending to an older buffer a second time (a branch) copies its
    positions into storage of its own first. Under autograd every append is a ``torch.cat``
    (the earlier views are saved for the backward, which an in-place write would invalidate).

    Every state that grows with the sequence is made of these (:class:`KVCache`, the input prefix
    ``Transformer.step`` re-runs for a stack without a recurrent form). Meets
    :class:`AttentionState`; ``copy``, ``pickle`` and ``torch.save`` keep the filled positions.
    """

    def __init__(self, first: torch.Tensor, dim: int, capacity: int = 256):
        """An empty buffer for positions shaped like ``first`` (not appended), with room for
        ``capacity`` of them before it grows."""
        shape = list(first.shape)
        shape.insert(dim, capacity)
        self._store = _Storage(first.new_empty(shape), 0)
        self._position_shape = first.shape
        self.dim = dim
        self.length = 0

    def _hold(self, store: _Storage, dim: int, length: int) -> SequenceBuffer:
        self._store, self.dim, self.length = store, dim, length
        self._position_shape = store.data.shape[:dim] + store.data.shape[dim + 1 :]
        return self

    @classmethod
    def _holding(cls, store: _Storage, dim: int, length: int) -> SequenceBuffer:
        return cls.__new__(cls)._hold(store, dim, length)

    @classmethod
    def _owning(cls, data: torch.Tensor, dim: int, length: int | None = None) -> SequenceBuffer:
        """A buffer on storage of its own, ``data``, holding its first ``length`` positions (None: all)."""
        length = data.shape[dim] if length is None else length
        return cls._holding(_Storage(data, length), dim, length)

    @classmethod
    def from_tensor(cls, x: torch.Tensor, dim: int, spare: int = 256) -> SequenceBuffer:
        """A buffer already holding the ``x.shape[dim]`` positions of ``x`` (a parallel forward's
        keys, say). Under autograd ``x`` itself is the storage, so gradients flow back into it
        (never written: it has no spare room); otherwise it is copied into storage with room
        for ``spare`` more positions."""
        length = x.shape[dim]
        if torch.is_grad_enabled() and x.requires_grad:
            return cls._owning(x, dim)
        shape = list(x.shape)
        shape[dim] += spare
        data = x.new_empty(shape)
        data.narrow(dim, 0, length).copy_(x)
        return cls._owning(data, dim, length)

    def appended(self, x_t: torch.Tensor) -> SequenceBuffer:
        """A buffer holding this one's positions and then ``x_t`` (the buffer's shape without
        the sequence axis); this one is left as it was."""
        if x_t.shape != self._position_shape:
            raise ValueError(
                f"SequenceBuffer: a position of shape {tuple(x_t.shape)} does not fit a buffer of positions shaped "
                f"{tuple(self._position_shape)} (fixed by the sequence's first step)"
            )
        store, dim, length = self._store, self.dim, self.length
        if torch.is_grad_enabled() and (x_t.requires_grad or store.data.requires_grad):
            data = torch.cat([self.filled, x_t.unsqueeze(dim)], dim=dim)
            return SequenceBuffer._owning(data, dim)
        if store.used != length or length == store.data.shape[dim] or \
                (store.data.is_inference() and not torch.is_inference_mode_enabled()):
            # a longer buffer holds position `length` already, or there is no room (or the storage
            # was made under inference mode, which only it may write): storage of its own, twice
            # the size (so a chain of appends copies O(1) times per position)
            shape = list(store.data.shape)
            shape[dim] = max(2 * length, 16)
            data = store.data.new_empty(shape)
            data.narrow(dim, 0, length).copy_(self.filled)
            store = _Storage(data, length)
        store.data.select(dim, length).copy_(x_t)
        store.used = length + 1
        return SequenceBuffer._holding(store, dim, length + 1)

    def append(self, x_t: torch.Tensor) -> None:
        """:meth:`appended`, rebinding this object to the result (for a loop that owns the buffer;
        memory another buffer reads is never written)."""
        grown = self.appended(x_t)
        self._store, self.length = grown._store, grown.length

    @property
    def filled(self) -> torch.Tensor:
        return self._store.data.narrow(self.dim, 0, self.length)

    def detach(self) -> SequenceBuffer:
        if not self._store.data.requires_grad:
            return self
        data = self.filled.detach()  # no spare room: an append copies instead of writing into it
        return SequenceBuffer._owning(data, self.dim)

    def clone(self) -> SequenceBuffer:
        """Storage of exactly the filled positions' size; the first append copies them into storage with room."""
        data = self.filled.clone(memory_format=torch.contiguous_format)
        return SequenceBuffer._owning(data, self.dim)

    def __getstate__(self) -> dict:
        # the filled positions alone: saving (or deep-copying) the view would write the whole shared
        # storage, spare room and positions that longer buffers appended after this one included
        return {"filled": _own_storage(self.filled), "dim": self.dim}

    def __setstate__(self, state: dict) -> None:
        data, dim = state["filled"], state["dim"]
        # the tensor as it came (a shallow copy's is the original's view): no spare room, so it
        # is never written; the first append copies
        self._hold(_Storage(data, data.shape[dim]), dim, data.shape[dim])

    @property
    def nbytes(self) -> int:
        """Bytes of the filled positions (spare capacity not counted)."""
        return self.filled.numel() * self._store.data.element_size()


class KVCache:
    """Keys and values of the prefix, for backends whose state grows with the sequence
    (stateful softmax, paper §C.1, and LSH's recompute baseline): two :class:`SequenceBuffer`.

    ``keys (B, H, T, D)`` and ``values (B, H, T, M)`` are views of the ``T`` filled positions.
    ``valid`` is None when every cached key counts, else a bool ``(B, T)`` view saying which
    do: a parallel forward over a padded batch (``key_lengths``) leaves its padding in the
    cache of the shorter sequences, and ``valid`` keeps it out of every later step.

    A value as :class:`SequenceBuffer` is (:meth:`appended` returns a new cache); ``copy``, ``pickle``
    and ``torch.save`` keep the filled keys, values and ``valid``.
    """

    def __init__(self, k_t: torch.Tensor, v_t: torch.Tensor, capacity: int = 256):
        """An empty cache for keys shaped like ``k_t (B, H, D)`` and values like ``v_t (B, H, M)``."""
        self._keys = SequenceBuffer(k_t, dim=2, capacity=capacity)
        self._values = SequenceBuffer(v_t, dim=2, capacity=capacity)
        self._valid: SequenceBuffer | None = None

    @classmethod
    def _of(cls, keys: SequenceBuffer, values: SequenceBuffer, valid: SequenceBuffer | None) -> KVCache:
        self = cls.__new__(cls)
        self._keys, self._values, self._valid = keys, values, valid
        return self

    @classmethod
    def from_sequence(cls, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None) -> KVCache:
        """A cache holding ``keys (B, H, T, D)``, ``values (B, H, T, M)`` and, if some keys are
        padding, ``valid`` bool ``(B, T)``."""
        return cls._of(SequenceBuffer.from_tensor(keys, dim=2), SequenceBuffer.from_tensor(values, dim=2),
                       None if valid is None else SequenceBuffer.from_tensor(valid, dim=1))

    def appended(self, k_t: torch.Tensor, v_t: torch.Tensor) -> KVCache:
        """The cache with one more position ``k_t (B, H, D)``, ``v_t (B, H, M)``; this one is left as it was."""
        valid = self._valid
        if valid is not None:
            valid = valid.appended(torch.ones(k_t.shape[0], dtype=torch.bool, device=k_t.device))
        return KVCache._of(self._keys.appended(k_t), self._values.appended(v_t), valid)

    def append(self, k_t: torch.Tensor, v_t: torch.Tensor) -> None:
        """:meth:`appended`, rebinding this object to the result (memory another cache reads is never written)."""
        grown = self.appended(k_t, v_t)
        self._keys, self._values, self._valid = grown._keys, grown._values, grown._valid

    @property
    def valid(self) -> torch.Tensor | None:
        return None if self._valid is None else self._valid.filled

    @property
    def length(self) -> int:
        return self._keys.length

    @property
    def keys(self) -> torch.Tensor:
        return self._keys.filled

    @property
    def values(self) -> torch.Tensor:
        return self._values.filled

    def detach(self) -> KVCache:
        return KVCache._of(self._keys.detach(), self._values.detach(), self._valid)

    def clone(self) -> KVCache:
        valid = None if self._valid is None else self._valid.clone()
        return KVCache._of(self._keys.clone(), self._values.clone(), valid)

    def __getstate__(self) -> dict:
        valid = self.valid
        return {"keys": _own_storage(self.keys), "values": _own_storage(self.values),
                "valid": None if valid is None else _own_storage(valid)}

    def __setstate__(self, state: dict) -> None:
        # the tensors as they came, as SequenceBuffer.__setstate__ keeps them (never written)
        valid = state["valid"]
        self._keys = SequenceBuffer._owning(state["keys"], dim=2)
        self._values = SequenceBuffer._owning(state["values"], dim=2)
        self._valid = None if valid is None else SequenceBuffer._owning(valid, dim=1)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes


# ---------------------------------------------------------------- a layer stack's state
class StackState(list):
    """A layer stack's state: a list with one backend state per layer, as ``Transformer.step`` and
    ``Transformer.forward(..., return_state=True)`` return it. It meets :class:`AttentionState` as
    a whole, applying the contract layer by layer; copies, pickles and saves as the list of its
    layers' states.
    """

    def detach(self) -> StackState:
        return StackState(detach_state(s) for s in self)

    def clone(self) -> StackState:
        return StackState(clone_state(s) for s in self)

    @property
    def nbytes(self) -> int:
        return sum(state_nbytes(s) for s in self)

    def __reduce__(self):
        # rebuilt by a call on a plain list: the safe loader appends only to plain lists
        return (StackState, (list(self),))

    def __repr__(self) -> str:
        return f"StackState({list.__repr__(self)})"


# a saved state loads with torch.load(..., weights_only=True): the classes are all it needs beyond tensors
torch.serialization.add_safe_globals([LinearState, SequenceBuffer, KVCache, StackState])
