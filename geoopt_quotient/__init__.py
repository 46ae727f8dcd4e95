"""geoopt-quotient: quotient geometry of neural-network symmetries, and sharpness it can't fool.

``import geoopt_quotient`` imports nothing heavy (not even torch): every name below and
every subpackage (:mod:`~geoopt_quotient.manifolds`, :mod:`~geoopt_quotient.sharpness`,
:mod:`~geoopt_quotient.nn`, :mod:`~geoopt_quotient.optim`, ...) is imported on first
attribute access (``gq.GLQuotient``, ``gq.nn.FactorizedLinear``). Any of them also
imports :mod:`~geoopt_quotient.models`, which installs the symmetry discovery that the
sharpness functions use for ``symmetries=None``.
"""

import importlib
from typing import Any, Dict, List

__version__ = "0.1.0"

#: Top-level names, and the subpackage each is imported from on first access.
EXPORTS: Dict[str, str] = {
    **dict.fromkeys(
        ("AdaptiveEuclidean", "DiagonalQuotient", "GeodesicDomainError", "GLQuotient"),
        "manifolds",
    ),
    **dict.fromkeys(("SymmetryVerificationError", "find_symmetries"), "models"),
    **dict.fromkeys(
        (
            "BallGroup",
            "IndependentLossError",
            "LossFnError",
            "NonFiniteError",
            "PlanError",
            "SharpnessResult",
            "StaleParameterError",
            "SymmetryGroup",
            "SymmetryPlan",
            "ZeroSharpnessWarning",
            "adaptive_sharpness",
            "average_in_ball",
            "calibrate_rho",
            "geodesic_sharpness",
            "hessian_top_eigenvalue",
            "hessian_trace",
            "kendall_tau",
            "maximize_in_ball",
            "riemannian_hvp",
        ),
        "sharpness",
    ),
}

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

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    if name in EXPORTS:
        importlib.import_module(f"{__name__}.models")  # installs the discovery
        value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    elif name in SUBMODULES:
        importlib.import_module(f"{__name__}.models")
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(EXPORTS) | set(SUBMODULES))
