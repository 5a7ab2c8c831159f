"""``linear``: linear attention (paper §3.2-3.4) on CPU and GPU, each op on the kernel that
:mod:`linformer_lab.ops.kernels` picks for the inputs' device (C++ on CPU, CUDA on a GPU, the
PyTorch reference where neither applies or ``LINFORMER_LAB_KERNELS=reference``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from linformer_lab.attention.base import Attention, check_cu_seqlens, state_type_error
from linformer_lab.feature_maps import FeatureMap, build_feature_map
from linformer_lab.ops import kernels
from linformer_lab.ops import linear_attention as ops


class LinearAttention(Attention):
    """V' = phi(Q) (phi(K)^T V) / phi(Q) sum_j phi(K_j)  (eq. 5-6), causal as eq. 9-12.

    Args:
        causal: mask the future (eq. 8-9).
        query_dim: D, the per-head query/key size (needed to build the feature map).
        feature_map: a registered name (default ``"elu"``, eq. 7), a :class:`FeatureMap`
            instance, or None for the default.
        feature_map_kwargs: keyword arguments for a feature map given by name.
        eps: added to the normaliser.
        chunk_size: chunk length of the causal algorithm (default: chosen from C and M). Packed
            sequences choose their own, at most their mean length.

    RNN mode (eq. 16-20): the state is ``(S (B, H, C, M), Z (B, H, C))`` in fp32, of fixed
    size whatever the sequence length. The parallel forward takes and returns the same state
    (``state=``, ``return_state=``): a prompt is prefilled in one pass and stepping continues
    from it, or a long sequence runs in segments with the state carried across. Non-causal
    attention takes it too: the state's keys are attended to alongside the new ones.
    """

    uses_feature_map = True
    supports_state = True
    supports_packed = True
    #: op of :mod:`linformer_lab.ops.kernels` -> the candidate this backend forces for it, as
    #: ``LINFORMER_LAB_KERNELS`` would for this layer alone (empty: chosen by the conditions);
    #: ``linear_cuda`` names the GPU kernels.
    forced_kernels: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        causal: bool = False,
        query_dim: int | None = None,
        feature_map: str | FeatureMap | None = None,
        feature_map_kwargs: dict | None = None,
        eps: float = 1e-6,
        chunk_size: int | None = None,
    ):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        self.feature_map = resolve_feature_map(feature_map, query_dim, feature_map_kwargs)
        self.query_dim = self.feature_map.query_dim
        self.eps = eps
        self.chunk_size = chunk_size

    def causal_dot_product(self, phi_q, phi_k, v, initial_state=None, return_final_state=False):
        """Numerator of eq. 9 (optionally from an initial state S_0, returning S_N) on the kernel
        for the device (:func:`linformer_lab.ops.kernels.causal_dot_product`, forced as
        :attr:`forced_kernels` says)."""
        return kernels.causal_dot_product(phi_q, phi_k, v, self.chunk_size, initial_state, return_final_state,
                                          force=self.forced_kernels.get("causal"))

    def forward(self, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
        # The hot path of training: no copy of q, k, v or the output here, and nothing read back
        # from the device (the checks of key_lengths and cu_seqlens assert on it).
        self.check_inputs(q, k, v, key_lengths)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)
        if state is not None and not isinstance(state, (tuple, list)):
            raise state_type_error(f"{type(self).__name__}.forward", state, "a LinearState (S, Z) or None")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, q.shape[2], q.shape[0], type(self).__name__, keys=k.shape[2], read=False,
                             device=q.device)
        if self.causal:
            # eq. 9-12 from the unmapped q, k: a fused kernel takes the feature map, the numerator and
            # the normaliser in one (packed sequences in the same launch), the reference composes them
            kernel = kernels.select("causal_attention", self.feature_map, q, k, v,
                                    force=self.forced_kernels.get("causal_attention"))
            return kernel.run(self.feature_map, q, k, v, key_lengths, self.eps, self.causal_dot_product, state,
                              return_state, cu_seqlens)
        phi_q = self.feature_map.forward_queries(q)
        phi_k = self.feature_map.forward_keys(k)
        if cu_seqlens is not None:
            return ops.packed_linear_attention(phi_q, phi_k, v, cu_seqlens, False, self.eps, state, return_state)
        return ops.linear_attention(
            phi_q, phi_k, v, key_lengths=key_lengths, eps=self.eps, initial_state=state, return_state=return_state
        )

    def step(self, q_t, k_t, v_t, state=None):
        if state is None:
            # A sequence's first step checks the inputs in full; later steps only check that
            # they fit the state (in linear_attention_step): the step is tiny and runs once per
            # position and layer, so per-step checks would cost as much as the attention.
            self.check_step_inputs(q_t, k_t, v_t)
        elif not isinstance(state, (tuple, list)):  # a LinearState, or (S, Z) built by hand
            raise state_type_error(f"{type(self).__name__}.step", state, "a LinearState (S, Z) or None")
        phi_q = self.feature_map.forward_queries(q_t)
        phi_k = self.feature_map.forward_keys(k_t)
        if state is None:
            b, h, c = phi_k.shape
            state_dtype = torch.float64 if v_t.dtype == torch.float64 else torch.float32
            state = ops.new_linear_state(b, h, c, v_t.shape[-1], v_t.device, state_dtype)
        out, state = ops.linear_attention_step(phi_q, phi_k, v_t, state, eps=self.eps)
        return out.to(v_t.dtype), state

    def extra_repr(self) -> str:
        return f"causal={self.causal}, eps={self.eps}, chunk_size={self.chunk_size}"


def resolve_feature_map(feature_map, query_dim: int | None, kwargs: dict | None) -> FeatureMap:
    """Turn a name / instance / None into a FeatureMap, checking it fits ``query_dim``."""
    if feature_map is None:
        feature_map = "elu"
    if isinstance(feature_map, str):
        if query_dim is None:
            raise ValueError(f"query_dim is required to build feature map {feature_map!r}")
        return build_feature_map(feature_map, query_dim=query_dim, **(kwargs or {}))
    if kwargs:
        raise ValueError("feature_map_kwargs only apply when feature_map is given by name")
    if not isinstance(feature_map, FeatureMap):
        raise ValueError(
            f"feature_map must be a registered name, a linformer_lab.feature_maps.FeatureMap instance or None; "
            f"got {type(feature_map).__name__}"
        )
    if query_dim is not None and feature_map.query_dim != query_dim:
        raise ValueError(f"feature map was built for query_dim={feature_map.query_dim} but query_dim={query_dim}")
    return feature_map
