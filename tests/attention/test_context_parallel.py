"""Context parallelism (``ll.context_parallel``): one sequence split over P gloo processes on CPU
gives the outputs and every gradient of one process running the whole sequence, in float64 to
1e-10 relative: linear attention layers causal and non-causal with a state in, padded lengths and
the final state out; a Transformer stack with per-layer states; a PixelTransformer's training
loss. Replicated tensors (weights, the initial state) are compared as the sum of the ranks'
gradients, the sum DDP forms. A rerun of a layer gives the same bits. The one-process reference
runs in every worker on the same seed.

Backends without a fixed-size state are refused before any process group is needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import linformer_lab as ll
from linformer_lab.attention.context_parallel import context_grid
from linformer_lab.attention.linear import LinearAttention
from linformer_lab.models.pixel_transformer import PixelTransformer
from linformer_lab.ops.state import LinearState
from linformer_lab.validation import ConfigurationError

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
TOL = 1e-10


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs().max() / scale).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def summed(grad: torch.Tensor | None, like: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """A replicated tensor's gradient share summed over the ranks (what DDP's all-reduce forms);
    None (a weight this rank's positions do not reach, like the start vector) is a zero share."""
    grad = torch.zeros_like(like) if grad is None else grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


def check_layer(causal: bool, rank: int, size: int, feature_map: str = "elu", group=None, seed: int = 0) -> None:
    """One layer, state in and out, padded lengths: outputs, q/k/v, state and weight gradients;
    ``rank`` and ``size`` are this process's in ``group``."""
    torch.manual_seed(seed)
    b, h, n, d, m = 3, 2, 5, 4, 3
    t = n * size
    layer = LinearAttention(causal=causal, query_dim=d, feature_map=feature_map).double()
    q, k, v = torch.randn(b, h, t, d, dtype=torch.float64), torch.randn(b, h, t, d, dtype=torch.float64), \
        torch.randn(b, h, t, m, dtype=torch.float64)
    s0, z0 = torch.randn(b, h, d, m, dtype=torch.float64), torch.rand(b, h, d, dtype=torch.float64)
    if feature_map != "elu":  # a map of another output size C: a state of its own shape
        c = layer.feature_map.output_dim
        s0, z0 = torch.randn(b, h, c, m, dtype=torch.float64), torch.rand(b, h, c, dtype=torch.float64)
    lengths = torch.tensor([t, max(t - n - 1, 1), 2])  # whole, ending inside a segment, within the first
    weight_out, weight_state = torch.randn(b, h, t, m, dtype=torch.float64), torch.randn(b, h, s0.shape[2], m + 1,
                                                                                            dtype=torch.float64)
    weight_out = weight_out * (torch.arange(t) < lengths[:, None])[:, None, :, None]  # a loss on the real positions

    def run(q, k, v, s0, z0, weight_out, state_term: bool):
        out, state = layer(q, k, v, key_lengths=lengths, state=(s0, z0), return_state=True)
        loss = (out * weight_out).sum() + (state.joint * weight_state).sum() * state_term
        layer.zero_grad()
        loss.backward()
        return out, state, {name: p.grad.clone() for name, p in layer.named_parameters()}

    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0, z0)]
    ref_out, ref_state, ref_params = run(*leaves, weight_out, True)
    ref_grads = [x.grad for x in leaves]

    ll.context_parallel(layer, group=group)
    part = slice(rank * n, (rank + 1) * n)
    mine = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)] + [x.clone().requires_grad_() for x in (s0, z0)]
    # the final state is the same on every rank: one rank's loss reads it, as the one process's does
    out, state, params = run(*mine, weight_out[:, :, part], rank == 0)
    # a rerun gives the same bits: every rank sums the gathered states alike
    again = [x.detach().clone().requires_grad_() for x in mine]
    out_again, state_again, params_again = run(*again, weight_out[:, :, part], rank == 0)
    assert torch.equal(out_again, out) and torch.equal(state_again.joint, state.joint)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(again, mine))
    assert all(torch.equal(params_again[name], grad) for name, grad in params.items())
    layer.context_group = None
    valid = (torch.arange(t)[part] < lengths[:, None])[:, None, :, None]
    assert_close(out * valid, ref_out[:, :, part] * valid, "output")
    assert_close(state.joint, ref_state.joint, "final state")
    for label, got, want in zip("qkv", mine[:3], ref_grads[:3]):
        assert_close(got.grad, want[:, :, part], f"grad {label}")
    for label, got, want in zip(("S0", "Z0"), mine[3:], ref_grads[3:]):
        assert_close(summed(got.grad, group=group), want, f"grad {label}")
    for name, grad in params.items():
        assert_close(summed(grad, group=group), ref_params[name], f"grad {name}")


def check_stack(causal: bool, rank: int, size: int) -> None:
    """A two-layer Transformer with per-layer states in, the final states out."""
    torch.manual_seed(1)
    b, n, d_model = 2, 4, 8
    t = n * size
    stack = ll.Transformer(2, d_model, 2, causal=causal).double()
    x = torch.randn(b, t, d_model, dtype=torch.float64)
    with torch.no_grad():
        _, state = stack(torch.randn(b, 3, d_model, dtype=torch.float64), return_state=True)
    weight = torch.randn(b, t, d_model, dtype=torch.float64)

    def run(x, states, state_term: bool):
        out, final = stack(x, state=states, return_state=True)
        loss = (out * weight[:, rank * n:(rank + 1) * n] if x.shape[1] == n else out * weight).sum()
        loss = loss + sum((s.joint ** 2).sum() for s in final) * state_term
        stack.zero_grad()
        loss.backward()
        return out, final, [p.grad.clone() for p in stack.parameters()]

    ref_x, ref_states = x.clone().requires_grad_(), [LinearState(s.joint.clone().requires_grad_()) for s in state]
    ref_out, ref_final, ref_params = run(ref_x, ref_states, True)
    ll.context_parallel(stack)
    part = slice(rank * n, (rank + 1) * n)
    my_x, my_states = x[:, part].clone().requires_grad_(), [LinearState(s.joint.clone().requires_grad_()) for s in state]
    out, final, params = run(my_x, my_states, rank == 0)
    ll.context_parallel(stack, group=False)
    assert_close(out, ref_out[:, part], "stack output")
    assert_close(my_x.grad, ref_x.grad[:, part], "stack grad x")
    for got, want in zip(final, ref_final):
        assert_close(got.joint, want.joint, "stack final state")
    for got, want in zip(my_states, ref_states):
        assert_close(summed(got.joint.grad), want.joint.grad, "stack grad state in")
    for got, want in zip(params, ref_params):
        assert_close(summed(got), want, "stack grad weight")


class TokenModel(torch.nn.Module):
    """Token and learned position embeddings, a causal linear Transformer, a linear head: the copy
    task's model in float64 throughout. ``positions`` are the global ones of the tokens given."""

    def __init__(self, vocab: int = 7, length: int = 32, d_model: int = 8):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(vocab, d_model), torch.nn.Embedding(length, d_model)
        self.stack = ll.Transformer(2, d_model, 2)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.tokens(tokens) + self.positions(positions)))


def check_training_step(rank: int, size: int) -> None:
    """A whole model's training step (cross-entropy, the global mean; SGD): the weights after it."""
    torch.manual_seed(3)
    b, n = 2, 4
    t = n * size
    model = TokenModel(length=t).double()
    tokens = torch.randint(0, 7, (b, t))
    targets = tokens.roll(1, dims=1)
    ref = TokenModel(length=t).double()
    ref.load_state_dict(model.state_dict())
    for net, seen in ((ref, slice(0, t)), (ll.context_parallel(model), slice(*ll.context_segment(t)))):
        logits = net(tokens[:, seen], torch.arange(t)[seen])  # the global positions of the tokens held
        # each rank's share of the mean over the global batch's positions
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, seen].flatten(), reduction="sum") / (b * t)
        loss.backward()
        if net is model:
            for p in model.parameters():
                p.grad = summed(p.grad, p)
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.5 * p.grad
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert_close(got, want, f"weight {name} after a step")
        assert_close(got.grad, want.grad, f"grad {name}")


def check_pixel_model(rank: int, size: int) -> None:
    """A PixelTransformer's training loss, the mean NLL, from each rank's positions alone; its
    mixture head computes in float32 whatever the model's dtype, hence the float32 tolerance."""
    torch.manual_seed(2)
    model = PixelTransformer(d_model=8, n_heads=2, n_layers=2, d_ff=16, num_mixtures=2, image_shape=(1, 4, 4)).double()
    images = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8)
    loss = model.nll(images).mean()
    model.zero_grad()
    loss.backward()
    ref_loss, ref_grads = loss.detach(), [p.grad.clone() for p in model.parameters()]
    ll.context_parallel(model)
    sequence = model.to_sequence(images)
    start, stop = ll.context_segment(sequence.shape[1])
    nll, _ = model.segment_nll(sequence, start, stop)
    local = nll.sum() / sequence.numel()  # this rank's share of the global mean
    model.zero_grad()
    local.backward()
    ll.context_parallel(model, group=False)
    assert_close(summed(local.detach()), ref_loss, "loss", tol=1e-5)
    for (name, p), want in zip(model.named_parameters(), ref_grads):
        assert_close(summed(p.grad, p), want, f"grad {name}", tol=1e-5)


def check_packed(rank: int, size: int, feature_map: str = "elu") -> None:
    """Packed sequences (``cu_seqlens`` of the whole, the same on every rank) whose boundaries fall
    inside segments, on them and across several of them; a state per sequence in and out."""
    torch.manual_seed(3)
    h, n, d, m = 2, 6, 4, 3
    t = n * size
    # lengths: one ending mid-segment, one ending on a boundary, one spanning the rest
    offsets = sorted({0, 2, n, n + 1, t - 1, t} if size > 1 else {0, 2, t - 1, t})
    cu = torch.tensor(offsets, dtype=torch.int32)
    layer = LinearAttention(causal=True, query_dim=d, feature_map=feature_map).double()
    c = layer.feature_map.output_dim
    q, k = torch.randn(1, h, t, d, dtype=torch.float64), torch.randn(1, h, t, d, dtype=torch.float64)
    v = torch.randn(1, h, t, m, dtype=torch.float64)
    s0, z0 = torch.randn(len(offsets) - 1, h, c, m, dtype=torch.float64), torch.rand(len(offsets) - 1, h, c,
                                                                                          dtype=torch.float64)
    weight_out, weight_state = torch.randn(1, h, t, m, dtype=torch.float64), torch.randn(len(offsets) - 1, h, c, m + 1,
                                                                                           dtype=torch.float64)

    def run(q, k, v, s0, z0, weight_out, state_term: bool):
        out, state = layer(q, k, v, state=(s0, z0), return_state=True, cu_seqlens=cu)
        ((out * weight_out).sum() + (state.joint * weight_state).sum() * state_term).backward()
        return out, state

    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0, z0)]
    ref_out, ref_state = run(*leaves, weight_out, True)
    ll.context_parallel(layer)
    part = slice(rank * n, (rank + 1) * n)
    mine = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)] + [x.clone().requires_grad_() for x in (s0, z0)]
    out, state = run(*mine, weight_out[:, :, part], rank == 0)
    layer.context_group = None
    assert_close(out, ref_out[:, :, part], "packed output")
    assert_close(state.joint, ref_state.joint, "packed final states")
    for label, got, want in zip("qkv", mine[:3], leaves[:3]):
        assert_close(got.grad, want.grad[:, :, part], f"packed grad {label}")
    for label, got, want in zip(("S0", "Z0"), mine[3:], leaves[3:]):
        assert_close(summed(got.grad), want.grad, f"packed grad {label}")


def check_unequal_segments(rank: int, size: int) -> None:
    """Segments of different lengths stop every rank with the lengths named, none left waiting."""
    layer = ll.context_parallel(LinearAttention(causal=True, query_dim=4).double())
    x = torch.randn(1, 1, 3 + rank, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the same length on every process.*got \[3, 4"):
        layer(x, x, x)
    layer.context_group = None


def check_copy_loss(rank: int, size: int) -> None:
    """CopyTask.copy_loss on this rank's half of each sequence (as the CLI's training step runs it)
    against the whole sequences in one process: the loss summed over copied tokens, the token count,
    the correct count, and the weights' gradients summed over the ranks."""
    from linformer_lab.tasks.copy_task import CopyTask

    torch.manual_seed(0)
    task = CopyTask(d_model=8, n_layers=2, n_heads=2, sequence_length=9, vocab_size=6).double()
    tokens = torch.randint(1, 5, (3, 9))
    target_mask = torch.zeros(3, 9, dtype=torch.bool)
    target_mask[:, 6:] = True  # the copies at the end: the first half of the positions scores nothing
    loss, correct, count = task.copy_loss(tokens, target_mask)
    (loss * count).backward()
    want = [p.grad.clone() for p in task.parameters()]
    task.zero_grad()
    task.context_group = dist.group.WORLD
    ll.context_parallel(task.transformer)
    loss, correct_here, count_here = task.copy_loss(tokens, target_mask)
    (loss * count_here).backward()
    totals = torch.tensor([float(loss * count_here), float(correct_here), float(count_here)], dtype=torch.float64)
    dist.all_reduce(totals)
    assert totals[2] == count and totals[1] == correct, (totals, correct, count)
    assert abs(totals[0] - float(loss_sum_one_process(tokens, target_mask, task))) < 1e-10 * float(count)
    for p, grad in zip(task.parameters(), want):
        got = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(got)
        assert (got - grad).abs().max() <= 1e-10 * grad.abs().max().clamp_min(1e-30), "a weight's gradient differs"
    ll.context_parallel(task.transformer, group=False)


def loss_sum_one_process(tokens, target_mask, task) -> float:
    group, task.context_group = task.context_group, None
    ll.context_parallel(task.transformer, group=False)
    try:
        loss, _, count = task.copy_loss(tokens, target_mask)
        return float(loss) * count
    finally:
        task.context_group = group
        ll.context_parallel(task.transformer, group=group)


def worker(rank: int, size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        for causal in (True, False):
            check_layer(causal, rank, size)
            check_stack(causal, rank, size)
        check_layer(True, rank, size, feature_map="hedgehog")  # a map with weights of its own
        check_training_step(rank, size)
        if size == 2:  # its cross-entropy runs in float32: two halves keep one process's sums, four do not
            check_copy_loss(rank, size)
        check_pixel_model(rank, size)
        check_packed(rank, size)
        check_packed(rank, size, feature_map="hedgehog")
        check_unequal_segments(rank, size)
        if size == 4:  # a (data x context) grid: two groups of two, each its own sequences
            group = context_grid(2)
            check_layer(True, dist.get_rank(group), 2, group=group, seed=rank // 2)
            check_layer(False, dist.get_rank(group), 2, group=group, seed=rank // 2)
            with pytest.raises(ValueError, match="divide the 4 processes of the run"):
                context_grid(3)
        assert ll.context_segment(4 * size) == (4 * rank, 4 * rank + 4)
        with pytest.raises(ValueError, match=f"do not divide by {size}"):
            ll.context_segment(4 * size + 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("processes", [2, 4])
def test_context_parallel_equals_one_process(processes, tmp_path):
    # forked, not spawned: the workers start with this process's imports (a spawned one imports
    # torch and the package again, 4-12 s each on two cores); none has a process group yet. The
    # worker's first line sets one thread: a forked child's first parallel op hangs on the OpenMP
    # pool of a parent that has run one
    mp.start_processes(worker, args=(processes, str(tmp_path / "store")), nprocs=processes, join=True,
                       start_method="fork")


@needs_gloo
def test_one_process_group_is_the_plain_forward(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        check_layer(True, 0, 1)
        check_layer(False, 0, 1)
        check_packed(0, 1)
        layer = ll.context_parallel(LinearAttention(causal=False, query_dim=4))
        q = torch.randn(1, 1, 6, 4)
        with pytest.raises(ValueError, match="non-causal packed sequences do not split"):
            layer(q, q, q, cu_seqlens=torch.tensor([0, 2, 6]))
        layer = ll.context_parallel(LinearAttention(causal=True, query_dim=4))
        with pytest.raises(ValueError, match="cu_seqlens ends at 5 positions"):
            layer(q, q, q, cu_seqlens=torch.tensor([0, 2, 5]))
        with pytest.raises(ValueError, match="key_lengths must lie in"):  # global lengths: at most P N
            layer(q, q, q, key_lengths=torch.tensor([7]))
        assert ll.context_segment(7) == (0, 7)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["softmax", "lsh"])
def test_backends_without_a_fixed_size_state_are_refused(backend):
    stack = ll.Transformer(1, 8, 2, attention=backend)
    with pytest.raises(ConfigurationError, match=f"attention backend '{backend}' cannot split a sequence"):
        ll.context_parallel(stack)


def test_without_a_process_group_the_call_says_so():
    if dist.is_initialized():
        pytest.skip("a process group is up in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ll.context_parallel(ll.Transformer(1, 8, 2))
