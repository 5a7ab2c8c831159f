"""``lsh``: Reformer LSH attention (Kitaev et al. 2020), the paper's lsh-1/lsh-4 baseline."""

from __future__ import annotations

import torch

from linformer_lab.attention.base import Attention
from linformer_lab.ops import kernels
from linformer_lab.ops.lsh import lsh_attention
from linformer_lab.ops.state import KVCache


class LSHAttention(Attention):
    """Shared-QK LSH attention; see :mod:`linformer_lab.ops.lsh` for the algorithm.

    Args:
        n_hashes: rounds of hashing (paper: 1 and 4; 8 in Fig. 1).
        bucket_size: positions per attention chunk (paper: ~32, e.g. 29 for MNIST's 783).
        n_buckets: hash buckets (paper: 64); must be even.
        seed: seed of the random rotations, a buffer (saved in checkpoints) fixed between calls,
            so a model is a deterministic function; :meth:`redraw` draws new ones.

    Keys are the queries (shared-QK): ``k`` must equal ``q`` (the multi-head module passes
    ``k = q``); a different ``k`` is an error rather than silently ignored.

    RNN mode keeps the prefix (a KV cache) and recomputes the attention over it at every step,
    the paper's baseline for Reformer generation. The parallel forward takes and returns that
    prefix (``state=``, ``return_state=``): the new positions get the outputs of a forward over
    ``prefix + new``.
    """

    shares_query_key = True
    has_recurrent_form = False
    supports_state = True
    state_description = "the KVCache of its prefix or None"

    def __init__(self, causal: bool = False, query_dim: int | None = None, feature_map=None,
                 n_hashes: int = 1, bucket_size: int = 32, n_buckets: int = 64, seed: int = 0):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        if query_dim is None:
            raise ValueError("lsh attention needs query_dim to draw its hash rotations")
        if n_hashes < 1 or bucket_size < 1:
            raise ValueError(f"n_hashes and bucket_size must be >= 1, got {n_hashes}, {bucket_size}")
        if n_buckets < 2 or n_buckets % 2:
            raise ValueError(f"n_buckets must be an even number >= 2, got {n_buckets}")
        self.n_hashes, self.bucket_size, self.n_buckets = n_hashes, bucket_size, n_buckets
        self._generator = torch.Generator().manual_seed(seed)
        self.register_buffer("rotations", torch.empty(query_dim, n_hashes, n_buckets // 2))
        self.redraw()

    def redraw(self, generator: torch.Generator | None = None) -> None:
        r = torch.randn(self.rotations.shape, generator=generator or self._generator)
        with torch.no_grad():
            self.rotations.copy_(r)

    def forward(self, q, k, v, key_lengths=None, state: KVCache | None = None, return_state=False, cu_seqlens=None):
        self.check_inputs(q, k, v, key_lengths)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)
        if k is not q and not torch.equal(k, q):
            raise ValueError(
                "lsh attention shares queries and keys (Reformer's shared-QK): pass k = q. "
                "MultiHeadAttention does this automatically for backends with shares_query_key."
            )
        if state is None and not return_state:
            return lsh_attention(q, v, self.rotations, self.bucket_size, self.causal, key_lengths, kernels.lsh_window)
        if key_lengths is not None and bool((key_lengths != q.shape[2]).any()):
            # the prefix is one sequence of inputs for every row; padding inside it would be attended
            raise ValueError("LSHAttention: a state (return_state / state=) needs sequences of equal length "
                             "(key_lengths all equal to the sequence length)")
        # the cache holds the queries: they are the keys (shared-QK)
        q_all, v_all = (q, v) if state is None else self.with_prefix(state, q, v)
        out = lsh_attention(q_all, v_all, self.rotations, self.bucket_size, self.causal,
                            window=kernels.lsh_window)[:, :, q_all.shape[2] - q.shape[2]:]
        return (out, KVCache.from_sequence(q_all, v_all)) if return_state else out

    def step(self, q_t, k_t, v_t, state: KVCache | None = None):
        state = self.appended_cache(q_t, k_t, v_t, state, key_t=q_t)
        out = lsh_attention(state.keys, state.values, self.rotations, self.bucket_size, causal=True, window=kernels.lsh_window)
        return out[:, :, -1], state

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, n_hashes={self.n_hashes}, bucket_size={self.bucket_size}, "
                f"n_buckets={self.n_buckets}")
