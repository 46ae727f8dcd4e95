"""Kendall's tau of sharpness against generalization, with a bootstrap interval over models."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
from scipy import stats

from .._moved import moved_attribute

__all__ = [
    "kendall_tau",
    "kendall_tau_bootstrap",
    "partial_kendall_tau",
    "partial_kendall_tau_bootstrap",
]


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
    return (tau, *_percentile_interval(taus, confidence))


#: A tau-b within this of +-1 is taken as +-1 (its pair counts' ratio, rounded).
RANK_TOLERANCE = 1e-12


def partial_kendall_tau(
    sharpness: Sequence[float], generalization: Sequence[float], control: Sequence[float]
) -> float:
    r"""Kendall's partial tau of sharpness and generalization given a control variable.

    With :math:`\tau_{xy}`, :math:`\tau_{xz}`, :math:`\tau_{yz}` the pairwise tau-b of
    sharpness :math:`x`, generalization :math:`y` and control :math:`z` (e.g. the
    training loss),

    .. math::

        \tau_{xy \cdot z} = \frac{\tau_{xy} - \tau_{xz}\,\tau_{yz}}
            {\sqrt{(1 - \tau_{xz}^2)(1 - \tau_{yz}^2)}},

    the association of :math:`x` and :math:`y` that :math:`z` does not account for
    (Kendall 1942). It equals :math:`\tau_{xy}` when :math:`z` is unrelated to either
    (:math:`\tau_{xz} = \tau_{yz} = 0`).

    Parameters
    ----------
    sharpness, generalization, control : sequence of float
        One value per model each, in the same order.

    Returns
    -------
    float
        :math:`\tau_{xy \cdot z} \in [-1, 1]`; NaN when a column is constant or the
        control ranks the models exactly as sharpness or generalization does
        (:math:`|\tau_{xz}| = 1` or :math:`|\tau_{yz}| = 1`: nothing is left once it is
        accounted for).

    Raises
    ------
    ValueError
        As :func:`kendall_tau`, also for a ``control`` of another length.

    References
    ----------
    Kendall (1942), "Partial rank correlation", Biometrika.

    Examples
    --------
    Sharpness and generalization both follow the control, and nothing else:

    >>> from geoopt_quotient.sharpness.stats import partial_kendall_tau
    >>> z = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    >>> x = [1.1, 2.3, 2.9, 4.2, 5.1, 5.8]
    >>> y = [0.9, 2.1, 3.2, 3.9, 5.3, 6.1]
    >>> import math; math.isnan(partial_kendall_tau(x, y, z))
    True
    >>> round(partial_kendall_tau(x, y, [3.0, 1.0, 6.0, 2.0, 5.0, 4.0]), 3)
    1.0
    """
    if len(control) != len(sharpness):
        raise ValueError(f"`control` has {len(control)} values for {len(sharpness)} models")
    xy, _ = kendall_tau(sharpness, generalization)
    xz, _ = kendall_tau(sharpness, control)
    yz, _ = kendall_tau(generalization, control)
    # the control ranks like x or y, to rounding (tau-b is a ratio of pair counts): undefined
    if not max(abs(xz), abs(yz)) < 1.0 - RANK_TOLERANCE:  # also NaN for a constant column
        return float("nan")
    denominator = (1.0 - xz * xz) * (1.0 - yz * yz)
    return float(np.clip((xy - xz * yz) / np.sqrt(denominator), -1.0, 1.0))


def partial_kendall_tau_bootstrap(
    sharpness: Sequence[float],
    generalization: Sequence[float],
    control: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Tuple[float, float, float]:
    """Partial tau (:func:`partial_kendall_tau`) and a percentile bootstrap interval.

    Models are resampled with replacement (their three values kept together), as in
    :func:`kendall_tau_bootstrap`; resamples without a partial tau (a constant column,
    :math:`|\tau_{xz}| = 1` or :math:`|\tau_{yz}| = 1`) are left out.

    Parameters
    ----------
    sharpness, generalization, control : sequence of float
        One value per model each.
    resamples, confidence, seed
        As for :func:`kendall_tau_bootstrap`.

    Returns
    -------
    tau : float
        The partial tau of all models.
    low, high : float
        The percentile interval (NaN when no resample has a partial tau).
    """
    tau = partial_kendall_tau(sharpness, generalization, control)
    columns = [np.asarray(c, dtype=float) for c in (sharpness, generalization, control)]
    count = len(columns[0])
    rows = np.random.default_rng(seed).integers(0, count, size=(resamples, count))
    taus = np.array(
        [
            partial_kendall_tau(*(c[r] for c in columns))
            for r in rows
            if _varies(*(c[r] for c in columns))
        ]
    )
    taus = taus[np.isfinite(taus)]
    return (tau, *_percentile_interval(taus, confidence))


def _percentile_interval(taus: np.ndarray, confidence: float) -> Tuple[float, float]:
    """The central ``confidence`` percentile interval of resampled taus (NaNs if none)."""
    if taus.size == 0:
        return float("nan"), float("nan")
    alpha = 100 * (1 - confidence) / 2
    low, high = np.percentile(taus, [alpha, 100 - alpha])
    return float(low), float(high)


def _varies(*columns: np.ndarray) -> bool:
    return all(np.ptp(c) > 0 for c in columns)


def __getattr__(name: str):
    return moved_attribute(__name__, name)
