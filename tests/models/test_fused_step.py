"""The fused C++ CPU step (linformer_lab/ops/cpu/fused_step.cpp, linformer_lab/models/generation/cpu_step.py)
against the readable ``Transformer.step`` and the Python ``fast_step``.

``fast_step`` takes the fused step on CPU inside a ``"model"`` weight-copy block for a stack of
linear attention with one of the maps it computes (elu, t2r, hedgehog), after a sequence's first
step. Checked here: it is taken where it should be and equals the readable step over many
positions (each map, the learned ones with random weights and F != D; float64 and float32, batch
1 and more, a small and the MNIST-shaped stack, from a first step or a prefill), its maps equal
the Python feature maps (far into exp's and softmax's tails), and every other case (switched
off, no copies, another backend, map or format, autocast, a state that does not fit, no
extension) keeps to the Python path. The tests that need the extension skip, saying why, where
it cannot be built (no C++ compiler).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.generation import cpu_step, dynamic_step, fast_step, weight_copies_for_steps, weights
from linformer_lab.models.transformer import Transformer
from linformer_lab.ops import build_cache, cpu, kernels
from linformer_lab.ops.state import LinearState

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(n_layers=2, d_model=16, n_heads=4, d_ff=32)
MNIST = dict(n_layers=8, d_model=256, n_heads=8, d_ff=1024)  # the paper's MNIST stack
#: tolerances against the readable step: summation order only
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}
#: the feature maps the fused step computes; the learned ones with F != D (C = F for t2r, 2 F for hedgehog)
MAPS = {"elu": AttentionConfig("linear"),
        "t2r": AttentionConfig("linear", feature_map="t2r", feature_map_kwargs={"num_features": 6}),
        "hedgehog": AttentionConfig("linear", feature_map="hedgehog", feature_map_kwargs={"num_features": 3})}


@pytest.fixture(scope="module")
def extension():
    try:
        return cpu.load()
    except RuntimeError as error:
        pytest.skip(f"needs the fused CPU step extension, which cannot be had here ({error})")


@pytest.fixture
def taken(monkeypatch):
    """Records, per fast_step call after the first, whether the fused step ran (True) or not."""
    record, original = [], cpu_step.step

    def spy(transformer, x_t, state, *args):
        result = original(transformer, x_t, state, *args)
        if state is not None:
            record.append(result is not None)
        return result

    monkeypatch.setattr(cpu_step, "step", spy)
    return record


def _model(shape=SMALL, dtype=torch.float64, attention=None, seed=0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(**shape, attention=attention or AttentionConfig("linear")).to(dtype).eval()
    with torch.no_grad():  # LayerNorms away from their initial ones and zeros, learned maps away from
        for name, parameter in model.named_parameters():  # hedgehog's identity: their weights count
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif "feature_map" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model


def _inputs(model: Transformer, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    d_model = model.norm.normalized_shape[0]
    dtype = model.norm.weight.dtype
    return torch.randn(batch, length, d_model, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _run(step, model, x, state=None, start=0):
    outs = []
    for t in range(start, x.shape[1]):
        out, state = step(model, x[:, t], state)
        outs.append(out)
    return torch.stack(outs, 1), state


def _readable(model, x_t, state):
    return model.step(x_t, state)


def _fast(model, x, state=None, start=0, copies="model"):
    context = weight_copies_for_steps(model, copies) if copies else contextlib.nullcontext()
    with torch.inference_mode(), context:
        return _run(fast_step, model, x, state, start)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("batch", [1, 3, cpu_step.FUSED_MAX_BATCH])
@pytest.mark.parametrize("shape", [SMALL, MNIST], ids=["small", "mnist"])
@pytest.mark.parametrize("feature_map", list(MAPS))
def test_the_fused_step_equals_the_readable_step(extension, taken, feature_map, shape, batch, dtype):
    model = _model(shape, dtype, MAPS[feature_map])
    length = 40 if shape is SMALL else 12
    x = _inputs(model, batch, length)
    with torch.no_grad():
        want, want_state = _run(_readable, model, x)
    got, state = _fast(model, x)
    assert taken == [True] * (length - 1)  # every step after the first
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    for (s, z), (want_s, want_z) in zip(state, want_state):  # the state, updated in place
        torch.testing.assert_close(s, want_s, **TOLERANCE[dtype])
        torch.testing.assert_close(z, want_z, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("feature_map", list(MAPS))
def test_the_fused_step_equals_the_python_fast_step(extension, taken, monkeypatch, feature_map, dtype):
    model = _model(MNIST, dtype, MAPS[feature_map])
    x = _inputs(model, 2, 10)
    fused, _ = _fast(model, x)
    assert taken == [True] * 9  # the fused step ran (a refused map would compare the Python step with itself)
    monkeypatch.setenv(kernels.SWITCH, "fused_step=pytorch")
    python, _ = _fast(model, x)
    torch.testing.assert_close(fused, python, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("feature_map", ["t2r", "hedgehog"])
def test_the_cpp_learned_maps_are_the_python_maps(extension, taken, feature_map, dtype):
    """One fused step from a zero state leaves Z = phi(k) (eq. 19), computed in C++: it equals the
    Python map's ``forward_keys`` on the same keys, and the outputs equal the Python step's
    (``phi(q)`` enters only there). The maps' weights x 100 spread W k + b over hundreds, where
    an exp that is not shifted by the maximum overflows in float32 (hedgehog's softmax)."""
    model = _model(dict(SMALL, n_layers=1), dtype, MAPS[feature_map])
    feature = model.layers[0].attention.attention.feature_map
    with torch.no_grad():
        for parameter in feature.parameters():
            parameter.mul_(100)
    x = _inputs(model, 3, 2)
    with torch.inference_mode(), weight_copies_for_steps(model, "model"):
        _, state = fast_step(model, x[:, 0])
        for layer_state in state:
            layer_state.joint.zero_()
        fused, state = fast_step(model, x[:, 1], state)
        attention = model.layers[0].attention
        q, k, _ = dynamic_step.split_heads(attention, attention.qkv(model.layers[0].norm_attention(x[:, 1])))
        want_phi_k = feature.forward_keys(k)
    assert taken == [True]
    projected = (feature.projection if feature_map == "t2r" else feature.key_map)(k)
    assert projected.abs().max() > 100  # exp(100) overflows float32: the softmax must be shifted
    assert want_phi_k.shape[-1] == feature.output_dim != k.shape[-1]
    torch.testing.assert_close(state[0][1], want_phi_k, **TOLERANCE[dtype])
    with torch.no_grad():
        python, _ = model.step(x[:, 1], [LinearState(torch.zeros_like(state[0].joint))])
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, python, **TOLERANCE[dtype])


def test_the_inline_phi_of_the_cpp_step_is_the_python_phi(extension, taken, monkeypatch):
    """fused_step.cpp writes phi = elu + 1 inline; the Python step reads the one Python phi,
    ``ops.linear_attention.elu_plus_one``. With queries and keys spread over both branches of phi
    and far into exp's tail, the fused step equals the Python step, and a Python step with
    another phi (exp on both branches) does not."""
    model = _model()
    attention = model.layers[0].attention
    with torch.no_grad():  # the q and k rows of every fused projection, x 20: |q|, |k| up to tens
        for layer in model.layers:
            layer.attention.qkv.weight[: 2 * attention.n_heads * attention.query_dim].mul_(20)
    x = _inputs(model, 2, 8)
    with torch.inference_mode():
        q = model.layers[0].attention.qkv(model.layers[0].norm_attention(x))[..., : attention.n_heads * attention.query_dim]
    assert q.min() < -20 and q.max() > 20
    fused, _ = _fast(model, x)
    assert taken == [True] * 7
    monkeypatch.setenv(kernels.SWITCH, "fused_step=pytorch")
    python, _ = _fast(model, x)
    torch.testing.assert_close(fused, python, **TOLERANCE[torch.float64])
    monkeypatch.setattr(dynamic_step, "elu_plus_one", lambda t: torch.exp(t))
    other, _ = _fast(model, x)
    assert not torch.allclose(fused, other, rtol=1e-3, atol=1e-3)


def test_under_no_grad_the_state_is_a_normal_tensor_whose_version_moves(extension, taken):
    """Outside inference mode (no_grad) the fused step updates the state in place as an in-place
    ATen op would, version counter included."""
    model = _model()
    x = _inputs(model, 2, 5)
    with torch.no_grad():
        want, _ = _run(_readable, model, x)
        with weight_copies_for_steps(model, "model"):
            _, state = fast_step(model, x[:, 0])
            versions = [s.joint._version for s in state]
            got, _ = _run(fast_step, model, x, state, start=1)
    assert taken == [True] * 4
    assert all(s.joint._version > v for s, v in zip(state, versions))
    torch.testing.assert_close(got, want[:, 1:], **TOLERANCE[torch.float64])


def test_the_fused_step_continues_a_prefilled_state(extension, taken):
    """``generate`` steps from the state of a parallel prefill: the fused step continues it."""
    model = _model()
    x = _inputs(model, 2, 20)
    with torch.inference_mode():
        _, prefilled = model(x[:, :8], return_state=True)
    with torch.no_grad():
        _, readable_state = model(x[:, :8], return_state=True)
        want, _ = _run(_readable, model, x, readable_state, start=8)
    got, _ = _fast(model, x, prefilled, start=8)
    assert taken == [True] * 12
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float64])


@pytest.mark.parametrize("off", ["environment", "no-extension"])
def test_switched_off_the_python_step_runs(request, taken, monkeypatch, off):
    """LINFORMER_LAB_KERNELS=fused_step=pytorch (with the extension there), or an extension that
    cannot be had: the Python step, the same numbers."""
    if off == "environment":
        request.getfixturevalue("extension")
        monkeypatch.setenv(kernels.SWITCH, "fused_step=pytorch")
    else:
        monkeypatch.setattr(cpu.FUSED_STEP, "module", lambda: None)
    model = _model()
    x = _inputs(model, 2, 6)
    with torch.no_grad():
        want, _ = _run(_readable, model, x)
    got, _ = _fast(model, x)
    assert taken == [False] * 5
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float64])


@pytest.mark.parametrize("case", ["no-copies", "bfloat16-copies", "softmax", "favor", "autocast", "large-batch"])
def test_other_cases_keep_to_the_python_path(extension, taken, case):
    attention = {"softmax": AttentionConfig("softmax"),
                 "favor": AttentionConfig("linear", feature_map="favor", feature_map_kwargs={"num_features": 8})}
    model = _model(dtype=torch.float32, attention=attention.get(case))
    x = _inputs(model, cpu_step.FUSED_MAX_BATCH + 1 if case == "large-batch" else 2, 6)
    copies = {"no-copies": None, "bfloat16-copies": "bfloat16"}.get(case, "model")
    with torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext():
        got, _ = _fast(model, x, copies=copies)
        with torch.no_grad():
            want, _ = _run(_readable, model, x)
    assert taken and not any(taken)
    if case != "bfloat16-copies":  # a lossy copy: not the readable step's numbers
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if case == "autocast" else 1e-5, atol=1e-2)


def test_a_state_that_does_not_fit_gets_the_python_paths_error(extension, taken):
    model = _model()
    x = _inputs(model, 2, 3)
    with torch.inference_mode(), weight_copies_for_steps(model, "model"):
        _, state = fast_step(model, x[:, 0])
        before = [s.joint.clone() for s in state]
        with pytest.raises(ValueError, match="do not fit the state"):
            fast_step(model, x[:1, 1], state)  # batch 1 against a state of batch 2
    assert taken == [False]
    assert all(torch.equal(s.joint, b) for s, b in zip(state, before))  # untouched


def test_the_plan_follows_the_weight_copies(extension, taken):
    """A new block of copies (after the weights changed) gets a new fused step; a block's end
    drops the fused step and the copies it reads."""
    model = _model()
    x = _inputs(model, 1, 4)
    first, _ = _fast(model, x)
    assert model not in weights._PLANS
    with torch.no_grad():
        model.layers[1].feedforward[3].weight.mul_(2)
        want, _ = _run(_readable, model, x)
    second, _ = _fast(model, x)
    assert taken == [True] * 6
    torch.testing.assert_close(second, want, **TOLERANCE[torch.float64])
    assert not torch.allclose(first, second)


def test_no_compiler_means_unavailable_with_one_warning(monkeypatch, tmp_path):
    """No cached build and no compiler: load() says so, fused_module() warns once and returns
    None, and fast_step keeps to the Python path (above)."""
    monkeypatch.setattr(cpu.FUSED_STEP, "_module", None)
    monkeypatch.setattr(cpu.FUSED_STEP, "_failure", None)
    monkeypatch.setenv(build_cache.VARIABLE, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-linformer-lab")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu.load()
    with pytest.warns(RuntimeWarning, match="keeps to the Python step"):
        assert cpu.fused_module() is None
    assert cpu.fused_module() is None  # not retried, not warned again


def test_the_build_folder_is_keyed_by_source_torch_and_flags(monkeypatch):
    info = {"source_sha256": "a", "torch": torch.__version__, "python": "3.11", "machine": "x86_64",
            "compiler": "c++ 13", "cflags": ["-O3"]}
    folders = {cpu.build_dir(info), cpu.build_dir({**info, "source_sha256": "b"}),
               cpu.build_dir({**info, "cflags": ["-O2"]}), cpu.build_dir({**info, "compiler": "clang++ 18"})}
    assert len(folders) == 4
    assert all(torch.__version__ in folder.name for folder in folders)


def test_the_source_digest_covers_the_headers_the_sources_include(monkeypatch, tmp_path):
    """A header edit (simd.h) must rebuild every module, though no .cpp changed."""
    monkeypatch.setattr(cpu, "_HERE", tmp_path)
    (tmp_path / "kernel.cpp").write_text('#include "simd.h"\n')
    (tmp_path / "simd.h").write_text("#define WIDTH 16\n")
    extension = cpu.Extension("kernel", "kernel.cpp", "test")
    before = extension.source_digest()
    (tmp_path / "notes.txt").write_text("not compiled")
    assert extension.source_digest() == before
    (tmp_path / "simd.h").write_text("#define WIDTH 32\n")
    assert extension.source_digest() != before
    assert extension.build_info(None)["source_sha256"] == extension.source_digest()


def test_every_source_the_builds_compile_ships_in_the_package():
    """A wheel that lacked simd.h would build nothing: pyproject's package-data must cover every
    C++ source and header of ops/cpu and ops/cuda."""
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("linformer_lab.ops.cpu", "linformer_lab.ops.cuda"):
        folder = REPO / package.replace(".", "/")
        sources = [f.name for f in folder.iterdir() if f.suffix in (".cpp", ".h", ".cu", ".cuh")]
        assert sources
        unshipped = [name for name in sources if not any(fnmatch.fnmatch(name, g) for g in package_data[package])]
        assert not unshipped, f"{package}: {unshipped} not in pyproject's package-data"


@pytest.mark.slow
def test_a_cached_build_loads_without_a_compiler(extension):
    """A later process loads the cached library without compiling: no compiler needed then."""
    code = "from linformer_lab.ops import cpu; print(cpu.load().__file__)"
    env = {**os.environ, "CXX": "no-such-compiler-linformer-lab", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    library = Path(done.stdout.strip())
    assert library.is_file() and (library.parent / "build_info.json").is_file()
    assert library.parent.parent == cpu.cache_root()
