"""The attention-backend interface shared by every registered backend."""

from __future__ import annotations

import torch
from torch import nn

from linformer_lab.ops.masks import check_on_device
from linformer_lab.ops.state import KVCache, LinearState, SequenceBuffer, StackState
from linformer_lab.registry import ATTENTION

__all__ = ["Attention", "backends_with", "check_cu_seqlens", "check_key_lengths"]


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

    Every state (from ``forward`` and from ``step``) meets :class:`~linformer_lab.ops.state.AttentionState`
    (``detach()``, ``nbytes``), all the code around the backends uses; plain lists and tuples of
    states (a stack's per-layer states, a hand-made ``(S, Z)``) are walked member by member. A
    state of another backend's type is a TypeError naming both types (:meth:`check_state_type`).

    Packed variable-length sequences (backends with ``supports_packed``):
    ``forward(q, k, v, cu_seqlens=offsets)`` with ``q, k (1, H, T, D)``, ``v (1, H, T, M)``,
    the sequences concatenated along T, and ``cu_seqlens`` int64 ``(S + 1,)`` = ``[0, n_1,
    n_1 + n_2, ..., T]``: each sequence attends only within itself, as if run alone.

    ``step(q_t, k_t, v_t, state=None)``: RNN mode (paper §3.4), one position at a time:
    ``(B, H, D), (B, H, D), (B, H, M) -> ((B, H, M), state)``. ``state=None`` starts from the
    empty prefix; every call attends over everything fed so far, so the outputs equal the causal
    forward at the same positions (without a recurrent form, lsh: the causal forward over the
    same prefix, since later positions change lsh's chunks).
    """

    #: Backends that use a feature map (linear attention) set this.
    uses_feature_map: bool = False
    #: Backends whose keys are the queries (Reformer's shared-QK) set this; the multi-head
    #: module then has no key projection and passes ``k = q``.
    shares_query_key: bool = False
    #: False for backends whose output at position t depends on how *later* tokens are arranged
    #: (lsh: chunk membership): ``step`` recomputes over the prefix, and so must a stack of them.
    has_recurrent_form: bool = True
    #: Backends whose ``forward`` takes ``state=`` and ``return_state=`` set this.
    supports_state: bool = False
    #: Backends whose ``forward`` takes ``cu_seqlens=`` (packed sequences) set this.
    supports_packed: bool = False
    #: The type(s) of the state this backend's ``step`` (and ``forward``, with ``supports_state``)
    #: takes, and how :meth:`check_state_type`'s error says it.
    state_type: type | tuple[type, ...] = KVCache
    state_description: str = "a KVCache or None"

    def __init__(self, causal: bool = False, query_dim: int | None = None, feature_map=None):
        super().__init__()
        if feature_map is not None and not self.uses_feature_map:
            raise ValueError(
                f"attention backend {type(self).__name__} does not use a feature map, but "
                f"feature_map={repr(feature_map) if isinstance(feature_map, str) else type(feature_map).__name__} was "
                f"given. Feature maps apply to the backends that use one ({backends_with('uses_feature_map')}); leave "
                f"feature_map unset here."
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

    def check_state_type(self, state, method: str) -> None:
        """A TypeError naming ``state``'s type, the backend that makes it and what ``method``
        (``"step"``, ``"forward"``) takes, unless ``state`` is None or a :attr:`state_type`."""
        if state is not None and not isinstance(state, self.state_type):
            made_by = _MADE_BY.get(type(state), type(state).__module__)
            raise TypeError(f"{type(self).__name__}.{method} got a {type(state).__qualname__} state (from {made_by}?); "
                            f"it takes {self.state_description}")

    def with_prefix(self, state: KVCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV-cache forward's keys ``(B, H, T + L, D)`` and values ``(B, H, T + L, M)``: the
        cached prefix ``state`` (T positions) followed by the new ``k (B, H, L, D)`` and
        ``v (B, H, L, M)``, after checking that ``state`` is a KVCache of matching B, H, D, M."""
        self.check_state_type(state, "forward")
        if state.keys.shape[:2] != k.shape[:2] or state.keys.shape[-1] != k.shape[-1] \
                or state.values.shape[-1] != v.shape[-1]:
            raise ValueError(f"{type(self).__name__}: state must be the KVCache of keys (B, H, T, {k.shape[-1]}) and "
                             f"values (B, H, T, {v.shape[-1]}) with B, H = {tuple(k.shape[:2])}, as returned by "
                             f"forward or step; got keys {tuple(state.keys.shape)}, values {tuple(state.values.shape)}")
        return torch.cat([state.keys, k], dim=2), torch.cat([state.values, v], dim=2)

    def appended_cache(self, q_t, k_t, v_t, state: KVCache | None, key_t=None) -> KVCache:
        """A KV-cache step's new cache: ``state`` with ``(key_t, v_t)`` appended (``key_t``: ``k_t``
        unless given; lsh caches its queries), ``state`` unchanged. The inputs are checked in full
        on a sequence's first step only (``state`` None; see LinearAttention.step)."""
        key_t = k_t if key_t is None else key_t
        self.check_state_type(state, "step")
        if state is None:
            self.check_step_inputs(q_t, k_t, v_t)
            state = KVCache(key_t, v_t)
        return state.appended(key_t, v_t)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, query_dim={self.query_dim}"


def check_key_lengths(key_lengths: torch.Tensor, batch: int, seq: int, device, who: str) -> None:
    if not isinstance(key_lengths, torch.Tensor) or key_lengths.shape != (batch,) or key_lengths.is_floating_point() \
            or key_lengths.is_complex():
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
    ValueError saying what is wrong (``keys``: the keys' length, which must equal the queries' ``total``;
    ``device``: where they must be, for a caller that computes with them there)."""
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
    """The registered backends whose class sets ``capability`` (``supports_state``, ...), quoted and
    comma-separated, for error messages; a plugin that fails to import is left out (``cli.py
    plugins --check`` reports it)."""
    return ", ".join(repr(name) for name, backend in ATTENTION.loadable() if getattr(backend, capability, False))


#: The backends that make each built-in state type, for :meth:`Attention.check_state_type`.
_MADE_BY = {
    LinearState: "linear attention",
    tuple: "linear attention",
    KVCache: "softmax or lsh attention",
    SequenceBuffer: "a Transformer over lsh, whose state is its input prefix",
    StackState: "a Transformer, whose state is a StackState of per-layer states",
    list: "a Transformer, whose state is a list of per-layer states",
}

