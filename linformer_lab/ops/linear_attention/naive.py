"""Linear attention written as the paper writes it, for reading and for tests.

Nothing here is fast or memory-efficient on purpose. Two independent forms:

* the similarity form (eq. 3, 4, 8, 9): build the full ``(N, L)`` matrix of
  ``sim(Q_i, K_j) = phi(Q_i)^T phi(K_j)``, mask it (future keys for eq. 8-9, padding), and
  normalise each row: ``V'_i = sum_j sim_ij V_j / sum_j sim_ij``;
* the recurrent form (eq. 10-12, the RNN of §3.4): walk t = 1..N keeping
  ``S_t = S_{t-1} + phi(K_t) V_t^T`` and ``Z_t = Z_{t-1} + phi(K_t)`` and read
  ``V'_t = phi(Q_t)^T S_t / phi(Q_t)^T Z_t``.

Called with float64 tensors they are the references of the fast paths in :mod:`.chunk` and
:mod:`.recurrent`; the two forms agree with each other too (a test checks it).
"""

from __future__ import annotations

import torch


def kernel_similarity(phi_q: torch.Tensor, phi_k: torch.Tensor) -> torch.Tensor:
    """phi(q)^T phi(k) for all pairs (eq. 4): ``(B, H, N, C), (B, H, L, C) -> (B, H, N, L)``."""
    return phi_q @ phi_k.transpose(-1, -2)


def attention_from_similarity(
    similarity: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_lengths: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Eq. 3 (non-causal) / eq. 8 (causal): V'_i = sum_j sim_ij V_j / (sum_j sim_ij + eps).

    Args:
        similarity: ``(B, H, N, L)`` non-negative weights sim(Q_i, K_j).
        v: ``(B, H, L, M)``.
        key_lengths: ``(B,)``; keys at positions >= length get weight 0.
        eps: added to the normaliser, as the linear backends do.
    Returns: ``(B, H, N, M)``.
    """
    n, l = similarity.shape[-2:]
    weights = similarity
    if causal:
        weights = weights * torch.ones(n, l, dtype=torch.bool, device=v.device).tril()
    if key_lengths is not None:
        visible = torch.arange(l, device=v.device) < key_lengths[:, None]  # (B, L)
        weights = weights * visible[:, None, None, :]
    return (weights @ v) / (weights.sum(-1, keepdim=True) + eps)


def causal_dot_product_naive(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Numerator of eq. 9: out_i = sum_{j <= i} (q_i^T k_j) v_j. ``(B,H,N,C),(B,H,N,C),(B,H,N,M)``."""
    n = phi_q.shape[-2]
    scores = kernel_similarity(phi_q, phi_k) * torch.ones(n, n, dtype=phi_q.dtype, device=phi_q.device).tril()
    return scores @ v


def causal_linear_attention_loop(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, eps: float = 0.0
) -> torch.Tensor:
    """Eq. 10-12 as a loop over positions: ``(B, H, N, C), (B, H, N, C), (B, H, N, M) -> (B, H, N, M)``."""
    b, h, n, c = phi_q.shape
    s = phi_q.new_zeros(b, h, c, v.shape[-1])  # S_0 = 0
    z = phi_q.new_zeros(b, h, c)  # Z_0 = 0
    outputs = []
    for t in range(n):
        s = s + phi_k[:, :, t, :, None] * v[:, :, t, None, :]  # S_t = S_{t-1} + phi(K_t) V_t^T
        z = z + phi_k[:, :, t]  # Z_t = Z_{t-1} + phi(K_t)
        numerator = (phi_q[:, :, t, None, :] @ s).squeeze(-2)  # phi(Q_t)^T S_t
        denominator = (phi_q[:, :, t] * z).sum(-1, keepdim=True) + eps  # phi(Q_t)^T Z_t
        outputs.append(numerator / denominator)
    return torch.stack(outputs, dim=2) if outputs else v.new_zeros(b, h, 0, v.shape[-1])
