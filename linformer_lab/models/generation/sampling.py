"""The sampling loop of ``PixelTransformer.generate`` and the choice of its decoder.

:func:`sample` fills an image sub-pixel by sub-pixel from a prefix's state (paper §3.4) with one
of the :data:`DECODERS`, under :func:`generation_kernels` and the weight copies of
:func:`~linformer_lab.models.generation.weights.weight_copies_for_steps`. Both decoders draw the
same noise (:func:`noise_per_position`, :func:`whole_image_noise`), so a generator seeded alike
gives the same images.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from linformer_lab.models.generation import dynamic_step, graph_step
from linformer_lab.models.generation.form import LINEAR_OR_SOFTMAX, why_not_paper_form
from linformer_lab.models.generation.weights import weight_copies_for_steps
from linformer_lab.models.mixture_of_logistics import DiscretizedMixtureOfLogistics

__all__ = ["DECODERS", "NOISE_BLOCK", "SINGLE_THREAD_MAX_BATCH", "choose_decoder", "generation_kernels",
           "noise_per_position", "sample", "whole_image_noise"]

#: ``PixelTransformer.generate(decoder=...)``: ``"dynamic"`` steps through ``fast_step`` (which takes
#: the C++ CPU step where it applies) and samples in Python; ``"graph"`` runs the whole generation
#: step on static buffers (:mod:`~linformer_lab.models.generation.graph_step`), a CUDA graph per step
#: on CUDA, eager elsewhere; ``"auto"`` is ``"graph"`` on CUDA for stacks it takes, else ``"dynamic"``.
DECODERS = ("auto", "dynamic", "graph")

def choose_decoder(decoder: str, transformer, device: torch.device) -> str:
    """``decoder`` checked against :data:`DECODERS` and ``"auto"`` resolved (see there)."""
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; valid choices: {', '.join(DECODERS)}")
    why = why_not_paper_form(transformer, LINEAR_OR_SOFTMAX)
    if decoder == "auto":
        return "graph" if device.type == "cuda" and why is None else "dynamic"
    if decoder == "graph" and why is not None:
        raise ValueError(f"decoder='graph' needs static buffers, but {why}; use decoder='dynamic'")
    return decoder


def sample(model, values: torch.Tensor, known: int, first: int, state, x_t: torch.Tensor, temperature: float,
           generator: torch.Generator | None, decoder: str, step_weights: str) -> None:
    """Fill ``values`` int64 ``(B, N)`` from position ``first`` on, sampling the positions
    ``>= known`` (those before hold the prefix), given the stack's ``state`` after positions
    ``< first`` (None at 0) and the input ``x_t (B, d_model)`` of ``first``. ``decoder``: as
    :func:`choose_decoder` returns; ``step_weights``: the format of the steps' weight copies."""
    transformer, head = model.transformer, model.head
    batch_size, length = values.shape
    device, recurrent = values.device, transformer.has_recurrent_form
    with generation_kernels(device, batch_size, recurrent), \
            weight_copies_for_steps(transformer, step_weights, enabled=recurrent):
        if decoder == "graph":
            noise = whole_image_noise(head, batch_size, length - known, temperature, generator, device)
            graph_step.decode(model, values, known, first, state, x_t, temperature, noise)
            return
        noise = noise_per_position(head, batch_size, length - known, temperature, generator, device)
        table = model.position_table()
        for position in range(first, length):
            # looked up on the module at every call, so a test or benchmark can wrap it
            hidden, state = dynamic_step.fast_step(transformer, x_t, state)
            if position >= known:  # a prefix position only sets the state: no output head
                values[:, position] = head.sample(head(hidden), temperature, noise=next(noise))
            if position + 1 < length:
                x_t = model.step_input(values[:, position], position + 1, table, batch_size)


#: On CPU, :func:`generation_kernels` runs recurrent steps of at most this many sequences with
#: one intra-op thread (restored afterwards). Such a step is a few dozen operations on
#: (B, d_model) rows; a thread-parallel region costs more than the work in it.
SINGLE_THREAD_MAX_BATCH = 16


@contextlib.contextmanager
def generation_kernels(device: torch.device, batch_size: int, recurrent: bool = True):
    """The kernel settings :meth:`~linformer_lab.models.pixel_transformer.PixelTransformer.generate`
    steps under on CPU, process-global and restored on exit:

    - oneDNN (mkldnn) off: it runs GELU in a thread-parallel region on every call, even for one
      step's (B, d_ff) tensor, which ATen's own kernel runs inline, many times faster. Nothing else
      on the fp32 step path uses oneDNN (linear layers go to BLAS), so fp32 results are identical.
    - one intra-op thread for a recurrent batch of at most :data:`SINGLE_THREAD_MAX_BATCH`; left as
      set for backends without a recurrent form (lsh), whose steps re-run the whole prefix.

    Code that steps the model by hand and must draw what ``generate`` draws runs under this too:
    with oneDNN on (on CPUs with bf16 instructions) a bf16 step copy goes through oneDNN's bf16
    matmul, which rounds differently from the native kernel.
    """
    if device.type != "cpu":
        yield
        return
    # only the flag itself: torch.backends.mkldnn.flags() would reset oneDNN's other settings too
    mkldnn_enabled, threads = torch.backends.mkldnn.enabled, torch.get_num_threads()
    try:
        torch.backends.mkldnn.enabled = False
        if recurrent and batch_size <= SINGLE_THREAD_MAX_BATCH:
            torch.set_num_threads(1)
        yield
    finally:
        torch.backends.mkldnn.enabled = mkldnn_enabled
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# ---------------------------------------------------------------- sampling noise

#: :meth:`PixelTransformer.generate` draws the sampling noise of this many positions per call
#: (``B x block x (K + 1)`` fp32 numbers, about 360 KB for 64 images and 10 logistics).
NOISE_BLOCK = 128


def _noise_blocks(head, batch_size: int, positions: int, generator: torch.Generator | None, device: torch.device):
    """``head.sampling_noise`` for ``positions``, :data:`NOISE_BLOCK` at a time: what both decoders draw."""
    for start in range(0, positions, NOISE_BLOCK):
        yield head.sampling_noise((batch_size, min(NOISE_BLOCK, positions - start)), generator, device)


def noise_per_position(head: DiscretizedMixtureOfLogistics, batch_size: int, positions: int, temperature: float,
                       generator: torch.Generator | None, device: torch.device):
    """Yields, per sampled position, the ``noise`` argument of ``head.sample``: slices of noise
    drawn :data:`NOISE_BLOCK` positions at a time, None at temperature 0 (which draws nothing).
    The same distribution as drawing per position, not the same stream (other images than
    position-by-position ``head.sample`` calls give)."""
    if temperature == 0:
        yield from itertools.repeat(None, positions)
        return
    for gumbel, logistic in _noise_blocks(head, batch_size, positions, generator, device):
        for i in range(gumbel.shape[1]):
            yield gumbel[:, i], logistic[:, i]


def whole_image_noise(head, batch: int, positions: int, temperature: float, generator, device):
    """The noise of :func:`noise_per_position` for all ``positions`` at once, the same numbers:
    ``(gumbel (B, P, K), logistic (B, P))``; None at temperature 0."""
    if temperature == 0 or positions == 0:
        return None
    gumbel, logistic = zip(*_noise_blocks(head, batch, positions, generator, device))
    return torch.cat(gumbel, dim=1), torch.cat(logistic, dim=1)
