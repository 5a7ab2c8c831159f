"""What one ``linear`` layer's forward and backward cost around its kernels: copies of tensors and
host synchronisations, counted op by op under a ``TorchDispatchMode`` on CPU.

On a GPU a copy costs a pass over memory as long as the kernel's own, and a host read
(``.item()``, ``.tolist()``, ``bool(tensor)``) stops the CPU until the GPU has caught up, so the
next kernels are not queued in time. The layer is given q, k, v as ``MultiHeadAttention`` gives
them (views of one fused projection, ``(B, H, N, D)`` over ``(B, N, H, D)`` memory) and the output
gradient as its backward gives it (also strided).

The GPU path is the Triton candidate of the ``causal_attention`` op, reached here on CPU tensors
under Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without
a GPU): the test swaps in a candidate that accepts interpreter tensors. Its custom operators
appear to the dispatch mode as one op each, so what is counted is the layer around them. The CPU
path (C++ recurrence, PyTorch reference) is counted too: no host reads there either; its copies
are those its kernels need (the recurrence reads contiguous rows), bounded below.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import linformer_lab as ll
from linformer_lab.ops import kernels
from linformer_lab.ops.linear_attention import naive

aten = torch.ops.aten
#: ops that copy a tensor whole (``.contiguous()`` of a strided tensor dispatches ``clone``)
COPIES = {aten.copy_.default, aten.clone.default, aten._to_copy.default}
#: ops that read a device value on the host
SYNCS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
#: host reads that do not pass the dispatcher on CPU tensors (on a GPU they copy to the host first)
HOST_READS = ("tolist", "cpu", "numpy")

B, H, N, D = 2, 2, 37, 8


class Ledger(TorchDispatchMode):
    """Counts copies (a ``_to_copy`` only when it changes no dtype: a requested cast is computation)
    and host reads of every op dispatched while it is entered, the library's custom operators as one
    op each; with :meth:`watch_host_reads`, also the host reads that bypass the dispatcher on CPU
    tensors (``.tolist()``: on a GPU it copies to the host first), outside the custom operators."""

    def __init__(self):
        super().__init__()
        self.copies, self.syncs, self.ops = Counter(), Counter(), Counter()
        self.inside_custom_op = self.entered = False

    def __enter__(self):
        self.entered = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.entered = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        cast = func is aten._to_copy.default and kwargs.get("dtype") not in (None, args[0].dtype)
        if func in COPIES and not cast:
            self.copies[str(func)] += 1
        if func in SYNCS:
            self.syncs[str(func)] += 1
        custom = func.namespace.startswith("linformer_lab")
        self.inside_custom_op = self.inside_custom_op or custom
        try:
            return func(*args, **kwargs)
        finally:
            if custom:
                self.inside_custom_op = False

    def watch_host_reads(self, monkeypatch) -> Ledger:
        for name in HOST_READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        return self

    def _counted(self, name, method):
        def counted(tensor, *args, **kwargs):
            if self.entered and not self.inside_custom_op:
                self.syncs[name] += 1
            return method(tensor, *args, **kwargs)

        return counted


@pytest.fixture
def interpreted_triton(monkeypatch):
    """The ``causal_attention`` op's Triton candidate, accepting CPU tensors under the interpreter
    (the real condition asks for CUDA tensors)."""
    pytest.importorskip("triton")
    from linformer_lab.ops.cuda.triton_chunk import launch

    if not launch.interpreting():
        pytest.skip("runs the Triton kernels under the interpreter (TRITON_INTERPRET=1: tests/conftest.py without a GPU)")
    triton = kernels.CANDIDATES["causal_attention"][0]
    assert triton.name == "triton"

    def accepts_interpreter_tensors(feature_map, q, k, v):
        return q.device.type == "cpu" and v.dtype in (torch.float32, torch.float16) and v.numel() > 0

    monkeypatch.setattr(triton, "accepts", accepts_interpreter_tensors)
    monkeypatch.setattr(triton, "available", lambda: True)


#: case -> (causal, key_lengths, cu_seqlens) for inputs of batch B (2; 1 when packed) and N positions
CASES = {
    "causal": (True, None, None),
    "non-causal": (False, None, None),
    "key_lengths": (True, [N, 20], None),
    "cu_seqlens": (True, None, [0, 10, 11, N]),
    "non-causal cu_seqlens": (False, None, [0, 10, 11, N]),
}


def _layer_inputs(batch: int, seed: int = 0):
    """q, k, v ``(B, H, N, D)`` as MultiHeadAttention makes them (views of one fused projection,
    transposed from ``(B, N, H, D)``), and a grad out with the strides its backward gives."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, N, 3 * H * D, generator=gen).requires_grad_()
    q, k, v = (part.unflatten(-1, (H, D)).transpose(1, 2) for part in fused.split(H * D, dim=-1))
    grad_out = torch.randn(batch, N, H * D, generator=gen).unflatten(-1, (H, D)).transpose(1, 2)
    return q, k, v, grad_out


def _naive(attention, q, k, v, causal, key_lengths, cu_seqlens):
    """The float64 O(N^2) attention (eq. 3-4, 8-9), every packed sequence on its own."""
    phi = attention.feature_map
    if cu_seqlens is None:
        similarity = naive.kernel_similarity(phi.forward_queries(q.double()), phi.forward_keys(k.double()))
        return naive.attention_from_similarity(similarity, v.double(), causal, key_lengths, attention.eps)
    return torch.cat([_naive(attention, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, None, None)
                      for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])], dim=2)


def _measure(ledger, case: str):
    """One layer's forward and backward under ``ledger``; checks them against the float64 reference."""
    causal, lengths, offsets = CASES[case]
    attention = ll.build_attention("linear", causal=causal, query_dim=D)
    q, k, v, grad_out = _layer_inputs(1 if offsets else B)
    key_lengths = None if lengths is None else torch.tensor(lengths)
    cu_seqlens = None if offsets is None else torch.tensor(offsets)
    with ledger:
        out = attention(q, k, v, key_lengths=key_lengths, cu_seqlens=cu_seqlens)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want = _naive(attention, q, k, v, causal, key_lengths, offsets)
    expected = torch.autograd.grad(want, (q, k, v), grad_out.double())
    rows = (torch.arange(N) < key_lengths[:, None])[:, None, :, None] if lengths else torch.ones(1, 1, N, 1, dtype=bool)
    torch.testing.assert_close(out.double() * rows, want * rows, rtol=1e-5, atol=1e-5)
    for got, reference in zip(grads, expected):
        torch.testing.assert_close(got.double(), reference.double(), rtol=1e-4, atol=1e-5)
    return ledger


@pytest.mark.parametrize("case", [c for c, (causal, _, _) in CASES.items() if causal])
def test_the_gpu_path_copies_nothing_and_reads_nothing_back(interpreted_triton, monkeypatch, case):
    """Around the Triton operators (one forward, one backward op), the layer copies no tensor and
    reads nothing back from the device: causal, with key_lengths, with packed sequences."""
    ledger = _measure(Ledger().watch_host_reads(monkeypatch), case)
    assert ledger.ops["linformer_lab.chunk_linear_attention_fwd.default"] == 1
    assert ledger.ops["linformer_lab.chunk_linear_attention_bwd.default"] == 1
    assert not ledger.copies, f"{case}: copies {dict(ledger.copies)}"
    assert not ledger.syncs, f"{case}: host reads {dict(ledger.syncs)}"


#: the copies the CPU path makes, at most: the C++ recurrence reads contiguous rows (phi(q), phi(k)
#: and v copied once, the copies saved for its backward); ``matmul`` over the (B, H) batch of a
#: (B, N, H) memory layout copies its operands (the non-causal form; cuBLAS would too); the packed
#: form spreads the sequences into buffers of its own (a strided gradient copied in its backward),
#: and its scan over chunks (causal) carries the finished chunks into its other buffer at each of
#: its log2(chunks) steps, 3 here, in the forward and again in the backward.
CPU_COPIES = {"causal": 3, "non-causal": 5, "key_lengths": 3, "cu_seqlens": 1 + 2 * 3, "non-causal cu_seqlens": 1}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cpu_path_reads_nothing_back_and_copies_only_what_its_kernels_need(monkeypatch, case):
    ledger = _measure(Ledger().watch_host_reads(monkeypatch), case)
    assert not ledger.syncs, f"{case}: host reads {dict(ledger.syncs)}"
    assert sum(ledger.copies.values()) <= CPU_COPIES[case], f"{case}: copies {dict(ledger.copies)}"
