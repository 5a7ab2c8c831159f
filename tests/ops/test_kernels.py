"""The kernel dispatch (linformer_lab/ops/kernels.py): which candidate computes each op under each
condition (device, dtype, autocast, shapes, the build, the LINFORMER_LAB_KERNELS switch), the
switch's errors, describe(), and that the ``linear`` backend runs what it picks: on CPU the C++
kernel, under the switch the ``pytorch`` candidate, both equal to the float64 O(N^2) definition; for
CUDA tensors the CUDA kernel (fake CUDA tensors and a stand-in kernel here: no GPU in CI).

The fast tests stand in for the builds (each candidate's ``available``); the ones marked slow load
(and may compile) the real C++ extensions.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import linformer_lab as ll
from linformer_lab.ops import kernel_check, kernels
from linformer_lab.ops.linear_attention import naive


def candidate(op: str, name: str) -> kernels.Candidate:
    (found,) = [c for c in kernels.CANDIDATES[op] if c.name == name]
    return found


@pytest.fixture
def builds(monkeypatch):
    """Stand-ins for the builds: ``builds(recurrence=True, lsh=False, ...)`` sets whether each
    candidate's build can be had."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)

    def set_builds(**available):
        for (op, name), ok in {("causal", "cuda"): available.get("cuda", False),
                               ("causal", "recurrence"): available.get("recurrence", False),
                               ("lsh_window", "cpp"): available.get("lsh", False),
                               ("fused_step", "cpp"): available.get("fused", False)}.items():
            monkeypatch.setattr(candidate(op, name), "available", lambda ok=ok: ok)

    return set_builds


def chosen(op, *args) -> str:
    return kernels.select(op, *args).name


def qkv(device="cpu", dtype=torch.float32, c=8, m=8):
    return tuple(torch.zeros(2, 2, 5, d, device=device, dtype=dtype) for d in (c, c, m))


# ---------------------------------------------------------------- conditions


def test_cpu_float32_and_float64_take_the_cpp_kernel_where_it_builds(builds):
    builds(recurrence=True)
    assert chosen("causal", *qkv()) == chosen("causal", *qkv(dtype=torch.float64)) == "recurrence"
    assert chosen("causal", *qkv(c=7, m=5)) == "recurrence"  # zero-padded to whole registers
    builds()
    assert chosen("causal", *qkv()) == "pytorch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cpu_takes_the_recurrence_for_causal_else_pytorch(builds, dtype):
    builds(recurrence=True, lsh=True)
    assert chosen("causal", *qkv(dtype=dtype)) == "recurrence"  # run as float32 (tests/ops/test_kernels_half.py)
    assert chosen("lsh_window", *qkv(dtype=dtype)) == "pytorch"
    builds()
    assert chosen("causal", *qkv(dtype=dtype)) == "pytorch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_autocast_takes_the_recurrence_for_causal_and_mixed_dtypes_pytorch(builds, dtype):
    builds(recurrence=True, lsh=True, fused=True)
    with torch.autocast("cpu", dtype=dtype):
        assert chosen("causal", *qkv()) == chosen("causal", *qkv(dtype=dtype)) == "recurrence"
        assert chosen("lsh_window", *qkv()) == "pytorch"
        assert chosen("fused_step", torch.zeros(1, 16)) == "pytorch"
    q, k, v = qkv()
    assert chosen("causal", q, k, v.double()) == "pytorch"
    assert chosen("causal", q, k, v) == "recurrence"


def test_fused_step_only_for_small_cpu_batches(builds):
    builds(fused=True)
    assert chosen("fused_step", torch.zeros(kernels.FUSED_MAX_BATCH, 16)) == "cpp"
    assert chosen("fused_step", torch.zeros(kernels.FUSED_MAX_BATCH + 1, 16)) == "pytorch"
    assert chosen("fused_step", torch.zeros(1, 16, dtype=torch.float16)) == "pytorch"


def test_cuda_tensors_take_the_cuda_kernel_where_it_is_available(builds):
    builds(recurrence=True, cuda=True)
    with FakeTensorMode():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert chosen("causal", *qkv("cuda", dtype)) == "cuda"
        assert chosen("causal", *qkv("cuda", c=257)) == "pytorch"  # past the kernel's tiles
        assert chosen("causal", *qkv("cuda", torch.float64)) == "pytorch"
        assert chosen("lsh_window", *qkv("cuda")) == "pytorch"
        assert chosen("fused_step", torch.zeros(1, 16, device="cuda")) == "pytorch"
        builds(recurrence=True, cuda=False)
        assert chosen("causal", *qkv("cuda")) == "pytorch"
    assert chosen("causal", *qkv()) == "recurrence"  # CPU tensors never take the CUDA kernel


# ---------------------------------------------------------------- the switch


@pytest.mark.parametrize("value, expected", [
    ("", {}), ("auto", {}), ("pytorch", {op: "pytorch" for op in kernels.CANDIDATES}),
    ("causal=recurrence", {"causal": "recurrence"}),
    (" causal = pytorch , lsh_window=cpp ", {"causal": "pytorch", "lsh_window": "cpp"}),
])
def test_switch_values(monkeypatch, value, expected):
    monkeypatch.setenv(kernels.SWITCH, value)
    assert kernels.forced() == expected


def test_switch_forces_a_candidate_where_it_applies_and_pytorch_elsewhere(builds, monkeypatch):
    builds(recurrence=True, lsh=True, fused=True, cuda=True)
    monkeypatch.setenv(kernels.SWITCH, "causal=recurrence")
    assert chosen("causal", *qkv()) == "recurrence"
    assert chosen("lsh_window", *qkv()) == "cpp"  # other ops unaffected
    with FakeTensorMode():
        assert chosen("causal", *qkv("cuda")) == "pytorch"  # the recurrence does not apply to CUDA tensors
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    assert [chosen("causal", *qkv()), chosen("lsh_window", *qkv()), chosen("fused_step", torch.zeros(1, 4))] \
        == ["pytorch"] * 3


@pytest.mark.parametrize("value, names", [
    ("causal=fast", "its kernels: cuda, recurrence, pytorch"),
    ("attention=pytorch", "an op among causal, lsh_window, fused_step, causal_attention"),
    ("0", "is not 'auto', 'pytorch' or op=kernel"),
    ("reference", "is not 'auto', 'pytorch' or op=kernel"),  # the pytorch candidates' earlier name
])
def test_a_bad_switch_value_is_one_line_naming_the_choices(monkeypatch, value, names):
    monkeypatch.setenv(kernels.SWITCH, value)
    with pytest.raises(ValueError) as error:
        kernels.select("causal", *qkv())
    assert "\n" not in str(error.value) and names in str(error.value) and kernels.SWITCH in str(error.value)


def test_an_unknown_op_names_the_ops():
    with pytest.raises(ValueError, match="unknown op 'causal_numerator'; ops: causal, lsh_window"):
        kernels.select("causal_numerator")


# ---------------------------------------------------------------- describe


def test_describe_names_the_chosen_candidate_per_op(builds, monkeypatch):
    builds(recurrence=True, fused=False)
    monkeypatch.setattr(candidate("causal", "recurrence"), "detail", lambda: "avx2")
    lines = kernel_check.describe()
    assert lines[0] == "causal op on cpu (float32, C = M = 32): C++ recurrence (ops/cpu/causal_recurrence.cpp), avx2"
    assert lines[1].startswith("lsh_window op on cpu (float32): PyTorch window step")
    assert lines[2].startswith("fused_step op on cpu (float32, batch 1): Python step")
    assert lines[-1].startswith(f"{kernels.SWITCH} unset")
    monkeypatch.setenv(kernels.SWITCH, "causal=pytorch")
    assert kernel_check.describe()[0].startswith("causal op on cpu (float32, C = M = 32): PyTorch chunked numerator")
    assert kernel_check.describe()[-1] == f"{kernels.SWITCH}=causal=pytorch: forced {{'causal': 'pytorch'}}"


# ---------------------------------------------------------------- what linear runs


def linear_inputs(c: int, m: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 37, d, generator=gen, dtype=dtype, requires_grad=True) for d in (c, c, m)]


def naive_linear(attention, q, k, v):
    """Causal linear attention in float64 from its definition (eq. 9): features, then the O(N^2) form."""
    phi = attention.feature_map
    similarity = naive.kernel_similarity(phi(q.double()), phi(k.double()))
    return naive.attention_from_similarity(similarity, v.double(), causal=True, eps=attention.eps)


@pytest.mark.slow
@pytest.mark.parametrize("c, m, kernel", [(16, 16, "cpp"), (7, 5, "cpp")])  # 7, 5: zero-padded
@pytest.mark.parametrize("switch", ["", "pytorch"])
def test_linear_on_cpu_runs_the_cpp_kernel_or_under_the_switch_pytorch(
        causal_extension, monkeypatch, c, m, kernel, switch):
    """The causal layer (elu map) takes the fused C++ attention (the causal_attention op's cpp candidate)."""
    monkeypatch.setenv(kernels.SWITCH, switch)
    ran = []
    for name in ("cpp", "pytorch"):
        entry = candidate("causal_attention", name)
        monkeypatch.setattr(entry, "run", lambda *a, run=entry.run, name=name: ran.append(name) or run(*a))
    attention = ll.build_attention("linear", causal=True, query_dim=c)
    q, k, v = linear_inputs(c, m)
    out = attention(q, k, v)
    assert ran == [kernel if not switch else "pytorch"]
    expected = naive_linear(attention, q, k, v)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected_grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(expected))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_the_real_build_is_selected_for_every_width(causal_extension):
    assert chosen("causal", *qkv(c=32, m=32)) == chosen("causal", *qkv(c=7, m=5)) == "recurrence"
    assert kernel_check.describe()[0].startswith("causal op on cpu (float32, C = M = 32): C++ recurrence")


def test_linear_on_cuda_tensors_calls_the_cuda_kernel(builds, monkeypatch):
    """With fake CUDA tensors and a stand-in for the kernel: ``linear`` hands the numerator of a
    CUDA input to the CUDA candidate, which gets the feature-mapped inputs."""
    builds(cuda=True)
    calls = []

    def cuda_stand_in(q, k, v, chunk_size=None, initial_state=None, return_final_state=False):
        calls.append((q.device.type, q.shape, v.shape))
        return torch.zeros_like(v)

    monkeypatch.setattr(candidate("causal", "cuda"), "run", cuda_stand_in)
    attention = ll.build_attention("linear", causal=True, query_dim=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.zeros(1, 2, 6, d, device="cuda") for d in (4, 4, 3))
        out = attention(q, k, v)
    assert calls == [("cuda", torch.Size([1, 2, 6, 4]), torch.Size([1, 2, 6, 3]))] and out.shape == (1, 2, 6, 3)


# ---------------------------------------------------------------- force: one call's choice over the switch


def test_force_picks_the_named_candidate_where_it_applies_over_the_switch(builds, monkeypatch):
    builds(recurrence=True, cuda=True)
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    assert kernels.select("causal", *qkv(), force="recurrence").name == "recurrence"
    assert kernels.select("causal", *qkv(), force="cuda").name == "pytorch"  # CPU tensors: not the CUDA kernel
    with FakeTensorMode():
        assert kernels.select("causal", *qkv("cuda"), force="cuda").name == "cuda"
    with pytest.raises(ValueError) as error:
        kernels.select("causal", *qkv(), force="triton")
    assert "\n" not in str(error.value) and "its kernels: cuda, recurrence, pytorch" in str(error.value)


def test_linear_cuda_is_linear_with_the_gpu_kernels_forced(builds, monkeypatch):
    """``linear_cuda`` is no class of its own: the registry's second name of ``LinearAttention``,
    built with ``gpu_kernels``, whose ``forced_kernels`` name the GPU kernels; here on fake CUDA
    tensors without Triton, so the ``causal_attention`` op falls to its PyTorch candidate and the
    numerator goes to the CUDA kernel, although the switch says ``pytorch``; ``linear`` under the
    same switch keeps to the PyTorch candidates."""
    from linformer_lab.attention.linear import LinearAttention
    from linformer_lab.registry import ATTENTION

    builds(cuda=True)
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    assert ATTENTION.get("linear_cuda") is ATTENTION.get("linear") is LinearAttention
    assert ATTENTION.arguments("linear_cuda") == {"gpu_kernels": True} and ATTENTION.arguments("linear") == {}
    built = ll.build_attention("linear_cuda", causal=True, query_dim=4, eps=1e-5)
    assert type(built) is LinearAttention and built.gpu_kernels and built.eps == 1e-5
    assert built.forced_kernels == {"causal_attention": "triton", "causal": "cuda"}
    assert ll.build_attention("linear", causal=True, query_dim=4).forced_kernels == {}
    ran = []
    for name in ("cuda", "pytorch"):
        entry = candidate("causal", name)
        monkeypatch.setattr(entry, "run", lambda *a, run=entry.run, name=name: ran.append(name) or run(*a))
    monkeypatch.setattr(candidate("causal", "cuda"), "run",
                        lambda q, k, v, *rest: ran.append("cuda") or torch.zeros_like(v))
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.zeros(1, 2, 6, d, device="cuda") for d in (4, 4, 3))
        for backend in ("linear_cuda", "linear"):
            out = ll.build_attention(backend, causal=True, query_dim=4)(q, k, v)
            assert out.shape == (1, 2, 6, 3)
    assert ran == ["cuda", "pytorch"]
