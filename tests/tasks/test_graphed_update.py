"""The training update as one CUDA graph (``linformer_lab/tasks/graphed_update.py``,
``ImageGenerationTask(cuda_graph=True)``, ``--model.cuda_graph true``), checked on CPU.

What a capture needs of the update is checked on the MNIST model at toy size: forward, loss and
backward trace whole under ``torch.compile(fullgraph=True)`` (a graph break is an error) and give
the eager numbers; nothing in the update reads a tensor on the host or builds one from host data
(a dispatch mode records every aten op; a host read inside a capture is an error on a GPU). The
optimizer's step is not traceable whole (torch's ``Optimizer.step`` breaks the graph on purpose),
so its ops are recorded instead. The Lightning hooks run a whole fit with the graph replaced by an
eager stand-in of the same contract (static buffers overwritten by each replay) and must train as
the eager loop does. Capture and replay themselves need a GPU (``benchmarks/paper/gpu_check_model.py``).
"""

from __future__ import annotations

import copy
import importlib
import math

import lightning as L
import pytest
import torch
from conftest import run_cli, tiny_mnist_args
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from linformer_lab.ops import cpu
from linformer_lab.tasks import graphed_update
from linformer_lab.tasks.graphed_update import WARMUP_UPDATES, CudaGraphUpdate, eager_optimizer_state, make_capturable
from linformer_lab.tasks.image_generation import ImageGenerationTask
from linformer_lab.validation import ConfigurationError

TINY = dict(n_layers=2, n_heads=2, d_model=16, d_ff=32, num_mixtures=3, image_shape=[1, 4, 4])
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero"}
#: ``torch.tensor(data)``: on a GPU a copy from the host, which a capture refuses
HOST_DATA = {"aten.lift_fresh", "aten.lift_fresh_copy"}


class Recorder(TorchDispatchMode):
    """The aten ops (and custom operators) run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def images(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def tiny_task(**kwargs) -> ImageGenerationTask:
    torch.manual_seed(0)
    return ImageGenerationTask(**TINY, **kwargs)


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """torch's capturable optimizers take CUDA parameters only; their arithmetic, what these tests
    check, is the same on the CPU."""
    radam = importlib.import_module("torch.optim.radam")
    stock = radam._get_capturable_supported_devices
    monkeypatch.setattr(radam, "_get_capturable_supported_devices", lambda *a, **k: [*stock(*a, **k), "cpu"])


# ---------------------------------------------------------------------- what a capture needs


@pytest.mark.slow  # Dynamo and AOT autograd trace for several seconds
def test_forward_loss_and_backward_trace_whole_and_equal_eager():
    eager = tiny_task()
    traced = copy.deepcopy(eager)

    def fwd_bwd(task):
        def run(x):
            loss, (logged, nll) = task.update_loss(x)
            loss.backward()
            return logged.detach(), nll.detach()
        return run

    x = images()
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # Tensor.backward inside the traced function
        got = torch.compile(fwd_bwd(traced), fullgraph=True, backend="aot_eager")(x)
    want = fwd_bwd(eager)(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.allclose(want[0], want[1].mean() / math.log(2.0))  # the loss is the batch's bits/dim
    for (name, p), q in zip(eager.named_parameters(), traced.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda text, name=name: f"{name}: {text}")


def test_the_update_reads_nothing_on_the_host(capturable_on_cpu):
    task = tiny_task()
    optimizer = torch.optim.RAdam(task.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)  # CUDA's default
    make_capturable(optimizer, torch.device("cpu"))
    for seed in range(7):  # RAdam's rectification switches on after 5 steps: both branches run
        with Recorder() as forward_backward:
            loss, _ = task.update_loss(images(seed=seed))
            loss.backward()
        with Recorder() as step:
            optimizer.step()
        optimizer.zero_grad()
        assert not set(forward_backward.ops) & (HOST_READS | HOST_DATA), sorted(set(forward_backward.ops))
        assert not set(step.ops) & HOST_READS, sorted(set(step.ops))
        assert any(op.startswith("aten.mm") or op.startswith("aten.addmm") for op in forward_backward.ops)
        if cpu.find_compiler() is not None:  # the attention ran on the C++ kernel, as on a CPU it does
            assert {"linformer_lab.causal_attention_forward", "linformer_lab.causal_attention_backward"} <= \
                set(forward_backward.ops)
        assert any(op.startswith("aten._foreach") for op in step.ops)

    # the recorder sees a host read where there is one: the stock optimizer reads its step count
    stock = torch.optim.RAdam(task.parameters(), lr=1e-3)
    for _ in range(2):
        task.update_loss(images())[0].backward()
        with Recorder() as step:
            stock.step()
    assert "aten._local_scalar_dense" in step.ops


def test_capturable_optimizer_steps_as_the_eager_one_and_saves_its_form(capturable_on_cpu):
    """make_capturable changes where the numbers live, not the arithmetic; a schedule fills the
    device learning rate in place (the replays read that tensor); a checkpoint holds the eager form."""
    tasks = [tiny_task(), tiny_task()]
    optimizers = [torch.optim.RAdam(t.parameters(), lr=1e-3, weight_decay=0.01) for t in tasks]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: (step + 1) / 4) for o in optimizers]
    make_capturable(optimizers[1], torch.device("cpu"))
    rate = optimizers[1].param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and optimizers[1].param_groups[0]["capturable"]
    for seed in range(7):
        for task, optimizer, schedule in zip(tasks, optimizers, schedules):
            optimizer.zero_grad()
            task.update_loss(images(seed=seed))[0].backward()
            optimizer.step()
            schedule.step()
        assert optimizers[1].param_groups[0]["lr"] is rate
        assert rate.item() == pytest.approx(optimizers[0].param_groups[0]["lr"], rel=1e-6)
    for (name, p), q in zip(tasks[0].named_parameters(), tasks[1].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")

    saved, want = eager_optimizer_state(optimizers[1].state_dict()), optimizers[0].state_dict()
    assert [g["capturable"] for g in saved["param_groups"]] == [False]
    assert saved["param_groups"][0]["lr"] == pytest.approx(want["param_groups"][0]["lr"], rel=1e-6)
    assert type(saved["param_groups"][0]["lr"]) is float
    for key, entry in saved["state"].items():
        assert entry["step"].device.type == "cpu" and entry["step"].item() == want["state"][key]["step"].item() == 7
    eager = torch.optim.RAdam(tasks[0].parameters(), lr=1e-3)
    eager.load_state_dict(saved)  # and it steps eagerly again
    tasks[0].update_loss(images())[0].backward()
    eager.step()


def test_a_graph_update_needs_a_cuda_device():
    task = tiny_task()
    update = CudaGraphUpdate(task.update_loss, torch.optim.RAdam(task.parameters()))
    with pytest.raises(ConfigurationError, match="needs its inputs on a CUDA device, got cpu"):
        update(images())
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        CudaGraphUpdate(task.update_loss, torch.optim.RAdam(task.parameters()), warmup=0)


# ---------------------------------------------------------------------- the task and Lightning


class EagerStandIn(CudaGraphUpdate):
    """CudaGraphUpdate with its CUDA parts replaced by eager runs of the same contract: the "capture"
    makes static input and output buffers, and every "replay" runs the update on the input buffers
    and overwrites the outputs, as a graph would."""

    instances: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        EagerStandIn.instances.append(self)

    def _warmup(self, inputs):
        return self._eager(inputs, set_to_none=True)

    def _capture(self, inputs):
        self.static_inputs = tuple(x.clone() for x in inputs)
        with torch.no_grad():  # a capture runs nothing: the buffers' shapes only
            self.static_outputs = tuple(torch.full_like(o, math.nan) for o in self.loss_fn(*self.static_inputs)[1])
        stand_in = self

        class Graph:
            def replay(self):
                stand_in.optimizer.zero_grad(set_to_none=False)
                loss, outputs = stand_in.loss_fn(*stand_in.static_inputs)
                loss.backward()
                stand_in.optimizer.step()
                for static, value in zip(stand_in.static_outputs, outputs):
                    static.copy_(value.detach())

        self.graph = Graph()


def fit(task: ImageGenerationTask, root, steps: int, accelerator: str = "cpu", precision: str = "32-true") -> list[float]:
    """``steps`` updates on 9 random images in batches of 4 (a last batch of 1), returning the
    logged training bits/dim of each update."""
    data = TensorDataset(images(9, seed=3), torch.zeros(9, dtype=torch.long))
    logged = []

    class Log(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            logged.append(float(trainer.callback_metrics["train/bits_per_dim"]))

    trainer = L.Trainer(accelerator=accelerator, devices=1, precision=precision, max_steps=steps, logger=False,
                        enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=[Log()],
                        enable_checkpointing=False)
    trainer.fit(task, DataLoader(data, batch_size=4))
    trainer.save_checkpoint(root / "last.ckpt")
    assert trainer.global_step == steps
    return logged


def test_a_graphed_fit_trains_as_the_eager_one(tmp_path, monkeypatch, capturable_on_cpu):
    """The hooks: one update per batch (none skipped, none doubled), the learning-rate schedule
    reaching the replays, the batch of another shape eager, checkpoints in the eager optimizer's form."""
    monkeypatch.setattr(graphed_update, "CudaGraphUpdate", EagerStandIn)
    monkeypatch.setattr(ImageGenerationTask, "check_cuda_graph", lambda self, device: None)
    EagerStandIn.instances = []
    settings = dict(lr=3e-3, warmup_steps=3, lr_schedule="cosine")
    eager, graphed = tiny_task(**settings), tiny_task(**settings, cuda_graph=True)
    steps = 8  # epochs of 3 batches: 4, 4, 1
    want = fit(eager, tmp_path / "eager", steps)
    got = fit(graphed, tmp_path / "graphed", steps)

    [update] = EagerStandIn.instances
    assert update.eager_updates == WARMUP_UPDATES + 1 and update.replays == steps - WARMUP_UPDATES - 1
    assert got == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")
    state = torch.load(tmp_path / "graphed" / "last.ckpt", map_location="cpu", weights_only=True)["optimizer_states"][0]
    assert state["param_groups"][0]["capturable"] is False and type(state["param_groups"][0]["lr"]) is float
    assert graphed.trainer.optimizers[0].param_groups[0]["capturable"]  # the run's own optimizer stays capturable


def test_what_a_graph_cannot_hold_is_refused(monkeypatch):
    from types import SimpleNamespace

    with pytest.raises(ConfigurationError, match="cuda_graph captures one pass over the whole sequence"):
        tiny_task(cuda_graph=True, segment_length=4)
    task = tiny_task(cuda_graph=True)
    with pytest.raises(ConfigurationError, match="model.cuda_graph true needs a CUDA device: .* on cpu; "
                                                 "set --model.cuda_graph false"):
        task.check_run(None, "cpu")
    tiny_task().check_run(None, "cpu")  # without cuda_graph a CPU is fine
    fine = dict(world_size=1, accumulate_grad_batches=1, gradient_clip_val=None, precision="bf16-mixed",
                precision_plugin=SimpleNamespace())
    for change, fragment in [({"world_size": 2}, "2 processes"), ({"accumulate_grad_batches": 4}, "accumulate_grad_batches 4"),
                             ({"gradient_clip_val": 1.0}, "gradient_clip_val 1.0"),
                             ({"precision": "16-mixed", "precision_plugin": SimpleNamespace(scaler=object())},
                              "precision 16-mixed")]:
        monkeypatch.setattr(graphed_update, "attached_trainer", lambda module, c=change: SimpleNamespace(**{**fine, **c}))
        with pytest.raises(ConfigurationError, match=f"cannot run with {fragment}"):
            task.check_cuda_graph(torch.device("cuda"))
    monkeypatch.setattr(graphed_update, "attached_trainer", lambda module: SimpleNamespace(**fine))
    task.check_cuda_graph(torch.device("cuda"))


def test_the_command_line_refuses_a_graph_on_a_cpu_in_one_line(tmp_path):
    code, out, err = run_cli(["fit", *tiny_mnist_args(tmp_path), "--model.cuda_graph=true", "--trainer.max_steps=1"])
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "model.cuda_graph true needs a CUDA device" in lines[0] and "set --model.cuda_graph false" in lines[0], lines[0]
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before the first update


def test_the_task_keeps_what_an_update_returned_past_the_next_replay(capturable_on_cpu):
    task = tiny_task(cuda_graph=True)
    task.cuda_graph_update = EagerStandIn(task.update_loss, torch.optim.RAdam(task.parameters(), lr=1e-2), warmup=1)
    task.graphed_update(images(seed=0))  # eager
    loss, nll = task.graphed_update(images(seed=1))  # "captured" and replayed
    kept = loss.clone(), nll.clone()
    later = task.graphed_update(images(seed=2))  # the buffers now hold this update's values
    assert task.cuda_graph_update.replays == 2 and not torch.equal(later[1], kept[1])
    assert torch.equal(loss, kept[0]) and torch.equal(nll, kept[1])


def test_the_gpu_commands_graphed_row_times_replays(monkeypatch, capturable_on_cpu):
    """``benchmarks/paper/gpu_check_model.py``'s graphed training row on CPU, the graph replaced by
    the eager stand-in: the task's own cuda_graph path runs, and every timed update is a replay."""
    from conftest import REPO

    for folder in ("benchmarks", "benchmarks/paper"):
        monkeypatch.syspath_prepend(str(REPO / folder))
    gpu_check_model = importlib.import_module("gpu_check_model")
    monkeypatch.setattr(graphed_update, "CudaGraphUpdate", EagerStandIn)
    EagerStandIn.instances = []
    row = gpu_check_model.train_rate("mnist_linear.yaml", "cpu", "none", 4, 0.2, dry_run=True, graph=True)
    [update] = EagerStandIn.instances
    assert update.eager_updates == WARMUP_UPDATES and update.replays >= row["updates"] + 1
    assert row["graph"] == "cuda_graph" and gpu_check_model.training_table([row])[0][:3] == [
        "mnist_linear.yaml", "none + CUDA graph", 4]



def test_a_new_fit_captures_its_own_optimizer(monkeypatch, capturable_on_cpu):
    from types import SimpleNamespace

    monkeypatch.setattr(graphed_update, "CudaGraphUpdate", EagerStandIn)
    task = tiny_task(cuda_graph=True)
    with pytest.raises(ConfigurationError, match="outside a Trainer, set task.cuda_graph_update"):
        task.graphed_update(images())
    runs = [SimpleNamespace(optimizers=[torch.optim.RAdam(task.parameters(), lr=1e-3)]) for _ in range(2)]
    for run in runs:
        monkeypatch.setattr(ImageGenerationTask, "trainer", property(lambda self, run=run: run))
        for seed in range(WARMUP_UPDATES + 2):
            task.graphed_update(images(seed=seed))
        assert task.cuda_graph_update.optimizer is run.optimizers[0] and task.cuda_graph_update.replays == 2
    with pytest.raises(ConfigurationError, match="captures the update of one optimizer; configure_optimizers gave 2"):
        monkeypatch.setattr(ImageGenerationTask, "trainer", property(lambda self: SimpleNamespace(optimizers=[
            torch.optim.RAdam(task.parameters()), torch.optim.RAdam(task.parameters())])))
        task.graphed_update(images())


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")


@GPU
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_on_a_gpu_a_graphed_fit_trains_as_the_eager_one(tmp_path, precision):
    """The real capture and replays in Lightning's loop (the Triton attention kernel, a capturable
    RAdam, the schedule, the last batch of another shape eager) against the eager loop."""
    settings = dict(lr=3e-3, warmup_steps=3, lr_schedule="cosine")
    eager, graphed = tiny_task(**settings), tiny_task(**settings, cuda_graph=True)
    steps = 10
    want = fit(eager, tmp_path / "eager", steps, "gpu", precision)
    got = fit(graphed, tmp_path / "graphed", steps, "gpu", precision)
    update = graphed.cuda_graph_update
    assert update.graph is not None and update.replays == steps - WARMUP_UPDATES - 2  # two batches of 1 eager
    tolerance = 1e-4 if precision == "32-true" else 2e-2
    assert got == pytest.approx(want, rel=tolerance)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=tolerance, atol=tolerance * 1e-2, msg=lambda text, name=name: f"{name}: {text}")
