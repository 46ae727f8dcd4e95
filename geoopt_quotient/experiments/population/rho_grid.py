r"""Kendall's :math:`\tau` as a function of the radius: one record per (scale, measure, path).

A study that measures every sharpness measure at several multiples ("scales") of its
radius, on the same models and the same data, hands the per-model values of each
(scale, measure, path) and the per-model generalization target (a gap, a test loss) to
:func:`tau_by_rho`; :func:`format_tau_by_rho` prints the result as a table and
:func:`tau_by_rho_figure` draws :math:`\tau` against
the scale with its bootstrap interval as a band. :func:`parse_rho_scales` is the
``--rho-scales`` argument type. The module knows nothing of the study: it never sees a
model, only numbers.

Record format
-------------
:func:`tau_by_rho` returns a list of JSON-serialisable dicts, the value of a study
document's top-level ``"tau_by_rho"`` key::

    {"scale": 2.0, "rho": 0.2, "measure": "inv", "path": "exact",
     "tau": -0.61, "ci": [-0.72, -0.48]}

``scale``
    The multiple :math:`s` of the measure's radius.
``rho``
    The radius actually used, :math:`s\,\rho_{\text{measure}}` (measures have their own
    radii, so two records at one scale can have different ``rho``).
``measure``
    The sharpness measure's name, as the study calls it (``"adaptive"``, ``"inv"``, ...).
``path``
    How the perturbation is applied: ``"exact"`` (the exact geodesic),
    ``"second_order"`` (the second-order retraction :math:`w(1 + B - B^2/2)` of the
    paper's Algorithm 1), or ``"straight"`` (:data:`STRAIGHT`: the straight line
    :math:`w + \xi` of adaptive sharpness, which has no geodesic).
``tau``
    Kendall's :math:`\tau_b` between the measure and the target over the models
    (:func:`~geoopt_quotient.sharpness.stats.kendall_tau`).
``ci``
    ``[low, high]``: the percentile bootstrap interval of :math:`\tau` over models
    (:func:`~geoopt_quotient.sharpness.stats.kendall_tau_bootstrap`, 95% and 2000
    resamples by default). Every record is bootstrapped with the same seed, hence the
    same resamples of models, so the intervals of two records are paired.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..._checks import STRAIGHT
from ..._extras import require
from ...sharpness.stats import kendall_tau_bootstrap
from ..figures import new_figure

__all__ = [
    "RhoSeries",
    "format_tau_by_rho",
    "parse_rho_scales",
    "study_scales",
    "tau_by_rho",
    "tau_by_rho_figure",
]


@dataclass(frozen=True)
class RhoSeries:
    """The per-model values of one measure along one path at one multiple of its radius.

    Attributes
    ----------
    scale : float
        The multiple :math:`s > 0` of the measure's radius.
    rho : float
        The radius used, :math:`s\\,\\rho_{\\text{measure}}`.
    measure : str
        The measure's name.
    path : str
        ``"exact"``, ``"second_order"`` or :data:`STRAIGHT` (module docstring).
    values : sequence of float
        One value per model, in the order of the target.
    """

    scale: float
    rho: float
    measure: str
    path: str
    values: Sequence[float]


def parse_rho_scales(text: str) -> Tuple[float, ...]:
    """The ``--rho-scales`` argument type: ``"0.25,0.5,1,2"`` -> ``(0.25, 0.5, 1.0, 2.0)``.

    Comma-separated finite numbers > 0, each once; returned in increasing order.

    Parameters
    ----------
    text : str
        The argument as given on the command line.

    Returns
    -------
    tuple of float
        The scales, in increasing order.

    Raises
    ------
    argparse.ArgumentTypeError
        On an empty item, a non-number, a number that is not finite and positive, or a
        repeated scale.
    """
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers > 0 such as 0.5,1,2, got {text!r}"
        )
    scales = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated numbers > 0, {item!r} is not a number"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"every scale must be a finite number > 0, got {item}")
        scales.append(value)
    if len(set(scales)) != len(scales):
        raise argparse.ArgumentTypeError(f"a scale is repeated in {text!r}")
    return tuple(sorted(scales))


def study_scales(rho_scales: Optional[Sequence[float]]) -> Tuple[float, ...]:
    """The scales a study measures: 1 (the study's own radii) and those given, sorted.

    Parameters
    ----------
    rho_scales : sequence of float or None
        Multiples of the study's radii to measure as well (``None``: none).

    Returns
    -------
    tuple of float
        The distinct scales, 1 included, in increasing order.

    Raises
    ------
    ValueError
        For a scale that is not a finite number > 0.
    """
    for scale in rho_scales or ():
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"every scale must be a finite number > 0, got {scale!r}")
    return tuple(sorted({float(s) for s in rho_scales or ()} | {1.0}))


def tau_by_rho(
    series: Iterable[RhoSeries],
    target: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> List[Dict[str, Any]]:
    r"""Kendall's :math:`\tau` of every series against ``target``, with its bootstrap interval.

    Parameters
    ----------
    series : iterable of RhoSeries
        One per (scale, measure, path); each (scale, measure, path) at most once.
    target : sequence of float
        The per-model generalization target (gap, test loss), in the models' order.
    resamples, confidence, seed
        Of :func:`~geoopt_quotient.sharpness.stats.kendall_tau_bootstrap`; one seed for
        every series, so that all intervals resample the same models.

    Returns
    -------
    list of dict
        The records of the module docstring, in the order of ``series``.
    """
    records, seen = [], set()
    for item in series:
        key = (float(item.scale), item.measure, item.path)
        if key in seen:
            raise ValueError(f"(scale, measure, path) = {key} given twice")
        seen.add(key)
        if len(item.values) != len(target):
            raise ValueError(
                f"{item.measure} ({item.path}) at scale {item.scale:g} has "
                f"{len(item.values)} values for {len(target)} models"
            )
        tau, low, high = kendall_tau_bootstrap(
            item.values, target, resamples=resamples, confidence=confidence, seed=seed
        )
        records.append(
            {
                "scale": float(item.scale),
                "rho": float(item.rho),
                "measure": item.measure,
                "path": item.path,
                "tau": tau,
                "ci": [low, high],
            }
        )
    return records


def _curves(records: Sequence[Mapping[str, Any]]) -> Dict[Tuple[str, str], List[Mapping]]:
    """(measure, path) -> its records sorted by scale, in order of first appearance."""
    curves: Dict[Tuple[str, str], List[Mapping]] = {}
    for record in records:
        curves.setdefault((record["measure"], record["path"]), []).append(record)
    return {key: sorted(rows, key=lambda r: r["scale"]) for key, rows in curves.items()}


def _base_radius(rows: Sequence[Mapping[str, Any]]) -> float:
    """The radius at scale 1 of a curve (``rho / scale``, the same for every row)."""
    return rows[0]["rho"] / rows[0]["scale"]


def format_tau_by_rho(
    records: Sequence[Mapping[str, Any]],
    *,
    reference: Mapping[str, float] | None = None,
) -> str:
    r"""A plain-text table: one row per (measure, path), one column per scale.

    Each cell is :math:`\tau` and its interval, ``-0.61 [-0.72, -0.48]``; the row label
    gives the measure's radius at scale 1, and ``reference`` (``measure -> tau``, e.g. a
    paper's values) adds a last column.

    Parameters
    ----------
    records : sequence of dict
        The records of :func:`tau_by_rho` (``scale``, ``rho``, ``measure``, ``path``,
        ``tau``, ``ci``).
    reference : dict of str to float or None
        A reference :math:`\tau` per measure, shown in a last column.

    Returns
    -------
    str
        The table, lines joined by newlines.

    Raises
    ------
    ValueError
        For no records.
    """
    if not records:
        raise ValueError("no records to format")
    curves = _curves(records)
    scales = sorted({r["scale"] for r in records})
    labels = {
        key: f"{key[0]} ({key[1]}), ρ₁ = {_base_radius(rows):g}" for key, rows in curves.items()
    }
    width = max(len("measure (path), radius at scale 1"), *map(len, labels.values())) + 2
    cell = 24
    head = f"{'measure (path), radius at scale 1':<{width}}"
    head += "".join(f"{f'scale {s:g}':>{cell}}" for s in scales)
    if reference is not None:
        head += f"{'reference':>11}"
    lines = [head, "-" * len(head)]
    for key, rows in curves.items():
        by_scale = {r["scale"]: r for r in rows}
        line = f"{labels[key]:<{width}}"
        for scale in scales:
            row = by_scale.get(scale)
            text = "—" if row is None else _tau_text(row)
            line += f"{text:>{cell}}"
        if reference is not None:
            value = reference.get(key[0])
            line += f"{'—' if value is None else f'{value:+.2f}':>11}"
        lines.append(line)
    lines.append("τ [95% bootstrap interval over models]; radius = scale × ρ₁")
    return "\n".join(lines)


def _tau_text(record: Mapping[str, Any]) -> str:
    low, high = record["ci"]
    return f"{record['tau']:+.3f} [{low:+.2f}, {high:+.2f}]"


def tau_by_rho_figure(
    records: Sequence[Mapping[str, Any]],
    path: str,
    *,
    title: str | None = None,
    reference: Mapping[str, float] | None = None,
    ylabel: str = "Kendall τ",
) -> str:
    r""":math:`\tau` against the radius, one curve per (measure, path), its interval a band.

    The x axis is the scale (logarithmic), the common multiple of every measure's radius;
    the legend gives each curve's radius at scale 1. Colours tell the measures apart,
    line styles the paths (solid exact, dashed second order, dotted straight).
    ``reference`` (``measure -> tau``) draws a thin horizontal line per measure in its
    colour. Writes a PNG to ``path`` and returns the path.

    Parameters
    ----------
    records : sequence of dict
        The records of :func:`tau_by_rho`.
    path : str
        Where to write the PNG.
    title : str or None
        Title of the figure.
    reference : dict of str to float or None
        A reference :math:`\tau` per measure.
    ylabel : str
        Label of the y axis (default ``"Kendall τ"``).

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ValueError
        For no records.
    """
    if not records:
        raise ValueError("no records to draw")
    fig = new_figure(figsize=(7.0, 4.4))
    ax = fig.subplots()

    curves = _curves(records)
    measures = list(dict.fromkeys(measure for measure, _ in curves))
    colours = {m: f"C{i % 10}" for i, m in enumerate(measures)}
    styles = {"exact": "-", "second_order": "--", STRAIGHT: ":"}
    for (measure, route), rows in curves.items():
        x = [r["scale"] for r in rows]
        colour = colours[measure]
        ax.plot(
            x,
            [r["tau"] for r in rows],
            styles.get(route, "-."),
            marker="o",
            markersize=4,
            color=colour,
            label=f"{measure} ({route}), ρ₁ = {_base_radius(rows):g}",
        )
        ax.fill_between(
            x,
            [r["ci"][0] for r in rows],
            [r["ci"][1] for r in rows],
            color=colour,
            alpha=0.12,
            linewidth=0,
        )
    label = "reference τ (thin lines)"
    for measure, value in (reference or {}).items():
        if measure in colours:
            ax.axhline(value, color=colours[measure], linewidth=0.8, alpha=0.6, label=label)
            label = None
    ax.set_xscale("log")
    scales = sorted({r["scale"] for r in records})
    ax.set_xticks(scales, [f"{s:g}" for s in scales])
    ax.xaxis.set_minor_formatter(require("matplotlib.ticker", "drawing figures").NullFormatter())
    ax.set_xlabel("radius / ρ₁ (scale)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-1.05, 1.05)
    ax.axhline(0.0, color="0.5", linewidth=0.6)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
