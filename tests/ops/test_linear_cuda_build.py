"""linear_cuda on the CPU, always run: argument parsing, the no-GPU error path, the autograd
wrapper around the operators, and a compile of the extension with the machine's nvcc
(``cuda_build`` marker). The other linear_cuda tests and how to run them all:
``tests/ops/linear_cuda_reference.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from linear_cuda_reference import CACHE, REPO

from linformer_lab.ops import cuda as lcuda

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


@pytest.mark.slow
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
