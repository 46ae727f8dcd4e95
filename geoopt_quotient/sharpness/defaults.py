r"""The default radius of every sharpness measure: one table, used by the Python API and the CLI.

The balls live on different scales (:doc:`/user_guide/radii`): the adaptive ball bounds
relative changes of every parameter, the ``inv`` ball relative changes of the products
:math:`W_q W_k^\top` and :math:`W_v W_o`, the ``mix`` ball their absolute changes. One
radius for all three compares nothing, so each measure has its own default. The values
were set on real pretrained weights (SmolLM2-135M-Instruct, all-MiniLM-L6-v2 and the tiny
ViT of ``reproduce transformers``; ``benchmarks/real_radii.py``): the radius at which
worst-case sharpness is 1 % of the clean loss differs between those models (by factors 4
to 25), and each default is the round radius at which every one of them is between 0.3 %
and 10 % of its clean loss (the table of :doc:`/user_guide/radii`): a local measure. For
balls calibrated to one rule on your own model and batches, use
:func:`~geoopt_quotient.sharpness.calibrate_radii`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .._checks import check_choice
from ..measures import MEASURES

__all__ = ["DEFAULT_RADII", "default_radius"]

#: Default radius of each measure: ``"adaptive"``, geodesic ``"inv"`` and ``"mix"``
#: (read-only), by ball (:attr:`~geoopt_quotient.Measure.ball`). The sharpness functions,
#: :func:`calibrate_rho` (its first radius) and the ``sharpness`` and ``population``
#: commands all take their defaults from here.
DEFAULT_RADII: Mapping[str, float] = MappingProxyType(
    {"adaptive": 0.01, "inv": 0.003, "mix": 0.003}
)


def default_radius(measure: str) -> float:
    """The default radius of ``measure`` (:data:`DEFAULT_RADII`).

    Parameters
    ----------
    measure : {"adaptive", "inv", "mix"}
        Adaptive sharpness, or geodesic sharpness in that metric.

    Returns
    -------
    float
        The radius.

    Raises
    ------
    ValueError
        For an unknown measure.

    Examples
    --------
    >>> from geoopt_quotient.sharpness import default_radius
    >>> default_radius("adaptive"), default_radius("inv"), default_radius("mix")
    (0.01, 0.003, 0.003)
    """
    return DEFAULT_RADII[check_choice(measure, MEASURES, "measure")]
