"""The Triton kernels (``causal_attention=triton`` and the graph decoder's step) compiled for a GPU:
for Hopper on any machine (Triton's own ptxas and cuobjdump; no GPU needed), and the chunk kernels run
on a CUDA GPU at N = 65,536 in fp32, fp16 and bf16 against the float64 chunked reference of the
library (``ops.linear_attention.causal_linear_attention``, an independent implementation: PyTorch
matmuls per chunk and a cumulative sum).

The interpreter tests (``test_triton_chunk.py``, with a GPU's roundings emulated) run the same
kernels' arithmetic, but not Triton's compiler: a kernel can be right in numpy and not compile,
or compile to slow code (no tensor-core instructions, registers spilled to local memory). The
compile tests catch that. Half precision at N = 65,536 is held to the PyTorch chunk form's error
in the same dtype (``triton_accuracy.py``), with v of mean 1 and 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton_accuracy import assert_as_exact_as_the_pytorch_form  # noqa: E402

from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention, launch, op  # noqa: E402
from linformer_lab.ops.linear_attention import causal_linear_attention  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tool(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def _sass_and_resources(cubin: bytes, tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "inspected.cubin"
    path.write_bytes(cubin)
    tool = [str(_tool("cuobjdump"))]
    sass = subprocess.run([*tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    resources = subprocess.run([*tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return sass, resources


#: Compiles the kernels for a GPU in a fresh interpreter (the compiler needs the real
#: triton.language, which an earlier import under TRITON_INTERPRET=1 replaced) and writes the cubins
#: of each build named in argv after the out dir, CAPABILITY-DTYPE-PACKED-ELU-WIDTH (packed and elu
#: 0 or 1, C = M = width), into out/BUILD, with each kernel's shared memory in bytes, which only the
#: compiler's metadata holds; the chunk the op takes by default at that width.
_COMPILE = """
import sys, torch
from pathlib import Path
from linformer_lab.ops.cuda.triton_chunk import launch, op
out = Path(sys.argv[1])
for build in sys.argv[2:]:
    capability, dtype, varlen, elu, width = build.split("-")
    capability, dtype, width = tuple(map(int, capability.split("."))), getattr(torch, dtype), int(width)
    (out / build).mkdir()
    chunk = op.default_chunk(width, width, dtype)
    kernels = launch.compile_for(capability, dtype, width, width, chunk, varlen=varlen == "1", elu=elu == "1")
    for name, kernel in kernels.items():
        (out / build / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
        (out / build / f"{name}.shared").write_text(str(kernel.metadata.shared))
"""
#: every Triton kernel, the graph decoder's step included: one added to launch.KERNELS is compiled and checked here
KERNEL_NAMES = set(launch.KERNELS)
#: (capability, dtype, packed, elu fused, C = M) of the Hopper builds: the training dtype, fp16 packed, fp32
HOPPER_BUILDS = [("9.0", "bfloat16", False, True, 128), ("9.0", "float16", True, True, 128),
                 ("9.0", "float32", False, True, 128)]
#: The most shared memory one Hopper program may take (227 KiB, opted into): a kernel that asks for
#: more compiles but fails at its first launch on the GPU (Triton's OutOfResources).
HOPPER_SHARED_BYTES = 227 * 1024
#: The builds at the widest the op takes (``op.MAX_WIDTH``; fp32 with elu fused up to
#: ``op.FUSED_ELU_FP32_MAX_WIDTH``, mapped first above it) for compute capability 8.6, whose programs
#: have the least shared memory of the GPUs the kernels run on (8.6 and 8.9: 99 KiB)
WIDEST_BUILDS = [("8.6", "bfloat16", False, True, op.MAX_WIDTH), ("8.6", "float16", False, True, op.MAX_WIDTH),
                 ("8.6", "float32", False, False, op.MAX_WIDTH),
                 ("8.6", "float32", False, True, op.FUSED_ELU_FP32_MAX_WIDTH)]
SMALLEST_SHARED_BYTES = 99 * 1024


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """{build: {kernel: (SASS, stack bytes, shared bytes)}} of every kernel of every build of
    :data:`HOPPER_BUILDS` and :data:`WIDEST_BUILDS`, all in one child process (its start costs as
    much as a build)."""
    if not _tool("cuobjdump").exists():
        pytest.skip("this Triton wheel carries no cuobjdump")
    if torch.cuda.is_available():
        pytest.skip("a check for machines without a GPU: on a GPU the kernels compile for it when they run")
    tmp_path = tmp_path_factory.mktemp("compiled")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    builds = HOPPER_BUILDS + WIDEST_BUILDS
    names = ["-".join(str(int(x)) if isinstance(x, bool) else str(x) for x in build) for build in builds]
    subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path), *names], env=env, check=True, cwd=REPO, timeout=900)
    result = {}
    for build, name in zip(builds, names):
        assert {p.stem for p in (tmp_path / name).glob("*.cubin")} == KERNEL_NAMES
        result[build] = {}
        for kernel in sorted(KERNEL_NAMES):
            sass, resources = _sass_and_resources((tmp_path / name / f"{kernel}.cubin").read_bytes(), tmp_path)
            shared = int((tmp_path / name / f"{kernel}.shared").read_text())
            result[build][kernel] = (sass, int(re.search(r"STACK:(\d+)", resources).group(1)), shared)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("build", HOPPER_BUILDS, ids=["bf16", "fp16-packed", "fp32"])
def test_kernels_compile_for_hopper(compiled, build):
    """Every kernel compiles for sm_90 at C = M = 128 with the op's default chunk; in bf16 (the
    training dtype) nothing spills to local memory and the walks run on Hopper's warpgroup
    tensor-core instructions (HGMMA). fp16 and fp32 keep fp32-exact tf32 products, which may
    spill a little at this width: compiled, their stack printed (-s). In every dtype each kernel's
    shared memory fits one Hopper program, so that its first launch cannot fail for it."""
    dtype = build[1]
    for name, (sass, stack, shared) in compiled[build].items():
        print(f"{dtype} {name}: stack {stack} bytes, shared {shared} bytes, HGMMA {'HGMMA' in sass}")
        assert shared <= HOPPER_SHARED_BYTES, f"{name}: {shared} bytes of shared memory"
        if dtype != "bfloat16":
            continue
        assert stack == 0 and "LDL" not in sass and "STL" not in sass, f"{name}: local memory ({stack} bytes)"
        if name in ("superchunk_forward", "superchunk_dk_dv", "superchunk_deltas"):
            assert "HGMMA" in sass, f"{name}: no warpgroup tensor-core instruction in the SASS"


@pytest.mark.slow
@pytest.mark.parametrize("build", WIDEST_BUILDS, ids=["bf16", "fp16", "fp32-mapped", "fp32-elu"])
def test_the_widest_kernels_fit_the_smallest_gpu(compiled, build):
    """At the widest features and values the op gives the kernels, each kernel's shared memory fits
    a program of the GPUs with the least of it (compute capability 8.6 and 8.9), so that no first
    launch fails for it; wider maps go to the PyTorch candidate (``test_triton_chunk.py``)."""
    for name, (_, stack, shared) in compiled[build].items():
        print(f"{build[1]} C = M = {build[4]}, elu {build[3]}: {name}: shared {shared} bytes, stack {stack} bytes")
        assert shared <= SMALLEST_SHARED_BYTES, f"{name}: {shared} bytes of shared memory at C = M = {build[4]}"


def _reference(q, k, v, eps=1e-6):
    """float64 causal linear attention with the elu feature map: the library's PyTorch path."""
    return causal_linear_attention(torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1, v, eps=eps)


@CUDA
@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "fp16", "bf16"])
def test_long_sequence_against_float64(dtype, tol):
    """N = 65,536 (1,024 chunks of 64): outputs and the gradients of q, k, v, ||got - ref|| / ||ref||."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, n, d = 1, 2, 65_536, 64
    q, k, v, grad = (torch.randn(b, h, n, d, device="cuda", generator=gen) for _ in range(4))
    fast = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    refs = [x.detach().double().requires_grad_() for x in fast]
    out = chunk_linear_attention(*fast)
    want = _reference(*refs)
    out.backward(grad.to(dtype))
    want.backward(grad.double())
    for name, got, ref in [("out", out, want), *((f"grad {n}", x.grad, r.grad) for n, x, r in zip("qkv", fast, refs))]:
        assert torch.isfinite(got).all(), f"{dtype} {name}: non-finite values"
        error = ((got.double() - ref).norm() / ref.norm()).item()
        assert error < tol, f"{dtype} {name}: relative error {error:.3g} > {tol:g}"


@CUDA
@pytest.mark.slow
@pytest.mark.parametrize("mean", [1.0, 0.0], ids=["v-mean-1", "v-mean-0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_as_exact_as_the_pytorch_form_at_65536(dtype, mean):
    """N = 65,536, D = M = 64, v of mean 1 (where dq and dk subtract nearly equal terms; zero-mean
    v hides it) and 0: the output and the gradients of q, k, v, S_0, z_0 within 1.5x the error
    of the PyTorch chunk form in the same dtype (the interpreter tests reach T = 4,096)."""
    assert_as_exact_as_the_pytorch_form(dtype, 65_536, mean, d=64, device="cuda")


@CUDA
@pytest.mark.slow
def test_compilations_are_reported():
    """A forward and backward at a shape not compiled before: ``launch.compile_report()`` names
    each kernel compiled, with its config and seconds (printed with -s); a second call compiles nothing."""
    q, k, v = (torch.randn(1, 2, 1000, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    before = len(launch.compile_report())
    chunk_linear_attention(q, k, v, chunk_size=32).sum().backward()
    new = launch.compile_report()[before:]
    for entry in new:
        print(f"compiled {entry['kernel']} {entry['key']}: {entry['config']} in {entry['seconds']:.2f} s")
    assert {e["kernel"] for e in new} >= {"superchunk_forward", "superchunk_backward_prepare", "superchunk_dq",
                                          "superchunk_dk_dv"}
    chunk_linear_attention(q, k, v, chunk_size=32).sum().backward()
    assert len(launch.compile_report()) == before + len(new)


@CUDA
@pytest.mark.slow
def test_state_and_packing_on_gpu_in_bf16():
    """bf16 (untestable in the interpreter) with state in and out and packed sequences, against
    the same kernel in fp32: the bf16 path shares everything but its dtypes."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    h, d, edges = 4, 64, torch.tensor([0, 100, 1000, 1000, 5000], device="cuda")
    q, k, v = (torch.randn(1, h, 5000, d, device="cuda", generator=gen) for _ in range(3))
    s0 = torch.rand(4, h, d, d, device="cuda", generator=gen)
    z0 = torch.rand(4, h, d, device="cuda", generator=gen)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        results[dtype] = chunk_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), initial_state=(s0, z0),
                                                return_final_state=True, cu_seqlens=edges)
    (out32, (s32, z32)), (out16, (s16, z16)) = results[torch.float32], results[torch.bfloat16]
    for name, got, ref in (("out", out16, out32), ("S_N", s16, s32), ("z_N", z16, z32)):
        error = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert error < 3e-2, f"bf16 {name}: relative error {error:.3g} against fp32"


@CUDA
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["linear", "linear_cuda"])
def test_layers_run_the_kernel_and_equal_the_reference(monkeypatch, backend):
    """On a GPU ``linear`` (through the kernel dispatch) and ``linear_cuda`` (insisting) run the
    Triton kernel; both equal ``linear`` on the PyTorch candidates (``LINFORMER_LAB_KERNELS=pytorch``),
    state and gradients included."""
    from linformer_lab.attention import build_attention
    from linformer_lab.ops import kernels
    from linformer_lab.ops.cuda.triton_chunk import backend as triton_backend

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(3, 4, 1000, 32, device="cuda", generator=gen).requires_grad_() for _ in range(3))

    def run(name):
        attention = build_attention(name, causal=True, query_dim=32).cuda()
        out, state = attention(q, k, v, return_state=True)
        grads = torch.autograd.grad((out.square().sum() + state[0].sum() + state[1].sum()), (q, k, v))
        return attention, (out, state[0], state[1], *grads)

    attention, got = run(backend)
    assert kernels.select("causal_attention", attention.feature_map, q, k, v).name == "triton"
    assert triton_backend.accepts(attention.feature_map, q, k, v)
    monkeypatch.setenv(kernels.SWITCH, "pytorch")
    _, want = run("linear")
    for i, (g, w) in enumerate(zip(got, want)):
        error = ((g.double() - w.double()).norm() / w.double().norm()).item()
        assert error < 1e-4, f"{backend}: result {i} differs from the reference by {error:.3g}"
