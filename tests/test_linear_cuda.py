"""Tests of the linear_cuda backend (linformer_lab.ops.cuda).

Three groups:

* CPU, always run: argument parsing, the no-GPU error path, a compile of the extension with the
  machine's nvcc (``cuda_build`` marker; sm_80 only, cached in
  ``~/.cache/linformer_lab/cuda_build_test``: about 2-4 minutes on 2 cores the first time, then
  ninja finds it up to date), and the kernel source executed by a CPU emulation of CUDA
  (``cuda_emulation`` marker; the emulator binaries are cached too) against a float64
  reference -- the only check of the kernels' arithmetic that CI can run.
* GPU (skipped without CUDA): values and gradients against a float64 reference, long sequences,
  many heads, streams, devices, error messages.

Run everything on a GPU machine with ``uv run pytest tests/test_linear_cuda.py -v``; leave out the
slow CPU compiles with ``-m "not cuda_build and not cuda_emulation"``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from linformer_lab.ops import cuda as lcuda

REPO = Path(__file__).resolve().parents[1]
CUDA_SRC = REPO / "linformer_lab" / "ops" / "cuda"
CACHE = Path(os.environ.get("LINFORMER_LAB_TEST_CACHE", Path.home() / ".cache" / "linformer_lab"))

_HAS_GPU = lcuda.is_available()


def gpu(test):
    """Marks a test that needs the GPU; its time limit covers the first test's JIT build."""
    test = pytest.mark.timeout(1800)(test)
    return pytest.mark.skipif(not _HAS_GPU, reason="needs a CUDA GPU (and nvcc or a cached build)")(test)


# ------------------------------------------------------------------------------------------------
# float64 references
# ------------------------------------------------------------------------------------------------


def naive_causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """out_i = sum_{j<=i} (q_i . k_j) v_j by the O(N^2) definition; q, k (..., N, D), v (..., N, M)."""
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("...id,...jd->...ij", q, k).masked_fill(~mask, 0)
    return scores @ v


def reference(q, k, v, grad_out=None):
    """float64 output (and gradients by autograd of the naive definition)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(grad_out is not None) for t in (q, k, v))
    out = naive_causal_dot_product(q64, k64, v64)
    if grad_out is None:
        return out.detach()
    out.backward(grad_out.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (the largest error relative to the output's scale)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def make_inputs(b, h, n, d, m, dtype, device="cpu", seed=0):
    """Feature-mapped (positive) q, k scaled by 1/D so scores stay O(1); v, grad_out standard normal."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, d, generator=gen) / d
    k = torch.rand(b, h, n, d, generator=gen)
    v = torch.randn(b, h, n, m, generator=gen)
    g = torch.randn(b, h, n, m, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, g)]


# ------------------------------------------------------------------------------------------------
# CPU tests
# ------------------------------------------------------------------------------------------------


def test_parse_arch_list():
    a = lcuda.parse_arch_list("9.0;8.0 8.6+PTX,90")
    assert [str(x) for x in a] == ["8.0", "8.6+PTX", "9.0"]
    assert [str(x) for x in lcuda.parse_arch_list(["sm_90a", "120"])] == ["9.0a", "12.0"]
    assert lcuda.parse_arch_list("8.0")[0].gencode_flags() == ["-gencode=arch=compute_80,code=sm_80"]
    assert lcuda.parse_arch_list("9.0+PTX")[0].gencode_flags()[1] == "-gencode=arch=compute_90,code=compute_90"
    with pytest.raises(ValueError, match="below 7.0"):
        lcuda.parse_arch_list("5.0")
    with pytest.raises(ValueError, match="unrecognised"):
        lcuda.parse_arch_list("Ampere")


def test_arch_coverage():
    sm80, sm90, sm90a, sm80ptx = (lcuda.parse_arch_list(s)[0] for s in ("8.0", "9.0", "9.0a", "8.0+PTX"))
    assert sm80.runs_on((8, 0)) and sm80.runs_on((8, 6)) and not sm80.runs_on((9, 0))
    assert sm90.runs_on((9, 0)) and not sm90.runs_on((10, 0)) and not sm90.runs_on((8, 9))
    assert sm90a.runs_on((9, 0)) and not sm90a.runs_on((10, 0))
    assert sm80ptx.runs_on((9, 0)) and sm80ptx.runs_on((12, 0)) and not sm80ptx.runs_on((7, 5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_without_gpu_is_unavailable_with_clear_error():
    assert not lcuda.is_available()
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*`linear` backend"):
        lcuda.load()
    q = torch.rand(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="`linear` backend"):
        lcuda.causal_dot_product(q, q, q)


def test_autograd_wrapper_plumbing(monkeypatch):
    """The autograd.Function around the operators, with the operators replaced by float64
    PyTorch code: contiguity, saved tensors, output_mask and None gradients."""
    calls = []

    class FakeOps:
        @staticmethod
        def causal_dot_product_fwd(q, k, v):
            assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            return naive_causal_dot_product(q, k, v)

        @staticmethod
        def causal_dot_product_bwd(q, k, v, g, mask):
            calls.append(list(mask))
            with torch.enable_grad():  # backward runs with grad mode off
                _, gq, gk, gv = reference(q, k, v, g)
            return tuple(t.to(q.dtype) if m else None for t, m in zip((gq, gk, gv), mask))

    monkeypatch.setattr(lcuda, "load", lambda verbose=False: FakeOps)
    q, k, v, g = make_inputs(2, 3, 17, 5, 7, torch.float64)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)  # non-contiguous leaf
    vr = v.clone().requires_grad_(True)
    out = lcuda.causal_dot_product(qt, k, vr)
    out.backward(g)
    assert calls == [[True, False, True]]
    _, gq, _, gv = reference(q, k, v, g)
    assert torch.allclose(qt.grad, gq) and torch.allclose(vr.grad, gv)


_BUILD_CHECK = textwrap.dedent(
    """
    import sys, torch
    from linformer_lab.ops.cuda.__main__ import main
    assert main(["build", "--arch", "8.0", "--build-dir", sys.argv[1]]) == 0
    ops = torch.ops.linformer_lab_cuda
    q = torch.rand(1, 2, 5, 8)
    try:
        ops.causal_dot_product_fwd(q, q, q)
    except RuntimeError as err:
        print("CPU-ERROR:", str(err).splitlines()[0])
    """
)


@pytest.mark.cuda_build
@pytest.mark.timeout(1800)
def test_extension_compiles_with_nvcc():
    """Builds the real extension (binding + kernels) for sm_80 with the installed nvcc and torch,
    loads it, and checks that the operators are registered and reject CPU tensors clearly."""
    if lcuda.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit (nvcc + headers) on this machine")
    build_dir = CACHE / "cuda_build_test"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.setdefault("MAX_JOBS", "2")
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_CHECK, str(build_dir)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    libs = list(build_dir.glob("*/sm80/linformer_lab_cuda_ext.so"))
    assert libs and (libs[0].parent / "build_info.json").is_file()
    assert "CPU-ERROR:" in proc.stdout and "`linear` backend" in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------------------
# CPU emulation of the kernels
# ------------------------------------------------------------------------------------------------


def _cuda_header_dir() -> Path | None:
    """The CUDA toolkit's include folder (cuda_fp16.h, cuda_bf16.h and what they include; the
    partial header sets inside Python wheels lack some of it)."""
    home = lcuda.find_cuda_home()
    include = Path(home) / "include" if home else None
    needed = ("cuda_fp16.h", "cuda_bf16.h", "vector_types.h", "vector_functions.h", "crt/host_defines.h")
    if include is not None and all((include / h).is_file() for h in needed):
        return include
    return None


@pytest.fixture(scope="module")
def emulator():
    """Compiles the kernel source with the CPU emulation harness (once per source version and
    emulated architecture; cached) and returns {arch: executable}."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")
    headers = _cuda_header_dir()
    if cxx is None or headers is None:
        pytest.skip("needs a C++20 compiler and a CUDA toolkit's headers")
    kernel = (CUDA_SRC / "causal_linear_attention.cu").read_bytes()
    key = hashlib.sha256(_EMULATOR_SOURCE.encode() + kernel + cxx.encode()).hexdigest()[:16]
    out_dir = CACHE / "cuda_emulator" / key
    out_dir.mkdir(parents=True, exist_ok=True)
    harness = out_dir / "emulator.cpp"
    harness.write_text(_EMULATOR_SOURCE)
    exes, procs = {}, []
    # 800: fp16/bf16 take the tensor-core (WMMA) path; 700: the fp32-FMA path for every dtype.
    for arch in (800, 700):
        exe = out_dir / f"emulator_sm{arch // 10}"
        exes[arch] = exe
        if not exe.is_file():
            cmd = [cxx, "-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-DLLA_EMULATE",
                   f"-DLLA_EMULATE_ARCH={arch}", f"-I{headers}", f"-I{CUDA_SRC}", str(harness),
                   "-o", f"{exe}.tmp"]  # fmt: skip
            procs.append((subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True), exe))
    for proc, exe in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            pytest.fail(f"emulator build failed:\n{err[-4000:]}")
        os.replace(f"{exe}.tmp", exe)
    return exes


@pytest.mark.cuda_emulation
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "arch, dtype, bh, n, d, m",
    [
        (800, torch.float32, 2, 130, 33, 100),  # FMA path, partial chunks, D and M not multiples of 8
        (800, torch.float32, 1, 65, 256, 70),  # largest D: 8 state slabs in registers
        (800, torch.bfloat16, 1, 130, 33, 72),  # tensor cores, scalar q/k loads, vector v loads
        (800, torch.float16, 1, 70, 100, 20),  # tensor cores, bf16 copy of q for the state product
        (800, torch.bfloat16, 1, 65, 256, 8),  # tensor cores, largest D
        (700, torch.float16, 1, 130, 64, 64),  # pre-Ampere: half inputs through the FMA path
        (700, torch.bfloat16, 2, 70, 33, 100),
    ],
)
def test_kernels_emulated_on_cpu(emulator, tmp_path, arch, dtype, bh, n, d, m):
    """Forward and all three gradients computed by the kernel source itself (run by the CPU
    emulation) against autograd of the float64 naive definition."""
    q, k, v, g = (t[:, 0] for t in make_inputs(bh, 1, n, d, m, dtype, seed=n + d))
    for name, t in zip("qkvg", (q, k, v, g)):
        t.contiguous().view(torch.uint8).numpy().tofile(tmp_path / f"{name}.bin")
    code = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    proc = subprocess.run(
        [str(emulator[arch]), code, str(bh), str(n), str(d), str(m), str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]

    def read(name, shape):
        raw = torch.from_numpy(__import__("numpy").fromfile(tmp_path / f"{name}.bin", dtype="uint8"))
        return raw.view(dtype).reshape(shape)

    got = [read("out", v.shape), read("gq", q.shape), read("gk", k.shape), read("gv", v.shape)]
    want = reference(q, k, v, g)
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < TOL[dtype], (name, rel_err(x, ref))


def _run_emulator(exe, tmp_path, q, k, v, g):
    """The kernel source's forward and gradients for (bh, n, d) / (bh, n, m) inputs, run by the
    CPU emulation: ``(out, grad_q, grad_k, grad_v)`` in the inputs' dtype."""
    import numpy as np

    bh, n, d = q.shape
    m = v.shape[-1]
    for name, t in zip("qkvg", (q, k, v, g)):
        t.contiguous().view(torch.uint8).numpy().tofile(tmp_path / f"{name}.bin")
    code = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype]
    proc = subprocess.run([str(exe), code, str(bh), str(n), str(d), str(m), str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def read(name, shape):
        return torch.from_numpy(np.fromfile(tmp_path / f"{name}.bin", dtype="uint8")).view(q.dtype).reshape(shape).clone()

    return read("out", v.shape), read("gq", q.shape), read("gk", k.shape), read("gv", v.shape)


@pytest.mark.cuda_emulation
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch, dtype", [(800, torch.float32), (800, torch.bfloat16), (700, torch.float16)])
def test_kernel_state_in_and_out_emulated(emulator, tmp_path, arch, dtype):
    """linear_cuda's state path: the kernel source (CPU emulation) as the stateless numerator
    inside ``dot_product_with_state``, exactly as ``lcuda.causal_dot_product`` composes it on a
    GPU, against autograd of the float64 recurrence from an initial state: outputs, final state
    and the gradients of q, k, v and the initial state."""
    from linformer_lab.ops.linear_attention import dot_product_with_state

    class Emulated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return _run_emulator(emulator[arch], tmp_path, q[0], k[0], v[0], torch.zeros_like(v[0]))[0][None]

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors
            _, gq, gk, gv = _run_emulator(emulator[arch], tmp_path, q[0], k[0], v[0], grad_out[0].to(q.dtype).contiguous())
            return gq[None], gk[None], gv[None]

    q, k, v, g = (t[:, 0][None] for t in make_inputs(2, 1, 70, 33, 40, dtype, seed=11))  # (1, BH=2, N, D)
    gen = torch.Generator().manual_seed(12)
    s0 = torch.randn(1, 2, 33, 40, generator=gen)
    g_final = torch.randn(1, 2, 33, 40, generator=gen)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    state = s0.clone().requires_grad_(True)
    out, final = dot_product_with_state(Emulated.apply, *leaves, initial_state=state, return_final_state=True)
    torch.autograd.backward([out, final], [g, g_final])

    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_state = s0.double().requires_grad_(True)
    states = ref_state.unsqueeze(2) + torch.einsum("bhnc,bhnm->bhncm", ref_leaves[1], ref_leaves[2]).cumsum(2)
    ref_out = torch.einsum("bhnc,bhncm->bhnm", ref_leaves[0], states)
    torch.autograd.backward([ref_out, states[:, :, -1]], [g.double(), g_final.double()])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    pairs = [("out", out, ref_out), ("final", final, states[:, :, -1]), ("grad S0", state.grad, ref_state.grad)]
    pairs += [(f"grad {n}", a.grad, b.grad) for n, a, b in zip("qkv", leaves, ref_leaves)]
    for name, got, want in pairs:
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


# ------------------------------------------------------------------------------------------------
# GPU tests
# ------------------------------------------------------------------------------------------------


def _check_against_reference(q, k, v, g, dtype, tol=None):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = lcuda.causal_dot_product(q, k, v)
    out.backward(g)
    assert out.dtype == dtype and out.shape == v.shape
    want = reference(q, k, v, g)
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), (out, q.grad, k.grad, v.grad), want):
        assert x.dtype == dtype, name
        assert torch.isfinite(x).all(), name
        err = rel_err(x, ref)
        assert err < (tol or TOL[dtype]), f"{name}: relative error {err:.2e}"


_DIMS = [16, 33, 64, 100, 128, 256]
_SHAPES = [  # (B, H, N, D, M): odd sizes, every D and M above, partial and single chunks
    (2, 3, 1, 16, 16),
    (1, 2, 63, 33, 100),
    (2, 1, 64, 64, 64),
    (1, 1, 65, 100, 33),
    (2, 2, 257, 128, 256),
    (1, 1, 130, 256, 16),
    (1, 2, 1000, 256, 128),
] + [(1, 1, 200, d, m) for d, m in zip(_DIMS, reversed(_DIMS))]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "B{}H{}N{}D{}M{}".format(*s))
def test_matches_float64_reference(shape, dtype):
    _check_against_reference(*make_inputs(*shape, dtype, device="cuda", seed=sum(shape)), dtype)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_random_odd_shapes(dtype):
    gen = torch.Generator().manual_seed(1234)
    for trial in range(6):
        d, m = (_DIMS[i] for i in torch.randint(len(_DIMS), (2,), generator=gen))
        n = int(torch.randint(1, 700, (1,), generator=gen))
        _check_against_reference(*make_inputs(1, 2, n, d, m, dtype, device="cuda", seed=trial), dtype)


def _blockwise_reference(q, k, v, g, block=4096):
    """float64 out, grad_q, grad_k, grad_v by the O(N^2) definitions, a block of rows at a time so
    that N = 65536 fits in memory: out = tril(Q K^T) V, dQ = tril(G V^T) K, dK = triu(V G^T) Q,
    dV = triu(K Q^T) G."""
    q, k, v, g = (t.double() for t in (q, k, v, g))
    n = q.shape[-2]
    out, gq, gk, gv = (torch.empty_like(t) for t in (v, q, k, v))
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        rows = torch.arange(r0, r1, device=q.device)[:, None]
        past = torch.arange(0, r1, device=q.device)[None, :] <= rows  # j <= i, columns 0..r1
        fut = torch.arange(r0, n, device=q.device)[None, :] >= rows  # j >= i, columns r0..n
        out[..., r0:r1, :] = ((q[..., r0:r1, :] @ k[..., :r1, :].mT) * past) @ v[..., :r1, :]
        gq[..., r0:r1, :] = ((g[..., r0:r1, :] @ v[..., :r1, :].mT) * past) @ k[..., :r1, :]
        gv[..., r0:r1, :] = ((k[..., r0:r1, :] @ q[..., r0:, :].mT) * fut) @ g[..., r0:, :]
        gk[..., r0:r1, :] = ((v[..., r0:r1, :] @ g[..., r0:, :].mT) * fut) @ q[..., r0:, :]
    return out, gq, gk, gv


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_long_sequence_stays_finite_and_accurate(dtype):
    """N = 65536 with positive (feature-mapped) q, k, v scaled by the caller so that the
    numerator stays inside fp16's range: no inf/NaN, and the same accuracy as short sequences
    (fp32 gets 5e-5: 1024 chunks of rounding accumulate in the running state)."""
    b, h, n, d, m = 1, 2, 65536, 32, 48
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(b, h, n, d, generator=gen) / d
    k = torch.rand(b, h, n, d, generator=gen)
    v = torch.rand(b, h, n, m, generator=gen) / 64  # out_N ~ N * (1/4) / 64 * 1/2 = 256
    g = torch.randn(b, h, n, m, generator=gen) / 64
    q, k, v, g = (t.to("cuda", dtype) for t in (q, k, v, g))
    qr, kr, vr = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = lcuda.causal_dot_product(qr, kr, vr)
    out.backward(g)
    want = _blockwise_reference(q, k, v, g)
    tol = 5e-5 if dtype == torch.float32 else TOL[dtype]
    for name, x, ref in zip(("out", "grad_q", "grad_k", "grad_v"), (out, qr.grad, kr.grad, vr.grad), want):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < tol, (name, rel_err(x, ref))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_heads(dtype):
    """B * H = 70000 > 65535: the batch*head index must live on grid.x."""
    _check_against_reference(*make_inputs(7, 10000, 3, 8, 5, dtype, device="cuda"), dtype)


@gpu
def test_single_head_long_enough_for_many_chunks():
    _check_against_reference(*make_inputs(1, 1, 3000, 64, 64, torch.float32, device="cuda"), torch.float32)


@gpu
def test_non_contiguous_inputs_and_partial_grads():
    q, k, v, g = make_inputs(2, 5, 40, 16, 24, torch.float32, device="cuda")
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous strides
    assert not qt.is_contiguous()
    vr = v.clone().requires_grad_(True)
    out = lcuda.causal_dot_product(qt, k, vr)  # only v needs a gradient
    out.backward(g)
    _, _, _, want_gv = reference(q, k, v, g)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    assert rel_err(vr.grad, want_gv) < 1e-5


@gpu
def test_runs_on_the_current_stream():
    """The kernel must run on the caller's stream: if it used another one it would read x
    before the (delayed) copy on the side stream has written it."""
    q, k, v, _ = make_inputs(2, 4, 512, 64, 64, torch.float32, device="cuda")
    want = reference(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.zeros_like(v)
        torch.cuda._sleep(50_000_000)  # keep the side stream busy before the copy
        x.copy_(v)
        out = lcuda.causal_dot_product(q, k, x)
    side.synchronize()
    assert rel_err(out, want) < 1e-5


@gpu
@pytest.mark.skipif(not (_HAS_GPU and torch.cuda.device_count() > 1), reason="needs 2 GPUs")
def test_second_device():
    with torch.cuda.device(0):  # inputs on cuda:1 while cuda:0 is current
        q, k, v, g = make_inputs(2, 3, 100, 33, 40, torch.bfloat16, device="cuda:1")
        _check_against_reference(q, k, v, g, torch.bfloat16)


@gpu
def test_error_messages():
    q, k, v, _ = make_inputs(1, 2, 8, 16, 16, torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="expected CUDA tensors.*`linear` backend"):
        lcuda.causal_dot_product(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(RuntimeError, match="expected CUDA tensors"):
        lcuda.causal_dot_product(q, k, v.cpu())
    big = torch.rand(1, 2, 8, 300, device="cuda")
    with pytest.raises(RuntimeError, match=r"D of q and k must be in 1\.\.256, got D = 300"):
        lcuda.causal_dot_product(big, big, v)
    with pytest.raises(RuntimeError, match=r"M of v must be in 1\.\.256, got M = 300"):
        lcuda.causal_dot_product(q, k, torch.rand(1, 2, 8, 300, device="cuda"))
    with pytest.raises(RuntimeError, match="share one dtype"):
        lcuda.causal_dot_product(q, k.half(), v)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        lcuda.causal_dot_product(q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match="4 dimensions"):
        lcuda.causal_dot_product(q[0], k[0], v[0])
    with pytest.raises(RuntimeError, match="same shape"):
        lcuda.causal_dot_product(q, k[..., :8], v)


@gpu
def test_empty_sequence():
    q, k, v, _ = make_inputs(1, 2, 0, 16, 16, torch.float32, device="cuda")
    assert lcuda.causal_dot_product(q, k, v).shape == (1, 2, 0, 16)


@gpu
def test_agrees_with_the_pure_pytorch_backend():
    la = pytest.importorskip("linformer_lab.ops.linear_attention")
    q, k, v, _ = make_inputs(2, 2, 300, 64, 48, torch.float32, device="cuda")
    assert rel_err(lcuda.causal_dot_product(q, k, v), la.causal_dot_product(q, k, v).double()) < 1e-5


# ------------------------------------------------------------------------------------------------
# The CPU emulation harness (C++20). It includes the kernel file itself with LLA_EMULATE defined,
# supplies stand-ins for the CUDA features the kernels use, and launches them through the same
# planning code (plan_chunk_scan, forward_params, backward_params) as the real extension.
# ------------------------------------------------------------------------------------------------

_EMULATOR_SOURCE = r"""// CPU emulation harness for linformer_lab/ops/cuda/causal_linear_attention.cu.
//
// Runs the real kernel source as plain C++: every CUDA thread of a block is an OS thread,
// __syncthreads/__syncwarp are barriers, dynamic shared memory is a heap buffer (filled with
// NaN bytes so reads of never-written shared memory poison the result), and WMMA is a
// reference implementation that checks the API's alignment / leading-dimension rules and keeps
// the warp-collective semantics (each lane stores only its share of a tile, so a missing
// __syncwarp before other lanes read it shows up as a wrong result or a sanitizer report).
//
// usage: emu DTYPE(f32|f16|bf16) BH N D M DIR   reads DIR/{q,k,v,g}.bin, writes DIR/{out,gq,gk,gv}.bin
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __launch_bounds__(...)
#define LLA_DEVICE inline
#define LLA_HOST_DEVICE
#define LLA_DECLARE_DYNAMIC_SMEM(name) unsigned char* name = ::lla_emu::t_smem

namespace lla_emu {
thread_local uint3 t_thread_idx, t_block_idx;
thread_local dim3 t_block_dim, t_grid_dim;
thread_local unsigned char* t_smem = nullptr;
thread_local std::size_t t_smem_bytes = 0;
thread_local std::barrier<>* t_block_barrier = nullptr;
thread_local std::barrier<>* t_warp_barrier = nullptr;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulation error: %s (block %u,%u thread %u)\n", what, t_block_idx.x, t_block_idx.y,
               t_thread_idx.x);
  std::abort();
}
inline void sync_block() { t_block_barrier->arrive_and_wait(); }
inline void sync_warp() { t_warp_barrier->arrive_and_wait(); }
inline int lane() { return static_cast<int>(t_thread_idx.x % 32); }
// Every WMMA operand of the kernel lives in shared memory: check the whole tile is inside it.
inline void check_smem_range(const void* p, std::size_t bytes) {
  auto* c = static_cast<const unsigned char*>(p);
  if (c < t_smem || c + bytes > t_smem + t_smem_bytes) fail("WMMA tile outside dynamic shared memory");
}
}  // namespace lla_emu

#define threadIdx (::lla_emu::t_thread_idx)
#define blockIdx (::lla_emu::t_block_idx)
#define blockDim (::lla_emu::t_block_dim)
#define gridDim (::lla_emu::t_grid_dim)
#define __syncthreads() ::lla_emu::sync_block()
#define __syncwarp() ::lla_emu::sync_warp()
inline void lla_emulate_trap() { ::lla_emu::fail("__trap()"); }
using std::max;
using std::min;

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

inline float as_float(float x) { return x; }
inline float as_float(__half x) { return __half2float(x); }
inline float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Each lane holds the whole 16 x 16 tile (the real register layout is unspecified anyway).
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 is emulated");
  float v[16][16];
};

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(sizeof(T) == 2, "operand tiles are 16-bit");
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) lla_emu::fail("load_matrix_sync: pointer not 32-byte aligned");
  if (ldm % 8 != 0) lla_emu::fail("load_matrix_sync: ldm not a multiple of 8 elements");
  lla_emu::check_smem_range(p, (15 * ldm + 16) * sizeof(T));
  lla_emu::sync_warp();
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r][c] = as_float(std::is_same<Layout, row_major>::value ? p[r * ldm + c] : p[c * ldm + r]);
}

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float x) {
  for (auto& row : f.v)
    for (float& e : row) e = x;
}

template <class T, class La, class Lb>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, La>& a,
              const fragment<matrix_b, 16, 16, 16, T, Lb>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  lla_emu::sync_warp();
  fragment<accumulator, 16, 16, 16, float> r;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.v[i][j];
      for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j];
      r.v[i][j] = s;
    }
  d = r;
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) lla_emu::fail("store_matrix_sync: pointer not 32-byte aligned");
  if (ldm % 4 != 0) lla_emu::fail("store_matrix_sync: ldm not a multiple of 4 floats");
  lla_emu::check_smem_range(p, (15 * ldm + 16) * sizeof(float));
  lla_emu::sync_warp();
  // Each lane writes only its share, as the hardware does from its registers.
  for (int e = lla_emu::lane(); e < 256; e += 32) {
    const int r = e / 16, c = e % 16;
    p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.v[r][c];
  }
}
}  // namespace wmma
}  // namespace nvcuda

#include "causal_linear_attention.cu"

namespace lla_emu {
using linformer_lab_cuda::kThreads;
using linformer_lab_cuda::LaunchPlan;
using linformer_lab_cuda::ScanParams;

void run_block(const LaunchPlan& plan, const ScanParams& p, dim3 grid, unsigned bx, unsigned by) {
  const std::size_t bytes = static_cast<std::size_t>(plan.smem_bytes);
  std::unique_ptr<unsigned char[]> smem(new (std::align_val_t(128)) unsigned char[bytes]);
  std::memset(smem.get(), 0xFF, bytes);  // NaN in every float / half / bf16 view
  std::barrier<> block_barrier(kThreads);
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  for (int w = 0; w < kThreads / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      t_thread_idx = make_uint3(static_cast<unsigned>(t), 0, 0);
      t_block_idx = make_uint3(bx, by, 0);
      t_block_dim = dim3(kThreads, 1, 1);
      t_grid_dim = grid;
      t_smem = smem.get();
      t_smem_bytes = bytes;
      t_block_barrier = &block_barrier;
      t_warp_barrier = warp_barriers[t / 32].get();
      plan.kernel(p);
    });
  }
  for (auto& th : threads) th.join();
  ::operator delete[](smem.release(), std::align_val_t(128));
}

void launch(const LaunchPlan& plan, const ScanParams& p, int64_t bh) {
  if (p.num_problems == 0 || p.n == 0 || bh == 0) return;
  const dim3 grid(static_cast<unsigned>(bh), static_cast<unsigned>(plan.blocks_y), 1);
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) run_block(plan, p, grid, bx, by);
}

template <typename T>
std::vector<T> read_file(const std::string& path, std::size_t count) {
  std::vector<T> data(count);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr || std::fread(data.data(), sizeof(T), count, f) != count) fail(("cannot read " + path).c_str());
  std::fclose(f);
  return data;
}

template <typename T>
void write_file(const std::string& path, const std::vector<T>& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(data.data(), sizeof(T), data.size(), f) != data.size())
    fail(("cannot write " + path).c_str());
  std::fclose(f);
}

template <typename T>
void run(int64_t bh, int64_t n, int d, int m, const std::string& dir) {
  const std::size_t nq = static_cast<std::size_t>(bh * n * d), nv = static_cast<std::size_t>(bh * n * m);
  const auto q = read_file<T>(dir + "/q.bin", nq), k = read_file<T>(dir + "/k.bin", nq);
  const auto v = read_file<T>(dir + "/v.bin", nv), g = read_file<T>(dir + "/g.bin", nv);
  // NaN-filled outputs: an element the kernel forgets to write fails the comparison.
  std::vector<T> out(nv), gq(nq), gk(nq), gv(nv);
  for (auto* buf : {&out, &gq, &gk, &gv}) std::memset(buf->data(), 0xFF, buf->size() * sizeof(T));
  const bool tensor_cores = LLA_EMULATE_ARCH >= 800;
  const ScanParams pf =
      linformer_lab_cuda::forward_params(q.data(), k.data(), v.data(), out.data(), n, d, m, sizeof(T));
  launch(linformer_lab_cuda::plan_chunk_scan<T>(pf, tensor_cores), pf, bh);
  const ScanParams pb = linformer_lab_cuda::backward_params(q.data(), k.data(), v.data(), g.data(), gq.data(),
                                                            gk.data(), gv.data(), n, d, m, sizeof(T));
  launch(linformer_lab_cuda::plan_chunk_scan<T>(pb, tensor_cores), pb, bh);
  write_file(dir + "/out.bin", out);
  write_file(dir + "/gq.bin", gq);
  write_file(dir + "/gk.bin", gk);
  write_file(dir + "/gv.bin", gv);
}
}  // namespace lla_emu

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s f32|f16|bf16 BH N D M DIR\n", argv[0]);
    return 2;
  }
  const std::string dtype = argv[1];
  const int64_t bh = std::atoll(argv[2]), n = std::atoll(argv[3]);
  const int d = std::atoi(argv[4]), m = std::atoi(argv[5]);
  if (dtype == "f32")
    lla_emu::run<float>(bh, n, d, m, argv[6]);
  else if (dtype == "f16")
    lla_emu::run<__half>(bh, n, d, m, argv[6]);
  else if (dtype == "bf16")
    lla_emu::run<__nv_bfloat16>(bh, n, d, m, argv[6]);
  else
    return 2;
  return 0;
}
"""


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_cuda_segments_with_state_equal_one_pass(dtype):
    """linear_cuda on a GPU: segments with the state carried == one forward, values and the
    gradients of q, k, v, against the float64 one-pass reference of the pure-PyTorch backend."""
    import linformer_lab as ll

    torch.manual_seed(0)
    attn = ll.build_attention("linear_cuda", causal=True, query_dim=32)
    q, k, v = (torch.randn(2, 4, 300, 32, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    state, outs = None, []
    for a, b in ((0, 64), (64, 100), (100, 300)):
        out, state = attn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state=state, return_state=True)
        outs.append(out)
    got = torch.cat(outs, 2)
    reference_attn = ll.build_attention("linear", causal=True, query_dim=32).double()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = reference_attn(*leaves)
    g = torch.randn_like(want)
    got.backward(g.to(dtype))
    want.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(got, want) < tol
    for t, ref in zip((q, k, v), leaves):
        assert rel_err(t.grad, ref.grad) < tol
