"""Results of several radii at once, as a list that also writes a table."""

from __future__ import annotations

import csv
import dataclasses
from typing import Any, Dict, List

from .._extras import require

__all__ = ["ResultList", "Table"]


class Table:
    """Writes the records of :meth:`rows` (dicts with the same keys) as a table."""

    def rows(self) -> List[Dict[str, Any]]:
        """The records of the table, one dict per row (the subclass's)."""
        raise NotImplementedError

    def to_csv(self, path: str) -> str:
        """Write :meth:`rows` to a CSV file at ``path`` (no pandas needed); returns the path."""
        rows = self.rows()
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["batch"])
            writer.writeheader()
            writer.writerows(rows)
        return path

    def to_frame(self):
        """:meth:`rows` as a :class:`pandas.DataFrame` (pandas comes with the
        ``experiments`` extra)."""
        pandas = require("pandas", f"{type(self).__name__}.to_frame")
        return pandas.DataFrame(self.rows())


class ResultList(Table, list):
    """A list of results, one per radius, that also writes them as one table.

    What :func:`~geoopt_quotient.sharpness.geodesic_sharpness` and
    :func:`~geoopt_quotient.sharpness.adaptive_sharpness` return for a grid of radii (one
    :class:`~geoopt_quotient.sharpness.SharpnessResult` per radius, in the order given),
    and :func:`~geoopt_quotient.sharpness.calibrate_rho` as its history (one
    :class:`~geoopt_quotient.sharpness.RhoEvaluation` per radius tried). It is a
    ``list``: indexing, iteration, ``len`` and comparison with a list are those of the
    list of the results.

    Parameters
    ----------
    iterable : iterable
        The results: :class:`~geoopt_quotient.sharpness.SharpnessResult` objects (or
        other objects with ``rows()``) or dataclasses, one per radius.

    Examples
    --------
    >>> from geoopt_quotient.sharpness import ResultList, RhoEvaluation
    >>> history = ResultList([RhoEvaluation(0.1, 0.2, 1.0), RhoEvaluation(0.2, 0.5, 1.0)])
    >>> history == [RhoEvaluation(0.1, 0.2, 1.0), RhoEvaluation(0.2, 0.5, 1.0)]
    True
    >>> history.rows()[1]
    {'rho': 0.2, 'value': 0.5, 'clean_loss': 1.0, 'ratio': 0.5}
    """

    def rows(self) -> List[Dict[str, Any]]:
        """One flat record per row of each result, in order: a
        :class:`~geoopt_quotient.sharpness.SharpnessResult`'s rows (one per batch, the
        settings, ``rho`` among them, in each) or a dataclass's fields (and its
        ``ratio``, where it has one)."""
        rows = []
        for result in self:
            if hasattr(result, "rows"):
                rows.extend(result.rows())
                continue
            row = dataclasses.asdict(result)
            if hasattr(result, "ratio"):
                row["ratio"] = result.ratio
            rows.append(row)
        return rows
