"""A third-party attention backend for linformer_lab: causal linear attention with a decaying state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from linformer_lab.attention import Attention


class DecayState:
    """The recurrent state ``(S (B, H, D, M), Z (B, H, D))``: the decayed sums of phi(k) v^T and
    phi(k). Meets linformer_lab's attention-state contract: :meth:`detach`, :meth:`clone` and :attr:`nbytes`
    (a value: ``step`` returns a new state)."""

    def __init__(self, s: torch.Tensor, z: torch.Tensor):
        self.s, self.z = s, z

    def detach(self) -> DecayState:
        return DecayState(self.s.detach(), self.z.detach())

    def clone(self) -> DecayState:
        return DecayState(self.s.clone(), self.z.clone())

    @property
    def nbytes(self) -> int:
        return self.s.nbytes + self.z.nbytes


class DecayedLinearAttention(Attention):
    """out_i = sum_{j <= i} decay^(i-j) phi(q_i).phi(k_j) v_j / (sum_{j <= i} decay^(i-j) phi(q_i).phi(k_j) + eps),
    phi(x) = elu(x) + 1; computed in fp32 (fp64 for fp64 inputs)."""

    supports_state = True

    def __init__(self, causal: bool = True, query_dim: int | None = None, feature_map=None, decay: float = 0.9,
                 eps: float = 1e-6):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        if not causal:
            raise ValueError("decayed_linear attention is causal only (a decay runs forward in time): use causal=True")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1], got {decay}")
        self.decay, self.eps = float(decay), eps

    def forward(self, q, k, v, key_lengths=None, state: DecayState | None = None, return_state=False, cu_seqlens=None):
        self.check_inputs(q, k, v, key_lengths)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)  # no packed sequences here
        n = q.shape[2]
        if (state is not None or return_state) and key_lengths is not None and bool((key_lengths != n).any()):
            raise ValueError("decayed_linear: a state needs sequences of equal length (padding would decay it)")
        if state is not None and not isinstance(state, DecayState):
            raise TypeError(f"decayed_linear got a {type(state).__name__} state; it takes a DecayState or None")
        compute = torch.float64 if v.dtype == torch.float64 else torch.float32
        phi_q, phi_k, values = F.elu(q.to(compute)) + 1, F.elu(k.to(compute)) + 1, v.to(compute)
        if key_lengths is not None:  # padded keys add nothing
            valid = (torch.arange(n, device=q.device) < key_lengths[:, None])[:, None, :, None]
            phi_k, values = phi_k * valid, values * valid
        gaps = torch.arange(n, device=q.device, dtype=compute)
        gaps = gaps[:, None] - gaps[None, :]  # i - j
        weights = torch.where(gaps >= 0, self.decay ** gaps.clamp(min=0), 0.0)  # (N, N): decay^(i-j), causal
        scores = (phi_q @ phi_k.transpose(-1, -2)) * weights
        numerator, denominator = scores @ values, scores.sum(-1)
        if state is not None:  # the state before position 0 has decayed i + 1 times at position i
            carried = self.decay ** (gaps[:, :1] + 1)  # (N, 1)
            numerator = numerator + carried * (phi_q @ state.s)
            denominator = denominator + carried[:, 0] * (phi_q @ state.z.unsqueeze(-1)).squeeze(-1)
        out = (numerator / (denominator.unsqueeze(-1) + self.eps)).to(v.dtype)
        if not return_state:
            return out
        last = weights[-1][:, None]  # (N, 1): decay^(N-1-j)
        s, z = (phi_k * last).transpose(-1, -2) @ values, (phi_k * last).sum(-2)
        if state is not None:
            s, z = s + self.decay**n * state.s, z + self.decay**n * state.z
        return out, DecayState(s, z)

    def step(self, q_t, k_t, v_t, state: DecayState | None = None):
        if state is None:
            self.check_step_inputs(q_t, k_t, v_t)
            b, h, d = k_t.shape
            compute = torch.float64 if v_t.dtype == torch.float64 else torch.float32
            state = DecayState(q_t.new_zeros(b, h, d, v_t.shape[-1], dtype=compute), q_t.new_zeros(b, h, d, dtype=compute))
        elif not isinstance(state, DecayState):
            raise TypeError(f"decayed_linear got a {type(state).__name__} state; it takes a DecayState or None")
        compute = state.s.dtype
        phi_q, phi_k = F.elu(q_t.to(compute)) + 1, F.elu(k_t.to(compute)) + 1
        s = self.decay * state.s + phi_k.unsqueeze(-1) * v_t.to(compute).unsqueeze(-2)
        z = self.decay * state.z + phi_k
        numerator = (phi_q.unsqueeze(-2) @ s).squeeze(-2)
        denominator = (phi_q * z).sum(-1, keepdim=True) + self.eps
        return (numerator / denominator).to(v_t.dtype), DecayState(s, z)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, decay={self.decay}, eps={self.eps}"
