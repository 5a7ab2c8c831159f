"""Discretized mixture of logistics output head for pixel-by-pixel image generation.

The image-generation experiments of "Transformers are RNNs" (Katharopoulos et al. 2020, §4.2)
predict every element of an image sequence with a discretized mixture of logistics (DMoL), the
output distribution of PixelCNN++ (Salimans et al. 2017). The reported metric is bits/dim: the
mean negative log2-likelihood per sub-pixel.

Difference from PixelCNN++
--------------------------
PixelCNN++ predicts a whole RGB pixel from one network evaluation, so it couples the channels
inside the mixture (the mean of G depends linearly on R, that of B on R and G). Here every
sub-pixel is its *own sequence element*: the causal transformer already conditions G on the R of
the same pixel through attention. So each position carries a mixture over ONE scalar, with no
channel-coupling coefficients. For greyscale images (MNIST) the two formulations coincide.

Parameterisation
----------------
For K components a position has ``3 K`` numbers, laid out along the last axis as
``[mixture logits (K) | means (K) | log-scales (K)]``. An integer value ``x`` in
``[0, num_bins - 1]`` is mapped to the bin centre ``c = 2 x / (num_bins - 1) - 1`` in
``[-1, 1]``; the bin is ``[c - h, c + h]`` with half-width ``h = 1 / (num_bins - 1)``, except that
the lowest bin extends down to ``-inf`` and the highest up to ``+inf`` so that the probabilities
of all bins sum to one for any parameters.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn

from linformer_lab.validation import check_at_least

__all__ = ["DiscretizedMixtureOfLogistics", "BitsPerDim"]


def _log1mexp(d: Tensor) -> Tensor:
    """``log(1 - exp(-d))`` for ``d > 0``, accurate over the whole range: ``-expm1(-d)`` for small
    ``d`` (where ``1 - exp(-d)`` cancels), ``log1p(-exp(-d))`` for large ``d``; ln 2 is the usual
    crossover."""
    return torch.where(
        d < math.log(2.0),
        torch.log(-torch.expm1(-d)),
        torch.log1p(-torch.exp(-d)),
    )


def _log_prob(params: Tensor, target: Tensor, num_mixtures: int, num_bins: int, log_scale_min: float,
              midpoint_max_width: float) -> Tensor:
    """:meth:`DiscretizedMixtureOfLogistics.log_prob` (see there): params ``(..., 3K)``, integer
    target ``(...)`` -> ``(...)`` fp32 nats (float64 for float64 params). A plain function of
    tensors and numbers, so that ``torch.compile`` can fuse it whole (:func:`_fused_log_prob`)."""
    with torch.autocast(device_type=params.device.type, enabled=False):
        params = params if params.dtype == torch.float64 else params.float()
        logits, means, log_scales = params.split(num_mixtures, dim=-1)
        log_scales = log_scales.clamp(min=log_scale_min)
        h = 1.0 / (num_bins - 1)
        target = target.long()
        is_low = (target == 0).unsqueeze(-1)
        is_high = (target == num_bins - 1).unsqueeze(-1)

        # Bin centre on the [-1, 1] scale, one column per component via broadcasting.
        centre = (target.to(params.dtype) * (2.0 * h) - 1.0).unsqueeze(-1)  # (..., 1)
        inv_scales = torch.exp(-log_scales)  # finite: log-scales are floored at -7
        offset = centre - means  # (..., K)
        a = (offset + h) * inv_scales  # upper edge, standardised
        b = (offset - h) * inv_scales  # lower edge, standardised
        m = offset * inv_scales  # centre, standardised

        log_cdf_upper = F.logsigmoid(a)  # log P(X < c + h)
        log_sf_lower = F.logsigmoid(-b)  # log P(X > c - h)

        width = (2.0 * h) * inv_scales  # bin width in units of the scale, from h and s directly
        use_midpoint = width < midpoint_max_width
        # torch.where differentiates both branches; feed the unused exact branch a harmless
        # value so an underflowed width (log1mexp(0) = -inf) cannot turn 0 * inf into NaN.
        safe_width = torch.where(use_midpoint, torch.ones_like(width), width)
        log_mass_exact = log_cdf_upper + log_sf_lower + _log1mexp(safe_width)
        # log(pdf(centre) * width), with pdf(x) = sigmoid(m) * sigmoid(-m) / s and width = 2h
        log_mass_midpoint = F.logsigmoid(m) + F.logsigmoid(-m) - log_scales + math.log(2.0 * h)
        log_mass_interior = torch.where(use_midpoint, log_mass_midpoint, log_mass_exact)

        log_mass = torch.where(
            is_low, log_cdf_upper, torch.where(is_high, log_sf_lower, log_mass_interior)
        )  # (..., K)
        return torch.logsumexp(F.log_softmax(logits, dim=-1) + log_mass, dim=-1)


@functools.cache
def _fused_log_prob():
    """:func:`_log_prob` through ``torch.compile``, built on first use (importing this module
    compiles nothing)."""
    return torch.compile(_log_prob)


class DiscretizedMixtureOfLogistics(nn.Module):
    """Projection from hidden states to a discretized mixture of logistics over one scalar.

    Args:
        hidden_dim: size ``D`` of the hidden state at each position.
        num_mixtures: number of logistic components ``K`` (10 in the paper).
        num_bins: number of discrete values ``B``; targets are integers in ``[0, B - 1]``.

    Shapes (``...`` is any batch shape, e.g. ``(batch, seq)``):
        hidden: ``(..., D)`` -> params: ``(..., 3K)`` -> log_prob / sample: ``(...)``.
    """

    # Floor on every component's log-scale, as in PixelCNN++: without it a component can collapse
    # onto one bin (the discretized likelihood is bounded, so nothing pushes back) and 1 / s
    # overflows. exp(-7) ~ 9e-4 is ~0.12 bin widths for 256 bins, so one component can still put
    # ~97% of its mass in one bin. Applied in log_prob and sample alike: part of the distribution.
    LOG_SCALE_MIN: float = -7.0

    # An interior bin narrower than this (in units of the component scale) uses the midpoint rule
    # (see log_prob); its relative error d^2 / 24 < 5e-8 is below fp32 resolution.
    _MIDPOINT_MAX_WIDTH: float = 1e-3

    def __init__(self, hidden_dim: int, num_mixtures: int = 10, num_bins: int = 256) -> None:
        super().__init__()
        check_at_least("hidden_dim", hidden_dim, 1)
        check_at_least("num_mixtures", num_mixtures, 1, "logistic components")
        check_at_least("num_bins", num_bins, 2, "discrete values")
        self.hidden_dim = hidden_dim
        self.num_mixtures = num_mixtures
        self.num_bins = num_bins
        self.proj = nn.Linear(hidden_dim, 3 * num_mixtures)

    @property
    def num_params(self) -> int:
        """Number of distribution parameters per position, ``3 K``."""
        return 3 * self.num_mixtures

    def extra_repr(self) -> str:
        return f"num_mixtures={self.num_mixtures}, num_bins={self.num_bins}"

    # ------------------------------------------------------------------ projection

    def forward(self, hidden: Tensor) -> Tensor:
        """Hidden states ``(..., D)`` (any float dtype) -> fp32 params ``(..., 3K)``
        ``[logits | means | log-scales]``.

        In fp32 even under autocast: in bf16 a mean near +-1 is resolved only to 2^-8 ~ half a bin
        width, which blurs sharp predictions and costs bits/dim; the ``D x 3K`` layer is tiny.
        """
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            # Cast the weights too, so the head also works when the module itself was cast to
            # half precision; autograd still delivers gradients in the weights' own dtype.
            return F.linear(hidden.float(), self.proj.weight.float(), self.proj.bias.float())

    # ------------------------------------------------------------------ helpers

    def _unpack(self, params: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Split ``(..., 3K)`` params into fp32 logits, means, clamped log-scales, each ``(..., K)``."""
        if params.shape[-1] != self.num_params:
            raise ValueError(
                f"params must have last dimension 3 * num_mixtures = {self.num_params}, "
                f"got shape {tuple(params.shape)}"
            )
        params = params.float()
        logits, means, log_scales = params.split(self.num_mixtures, dim=-1)
        return logits, means, log_scales.clamp(min=self.LOG_SCALE_MIN)

    # ------------------------------------------------------------------ likelihood

    def log_prob(self, params: Tensor, target: Tensor, fused: bool = False) -> Tensor:
        """Log-probability (nats) of integer values under the discretized mixture.

        Args:
            params: ``(..., 3K)`` output of :meth:`forward` (any float dtype; used in fp32).
            target: ``(...)`` integers in ``[0, B - 1]`` (uint8, long, ...), same batch shape as
                ``params`` (or broadcastable to it). Values outside the range are not checked
                (checking would force a device sync on every call); they give meaningless results.

            fused: compute it in one function compiled by ``torch.compile`` (a few fused kernels
                instead of some forty elementwise operations each way); the same formula, so the
                same values up to rounding. The first call compiles (seconds), as does each new shape.

        Returns:
            ``(...)`` log-probabilities, fp32 even under autocast (float64 for float64 params:
            what the tests compare the fused loss by).

        For a component with mean ``mu``, scale ``s`` and a bin ``[c - h, c + h]``, write
        ``a = (c + h - mu) / s`` and ``b = (c - h - mu) / s``. The bin mass is
        ``sigmoid(a) - sigmoid(b)``; the lowest bin has ``sigmoid(a)`` (CDF from -inf) and the
        highest ``sigmoid(-b)`` (CDF to +inf).

        That difference cancels catastrophically for every bin in the tails (both sigmoids near 0
        or 1). Instead of PixelCNN++'s ``log(cdf_plus - cdf_min)`` we use the exact factorisation

            sigmoid(a) - sigmoid(b) = sigmoid(a) * sigmoid(-b) * (1 - exp(-(a - b)))

        so ``log mass = logsigmoid(a) + logsigmoid(-b) + log1mexp(d)`` with ``d = a - b = 2h / s``
        computed from ``h`` and ``s`` (never as a difference of large numbers). Every term is
        stable, so far-tail bins get their exact log-mass and gradient, where PixelCNN++ falls
        back to an approximation once the mass drops below 1e-5.

        The opposite hazard is a component much wider than a bin: ``d`` is tiny, and once it
        underflows fp32 (log-scale above ~80) ``log1mexp(d)`` is ``-inf``. For ``d`` below
        ``_MIDPOINT_MAX_WIDTH`` we use PixelCNN++'s fallback ``log pdf(c) + log(2h)``, the leading
        term of the factorisation as ``d -> 0`` (midpoint rule, relative error ~ ``d^2 / 24``),
        which stays finite for any scale: it needs only ``log s``, never ``1 / s``.
        """
        # already-rescaled float values would be silently truncated and land in the wrong bins
        if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            raise TypeError(f"target must be an integer tensor (uint8 / long), got {target.dtype}")
        if params.shape[-1] != self.num_params:
            self._unpack(params)  # raises the error naming the expected shape
        function = _fused_log_prob() if fused else _log_prob
        return function(params, target, self.num_mixtures, self.num_bins, self.LOG_SCALE_MIN, self._MIDPOINT_MAX_WIDTH)

    # ------------------------------------------------------------------ sampling

    def sampling_noise(
        self, shape: tuple[int, ...], generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """The randomness of :meth:`sample` for params ``(*shape, 3K)``, drawn ahead: fp32
        ``(gumbel (*shape, K), logistic (*shape))``, the standard Gumbel noise that picks the
        component and the standard logistic noise for the value. ``sample(params, T, noise=...)``
        with these equals ``sample(params, T, generator)`` (same draws, same order). Drawing many
        positions in one call saves a generation loop ten small operations per step.
        """
        u = torch.rand((*shape, self.num_mixtures), generator=generator, device=device)
        # torch.rand can return exactly 0; the clamp keeps -log(-log u) finite.
        gumbel = -torch.log(-torch.log(u.clamp(min=torch.finfo(u.dtype).tiny)))
        v = torch.rand(shape, generator=generator, device=device)
        # logit(v), the inverse logistic CDF. v = 0 gives -inf, which sample's clamp sends to the
        # lowest bin, where that tail belongs (no truncation as PixelCNN++'s u in [1e-5, 1 - 1e-5]).
        return gumbel, torch.log(v) - torch.log1p(-v)

    @torch.no_grad()
    def sample(
        self, params: Tensor, temperature: float = 1.0, generator: torch.Generator | None = None,
        noise: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Draw one integer value per position.

        Args:
            params: ``(..., 3K)`` mixture parameters.
            temperature: ``T >= 0``.

                * ``T = 1``: an exact sample from the distribution that :meth:`log_prob` scores.
                * ``T > 0``: the component is drawn from ``softmax(logits / T)`` and the
                  logistic is drawn with scale ``s * T``; ``T < 1`` sharpens, ``T > 1`` flattens.
                * ``T = 0``: deterministic, the limit of ``T > 0`` as ``T -> 0``: the component
                  with the largest logit (lowest index on ties), its mean clamped to ``[-1, 1]``
                  and rounded to the nearest bin (ties to even). A pure function of ``params``
                  (``generator`` ignored), so two decoders that produce the same params (recurrent
                  vs. parallel) produce the same values. Not in general the mixture's most
                  probable bin, only the centre of the dominant component.
            generator: optional ``torch.Generator`` on ``params``' device, for reproducibility.
            noise: the ``(gumbel (..., K), logistic (...))`` pair of :meth:`sampling_noise`
                for these positions, drawn ahead; ``generator`` is then not used.

        Returns:
            ``(...)`` int64 values in ``[0, B - 1]``.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        with torch.autocast(device_type=params.device.type, enabled=False):  # the sample is computed in fp32
            logits, means, log_scales = self._unpack(params)
            if temperature == 0:
                component = logits.argmax(dim=-1, keepdim=True)
                value = means.gather(-1, component).squeeze(-1)
            else:
                if noise is None:
                    noise = self.sampling_noise(logits.shape[:-1], generator, logits.device)
                gumbel, logistic = noise
                if gumbel.shape != logits.shape or logistic.shape != logits.shape[:-1]:
                    raise ValueError(
                        f"noise for params of shape {tuple(params.shape)} must be (gumbel {tuple(logits.shape)}, "
                        f"logistic {tuple(logits.shape[:-1])}), got ({tuple(gumbel.shape)}, {tuple(logistic.shape)})"
                    )
                # Gumbel-max: argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T).
                component = (logits / temperature + gumbel).argmax(dim=-1, keepdim=True)
                mu = means.gather(-1, component).squeeze(-1)
                scale = torch.exp(log_scales.gather(-1, component).squeeze(-1)) * temperature
                value = mu + scale * logistic  # inverse logistic CDF: mu + s * logit(v)
            # Nearest bin centre. Bin k covers |x - c_k| < h, so rounding (x + 1) / (2h) is the
            # inverse of the binning in log_prob; the clamp realises the infinite edge bins.
            index = torch.round((value.clamp(-1.0, 1.0) + 1.0) * (0.5 * (self.num_bins - 1)))
            return index.long().clamp_(0, self.num_bins - 1)


class BitsPerDim(torchmetrics.Metric):
    """Bits per dimension aggregated over batches (and processes, summed under DDP).

    ``update(nll)`` takes per-dimension NLLs in nats, any shape (one element, one dimension).
    ``compute()`` returns ``sum(nll) / count / ln 2`` since the last reset: the dimension-weighted
    mean (a mean of per-batch means would overweight a smaller last batch).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    nll_sum: Tensor
    count: Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # float64 sum: an epoch of CIFAR-10 is ~3e7 dimensions, whose fp32 sum would make the
        # metric's last digits depend on batching. The count is exact in int64.
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, nll: Tensor) -> None:
        """Add per-dimension NLLs (nats), shape ``(...)``; detached, or the running sum would keep
        every batch's activations alive until the next reset."""
        self.nll_sum += nll.detach().to(torch.float64).sum()
        self.count += nll.numel()

    def compute(self) -> Tensor:
        """Bits/dim as a float64 scalar (NaN before any update)."""
        return self.nll_sum / self.count / math.log(2.0)
