"""The training update as one CUDA graph: forward, backward and the optimizer step captured once
and replayed for every later batch of the same shape.

An eager update of a small model is hundreds of small kernels, each launched by Python, so the
GPU waits on the host; a graph replays them with one launch. What :class:`CudaGraphUpdate` relies on:

* static shapes: the inputs are copied into buffers the graph reads; a batch of another shape
  (the epoch's last, when the batch size does not divide the data) runs eagerly, on the same
  optimizer and the same gradient memory;
* no host read in the update (no ``.item()``, no tensor built from Python numbers on the host):
  the model's attention kernels read no lengths on the host, and the optimizer runs with
  ``capturable=True`` (its step counts and learning rate as device tensors, see
  :func:`make_capturable`); ``tests/tasks/test_graphed_update.py`` traces the update whole;
* the optimizer's state made before capture, and every lazy first-call cost (Triton's autotuner,
  cuBLAS's workspaces) paid before it: :data:`WARMUP_UPDATES` eager updates on the first batches
  run on a side stream, as CUDA's capture rules ask; they are real updates, counted as such;
* no autocast cache: a cast weight cached by autocast outside the graph would be read by the
  replays after the weight changed, so the capture runs with ``cache_enabled=False``.

The parameters keep their tensors (a graph replays into the memory it recorded), so nothing may
replace them between replays (``load_state_dict`` copies in place and is fine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linformer_lab.tasks.base import attached_trainer
from linformer_lab.validation import ConfigurationError

__all__ = ["WARMUP_UPDATES", "CudaGraphUpdate", "GraphedTraining", "eager_optimizer_state", "make_capturable"]

#: Eager updates before the capture (see the module doc): the first creates the optimizer's
#: state, the ones after it run each kernel at the shape it is captured at once more.
WARMUP_UPDATES = 3

#: ``loss_fn(*inputs) -> (loss, outputs)``: the scalar to differentiate and the tensors to hand back.
LossFunction = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch ``optimizer`` (one of torch's, with a ``capturable`` option) to its capturable form in
    place: ``capturable=True``, the learning rate a 0-dim tensor on ``device`` (a schedule fills it
    in place, the replays read it) and every step count a float32 tensor on ``device``. The
    arithmetic is unchanged; a state loaded from an eager checkpoint works too."""
    for group in optimizer.param_groups:
        if "capturable" not in group:
            raise ConfigurationError(f"{type(optimizer).__name__} has no capturable form; a CUDA graph needs an "
                                     f"optimizer that keeps its step counts on the device (Adam, AdamW, RAdam, ...)")
        group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            state["step"] = step.to(device=device, dtype=torch.float32)


def eager_optimizer_state(state: dict) -> dict:
    """An optimizer ``state_dict`` as its eager form writes it: ``capturable`` off, the learning
    rate a float, the step counts on the CPU. A checkpoint of a graphed run then loads into an
    eager one, on any device (a capturable optimizer refuses CPU parameters)."""
    groups = [{**group, "capturable": False,
               "lr": float(group["lr"]) if isinstance(group["lr"], torch.Tensor) else group["lr"]}
              for group in state["param_groups"]]
    states = {key: {name: (value.detach().to("cpu", torch.float32) if name == "step" and isinstance(value, torch.Tensor)
                           else value) for name, value in entry.items()}
              for key, entry in state["state"].items()}
    return {**state, "param_groups": groups, "state": states}


class CudaGraphUpdate:
    """``update(*inputs) -> outputs``: one training update of ``loss_fn`` with ``optimizer``,
    eager for the first :data:`WARMUP_UPDATES` calls, then captured as one CUDA graph and replayed
    (the module doc says what this needs). The outputs (detached) are the graph's own buffers,
    overwritten by the next replay: clone what must outlive it."""

    def __init__(self, loss_fn: LossFunction, optimizer: torch.optim.Optimizer, warmup: int = WARMUP_UPDATES):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 eager update (the optimizer's state is made in it), got {warmup}")
        self.loss_fn, self.optimizer, self.warmup = loss_fn, optimizer, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: tuple[torch.Tensor, ...] = ()
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.eager_updates = 0
        self.replays = 0
        self._stream: torch.cuda.Stream | None = None
        self._capturable_on: torch.device | None = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = inputs[0].device
        if self._capturable_on != device:
            make_capturable(self.optimizer, device)
            self._capturable_on = device
        if self.graph is None and self.eager_updates < self.warmup:
            return self._warmup(inputs)
        if self.graph is None:
            self._capture(inputs)
        elif [x.shape for x in inputs] != [s.shape for s in self.static_inputs]:
            return self._eager(inputs, set_to_none=False)  # keeps the gradient memory the graph writes
        for static, x in zip(self.static_inputs, inputs):
            static.copy_(x, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.static_outputs

    def _eager(self, inputs, set_to_none: bool) -> tuple[torch.Tensor, ...]:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        loss, outputs = self.loss_fn(*inputs)
        loss.backward()
        self.optimizer.step()
        self.eager_updates += 1
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def _check_device(inputs) -> None:
        if inputs[0].device.type != "cuda":
            raise ConfigurationError(f"a CUDA graph update needs its inputs on a CUDA device, got {inputs[0].device}")

    def _warmup(self, inputs) -> tuple[torch.Tensor, ...]:
        self._check_device(inputs)
        if self._stream is None:
            self._stream = torch.cuda.Stream(inputs[0].device)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            outputs = self._eager(inputs, set_to_none=True)
        torch.cuda.current_stream().wait_stream(self._stream)
        return outputs

    def _capture(self, inputs) -> None:
        self._check_device(inputs)
        self.static_inputs = tuple(x.clone() for x in inputs)
        # gradients made inside the capture live in the graph's memory; backward then writes them
        # at every replay rather than adding to the previous ones
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        autocast = torch.is_autocast_enabled("cuda")
        # thread_local: only this thread's calls are checked while capturing; a data loader's
        # pin-memory thread may allocate pinned memory meanwhile, which is no part of the update
        with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), enabled=autocast, cache_enabled=False), \
                torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss, outputs = self.loss_fn(*self.static_inputs)
            loss.backward()
            self.optimizer.step()
        self.static_outputs = tuple(o.detach() for o in outputs)
        self.graph = graph


class GraphedTraining:
    """Lightning's hooks for a task whose ``cuda_graph`` hyper-parameter runs its training update
    as a :class:`CudaGraphUpdate` (mixed in before :class:`~linformer_lab.tasks.base.Task`).

    ``training_step`` calls :meth:`graphed_update` and logs what it returns; backward and the
    optimizer step have then run, so ``backward`` and ``optimizer_zero_grad`` do nothing and
    ``optimizer_step`` only runs Lightning's closure; step counts, schedule and checkpoints stay
    Lightning's (checkpoints in the eager optimizer's form, :func:`eager_optimizer_state`). What
    the graph leaves out is refused at the start of the run (:meth:`check_cuda_graph`).
    """

    cuda_graph_update: CudaGraphUpdate | None = None

    def uses_cuda_graph(self) -> bool:
        return bool(self.hparams.get("cuda_graph"))

    def update_loss(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The loss the graph differentiates and the tensors ``training_step`` logs; the task's own."""
        raise NotImplementedError(f"{type(self).__name__} does not define update_loss, which cuda_graph needs")

    def graphed_update(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One update on ``inputs`` through the task's :class:`CudaGraphUpdate` (made on the first
        call of a fit, with its optimizer; outside a Trainer, the one set as ``cuda_graph_update``);
        its outputs cloned, so a logged value outlives the next replay."""
        trainer = attached_trainer(self)
        optimizers = trainer.optimizers if trainer is not None else ()
        if trainer is None and self.cuda_graph_update is None:
            raise ConfigurationError("outside a Trainer, set task.cuda_graph_update = CudaGraphUpdate(task.update_loss, "
                                     "optimizer) before the first graphed update")
        # a new fit makes a new optimizer: a graph of the old one would step that one instead
        if trainer is not None and (self.cuda_graph_update is None or self.cuda_graph_update.optimizer not in optimizers):
            if len(optimizers) != 1:
                raise ConfigurationError(f"model.cuda_graph true captures the update of one optimizer; "
                                         f"configure_optimizers gave {len(optimizers)}")
            self.cuda_graph_update = CudaGraphUpdate(self.update_loss, optimizers[0])
        return tuple(o.clone() for o in self.cuda_graph_update(*inputs))

    def check_run(self, datamodule=None, device=None) -> None:
        super().check_run(datamodule, device)
        if device is not None and self.uses_cuda_graph():
            self.check_cuda_graph(torch.device(device))

    def check_cuda_graph(self, device: torch.device) -> None:
        """Raise a ConfigurationError naming what a graphed update cannot run with on ``device``."""
        if device.type != "cuda":
            raise ConfigurationError(f"model.cuda_graph true needs a CUDA device: it replays the update's recorded GPU "
                                     f"kernels, and this run is on {device.type}; set --model.cuda_graph false")
        trainer = attached_trainer(self)
        if trainer is None:
            return
        refused = [
            (trainer.world_size > 1, f"{trainer.world_size} processes (the gradients' all-reduce is not captured; "
                                     f"use one device)"),
            (trainer.accumulate_grad_batches > 1, f"accumulate_grad_batches {trainer.accumulate_grad_batches} "
                                                  f"(every replay is a whole update)"),
            (bool(trainer.gradient_clip_val), f"gradient_clip_val {trainer.gradient_clip_val} (clipping runs in "
                                              f"Lightning's optimizer step, which the graph replaces)"),
            (getattr(trainer.precision_plugin, "scaler", None) is not None,
             f"precision {trainer.precision} (its gradient scaler decides on the host; use bf16-mixed or 32-true)"),
        ]
        for bad, what in refused:
            if bad:
                raise ConfigurationError(f"model.cuda_graph true cannot run with {what}; or set --model.cuda_graph false")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if not self.uses_cuda_graph():
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        optimizer_closure()  # training_step: the whole update, optimizer step included

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if not self.uses_cuda_graph():
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        if not self.uses_cuda_graph():
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.uses_cuda_graph() and "optimizer_states" in checkpoint:
            checkpoint["optimizer_states"] = [eager_optimizer_state(s) for s in checkpoint["optimizer_states"]]
