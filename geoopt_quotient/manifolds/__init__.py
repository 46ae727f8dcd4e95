"""Geoopt manifolds for the quotients that neural-network symmetries create."""

from .adaptive import AdaptiveEuclidean
from .base import QuotientManifold
from .diagonal_quotient import DiagonalQuotient, GeodesicDomainError
from .gl_quotient import GLQuotient
from .positive_scaling import PositiveScalingQuotient
from .rotary_quotient import RotaryGLQuotient

__all__ = [
    "AdaptiveEuclidean",
    "DiagonalQuotient",
    "GLQuotient",
    "GeodesicDomainError",
    "PositiveScalingQuotient",
    "QuotientManifold",
    "RotaryGLQuotient",
]
