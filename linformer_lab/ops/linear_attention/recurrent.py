"""RNN mode of linear attention (paper §3.4, eq. 16-20): a fixed-size state, one position per call."""

from __future__ import annotations

import weakref

import torch

from linformer_lab.ops.state import LinearState


class StateOwner:
    """The :class:`LinearState` buffers one in-place stepper made itself (held weakly): it may update
    those in place, and no other. A state from anywhere else (a prefill, a caller's) is a value it
    leaves as it was: :meth:`take` gives it a copy of its own first. The generation loop's fast step
    (``linformer_lab.models.generation.fast_step``) keeps one."""

    def __init__(self):
        self._buffers = weakref.WeakValueDictionary()  # id -> buffer (tensors compare by value, not identity)

    def adopt(self, out, state: LinearState):
        """``(out, state)`` as given, with ``state`` (just made, held by no one else) now owned."""
        self._buffers[id(state.joint)] = state.joint
        return out, state

    def owns(self, state) -> bool:
        return isinstance(state, LinearState) and self._buffers.get(id(state.joint)) is state.joint

    def take(self, states):
        """A stack's ``states`` (a list; None) with every :class:`LinearState` this owner did not make
        replaced by an owned copy (the list itself too, then); other states as they are."""
        if states is None or not any(isinstance(s, LinearState) and not self.owns(s) for s in states):
            return states
        return [self.adopt(None, s.clone())[1] if isinstance(s, LinearState) and not self.owns(s) else s for s in states]


def new_linear_state(batch: int, heads: int, feature_dim: int, value_dim: int, device, dtype=torch.float32):
    """Empty RNN state (eq. 16-17): S ``(B, H, C, M)`` = 0, Z ``(B, H, C)`` = 0, returned as
    a :class:`LinearState` (a tuple ``(S, Z)``; both live in one zeroed buffer)."""
    return LinearState(torch.zeros(batch, heads, feature_dim, value_dim + 1, device=device, dtype=dtype))


def check_step_fits_state(phi_k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """Raise a ValueError unless a step's ``phi_k (B, H, C)`` and ``v (B, H, M)`` fit the state
    ``S (B, H, C, M)``, ``Z (B, H, C)``: the in-place updates would broadcast a misfit silently."""
    if phi_k.shape != z.shape or v.shape[-1] != s.shape[-1]:
        raise ValueError(
            f"linear_attention_step: phi_k {tuple(phi_k.shape)} and v {tuple(v.shape)} do not fit the state "
            f"S {tuple(s.shape)}, Z {tuple(z.shape)} (batch, heads, feature dim, value dim must match the "
            f"sequence's first step)"
        )


def linear_attention_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                          eps: float = 1e-6) -> tuple[torch.Tensor, LinearState]:
    """One RNN step (eq. 18-20).

    Args: phi_q, phi_k ``(B, H, C)``, v ``(B, H, M)``, state ``(S (B, H, C, M), Z (B, H, C))``
    in fp32 (fp64 for fp64 inputs), e.g. from :func:`new_linear_state`. Returns
    ``(out (B, H, M), state)`` with ``out`` in the state's dtype and the state after this
    position a new :class:`LinearState` (the given one is left as it was; gradients flow through
    time). The update is one product into a new buffer, ``[S | Z] + phi(k) [v | 1]^T``, and the
    numerator and the normaliser of eq. 20 come out of one product ``phi(q)^T [S | Z]``.
    """
    s, z = state
    check_step_fits_state(phi_k, v, s, z)
    compute = s.dtype
    phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
    joint = getattr(state, "joint", None)
    if joint is None:  # (S, Z) built by hand: separate tensors
        joint = torch.cat([s, z.unsqueeze(-1)], dim=-1)
    # the state's precision under autocast too (a product in bf16/fp16 would round the sums)
    with torch.autocast(joint.device.type, enabled=False):
        joint = torch.addcmul(joint, phi_k.unsqueeze(-1), torch.nn.functional.pad(v, (0, 1), value=1.0).unsqueeze(-2))
        both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)  # (B, H, M + 1) = [phi(q)^T S | phi(q)^T Z]
    m = s.shape[-1]
    return both[..., :m] / (both[..., m:] + eps), LinearState(joint)
