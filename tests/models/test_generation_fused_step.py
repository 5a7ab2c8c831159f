"""The fused attention step of the graph decoder (``linformer_lab/ops/cuda/triton_chunk/step.py``:
elu + 1, the state update and the readout of eq. 18-20 in one Triton kernel per layer) against the
PyTorch step it replaces, run by Triton's interpreter on a CPU; and the count of operations a
generation step of the paper's MNIST model dispatches, with and without it (on a GPU each is a
kernel launch)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from linformer_lab.attention.linear import LinearAttention  # noqa: E402
from linformer_lab.models.generation.graph_step import StaticDecoder, _LinearBuffers  # noqa: E402
from linformer_lab.models.pixel_transformer import PixelTransformer  # noqa: E402
from linformer_lab.ops.cuda.triton_chunk import launch  # noqa: E402

INTERPRETER = pytest.mark.skipif(not launch.interpreting(), reason="runs on CPU tensors in Triton's interpreter")


@INTERPRETER
@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor"])
def test_fused_step_equals_the_pytorch_step(feature_map):
    """Ten positions of the fused step (the elu map inside the kernel; others mapped by PyTorch
    first) against the PyTorch step on the same state: outputs and the [S | Z] state, fp32; a
    state loaded from earlier positions included."""
    backend = LinearAttention(causal=True, query_dim=6, feature_map=feature_map)
    c = backend.feature_map.output_dim
    fused, plain = (_LinearBuffers(backend, 3, 2, 5, torch.float32, torch.device("cpu"), fused=f) for f in (True, False))
    gen = torch.Generator().manual_seed(0)
    start = (torch.rand(3, 2, c, 5, generator=gen), torch.rand(3, 2, c, generator=gen) + 1)
    fused.load(start)
    plain.load(start)
    for _ in range(10):
        q, k, v = (torch.randn(3, 2, d, generator=gen) for d in (6, 6, 5))
        torch.testing.assert_close(fused.attend(q, k, v, None, None), plain.attend(q, k, v, None, None),
                                   rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(fused.joint, plain.joint, rtol=1e-6, atol=1e-6)


@INTERPRETER
def test_fused_step_reads_strided_views_and_refuses_float64():
    """q, k, v as the step makes them (views into one fused projection) read in place; a float64
    model's state cannot take the fp32 kernel: one line."""
    backend = LinearAttention(causal=True, query_dim=4, feature_map="elu")
    fused, plain = (_LinearBuffers(backend, 2, 3, 4, torch.float32, torch.device("cpu"), fused=f) for f in (True, False))
    qkv = torch.randn(2, 3, 3, 4, generator=torch.Generator().manual_seed(1)).unbind(1)  # each (B, H, D), strided
    torch.testing.assert_close(fused.attend(*qkv, None, None), plain.attend(*qkv, None, None), rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="fp32 state: not for float64 models"):
        _LinearBuffers(backend, 2, 3, 4, torch.float64, torch.device("cpu"), fused=True)


class _CudaState:
    """What ``step.runs_for`` reads of an fp32 CUDA ``[S | Z]`` state of ``shape`` (no GPU needed)."""

    device, dtype = torch.device("cuda", 0), torch.float32

    def __init__(self, *shape):
        self.shape = torch.Size(shape)

    def is_contiguous(self):
        return True


@pytest.mark.parametrize("c, m, runs", [(32, 32, True), (256, 256, True), (561, 32, False), (32, 300, False)])
def test_the_fused_step_runs_for_states_up_to_the_kernels_widest(monkeypatch, c, m, runs):
    """One program of the step kernel holds a whole C x M state: wider than ``op.MAX_WIDTH`` (a
    second-order map's 561 features at D = 32) the graph decoder keeps the PyTorch step."""
    from linformer_lab.ops.cuda import triton_chunk
    from linformer_lab.ops.cuda.triton_chunk import step

    monkeypatch.setattr(triton_chunk, "is_available", lambda: True)
    assert step.runs_for(_CudaState(2, 4, c, m + 1)) == runs


class _Operations(TorchDispatchMode):
    """Counts the operations that compute something (views and metadata left out)."""

    VIEWS = {"view", "_unsafe_view", "unsqueeze", "squeeze", "t", "transpose", "expand", "slice", "select", "permute",
             "unflatten", "flatten", "split", "split_with_sizes", "alias", "detach", "as_strided", "unbind", "reshape"}

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        if name not in self.VIEWS:
            self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@INTERPRETER
def test_generation_step_operations_of_the_paper_model():
    """The paper's MNIST model (8 layers, 8 heads, d_model 256): one graph-decoder step dispatches
    about 210 operations with the PyTorch attention step, under 115 with the fused one (one per
    layer for maps, state and readout), and both sample the same value."""
    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=8, n_heads=8, d_model=256, d_ff=1024, num_mixtures=10).eval()
    counts, sampled = {}, {}
    for fused in (False, True):
        values = torch.zeros(1, 784, dtype=torch.long)
        noise = (torch.rand(1, 784, 10, generator=torch.Generator().manual_seed(2)),
                 torch.rand(1, 784, generator=torch.Generator().manual_seed(3)))
        static = StaticDecoder(model, values, 0, 1.0, noise, fused_attention=fused)
        static.load(None, torch.randn(1, 256, generator=torch.Generator().manual_seed(4)), 0)
        with torch.no_grad():
            static.step(784)
            operations = _Operations()
            with operations:
                static.step(784)
        counts[fused], sampled[fused] = sum(operations.count.values()), values[:, :2].clone()
        assert not fused or operations.count["linformer_lab.linear_attention_step_"] == 8
    assert counts[False] > 180 and counts[True] <= 115, counts
    assert torch.equal(sampled[True], sampled[False])


@INTERPRETER
def test_opcheck():
    """torch.library's checks of the operator: schema (the state written in place), fake tensors."""
    from linformer_lab.ops.cuda.triton_chunk.step import linear_attention_step_

    q, k, v = (torch.randn(2, 3, 4) for _ in range(3))
    joint = torch.rand(2, 3, 4, 5)
    torch.library.opcheck(linear_attention_step_, (q, k, v, joint, "elu", 1e-6), test_utils=("test_schema", "test_faketensor"))


def test_graph_step_traces_whole_for_torch_compile():
    """The graph step (every layer, the head, sampling, the next input) traces as one graph
    (``fullgraph=True`` raises at a break) with no host read, the precondition of compiling it
    before capture on a GPU; the traced step samples what the eager one does."""
    torch.manual_seed(0)
    model = PixelTransformer("linear", n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3,
                             image_shape=(1, 6, 5)).eval()
    images = []
    for compiled in (False, True):
        values = torch.zeros(2, 30, dtype=torch.long)
        noise = (torch.rand(2, 30, 3, generator=torch.Generator().manual_seed(1)),
                 torch.rand(2, 30, generator=torch.Generator().manual_seed(2)))
        static = StaticDecoder(model, values, 0, 1.0, noise)
        static.load(None, torch.zeros(2, 16), 0)
        step = torch.compile(static.step, fullgraph=True, backend="aot_eager") if compiled else static.step
        with torch.no_grad():
            for _ in range(4):
                step(30)
        images.append(values[:, :4].clone())
    assert torch.equal(images[0], images[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_step_on_a_gpu_equals_the_pytorch_step(dtype):
    """Compiled for the GPU: the fused step (the default there) against the PyTorch step over
    twenty positions of the paper's head shapes (8 heads, D = M = 32)."""
    backend = LinearAttention(causal=True, query_dim=32, feature_map="elu").cuda()
    fused, plain = (_LinearBuffers(backend, 4, 8, 32, dtype, torch.device("cuda"), fused=f) for f in (None, False))
    assert fused.fused, "the fused step is the default on a GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    tolerance = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for _ in range(20):
        q, k, v = (torch.randn(4, 8, 32, device="cuda", generator=gen).to(dtype) for _ in range(3))
        torch.testing.assert_close(fused.attend(q, k, v, None, None), plain.attend(q, k, v, None, None), **tolerance)
    torch.testing.assert_close(fused.joint, plain.joint, rtol=1e-4, atol=1e-4)
