"""Optimizers: geoopt's Riemannian optimizers with the fixes a quotient needs, and
sharpness-aware minimisation on the quotient (:class:`GeodesicSAM`)."""

from .riemannian import RiemannianAdam, RiemannianSGD, StepSizeError
from .sam import GeodesicSAM, SAMAscent, ZeroAscentWarning

__all__ = [
    "GeodesicSAM",
    "RiemannianAdam",
    "RiemannianSGD",
    "SAMAscent",
    "StepSizeError",
    "ZeroAscentWarning",
]
