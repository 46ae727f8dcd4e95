"""Kendall's tau of sharpness against generalization, with a bootstrap interval over models."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
from scipy import stats

from .._moved import moved_attribute

__all__ = ["kendall_tau", "kendall_tau_bootstrap"]


def kendall_tau(sharpness: Sequence[float], generalization: Sequence[float]) -> Tuple[float, float]:
    r"""Kendall's tau-b and its two-sided p-value (:func:`scipy.stats.kendalltau`).

    With :math:`n_c` and :math:`n_d` the concordant and discordant pairs of models,

    .. math::

        \tau_b = \frac{n_c - n_d}{\sqrt{(n_0 - n_1)(n_0 - n_2)}}, \qquad
        n_0 = \frac{M(M - 1)}2,

    where :math:`n_1` and :math:`n_2` count the pairs tied in ``sharpness`` and in
    ``generalization``; without ties it is :math:`\frac{2}{M(M-1)} \sum_{i<j}
    \operatorname{sign}(s_i - s_j) \operatorname{sign}(t_i - t_j)`.

    Parameters
    ----------
    sharpness : sequence of float
        One sharpness value per model.
    generalization : sequence of float
        The generalization measure of the same models, in the same order (e.g. the
        test loss or the gap between test and train error).

    Returns
    -------
    tau : float
        :math:`\tau_b \in [-1, 1]` (NaN when either sequence is constant).
    p_value : float
        Two-sided p-value of the hypothesis :math:`\tau = 0`.

    Raises
    ------
    ValueError
        If the sequences differ in length or have fewer than two models.

    References
    ----------
    Kendall (1945), "The treatment of ties in ranking problems", Biometrika
    :cite:`kendall1945treatment`.

    Examples
    --------
    Five concordant pairs and one discordant pair out of six:

    >>> from geoopt_quotient import kendall_tau
    >>> tau, p_value = kendall_tau([0.1, 0.4, 0.3, 0.8], [1.0, 2.0, 3.0, 4.0])
    >>> round(tau, 4)
    0.6667
    >>> 0 < p_value < 1
    True

    Ties enter the denominator:

    >>> round(kendall_tau([1, 1, 2, 3], [1, 2, 2, 3])[0], 4)
    0.8
    """
    if len(sharpness) != len(generalization):
        raise ValueError(
            f"`sharpness` and `generalization` differ in length: {len(sharpness)} vs "
            f"{len(generalization)}"
        )
    if len(sharpness) < 2:
        raise ValueError("Kendall's tau needs at least two models")
    result = stats.kendalltau(sharpness, generalization)
    return float(result.statistic), float(result.pvalue)


def kendall_tau_bootstrap(
    sharpness: Sequence[float],
    generalization: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Tuple[float, float, float]:
    """Tau and a percentile bootstrap confidence interval over models.

    Models are resampled with replacement (pairs kept together). A resample in which
    either column is constant has no tau (:func:`scipy.stats.kendalltau` gives NaN) and
    is left out; with few models that happens often enough to matter, and the interval
    is taken over the remaining resamples (NaN when none remain).

    Parameters
    ----------
    sharpness, generalization : sequence of float
        One value per model each, as for :func:`kendall_tau`.
    resamples : int
        Number of bootstrap resamples (default 2000).
    confidence : float
        Coverage of the interval, in (0, 1); default 0.95 (the 2.5th and 97.5th
        percentiles of the resampled taus).
    seed : int
        Seed of NumPy's generator that draws the resamples.

    Returns
    -------
    tau : float
        Kendall's tau-b of all models (:func:`kendall_tau`).
    low, high : float
        The percentile interval.

    Raises
    ------
    ValueError
        As :func:`kendall_tau`.
    """
    tau, _ = kendall_tau(sharpness, generalization)
    x, y = np.asarray(sharpness, dtype=float), np.asarray(generalization, dtype=float)
    rows = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    taus = np.array([stats.kendalltau(x[r], y[r]).statistic for r in rows if _varies(x[r], y[r])])
    if taus.size == 0:
        return tau, float("nan"), float("nan")
    alpha = 100 * (1 - confidence) / 2
    low, high = np.percentile(taus, [alpha, 100 - alpha])
    return tau, float(low), float(high)


def _varies(*columns: np.ndarray) -> bool:
    return all(np.ptp(c) > 0 for c in columns)


def __getattr__(name: str):
    return moved_attribute(__name__, name)
