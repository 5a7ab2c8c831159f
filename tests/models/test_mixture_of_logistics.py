"""Tests for the discretized mixture of logistics head and the bits/dim metric.

References are computed independently in float64 with Python's ``math`` module straight from
the logistic CDF ``sigmoid((x - mu) / s)``, not from the implementation's log-space identity.
"""

from __future__ import annotations

import math

import pytest
import torch

from linformer_lab.models.mixture_of_logistics import BitsPerDim, DiscretizedMixtureOfLogistics

B = 256  # bins
H = 1.0 / (B - 1)  # half bin width on the [-1, 1] scale


# ---------------------------------------------------------------------------------- references


def _sigmoid(z: float) -> float:
    # Two forms so that neither exp overflows for large |z|.
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def _logistic_bin_mass(x: int, mu: float, s: float) -> float:
    """P(value == x) for one discretized logistic, in float64, from the CDF by hand."""
    c = 2.0 * x / (B - 1) - 1.0
    upper = (c + H - mu) / s
    lower = (c - H - mu) / s
    if x == 0:
        return _sigmoid(upper)  # CDF from -inf
    if x == B - 1:
        return 1.0 - _sigmoid(lower) if lower < 0 else _sigmoid(-lower)  # CDF to +inf
    if c >= mu:
        # Right of the mean both CDF values are close to 1; subtract the survival functions
        # instead so float64 keeps its digits (same quantity: (1-F(lower)) - (1-F(upper))).
        return _sigmoid(-lower) - _sigmoid(-upper)
    return _sigmoid(upper) - _sigmoid(lower)


def _params(logits, means, log_scales) -> torch.Tensor:
    """(3K,) parameter vector in the head's [logits | means | log-scales] layout."""
    return torch.tensor(list(logits) + list(means) + list(log_scales), dtype=torch.float32)


def _all_bins_log_prob(dmol: DiscretizedMixtureOfLogistics, params: torch.Tensor) -> torch.Tensor:
    """(N, 3K) params -> (B, N) log-probabilities of every bin."""
    n = params.shape[0]
    targets = torch.arange(B).unsqueeze(1).expand(B, n)
    return dmol.log_prob(params.unsqueeze(0).expand(B, n, params.shape[-1]), targets)


def _chi2_upper_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal score z."""
    k = 2.0 / (9.0 * df)
    return df * (1.0 - k + z * math.sqrt(k)) ** 3


# ---------------------------------------------------------------------------------- log_prob


@pytest.mark.parametrize(
    "mu, log_s, bins",
    [
        # Narrow component: both edge bins and a far-left interior bin are deep in the tails
        # (masses ~1e-10 .. 1e-8), the regime where a plain CDF difference cancels.
        (0.1, math.log(0.05), [0, 20, 140, 141, 200, 255]),
        # Mean just inside the lower edge: the edge bin holds most of the mass.
        (-0.98, math.log(0.1), [0, 1, 5, 128, 255]),
        # Mean outside [-1, 1]: nearly everything in the top edge bin.
        (1.7, math.log(0.3), [0, 128, 250, 254, 255]),
        # Just above / below the width threshold of the midpoint fallback (exact path, then
        # midpoint path) and a very wide component, where only the midpoint path is finite-safe.
        (0.2, 1.5, [0, 7, 128, 254, 255]),
        (0.2, 3.0, [0, 7, 128, 254, 255]),
        (0.2, 15.0, [0, 7, 128, 254, 255]),
    ],
)
def test_log_prob_single_logistic_matches_hand_computation(mu, log_s, bins):
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=1)
    s = math.exp(log_s)
    params = _params([0.0], [mu], [log_s]).expand(len(bins), 3)
    got = dmol.log_prob(params, torch.tensor(bins)).double()
    want = torch.tensor([math.log(_logistic_bin_mass(x, mu, s)) for x in bins], dtype=torch.float64)
    # fp32 evaluation: absolute error in log space ~1e-6 at these magnitudes.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_log_prob_two_component_mixture_is_weighted_sum():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=2)
    logits, means, log_scales = [0.3, -0.5], [-0.2, 0.6], [math.log(0.04), math.log(0.15)]
    z = sum(math.exp(l) for l in logits)
    weights = [math.exp(l) / z for l in logits]
    bins = [0, 60, 102, 103, 180, 204, 255]
    want = [
        math.log(
            sum(w * _logistic_bin_mass(x, m, math.exp(ls)) for w, m, ls in zip(weights, means, log_scales))
        )
        for x in bins
    ]
    params = _params(logits, means, log_scales).expand(len(bins), 6)
    got = dmol.log_prob(params, torch.tensor(bins)).double()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def test_log_prob_uint8_and_long_targets_agree_and_batch_shape_is_kept():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(2, 7, 30, generator=gen)
    target = torch.randint(0, B, (2, 7), generator=gen)
    lp_long = dmol.log_prob(params, target)
    lp_u8 = dmol.log_prob(params, target.to(torch.uint8))
    assert lp_long.shape == (2, 7) and lp_long.dtype == torch.float32
    torch.testing.assert_close(lp_long, lp_u8, rtol=0, atol=0)


def test_log_prob_rejects_float_targets_and_wrong_param_size():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=2)
    with pytest.raises(TypeError):
        dmol.log_prob(torch.zeros(3, 6), torch.zeros(3))
    with pytest.raises(ValueError):
        dmol.log_prob(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))


def test_probabilities_sum_to_one_including_extreme_params():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    gen = torch.Generator().manual_seed(1)
    random = torch.cat(
        [torch.randn(64, 10, generator=gen) * 3, torch.randn(64, 10, generator=gen), torch.randn(64, 10, generator=gen) * 2 - 3],
        dim=-1,
    )
    # Extremes, one component each (K = 10 copies): tiny scales (below the -7 floor), scales
    # so wide that the bin width underflows fp32, means far outside [-1, 1], means exactly on a
    # bin edge, huge logits.
    extreme_rows = []
    for mu in [-50.0, -1.0 - H, -1.0, -H, 0.0, H, 0.37, 1.0, 50.0]:
        for log_s in [-30.0, -7.0, -3.0, 0.0, 3.0, 20.0, 100.0, 1000.0]:
            extreme_rows.append([0.0] * 10 + [mu] * 10 + [log_s] * 10)
    # A mixture of a far-away sharp component and a broad one, with extreme logits.
    extreme_rows.append([80.0, -80.0] + [0.0] * 8 + [50.0, -0.5] + [0.0] * 8 + [-20.0, 1.0] + [0.0] * 8)
    params = torch.cat([random, torch.tensor(extreme_rows)], dim=0)

    lp = _all_bins_log_prob(dmol, params)
    assert torch.isfinite(lp).all() and (lp <= 1e-6).all()
    total = lp.double().exp().sum(dim=0)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------------- sampling

# A 3-component mixture whose mass covers ~30 bins, including substantial mass in the top
# edge bin (mean at 0.995 sits inside it), so the sampler's edge handling is exercised too.
_CHI2_PARAMS = _params([0.4, -0.3, 0.1], [-0.31, 0.12, 0.995], [math.log(0.012), math.log(0.02), math.log(0.01)])
_CHI2_SAMPLES = 200_000


def _chi2_statistic(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 20.0) -> tuple[float, int]:
    """Pearson chi-square of observed bin counts against bin probabilities.

    Bins with an expected count below ``min_expected`` are pooled into one cell so the
    chi-square approximation holds. Returns (statistic, degrees of freedom).
    """
    n = counts.sum().item()
    expected = probs.double() * n
    counts = counts.double()
    big = expected >= min_expected
    obs_cells = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_cells = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp_cells[-1] < 1e-9:  # nothing pooled: drop the empty cell (obs would also be 0)
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = ((obs_cells - exp_cells) ** 2 / exp_cells).sum().item()
    return stat, exp_cells.numel() - 1


def _chi2_threshold(df: int) -> float:
    # Upper 1e-5 tail (z = 4.265): a correct sampler essentially never exceeds it, while each
    # wrong sampler below overshoots it by orders of magnitude.
    return _chi2_upper_quantile(df, 4.265)


def test_sampling_matches_probabilities_chi_square():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=3)
    probs = _all_bins_log_prob(dmol, _CHI2_PARAMS.view(1, 9))[:, 0].double().exp()
    assert probs[-1] > 0.1  # the edge bin really is exercised

    gen = torch.Generator().manual_seed(1234)
    samples = dmol.sample(_CHI2_PARAMS.expand(_CHI2_SAMPLES, 9), generator=gen)
    assert samples.dtype == torch.long and samples.shape == (_CHI2_SAMPLES,)
    assert samples.min() >= 0 and samples.max() <= B - 1
    counts = torch.bincount(samples, minlength=B)
    stat, df = _chi2_statistic(counts, probs)
    assert df >= 15
    assert stat < _chi2_threshold(df), (stat, df)


def test_chi_square_check_rejects_wrong_samplers():
    """The same check must fail for plausible sampler bugs, otherwise it proves nothing."""
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=3)
    probs = _all_bins_log_prob(dmol, _CHI2_PARAMS.view(1, 9))[:, 0].double().exp()
    gen = torch.Generator().manual_seed(1234)
    logits, means, log_scales = _CHI2_PARAMS.split(3)

    wrong = {
        # floor instead of round when binning == means shifted by half a bin
        "half-bin shift": torch.cat([logits, means + H, log_scales]),
        # mixture weights ignored (uniform component choice)
        "uniform components": torch.cat([torch.zeros(3), means, log_scales]),
        # scale off by 25% (e.g. std instead of logistic scale mix-up)
        "scale x1.25": torch.cat([logits, means, log_scales + math.log(1.25)]),
    }
    for name, params in wrong.items():
        samples = dmol.sample(params.expand(_CHI2_SAMPLES, 9), generator=gen)
        stat, df = _chi2_statistic(torch.bincount(samples, minlength=B), probs)
        assert stat > _chi2_threshold(df), (name, stat, df)

    # Off-by-one bin index on otherwise correct samples.
    samples = dmol.sample(_CHI2_PARAMS.expand(_CHI2_SAMPLES, 9), generator=gen)
    stat, df = _chi2_statistic(torch.bincount((samples + 1).clamp(max=B - 1), minlength=B), probs)
    assert stat > _chi2_threshold(df), ("off by one", stat, df)


def test_sampling_is_reproducible_with_generator():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    params = torch.randn(4, 100, 30, generator=torch.Generator().manual_seed(0))
    a = dmol.sample(params, generator=torch.Generator().manual_seed(7))
    b = dmol.sample(params, generator=torch.Generator().manual_seed(7))
    assert a.shape == (4, 100)
    assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_noise_drawn_ahead_gives_the_same_samples(temperature):
    """sample(noise=sampling_noise(...)) is sample(generator=...) with the draws made first."""
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    params = torch.randn(4, 100, 30, generator=torch.Generator().manual_seed(0))
    own = dmol.sample(params, temperature, generator=torch.Generator().manual_seed(7))
    noise = dmol.sampling_noise((4, 100), generator=torch.Generator().manual_seed(7))
    assert noise[0].shape == (4, 100, 10) and noise[1].shape == (4, 100)
    assert torch.equal(dmol.sample(params, temperature, noise=noise), own)


def test_noise_of_the_wrong_shape_is_refused():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    params = torch.randn(2, 30)
    with pytest.raises(ValueError, match=r"noise for params of shape \(2, 30\) must be \(gumbel \(2, 10\), logistic \(2,\)\)"):
        dmol.sample(params, noise=dmol.sampling_noise((3,)))


def test_temperature_zero_is_deterministic_argmax_component_mean_rounded():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=3)
    rows = [
        # argmax component 1, mean 0.3 -> (1.3) * 127.5 = 165.75 -> 166
        ([0.0, 2.0, 1.0], [-0.5, 0.3, 0.9], [0.0, 5.0, 0.0], 166),
        # means outside [-1, 1] clamp to the edge bins; the (ignored) log-scale is irrelevant
        ([3.0, 0.0, 0.0], [7.0, 0.0, 0.0], [-9.0, 0.0, 0.0], 255),
        ([0.0, 0.0, 3.0], [0.0, 0.0, -4.0], [0.0, 0.0, 9.0], 0),
        # tie in the logits -> first component (torch.argmax), mean -1 + 2 * 10 / 255 -> bin 10
        ([1.0, 1.0, 0.0], [-1.0 + 20.0 / 255, 0.5, 0.0], [0.0, 0.0, 0.0], 10),
    ]
    params = torch.stack([_params(*r[:3]) for r in rows])
    want = torch.tensor([r[3] for r in rows])
    first = dmol.sample(params, temperature=0.0, generator=torch.Generator().manual_seed(1))
    second = dmol.sample(params, temperature=0.0, generator=torch.Generator().manual_seed(2))
    third = dmol.sample(params, temperature=0.0)
    assert first.dtype == torch.long
    assert torch.equal(first, want)
    assert torch.equal(first, second) and torch.equal(first, third)


def test_small_temperature_converges_to_temperature_zero():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=5)
    gen = torch.Generator().manual_seed(3)
    n = 500
    # Distinct logits (gaps of 1) and means 0.2 bins away from a centre, so neither the
    # component choice nor the rounding sits on a tie.
    logits = torch.stack([torch.randperm(5, generator=gen).float() for _ in range(n)])
    centres = torch.randint(0, B, (n, 5), generator=gen).float() * (2 * H) - 1
    means = centres + 0.2 * H
    log_scales = torch.rand(n, 5, generator=gen) * 4 - 5
    params = torch.cat([logits, means, log_scales], dim=-1)
    mode = dmol.sample(params, temperature=0.0)
    cold = dmol.sample(params, temperature=1e-5, generator=gen)
    assert torch.equal(mode, cold)


def test_negative_temperature_rejected():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4)
    with pytest.raises(ValueError):
        dmol.sample(torch.zeros(2, 30), temperature=-1.0)


# ---------------------------------------------------------------------------------- metric


def bits_per_dim(head, params, target):
    """Mean negative log2-likelihood per dimension: the image task's training loss."""
    return -head.log_prob(params, target).mean() / math.log(2.0)


def test_nll_bits_per_dim_and_metric_match_hand_computation():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=1)
    # Batch 1: 3 dims, batch 2: 5 dims (unequal, so a mean of batch means would differ).
    p1 = _params([0.0], [0.1], [math.log(0.05)]).expand(3, 3)
    t1 = torch.tensor([0, 140, 255])
    p2 = _params([0.0], [-0.98], [math.log(0.1)]).expand(5, 3)
    t2 = torch.tensor([0, 1, 5, 128, 255])
    nll1 = [-math.log(_logistic_bin_mass(x, 0.1, 0.05)) for x in t1.tolist()]
    nll2 = [-math.log(_logistic_bin_mass(x, -0.98, 0.1)) for x in t2.tolist()]
    ln2 = math.log(2.0)

    assert bits_per_dim(dmol, p1, t1).item() == pytest.approx(sum(nll1) / 3 / ln2, rel=1e-5)

    metric = BitsPerDim()
    metric.update(-dmol.log_prob(p1, t1))
    assert metric.compute().item() == pytest.approx(sum(nll1) / 3 / ln2, rel=1e-5)
    metric.update(-dmol.log_prob(p2, t2).view(1, 5))  # any shape; every element is a dim
    want = (sum(nll1) + sum(nll2)) / 8 / ln2
    assert metric.compute().item() == pytest.approx(want, rel=1e-5)
    mean_of_means = (sum(nll1) / 3 + sum(nll2) / 5) / 2 / ln2
    assert abs(want - mean_of_means) > 1e-2  # the weighting really is tested
    # Same number as the loss helper on the concatenated data.
    both = bits_per_dim(dmol, torch.cat([p1, p2]), torch.cat([t1, t2]))
    assert metric.compute().item() == pytest.approx(both.item(), rel=1e-5)

    metric.reset()
    metric.update(torch.full((4,), ln2, dtype=torch.float64))  # 1 bit per dim, summed in float64
    assert metric.compute().item() == pytest.approx(1.0, rel=1e-12)


# ---------------------------------------------------------------------------------- gradients / precision


def test_gradients_finite_for_extreme_targets_and_params():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=1)
    rows, targets = [], []
    for mu in [-50.0, -1.0, 0.0, 0.5, 50.0]:
        for log_s in [-30.0, -7.0, 0.0, 3.0, 90.0, 1000.0]:
            for logit in [-100.0, 0.0]:
                for x in [0, 1, 128, 254, 255]:
                    rows.append([logit, mu, log_s])
                    targets.append(x)
    params = torch.tensor(rows, requires_grad=True)
    lp = dmol.log_prob(params, torch.tensor(targets))
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert torch.isfinite(params.grad).all()

    # Through the projection as well, with a mixture of 10 and huge hidden activations.
    head = DiscretizedMixtureOfLogistics(hidden_dim=8)
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)) * 100
    loss = bits_per_dim(head, head(hidden), torch.tensor([0, 255, 0, 255, 3, 250]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())


def test_gradient_in_far_tail_matches_analytic():
    """The log-space identity gives the exact gradient even where the bin mass is ~1e-9."""
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=4, num_mixtures=1)
    mu, s, x = 0.1, 0.05, 20
    params = _params([0.0], [mu], [math.log(s)]).view(1, 3).requires_grad_(True)
    dmol.log_prob(params, torch.tensor([x])).sum().backward()
    # d/dmu log(F(a) - F(b)) = -(f(a) - f(b)) / s / (F(a) - F(b)), f = F (1 - F).
    c = 2.0 * x / (B - 1) - 1.0
    a, b = (c + H - mu) / s, (c - H - mu) / s
    fa, fb = _sigmoid(a) * _sigmoid(-a), _sigmoid(b) * _sigmoid(-b)
    want = -(fa - fb) / s / (_sigmoid(a) - _sigmoid(b))
    assert params.grad[0, 1].item() == pytest.approx(want, rel=1e-4)


def test_bf16_autocast_returns_fp32():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=16)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=gen)
    target = torch.randint(0, B, (2, 5), generator=gen, dtype=torch.long).to(torch.uint8)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        params = dmol(hidden.bfloat16())
        lp = dmol.log_prob(params, target)
        lp_bf16_params = dmol.log_prob(params.bfloat16(), target)
        bpd = bits_per_dim(dmol, params, target)
    assert params.dtype == torch.float32
    assert lp.dtype == torch.float32 and lp_bf16_params.dtype == torch.float32
    assert bpd.dtype == torch.float32
    # bf16 params are evaluated exactly as their fp32 upcast would be.
    torch.testing.assert_close(lp_bf16_params, dmol.log_prob(params.bfloat16().float(), target), rtol=0, atol=0)
    # And the head matches a plain fp32 evaluation (only the bf16 rounding of the input differs).
    torch.testing.assert_close(lp, dmol.log_prob(dmol(hidden.bfloat16().float()), target), rtol=0, atol=0)


def test_forward_shape_and_half_precision_module():
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=16, num_mixtures=4)
    hidden = torch.randn(3, 7, 16)
    assert dmol(hidden).shape == (3, 7, 12)
    half = DiscretizedMixtureOfLogistics(hidden_dim=16, num_mixtures=4).to(torch.bfloat16)
    out = half(hidden.bfloat16())
    assert out.dtype == torch.float32 and out.shape == (3, 7, 12)


def test_sampling_under_autocast_equals_fp32_sampling():
    """sample turns autocast off itself (only entering the context when autocast is on)."""
    dmol = DiscretizedMixtureOfLogistics(hidden_dim=16)
    params = torch.randn(3, 50, 30, generator=torch.Generator().manual_seed(0))
    want = dmol.sample(params, 0.8, generator=torch.Generator().manual_seed(5))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = dmol.sample(params, 0.8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(got, want)
