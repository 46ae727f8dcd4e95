"""The experiments' figures, drawn without pyplot.

Each function builds a :class:`matplotlib.figure.Figure` of its own and writes it to a
PNG file: no global state of matplotlib changes (no backend switch, no open pyplot
figure), so they are safe to call from a notebook. matplotlib comes with the
``experiments`` extra (``pip install -e '.[experiments]'`` in the clone).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .._extras import require
from ..sharpness.stats import kendall_tau

__all__ = ["new_figure", "sharpness_scatter"]


def new_figure(**kwargs: Any):
    """A :class:`matplotlib.figure.Figure` (keyword arguments passed on), not owned by pyplot.

    Parameters
    ----------
    **kwargs
        Passed to :class:`matplotlib.figure.Figure` (e.g. ``figsize``).

    Returns
    -------
    matplotlib.figure.Figure
        A new figure, which no pyplot state refers to.
    """
    figure = require("matplotlib.figure", "drawing figures")
    return figure.Figure(**kwargs)


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

    Writes a PNG to ``path`` and returns the path.

    Parameters
    ----------
    panels : dict of str to sequence of float
        Per measure, the sharpness of each model.
    generalization : sequence of float
        The generalization measure of each model, in the same order.
    path : str
        Where to write the PNG.
    ylabel : str
        Label of the y axis (default ``"test loss"``).
    title : str or None
        Title of the figure.
    log_x : bool
        Logarithmic x axes, for panels whose values are all positive (default ``False``).

    Returns
    -------
    str
        ``path``.
    """
    fig = new_figure(figsize=(4.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)
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
    return path
