"""Training without launch overhead: the fused mixture-of-logistics loss and the compiled
per-batch loss (``ImageGenerationTask(compile=...)``) against the eager ones.

Both go through ``torch.compile`` (inductor's C++ code on CPU), which takes minutes on two
cores: slow. The references are the eager functions, in float64 for the loss (values and the
gradient of the parameters, with bins at both edges, floored and midpoint-rule scales).
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch._inductor import cpu_vec_isa

from linformer_lab.models.mixture_of_logistics import DiscretizedMixtureOfLogistics
from linformer_lab.tasks.image_generation import ImageGenerationTask
from linformer_lab.validation import ConfigurationError

TINY = dict(n_layers=1, n_heads=2, d_model=16, d_ff=32, num_mixtures=3, image_shape=[1, 4, 4])


def _params_and_targets():
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(3, 40, 12, dtype=torch.float64, generator=gen) * 3
    params[..., 8:] *= 4  # log-scales from about -12 to 12: the floor and the midpoint rule both taken
    target = torch.randint(0, 256, (3, 40), generator=gen)
    target[:, :5], target[:, 5:10] = 0, 255  # the two edge bins
    return params, target


def test_log_prob_keeps_float64():
    head = DiscretizedMixtureOfLogistics(8, 4)
    params, target = _params_and_targets()
    assert head.log_prob(params, target).dtype == torch.float64
    assert head.log_prob(params.float(), target).dtype == torch.float32
    torch.testing.assert_close(head.log_prob(params, target).float(), head.log_prob(params.float(), target),
                               rtol=1e-4, atol=1e-4)


def _compiler_takes_the_flags(isa, code: str) -> bool:
    from torch._inductor.cpp_builder import get_cpp_compiler

    flags = isa.build_arch_flags().split()
    return subprocess.run([get_cpp_compiler(), *flags, "-x", "c++", "-fsyntax-only", "-"], input="",
                          capture_output=True, text=True).returncode == 0


@pytest.mark.slow
def test_fused_loss_equals_the_eager_loss_with_gradients(monkeypatch):
    # inductor trusts the CPU's flags (torch.cpu's) for AVX2, AVX-512, VNNI and AMX instead of
    # proving each with a test build that a fresh Python loads: a torch import each, six on a CPU
    # with AMX, most of this test on two cores (config.cpp.vec_isa_ok spares the base checks, not
    # those of AVX-512 bf16, VNNI and AMX). The compiler is still asked whether it takes the
    # instruction set's flags (gcc 12 refuses AMX-fp16's, which such a CPU would claim).
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", _compiler_takes_the_flags)
    head = DiscretizedMixtureOfLogistics(8, 4)
    params, target = _params_and_targets()
    eager, fused = params.clone().requires_grad_(), params.clone().requires_grad_()
    want, got = head.log_prob(eager, target), head.log_prob(fused, target, fused=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(torch.autograd.grad(got, fused, weights)[0], torch.autograd.grad(want, eager, weights)[0],
                               rtol=1e-11, atol=1e-11)


@pytest.mark.slow
def test_compiled_model_gives_the_eager_loss_and_gradients(monkeypatch):
    """Dynamo's capture of the whole per-batch loss and its backward (AOT autograd) give the
    eager loss; inductor's code generation, minutes on two cores for this graph, is the fused
    loss test's part."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend="aot_eager", **kwargs))
    torch.manual_seed(0)
    task = ImageGenerationTask(**TINY, compile="model")
    task.configure_model()
    task.configure_model()  # once only: a second call keeps the compiled function
    images = torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    params = list(task.model.parameters())
    want = task.model.nll(images)
    got = task._nll((images, torch.zeros(2)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(torch.autograd.grad(got.mean(), params), torch.autograd.grad(want.mean(), params)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_compile_and_decoder_choices_are_checked():
    with pytest.raises(ConfigurationError, match="compile must be one of 'none', 'loss', 'model', got 'yes'"):
        ImageGenerationTask(**TINY, compile="yes")
    with pytest.raises(ConfigurationError, match="decoder must be one of 'auto', 'dynamic', 'graph'"):
        ImageGenerationTask(**TINY, decoder="fast")
    assert ImageGenerationTask(**TINY, compile="loss").model.fused_loss
    assert not ImageGenerationTask(**TINY).model.fused_loss
