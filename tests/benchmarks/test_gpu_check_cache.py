"""What benchmarks/paper/gpu_check.py carries into a device run (``--cache .gpu_cache``): the
previous revision of the Triton chunk kernel, exported here where the git history is and timed
beside the working tree's (it must load apart from its package and compute what ours computes),
and the compiled code of the last run (Triton's cache, the extensions' builds), which must load
again from wherever the next machine keeps its caches."""

from __future__ import annotations

import json
import sys
import tarfile

import pytest
import torch
from conftest import REPO

sys.path[:0] = [str(REPO / "benchmarks" / "paper"), str(REPO / "benchmarks")]
try:
    import gpu_check_cache
finally:
    del sys.path[:2]

from linformer_lab.ops.cuda.triton_chunk import chunk_linear_attention  # noqa: E402

#: The kernel the H200 run of 2026-11-28 measured (two state walks per pass, autotuned).
TWO_WALKS = "10c4e5b"


def relative_error(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.slow
@pytest.mark.parametrize("rev", [TWO_WALKS, "HEAD"])
def test_the_previous_kernel_loads_beside_ours_and_computes_what_ours_computes(tmp_path, rev):
    folder = tmp_path / "prev"
    commit = gpu_check_cache.export_previous(rev, folder)
    exported = {p.name for p in folder.iterdir()}
    # the launches and the kernels they import; never the operators (their names are the working tree's)
    assert {"__init__.py", "launch.py", "forward.py", "backward.py"} <= exported and "op.py" not in exported
    assert gpu_check_cache.exported_revision(folder) == commit
    assert "linformer_lab.ops.cuda.triton_chunk" not in (folder / "launch.py").read_text().split('"""')[-1]
    name = f"prev_{rev.lower()}"
    fn, revision = gpu_check_cache.previous_kernel(folder, name)
    assert revision == commit
    # its kernels are its own: the exported launch module, not the working tree's
    assert sys.modules[f"{name}.launch"].__file__ == str((folder / "launch.py").resolve())
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 150, 2, 16, requires_grad=True) for _ in range(3))  # several chunks of either revision
    grad = torch.randn(1, 150, 2, 16)
    got = fn(q, k, v)
    want = chunk_linear_attention(q, k, v, head_first=False)  # ours, through its torch.library operators
    assert relative_error(got, want) < 1e-6
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert relative_error(a, b) < 1e-5


def test_an_export_that_would_need_the_rest_of_its_package_is_refused():
    text = ("from linformer_lab.ops.cuda.triton_chunk import backward, forward\n"
            "from linformer_lab.ops.cuda.triton_chunk.forward import (\n    elu_plus_one,\n)\n")
    assert gpu_check_cache.package_imports(text) == {"backward", "forward"}
    assert gpu_check_cache.relative_imports(text, "launch.py") == \
        "from . import backward, forward\nfrom .forward import (\n    elu_plus_one,\n)\n"
    with pytest.raises(ValueError, match="launch.py of that revision imports linformer_lab.ops: it does not run apart"):
        gpu_check_cache.relative_imports("from linformer_lab.ops import custom_ops\n", "launch.py")


def compiled_kernel(root, folder: str, name: str, size: int = 64, mtime: float = 1e9):
    """A compiled kernel as Triton caches it: metadata, binary, intermediate IR, and the group file
    that lists them by absolute path."""
    import os

    where = root / folder
    where.mkdir(parents=True)
    files = {f"{name}.json": b'{"name": "%s"}' % name.encode(), f"{name}.cubin": os.urandom(size),
             f"{name}.ptx": b"// ptx", f"{name}.llir": b"; llir"}
    for file, data in files.items():
        (where / file).write_bytes(data)
    (where / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {f: str(where / f) for f in files}}))
    for path in where.iterdir():
        os.utime(path, (mtime, mtime))


def test_triton_caches_travel_to_another_machines_cache_folder(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(first))
    compiled_kernel(first, "a1", "superchunk_forward")
    compiled_kernel(first, "b2", "chunk_fwd_kernel_h")
    (first / "c3").mkdir()
    (first / "c3" / "chunk_fwd_kernel_h.autotune.json").write_text('{"key": [64], "configs_timings": []}')
    (first / "d4").mkdir()
    (first / "d4" / "__triton_launcher.so").write_bytes(b"launcher")  # Triton's launcher: no group file
    archive = tmp_path / gpu_check_cache.TRITON_ARCHIVE
    saved = gpu_check_cache.save_triton_cache(archive, used={"a1"})
    assert saved == {"autotune": 1, "kernels": 2, "used": 1, "left_out": 0, "bytes": archive.stat().st_size}
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "a1/superchunk_forward.cubin" in names and "a1/superchunk_forward.ptx" not in names  # IR stays behind
    monkeypatch.setenv("TRITON_CACHE_DIR", str(second))
    assert gpu_check_cache.restore_triton_cache(archive) == {"autotune": 1, "kernels": 2}
    assert gpu_check_cache.autotune_results() == 1
    group = json.loads((second / "a1" / "__grp__superchunk_forward.json").read_text())["child_paths"]
    # what Triton's cache looks up: every listed file, at its path in this machine's cache folder
    assert group == {f: str(second / "a1" / f) for f in ("superchunk_forward.json", "superchunk_forward.cubin")}
    assert (second / "a1" / "superchunk_forward.cubin").read_bytes() == (first / "a1" / "superchunk_forward.cubin").read_bytes()
    assert gpu_check_cache.restore_triton_cache(tmp_path / "missing.tar.gz") == {"autotune": 0, "kernels": 0}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert gpu_check_cache.save_triton_cache(tmp_path / "none.tar.gz")["bytes"] == 0
    assert not (tmp_path / "none.tar.gz").exists()


def test_a_triton_cache_over_the_cap_keeps_the_autotune_results_and_the_kernels_the_parts_used(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    for i in range(8):  # incompressible binaries of 64 KiB, the newest last
        compiled_kernel(tmp_path / "cache", f"k{i}", f"kernel{i}", size=64 * 1024, mtime=1e9 + i)
    (tmp_path / "cache" / "t").mkdir()
    (tmp_path / "cache" / "t" / "fla.autotune.json").write_text("{}")
    archive = tmp_path / "a.tar.gz"
    saved = gpu_check_cache.save_triton_cache(archive, used={"k0", "k1"}, cap=300 * 1024)
    assert archive.stat().st_size <= 300 * 1024 and saved["left_out"] >= 4 and saved["used"] == 2
    with tarfile.open(archive) as tar:
        kept = {name.split("/")[0] for name in tar.getnames()}
    # the used ones first, then the newest
    assert kept == {"t", "k0", "k1", *[f"k{i}" for i in range(7, 7 - saved["kernels"] + 2, -1)]}


def test_the_extensions_builds_travel_without_their_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("LINFORMER_LAB_BUILD_DIR", str(tmp_path / "first"))
    build = tmp_path / "first" / "cpu" / "torch2.11-py3.12-x86_64-abc"
    build.mkdir(parents=True)
    (build / "fused_step.so").write_bytes(b"library")
    (build / "fused_step.o").write_bytes(b"object")
    (build / "build_info.json").write_text('{"torch": "2.11.0"}')
    cuda = tmp_path / "first" / "cuda" / "torch2.11.0-cuda13.0-py312" / "sm90-def"
    cuda.mkdir(parents=True)
    (cuda / "linear_cuda.so").write_bytes(b"library")
    (cuda / "build_info.json").write_text("{}")
    (tmp_path / "first" / "cpu" / "build-unfinished").mkdir()  # no build_info.json: not a build
    archive = tmp_path / gpu_check_cache.EXTENSIONS_ARCHIVE
    assert gpu_check_cache.save_extensions(archive) == 2
    monkeypatch.setenv("LINFORMER_LAB_BUILD_DIR", str(tmp_path / "second"))
    assert gpu_check_cache.restore_extensions(archive) == 2
    restored = tmp_path / "second" / "cpu" / build.name
    assert sorted(p.name for p in restored.iterdir()) == ["build_info.json", "fused_step.so"]
    assert (tmp_path / "second" / "cuda" / cuda.parent.name / cuda.name / "linear_cuda.so").is_file()
    assert gpu_check_cache.save_extensions(tmp_path / "capped.tar.gz", cap=10) == 0  # over its cap: none
    assert not (tmp_path / "capped.tar.gz").exists()


def test_the_parts_record_which_triton_kernels_they_compiled_or_loaded(tmp_path):
    import triton

    before = triton.knobs.compilation.listener
    try:
        gpu_check_cache.record_compilations(tmp_path / "used.txt")
        group = {"superchunk_dq.json": "/cache/f00d/superchunk_dq.json", "superchunk_dq.cubin": "/cache/f00d/superchunk_dq.cubin"}
        triton.knobs.compilation.listener(src=None, metadata={}, metadata_group=group, times=None, cache_hit=True)
    finally:
        triton.knobs.compilation.listener = before
    assert (tmp_path / "used.txt").read_text().split() == ["f00d"]
