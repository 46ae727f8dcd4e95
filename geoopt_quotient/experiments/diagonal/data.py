r"""Sparse linear regression data for the diagonal-network experiment.

The setup, and why
------------------
The paper's setup (Table 1 of "Hide & Seek") gives only :math:`d = 200`, a 90%-sparse
ground truth and 50 models trained to :math:`10^{-5}` training loss; everything else is
chosen here from first principles, before looking at any correlation:

* **Inputs** :math:`x \sim \mathcal N(0, I_d)`, so that :math:`\mathbb E\,(x^\top\beta)^2 =
  |\beta|^2` and the population risk of a model is known in closed form.
* **Ground truth** :math:`\beta^*` with :math:`s = \lceil (1 - \text{sparsity})\, d \rceil`
  non-zeros (20 of 200) on a uniformly random support, Gaussian values, rescaled to
  :math:`|\beta^*|_2 = 1`. The unit norm makes :math:`\beta` dimensionless (a perturbation
  radius of 0.1 in :math:`\beta` is 10% of the signal), and each sample's signal
  :math:`x^\top\beta^*` has unit variance.
* **Noise** :math:`y = x^\top\beta^* + \sigma\varepsilon` with :math:`\sigma = 0.1`
  (signal-to-noise variance ratio 100). Some noise keeps the problem honest (an
  interpolating model pays for fitting it, and exact-recovery ties between the sparsest
  models are broken), while the implicit bias (how close :math:`\beta` is to :math:`\beta^*`)
  still dominates generalisation.
* **Number of training samples** :math:`n`: the models are interpolators (:math:`n < d`),
  and they should differ *because of their implicit bias*: small initialisation scales
  of a diagonal network bias gradient descent towards the minimum-:math:`\ell_1`
  interpolant, large ones towards the minimum-:math:`\ell_2` interpolant (Woodworth et
  al., 2020). This difference matters most at the :math:`\ell_1` recovery threshold:
  far above it every sparse-biased model recovers :math:`\beta^*` (ties), far below it
  none does (all models are poor). The threshold is located precisely by the
  statistical dimension of the :math:`\ell_1` descent cone at an :math:`s`-sparse point
  (Amelunxen, Lotz, McCoy & Tropp, 2014),

  .. math::

      \delta(s, d) = \inf_{\tau \ge 0}\ s(1 + \tau^2)
          + (d - s)\,\mathbb E\,(|g| - \tau)_+^2, \qquad g \sim \mathcal N(0, 1),

  and :math:`n = \lceil \delta(s, d) \rceil` (66 for :math:`d = 200, s = 20`; between the
  classical :math:`s \log(d/s) \approx 46` and :math:`2 s \log(d/s) \approx 92`).
* **Test set** 1000 fresh samples from the same distribution (as in the related public
  setup); the test loss is :math:`|X_{\text{test}}\beta - y_{\text{test}}|^2 / (2 n_{\text{test}})`,
  the same normalisation as the training loss, and the exact population risk
  :math:`(|\beta - \beta^*|^2 + \sigma^2) / 2` is recorded beside it.

All randomness comes from :class:`numpy.random.Generator` seeded with ``(seed, 1)``, so
the data do not depend on the torch device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import numpy as np
import torch
from scipy import optimize, stats

__all__ = [
    "SparseRegression",
    "l1_statistical_dimension",
    "make_sparse_regression",
    "recovery_threshold",
    "support_size",
]

DEFAULT_SPARSITY = 0.9
DEFAULT_NOISE_STD = 0.1
DEFAULT_N_TEST = 1000


def support_size(dim: int, sparsity: float = DEFAULT_SPARSITY) -> int:
    r"""Number of non-zeros :math:`s = \max(1, \lceil (1 - \text{sparsity})\, d \rceil)`
    (up to rounding error in the product)."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"`sparsity` must be in [0, 1), got {sparsity}")
    return max(1, math.ceil((1.0 - sparsity) * dim - 1e-9))


def l1_statistical_dimension(s: int, dim: int) -> float:
    r"""Statistical dimension of the :math:`\ell_1` descent cone at an ``s``-sparse point of
    :math:`\mathbb R^d`: the location of the :math:`\ell_1` recovery phase transition.

    .. math::

        \delta = \inf_{\tau \ge 0}\ s(1 + \tau^2) + 2(d - s)\big[(1 + \tau^2)\Phi(-\tau)
            - \tau\varphi(\tau)\big].
    """
    if not 1 <= s <= dim:
        raise ValueError(f"need 1 <= s <= dim, got s={s}, dim={dim}")
    if s == dim:
        return float(dim)

    def bound(tau: float) -> float:
        tail = (1 + tau**2) * stats.norm.cdf(-tau) - tau * stats.norm.pdf(tau)
        return s * (1 + tau**2) + 2 * (dim - s) * tail

    result = optimize.minimize_scalar(bound, bounds=(0.0, 20.0), method="bounded")
    return float(min(result.fun, dim))


def recovery_threshold(dim: int, sparsity: float = DEFAULT_SPARSITY) -> int:
    r"""The default number of training samples :math:`n = \lceil\delta(s, d)\rceil`, at least 2.

    :math:`\delta(s, d)` is the statistical dimension of the :math:`\ell_1` descent cone
    (:func:`l1_statistical_dimension`), where :math:`\ell_1` recovery of an
    :math:`s`-sparse vector from :math:`n` Gaussian measurements sets in.

    Parameters
    ----------
    dim : int
        Dimension :math:`d` of the coefficients.
    sparsity : float
        Fraction of zero coefficients, in [0, 1) (default 0.9), giving
        :math:`s = \max(1, \lceil (1 - \text{sparsity})\, d \rceil)` non-zeros.

    Returns
    -------
    int
        The number of training samples :math:`n`.

    Raises
    ------
    ValueError
        For ``sparsity`` outside [0, 1).
    """
    return max(2, math.ceil(l1_statistical_dimension(support_size(dim, sparsity), dim)))


@dataclass(frozen=True)
class SparseRegression:
    """A training set, a test set and the ground truth they come from.

    Attributes
    ----------
    x_train, y_train : torch.Tensor
        ``(n, d)`` and ``(n,)``.
    x_test, y_test : torch.Tensor
        ``(n_test, d)`` and ``(n_test,)``.
    beta_star : torch.Tensor
        The ground truth ``(d,)``, unit norm, ``s`` non-zeros.
    noise_std : float
        :math:`\\sigma` of the label noise (train and test).
    seed : int
        The seed the data were drawn with.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    beta_star: torch.Tensor
    noise_std: float
    seed: int

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]

    @property
    def n_train(self) -> int:
        return self.x_train.shape[0]

    @property
    def n_test(self) -> int:
        return self.x_test.shape[0]

    @property
    def support(self) -> torch.Tensor:
        """Indices of the non-zeros of :math:`\\beta^*`."""
        return torch.nonzero(self.beta_star).flatten()

    def train_loss(self, beta: torch.Tensor) -> torch.Tensor:
        r""":math:`|X\beta - y|^2 / (2n)` for ``beta`` of shape ``(..., d)``."""
        residual = beta @ self.x_train.T - self.y_train
        return residual.pow(2).sum(-1) / (2 * self.n_train)

    def test_loss(self, beta: torch.Tensor) -> torch.Tensor:
        r""":math:`|X_{\text{test}}\beta - y_{\text{test}}|^2 / (2 n_{\text{test}})`."""
        residual = beta @ self.x_test.T - self.y_test
        return residual.pow(2).sum(-1) / (2 * self.n_test)

    def population_risk(self, beta: torch.Tensor) -> torch.Tensor:
        r"""Exact expected test loss :math:`(|\beta - \beta^*|^2 + \sigma^2) / 2`."""
        return 0.5 * ((beta - self.beta_star).pow(2).sum(-1) + self.noise_std**2)

    def describe(self) -> Dict[str, float | int]:
        """The settings, for a JSON record."""
        s = int(self.support.numel())
        return {
            "dim": self.dim,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "support_size": s,
            "noise_std": self.noise_std,
            "beta_star_norm": float(self.beta_star.norm()),
            "l1_statistical_dimension": l1_statistical_dimension(s, self.dim),
            "seed": self.seed,
        }


def make_sparse_regression(
    dim: int = 200,
    *,
    n_train: int | None = None,
    n_test: int = DEFAULT_N_TEST,
    sparsity: float = DEFAULT_SPARSITY,
    noise_std: float = DEFAULT_NOISE_STD,
    seed: int = 0,
    nonnegative: bool = False,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> SparseRegression:
    r"""Draw a sparse regression problem (module docstring for the choices).

    Parameters
    ----------
    dim : int
        Number of features :math:`d \ge 2`.
    n_train : int, optional
        Number of training samples; default :func:`recovery_threshold` (66 for d = 200).
    n_test : int
        Number of test samples.
    sparsity : float
        Fraction of zeros of :math:`\beta^*`.
    noise_std : float
        Label-noise standard deviation :math:`\sigma \ge 0`.
    seed : int
        Seed of the data.
    nonnegative : bool
        Take the absolute values of the non-zeros of :math:`\beta^*` (as in the public
        diagonal-network notebook of Andriushchenko et al., 2023). The random draws are
        the same either way, so only the signs change.
    dtype, device
        Of the returned tensors.

    Returns
    -------
    SparseRegression
        The training and test data and the ground truth :math:`\beta^\star`.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2:
        raise ValueError(f"`dim` must be an int >= 2, got {dim!r}")
    n_train = recovery_threshold(dim, sparsity) if n_train is None else n_train
    if n_train < 1 or n_test < 1:
        raise ValueError(f"need n_train >= 1 and n_test >= 1, got {n_train}, {n_test}")
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"`noise_std` must be finite and >= 0, got {noise_std}")
    rng = np.random.default_rng([seed, 1])
    s = support_size(dim, sparsity)
    beta_star = np.zeros(dim)
    support = rng.choice(dim, size=s, replace=False)
    beta_star[support] = rng.standard_normal(s)
    if nonnegative:
        beta_star = np.abs(beta_star)
    beta_star /= np.linalg.norm(beta_star)
    x_train = rng.standard_normal((n_train, dim))
    y_train = x_train @ beta_star + noise_std * rng.standard_normal(n_train)
    x_test = rng.standard_normal((n_test, dim))
    y_test = x_test @ beta_star + noise_std * rng.standard_normal(n_test)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=dtype, device=device)

    return SparseRegression(
        x_train=tensor(x_train),
        y_train=tensor(y_train),
        x_test=tensor(x_test),
        y_test=tensor(y_test),
        beta_star=tensor(beta_star),
        noise_std=float(noise_std),
        seed=int(seed),
    )
