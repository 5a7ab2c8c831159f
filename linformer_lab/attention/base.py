"""The attention-backend interface shared by every registered backend."""

from __future__ import annotations

import torch
from torch import nn

from linformer_lab.ops.linear_attention.recurrent import LinearState
from linformer_lab.ops.masks import check_on_device
from linformer_lab.ops.state import AttentionState, check_state
from linformer_lab.registry import ATTENTION, PluginError

__all__ = [
    "Attention",
    "AttentionState",
    "KVCache",
    "SequenceBuffer",
    "check_cu_seqlens",
    "check_key_lengths",
    "check_state",
    "state_type_error",
]


class Attention(nn.Module):
    """Base class of attention backends (registered under ``linformer_lab.attention``).

    Built as ``Cls(causal=..., query_dim=D, feature_map=..., **kwargs)``.

    ``forward(q, k, v, key_lengths=None)``: q ``(B, H, N, D)``, k ``(B, H, L, D)``, v ``(B, H, L, M)``
    -> ``(B, H, N, M)``; keys at positions >= ``key_lengths[b]`` are ignored. Self attention has
    L = N: outputs at query positions >= ``key_lengths[b]`` are padding (softmax and linear still
    attend from them, lsh returns zeros there; mask them out downstream). Cross attention (queries
    from one sequence, keys and values from another, L != N) is non-causal only, and not for
    shared-QK backends (lsh); ``check_inputs`` says so in one line.

    State in and out of the parallel form (backends with ``supports_state``):
    ``forward(q, k, v, key_lengths=None, state=None, return_state=False)``. ``state`` is what an
    earlier forward returned or what ``step`` built: the new positions attend to it as to
    keys that came before them. With ``return_state`` the result is ``(out, state)``, the state
    after the last position, which ``step`` and another ``forward`` continue from; keys at
    positions >= ``key_lengths`` do not enter it. Causal linear: ``(S, Z)``; softmax: a
    :class:`KVCache`; lsh: the :class:`KVCache` of its prefix.

    Every state (from ``forward`` and from ``step``) meets :class:`AttentionState`: it has
    ``detach()`` (the same state cut from the autograd graph) and ``nbytes`` (the bytes it
    holds), which is all the code around the backends uses (segmented training with a detached
    state, state-size reports). A tensor meets it as it is; plain lists and tuples of states (a
    stack's per-layer states, a hand-made ``(S, Z)``) are walked member by member. A state of
    another backend's type given to ``step`` or ``forward`` is a TypeError naming both types
    (:func:`state_type_error`).

    Packed variable-length sequences (backends with ``supports_packed``):
    ``forward(q, k, v, cu_seqlens=offsets)`` with ``q, k (1, H, T, D)``, ``v (1, H, T, M)``,
    the sequences concatenated along T, and ``cu_seqlens`` int64 ``(S + 1,)`` = ``[0, n_1,
    n_1 + n_2, ..., T]``: each sequence attends only within itself, as if run alone.

    ``step(q_t, k_t, v_t, state=None)``: RNN mode (paper §3.4), one position at a time:
    ``(B, H, D), (B, H, D), (B, H, M) -> ((B, H, M), state)``. ``state=None`` starts from the
    empty prefix; every call attends over everything fed so far, so the outputs equal the
    causal forward at the same positions.
    """

    #: Backends that use a feature map (linear attention) set this.
    uses_feature_map: bool = False
    #: Backends whose keys are the queries (Reformer's shared-QK) set this; the multi-head
    #: module then has no key projection and passes ``k = q``.
    shares_query_key: bool = False
    #: False for backends whose output at position t depends on how *later* tokens are
    #: arranged (lsh: chunk membership). Their ``step`` recomputes the attention over the
    #: prefix, and a model stacking them must recompute all layers over the prefix too.
    has_recurrent_form: bool = True
    #: Backends whose ``forward`` takes ``state=`` and ``return_state=`` set this.
    supports_state: bool = False
    #: Backends whose ``forward`` takes ``cu_seqlens=`` (packed sequences) set this.
    supports_packed: bool = False

    def __init__(self, causal: bool = False, query_dim: int | None = None, feature_map=None):
        super().__init__()
        if feature_map is not None and not self.uses_feature_map:
            raise ValueError(
                f"attention backend {type(self).__name__} does not use a feature map, but "
                f"feature_map={_describe(feature_map)} was given. Feature maps apply to the "
                f"backends that use one ({backends_with('uses_feature_map')}); leave feature_map unset here."
            )
        self.causal = bool(causal)
        self.query_dim = query_dim

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths=None) -> None:
        """Raise a ValueError that states what was expected for any mismatch."""
        name = type(self).__name__
        for label, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: {label} must be a 4-d tensor (batch, heads, seq, dim), got {shape}")
        if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{name}: q (batch, heads, N, dim) and k (batch, heads, L, dim) must share batch, heads and dim; got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"{name}: v must be (batch, heads, L, value_dim) with batch, heads, L = {tuple(k.shape[:3])} "
                f"like k; got {tuple(v.shape)}"
            )
        if q.shape[2] != k.shape[2]:
            self.check_cross_attention(q.shape[2], k.shape[2])
        if self.query_dim is not None and q.shape[-1] != self.query_dim:
            raise ValueError(f"{name}: built for query_dim={self.query_dim}, got q of shape {tuple(q.shape)}")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"{name}: q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if not q.is_floating_point():
            raise ValueError(f"{name}: expected floating-point q, k, v; got {q.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"{name}: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
        if key_lengths is not None:
            check_key_lengths(key_lengths, batch=q.shape[0], seq=k.shape[2], device=q.device, who=name)

    def check_cross_attention(self, queries: int, keys: int) -> None:
        """Raise a one-line ValueError where this backend cannot attend from ``queries`` positions to
        a different number of ``keys`` (cross attention): causal, or keys shared with the queries."""
        name = type(self).__name__
        if self.shares_query_key:
            raise ValueError(
                f"{name}: its keys are its queries (shares_query_key), so it cannot attend from N = {queries} queries "
                f"to L = {keys} other keys; cross attention takes a backend with separate keys ('linear', 'softmax')"
            )
        if self.causal:
            raise ValueError(
                f"{name}: causal attention needs as many keys as queries (query i sees keys 0..i); got N = {queries} "
                f"queries and L = {keys} keys. Cross attention is non-causal: build the backend with causal=False"
            )

    def check_state_request(self, state, return_state: bool, cu_seqlens=None, key_lengths=None) -> None:
        """Raise a clear error if this backend is asked for something it does not support."""
        name = type(self).__name__
        if (state is not None or return_state) and not self.supports_state:
            raise ValueError(
                f"attention backend {name} does not take or return a state in its parallel forward "
                f"(supports_state = False); these installed backends do: {backends_with('supports_state')}"
            )
        if cu_seqlens is not None:
            if not self.supports_packed:
                raise ValueError(
                    f"attention backend {name} does not take packed sequences (cu_seqlens; supports_packed = False); "
                    f"these installed backends do: {backends_with('supports_packed')}. Pad the batch and pass "
                    f"key_lengths instead"
                )
            if key_lengths is not None:
                raise ValueError(f"{name}: give either cu_seqlens (packed) or key_lengths (padded), not both")

    def check_step_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        name = type(self).__name__
        for label, t in (("q_t", q), ("k_t", k), ("v_t", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}.step: {label} must be a 3-d tensor (batch, heads, dim), got {shape}")
        self.check_inputs(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))

    def extra_repr(self) -> str:
        return f"causal={self.causal}, query_dim={self.query_dim}"


def check_key_lengths(key_lengths: torch.Tensor, batch: int, seq: int, device, who: str) -> None:
    if not isinstance(key_lengths, torch.Tensor) or key_lengths.shape != (batch,) or key_lengths.is_floating_point():
        if isinstance(key_lengths, torch.Tensor):
            got = f"{key_lengths.dtype} tensor of shape {tuple(key_lengths.shape)}"
        else:
            got = type(key_lengths).__name__
        raise ValueError(f"{who}: key_lengths must be an integer tensor of shape ({batch},), got {got}")
    if key_lengths.device != device:
        raise ValueError(f"{who}: key_lengths is on {key_lengths.device} but q, k, v are on {device}")
    check_on_device(((key_lengths >= 1) & (key_lengths <= seq)).all(), f"{who}: key_lengths must lie in [1, {seq}] "
                    "(the sequence length)", lambda: f"got values in [{int(key_lengths.min())}, {int(key_lengths.max())}]")


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, batch: int, who: str, keys: int | None = None,
                     read: bool = True, device=None) -> list[int] | None:
    """The offsets of packed sequences as a Python list (``read=False``: None, nothing read on the host), or a
    ValueError saying what is wrong (``keys``: the keys' length, which packed sequences share with the queries' ``total``;
    ``device``: where they must be, the inputs' device for a caller that computes with them there)."""
    if keys is not None and keys != total:
        raise ValueError(f"{who}: packed sequences (cu_seqlens) attend within themselves, so q and k must have one "
                         f"length; got {total} queries and {keys} keys. Pad the batch and pass key_lengths instead")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.numel() < 2:
        raise ValueError(f"{who}: cu_seqlens must be a 1-d integer tensor [0, n_1, n_1 + n_2, ..., T] of at least "
                         f"2 offsets, got {cu_seqlens!r}")
    if batch != 1:
        raise ValueError(f"{who}: packed sequences are one row: q, k, v must be (1, heads, T, dim), got batch {batch}")
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"{who}: cu_seqlens is on {cu_seqlens.device} but q, k, v are on {device}")
    rising = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (cu_seqlens[1:] > cu_seqlens[:-1]).all()
    check_on_device(rising, f"{who}: cu_seqlens must rise strictly from 0 to T = {total} (no empty sequence)",
                    lambda: f"got {cu_seqlens.tolist()}")
    return cu_seqlens.tolist() if read else None


def backends_with(capability: str) -> str:
    """The registered backends whose class sets ``capability`` (``uses_feature_map``,
    ``supports_state``, ``supports_packed``, ``has_recurrent_form``), quoted and comma-separated,
    for error messages that list the valid choices; a plugin that fails to import is left out
    (``cli.py plugins --check`` reports it)."""
    names = []
    for name in ATTENTION.names():
        try:
            backend = ATTENTION.get(name)
        except PluginError:
            continue
        if getattr(backend, capability, False):
            names.append(name)
    return ", ".join(map(repr, names))


def _describe(feature_map) -> str:
    return repr(feature_map) if isinstance(feature_map, str) else type(feature_map).__name__


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
        """The filled positions in storage of their own (under autograd, a differentiable copy)."""
        x = self.filled
        return SequenceBuffer.from_tensor(x.clone() if torch.is_grad_enabled() and x.requires_grad else x, self.dim)

    def __getstate__(self) -> dict:
        return {"filled": self.filled, "dim": self.dim}

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
        return {"keys": self.keys, "values": self.values, "valid": self.valid}

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


#: The backends that make each built-in state type, for :func:`state_type_error`.
_MADE_BY = {
    LinearState: "linear attention",
    tuple: "linear attention",
    KVCache: "softmax or lsh attention",
    SequenceBuffer: "a Transformer over lsh, whose state is its input prefix",
    list: "a Transformer, whose state is a list of per-layer states",
}


def state_type_error(who: str, state, takes: str) -> TypeError:
    """The error for a state of the wrong type given to ``who`` (a backend's ``step`` or
    ``forward``), naming the type it got, the backend that makes that type, and what it takes."""
    cls = type(state)
    made_by = _MADE_BY.get(cls, cls.__module__)
    return TypeError(f"{who} got a {cls.__qualname__} state (from {made_by}?); it takes {takes}")
