"""Geoopt manifolds for the quotients that neural-network symmetries create."""

from ._gl_tangent import BatchedKernels
from .adaptive import AdaptiveEuclidean
from .base import QuotientManifold, group_label, has_group, random_group_element
from .diagonal_quotient import DiagonalQuotient, GeodesicDomainError
from .gl_quotient import GLQuotient
from .groups import general_linear, log_spread, nonzero_scalars, positive_scalars
from .positive_scaling import PositiveScalingQuotient
from .rotary_quotient import RotaryGLQuotient

__all__ = [
    "AdaptiveEuclidean",
    "BatchedKernels",
    "DiagonalQuotient",
    "GLQuotient",
    "GeodesicDomainError",
    "PositiveScalingQuotient",
    "QuotientManifold",
    "RotaryGLQuotient",
    "general_linear",
    "group_label",
    "has_group",
    "log_spread",
    "nonzero_scalars",
    "positive_scalars",
    "random_group_element",
]
