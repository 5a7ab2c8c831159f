"""The Triton chunk kernels as ``torch.library`` operators with fake implementations and a
registered gradient (defined as ``ops/custom_ops.py`` defines the CPU ones), so
``torch.compile(fullgraph=True)`` traces through them, and the public :func:`chunk_linear_attention`.

The backward recomputes the states inside a super-chunk from the super-chunk deltas the forward
saves; they are never saved. No copies and no host reads: q, k, v and the incoming gradient are read through their strides
(a ``(B, H, N, D)`` view of a layer's ``(B, N, H, D)`` projection included), the output and the
gradients are allocated in their inputs' memory order (``empty_like``), and ``cu_seqlens`` is
checked on the device (``torch._assert_async``).
"""


import torch
from torch import Tensor

from linformer_lab.ops import custom_ops
from linformer_lab.ops.linear_attention import elu_plus_one

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FEATURE_MAPS = ("elu", None)
_CHUNKS = (16, 32, 64, 128)
#: The widest features C and values M the kernels take: at 256 (and the default chunk) every kernel
#: fits the shared memory of the smallest GPU they run on, 99 KiB a program at compute capability 8.6
#: and 8.9 (at most 80 KiB; ``tests/ops/test_triton_chunk_gpu.py`` compiles and checks). Wider ones
#: need more than some GPUs have (bf16 for sm_90: C = 512 116 KiB, C = 1,024 230 KiB, C = 2,048 460 KiB):
#: the ``causal_attention`` op gives wider feature maps (the second-order ones from D = 32,
#: random_fourier's 512 features) to its PyTorch candidate.
MAX_WIDTH = 256
#: In fp32 the elu map applied inside the forward kernel takes 129 KiB at C = 256: above this many
#: features PyTorch applies it first and the kernels take the mapped inputs (49 KiB).
FUSED_ELU_FP32_MAX_WIDTH = 128


def default_chunk(c: int, m: int, dtype: torch.dtype) -> int:
    """The chunk the kernels take when none is asked for: 64 up to 32 features and values; above,
    the longest whose chunk tiles, state tile and the parts of its products stay in a Hopper
    program's registers at C = M = 128 (``tests/ops/test_triton_chunk_gpu.py`` compiles and
    checks): 32 for bf16 (bf16 parts), 16 for fp16 and fp32 (tf32 products take more)."""
    if max(c, m) <= 32:
        return 64
    return 32 if dtype == torch.bfloat16 or max(c, m) <= 64 else 16


def _layout(q, v, cu_seqlens, chunk_size, head_first, check_values=True):
    from linformer_lab.ops.cuda.triton_chunk import launch  # imports triton: only when a kernel runs

    if q.device.type != "cuda" and not launch.interpreting():
        raise RuntimeError(f"chunk_linear_attention runs on CUDA tensors (got {q.device}); on a CPU only under "
                           "Triton's interpreter (TRITON_INTERPRET=1, fp32/fp16)")
    if check_values and cu_seqlens is not None:  # the backward's were checked by the forward
        _check_cu_seqlens_values(cu_seqlens, q.shape[2] if head_first else q.shape[1])
    return launch, launch.layout(q, v, cu_seqlens, chunk_size, head_first)


def _check_cu_seqlens_values(cu_seqlens: Tensor, total: int) -> None:
    """Without a host read (it would wait for the GPU): a device-side assertion, raised at once
    on a CPU and at the next synchronisation on a GPU."""
    rising = (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    torch._assert_async((cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & rising,
                        f"chunk_linear_attention: cu_seqlens must rise from 0 to the sequence length {total} "
                        "([0, n_1, n_1 + n_2, ..., T])")


def _sequences(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _heads(q, head_first):
    return q.shape[1] if head_first else q.shape[2]


def forward(q: Tensor, k: Tensor, v: Tensor, s0: Tensor | None, z0: Tensor | None, cu_seqlens: Tensor | None,
            feature_map: str, eps: float, chunk_size: int, head_first: bool) -> tuple[Tensor, ...]:
    """-> out (like v, in v's memory order), den ``(B, H, T)`` fp32, S_N ``(S, H, C, M)`` fp32,
    z_N ``(S, H, C)`` fp32, the super-chunk deltas ``(slots H, C, M)``, ``(slots H, C)`` fp32 and
    the output before rounding (half inputs; ``launch.run_forward``)."""
    launch, lay = _layout(q, v, cu_seqlens, chunk_size, head_first)
    s0 = None if s0 is None else s0.to(torch.float32).contiguous()  # small; the kernels read states densely
    z0 = None if z0 is None else z0.to(torch.float32).contiguous()
    if lay.time == 0 or lay.sequences * lay.heads == 0:
        s_n = s0.clone() if s0 is not None else q.new_zeros(lay.sequences, lay.heads, lay.c, lay.m, dtype=torch.float32)
        z_n = z0.clone() if z0 is not None else q.new_zeros(lay.sequences, lay.heads, lay.c, dtype=torch.float32)
        f32 = dict(dtype=torch.float32)
        return (torch.empty_like(v), q.new_ones(lay.batch, lay.heads, lay.time, **f32), s_n, z_n,
                q.new_empty(0, lay.c, lay.m, **f32), q.new_empty(0, lay.c, **f32),
                q.new_empty(0, lay.heads, lay.time, lay.m, **f32))
    with launch.on_device(q.device):
        return launch.run_forward(q, k, v, s0, z0, lay, feature_map == "elu", eps)


def _fwd_fake(q, k, v, s0, z0, cu_seqlens, feature_map, eps, chunk_size, head_first):
    from linformer_lab.ops.cuda.triton_chunk import launch

    lay = launch.layout(q, v, cu_seqlens, chunk_size, head_first)
    s, h, c, m = lay.sequences, lay.heads, lay.c, lay.m
    work = lay.time > 0 and s * h > 0
    deltas = lay.slots * h if lay.ns_max > 1 and work else 0
    half = q.dtype in (torch.float16, torch.bfloat16) and work
    f32 = dict(dtype=torch.float32)
    return (torch.empty_like(v), q.new_empty(lay.batch, h, lay.time, **f32), q.new_empty(s, h, c, m, **f32),
            q.new_empty(s, h, c, **f32), q.new_empty(deltas, c, m, **f32), q.new_empty(deltas, c, **f32),
            q.new_empty(lay.batch if half else 0, h, lay.time, m, **f32))


def backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, den: Tensor, deltas_s: Tensor, deltas_z: Tensor,
             out32: Tensor, grad_out: Tensor,
             ds_final: Tensor | None, dz_final: Tensor | None, s0: Tensor | None, z0: Tensor | None,
             cu_seqlens: Tensor | None, feature_map: str, chunk_size: int,
             head_first: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> dq, dk, dv (like q, k, v), dS_0 ``(S, H, C, M)`` fp32, dz_0 ``(S, H, C)`` fp32, from the
    forward's output, denominator, super-chunk deltas and output before rounding."""
    grad_out = grad_out.to(v.dtype)
    launch, lay = _layout(q, v, cu_seqlens, chunk_size, head_first, check_values=False)
    if (ds_final is None) != (dz_final is None):  # one of the final state's parts was used
        ds_final = ds_final if ds_final is not None else q.new_zeros(lay.sequences, lay.heads, lay.c, lay.m)
        dz_final = dz_final if dz_final is not None else q.new_zeros(lay.sequences, lay.heads, lay.c)
    if ds_final is not None:
        ds_final, dz_final = (x.to(torch.float32).contiguous() for x in (ds_final, dz_final))
    if lay.time == 0 or lay.sequences * lay.heads == 0:
        zero_s = q.new_zeros(lay.sequences, lay.heads, lay.c, lay.m, dtype=torch.float32)
        zero_z = q.new_zeros(lay.sequences, lay.heads, lay.c, dtype=torch.float32)
        ds0 = ds_final.clone() if ds_final is not None else zero_s
        dz0 = dz_final.clone() if dz_final is not None else zero_z
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), ds0, dz0
    s0 = None if s0 is None else s0.to(torch.float32).contiguous()
    z0 = None if z0 is None else z0.to(torch.float32).contiguous()
    with launch.on_device(q.device):
        return launch.run_backward(q, k, v, out, den, grad_out, ds_final, dz_final, s0, z0, deltas_s, deltas_z, out32,
                                   lay, feature_map == "elu")


def _bwd_fake(q, k, v, out, den, deltas_s, deltas_z, out32, grad_out, ds_final, dz_final, s0, z0, cu_seqlens, feature_map,
              chunk_size, head_first):
    s, h, c, m = _sequences(q, cu_seqlens), _heads(q, head_first), q.shape[-1], v.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(s, h, c, m, dtype=torch.float32), q.new_empty(s, h, c, dtype=torch.float32))


# ``forward`` and ``backward`` serve every device: they say themselves where they cannot run
#: ``chunk_linear_attention_fwd(q, k, v, s0, z0, cu_seqlens, feature_map, eps, chunk_size, head_first)``
#: -> ``(out, den, S_N, z_N, dS, dz, out32)`` (:func:`forward`), differentiable in out, S_N, z_N
chunk_linear_attention_fwd = custom_ops.define(
    "chunk_linear_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? s0, Tensor? z0, Tensor? cu_seqlens, "
    "str feature_map, float eps, int chunk_size, bool head_first) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
    "Tensor)",
    forward, _fwd_fake, "CompositeExplicitAutograd")
#: ``chunk_linear_attention_bwd(q, k, v, out, den, dS, dz, out32, grad_out, ds_final, dz_final, s0, z0, cu_seqlens,
#: feature_map, chunk_size, head_first)`` -> ``(dq, dk, dv, dS_0, dz_0)`` (:func:`backward`)
chunk_linear_attention_bwd = custom_ops.define(
    "chunk_linear_attention_bwd(Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, Tensor deltas_s, "
    "Tensor deltas_z, Tensor out32, Tensor grad_out, "
    "Tensor? ds_final, Tensor? dz_final, Tensor? s0, Tensor? z0, Tensor? cu_seqlens, str feature_map, "
    "int chunk_size, bool head_first) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward, _bwd_fake, "CompositeExplicitAutograd")


class _ChunkLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0, z0, cu_seqlens, feature_map, eps, chunk_size, head_first):
        out, den, s_n, z_n, deltas_s, deltas_z, out32 = custom_ops.below_autograd(
            chunk_linear_attention_fwd, q, k, v, s0, z0, cu_seqlens, feature_map, eps, chunk_size, head_first)
        ctx.save_for_backward(q, k, v, out, den, deltas_s, deltas_z, out32, s0, z0, cu_seqlens)
        ctx.options = (feature_map, chunk_size, head_first)
        ctx.mark_non_differentiable(den, deltas_s, deltas_z, out32)  # the backward's inputs, not results
        ctx.set_materialize_grads(False)  # an unused output sends None, not a fresh zero tensor
        return out, den, s_n, z_n, deltas_s, deltas_z, out32

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward operator has no gradient: an error, not a wrong number
    def backward(ctx, grad_out, _grad_den, ds_final, dz_final, _grad_ds, _grad_dz, _grad_out32):
        q, k, v, out, den, deltas_s, deltas_z, out32, s0, z0, cu_seqlens = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, ds0, dz0 = chunk_linear_attention_bwd(q, k, v, out, den, deltas_s, deltas_z, out32, grad_out,
                                                          ds_final, dz_final, s0, z0, cu_seqlens, *ctx.options)
        ds0 = None if s0 is None else ds0.to(s0.dtype)
        dz0 = None if z0 is None else dz0.to(z0.dtype)
        return dq, dk, dv, ds0, dz0, None, None, None, None, None


custom_ops.differentiable("chunk_linear_attention_fwd", _ChunkLinearAttention)


def _check(q, k, v, feature_map, initial_state, cu_seqlens, chunk_size, head_first):
    """One line naming the problem and the valid choices, for each bad argument."""
    name = "chunk_linear_attention"
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        raise ValueError(f"{name}: q, k, v must be 4-d tensors ({'(B, H, T, D)' if head_first else '(B, T, H, D)'})")
    if q.shape != k.shape:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"{name}: v {tuple(v.shape)} must match q {tuple(q.shape)} in every dim but the last")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"{name}: q, k, v must share one dtype of float32, float16, bfloat16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if max(q.shape[-1], v.shape[-1]) > MAX_WIDTH:
        raise ValueError(f"{name}: feature dim {q.shape[-1]} and value dim {v.shape[-1]} must each be at most "
                         f"{MAX_WIDTH} (wider kernels exceed a GPU's shared memory); wider inputs take the PyTorch "
                         f"form, linformer_lab.ops.linear_attention.causal_linear_attention")
    if feature_map not in _FEATURE_MAPS:
        raise ValueError(f"{name}: feature_map must be 'elu' (applied in the kernel) or None (inputs already "
                         f"feature-mapped); got {feature_map!r}")
    if chunk_size is not None and chunk_size not in _CHUNKS:
        raise ValueError(f"{name}: chunk_size must be one of {_CHUNKS}; got {chunk_size!r}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)
                                   or cu_seqlens.shape[0] < 2 or q.shape[0] != 1):
        raise ValueError(f"{name}: cu_seqlens must be a 1-d int32/int64 tensor [0, n_1, ..., T] of at least 2 "
                         f"entries, with packed inputs of batch 1; got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype} "
                         f"for batch {q.shape[0]}")
    if initial_state is not None:
        s, h, c, m = _sequences(q, cu_seqlens), _heads(q, head_first), q.shape[-1], v.shape[-1]
        ok = isinstance(initial_state, (tuple, list)) and len(initial_state) == 2
        if not ok or tuple(initial_state[0].shape) != (s, h, c, m) or tuple(initial_state[1].shape) != (s, h, c):
            got = [tuple(x.shape) for x in initial_state] if ok else type(initial_state).__name__
            raise ValueError(f"{name}: initial_state must be (S_0 {(s, h, c, m)}, z_0 {(s, h, c)}) (sequences, heads, "
                             f"feature dim, value dim); got {got}")


def chunk_linear_attention(q: Tensor, k: Tensor, v: Tensor, *, feature_map: str | None = "elu", eps: float = 1e-6,
                           initial_state: tuple[Tensor, Tensor] | None = None, return_final_state: bool = False,
                           cu_seqlens: Tensor | None = None, chunk_size: int | None = None, head_first: bool = True):
    """Causal linear attention (eq. 9-12) with the feature map and the normaliser fused:
    out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i + eps), S_i = S_0 + sum_{j <= i} phi(k_j) v_j^T,
    z_i = z_0 + sum_{j <= i} phi(k_j), by Triton kernels parallel over chunks (forward and
    backward; S and z accumulated in fp32).

    Args:
        q, k: ``(B, H, T, C)`` (``head_first=False``: ``(B, T, H, C)``); float32, float16 or
            bfloat16, all three inputs one dtype, on a CUDA device (on CPU only under
            ``TRITON_INTERPRET=1``, fp32/fp16). Any strides: views are read in place. C and M at
            most :data:`MAX_WIDTH`.
        v: ``(B, H, T, M)`` (or ``(B, T, H, M)``).
        feature_map: ``"elu"``: phi = elu + 1 (eq. 7) applied inside the kernels; None: q and k
            are already feature-mapped (non-negative); any other map is applied by the caller.
        eps: added to the denominator.
        initial_state: ``(S_0 (S, H, C, M), z_0 (S, H, C))``, the state before position 0 (S = B,
            or the number of packed sequences); None for zero. Receives gradients.
        return_final_state: also return ``(S_T (S, H, C, M), z_T (S, H, C))`` in fp32, the state a
            following segment or the RNN step continues from; gradients flow back from it.
        cu_seqlens: int ``[0, n_1, n_1 + n_2, ..., T]``: q, k, v of batch 1 hold packed sequences,
            each attended within itself with its own state row.
        chunk_size: positions per chunk, 16, 32, 64 or 128; None: :func:`default_chunk`. Chunks
            are walked in super-chunks of several, one program each (``launch.superchunk_length``).
        head_first: the layout of q, k, v (and of the output).

    Returns:
        out like v, in v's memory order (a ``(B, H, T, M)`` view of ``(B, T, H, M)`` memory gets
        an output laid out so, which a layer flattens without a copy), or ``(out, (S_T, z_T))``
        with ``return_final_state``. Differentiable in q, k, v and the initial state.
    """
    _check(q, k, v, feature_map, initial_state, cu_seqlens, chunk_size, head_first)
    if feature_map == "elu" and q.dtype == torch.float32 and q.shape[-1] > FUSED_ELU_FP32_MAX_WIDTH:
        q, k, feature_map = elu_plus_one(q), elu_plus_one(k), None
    s0, z0 = initial_state if initial_state is not None else (None, None)
    chunk_size = chunk_size or default_chunk(q.shape[-1], v.shape[-1], v.dtype)
    out, _, s_n, z_n, _, _, _ = chunk_linear_attention_fwd(q, k, v, s0, z0, cu_seqlens, feature_map or "none",
                                                        float(eps), int(chunk_size), bool(head_first))
    return (out, (s_n, z_n)) if return_final_state else out
