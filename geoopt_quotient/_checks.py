"""Argument checks, and the names they accept, shared by every layer of the package.

The vocabulary is declared once here: the measures of sharpness, the metrics of the
quotients, their retractions, and the paths along which a ball is walked. Every check
raises an error that names the argument and says what was expected.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = [
    "ABLATIONS",
    "GEODESIC_PATHS",
    "MEASURES",
    "METRICS",
    "NAMED_MEASURES",
    "PATHS",
    "RETRACTIONS",
    "STRAIGHT",
    "check_choice",
    "check_nonnegative_float",
    "check_positive_float",
    "check_positive_int",
    "split_measure",
]

#: Metrics of the quotient geometries (:class:`~geoopt_quotient.GLQuotient`, ...).
METRICS = ("inv", "mix")
#: Retractions of the quotient geometries.
RETRACTIONS = ("second_order", "first_order")
#: Sharpness measures by ball: the adaptive ball, or the geodesic ball of a metric.
MEASURES = ("adaptive", *METRICS)
#: Paths along geodesics (exact, or the second-order retraction).
GEODESIC_PATHS = ("exact", "second_order")
#: The straight path ``theta + xi`` (no geometry).
STRAIGHT = "straight"
#: Every path a ball can be walked along.
PATHS = (*GEODESIC_PATHS, STRAIGHT)
#: Sharpness measures by name: adaptive sharpness and geodesic sharpness in each metric.
NAMED_MEASURES = ("adaptive", *(f"geodesic_{metric}" for metric in METRICS))
#: The ablations of Appendix G of "Hide & Seek": the quotient norm or the curvature off.
ABLATIONS = tuple(
    f"geodesic_{metric}_no_{part}" for metric in METRICS for part in ("norm", "curvature")
)


def split_measure(measure: str) -> tuple:
    """A measure's name as ``(metric, norm, curvature)``; ``metric`` is None for
    ``"adaptive"``: ``"geodesic_mix_no_norm"`` -> ``("mix", False, True)``."""
    check_choice(measure, (*NAMED_MEASURES, *ABLATIONS), "measure")
    if measure == "adaptive":
        return None, True, True
    metric = measure.split("_")[1]
    return metric, not measure.endswith("_no_norm"), not measure.endswith("_no_curvature")


def check_choice(value: str, choices: Sequence[str], name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string, one of {list(choices)}; got {value!r}")
    if value not in choices:
        raise ValueError(f"unknown `{name}` {value!r}; expected one of {list(choices)}")
    return value


def check_positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}")
    return value


def check_nonnegative_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value}")
    return value


def check_nonnegative_float(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be finite and >= 0, got {value}")
    return float(value)


def check_positive_float(value: float, name: str) -> float:
    """``value`` as a float if it is a finite real number > 0 (e.g. a radius ``rho``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`{name}` must be finite and > 0, got {value}")
    return float(value)
