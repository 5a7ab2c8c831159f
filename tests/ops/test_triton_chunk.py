"""The Triton chunk kernels of causal linear attention (``linformer_lab.ops.cuda.triton_chunk``)
against the float64 O(N^2) similarity form of eq. 8-9 (with the state terms q^T S_0, q^T z_0
written out) and autograd of it for the gradients; the PyTorch form of the same chunk algorithm
against the same reference. Long sequences and bf16 on a real GPU: ``test_triton_chunk_gpu.py``.

On a machine without a GPU, Triton's interpreter runs the kernels on CPU tensors in numpy (fp32,
fp16): ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` there, before anything imports triton
(the mode is fixed at that import). On a GPU they run compiled if asked (``device`` below). The
interpreter runs every program of the grid in Python (about 0.1 s each), so shapes are small:
few heads, few chunks (chunk 16, the smallest), T not a multiple of the chunk.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
from triton_accuracy import assert_as_exact_as_the_pytorch_form  # noqa: E402

from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention, chunk_linear_attention_torch  # noqa: E402
from linformer_lab.ops.linear_attention.naive import kernel_similarity  # noqa: E402

EPS = 1e-6
#: ||got - ref|| / ||ref|| allowed per dtype: fp32 arithmetic, fp16 inputs and roundings
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.float64: 1e-12}


@pytest.fixture
def device() -> str:
    """The CPU, under Triton's interpreter. With a GPU, ``LINFORMER_LAB_TRITON_TESTS=cuda`` runs
    these tests compiled there too (each new shape compiles: minutes of device
    time, so the GPU checks proper are ``test_triton_chunk_gpu.py``)."""
    from linformer_lab.ops.cuda.triton_chunk import launch

    if launch.interpreting():
        return "cpu"
    if torch.cuda.is_available() and os.environ.get("LINFORMER_LAB_TRITON_TESTS") == "cuda":
        return "cuda"
    pytest.skip("runs under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported: tests/conftest.py "
                "on machines without a GPU), or on a GPU with LINFORMER_LAB_TRITON_TESTS=cuda")


def phi(x: torch.Tensor) -> torch.Tensor:
    """Eq. 7 as written, from torch's own elu."""
    return torch.nn.functional.elu(x) + 1


def naive(q, k, v, s0=None, z0=None, feature_map="elu", eps=EPS):
    """out_i = (phi(q_i)^T S_0 + sum_{j <= i} sim_ij v_j) / (phi(q_i)^T z_0 + sum_{j <= i} sim_ij + eps) and
    (S_N, z_N), with sim = phi(q) phi(k)^T: ``(B, H, N, C), (B, H, N, C), (B, H, N, M)``."""
    pq, pk = (phi(q), phi(k)) if feature_map == "elu" else (q, k)
    sim = kernel_similarity(pq, pk).tril()
    num, den = sim @ v, sim.sum(-1, keepdim=True) + eps
    s_n, z_n = pk.transpose(-1, -2) @ v, pk.sum(-2)
    if s0 is not None:
        num, den = num + pq @ s0, den + pq @ z0.unsqueeze(-1)
        s_n, z_n = s_n + s0, z_n + z0
    return num / den, s_n, z_n


def check(name, got, ref, dtype):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    error = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert error < TOL[dtype], f"{name}: relative error {error:.3g} > {TOL[dtype]:g}"


def inputs(b, h, t, c, m, dtype, seed=0, state=False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(device, dtype).requires_grad_() for d in (c, c, m))
    if not state:
        return q, k, v
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.rand(b, h, c, m, generator=gen).mul(4).to(device, state_dtype).requires_grad_()
    z0 = torch.rand(b, h, c, generator=gen).mul(4).to(device, state_dtype).requires_grad_()
    return q, k, v, s0, z0


def compare(fast, ref_fn, tensors, dtype, name, seed=1):
    """Outputs of ``fast(*tensors)`` and ``ref_fn(*float64 copies)`` and the gradients of a random
    linear function of all outputs, each within the dtype's tolerance."""
    refs = [x.detach().double().requires_grad_() for x in tensors]
    got, want = fast(*tensors), ref_fn(*refs)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w.device) for w in want]
    sum(((g.double() * w).sum() for g, w in zip(got, weights))).backward()
    sum(((r * w).sum() for r, w in zip(want, weights))).backward()
    for i, (g, r) in enumerate(zip(got, want)):
        check(f"{name}: output {i}", g, r, dtype)
    for i, (x, r) in enumerate(zip(tensors, refs)):
        assert x.grad is not None, f"{name}: no gradient for input {i}"
        check(f"{name}: grad of input {i}", x.grad, r.grad, dtype)


# (B, H, T, C, M): T below, at, and past multiples of the chunk (16); C != M, neither a power of 2
SHAPES = [(1, 2, 37, 8, 12), (2, 1, 5, 6, 4), (1, 1, 48, 20, 16)]


def test_forward_and_gradients_fp32(device):
    q, k, v = inputs(1, 2, 37, 8, 12, torch.float32, device=device)
    compare(lambda *x: chunk_linear_attention(*x, chunk_size=16), lambda *x: naive(*x)[0], (q, k, v), torch.float32, "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients(device, dtype, shape):
    q, k, v = inputs(*shape, dtype, seed=sum(shape), device=device)
    compare(lambda *x: chunk_linear_attention(*x, chunk_size=16), lambda *x: naive(*x)[0], (q, k, v), dtype,
            f"{dtype} {shape}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_state_in_and_out_with_gradients(device, dtype):
    """S_0, z_0 in and S_N, z_N out, gradients into both initial parts and from both final parts."""
    tensors = inputs(2, 2, 21, 8, 12, dtype, state=True, device=device)

    def fast(q, k, v, s0, z0):
        out, (s_n, z_n) = chunk_linear_attention(q, k, v, initial_state=(s0, z0), return_final_state=True, chunk_size=16)
        assert s_n.dtype == z_n.dtype == torch.float32
        return out, s_n, z_n

    compare(fast, naive, tensors, dtype, f"state {dtype}")


def test_split_sequence_continues_exactly(device):
    """Two segments, the second from the first one's final state, equal one pass over the whole."""
    q, k, v = (x.detach() for x in inputs(1, 2, 40, 8, 8, torch.float32, device=device))
    whole, (s_whole, z_whole) = chunk_linear_attention(q, k, v, return_final_state=True, chunk_size=16)
    first, state = chunk_linear_attention(q[:, :, :19], k[:, :, :19], v[:, :, :19], return_final_state=True, chunk_size=16)
    second, (s_n, z_n) = chunk_linear_attention(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], initial_state=state,
                                                return_final_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_n, s_whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z_n, z_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_sequences_equal_separate_runs(device, dtype):
    """cu_seqlens (an empty sequence and one shorter than a chunk included): every sequence on
    its own, its own state row in and out; gradients through all of it (fp16: r from the
    recomputed numerator, fp32: from the output)."""
    lengths = [5, 0, 35, 17]
    edges = torch.tensor([0, 5, 5, 40, 57], device=device)
    q, k, v, s0, z0 = inputs(1, 2, sum(lengths), 8, 12, dtype, state=True, device=device)
    s0 = s0.detach().expand(len(lengths), -1, -1, -1).clone().requires_grad_()
    z0 = z0.detach().expand(len(lengths), -1, -1).clone().requires_grad_()

    def fast(q, k, v, s0, z0):
        out, (s_n, z_n) = chunk_linear_attention(q, k, v, initial_state=(s0, z0), return_final_state=True,
                                                 cu_seqlens=edges, chunk_size=16)
        return out, s_n, z_n

    def separate(q, k, v, s0, z0):
        parts = [naive(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], s0[i:i + 1], z0[i:i + 1])
                 for i, (a, b) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist()))]
        return (torch.cat([p[0] for p in parts], dim=2), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))

    compare(fast, separate, (q, k, v, s0, z0), dtype, f"packed {dtype}")


@pytest.mark.slow
def test_feature_map_none_takes_mapped_inputs(device):
    """feature_map=None: q, k are used as given (here a softplus map applied by the caller)."""
    q, k, v = inputs(1, 2, 30, 8, 12, torch.float32, device=device)
    mapped = [torch.nn.functional.softplus(x.detach()).requires_grad_() for x in (q, k)]
    compare(lambda *x: chunk_linear_attention(*x, feature_map=None, chunk_size=16),
            lambda *x: naive(*x, feature_map=None)[0], (*mapped, v), torch.float32, "feature_map=None")


def test_sequence_major_layout(device):
    """head_first=False: ``(B, T, H, D)`` inputs give the ``(B, T, H, M)`` output of the same attention."""
    q, k, v = (x.detach() for x in inputs(2, 2, 19, 8, 12, torch.float32, device=device))
    want = chunk_linear_attention_torch(q, k, v, chunk_size=16)
    got = chunk_linear_attention(*(x.transpose(1, 2).contiguous() for x in (q, k, v)), chunk_size=16, head_first=False)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [16, 64])
def test_pytorch_form_equals_the_definition(chunk):
    """The PyTorch form of the chunk algorithm (float64, state and packing) against the naive form."""
    q, k, v, s0, z0 = inputs(2, 2, 45, 6, 5, torch.float64, state=True)
    got, (s_n, z_n) = chunk_linear_attention_torch(q, k, v, initial_state=(s0, z0), return_final_state=True,
                                                       chunk_size=chunk)
    want, s_want, z_want = naive(q, k, v, s0, z0)
    for name, g, w in (("out", got, want), ("S_N", s_n, s_want), ("z_N", z_n, z_want)):
        check(f"pytorch form {name}", g, w, torch.float64)
    edges = torch.tensor([0, 20, 45])
    packed = chunk_linear_attention_torch(q[:1], k[:1], v[:1], cu_seqlens=edges, chunk_size=chunk)
    parts = [naive(q[:1, :, a:b], k[:1, :, a:b], v[:1, :, a:b])[0] for a, b in ((0, 20), (20, 45))]
    check("pytorch form packed", packed, torch.cat(parts, dim=2), torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("feature_map, with_lengths", [("elu", False), ("elu", True), ("poly2", False)],
                         ids=["elu-fused", "elu-key_lengths", "poly2"])
def test_backend_equals_the_causal_attention_pytorch_candidate(device, feature_map, with_lengths):
    """``backend.causal_attention`` (the GPU candidate of the ``causal_attention`` op and
    ``linear_cuda``'s causal forward) equals that op's ``pytorch`` candidate: the elu map fused or, with
    key_lengths or another map, applied first; state in and out; gradients."""
    from linformer_lab.attention.linear import LinearAttention
    from linformer_lab.ops import kernels
    from linformer_lab.ops.cuda.triton_chunk import backend

    attention = LinearAttention(causal=True, query_dim=4, feature_map=feature_map).to(device)
    c = attention.feature_map.output_dim
    q, k, v = inputs(2, 2, 21, 4, 6, torch.float32, device=device)
    # poly2 is not non-negative: phi(q)^T z can come near 0, and for some draws of the state fp32 and
    # float64 then part by 5e-5 whichever implementation computes it; the state is drawn from a seed
    gen = torch.Generator().manual_seed(2)
    s0 = torch.rand(2, 2, c, 6, generator=gen).to(device).requires_grad_()
    z0 = torch.rand(2, 2, c, generator=gen).to(device).requires_grad_()
    lengths = torch.tensor([21, 13], device=device) if with_lengths else None
    assert backend.fuses(attention.feature_map) == (feature_map == "elu")

    def run(implementation, *args):
        *tensors, s0, z0 = args
        out, state = implementation(attention.feature_map, *tensors, lengths, 1e-6, attention.causal_dot_product,
                                    (s0, z0), True)
        return out, state[0], state[1]

    compare(lambda *x: run(backend.causal_attention, *x), lambda *x: run(kernels.fallback("causal_attention").run, *x),
            (q, k, v, s0, z0), torch.float32, f"backend {feature_map}")


def test_dispatch_lists_the_kernel_first_for_cuda_only(monkeypatch):
    """The ``causal_attention`` op of the kernel dispatch has the kernel first and ``pytorch``
    last; CPU tensors get the CPU candidate (the fused C++ kernel, ``tests/ops/test_causal_cpu_attention.py``),
    and ``pytorch`` when the switch forces the Triton kernel by its name."""
    from linformer_lab.feature_maps import build_feature_map
    from linformer_lab.ops import kernels

    assert [c.name for c in kernels.CANDIDATES["causal_attention"]] == ["triton", "cpp", kernels.PYTORCH]
    feature_map = build_feature_map("elu", query_dim=4)
    q = torch.randn(1, 2, 8, 4)
    assert kernels.select("causal_attention", feature_map, q, q, q).name != "triton"
    monkeypatch.setenv(kernels.SWITCH, "causal_attention=triton")
    assert kernels.forced() == {"causal_attention": "triton"}
    assert kernels.select("causal_attention", feature_map, q, q, q).name == kernels.PYTORCH


@pytest.mark.slow
def test_torch_compile_traces_through_the_custom_op(device):
    """``torch.compile(fullgraph=True)`` traces the op (fake tensors, registered autograd) and the
    layers' entry to it (``backend.accepts``, ``backend.causal_attention`` with a state): same
    outputs and gradients as eager."""
    from linformer_lab.attention import build_attention
    from linformer_lab.ops.cuda.triton_chunk import backend

    feature_map = build_attention("linear", causal=True, query_dim=8).feature_map
    q, k, v, s0, z0 = inputs(1, 2, 20, 8, 8, torch.float32, state=True, device=device)

    def f(q, k, v, s0, z0):
        out, state = backend.causal_attention(feature_map, q * 0.5, k, v, None, 1e-6, None, (s0, z0), True)
        accepted = backend.accepts(feature_map, q, k, v)  # False on CPU tensors: traced all the same
        return out.square().sum() + state[0].sum() + state[1].sum() + accepted

    tensors = (q, k, v, s0, z0)
    eager = torch.autograd.grad(f(*tensors), tensors)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for got, want in zip(torch.autograd.grad(compiled(*tensors), tensors), eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_opcheck(device):
    """torch.library's own checks of the op: schema, fake tensors, autograd registration."""
    q, k, v, s0, z0 = (x.detach().requires_grad_() for x in inputs(1, 1, 18, 4, 4, torch.float32, state=True, device=device))
    from linformer_lab.ops.cuda.triton_chunk.op import chunk_linear_attention_fwd

    torch.library.opcheck(chunk_linear_attention_fwd, (q, k, v, s0, z0, None, "elu", EPS, 16, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_a_second_derivative_is_an_error(device):
    """The backward operator has no gradient: differentiating grad q again (a grad_out that requires
    grad) raises instead of returning a wrong number."""
    q, k, v = (x.detach().requires_grad_() for x in inputs(1, 1, 18, 4, 4, torch.float32, device=device)[:3])
    out = chunk_linear_attention(q, k, v, chunk_size=16)
    weight = torch.randn_like(out, requires_grad=True)
    (grad_q,) = torch.autograd.grad(out, q, weight, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_q.sum().backward()


def _bad(**changes):
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 3)
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return args


@pytest.mark.parametrize("args, message", [
    (_bad(q=torch.randn(2, 8, 4)), "4-d tensors"),
    (_bad(k=torch.randn(1, 2, 8, 5)), "same shape"),
    (_bad(v=torch.randn(1, 2, 7, 3)), "every dim but the last"),
    (_bad(v=torch.randn(1, 2, 8, 3, dtype=torch.float64)), "float32, float16, bfloat16"),
    (_bad(feature_map="relu"), "feature_map must be 'elu'"),
    (_bad(chunk_size=48), "chunk_size must be one of"),
    (_bad(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens must be"),
    (_bad(initial_state=(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4))), "initial_state must be"),
    (_bad(q=torch.randn(1, 2, 8, 257), k=torch.randn(1, 2, 8, 257)), "must each be at most 256"),
    (_bad(v=torch.randn(1, 2, 8, 257)), "must each be at most 256"),
], ids=["dims", "qk", "v", "dtype", "feature_map", "chunk", "cu_seqlens", "state", "features", "values"])
def test_bad_input_is_one_line(args, message):
    with pytest.raises(ValueError, match=message) as info:
        chunk_linear_attention(**args)
    assert "\n" not in str(info.value)


class _OnCuda:
    """What ``backend.accepts`` reads of a CUDA tensor of ``shape`` (no GPU needed)."""

    device, dtype = torch.device("cuda", 0), torch.bfloat16

    def __init__(self, *shape):
        self.shape = torch.Size(shape)

    def dim(self):
        return len(self.shape)

    def numel(self):
        return self.shape.numel()


@pytest.mark.parametrize("feature_map, d, m, accepted", [
    ("elu", 64, 64, True), ("elu", 256, 256, True), ("elu", 320, 64, False), ("elu", 64, 320, False),
    ("favor", 64, 64, True),             # 256 features
    ("random_fourier", 64, 64, False),   # 512 features
    ("poly2", 16, 16, True),             # 153 features
    ("poly2", 64, 64, False), ("taylor", 64, 64, False), ("rebased", 32, 32, False),  # 2,145, 2,145, 528
])
def test_the_kernel_takes_features_and_values_up_to_its_widest(feature_map, d, m, accepted):
    """The GPU candidate takes a map's features and the values up to ``op.MAX_WIDTH`` wide, the
    widest whose kernels fit a GPU's shared memory (``test_triton_chunk_gpu.py`` compiles and
    checks); a wider map (the second-order ones at usual head sizes, random_fourier) would not
    launch, and goes to the op's next candidate."""
    from linformer_lab.feature_maps import build_feature_map
    from linformer_lab.ops.cuda.triton_chunk import backend, op

    phi_map = build_feature_map(feature_map, query_dim=d)
    assert (max(phi_map.output_dim, m) <= op.MAX_WIDTH) == accepted
    assert backend.accepts(phi_map, _OnCuda(2, 4, 64, d), _OnCuda(2, 4, 64, d), _OnCuda(2, 4, 64, m)) == accepted


@pytest.mark.slow
def test_fp32_elu_over_128_features_is_mapped_before_the_kernels(device, monkeypatch):
    """In fp32, elu inside the forward kernel at more than ``FUSED_ELU_FP32_MAX_WIDTH`` features would
    outgrow a GPU's shared memory: PyTorch maps q and k first and the kernels take them as mapped,
    with the same outputs and gradients as the definition; at 128 features it stays fused."""
    from linformer_lab.ops.cuda.triton_chunk import op

    taken = []
    run = op.chunk_linear_attention_fwd
    monkeypatch.setattr(op, "chunk_linear_attention_fwd", lambda *args: taken.append(args[6]) or run(*args))
    wide = op.FUSED_ELU_FP32_MAX_WIDTH + 8
    q, k, v = inputs(1, 1, 18, wide, 4, torch.float32, device=device)
    compare(lambda *x: chunk_linear_attention(*x, chunk_size=16), lambda *x: naive(*x)[0], (q, k, v), torch.float32,
            "fp32 elu, wide")
    q, k, v = inputs(1, 1, 18, op.FUSED_ELU_FP32_MAX_WIDTH, 4, torch.float32, device=device)
    chunk_linear_attention(q, k, v, chunk_size=16)
    assert list(dict.fromkeys(taken)) == ["none", "elu"]  # (the op's autograd calls it again below itself)


def test_bad_cu_seqlens_values_and_cpu_without_interpreter(monkeypatch):
    """cu_seqlens' values are checked on the device (no host read): on a CPU at once."""
    q = torch.randn(1, 1, 8, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="rise from 0 to the sequence length 8"):
        chunk_linear_attention(q, q, q, cu_seqlens=torch.tensor([0, 5, 4, 8]))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunk_linear_attention(q, q, q)


# --- half precision against the PyTorch form, with a GPU's arithmetic -------------------------------------------------


@pytest.fixture
def gpu_arithmetic():
    """Triton's interpreter doing a GPU's arithmetic for the test (``triton_emulation.py``): bf16
    decoded, tf32 operands truncated, fp32 -> bf16 rounded to nearest even."""
    from triton_emulation import gpu_arithmetic

    with gpu_arithmetic():
        yield


def test_emulated_roundings_are_the_gpus():
    """The emulation's conversions against torch's own (fp32 -> bf16 is round to nearest even in
    torch as on the GPU) and tf32 truncation keeping exactly the top 10 mantissa bits."""
    import numpy as np
    from triton_emulation import bf16_to_fp32, fp32_to_bf16, round_tf32, truncate_tf32

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)])  # ties: to even
    for values in (x, halfway):
        want = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert (fp32_to_bf16(values.numpy()) == want).all()
        assert (bf16_to_fp32(want) == values.to(torch.bfloat16).float().numpy()).all()
    one = np.float32(1 + 2**-10 + 2**-11 + 2**-20)
    assert truncate_tf32(np.array([one]))[0] == np.float32(1 + 2**-10)
    assert round_tf32(np.array([one]))[0] == np.float32(1 + 2**-9)


def test_fp16_gradients_as_exact_as_the_pytorch_form(device):
    """fp16 on the stock interpreter (numpy's exact products), v of mean 1: r taken from the
    fp16 output made dq 8x the PyTorch form's error at this length."""
    assert_as_exact_as_the_pytorch_form(torch.float16, 1024, 1.0, device=device)


def test_bf16_gradients_as_exact_as_the_pytorch_form_on_gpu_arithmetic(device, gpu_arithmetic):
    """bf16 with the GPU's roundings, v of mean 1: bf16 states made dq 11x at this length."""
    if device != "cpu":
        pytest.skip("the emulation patches the interpreter")
    assert_as_exact_as_the_pytorch_form(torch.bfloat16, 1024, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, t, d, mean", [(torch.float16, 1024, 32, 1.0), (torch.bfloat16, 1024, 32, 0.0),
                                               (torch.float16, 1024, 32, 0.0), (torch.bfloat16, 4096, 64, 1.0),
                                               (torch.float16, 2048, 64, 1.0)],
                         ids=["fp16-1024-mean-1", "bf16-1024-mean-0", "fp16-1024-mean-0", "bf16-4096-mean-1",
                              "fp16-2048-mean-1"])
def test_half_gradients_as_exact_on_gpu_arithmetic(device, gpu_arithmetic, dtype, t, d, mean):
    """More of the same with the GPU's roundings (fp16: tf32 truncation of fp32 operands made the
    output and dk, dv 2x); T = 4,096 at D = M = 64 is the longest the interpreter runs in seconds,
    for bf16 (the shorter mantissa: its errors grow first); fp16 at D = 64 to T = 2,048, a third
    of fp16's time at 4,096 (its kernel/PyTorch-form ratios alike at 1,024, 2,048 and 4,096)."""
    if device != "cpu":
        pytest.skip("the emulation patches the interpreter")
    assert_as_exact_as_the_pytorch_form(dtype, t, mean, d=d)


# --- strided inputs, no copies, no host reads --------------------------------------------------------------------------


def test_strided_views_in_and_the_layers_layout_out(device):
    """q, k, v as a layer makes them: ``(B, H, N, D)`` views of one fused ``(B, N, 3, H, D)``
    projection; the output flattened back to ``(B, N, H M)`` as a layer does, so the incoming
    gradient is a strided view too. Same results and gradients as the float64 definition, and
    the output already in ``(B, N, H, M)`` memory order (the layer's flatten is a view)."""
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(2, 21, 3, 2, 8, generator=gen).to(device).requires_grad_()

    def heads(x):
        return (t.transpose(1, 2) for t in x.unbind(2))

    def fast(x):
        out = chunk_linear_attention(*heads(x), chunk_size=16)
        assert out.transpose(1, 2).is_contiguous(), f"output strides {out.stride()}: not the layer's layout"
        return out.transpose(1, 2).flatten(2)

    compare(fast, lambda x: naive(*heads(x))[0].transpose(1, 2).flatten(2), (fused,), torch.float32, "strided")
