"""A population study's results as files: the scatter figure, JSON, and flat tables.

The document of a study (:func:`~geoopt_quotient.experiments.population.run_population`,
:func:`~geoopt_quotient.experiments.population.measure_population`) is nested: per model,
per measure. :func:`population_rows` and :func:`tau_rows` flatten it into one record per
(model, measure) and per measure, written as CSV without pandas
(:func:`write_rows_csv`) or given as a :class:`pandas.DataFrame`
(:func:`population_frames`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Union

from ..._extras import require
from .rho_grid import tau_by_rho_figure
from .study import MEASURES, PAPER_TAU, scatter_figure

__all__ = [
    "figure_title",
    "population_frames",
    "population_rows",
    "read_rows_csv",
    "tau_rows",
    "write_population_files",
    "write_rows_csv",
]

#: Table 1's row drawn beside tau against the radius.
REFERENCE = "ImageNet, 72 CLIP ViT-B/32"
#: Per-model fields copied into every row of :func:`population_rows` when present.
MODEL_FIELDS = ("gap", "train_error", "test_error")


def figure_title(document: Mapping[str, Any], label: str) -> str:
    """The scatter figure's title: ``label``, the radius of every measure, the warning.

    Parameters
    ----------
    document : dict
        The study's document (``settings`` and ``warning`` are read).
    label : str
        What the models are (e.g. ``"6 ViTs on 8x8 digits (--quick run)"``).

    Returns
    -------
    str
        The title, lines joined by newlines.
    """
    settings = document["settings"]
    radii = ", ".join(f"{name} {settings[f'rho_{name}']:g}" for name in ("adaptive", "inv", "mix"))
    steps = "Auto-PGD iterations" if settings["kind"] == "worst" else "samples"
    lines = [label, f"radii ρ: {radii}; {settings['kind']} case, {settings['iters']} {steps}"]
    if document.get("warning"):
        lines.append(f"warning: {document['warning']}")
    return "\n".join(lines)


def population_rows(document: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One flat record per (model, measure), and per scale when the study has several.

    Parameters
    ----------
    document : dict
        A study's document.

    Returns
    -------
    list of dict
        ``model``, ``measure``, ``value``, ``clean_loss``, ``perturbed_loss``,
        ``seconds``, then ``gap`` (and ``train_error``, ``test_error`` when measured);
        with ``rho_scales`` also ``scale``, one row per scale.
    """
    rows = []
    for model in document["models"]:
        extra = {k: model[k] for k in MODEL_FIELDS if k in model}
        by_scale = model.get("by_scale") or {"1": model["measures"]}
        for scale, measures in by_scale.items():
            for measure, entry in measures.items():
                row = {"model": model["checkpoint"], "measure": measure}
                if "by_scale" in model:
                    row["scale"] = float(scale)
                row.update(
                    value=entry["value"],
                    clean_loss=entry.get("clean_loss"),
                    perturbed_loss=entry.get("perturbed_loss"),
                    seconds=entry.get("seconds"),
                    **extra,
                )
                rows.append(row)
    return rows


def tau_rows(document: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One record per measure: ``measure``, ``tau``, ``p_value``, ``ci_low``, ``ci_high``,
    ``models`` and ``warning`` (the tau table).

    Parameters
    ----------
    document : dict
        A study's document.

    Returns
    -------
    list of dict
        The rows, in the order of the study's measures.
    """
    return [{"measure": measure, **row} for measure, row in document["tau"].items()]


def write_rows_csv(rows: Sequence[Mapping[str, Any]], path: Union[str, Path]) -> str:
    """Write records to a CSV file with a header (the union of their keys, in order).

    Parameters
    ----------
    rows : sequence of dict
        The records (``None`` is written as an empty cell).
    path : str or path-like
        The file.

    Returns
    -------
    str
        ``path``.
    """
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["model"]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def read_rows_csv(path: Union[str, Path]) -> List[Dict[str, Any]]:
    """The records of a CSV written by :func:`write_rows_csv`, numbers parsed.

    Parameters
    ----------
    path : str or path-like
        The file.

    Returns
    -------
    list of dict
        One dict per line; cells that parse as numbers are floats, empty cells ``None``.
    """
    with open(path, newline="", encoding="utf-8") as handle:
        return [{k: _cell(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def _cell(text: str) -> Any:
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def population_frames(document: Mapping[str, Any]):
    """The study as two :class:`pandas.DataFrame`: :func:`population_rows` and
    :func:`tau_rows` (pandas comes with the ``experiments`` extra).

    Parameters
    ----------
    document : dict
        A study's document.

    Returns
    -------
    tuple of pandas.DataFrame
        ``(models, tau)``.
    """
    pandas = require("pandas", "population_frames")
    return pandas.DataFrame(population_rows(document)), pandas.DataFrame(tau_rows(document))


def write_population_files(
    document: Dict[str, Any], out: Union[str, Path], stem: str, label: str
) -> List[str]:
    """Write OUT/STEM.png (the scatter figure), OUT/STEM.csv and OUT/STEM-tau.csv (the
    tables), OUT/STEM-tau-by-rho.png with ``rho_scales``, then OUT/STEM.json.

    The document gets ``figure``, ``figure_title`` (:func:`figure_title` of ``label``),
    ``tables`` and, with ``rho_scales``, ``tau_by_rho_figure`` before it is written.

    Parameters
    ----------
    document : dict
        A study's document; updated with the paths.
    out : str or path-like
        The output directory (made if missing).
    stem : str
        The files' common name.
    label : str
        What the models are, for the figure's title.

    Returns
    -------
    list of str
        The paths written, the JSON last.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    title = figure_title(document, label)
    document["figure"] = scatter_figure(
        document["models"], MEASURES, str(out / f"{stem}.png"), title
    )
    document["figure_title"] = title
    written = [document["figure"]]
    if "tau_by_rho" in document:
        document["tau_by_rho_figure"] = _rho_figure(
            document, label, str(out / f"{stem}-tau-by-rho.png")
        )
        written.append(document["tau_by_rho_figure"])
    document["tables"] = {
        "models": write_rows_csv(population_rows(document), out / f"{stem}.csv"),
        "tau": write_rows_csv(tau_rows(document), out / f"{stem}-tau.csv"),
    }
    written += list(document["tables"].values())
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(document, indent=1, default=float) + "\n")
    return [*written, str(json_path)]


def _rho_figure(document: Mapping[str, Any], label: str, path: str) -> str:
    """Tau against the radius, the paper's ImageNet values as thin lines."""
    title = f"{label}\ntau against the generalization gap; thin lines: {REFERENCE} (Table 1)"
    if document.get("warning"):
        title += f"\nwarning: {document['warning']}"
    return tau_by_rho_figure(
        document["tau_by_rho"], path, title=title, reference=PAPER_TAU[REFERENCE]
    )
