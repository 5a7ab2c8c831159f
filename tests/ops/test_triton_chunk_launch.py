"""The Triton chunk op's launches (``linformer_lab.ops.cuda.triton_chunk.launch`` and ``op``)
without their arithmetic: no copies and no host reads on a layer's strided views, grids and
offsets at sizes past CUDA's grid limits and 2^31 elements, computed on meta tensors or by the
kernels' own helpers in Triton's interpreter (nothing of that size allocated). The kernels'
results: ``test_triton_chunk.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from linformer_lab.ops.cuda.triton_chunk import launch  # noqa: E402
from linformer_lab.ops.cuda.triton_chunk.forward import base_offset, superchunk_program  # noqa: E402

INTERPRETER = pytest.mark.skipif(not launch.interpreting(), reason="runs on CPU tensors in Triton's interpreter")


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops run under it, except inside a kernel launch of the interpreter (whose
    own copies to and from numpy are not the op's)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


COPIES = {"aten.copy_", "aten.clone", "aten._to_copy", "aten.contiguous"}
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero"}


@INTERPRETER
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_forward_and_backward_make_no_copy_and_no_host_read(monkeypatch, packed):
    """The op's forward and backward implementations (``op.forward`` / ``op.backward``, what the
    custom ops run) on a layer's strided views, under a dispatch mode: no aten copy and no host
    read (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``), packed sequences included."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter

    from linformer_lab.ops.cuda.triton_chunk import op

    reads = []
    quiet = []  # non-empty inside a kernel launch
    for name in ("tolist", "cpu", "numpy", "item"):
        stock = getattr(torch.Tensor, name)

        def wrapped(self, *args, _stock=stock, _name=name, **kwargs):
            if not quiet:
                reads.append(_name)
            return _stock(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    stock_launch = interpreter.GridExecutor.__call__

    def launch_quietly(self, *args, **kwargs):
        quiet.append(1)
        try:
            with _disable_current_modes():
                return stock_launch(self, *args, **kwargs)
        finally:
            quiet.pop()

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_quietly)
    gen = torch.Generator().manual_seed(4)
    b = 1 if packed else 2
    fused = torch.randn(b, 40, 3, 2, 8, generator=gen)
    q, k, v = (t.transpose(1, 2) for t in fused.unbind(2))
    grad_out = torch.randn(b, 40, 2 * 8, generator=gen).unflatten(2, (2, 8)).transpose(1, 2)
    cu = torch.tensor([0, 5, 5, 40]) if packed else None
    recorder = _Recorder()
    with recorder:
        out, den, _, _, deltas_s, deltas_z, out32 = op.forward(q, k, v, None, None, cu, "elu", 1e-6, 16, True)
        op.backward(q, k, v, out, den, deltas_s, deltas_z, out32, grad_out, None, None, None, None, cu, "elu", 16, True)
    assert len(recorder.ops) > 5, "the dispatch mode saw nothing: the check would pass vacuously"
    copies = [name for name in recorder.ops if name in COPIES]
    syncs = [name for name in recorder.ops if name in HOST_READS]
    assert not copies and not syncs and not reads, f"copies {copies}, host reads {syncs + reads}"


# --- launch arithmetic at sizes past CUDA's grid limits and 2^31 offsets, without allocating them -----------------------


def test_grids_are_one_dimensional_past_cudas_y_and_z_limits():
    """B H = 65,536 rows (grid z was capped at 65,535) and 65,536 chunks (y): every launch one
    x dimension of all programs, shapes from meta tensors (nothing allocated); past 2^31 - 1
    programs one clear error."""
    many_rows = torch.empty(4096, 16, 128, 64, device="meta")  # (B, H, T, D): 65,536 rows of 2 chunks
    lay = launch.layout(many_rows, many_rows, None, 64, True)
    assert lay.rows == 65_536 and lay.nsc == 1, "enough rows to fill any GPU: one super-chunk per sequence"
    assert launch.programs(2, lay.nsc, lay.rows) == (2 * 65_536,)
    long = torch.empty(1, 65_536 * 64, 1, 16, device="meta")  # (B, T, H, D): 65,536 chunks
    lay = launch.layout(long, long, None, 64, False, ls=64)
    assert lay.nsc == 65_536 and launch.programs(1, lay.nsc, lay.rows) == (65_536,)
    with pytest.raises(ValueError, match="exceed one launch's 2147483647; split the batch"):
        launch.programs(4, 2**20, 2**10)


@pytest.mark.parametrize("chunks, rows, wanted, expected", [
    (256, 32, 264, 16 * 64),  # 2 x 16384 tokens x 16 heads on an H100/H200: 16 walks of 16 chunks
    (16, 64, 264, 2 * 64),  # 8 x 1024 x 8 heads: 8 walks of 2 chunks each
    (13, 512, 264, 13 * 64),  # 64 x 784 x 8 heads: already 512 rows, one walk per sequence
    (3, 1, 1000, 64),  # fewer chunks than wanted walks: one chunk per walk
])
def test_superchunk_length_fills_the_gpu_and_no_more(chunks, rows, wanted, expected):
    """Walks (super-chunks) per sequence double until rows x walks reaches the programs wanted
    (two per SM), never past one chunk per walk; each walk a whole number of chunks."""
    assert launch.superchunk_length(chunks, rows, 64, wanted) == expected


def _unfold_probe(OUT, pid, T, H, NSC, sb, sh, st):
    """Stores what program ``pid`` of a super-chunk kernel addresses: b, h, super-chunk, its first
    global super-chunk row, and the 64-bit offset of its first position."""
    _, b, h, seq, bos, length, s, g0, n_sc = superchunk_program(pid, 1, OUT, OUT, OUT, T, H, NSC, 64, False)
    tl.store(OUT + 0, b.to(tl.int64))
    tl.store(OUT + 1, h.to(tl.int64))
    tl.store(OUT + 2, s.to(tl.int64))
    tl.store(OUT + 3, ((g0 + s) * H + h).to(tl.int64))
    tl.store(OUT + 4, base_offset(b, h, bos + s * 64, sb, sh, st))


@INTERPRETER
def test_offsets_past_two_to_the_31_are_64_bit():
    """A (B, T, H, D) = (2, 2^21, 16, 128) layout: T H D = 2^32 elements per batch row. The last
    super-chunk (64 positions) of the last head of the second row is found and addressed exactly
    (a 32-bit product of position and stride would wrap), by the kernels' own helpers, nothing allocated."""
    t, h, d = 2**21, 16, 128
    sb, sh, st = t * h * d, d, h * d  # strides of the (B, T, H, D) layout
    nsc = t // 64
    pid = (1 * h + (h - 1)) * nsc + (nsc - 1)  # row (b = 1, head 15), its last super-chunk
    out = torch.zeros(5, dtype=torch.int64)
    triton.jit(_unfold_probe)[(1,)](out, pid, t, h, nsc, sb, sh, st)
    want_offset = 1 * sb + (h - 1) * sh + (t - 64) * st
    assert want_offset > 2**32
    assert out.tolist() == [1, h - 1, nsc - 1, ((1 * nsc) + nsc - 1) * h + h - 1, want_offset]


# --- the launch path: launches per call, the direct path's cache, host time --------------------------------------------


class _Counter:
    """Stands in for ``launch._launch``: records each launch's kernel and runs it."""

    def __init__(self, stock):
        self.stock, self.names = stock, []

    def __call__(self, name, *args):
        self.names.append(name)
        return self.stock(name, *args)


@INTERPRETER
@pytest.mark.parametrize("programs, forward, backward", [
    (1, ["superchunk_forward"], ["superchunk_backward_prepare", "superchunk_dq", "superchunk_dk_dv"]),
    (10**6, ["superchunk_deltas", "superchunk_forward"],
     ["superchunk_backward_prepare", "superchunk_dq", "superchunk_dk_dv"]),
], ids=["one-walk-per-sequence", "several-walks"])
def test_launches_per_forward_and_backward(monkeypatch, programs, forward, backward):
    """At most 2 launches per forward and 3 per backward (the issue's bound), 1 + 3 when one walk
    per sequence fills the GPU; nothing else runs a kernel of ours."""
    from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention

    monkeypatch.setattr(launch, "INTERPRETER_PROGRAMS", programs)
    counter = _Counter(launch._launch)
    monkeypatch.setattr(launch, "_launch", counter)
    q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))
    out = chunk_linear_attention(q, k, v, chunk_size=16)
    assert counter.names == forward
    counter.names.clear()
    out.sum().backward()
    assert counter.names == backward


def test_direct_launch_path_compiles_once_per_specialisation(monkeypatch):
    """The direct path: a launch at a new specialisation goes through the jitted kernel (which
    compiles and returns the compiled kernel: recorded in ``compile_report``), later ones call
    the compiled kernel with the constexprs by position, no binding; a new alignment or dtype is
    a new specialisation; constexprs out of the kernel's order are refused."""
    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, args))

    class Jitted:
        arg_names = ["X", "n", "A", "B"]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("jit", grid, args, kwargs))
                return Compiled()
            return run

    monkeypatch.setattr(launch, "kernels", lambda interpret: SimpleNamespace(probe=Jitted()))
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "_COMPILES", [])
    x = torch.zeros(8)
    for args in [(x, 32), (x, 48), (x, 7), (x[1:], 32), (x.double(), 32)]:
        launch._launch("probe", ((3,), dict(A=1, B=True), dict(num_warps=4)), args, False)
    kinds = [c[0] for c in calls]
    # 32 and 48 are both 16-divisible: one specialisation; 7, a misaligned pointer and fp64 are new
    assert kinds == ["jit", "direct", "jit", "jit", "jit"]
    assert calls[1] == ("direct", (3,), (x, 48, 1, True))
    assert [c["kernel"] for c in launch.compile_report()] == ["probe"] * 4
    with pytest.raises(RuntimeError, match="not in the kernel's order"):
        launch._launch("probe", ((3,), dict(B=True, A=1), dict(num_warps=4)), (x, 5), False)
