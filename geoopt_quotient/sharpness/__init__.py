"""The sharpness engine: a worst-case ball maximiser on manifolds, and sharpness of models."""

from .._moved import moved_attribute
from .apgd import BallGroup, BallMaxResult, NonFiniteError, average_in_ball, maximize_in_ball
from .calibrate import CalibrationError, RhoEvaluation, calibrate_radii, calibrate_rho
from .defaults import DEFAULT_RADII, default_radius
from .engine import DistributedModeDeprecationWarning
from .functional import IndependentLossError, LossFnError, StaleParameterError
from .hessian import HessianResult, hessian_top_eigenvalue, hessian_trace, riemannian_hvp
from .measure import (
    SharpnessResult,
    ZeroSharpnessWarning,
    adaptive_sharpness,
    geodesic_sharpness,
)
from .path_gap import PathGapWarning
from .results import ResultList
from .sharded import ShardingError
from .shares import block_of, maximiser_shares, mean_shares
from .stats import (
    kendall_tau,
    kendall_tau_bootstrap,
    partial_kendall_tau,
    partial_kendall_tau_bootstrap,
)

__all__ = [
    "DEFAULT_RADII",
    "BallGroup",
    "BallMaxResult",
    "CalibrationError",
    "DistributedModeDeprecationWarning",
    "HessianResult",
    "IndependentLossError",
    "LossFnError",
    "NonFiniteError",
    "PathGapWarning",
    "ResultList",
    "RhoEvaluation",
    "ShardingError",
    "SharpnessResult",
    "StaleParameterError",
    "ZeroSharpnessWarning",
    "adaptive_sharpness",
    "average_in_ball",
    "block_of",
    "calibrate_radii",
    "calibrate_rho",
    "default_radius",
    "geodesic_sharpness",
    "hessian_top_eigenvalue",
    "hessian_trace",
    "kendall_tau",
    "kendall_tau_bootstrap",
    "maximiser_shares",
    "maximize_in_ball",
    "mean_shares",
    "partial_kendall_tau",
    "partial_kendall_tau_bootstrap",
    "riemannian_hvp",
]


def __getattr__(name: str):
    return moved_attribute(__name__, name)
