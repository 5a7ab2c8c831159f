"""Shared test helpers: tolerances and the registered attention configs, a tiny copy-task
configuration and ways to run ``cli.py``, and the kernel tests' fixtures (the built C++ CPU
extensions and each instruction-set version of their loops; a missing extension is a skip only
where there is no C++ compiler and no cached build: where there is one, as in CI, a failed build
fails the tests instead of hiding them)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

# Under pytest-xdist (the README's `pytest -n 2`) every worker shares the cores with the other:
# one thread each (and for the processes a test starts), or the two would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

# Triton fixes its mode when first imported (lightning imports it): on a machine without a CUDA GPU
# its interpreter runs the Triton kernels on CPU tensors (tests/ops/test_triton_chunk.py).
os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

# The CLI runs a bf16 precision in fp32 on a CPU without bf16 units (cli/checks.py: resolve_precision).
# The tests that train bf16 on a CPU mean bf16 on any CPU, so they run as on one with AMX; the tests
# of that rule set the variable themselves (tests/cli/test_precision_rule.py).
os.environ.setdefault("LINFORMER_LAB_CPU_BF16", "amx")

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    import lightning as L

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_test():
    """Every test starts from torch's seed 0 and with Ctrl-C's handler of a terminal's foreground job,
    and leaves that handler as it found it, whatever ran before it in its process (``pytest -n 2``
    deals tests to workers in an order of its own) and however pytest was started (a background
    job ignores Ctrl-C): a test that draws from the global generator gets the same numbers, and
    Lightning's SIG_IGN after an interrupt (a Trainer run directly) does not outlive its test, where
    every child process would inherit it and ignore a real Ctrl-C."""
    torch.manual_seed(0)
    sigint = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, sigint)


def assert_close(name: str, reference: torch.Tensor, got: torch.Tensor, rtol: float = 1e-9, atol: float = 1e-9) -> None:
    """``got`` equals ``reference`` within tolerance; on failure the message names the component
    under test (``name``, e.g. ``"linear/poly2 causal: grad q"``) and the largest error and where."""
    if got.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference {tuple(reference.shape)}")
    error = (got.double() - reference.double()).abs()
    allowed = atol + rtol * reference.double().abs()
    if not bool((error <= allowed).all()) or not bool(torch.isfinite(got).all() == torch.isfinite(reference).all()):
        worst = int((error - allowed).flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), error.shape))
        raise AssertionError(
            f"{name}: max |error| {error.max().item():.3g} (allowed {atol:g} + {rtol:g}|ref|), worst at {index}: "
            f"got {got[index].item():.6g}, reference {reference[index].item():.6g}"
        )


def built_in_attention() -> list[str]:
    """The attention backends this project registers, whatever plugins are installed beside it: the
    tests hold each to a reference of its own math, which a plugin's backend (the README's
    ``decayed_linear``) does not share; a plugin is tested by its own tests
    (tests/attention/test_state_contract.py installs one). Registered feature maps all count."""
    import linformer_lab as ll

    return _built_in(ll.ATTENTION)


def built_in_feature_maps() -> list[str]:
    """The feature maps this project registers (the benchmarks list these), whatever plugins are installed."""
    import linformer_lab as ll

    return _built_in(ll.FEATURE_MAPS)


def _built_in(registry) -> list[str]:
    from linformer_lab.registry import SOURCE_CHECKOUT

    return [name for name, dists in registry.distributions().items()
            if all(d == SOURCE_CHECKOUT or d.split("==")[0] == "linformer_lab" for d in dists)]


def attention_configs(lsh_kwargs: dict | None = None, feature_map_kwargs: dict | None = None) -> list:
    """Every built-in attention backend that runs here as an ``AttentionConfig``; a backend with
    a feature map once per registered map (``feature_map_kwargs``: name -> kwargs of that map).
    ``lsh_kwargs``: lsh's arguments (by default 4 chunks of 4 over 16 positions, so hashing
    really decides who sees whom)."""
    import linformer_lab as ll
    from linformer_lab.attention.config import AttentionConfig

    configs = []
    for backend in built_in_attention():
        cls = ll.ATTENTION.get(backend)
        if backend == "linear_cuda" and not torch.cuda.is_available():
            continue  # CUDA-only backend; tests/ops/test_linear_cuda_gpu.py covers it on GPUs
        if getattr(cls, "uses_feature_map", False):
            map_kwargs = feature_map_kwargs or {}
            configs += [AttentionConfig(backend=backend, feature_map=fm, feature_map_kwargs=map_kwargs.get(fm, {}))
                        for fm in ll.list_feature_maps()]
        elif backend == "lsh":
            configs.append(AttentionConfig(backend="lsh", kwargs=lsh_kwargs or {"n_hashes": 2, "bucket_size": 4, "n_buckets": 4}))
        else:
            configs.append(AttentionConfig(backend=backend))
    return configs


def config_id(config) -> str:
    """A test id for an ``AttentionConfig``: ``backend`` or ``backend-feature_map``."""
    return config.backend + (f"-{config.feature_map}" if config.feature_map else "")


def tiny_copy_args(root: Path, backend: str = "linear", *extra: str) -> list[str]:
    """Arguments for a copy-task run small enough for CPU tests (about 10 ms a step).

    Logs go to ``root`` through an explicit CSVLogger (``root/version_N/metrics.csv``), so the
    tests read the same files whether or not tensorboard is installed. Lengths from 1 and no
    dropout, whatever the config says: exact-resume tests need a run that draws no random numbers.
    """
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root), "name": ""}}
    return [
        "--config", "copy_linear.yaml",
        f"--model.attention.backend={backend}",
        "--model.d_model=16", "--model.n_heads=2", "--model.n_layers=1", "--model.dropout=0.0",
        "--data.min_length=1", "--data.max_length=6", "--data.batch_size=4", "--data.train_batches_per_epoch=3",
        "--data.val_batches=2", "--data.test_batches=2",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true",
        "--trainer.deterministic=true", "--trainer.val_check_interval=null",
        "--trainer.check_val_every_n_epoch=1", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger={json.dumps(logger)}",
        "--checkpoint.every_n_train_steps=null",
        *extra,
    ]


def tiny_mnist_args(root: Path, *extra: str) -> list[str]:
    """The README's MNIST config at toy size on real MNIST: 4 updates an epoch, validation every 2,
    no progress bar (a later ``--trainer.enable_progress_bar=true`` in ``extra`` turns it on)."""
    return [
        "--config", "mnist_linear.yaml",
        "--model.n_layers=1", "--model.d_model=16", "--model.n_heads=2", "--model.d_ff=32", "--model.num_mixtures=2",
        "--data.batch_size=4", "--trainer.limit_train_batches=4", "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.precision=32-true", "--trainer.deterministic=true", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={root}", *extra,
    ]


def fit_saving_every_step(model: L.LightningModule, datamodule, dirpath: Path, ckpt_path: Path | None = None) -> None:
    """Two epochs of ``model`` on ``datamodule`` on CPU with a checkpoint ``step=N.ckpt`` in
    ``dirpath`` after every update (resumed from ``ckpt_path`` when given): the data resume tests
    restart from each step's checkpoint and compare the batches seen."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ckpt], limit_val_batches=0, accelerator="cpu")
    trainer.fit(model, datamodule, ckpt_path=ckpt_path)


@contextlib.contextmanager
def _restored_torch_flags():
    # `trainer.deterministic` switches torch's global flags; don't leak them into other tests.
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


def run_cli(args: list[str], cwd: Path = REPO) -> tuple[int, str, str]:
    """Run ``cli.main(args)`` in this process, then close a process group it opened (as ``cli.py``
    does: a ddp run of one process opens one); returns (exit code, stdout, stderr)."""
    from linformer_lab.cli.entry import close_process_group, main

    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with _restored_torch_flags(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            # keep every warning, as a fresh process would print it: Python's default filter
            # shows a warning once per call site (an earlier test would swallow it), and
            # pytest records warnings instead of printing them
            warnings.simplefilter("always")
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            finally:
                close_process_group()
    finally:
        os.chdir(old)
    warned = "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return code, out.getvalue(), err.getvalue() + warned


def cli_subprocess(args: list[str], cwd: Path = REPO, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start ``python cli.py ARGS`` (the repo's cli.py) as a child process with piped output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), *args], cwd=cwd, env=full_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


def checkpoint_dir(root: Path, version: int = 0) -> Path:
    """Where a fresh ``fit`` into ``root`` keeps its checkpoints: its run's ``version_N/checkpoints``."""
    return Path(root) / f"version_{version}" / "checkpoints"


def read_metrics(log_dir: Path) -> list[dict]:
    """Rows of ``log_dir/metrics.csv`` as dicts of floats (empty cells dropped)."""
    import csv

    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]



def __getattr__(name: str):
    """``BatchCounter``, made on first use (``--trainer.callbacks+=conftest.BatchCounter``): lightning
    takes seconds to import, and the pytest processes that run no training (the ones a test starts
    on a single module) should not pay for it."""
    if name != "BatchCounter":
        raise AttributeError(f"module 'conftest' has no attribute {name!r}")
    import lightning as L

    class BatchCounter(L.Callback):
        """Writes how many train and validation batches ran to the JSON file ``path`` when the run ends."""

        def __init__(self, path: str):
            self.path = path
            self.counts = {"train": 0, "validate": 0}

        def on_train_batch_end(self, *args, **kwargs):
            self.counts["train"] += 1

        def on_validation_batch_end(self, trainer, *args, **kwargs):
            if not trainer.sanity_checking:
                self.counts["validate"] += 1

        def teardown(self, trainer, pl_module, stage):
            Path(self.path).write_text(json.dumps(self.counts))

    BatchCounter.__module__, BatchCounter.__qualname__ = __name__, "BatchCounter"  # its class path: conftest.BatchCounter
    globals()["BatchCounter"] = BatchCounter  # one class for every later use
    return BatchCounter


# ---------------------------------------------------------------- kernel fixtures (tests/ops/)

#: The versions of the hot loops each extension carries, widest first.
INSTRUCTION_SETS = ["avx512", "avx2", "baseline"]


def _built(extension, what: str):
    """``extension`` (an ``ops.cpu.Extension``) loaded, or a skip where it cannot be built here."""
    from linformer_lab.ops import cpu

    try:
        return extension.load()
    except RuntimeError as error:
        if cpu.find_compiler() is not None:
            raise
        pytest.skip(f"needs {what}, which cannot be built here ({error})")


def _on_instruction_set(extension, name: str):
    """Runs the test on one version of the extension's loops (a skip where the CPU lacks it), and
    restores the version chosen before."""
    try:
        before = extension.set_instruction_set(name)
    except RuntimeError as error:
        pytest.skip(str(error))
    yield name
    extension.set_instruction_set(before)


@pytest.fixture(scope="session")
def causal_extension():
    """The fused causal attention's register recurrence (``ops/cpu/causal_recurrence.cpp``), built."""
    from linformer_lab.ops import cpu

    return _built(cpu.CAUSAL_RECURRENCE, "the causal CPU kernel extension")


@pytest.fixture(scope="session")
def lsh_extension():
    """lsh attention's window step (``ops/cpu/lsh_window.cpp``), built."""
    from linformer_lab.ops import cpu

    return _built(cpu.LSH_WINDOW, "the lsh window extension")


@pytest.fixture(params=INSTRUCTION_SETS)
def causal_isa(request, causal_extension):
    """Each instruction-set version of the recurrence that the CPU can run."""
    yield from _on_instruction_set(causal_extension, request.param)


@pytest.fixture(params=INSTRUCTION_SETS)
def lsh_isa(request, lsh_extension):
    """Each instruction-set version of the lsh window step that the CPU can run."""
    yield from _on_instruction_set(lsh_extension, request.param)


# ---------------------------------------------------------------- running in parallel (pytest -n 2)

@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """A test module whose tests share a module- or session-scoped fixture of its own (a DDP job, a
    trained model, a built emulator) runs on one xdist worker (``--dist loadgroup``, in the pytest
    settings), so the fixture is made once instead of once per worker."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::")[0]
        definitions = getattr(item, "_fixtureinfo", None)
        shared = definitions is not None and any(
            d.scope != "function" and d.baseid == module for defs in definitions.name2fixturedefs.values() for d in defs)
        if shared:
            item.add_marker(pytest.mark.xdist_group(module))


def pytest_sessionstart(session):
    """The controller of an xdist run builds the C++ CPU extensions that the build cache lacks,
    side by side, before the workers start: both workers would otherwise compile each one at once."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "numprocesses", None):
        return
    from linformer_lab.ops import cpu

    if cpu.find_compiler() is None:
        return
    names = [name for name in ("CAUSAL_RECURRENCE", "LSH_WINDOW", "FUSED_STEP")
             if getattr(cpu, name)._cached_library() is None]
    builds = [subprocess.Popen([sys.executable, "-c", f"from linformer_lab.ops import cpu; cpu.{name}.load()"], cwd=REPO)
              for name in names]
    for build in builds:
        build.wait()  # a failed build fails the tests that need it, with its message
