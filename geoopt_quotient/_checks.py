"""Argument checks, and the names they accept, shared by every layer of the package.

The vocabulary of the geometry is declared once here: the metrics of the quotients, their
retractions, and the paths along which a ball is walked (the measures of sharpness built
on them are :class:`geoopt_quotient.measures.Measure`). Every check raises an error that
names the argument and says what was expected.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = [
    "GEODESIC_PATHS",
    "METRICS",
    "PATHS",
    "RETRACTIONS",
    "STRAIGHT",
    "check_choice",
    "check_nonnegative_float",
    "check_positive_float",
    "check_positive_int",
]

#: Metrics of the quotient geometries (:class:`~geoopt_quotient.GLQuotient`, ...).
METRICS = ("inv", "mix")
#: Retractions of the quotient geometries.
RETRACTIONS = ("second_order", "first_order")
#: Paths along geodesics (exact, or the second-order retraction).
GEODESIC_PATHS = ("exact", "second_order")
#: The straight path ``theta + xi`` (no geometry).
STRAIGHT = "straight"
#: Every path a ball can be walked along.
PATHS = (*GEODESIC_PATHS, STRAIGHT)


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
