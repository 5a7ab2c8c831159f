"""Random Fourier features (Rahimi & Recht 2007) turned into a softmax-kernel estimator."""

from __future__ import annotations

import math
import warnings

import torch

from linformer_lab.feature_maps.random_features import RandomFeatureMap

#: Expected relative error of the kernel estimate per query-key pair above which the map warns
#: (:meth:`RandomFourierFeatureMap.expected_relative_error`; see its class doc for why 0.5).
UNRELIABLE_ERROR = 0.5


class RandomFourierFeatureMap(RandomFeatureMap):
    """Unbiased estimate of the softmax kernel exp(q^T k / sqrt(D)), the paper's closing idea.

    With x' = x / D^(1/4):  exp(q'^T k') = exp(|q'|^2/2) exp(|k'|^2/2) exp(-|q' - k'|^2 / 2),
    and the Gaussian kernel has random Fourier features: for w ~ N(0, I),
    E[cos(w^T q') cos(w^T k') + sin(w^T q') sin(w^T k')] = E[cos(w^T (q' - k'))] = exp(-|q'-k'|^2/2).
    So  phi(x) = exp(|x'|^2 / 2) / sqrt(m) [cos(W x'), sin(W x')],  output_dim = 2 m  (:meth:`forward`).

    Queries (:meth:`forward_queries`) leave out their factor exp(|q'|^2 / 2): a per-query
    constant cancels between the numerator and the normaliser of linear attention (eq. 5), and
    the query features stay bounded by 1 / sqrt(m) instead of overflowing (with a key's factor
    the product was inf from inputs of about 3 per dimension at D = 32). Keys keep theirs (a
    per-key factor does not cancel); it overflows float32 only where |k|^2 / sqrt(D) > 2 ln(float32
    max) ~ 177, far past where the estimate means anything (below).

    Reliability: unlike ``favor`` these features are signed, and the estimate's relative error per
    query-key pair grows like sqrt(2 / m) sinh(|q' - k'|^2 / 2), exponentially in the squared
    input norm (:meth:`expected_relative_error`). Past about 0.5 the estimated normaliser comes
    near zero or negative for some queries and outputs are off by orders of magnitude (at D = 32,
    m = 256: inputs of 0.5 per dimension give ~15 % error, 1 per dimension ~100x). The map warns
    once per process in that range; use ``favor`` (positive features, same kernel) or many more features.
    """

    #: set once the unreliable-input warning has been given (once per process, not per layer)
    _warned_unreliable = False

    @property
    def output_dim(self) -> int:
        return 2 * self.num_features

    def expected_relative_error(self, mean_sq_norm: float) -> float:
        """The estimate's relative error per query-key pair, ``sqrt(2 / m) sinh(|q' - k'|^2 / 2)``
        (the standard deviation of the mean of m features cos(w^T (q' - k')), over its
        expectation), for independent queries and keys of mean ``|x|^2 / sqrt(D)`` = ``mean_sq_norm``,
        so that ``E |q' - k'|^2 = 2 mean_sq_norm``. Orthogonal features do somewhat better."""
        return math.sqrt(2 / self.num_features) * math.sinh(min(mean_sq_norm, 700.0))

    def _warn_if_unreliable(self, half_sq_norm: torch.Tensor) -> None:
        # one device sync per call until the warning is given: it keeps this experimental map from failing silently
        if RandomFourierFeatureMap._warned_unreliable or half_sq_norm.numel() == 0:
            return
        mean_sq_norm = 2 * float(half_sq_norm.detach().mean())
        error = self.expected_relative_error(mean_sq_norm)
        if error <= UNRELIABLE_ERROR:
            return
        RandomFourierFeatureMap._warned_unreliable = True
        warnings.warn(
            f"random_fourier feature map: inputs with mean |x|^2/sqrt(D) = {mean_sq_norm:.3g} (D = {self.query_dim}) "
            f"make its estimate of exp(q.k/sqrt(D)) unreliable: expected relative error ~{error:.2g} per query-key "
            f"pair with num_features={self.num_features} (it grows like exp(|x|^2/sqrt(D))), enough to bring the "
            f"attention normaliser near zero and outputs off by orders of magnitude. Use the 'favor' feature map "
            f"(positive features, same kernel), many more features, or smaller queries and keys. (Warned once.)",
            RuntimeWarning,
            stacklevel=2,
        )

    def _features(self, x: torch.Tensor, norm_factor: bool) -> torch.Tensor:
        projected, half_sq_norm = self._project(x)
        self._warn_if_unreliable(half_sq_norm)
        scale = 1 / math.sqrt(self.num_features)
        if norm_factor:
            scale = torch.exp(half_sq_norm) * scale
        out = torch.cat([torch.cos(projected), torch.sin(projected)], dim=-1) * scale
        return out if x.dtype == torch.float64 else out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The features of the docstring: ``phi(q)^T phi(k)`` estimates exp(q^T k / sqrt(D))
        without bias. ``(..., D) -> (..., 2 m)``; also the keys' features."""
        return self._features(x, norm_factor=True)

    def forward_queries(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the per-query factor exp(|q'|^2 / 2), which cancels in the
        attention: ``(..., D) -> (..., 2 m)``, every entry within +-1/sqrt(m)."""
        return self._features(x, norm_factor=False)
