"""Linear attention (paper §3.2-3.4) as pure functions on feature-mapped tensors.

Shapes follow ``scaled_dot_product_attention``: ``phi_q, phi_k (B, H, N, C)`` (C = the
feature map's output dim), ``v (B, H, N, M)``.

Causal attention is computed chunk-wise. Split the sequence into chunks of L positions;
for a query i in chunk c,

    sum_{j <= i} (q_i . k_j) v_j  =  q_i^T S_{c-1}  +  sum_{j in c, j <= i} (q_i . k_j) v_j

where S_{c-1} = sum over all earlier chunks of k_j v_j^T is the RNN state of eq. 10 at the
chunk boundary. The second term is an (L x L) masked matrix product inside the chunk. Both
are matmuls, so there is no loop over time steps at all: the per-chunk states come from one
cumulative sum over chunks. Chunk states are (N / L) x C x M, which is O(N max(C, M)) because
L >= min(C, M); the (N, C, M) tensor of per-step states is never formed. The backward pass is
eq. 13-15 organised the same way: grad Q uses the forward prefix states S, grad K and grad V
use the suffix states R_i = sum_{j >= i} q_j g_j^T (the backward scan of Algorithm 1).
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs are accumulated in fp32 (states and normaliser); fp32/fp64 as is."""
    return torch.float32 if dtype in _HALF else dtype


def default_chunk_size(feature_dim: int, value_dim: int) -> int:
    """Chunk length: at least min(C, M) so chunk states stay O(N max(C, M)), at least 32 so
    matmuls are not tiny, at most 256 so intra-chunk work stays small. Measured on 2 CPU cores
    (benchmarks/results/causal_linear_cpu.md): C = M = 32 is fastest at 32, C = M = 64 at 64."""
    return max(32, min(256, min(feature_dim, value_dim)))


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(B, H, N, X) -> (B, H, N/L, L, X)``, zero-padding N up to a multiple of L. Zero keys
    and values add nothing to any state; outputs of zero queries are cut off afterwards."""
    b, h, n, d = x.shape
    pad = (-n) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, (n + pad) // chunk, chunk, d)


def _exclusive_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Along dim 2 (chunks): the sum of the entries strictly before each chunk (or strictly
    after, with ``reverse``). ``(B, H, n, C, M) -> (B, H, n, C, M)``.

    A loop over chunks (not time steps) with one fused add each: measured 2.5x faster on
    CPU than ``torch.cumsum`` along a non-innermost dim followed by a shift.
    """
    out = torch.empty_like(x)
    n = x.shape[2]
    order = range(n - 1, -1, -1) if reverse else range(n)
    previous = None
    for i in order:
        if previous is None:
            out[:, :, i].zero_()
        else:
            torch.add(out[:, :, previous], x[:, :, previous], out=out[:, :, i])
        previous = i
    return out


class CausalDotProduct(torch.autograd.Function):
    """Numerator of eq. 9 with the constant-memory backward of eq. 13-15.

    Saved for backward: the inputs and the (N / L, C, M) chunk-boundary states, never the
    per-step states.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None):
        # Autocast would run the matmuls below in bf16/fp16 and save a half-precision state;
        # we accumulate in fp32 ourselves, so autocast is off in both passes.
        with torch.autocast(q.device.type, enabled=False):
            return CausalDotProduct._forward(ctx, q, k, v, chunk_size)

    @staticmethod
    def _forward(ctx, q, k, v, chunk_size):
        chunk = chunk_size or default_chunk_size(q.shape[-1], v.shape[-1])
        ctx.chunk = chunk
        n = q.shape[-2]
        compute = _compute_dtype(q.dtype)
        qc, kc, vc = (_chunked(t.to(compute), chunk) for t in (q, k, v))
        mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        # S before each chunk (eq. 10 at chunk boundaries): (B, H, n, C, M). Kept for the
        # backward pass: it is (N / L) C M <= N max(C, M) numbers and saves recomputing it.
        prefix = _exclusive_cumsum(kc.transpose(-1, -2) @ vc)
        out = qc @ prefix
        out += (qc @ kc.transpose(-1, -2)).masked_fill_(~mask, 0) @ vc
        ctx.save_for_backward(q, k, v, prefix)
        return out.flatten(2, 3)[:, :, :n].to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            return CausalDotProduct._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, prefix = ctx.saved_tensors
        chunk, n = ctx.chunk, q.shape[-2]
        compute = _compute_dtype(q.dtype)
        qc, kc, vc, gc = (_chunked(t.to(compute), chunk) for t in (q, k, v, grad_out))
        mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
        # eq. 13: grad Q_i = sum_{j <= i} (g_i . v_j) k_j = g_i S_i^T
        gv_scores = (gc @ vc.transpose(-1, -2)).masked_fill_(~mask, 0)  # [i, j] = g_i . v_j, j <= i
        grad_q = gc @ prefix.transpose(-1, -2)
        grad_q += gv_scores @ kc
        # eq. 14-15 with R = sum_{j >= i} q_j g_j^T: grad K_i = R_i v_i, grad V_i = R_i^T k_i
        suffix = _exclusive_cumsum(qc.transpose(-1, -2) @ gc, reverse=True)  # (B, H, n, C, M)
        grad_k = vc @ suffix.transpose(-1, -2)
        grad_k += gv_scores.transpose(-1, -2) @ qc
        grad_v = kc @ suffix
        del suffix
        qk_scores = (qc @ kc.transpose(-1, -2)).masked_fill_(~mask, 0)  # [j, i] = q_j . k_i, i <= j
        grad_v += qk_scores.transpose(-1, -2) @ gc

        def finish(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            return g.flatten(2, 3)[:, :, :n].to(like.dtype)

        return finish(grad_q, q), finish(grad_k, k), finish(grad_v, v), None


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """out_i = sum_{j <= i} (q_i . k_j) v_j: ``(B,H,N,C), (B,H,N,C), (B,H,N,M) -> (B,H,N,M)``."""
    return CausalDotProduct.apply(q, k, v, chunk_size)


def _mask_keys(phi_k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None):
    """Zero keys and values at positions >= key_lengths so they add nothing to any sum."""
    if key_lengths is None:
        return phi_k, v
    valid = torch.arange(phi_k.shape[-2], device=phi_k.device) < key_lengths[:, None]  # (B, N)
    valid = valid[:, None, :, None]
    return phi_k * valid, v * valid


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Non-causal linear attention by associativity (eq. 5-6): phi(Q) (phi(K)^T V) / phi(Q) z.

    Args: phi_q ``(B, H, N, C)``, phi_k ``(B, H, L, C)``, v ``(B, H, L, M)``, key_lengths ``(B,)``.
    Returns ``(B, H, N, M)``. Cost O(N C M); the ``(C, M)`` key-value summary and the
    normaliser are accumulated in fp32 for half inputs.
    """
    compute, out_dtype = _compute_dtype(phi_q.dtype), v.dtype
    with torch.autocast(phi_q.device.type, enabled=False):  # keep the fp32 accumulation under autocast
        phi_k, v = _mask_keys(phi_k, v, key_lengths)
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
        kv = phi_k.transpose(-1, -2) @ v  # (B, H, C, M)
        z = phi_k.sum(dim=-2)  # (B, H, C)
        denominator = (phi_q @ z.unsqueeze(-1)) + eps  # (B, H, N, 1)
        return ((phi_q @ kv) / denominator).to(out_dtype)


def causal_linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: torch.Tensor | None = None,
    eps: float = 1e-6,
    dot_product=causal_dot_product,
) -> torch.Tensor:
    """Causal linear attention (eq. 9-12): V'_i = phi(Q_i)^T S_i / phi(Q_i)^T Z_i.

    Args: phi_q, phi_k ``(B, H, N, C)``, v ``(B, H, N, M)``, key_lengths ``(B,)``;
    ``dot_product`` computes the numerator (the pure-PyTorch :func:`causal_dot_product` or
    the CUDA kernel's). Returns ``(B, H, N, M)`` in v's dtype.

    The normaliser Z_i = sum_{j <= i} phi(K_j) is a cumulative sum, O(N C) memory, in fp32.
    """
    if not (phi_q.dtype == phi_k.dtype == v.dtype):
        # under autocast the feature maps may return fp32 for half inputs: one dtype for the kernel
        phi_q, phi_k = phi_q.to(v.dtype), phi_k.to(v.dtype)
    phi_k, v = _mask_keys(phi_k, v, key_lengths)
    numerator = dot_product(phi_q, phi_k, v)
    compute = _compute_dtype(phi_q.dtype)
    with torch.autocast(phi_q.device.type, enabled=False):
        z = phi_k.to(compute).cumsum(dim=-2)  # (B, H, N, C)
        denominator = (phi_q.to(compute) * z).sum(dim=-1, keepdim=True) + eps
        return (numerator.to(compute) / denominator).to(v.dtype)


class LinearState(tuple):
    """The RNN state ``(S (B, H, C, M), Z (B, H, C))`` of eq. 16-19, as made by
    :func:`new_linear_state`: a plain 2-tuple to every reader, whose two members are views of
    one ``(B, H, C, M + 1)`` buffer, ``joint = [S | Z]`` (Z is the last column).

    With that layout one matmul ``phi(q)^T [S | Z]`` gives the numerator and the normaliser
    of eq. 20 together. The bytes are those of S and Z alone.
    """

    joint: torch.Tensor

    def __new__(cls, joint: torch.Tensor):
        m = joint.shape[-1] - 1
        self = super().__new__(cls, (joint[..., :m], joint[..., m]))
        self.joint = joint
        return self


def new_linear_state(batch: int, heads: int, feature_dim: int, value_dim: int, device, dtype=torch.float32):
    """Empty RNN state (eq. 16-17): S ``(B, H, C, M)`` = 0, Z ``(B, H, C)`` = 0, returned as
    a :class:`LinearState` (a tuple ``(S, Z)``; both live in one zeroed buffer)."""
    return LinearState(torch.zeros(batch, heads, feature_dim, value_dim + 1, device=device, dtype=dtype))


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

    Without autograd the state is updated in place: no allocation per step beyond the output,
    which is what makes generation fast. With autograd enabled a new state is returned so
    gradients can flow through time.

    The step runs once per position and layer with tiny tensors, so its cost is the number of
    tensor operations, not arithmetic: in place it is two element-wise updates (S += phi(k)
    v^T as a broadcast ``addcmul_``, which needs no BLAS call, and Z += phi(k)), one product
    with ``[S | Z]`` for numerator and normaliser together (when ``state`` is a
    :class:`LinearState`) and one division.
    """
    s, z = state
    if phi_k.shape != z.shape or v.shape[-1] != s.shape[-1]:
        raise ValueError(
            f"linear_attention_step: phi_k {tuple(phi_k.shape)} and v {tuple(v.shape)} do not fit the state "
            f"S {tuple(s.shape)}, Z {tuple(z.shape)} (batch, heads, feature dim, value dim must match the "
            f"sequence's first step)"
        )
    compute = s.dtype
    if phi_q.dtype != compute or phi_k.dtype != compute or v.dtype != compute:
        phi_q, phi_k, v = phi_q.to(compute), phi_k.to(compute), v.to(compute)
    if torch.is_grad_enabled() and (phi_q.requires_grad or phi_k.requires_grad or v.requires_grad or s.requires_grad):
        s = s + phi_k.unsqueeze(-1) * v.unsqueeze(-2)
        z = z + phi_k
        numerator = (phi_q.unsqueeze(-2) @ s).squeeze(-2)
        denominator = (phi_q * z).sum(-1, keepdim=True) + eps
        return numerator / denominator, (s, z)
    s.addcmul_(phi_k.unsqueeze(-1), v.unsqueeze(-2))  # S += phi(k) v^T, in place
    z.add_(phi_k)
    joint = getattr(state, "joint", None)
    if joint is None:  # a state built elsewhere: S and Z are separate tensors
        numerator = (phi_q.unsqueeze(-2) @ s).squeeze(-2)
        denominator = (phi_q * z).sum(-1, keepdim=True) + eps
        return numerator / denominator, state
    if joint.is_cuda:
        if torch.is_autocast_enabled("cuda"):  # keep the product with the fp32 state in fp32
            with torch.autocast("cuda", enabled=False):
                both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)
        else:
            both = torch.matmul(phi_q.unsqueeze(-2), joint).squeeze(-2)  # (B, H, M + 1)
    else:
        # on CPU a broadcast product + sum: a (B*H)-batched matmul of (1, C) x (C, M + 1)
        # enters the BLAS thread pool, which costs more than the arithmetic at these sizes
        both = (phi_q.unsqueeze(-1) * joint).sum(-2)  # (B, H, M + 1) = [phi(q)^T S | phi(q)^T Z]
    m = s.shape[-1]
    # eps as a cached 0-d tensor: a Python float would be converted to a tensor at every call
    return both[..., :m] / both[..., m:].add_(_scalar(eps, both)), state


_SCALARS: dict = {}


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor holding ``value`` with ``like``'s dtype and device, made once and cached."""
    key = (value, like.dtype, like.device)
    scalar = _SCALARS.get(key)
    if scalar is None:
        with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
            scalar = _SCALARS[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return scalar
