"""Every GPU kernel is known to every place that must know it: one check per step of
docs/ARCHITECTURE.md's "Where to add" (a GPU kernel), whose failure names the step and what lacks
the kernel, so that a newcomer who skips a step is told which.

A GPU kernel is a candidate of ``ops/kernels.py`` whose description names its source under
``ops/cuda/`` (step 1), or a Triton kernel function there: an undecorated function with
``tl.constexpr`` parameters, which ``launch.py`` compiles (the ``@triton.jit`` helpers are not
kernels). The places are read, not restated here, so a kernel added anywhere is checked.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO
from test_docs_facts import kernel_table, named_kernels, section
from torch.utils._python_dispatch import TorchDispatchMode

from linformer_lab.attention.linear import GPU_KERNELS
from linformer_lab.ops import kernel_check, kernels

CUDA_DIR = REPO / "linformer_lab" / "ops" / "cuda"
GUIDE = "docs/ARCHITECTURE.md 'Where to add' (a GPU kernel)"


def step(number: int, what: str) -> str:
    return f"step {number} of {GUIDE}: {what}"


def gpu_candidates() -> list[tuple[str, kernels.Candidate]]:
    """(op, candidate) of every candidate whose description names a source under ops/cuda/."""
    return [(op, c) for op, candidates in kernels.CANDIDATES.items() for c in candidates
            if "ops/cuda" in c.description]


def triton_kernel_functions(folder: Path = CUDA_DIR) -> dict[str, str]:
    """name -> module of every Triton kernel under ``folder``: a top-level function without
    decorators with a parameter annotated ``tl.constexpr``."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.decorator_list and any(
                    isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr"
                    for a in node.args.args + node.args.kwonlyargs):
                found[node.name] = module
    return found


def defined_operators(folder: Path = CUDA_DIR) -> set[str]:
    """The ``linformer_lab::`` operators that ``custom_ops.define`` registers under ``folder``."""
    text = "\n".join(path.read_text() for path in folder.rglob("*.py"))
    return set(re.findall(r"custom_ops\.define\(\s*\"(\w+)\(", text))


def gpu_tests() -> list[str]:
    """``benchmarks/paper/gpu_check.py``'s ``GPU_TESTS``, read from the script's source: importing it
    would import the benchmarks' modules beside it, which the library's tests need not."""
    tree = ast.parse((REPO / "benchmarks" / "paper" / "gpu_check.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "GPU_TESTS" for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/paper/gpu_check.py has no GPU_TESTS list")


def test_there_are_gpu_kernels_to_check():
    """The checks below are over these: an empty list would pass them all."""
    assert ("causal_attention", "triton") in {(op, c.name) for op, c in gpu_candidates()}
    assert {"superchunk_forward", "linear_attention_step"} <= set(triton_kernel_functions())
    assert "chunk_linear_attention_fwd" in defined_operators()


def test_step_1_source_under_ops_cuda():
    for op, candidate in gpu_candidates():
        paths = re.findall(r"ops/cuda[\w/.]*", candidate.description)
        missing = [p for p in paths if not (REPO / "linformer_lab" / p).exists()]
        assert not missing, step(1, f"{op}={candidate.name}'s description names {missing}, not under linformer_lab/")


def test_step_2_launch_kernels_lists_every_triton_kernel():
    pytest.importorskip("triton")
    from linformer_lab.ops.cuda.triton_chunk import launch

    listed = {name: module.__name__ for name, module in launch.KERNELS.items()}
    for name, module in triton_kernel_functions().items():
        assert listed.get(name) == module, step(2, f"launch.KERNELS lacks {name!r} (of {module}): launch.kernels() "
                                                   "does not compile it, nor launch.compile_for for the Hopper check")


def test_step_2_compile_for_gives_every_kernel_its_arguments(monkeypatch):
    """``launch.compile_for`` (the Hopper check of tests/ops/test_triton_chunk_gpu.py) passes every
    kernel's constexprs a value and its other parameters a type: Triton's compiler is replaced by
    a recorder, so nothing is compiled."""
    pytest.importorskip("triton")
    import triton
    import triton.compiler
    import triton.language as tl

    from linformer_lab.ops.cuda.triton_chunk import launch

    sources = []
    monkeypatch.setattr(triton.compiler, "ASTSource", lambda **kwargs: kwargs)
    monkeypatch.setattr(triton, "compile", lambda source, **kwargs: sources.append(source) or source)
    compiled = launch.compile_for((9, 0), torch.bfloat16, 128, 128)
    assert set(compiled) == set(launch.KERNELS)
    for name, source in compiled.items():
        kernel = getattr(launch.KERNELS[name], name)
        wanted = [arg for arg, p in inspect.signature(kernel).parameters.items() if p.annotation is tl.constexpr]
        unset = sorted(arg for arg in wanted if source["constexprs"].get(arg) is None)
        assert not unset, step(2, f"launch.compile_for gives kernel {name!r} no value for {unset}")
        assert set(source["signature"]) == set(source["fn"].arg_names), step(
            2, f"launch.compile_for leaves parameters of kernel {name!r} untyped")


class Dispatched(TorchDispatchMode):
    """The names of the operators dispatched inside the block."""

    def __enter__(self):
        self.names = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_step_3_each_triton_candidate_runs_through_an_operator():
    """Run on its op's probe (``kernel_check.PROBES``, on a CPU under Triton's interpreter), a Triton
    candidate dispatches a ``linformer_lab::`` operator: what torch.compile traces as one node
    (a Triton launch from plain Python it cannot trace)."""
    pytest.importorskip("triton")
    from linformer_lab.ops.cuda.triton_chunk import launch

    if not launch.interpreting():
        pytest.skip("runs the kernels on CPU tensors in Triton's interpreter")
    for op, candidate in gpu_candidates():
        if "ops/cuda/triton" not in candidate.description:
            continue  # the CUDA C++ numerator's operators: custom_ops.register_cuda_ops, which needs a GPU
        _, _, call = kernel_check.PROBES[op][1]("cpu", torch.float32)
        with Dispatched() as seen:
            call(candidate)
        assert any(name.startswith("linformer_lab.") for name in seen.names), step(
            3, f"{op}={candidate.name} launches its kernel outside a torch.library operator (custom_ops.define)")


def test_step_3_every_operator_is_opchecked():
    tests = [path.read_text() for path in (REPO / "tests").rglob("test_*.py")]
    checked = {name for name in defined_operators()
               if any(re.search(rf"opcheck\(\s*[\w.]*?\b{name}\b", t) for t in tests)}  # the operator, opcheck's first argument
    # a _bwd operator is its _fwd's registered gradient: checked with it (opcheck's autograd registration)
    unchecked = {name for name in defined_operators() - checked
                 if not (name.endswith("_bwd") and name.removesuffix("_bwd") + "_fwd" in checked)}
    assert not unchecked, step(3, f"no test runs torch.library.opcheck on {sorted(unchecked)}")


def test_step_4_gpu_candidates_come_first():
    for op, candidates in kernels.CANDIDATES.items():
        for c in candidates:  # a GPU candidate whose description hid its source would skip every check here
            assert "CUDA" not in c.condition or "ops/cuda" in c.description, step(
                4, f"{op}={c.name} runs on CUDA tensors but its description names no source under ops/cuda/")
    for op, candidate in gpu_candidates():
        names = [c.name for c in kernels.CANDIDATES[op]]
        first_other = min(i for i, c in enumerate(kernels.CANDIDATES[op]) if "ops/cuda" not in c.description)
        assert names.index(candidate.name) < first_other, step(
            4, f"CANDIDATES[{op!r}] lists {candidate.name!r} after a CPU candidate: {names}")
        assert names[-1] == kernels.PYTORCH, step(4, f"CANDIDATES[{op!r}] does not end with {kernels.PYTORCH!r}")


def ops_linear_selects(monkeypatch) -> set[str]:
    """The ops ``linear``'s causal forward asks ``kernels.select`` for, recorded over the elu map (fused)
    and relu (mapped first, then the numerator); the switch forcing the PyTorch candidates, which
    take every branch that calls another op."""
    from linformer_lab.attention import build_attention

    asked, select = set(), kernels.select

    def recording(op, *args, **kwargs):
        asked.add(op)
        return select(op, *args, **kwargs)

    monkeypatch.setattr(kernels, "select", recording)
    q = torch.randn(1, 2, 5, 4)
    for feature_map, switch in (("elu", "auto"), ("relu", "auto"), ("elu", kernels.PYTORCH)):
        with kernels.switched(switch):
            build_attention("linear", causal=True, query_dim=4, feature_map=feature_map)(q, q, q)
    return asked


def test_step_5_linear_cuda_forces_a_gpu_kernel_of_each_op_linear_runs(monkeypatch):
    gpu = {(op, c.name) for op, c in gpu_candidates()}
    linear_ops = ops_linear_selects(monkeypatch)
    assert "causal_attention" in linear_ops
    for op in {op for op, _ in gpu} & linear_ops:
        assert (op, GPU_KERNELS.get(op)) in gpu, step(
            5, f"attention/linear.py's GPU_KERNELS lacks {op!r} (has {GPU_KERNELS}): linear_cuda would not force it")
    for op, name in GPU_KERNELS.items():
        assert (op, name) in gpu, step(5, f"GPU_KERNELS names {op}={name}, not a GPU candidate")


def test_step_6_the_probe_table_has_every_op():
    for op in kernels.CANDIDATES:
        assert op in kernel_check.PROBES, step(6, f"kernel_check.PROBES lacks {op!r}: describe() and plugins --check "
                                                  "say nothing of it")
    assert set(kernel_check.PROBES) == set(kernels.CANDIDATES)


def test_step_7_every_doc_table_names_each_gpu_kernel():
    docs = {
        "README.md's backend table (rows linear, lsh)": named_kernels("\n".join(
            line for line in (REPO / "README.md").read_text().splitlines() if re.match(r"\| `(linear|lsh)` \|", line))),
        "docs/ARCHITECTURE.md's 'Where speed code goes'": named_kernels(
            section("docs/ARCHITECTURE.md", "## Where speed code goes")),
        "docs/cli.md's kernel table": {(op, name) for op, names in kernel_table(
            section("docs/cli.md", "## Kernels and switches")).items() for name in names},
        "ops/kernels.py's docstring table": {
            (row[0].strip("`"), name.strip()) for row in (re.split(r"\s{2,}", line.strip()) for line in
                                                          kernels.__doc__.split("\n=====")[2].splitlines()
                                                          if line.startswith("``")) for name in row[1].split(",")},
    }
    for op, candidate in gpu_candidates():
        lacking = [where for where, named in docs.items() if (op, candidate.name) not in named]
        assert not lacking, step(7, f"{'; '.join(lacking)} lack{'s' if len(lacking) == 1 else ''} {op}={candidate.name}")


def test_step_8_a_gpu_test_file_runs_each_gpu_kernel():
    files = gpu_tests()
    texts = {f: (REPO / f).read_text() for f in files if (REPO / f).is_file()}
    for op, candidate in gpu_candidates():
        assert any(f"{op}={candidate.name}" in text for text in texts.values()), step(
            8, f"no file of benchmarks/paper/gpu_check.py's GPU_TESTS {files} names {op}={candidate.name}")
    assert "tests/ops/test_triton_chunk_gpu.py" in files, step(
        8, "GPU_TESTS lacks tests/ops/test_triton_chunk_gpu.py, the Hopper compile check of launch.KERNELS")


def test_step_8_gpu_check_runs_every_gpu_test_of_a_gpu_kernel():
    """A test file with a test that needs a CUDA GPU and names a GPU kernel (a Triton kernel, an
    operator of ops/cuda/ or a GPU candidate's ``op=name``) is one the GPU session runs: a GPU test
    outside GPU_TESTS runs nowhere (no other machine has a GPU)."""
    names = {*triton_kernel_functions(), *defined_operators(), *(f"{op}={c.name}" for op, c in gpu_candidates())}
    kernel_names = re.compile("|".join(rf"(?<![\w=]){re.escape(name)}(?!\w)" for name in sorted(names)))
    needs_gpu = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    files = gpu_tests()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text()
        if needs_gpu.search(text) and (found := kernel_names.search(text)):
            where = str(path.relative_to(REPO))
            assert where in files, step(8, f"benchmarks/paper/gpu_check.py's GPU_TESTS lacks {where}, whose GPU tests "
                                           f"run {found.group()!r}")
