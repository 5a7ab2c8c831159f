"""RNN mode of linear attention (paper §3.4, eq. 16-20): a fixed-size state, one position per call."""

from __future__ import annotations

import torch


class LinearState(tuple):
    """The RNN state ``(S (B, H, C, M), Z (B, H, C))`` of eq. 16-19, as made by
    :func:`new_linear_state`: a plain 2-tuple to every reader, whose two members are views of
    one ``(B, H, C, M + 1)`` buffer, ``joint = [S | Z]`` (Z is the last column).

    With that layout one matmul ``phi(q)^T [S | Z]`` gives the numerator and the normaliser
    of eq. 20 together. The bytes are those of S and Z alone.

    Meets the attention-state contract (:class:`~linformer_lab.ops.state.AttentionState`):
    :meth:`detach` and :attr:`nbytes`.
    """

    joint: torch.Tensor

    def __new__(cls, joint: torch.Tensor):
        m = joint.shape[-1] - 1
        self = super().__new__(cls, (joint[..., :m], joint[..., m]))
        self.joint = joint
        return self

    def detach(self) -> LinearState:
        """The same ``[S | Z]`` buffer cut from the autograd graph (shares its memory)."""
        return LinearState(self.joint.detach())

    @property
    def nbytes(self) -> int:
        """Bytes of S and Z: fixed by (B, H, C, M), whatever the sequence length."""
        return self.joint.nbytes


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


def linear_attention_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    eps: float = 1e-6,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One RNN step (eq. 18-20).

    Args: phi_q, phi_k ``(B, H, C)``, v ``(B, H, M)``, state ``(S (B, H, C, M), Z (B, H, C))``
    in fp32 (fp64 for fp64 inputs), e.g. from :func:`new_linear_state`. Returns
    ``(out (B, H, M), state)`` with ``out`` in the state's dtype.

    Without autograd the state is updated in place (no allocation per step beyond the output);
    with autograd enabled a new :class:`LinearState` is returned so gradients can flow through
    time. For a :class:`LinearState` the numerator and the normaliser of eq. 20 come out of one
    product ``phi(q)^T [S | Z]``.
    """
    s, z = state
    check_step_fits_state(phi_k, v, s, z)
    compute = s.dtype
    phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
    if torch.is_grad_enabled() and (phi_q.requires_grad or phi_k.requires_grad or v.requires_grad or s.requires_grad):
        # out of place, so gradients flow through time; the new state keeps the [S | Z] layout:
        # [S + phi(k) v^T | Z + phi(k)] = [S | Z] + phi(k) [v | 1]^T
        joint = getattr(state, "joint", None)
        if joint is None:
            joint = torch.cat([s, z.unsqueeze(-1)], dim=-1)
        joint = joint + phi_k.unsqueeze(-1) * torch.nn.functional.pad(v, (0, 1), value=1.0).unsqueeze(-2)
        state = LinearState(joint)
        s, z = state
        numerator = (phi_q.unsqueeze(-2) @ s).squeeze(-2)
        denominator = (phi_q * z).sum(-1, keepdim=True) + eps
        return numerator / denominator, state
    s.addcmul_(phi_k.unsqueeze(-1), v.unsqueeze(-2))  # S += phi(k) v^T, in place
    z.add_(phi_k)
    joint = getattr(state, "joint", None)
    if joint is None:  # a state built elsewhere: S and Z are separate tensors
        numerator = (phi_q.unsqueeze(-2) @ s).squeeze(-2)
        denominator = (phi_q * z).sum(-1, keepdim=True) + eps
        return numerator / denominator, state
    # the product with the fp32 state stays in fp32 under autocast (it would round to bf16/fp16)
    with torch.autocast(joint.device.type, enabled=False):
        both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)  # (B, H, M + 1) = [phi(q)^T S | phi(q)^T Z]
    m = s.shape[-1]
    return both[..., :m] / (both[..., m:] + eps), state
