"""``linear``: linear attention (paper §3.2-3.4) on CPU and GPU, each op on the kernel that
:mod:`linformer_lab.ops.kernels` picks for the inputs' device (C++ on CPU, CUDA and Triton on a GPU,
PyTorch where neither applies or ``LINFORMER_LAB_KERNELS=pytorch``); ``gpu_kernels=True`` forces
the GPU kernels (the ``linear_cuda`` backend)."""

from __future__ import annotations

import functools

import torch

from linformer_lab.attention.base import Attention, check_cu_seqlens
from linformer_lab.attention.context_parallel import segment_attention
from linformer_lab.feature_maps import FeatureMap, build_feature_map
from linformer_lab.ops import kernels
from linformer_lab.ops import linear_attention as ops
from linformer_lab.validation import ConfigurationError

#: op of :mod:`linformer_lab.ops.kernels` -> the candidate ``gpu_kernels=True`` forces, as
#: ``LINFORMER_LAB_KERNELS=causal_attention=triton,causal=cuda`` would for this layer alone.
GPU_KERNELS = {"causal_attention": "triton", "causal": "cuda"}
#: Why the GPU kernels cannot run off CUDA (``where``: the run's device or the tensors'), and what
#: runs everywhere instead.
NOT_CUDA = (
    "attention backend 'linear_cuda' runs only on CUDA GPUs, but {where}. "
    "Use the 'linear' backend instead (same arguments, same results, runs on CPU and GPU)."
)


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
        gpu_kernels: force the GPU kernels (``linear_cuda`` is this layer with it): causal eq.
            9-12 on the Triton chunk kernel (:mod:`linformer_lab.ops.cuda.triton_chunk`: elu map
            and normaliser fused, packed sequences in one launch) where Triton runs (compute
            capability >= 8.0; features and values at most 256 wide), else the numerator on the
            CUDA C++ kernel of :mod:`linformer_lab.ops.cuda` (compiled on first use; also 7.x; at
            most 256 wide too), else the PyTorch candidates. Non-causal attention
            and RNN steps are matmuls already (cuBLAS). Built anywhere, runs on CUDA tensors only
            (:meth:`check_device` lets a task refuse a CPU run before its first batch).

    RNN mode (eq. 16-20): the state is ``(S (B, H, C, M), Z (B, H, C))`` in fp32, of fixed size
    whatever the sequence length. The parallel forward takes and returns it (``state=``,
    ``return_state=``): a prompt is prefilled in one pass and stepping continues from it, or a
    long sequence runs in segments. Non-causal attention attends to the state's keys alongside the new ones.
    """

    #: the registry's second name of this layer (``registry.py``): ``linear`` with the GPU kernels forced
    aliases = {"linear_cuda": {"gpu_kernels": True}}
    uses_feature_map = True
    supports_state = True
    supports_packed = True
    state_type = (tuple, list)  # a LinearState, or (S, Z) built by hand
    state_description = "a LinearState (S, Z) or None"

    def __init__(
        self,
        causal: bool = False,
        query_dim: int | None = None,
        feature_map: str | FeatureMap | None = None,
        feature_map_kwargs: dict | None = None,
        eps: float = 1e-6,
        chunk_size: int | None = None,
        gpu_kernels: bool = False,
    ):
        super().__init__(causal=causal, query_dim=query_dim, feature_map=feature_map)
        self.feature_map = resolve_feature_map(feature_map, query_dim, feature_map_kwargs)
        self.query_dim = self.feature_map.query_dim
        self.eps = eps
        self.chunk_size = chunk_size
        self.gpu_kernels = gpu_kernels
        #: :data:`GPU_KERNELS` with ``gpu_kernels``, else empty (each op's candidate chosen by the conditions)
        self.forced_kernels = dict(GPU_KERNELS) if gpu_kernels else {}
        #: the process group whose ranks hold consecutive segments of one sequence, or None (one
        #: process holds it all); set by :func:`~linformer_lab.attention.context_parallel.context_parallel`
        self.context_group = None

    @property
    def causal_dot_product(self):
        """The numerator of eq. 9 this layer computes with, ``(phi_q, phi_k, v, initial_state=None,
        return_final_state=False)``: :func:`linformer_lab.ops.kernels.causal_dot_product` with its
        chunk size and forced kernel (what the PyTorch candidates of ``causal_attention`` call)."""
        return functools.partial(kernels.causal_dot_product, chunk_size=self.chunk_size,
                                 force=self.forced_kernels.get("causal"))

    @staticmethod
    def unavailable_reason(gpu_kernels: bool = False) -> str | None:
        """Why the layer cannot run on this machine, or None (``cli.py plugins --check`` asks, with
        the arguments of the name it checks): only the GPU kernels can be missing."""
        if not gpu_kernels:
            return None
        from linformer_lab.ops import cuda as cuda_ops
        from linformer_lab.ops.cuda import triton_chunk

        if not torch.cuda.is_available():
            return "no CUDA GPU visible (use 'linear' here)"
        if triton_chunk.is_available() or cuda_ops.is_available():
            return None
        return (f"neither GPU kernel runs here: Triton's ({triton_chunk.unavailable_reason()}), nor the CUDA "
                "extension (needs compute capability >= 7.0, CUDA toolkit, ninja)")

    def check_device(self, device: torch.device | str) -> None:
        """With ``gpu_kernels``, a :class:`~linformer_lab.validation.ConfigurationError` unless
        ``device`` is a CUDA device (the tasks call this from ``setup`` with the run's device)."""
        if self.gpu_kernels and torch.device(device).type != "cuda":
            raise ConfigurationError(NOT_CUDA.format(where=f"this run's device is {device}"))

    def check_inputs(self, q, k, v, key_lengths=None):
        super().check_inputs(q, k, v, key_lengths)
        if self.gpu_kernels and q.device.type != "cuda":
            raise RuntimeError(NOT_CUDA.format(where=f"got tensors on {q.device}"))

    def forward(self, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
        if self.context_group is not None:  # this rank's segment of a sequence split over processes
            self.check_inputs(q, k, v)
            return segment_attention(self, self.context_group, q, k, v, key_lengths, state, return_state, cu_seqlens)
        return self.attend(q, k, v, key_lengths, state, return_state, cu_seqlens)

    def attend(self, q, k, v, key_lengths=None, state=None, return_state=False, cu_seqlens=None):
        """:meth:`forward` on inputs held whole by this process (what a context-parallel segment
        runs, from the prefix of the earlier segments' state)."""
        # the hot path of training: no copy of q, k, v or the output, nothing read back from the
        # device (key_lengths and cu_seqlens are checked by assertions on it)
        self.check_inputs(q, k, v, key_lengths)
        self.check_state_request(state, return_state, cu_seqlens, key_lengths)
        self.check_state_type(state, "forward")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, q.shape[2], q.shape[0], type(self).__name__, keys=k.shape[2], read=False,
                             device=q.device)
        if self.causal:
            # eq. 9-12 from the unmapped q, k on the candidate kernels picks: a fused one applies the
            # feature map, numerator and normaliser in one launch, the PyTorch one composes them
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
            # full checks on a sequence's first step only (later ones: fit to the state, in
            # linear_attention_step): per-step checks would cost as much as the tiny step
            self.check_step_inputs(q_t, k_t, v_t)
        self.check_state_type(state, "step")
        phi_q = self.feature_map.forward_queries(q_t)
        phi_k = self.feature_map.forward_keys(k_t)
        if state is None:
            b, h, c = phi_k.shape
            state_dtype = torch.float64 if v_t.dtype == torch.float64 else torch.float32
            state = ops.new_linear_state(b, h, c, v_t.shape[-1], v_t.device, state_dtype)
        out, state = ops.linear_attention_step(phi_q, phi_k, v_t, state, eps=self.eps)
        return out.to(v_t.dtype), state

    def extra_repr(self) -> str:
        gpu = ", gpu_kernels=True" if self.gpu_kernels else ""
        return f"causal={self.causal}, eps={self.eps}, chunk_size={self.chunk_size}{gpu}"


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
