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
    """Stand-ins for the builds: ``builds(cpp=True, lsh=False, ...)`` sets whether each
    candidate's build can be had (``cpp``: the fused causal attention's)."""
    monkeypatch.delenv(kernels.SWITCH, raising=False)

    def set_builds(**available):
        for (op, name), ok in {("causal", "cuda"): available.get("cuda", False),
                               ("causal_attention", "cpp"): available.get("cpp", False),
                               ("lsh_window", "cpp"): available.get("lsh", False),
                               ("fused_step", "cpp"): available.get("fused", False)}.items():
            monkeypatch.setattr(candidate(op, name), "available", lambda ok=ok: ok)

    return set_builds


def chosen(op, *args) -> str:
    return kernels.select(op, *args).name


def qkv(device="cpu", dtype=torch.float32, c=8, m=8):
    return tuple(torch.zeros(2, 2, 5, d, device=device, dtype=dtype) for d in (c, c, m))


def mapped(*args, **kwargs):
    """The ``causal_attention`` op's probe arguments: the elu map, then :func:`qkv`."""
    from linformer_lab.feature_maps.elu import EluFeatureMap

    q, k, v = qkv(*args, **kwargs)
    return EluFeatureMap(q.shape[-1]), q, k, v


# ---------------------------------------------------------------- conditions


def test_cpu_float32_and_float64_take_the_cpp_kernel_where_it_builds(builds):
    builds(cpp=True)
    assert chosen("causal_attention", *mapped()) == chosen("causal_attention", *mapped(dtype=torch.float64)) == "cpp"
    assert chosen("causal_attention", *mapped(c=7, m=5)) == "cpp"  # zero-padded to whole registers
    assert chosen("causal", *qkv()) == "pytorch"  # the numerator alone has no CPU kernel
    builds()
    assert chosen("causal_attention", *mapped()) == "pytorch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cpu_takes_the_cpp_kernel_for_causal_attention_else_pytorch(builds, dtype):
    builds(cpp=True, lsh=True)
    assert chosen("causal_attention", *mapped(dtype=dtype)) == "cpp"  # run as float32 (tests/ops/test_kernels_half.py)
    assert chosen("lsh_window", *qkv(dtype=dtype)) == "pytorch"
    builds()
    assert chosen("causal_attention", *mapped(dtype=dtype)) == "pytorch"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_autocast_takes_the_cpp_kernel_for_causal_attention_and_mixed_dtypes_pytorch(builds, dtype):
    builds(cpp=True, lsh=True, fused=True)
    with torch.autocast("cpu", dtype=dtype):
        assert chosen("causal_attention", *mapped()) == chosen("causal_attention", *mapped(dtype=dtype)) == "cpp"
        assert chosen("lsh_window", *qkv()) == "pytorch"
        assert chosen("fused_step", torch.zeros(1, 16)) == "pytorch"
    feature_map, q, k, v = mapped()
    assert chosen("causal_attention", feature_map, q, k, v.double()) == "pytorch"
    assert chosen("causal_attention", feature_map, q, k, v) == "cpp"


def test_fused_step_only_for_small_cpu_batches(builds):
    builds(fused=True)
    assert chosen("fused_step", torch.zeros(kernels.FUSED_MAX_BATCH, 16)) == "cpp"
    assert chosen("fused_step", torch.zeros(kernels.FUSED_MAX_BATCH + 1, 16)) == "pytorch"
    assert chosen("fused_step", torch.zeros(1, 16, dtype=torch.float16)) == "pytorch"


def test_cuda_tensors_take_the_cuda_kernel_where_it_is_available(builds):
    builds(cpp=True, cuda=True)
    with FakeTensorMode():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert chosen("causal", *qkv("cuda", dtype)) == "cuda"
        assert chosen("causal", *qkv("cuda", c=257)) == "pytorch"  # past the kernel's tiles
        assert chosen("causal", *qkv("cuda", torch.float64)) == "pytorch"
        assert chosen("lsh_window", *qkv("cuda")) == "pytorch"
        assert chosen("fused_step", torch.zeros(1, 16, device="cuda")) == "pytorch"
        assert chosen("causal_attention", *mapped("cuda")) == "pytorch"  # the C++ kernel takes CPU tensors only
        builds(cpp=True, cuda=False)
        assert chosen("causal", *qkv("cuda")) == "pytorch"
    builds(cpp=True, cuda=True)
    assert chosen("causal", *qkv()) == "pytorch"  # CPU tensors never take the CUDA kernel


# ---------------------------------------------------------------- the switch


@pytest.mark.parametrize("value, expected", [
    ("", {}), ("auto", {}), ("pytorch", {op: "pytorch" for op in kernels.CANDIDATES}),
    ("causal_attention=cpp", {"causal_attention": "cpp"}),
    (" causal = pytorch , lsh_window=cpp ", {"causal": "pytorch", "lsh_window": "cpp"}),
])
def test_switch_values(monkeypatch, value, expected):
    monkeypatch.setenv(kernels.SWITCH, value)
    assert kernels.forced() == expected


def test_switch_forces_a_candidate_where_it_applies_and_pytorch_elsewhere(builds, monkeypatch):
    builds(cpp=True, lsh=True, fused=True, cuda=True)
    monkeypatch.setenv(kernels.SWITCH, "causal=pytorch")
    with FakeTensorMode():
        assert chosen("causal", *qkv("cuda")) == "pytorch"  # the CUDA kernel applies, the switch says no
    assert chosen("lsh_window", *qkv()) == "cpp"  # other ops unaffected
    monkeypatch.setenv(kernels.SWITCH, "causal_attention=cpp")
    assert chosen("causal_attention", *mapped()) == "cpp"
    with FakeTensorMode():
        assert chosen("causal_attention", *mapped("cuda")) == "pytorch"  # the C++ kernel does not apply to CUDA tensors
        assert chosen("causal", *qkv("cuda")) == "cuda"
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    assert [chosen("causal_attention", *mapped()), chosen("lsh_window", *qkv()), chosen("fused_step", torch.zeros(1, 4))] \
        == ["pytorch"] * 3


@pytest.mark.parametrize("value, names", [
    ("causal=fast", "its kernels: cuda, pytorch"),
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
    builds(cpp=True, fused=False)
    cpp = candidate("causal_attention", "cpp")
    monkeypatch.setattr(cpp, "detail", lambda: "avx2")

    def line(op: str) -> str:
        (found,) = [text for text in kernel_check.describe() if text.startswith(f"{op} op on cpu (")]
        return found

    assert line("causal_attention").endswith(f"): {cpp.description}, avx2")
    assert line("causal").endswith(f"): {kernels.fallback('causal').description}")
    assert line("lsh_window").startswith("lsh_window op on cpu (float32): PyTorch window step")
    assert line("fused_step").startswith("fused_step op on cpu (float32, batch 1): Python step")
    assert kernel_check.describe()[-1].startswith(f"{kernels.SWITCH} unset")
    monkeypatch.setenv(kernels.SWITCH, "causal_attention=pytorch")
    assert line("causal_attention").endswith(f"): {kernels.fallback('causal_attention').description}")
    assert kernel_check.describe()[-1] == f"{kernels.SWITCH}=causal_attention=pytorch: forced {{'causal_attention': 'pytorch'}}"


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
    assert chosen("causal_attention", *mapped(c=32, m=32)) == chosen("causal_attention", *mapped(c=7, m=5)) == "cpp"
    assert any(line.startswith("causal_attention op on cpu (") and "C++ recurrence" in line for line in kernel_check.describe())


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
    builds(cpp=True, cuda=True)
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    assert kernels.select("causal_attention", *mapped(), force="cpp").name == "cpp"
    assert kernels.select("causal", *qkv(), force="cuda").name == "pytorch"  # CPU tensors: not the CUDA kernel
    with FakeTensorMode():
        assert kernels.select("causal", *qkv("cuda"), force="cuda").name == "cuda"
    with pytest.raises(ValueError) as error:
        kernels.select("causal", *qkv(), force="triton")
    assert "\n" not in str(error.value) and "its kernels: cuda, pytorch" in str(error.value)


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
