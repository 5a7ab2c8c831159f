"""The recurrent-state contract: what the state of every attention backend offers.

A backend's ``step`` and ``forward(..., return_state=True)`` return a state of the backend's own
type (linear attention's :class:`~linformer_lab.ops.linear_attention.LinearState`, softmax's and
lsh's :class:`~linformer_lab.attention.base.KVCache`, a plugin's own class). Only the backend
looks inside it. The code around the backends (truncated back-propagation through time in
``segmented_forward``, branching a generation, state-size reports) calls the three members of
:class:`AttentionState` and nothing else.

A state is a value: ``step`` and ``forward(state=...)`` return a new state and leave the one
they were given as it was, so one state can be continued several ways (samples from one prompt,
beam search, retrying a step). That is why :meth:`AttentionState.detach` may share memory with
the original: nothing writes into a state after it was returned.

A layer stack's state is a :class:`StackState`, a list with one backend state per layer
(``Transformer.step``) that meets the contract itself; :func:`detach_state`, :func:`clone_state`
and :func:`state_nbytes` also walk plain lists and tuples (a stack's state put together by hand),
so stacks are handled here, once. Tensors meet the contract as they are (``Tensor.detach()``, ``Tensor.nbytes``), so a
state that is a tensor or a plain tuple of tensors needs nothing more.

The contract lives in ops/, the lowest layer that defines a state type (``LinearState``), and is
re-exported beside ``Attention`` in :mod:`linformer_lab.attention.base`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["AttentionState", "StackState", "check_state", "clone_state", "detach_state", "state_nbytes"]


@runtime_checkable
class AttentionState(Protocol):
    """What an attention backend's recurrent state offers (structural: no base class to derive).

    A state is a value: the backend's ``step`` and ``forward(state=...)`` never change the state
    they are given (they return a new one), so continuing one state twice gives the same outputs.

    ``detach()``: a state of the same type holding the same numbers, cut from the autograd graph
    (what truncated back-propagation through time carries into the next segment). It may share
    memory with the original, as ``Tensor.detach()`` does (the built-in states do): safe, since no
    step writes into a state it was given. It must be usable wherever the original was: ``step``
    and ``forward(state=...)`` continue from it.

    ``clone()``: a state of the same type holding the same numbers in memory of its own (as
    ``Tensor.clone()``: still connected to the autograd graph). A state to keep while something
    that updates states in place (the generation loop's fast step) runs on from it.

    ``nbytes``: the bytes the state holds for the sequence so far (a growing cache counts its
    filled positions, not spare capacity): constant for linear attention, growing for softmax.
    """

    def detach(self) -> AttentionState: ...

    def clone(self) -> AttentionState: ...

    @property
    def nbytes(self) -> int: ...


#: The members of :class:`AttentionState`, as an error names them.
_MEMBERS = (("detach", "detach()"), ("clone", "clone()"), ("nbytes", "nbytes"))


def _lacks(state) -> list[str]:
    """The members of the contract that ``state`` lacks (what ``isinstance(state, AttentionState)``
    looks at)."""
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
            f"own) and nbytes (the bytes it holds); see "
            f"docs/ARCHITECTURE.md, 'The recurrent state'"
        )


def _map_states(state, method: str):
    """``state`` (one backend's, a list / tuple of them, or None) with each backend state replaced
    by the result of calling its contract member ``method`` (``"detach"`` or ``"clone"``)."""
    if state is None:
        return None
    if _is_container(state):
        return type(state)(_map_states(s, method) for s in state)
    check_state(state, f"{method}_state")
    return getattr(state, method)()


def detach_state(state):
    """``state`` (one backend's, or a stack's list of them; None) cut from the autograd graph, the
    same numbers: what truncated back-propagation through time carries to the next segment."""
    return _map_states(state, "detach")


def clone_state(state):
    """``state`` (one backend's, or a stack's list of them; None) with the same numbers in memory
    of its own: a copy to keep while a step that updates states in place runs on."""
    return _map_states(state, "clone")


def state_nbytes(state) -> int:
    """Bytes held by a recurrent state (one backend's, or a stack's list of them, as
    ``Transformer.step`` returns; None holds none): the sum of the states' ``nbytes``. Shows that
    the linear state is constant in size while the softmax cache grows with every position."""
    if state is None:
        return 0
    if _is_container(state):
        return sum(state_nbytes(s) for s in state)
    check_state(state, "state_nbytes")
    return int(state.nbytes)


class StackState(list):
    """A layer stack's state: a list with one backend state per layer, as ``Transformer.step`` and
    ``Transformer.forward(..., return_state=True)`` return it (index, iterate and ``len`` it as a
    list). It meets :class:`AttentionState` as a whole, like the states it holds: :meth:`detach`,
    :meth:`clone` and :attr:`nbytes` apply the contract layer by layer.

    Copies, pickles and saves as the list of its layers' states; ``torch.load(...,
    weights_only=True)`` reads it back (the class is a registered safe global).
    """

    def detach(self) -> StackState:
        """Every layer's state cut from the autograd graph (sharing memory, as each state's ``detach``)."""
        return StackState(detach_state(s) for s in self)

    def clone(self) -> StackState:
        """Every layer's state in memory of its own."""
        return StackState(clone_state(s) for s in self)

    @property
    def nbytes(self) -> int:
        """The bytes of all layers' states."""
        return sum(state_nbytes(s) for s in self)

    def __reduce__(self):
        # rebuilt by a call on a plain list: the safe loader appends only to plain lists
        return (StackState, (list(self),))

    def __repr__(self) -> str:
        return f"StackState({list.__repr__(self)})"


# a saved stack state loads with torch.load(..., weights_only=True): the class is all it adds to its layers' states
torch.serialization.add_safe_globals([StackState])
