r"""The sharpness measures, by name: one vocabulary for the library, the experiments and the CLI.

A measure is :math:`\max_{|\xi|_w \le \rho} L(\gamma_\xi(1)) - L(w)` (or the mean over the
ball) for one ball :math:`|\cdot|_w` and one family of paths :math:`\gamma`:

* adaptive sharpness: the adaptive ball, straight lines :math:`w + \xi`;
* geodesic sharpness in a metric (``inv`` or ``mix``): the quotient's ball, its
  geodesics (along the path the caller chooses, or one the measure fixes);
* the ablations of Appendix G of "Hide & Seek": the quotient norm off (the adaptive ball
  walked along the quotient's geodesics, ``_no_norm``) or the curvature off (the quotient
  ball walked along straight lines, ``_no_curvature``).

:class:`Measure` is one such measure; :meth:`Measure.parse` reads every name the package
uses and :attr:`Measure.name` writes it back. Two spellings exist, and both are kept
because results, CSV columns and JSON keys carry them:

========================  ==============================  =================================
measure                   name (:attr:`Measure.name`)     short name (:attr:`~Measure.short_name`)
========================  ==============================  =================================
adaptive                  ``adaptive``                    ``adaptive``
geodesic, metric M        ``geodesic_M``                  ``M``
ablation: norm off        ``geodesic_M_no_norm``          —
ablation: curvature off   ``geodesic_M_no_curvature``     —
geodesic along path P     ``M_P``                         ``M_P``
mix, not stopped at 0     ``mix_unclamped``               ``mix_unclamped``
========================  ==============================  =================================

The names ``geodesic_M`` (and the ablations) are those of
:func:`~geoopt_quotient.integrations.measure_sharpness`, the population studies and the
``sharpness`` command; the short names are the keys of
:data:`~geoopt_quotient.sharpness.DEFAULT_RADII`, the measures of
:func:`~geoopt_quotient.calibrate_rho` and of the diagonal-network experiment, whose
``M_second_order`` and ``mix_unclamped`` fix the path
(:mod:`geoopt_quotient.experiments.diagonal`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from ._checks import GEODESIC_PATHS, METRICS

__all__ = ["ABLATIONS", "MEASURES", "NAMED_MEASURES", "Measure"]

#: Prefix of the geodesic measures' names.
GEODESIC_PREFIX = "geodesic_"
#: Name suffix of each ablation: the quotient norm, or the curvature, switched off.
ABLATION_SUFFIXES = {"norm": "_no_norm", "curvature": "_no_curvature"}
#: Name suffix of the mix geodesic continued through :math:`\beta_i = 0`.
UNCLAMPED_SUFFIX = "_unclamped"


@dataclass(frozen=True)
class Measure:
    """One sharpness measure: adaptive, or geodesic in a metric (with its path and
    ablations).

    Attributes
    ----------
    metric : {"inv", "mix"} or None
        The metric of the quotient geometries; ``None``: adaptive sharpness.
    path : {"exact", "second_order"} or None
        The path along the geodesics that the measure fixes; ``None`` (default): the
        caller's (the ``path`` argument of :func:`~geoopt_quotient.geodesic_sharpness`,
        the exact geodesic in the diagonal-network experiment).
    norm : bool
        ``False``: the ablation that measures in the adaptive ball (default ``True``, the
        quotient's ball).
    curvature : bool
        ``False``: the ablation that walks straight lines (default ``True``, geodesics).
    clamped : bool
        ``False``: the mix geodesic of the diagonal-network experiment continued through
        :math:`\\beta_i = 0` instead of stopped there (a diagnostic; default ``True``).

    Examples
    --------
    >>> from geoopt_quotient import Measure
    >>> Measure.parse("geodesic_mix_no_norm")
    Measure(metric='mix', path=None, norm=False, curvature=True, clamped=True)
    >>> Measure("inv").name, Measure("inv").short_name, Measure("inv").ball
    ('geodesic_inv', 'inv', 'inv')
    >>> Measure.parse("inv_second_order").name
    'inv_second_order'
    """

    metric: Optional[str] = None
    path: Optional[str] = None
    norm: bool = True
    curvature: bool = True
    clamped: bool = True

    def __post_init__(self) -> None:
        if self.metric is None:
            if (self.path, self.norm, self.curvature, self.clamped) != (None, True, True, True):
                raise ValueError(
                    f"adaptive sharpness (metric None) has no path, ablation or clamp; got {self!r}"
                )
            return
        if self.metric not in METRICS:
            raise ValueError(
                f"`metric` must be one of {list(METRICS)} or None, got {self.metric!r}"
            )
        if self.path is not None and self.path not in GEODESIC_PATHS:
            raise ValueError(
                f"`path` must be one of {list(GEODESIC_PATHS)} or None, got {self.path!r}"
            )
        if not (self.norm and self.curvature) and self.path is not None:
            raise ValueError(f"an ablation takes its path from the caller (path None): {self!r}")
        if not (self.norm or self.curvature):
            raise ValueError(f"switch off the norm or the curvature, not both: {self!r}")
        if not self.clamped and (self.metric != "mix" or self.path is not None):
            raise ValueError(f"only the mix geodesic, on its own path, is unclamped: {self!r}")

    @classmethod
    def parse(cls, name: Union[str, Measure]) -> Measure:
        """The measure of a name: :attr:`name` or :attr:`short_name` of some measure.

        Parameters
        ----------
        name : str or Measure
            ``"adaptive"``, ``"geodesic_inv"``, ``"inv"``, ``"geodesic_mix_no_norm"``,
            ``"mix_second_order"``, ... (the names of the module's table); a
            :class:`Measure` is returned as it is.

        Returns
        -------
        Measure

        Raises
        ------
        ValueError
            For any other name; the message lists the valid ones.
        TypeError
            For something that is neither a string nor a :class:`Measure`.
        """
        if isinstance(name, Measure):
            return name
        table = _by_name()
        if not isinstance(name, str):
            raise TypeError(
                f"a measure's name must be a string, one of {list(table)}; got {name!r}"
            )
        if name not in table:
            raise ValueError(f"unknown measure {name!r}; expected one of {list(table)}")
        return table[name]

    @property
    def is_adaptive(self) -> bool:
        """Whether this is adaptive sharpness."""
        return self.metric is None

    @property
    def is_ablation(self) -> bool:
        """Whether the quotient norm or the curvature is switched off."""
        return not (self.norm and self.curvature)

    @property
    def ball(self) -> str:
        """The ball, a key of :data:`~geoopt_quotient.sharpness.DEFAULT_RADII`:
        ``"adaptive"`` for adaptive sharpness and the no-norm ablations, the metric
        otherwise."""
        return "adaptive" if self.metric is None or not self.norm else self.metric

    @property
    def straight(self) -> bool:
        """Whether the measure walks straight lines :math:`w + \\xi` (adaptive sharpness,
        the no-curvature ablations) rather than geodesics."""
        return self.metric is None or not self.curvature

    @property
    def name(self) -> str:
        """The measure's name: ``geodesic_M`` and its ablations for a path the caller
        chooses, the short name (``M_P``, ``mix_unclamped``) for one the measure fixes.

        ``Measure.parse(m.name) == m`` for every measure ``m``.
        """
        if self.metric is None:
            return "adaptive"
        if self.path is not None or not self.clamped:
            return self.short_name
        suffix = ""
        if self.is_ablation:
            suffix = ABLATION_SUFFIXES["norm" if not self.norm else "curvature"]
        return f"{GEODESIC_PREFIX}{self.metric}{suffix}"

    @property
    def short_name(self) -> str:
        """The name without ``geodesic_``: ``"adaptive"``, ``"inv"``, ``"mix"``,
        ``"inv_second_order"``, ``"mix_unclamped"``, ...

        Raises
        ------
        ValueError
            For an ablation, which has no short name.
        """
        if self.metric is None:
            return "adaptive"
        if self.is_ablation:
            raise ValueError(f"the ablation {self.name!r} has no short name")
        suffix = UNCLAMPED_SUFFIX if not self.clamped else ""
        return self.metric + ("" if self.path is None else f"_{self.path}") + suffix


def _every_measure() -> Tuple[Measure, ...]:
    """Every measure, in the order of :func:`names`."""
    measures = [Measure()]
    measures += [Measure(metric) for metric in METRICS]
    measures += [
        Measure(metric, **{part: False}) for metric in METRICS for part in ABLATION_SUFFIXES
    ]
    measures += [Measure(metric, path) for path in GEODESIC_PATHS for metric in METRICS]
    return (*measures, Measure("mix", clamped=False))


@functools.cache
def _by_name() -> Dict[str, Measure]:
    table: Dict[str, Measure] = {}
    for measure in _every_measure():
        table[measure.name] = measure
        if not measure.is_ablation:
            table[measure.short_name] = measure
    return table


def names() -> Tuple[str, ...]:
    """Every name :meth:`Measure.parse` reads: names, then short names, of every measure."""
    return tuple(_by_name())


#: The measures by ball, in short names: adaptive sharpness and geodesic sharpness in each
#: metric (the keys of :data:`~geoopt_quotient.sharpness.DEFAULT_RADII`).
MEASURES: Tuple[str, ...] = tuple(Measure(m).short_name for m in (None, *METRICS))
#: The same measures by name: ``"adaptive"``, ``"geodesic_inv"``, ``"geodesic_mix"``.
NAMED_MEASURES: Tuple[str, ...] = tuple(Measure(m).name for m in (None, *METRICS))
#: The ablations of Appendix G of "Hide & Seek": the quotient norm or the curvature off.
ABLATIONS: Tuple[str, ...] = tuple(
    Measure(metric, **{part: False}).name for metric in METRICS for part in ABLATION_SUFFIXES
)
