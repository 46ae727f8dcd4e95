"""geoopt-quotient: quotient geometry of neural-network symmetries, and sharpness it can't fool.

``import geoopt_quotient`` imports nothing heavy (not even torch): every name below and
every subpackage is imported on first attribute access (``gq.GLQuotient``,
``gq.nn.FactorizedLinear``). The library's layers, each importing only those below it:

* :mod:`~geoopt_quotient.errors`: the base exception and warning of the package;
  :mod:`~geoopt_quotient.measures`: the names of the sharpness measures;
* :mod:`~geoopt_quotient.manifolds`: the quotient geometries (Geoopt manifolds);
* :mod:`~geoopt_quotient.symmetry`: symmetry plans and their discovery in real models;
* :mod:`~geoopt_quotient.sharpness`: the engine (Auto-PGD in a ball, sharpness, Hessian);
* :mod:`~geoopt_quotient.nn`, :mod:`~geoopt_quotient.optim`,
  :mod:`~geoopt_quotient.testing`, :mod:`~geoopt_quotient.integrations`: layers,
  optimizers, the testing kit, sharpness during training (Hugging Face ``Trainer``);
* :mod:`~geoopt_quotient.experiments` and :mod:`~geoopt_quotient.cli`: the paper's
  experiments and the command line, on top (their figures and data sets need the
  ``experiments`` extra).
"""

import importlib
from typing import Any, Dict, List

from . import _moved

__version__ = "0.2.0"

_moved.install()

#: Top-level names, and the subpackage each is imported from on first access.
EXPORTS: Dict[str, str] = {
    **dict.fromkeys(("GeooptQuotientError", "GeooptQuotientWarning"), "errors"),
    "Measure": "measures",
    **dict.fromkeys(
        (
            "AdaptiveEuclidean",
            "DiagonalQuotient",
            "GeodesicDomainError",
            "GLQuotient",
            "PositiveScalingQuotient",
            "RotaryGLQuotient",
        ),
        "manifolds",
    ),
    **dict.fromkeys(
        (
            "BoundPlan",
            "GeodesicEqualsAdaptiveWarning",
            "PlanError",
            "SymmetryGroup",
            "SymmetryNotProvenWarning",
            "SymmetryPlan",
            "SymmetryVerificationError",
            "find_symmetries",
            "prove_plan",
            "verify_plan",
        ),
        "symmetry",
    ),
    **dict.fromkeys(
        (
            "BallGroup",
            "IndependentLossError",
            "LossFnError",
            "NonFiniteError",
            "PathGapWarning",
            "SharpnessResult",
            "StaleParameterError",
            "ZeroSharpnessWarning",
            "adaptive_sharpness",
            "average_in_ball",
            "calibrate_radii",
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
    "errors",
    "experiments",
    "integrations",
    "manifolds",
    "measures",
    "nn",
    "optim",
    "sharpness",
    "symmetry",
    "testing",
)

#: Old subpackage and module names, still reachable as attributes (with a FutureWarning).
MOVED = tuple(old.rpartition(".")[2] for old in _moved.MOVED_MODULES if old.count(".") == 1)

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    if name in EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    elif name in SUBMODULES or name in MOVED:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in MOVED:
        globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(EXPORTS) | set(SUBMODULES))
