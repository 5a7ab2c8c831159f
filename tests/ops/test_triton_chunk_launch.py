"""The Triton chunk op's launches (``linformer_lab.ops.cuda.triton_chunk.launch`` and ``op``)
without their arithmetic: no copies and no host reads on a layer's strided views, grids and
offsets at sizes past CUDA's grid limits and 2^31 elements, computed on meta tensors or by the
kernels' own helpers in Triton's interpreter (nothing of that size allocated). The kernels'
results: ``test_triton_chunk.py``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from linformer_lab.ops.cuda.triton_chunk import launch  # noqa: E402
from linformer_lab.ops.cuda.triton_chunk.forward import base_offset, chunk_program  # noqa: E402

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
        out, den, _, _ = op.forward(q, k, v, None, None, cu, "elu", 1e-6, 16, True)
        op.backward(q, k, v, out, den, grad_out, None, None, None, None, cu, "elu", 16, True)
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
    assert launch.chunk_grid(lay, lambda meta: 2)({}) == (2 * 2 * 65_536,)
    assert launch.walk_grid(lay)({"BK": 32, "BV": 64}) == (2 * 1 * 65_536,)
    long = torch.empty(1, 65_536 * 64, 1, 16, device="meta")  # (B, T, H, D): 65,536 chunks
    lay = launch.layout(long, long, None, 64, False)
    assert lay.nt == 65_536 and launch.chunk_grid(lay, lambda meta: 1)({}) == (65_536,)
    with pytest.raises(ValueError, match="exceed one launch's 2147483647; split the batch"):
        launch.programs(4, 2**20, 2**10)


def _unfold_probe(OUT, pid, T, H, NT, sb, sh, st):
    """Stores what program ``pid`` of a chunk-parallel kernel addresses: b, h, chunk, state row,
    and the 64-bit offset of its first position."""
    _, b, h, start, g, _, _ = chunk_program(pid, 1, OUT, OUT, OUT, T, H, NT, 64, False)
    tl.store(OUT + 0, b.to(tl.int64))
    tl.store(OUT + 1, h.to(tl.int64))
    tl.store(OUT + 2, (start // 64).to(tl.int64))  # the chunk: one sequence per row starts at 0
    tl.store(OUT + 3, g.to(tl.int64))
    tl.store(OUT + 4, base_offset(b, h, start, sb, sh, st))


@INTERPRETER
def test_offsets_past_two_to_the_31_are_64_bit():
    """A (B, T, H, D) = (2, 2^21, 16, 128) layout: T H D = 2^32 elements per batch row. The last
    chunk of the last head of the second row is found and addressed exactly (a 32-bit product
    of position and stride would wrap), by the kernels' own helpers, nothing allocated."""
    t, h, d = 2**21, 16, 128
    sb, sh, st = t * h * d, d, h * d  # strides of the (B, T, H, D) layout
    nt = t // 64
    pid = (1 * h + (h - 1)) * nt + (nt - 1)  # row (b = 1, head 15), its last chunk
    out = torch.zeros(5, dtype=torch.int64)
    triton.jit(_unfold_probe)[(1,)](out, pid, t, h, nt, sb, sh, st)
    want_offset = 1 * sb + (h - 1) * sh + (t - 64) * st
    assert want_offset > 2**32
    assert out.tolist() == [1, h - 1, nt - 1, ((1 * nt) + nt - 1) * h + h - 1, want_offset]


def test_tuning_report_records_each_new_key_once(monkeypatch):
    """A launch through an autotuner (a stand-in with Triton's ``cache`` and ``bench_time``)
    adds one report entry per key it tuned, none when the key was tuned before; untuned kernels
    (the interpreter's) add none."""
    monkeypatch.setattr(launch, "_TUNINGS", [])

    class Tuner:
        cache, bench_time = {}, 0.0

        def __getitem__(self, grid):
            def run(key):
                if key not in self.cache:
                    self.cache[key], self.bench_time = f"config for {key}", 1.5
            return run

    class Untuned:
        def __getitem__(self, grid):
            return lambda: None

    tuner = Tuner()
    for key in [(64, 64, 64, "bf16"), (64, 64, 64, "bf16"), (128, 128, 64, "bf16")]:
        launch._launch(tuner, "walk", (1,), key)
    launch._launch(Untuned(), "untuned", (1,))
    assert launch.tuning_report() == [
        dict(kernel="walk", key=(64, 64, 64, "bf16"), config="config for (64, 64, 64, 'bf16')", seconds=1.5),
        dict(kernel="walk", key=(128, 128, 64, "bf16"), config="config for (128, 128, 64, 'bf16')", seconds=1.5)]
