"""Kendall's tau and the scatter figure of sharpness-versus-generalization studies."""

from __future__ import annotations

from typing import Mapping, Sequence, Tuple

import numpy as np
from scipy import stats

__all__ = ["kendall_tau", "kendall_tau_bootstrap", "sharpness_scatter"]


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


def sharpness_scatter(
    panels: Mapping[str, Sequence[float]],
    generalization: Sequence[float],
    path: str,
    *,
    ylabel: str = "test loss",
    title: str | None = None,
    log_x: bool = False,
) -> str:
    """One scatter panel per sharpness measure (x) against generalization (y), tau in titles.

    Writes a PNG to ``path`` with matplotlib's Agg backend and returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (name, values) in zip(axes[0], panels.items()):
        tau, _ = kendall_tau(values, generalization)
        ax.scatter(values, generalization, s=18, alpha=0.8, edgecolors="none")
        ax.set_title(f"{name}: τ = {tau:.3f}")
        ax.set_xlabel(f"{name} sharpness")
        if log_x and min(values) > 0:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
