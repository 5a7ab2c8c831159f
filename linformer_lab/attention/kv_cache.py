"""The states that grow with the sequence: :class:`SequenceBuffer` (a tensor growing along one
axis, as a value) and :class:`KVCache` (softmax's and lsh's keys and values of the prefix), both
saved, pickled and copied as their filled positions alone."""

from __future__ import annotations

import torch

__all__ = ["KVCache", "SequenceBuffer"]


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

    The state of every backend whose state grows with the sequence is made of these: softmax's
    :class:`KVCache` (stateful softmax, paper §C.1), lsh's prefix, and the input prefix that a
    stack without a recurrent form re-runs (``Transformer.step``). :meth:`detach` shares memory,
    :meth:`clone` copies; ``copy``, ``pickle`` and ``torch.save`` / ``torch.load(...,
    weights_only=True)`` keep the filled positions (the class is a registered safe global).
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

    @classmethod
    def _holding(cls, store: _Storage, dim: int, length: int) -> SequenceBuffer:
        self = cls.__new__(cls)
        self._store, self.dim, self.length = store, dim, length
        data = store.data
        self._position_shape = data.shape[:dim] + data.shape[dim + 1 :]
        return self

    @classmethod
    def from_tensor(cls, x: torch.Tensor, dim: int, spare: int = 256) -> SequenceBuffer:
        """A buffer already holding the ``x.shape[dim]`` positions of ``x`` (a parallel forward's
        keys, say). Under autograd ``x`` itself is the storage, so gradients flow back into it
        (never written: it has no spare room); otherwise it is copied into storage with room
        for ``spare`` more positions."""
        length = x.shape[dim]
        if torch.is_grad_enabled() and x.requires_grad:
            return cls._holding(_Storage(x, length), dim, length)
        shape = list(x.shape)
        shape[dim] += spare
        data = x.new_empty(shape)
        data.narrow(dim, 0, length).copy_(x)
        return cls._holding(_Storage(data, length), dim, length)

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
            return SequenceBuffer._holding(_Storage(data, length + 1), dim, length + 1)
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
        """The filled positions cut from the autograd graph; shares their memory."""
        if not self._store.data.requires_grad:
            return self
        data = self.filled.detach()  # no spare room: an append copies instead of writing into it
        return SequenceBuffer._holding(_Storage(data, self.length), self.dim, self.length)

    def clone(self) -> SequenceBuffer:
        """The filled positions in storage of their own, exactly their size (under autograd, a
        differentiable copy); the first append copies them into storage with room to grow."""
        data = self.filled.clone(memory_format=torch.contiguous_format)
        return SequenceBuffer._holding(_Storage(data, self.length), self.dim, self.length)

    def __getstate__(self) -> dict:
        # the filled positions alone: saving (or deep-copying) the view would write the whole shared
        # storage, spare room and positions that longer buffers appended after this one included
        return {"filled": _own_storage(self.filled), "dim": self.dim}

    def __setstate__(self, state: dict) -> None:
        data, dim = state["filled"], state["dim"]
        # the tensor as it came (a shallow copy's is the original's view): no spare room, so it
        # is never written; the first append copies
        self._store, self.dim, self.length = _Storage(data, data.shape[dim]), dim, data.shape[dim]
        self._position_shape = data.shape[:dim] + data.shape[dim + 1 :]

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

    A value: :meth:`appended` returns a new cache (amortised O(1), see :class:`SequenceBuffer`)
    and leaves this one as it was. :meth:`detach` shares memory, :meth:`clone` copies; ``copy``,
    ``pickle`` and ``torch.save`` / ``torch.load(..., weights_only=True)`` keep the filled keys,
    values and ``valid``.
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
        """The same keys, values and ``valid`` mask cut from the autograd graph; shares their memory."""
        return KVCache._of(self._keys.detach(), self._values.detach(), self._valid)

    def clone(self) -> KVCache:
        """The same keys, values and ``valid`` mask in memory of their own."""
        valid = None if self._valid is None else self._valid.clone()
        return KVCache._of(self._keys.clone(), self._values.clone(), valid)

    def __getstate__(self) -> dict:
        valid = self.valid
        return {"keys": _own_storage(self.keys), "values": _own_storage(self.values),
                "valid": None if valid is None else _own_storage(valid)}

    def __setstate__(self, state: dict) -> None:
        valid = state["valid"]
        self._keys = SequenceBuffer.__new__(SequenceBuffer)
        self._keys.__setstate__({"filled": state["keys"], "dim": 2})
        self._values = SequenceBuffer.__new__(SequenceBuffer)
        self._values.__setstate__({"filled": state["values"], "dim": 2})
        self._valid = None
        if valid is not None:
            self._valid = SequenceBuffer.__new__(SequenceBuffer)
            self._valid.__setstate__({"filled": valid, "dim": 1})

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (spare capacity not counted): grows by one
        position per step."""
        return self._keys.nbytes + self._values.nbytes


# a saved state loads with torch.load(..., weights_only=True): the classes are all it needs beyond tensors
torch.serialization.add_safe_globals([SequenceBuffer, KVCache])
