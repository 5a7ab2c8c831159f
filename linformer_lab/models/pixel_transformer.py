"""Autoregressive image model of paper §4.2: a causal transformer over the sub-pixels of an image.

Sequence order
--------------
An image ``(C, H, W)`` is read as ``N = H * W * C`` sub-pixels in raster order: rows top to
bottom, columns left to right, then each pixel's channels (R, G, B for CIFAR-10), i.e. transposed
to ``(H, W, C)`` and flattened, so sub-pixel ``(c, h, w)`` is at ``(h * W + w) * C + c``. MNIST
gives 784 elements, CIFAR-10 3072. The first ``k * W * C`` elements are then exactly the top
``k`` rows, what image completion conditions on.

Inputs and outputs
------------------
Position ``i`` predicts sub-pixel ``i`` from the *previous* sub-pixel's value (shift right);
position 0 gets a learned start vector, so the first sub-pixel is modelled too and all ``N``
dimensions enter bits/dim. Each input is

    value_embedding[x_{i-1}]  (or the start vector at i = 0)
    + position(i // C)  + channel_embedding[i % C]  (the latter only if C > 1)

i.e. the position and channel embeddings describe the sub-pixel *being predicted*, what the
query there needs to know. ``position`` is one learned vector per pixel (``"pixel"``, ``H * W``
vectors: the paper's setting) or the sum of a row and a column vector (``"row_column"``,
``H + W`` vectors): every row then trains the same column vectors, so "the same column, one row
up" is learned from 28 times more examples, which counts when a CPU affords a few thousand
updates. The output head is a discretized mixture of logistics over the 256 levels
(:class:`DiscretizedMixtureOfLogistics`).

Two paths through the same weights
----------------------------------
:meth:`PixelTransformer.forward` evaluates all positions in parallel (training, bits/dim);
:meth:`PixelTransformer.step` runs the transformer as an RNN (paper §3.4), one sub-pixel per
:meth:`Transformer.step` call, with a per-layer state: fixed-size ``(S, Z)`` for linear attention,
a growing KV cache for softmax (lsh: its input prefix). :meth:`PixelTransformer.generate` samples
through the same recurrence with :func:`~linformer_lab.models.generation.fast_step`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from linformer_lab.attention.config import AttentionConfig
from linformer_lab.models.generation import sampling, weights
from linformer_lab.models.mixture_of_logistics import DiscretizedMixtureOfLogistics
from linformer_lab.models.transformer import Transformer
from linformer_lab.validation import ConfigurationError, check_transformer_shape

__all__ = ["PixelTransformer", "images_to_sequence", "sequence_to_images"]

#: Number of intensity levels of an 8-bit image.
NUM_LEVELS = 256

#: How the position of a pixel is embedded (see the module docstring).
POSITION_EMBEDDINGS = ("pixel", "row_column")


def images_to_sequence(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(B, C, H, W)`` -> int64 ``(B, H * W * C)`` in raster (H, W, C) order."""
    return images.permute(0, 2, 3, 1).reshape(images.shape[0], -1).long()


def sequence_to_images(sequence: torch.Tensor, image_shape: Sequence[int]) -> torch.Tensor:
    """int ``(B, H * W * C)`` in (H, W, C) order -> uint8 ``(B, C, H, W)``; inverse of
    :func:`images_to_sequence`."""
    c, h, w = image_shape
    return sequence.reshape(sequence.shape[0], h, w, c).permute(0, 3, 1, 2).to(torch.uint8).contiguous()


class PixelTransformer(nn.Module):
    """Causal transformer + discretized mixture of logistics over the sub-pixels of images.

    Args:
        attention: the attention (:class:`AttentionConfig`, a backend name, or a dict of its
            fields); default ``linear`` with the ``elu`` feature map. Kept as ``attention_config``.
        n_layers, n_heads, d_model, d_ff: transformer size. Paper: MNIST 8 layers, CIFAR-10
            16 layers, both 8 heads, d_model 256 (32 per head), d_ff 1024.
        num_mixtures: logistic components of the output head (paper: 10).
        image_shape: ``(C, H, W)``, e.g. ``(1, 28, 28)`` or ``(3, 32, 32)``.
        dropout: dropout in the transformer layers.
        position_embedding: ``"pixel"`` (a learned vector per pixel, the default) or
            ``"row_column"`` (a learned row vector plus a learned column vector).

    Shapes: ``forward(images uint8 (B, C, H, W)) -> params (B, N, 3K)`` fp32, ``N = C * H * W``
    in the module docstring's order.
    """

    def __init__(
        self,
        attention: AttentionConfig | str | dict | None = None,
        n_layers: int = 8,
        n_heads: int = 8,
        d_model: int = 256,
        d_ff: int = 1024,
        num_mixtures: int = 10,
        image_shape: Sequence[int] = (1, 28, 28),
        dropout: float = 0.0,
        position_embedding: str = "pixel",
    ):
        super().__init__()
        check_transformer_shape(d_model, n_heads, n_layers, d_ff, dropout)
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ConfigurationError(f"position_embedding must be one of {', '.join(map(repr, POSITION_EMBEDDINGS))}, "
                             f"got {position_embedding!r}")
        image_shape = tuple(int(s) for s in image_shape)
        if len(image_shape) != 3 or min(image_shape) < 1:
            raise ValueError(f"image_shape must be (channels, height, width) with positive sizes, got {image_shape}")
        self.attention_config = AttentionConfig.coerce(attention)
        self.image_shape = image_shape
        channels, height, width = image_shape
        self.channels = channels
        self.seq_len = channels * height * width
        self.d_model = d_model

        self.value_embedding = nn.Embedding(NUM_LEVELS, d_model)
        self.start = nn.Parameter(torch.empty(d_model))
        self.position_embedding = position_embedding
        if position_embedding == "pixel":
            self.pixel_position_embedding = nn.Embedding(height * width, d_model)
        else:
            self.row_embedding = nn.Embedding(height, d_model)
            self.column_embedding = nn.Embedding(width, d_model)
        # One channel gives a constant vector that the biases can absorb: leave it out.
        self.channel_embedding = nn.Embedding(channels, d_model) if channels > 1 else None
        self.transformer = Transformer(
            n_layers, d_model, n_heads, d_ff, causal=True, dropout=dropout,
            attention=self.attention_config,
        )
        self.head = DiscretizedMixtureOfLogistics(d_model, num_mixtures=num_mixtures, num_bins=NUM_LEVELS)
        #: :meth:`nll` and :meth:`segment_nll` compute the loss with ``head.log_prob(fused=True)``
        self.fused_loss = False
        # Small embeddings (GPT-style 0.02) keep the residual stream from being dominated by
        # the input at initialisation; nn.Embedding's default N(0, 1) is ~16x larger per vector.
        position_tables = ([self.pixel_position_embedding.weight] if self.position_embedding == "pixel"
                           else [self.row_embedding.weight, self.column_embedding.weight])
        for table in (self.value_embedding.weight, self.start, *position_tables):
            nn.init.normal_(table, std=0.02)
        if self.channel_embedding is not None:
            nn.init.normal_(self.channel_embedding.weight, std=0.02)

    # ------------------------------------------------------------------ sequences

    def to_sequence(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, C, H, W)`` -> int64 ``(B, N)``, checking the shape."""
        if images.dim() != 4 or tuple(images.shape[1:]) != self.image_shape:
            raise ValueError(f"expected images of shape (B, {', '.join(map(str, self.image_shape))}), got {tuple(images.shape)}")
        if images.is_floating_point():
            raise TypeError(f"expected integer images with values 0..255 (uint8), got {images.dtype}")
        return images_to_sequence(images)

    def to_images(self, sequence: torch.Tensor) -> torch.Tensor:
        """int ``(B, N)`` -> uint8 ``(B, C, H, W)``."""
        return sequence_to_images(sequence, self.image_shape)

    def position_table(self) -> torch.Tensor:
        """``(N, d_model)``: pixel-position (+ channel) embedding of every sequence position."""
        if self.position_embedding == "pixel":
            pixels = self.pixel_position_embedding.weight  # (H * W, d_model)
        else:  # pixel h * W + w gets row[h] + column[w]
            pixels = (self.row_embedding.weight[:, None] + self.column_embedding.weight[None]).flatten(0, 1)
        table = pixels.repeat_interleave(self.channels, dim=0)  # row i -> pixel i // C
        if self.channel_embedding is not None:
            table = table + self.channel_embedding.weight.repeat(self.seq_len // self.channels, 1)  # row i -> channel i % C
        return table

    def embed(self, sequence: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Inputs of the parallel path for positions ``start..L-1``: int ``(B, L)`` values,
        ``L <= N`` -> ``(B, L - start, d_model)``. Position ``i`` gets the value at ``i - 1`` (the
        start vector at 0): the last value of ``sequence`` is only predicted, never read."""
        b, length = sequence.shape
        x = self.value_embedding(sequence[:, max(start - 1, 0) : length - 1])  # values at start-1 .. L-2
        if start == 0:
            x = torch.cat([self.start.to(x.dtype).expand(b, 1, self.d_model), x], dim=1)
        return x + self.position_table()[start:length]

    # ------------------------------------------------------------------ parallel path

    def sequence_params(self, sequence: torch.Tensor) -> torch.Tensor:
        """int ``(B, L)`` with ``L <= N`` -> params ``(B, L, 3K)`` for positions ``0..L-1``:
        :meth:`forward` on a truncated image for causal backends; compares with the recurrent
        path prefix by prefix (lsh, whose outputs depend on later keys)."""
        if sequence.shape[1] > self.seq_len:
            raise ValueError(f"sequence of length {sequence.shape[1]} is longer than the image ({self.seq_len})")
        return self.head(self.transformer(self.embed(sequence)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``(B, C, H, W)`` -> mixture params ``(B, N, 3K)`` (fp32)."""
        return self.sequence_params(self.to_sequence(images))

    def nll(self, images: torch.Tensor) -> torch.Tensor:
        """Negative log-likelihood per sub-pixel in nats: uint8 ``(B, C, H, W)`` -> ``(B, N)``."""
        sequence = self.to_sequence(images)
        return -self.head.log_prob(self.sequence_params(sequence), sequence, fused=self.fused_loss)

    def segment_nll(self, sequence: torch.Tensor, start: int, stop: int, state: list | None = None):
        """NLL of positions ``start..stop-1`` given the state after positions ``< start``:
        int ``(B, N)`` -> ``((B, stop - start)`` nats, state after ``stop - 1)``. Chained over
        consecutive segments it equals :meth:`nll` (segmented training, see
        :func:`~linformer_lab.models.transformer.segmented_forward`)."""
        hidden, state = self.transformer(self.embed(sequence[:, :stop], start), state=state, return_state=True)
        return -self.head.log_prob(self.head(hidden), sequence[:, start:stop], fused=self.fused_loss), state

    # ------------------------------------------------------------------ recurrent path

    def step(
        self, previous: torch.Tensor | None, position: int, state: list | None = None,
        batch_size: int | None = None, position_table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list]:
        """One position in RNN mode: params for sub-pixel ``position`` given the value of
        ``position - 1``.

        Args:
            previous: int64 ``(B,)``, the value at ``position - 1``; None at position 0
                (the start vector is fed; then ``batch_size`` gives B).
            position: the position being predicted, ``0 <= position < N``; call in order
                0, 1, 2, ... with the returned state.
            state: the per-layer state from the previous call (None at position 0).
            position_table: :meth:`position_table` computed once by a calling loop (computed
                here if None).
        Returns: ``(params (B, 3K) fp32, state)``.

        The readable form of :meth:`generate`'s loop, which adds sampling and steps with
        :func:`~linformer_lab.models.generation.fast_step` (the same numbers, faster).
        """
        if previous is None and batch_size is None:
            raise ValueError("step at position 0 needs batch_size (there is no previous value to take it from)")
        table = self.position_table() if position_table is None else position_table
        hidden, state = self.transformer.step(self.step_input(previous, position, table, batch_size), state)
        return self.head(hidden), state

    @torch.inference_mode()
    def generate(
        self,
        batch_size: int,
        temperature: float = 1.0,
        prefix: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        step_weights: str = "model",
        prefill: bool = True,
        decoder: str = "auto",
    ) -> torch.Tensor:
        """Sample images sub-pixel by sub-pixel through the recurrent path (paper §3.4).

        Args:
            batch_size: images to generate (must equal ``prefix.shape[0]`` if a prefix is given).
            temperature: see :meth:`DiscretizedMixtureOfLogistics.sample`; 0 is deterministic.
            prefix: the first ``P`` sub-pixels in sequence order, int ``(B, P)`` (e.g. the top
                half of test images, ``images_to_sequence(x)[:, :P]``), or uint8 images
                ``(B, C, H', W)`` holding the top ``H'`` rows. They set the state (see
                ``prefill``); the rest is sampled.
            generator: a ``torch.Generator`` on the model's device, for reproducible samples.
            step_weights: the copy of the linear weights the steps read
                (:mod:`linformer_lab.models.generation.weights`): ``"model"`` (default) the
                model's own values; ``"bfloat16"`` or ``"int8"`` a lossy copy with 1/2 or 1/4 of
                the bytes, for small-batch latency, where every step reads every weight.
                Recurrent backends only.
            prefill: run the prefix through the parallel forward in one pass, which returns the
                state the steps continue from (default); False feeds it through ``step`` one
                position at a time. Same state; the parallel pass reads the model's own weights
                whatever ``step_weights`` says.
            decoder: how the steps run, one of :data:`~linformer_lab.models.generation.DECODERS`
                (see there): ``"dynamic"`` the ``fast_step`` loop, ``"graph"`` static buffers
                replayed as CUDA graphs, ``"auto"`` (default) picks. Both draw the same noise.
        Returns: uint8 ``(B, C, H, W)``; the prefix positions hold the prefix.

        Runs in eval mode (dropout off), the mode restored afterwards. Memory per image is the
        per-layer state (constant for ``linear``, O(position) for softmax's KV cache) plus a copy
        of the linear weights in the ``step_weights`` format (``"model"``: on CPU only). The steps run under
        :func:`~linformer_lab.models.generation.generation_kernels` (the prefill pass does not:
        it gains from every thread).
        """
        device = self.start.device
        self.check_step_weights(step_weights)
        decoder = sampling.choose_decoder(decoder, self.transformer, device)
        prefix = self._check_prefix(prefix, batch_size, device)
        known = 0 if prefix is None else prefix.shape[1]
        values = torch.empty(batch_size, self.seq_len, dtype=torch.long, device=device)
        if known:
            values[:, :known] = prefix
        was_training = self.training
        self.eval()
        try:
            table = self.position_table()  # computed once: the embeddings are fixed while sampling
            state, first = None, 0
            x_t = self.step_input(None, 0, table, batch_size)
            if known and prefill:
                # positions 0..known-1 in one parallel pass, leaving the state the steps would;
                # outside the loop's kernel settings: this pass gains from every thread
                _, state = self.transformer(self.embed(values[:, :known]), return_state=True)
                first = known
                if first < self.seq_len:
                    x_t = self.step_input(values[:, first - 1], first, table, batch_size)
            sampling.sample(self, values, known, first, state, x_t, temperature, generator, decoder, step_weights)
        finally:
            self.train(was_training)
        return self.to_images(values)

    def check_step_weights(self, step_weights: str) -> None:
        """Raise a ValueError unless this model can use ``step_weights`` (a lossy copy needs a
        backend with a recurrent step)."""
        weights.check_step_weight_format(step_weights)
        if step_weights != "model" and not self.transformer.has_recurrent_form:
            raise ValueError(
                f"step_weights={step_weights!r} applies to the recurrent step, but attention backend "
                f"{self.attention_config.backend!r} has no recurrent form (each step re-runs the parallel "
                f"forward over the prefix); use step_weights='model'"
            )

    def step_input(self, previous: torch.Tensor | None, position: int, table: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The transformer's input at ``position``: ``(B, d_model)`` from the value at
        ``position - 1`` (int64 ``(B,)``; None at position 0: the start vector) and the
        :meth:`position_table` ``table``."""
        if previous is None:
            return (self.start + table[0]).expand(batch_size, self.d_model)
        return F.embedding(previous, self.value_embedding.weight) + table[position]

    def _check_prefix(self, prefix, batch_size: int, device) -> torch.Tensor | None:
        """Normalise ``prefix`` to int64 ``(B, P)`` on ``device`` (None if empty)."""
        if prefix is None:
            return None
        if prefix.dim() == 4:  # top rows of images
            c, h, w = self.image_shape
            if prefix.shape[1] != c or prefix.shape[3] != w or prefix.shape[2] > h:
                raise ValueError(f"an image prefix must be (B, {c}, rows <= {h}, {w}), got {tuple(prefix.shape)}")
            prefix = images_to_sequence(prefix)
        if prefix.dim() != 2 or prefix.is_floating_point():
            raise ValueError(f"prefix must be an integer (B, P) sequence or uint8 (B, C, rows, W) images, got "
                             f"{prefix.dtype} {tuple(prefix.shape)}")
        if prefix.shape[0] != batch_size:
            raise ValueError(f"prefix has {prefix.shape[0]} rows but batch_size={batch_size}")
        if prefix.shape[1] > self.seq_len:
            raise ValueError(f"prefix of length {prefix.shape[1]} is longer than the image ({self.seq_len})")
        if prefix.shape[1] == 0:
            return None
        if int(prefix.min()) < 0 or int(prefix.max()) >= NUM_LEVELS:
            raise ValueError(f"prefix values must lie in [0, {NUM_LEVELS - 1}], got [{int(prefix.min())}, {int(prefix.max())}]")
        return prefix.to(device=device, dtype=torch.long)

