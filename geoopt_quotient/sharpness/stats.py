"""Kendall's tau of sharpness against generalization, with a bootstrap interval over models."""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
from scipy import stats

from .._moved import moved_attribute

__all__ = ["kendall_tau", "kendall_tau_bootstrap"]


def kendall_tau(sharpness: Sequence[float], generalization: Sequence[float]) -> Tuple[float, float]:
    """Kendall's tau-b and its two-sided p-value (:func:`scipy.stats.kendalltau`)."""
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
