"""geoopt-quotient: quotient geometry of neural-network symmetries, and sharpness it can't fool.

The subpackages :mod:`~geoopt_quotient.nn`, :mod:`~geoopt_quotient.optim`,
:mod:`~geoopt_quotient.testing`, :mod:`~geoopt_quotient.population`, ... are imported on
first attribute access (``gq.nn.FactorizedLinear``), not by ``import geoopt_quotient``.
"""

import importlib

from .manifolds import AdaptiveEuclidean, DiagonalQuotient, GeodesicDomainError, GLQuotient
from .models import SymmetryVerificationError, find_symmetries
from .sharpness import (
    BallGroup,
    IndependentLossError,
    LossFnError,
    NonFiniteError,
    PlanError,
    SharpnessResult,
    StaleParameterError,
    SymmetryGroup,
    SymmetryPlan,
    ZeroSharpnessWarning,
    adaptive_sharpness,
    average_in_ball,
    geodesic_sharpness,
    hessian_top_eigenvalue,
    hessian_trace,
    kendall_tau,
    maximize_in_ball,
    riemannian_hvp,
)

__version__ = "0.1.0"

__all__ = [
    "AdaptiveEuclidean",
    "BallGroup",
    "DiagonalQuotient",
    "GLQuotient",
    "GeodesicDomainError",
    "IndependentLossError",
    "LossFnError",
    "NonFiniteError",
    "PlanError",
    "SharpnessResult",
    "StaleParameterError",
    "SymmetryGroup",
    "SymmetryPlan",
    "SymmetryVerificationError",
    "ZeroSharpnessWarning",
    "adaptive_sharpness",
    "average_in_ball",
    "find_symmetries",
    "geodesic_sharpness",
    "hessian_top_eigenvalue",
    "hessian_trace",
    "kendall_tau",
    "maximize_in_ball",
    "riemannian_hvp",
]

#: Subpackages imported on first access as attributes of the package.
SUBMODULES = (
    "cli",
    "classifiers",
    "diagonal",
    "io",
    "manifolds",
    "models",
    "nn",
    "optim",
    "population",
    "records",
    "sharpness",
    "testing",
)


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(SUBMODULES))
