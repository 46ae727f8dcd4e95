"""The geometry's own checks: the domain of geodesics, the checks of their numerical
integration (the reference's and the batched kernels' alike) and the rank of factors."""

from __future__ import annotations

import math
from typing import List

import torch

from ..errors import GeooptQuotientError

__all__ = [
    "GeodesicDomainError",
    "check_speeds",
    "integration_error",
    "is_finite",
    "rank_report",
]


class GeodesicDomainError(GeooptQuotientError, ValueError):
    """A geodesic would leave the manifold (e.g. a mix geodesic with ``1 + 2 B t <= 0``), or
    its numerical integration broke down."""


def is_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every entry of the floating-point ``t`` is finite, as a boolean tensor:
    its minimum and maximum are finite (both are NaN where an entry is; an infinite
    entry is one of them), read in one pass, with no boolean tensor of its size."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all()


def rank_report(factor: torch.Tensor, label: str, rtol: float) -> str | None:
    r"""Describe why a batch of ``(..., k, h)`` factors is not of full column rank, or ``None``.

    Uses the eigenvalues of the float64 Gram matrix, whose square roots are the singular
    values (resolved down to about 1e-8 relative, well below the tolerance). A factor is
    rank-deficient when :math:`\sigma_{min} / \sigma_{max}` is at most ``rtol`` or the
    resolution of its dtype: rounding each entry to unit roundoff :math:`u` moves every
    singular value by at most :math:`\|E\|_2 \le u \|F\|_F \le u \sqrt h\,\sigma_{max}`
    (Weyl), so a smaller ratio cannot be told from 0 in that dtype. For bfloat16
    (:math:`u = 2^{-8}`) and :math:`h = 64` that is 0.031; for float32 :math:`5 \cdot 10^{-7}`.
    """
    if factor.numel() == 0:
        return None
    if not bool(is_finite(factor)):
        return f"factor {label} has non-finite entries"
    # the ratio of singular values is scale-free: scaling each factor to a largest entry of
    # 1 keeps its Gram matrix finite for entries near the float64 range (1e300 squared);
    # the largest |entry| from the extremes, exact in any dtype (no copy of the factor)
    dims = (-2, -1)
    largest_entry = torch.maximum(factor.amax(dims, keepdim=True), -factor.amin(dims, keepdim=True))
    f = factor.to(torch.float64, copy=True)
    f.div_(largest_entry.to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny))
    eigvals = torch.linalg.eigvalsh(f.mT @ f).clamp_min(0)
    largest = eigvals[..., -1:].clamp_min(torch.finfo(torch.float64).tiny)
    ratio = (eigvals[..., :1] / largest).sqrt().min().item()
    resolution = math.sqrt(factor.shape[-1]) * torch.finfo(factor.dtype).eps / 2
    tol = max(rtol, resolution)
    if ratio <= tol:
        return (
            f"factor {label} is rank-deficient: smallest/largest singular value "
            f"{ratio:.3g} <= {tol:.3g}"
        )
    return None


#: The largest relative change of a geodesic's squared metric speed that its numerical
#: integration may make (:func:`check_speeds`); more means it broke down.
SPEED_TOLERANCE = 2e-2


def check_speeds(
    steps: int,
    start: torch.Tensor,
    end: torch.Tensor,
    failures: List[torch.Tensor],
    *finite: torch.Tensor,
) -> None:
    r"""The check of a geodesic's numerical integration: raise
    :func:`integration_error` unless every tensor of ``finite`` is finite, the squared
    speeds ``end`` of each point are within 2% of ``start`` (:math:`|s_1 - s_0| \le
    0.02\, |s_0| + 10^{-30}`) and every Cholesky ``info`` of ``failures`` is 0: one
    host synchronisation.

    A geodesic keeps its metric speed: a speed that changed more, or a Gram matrix on
    the way that was not positive definite (a factor lost rank), means that the path
    left the manifold or that the steps were too long.

    Raises
    ------
    GeodesicDomainError
        Where any of these fails."""
    with torch.no_grad():
        checks = [
            *(is_finite(t) for t in finite),
            ((end - start).abs() <= SPEED_TOLERANCE * start.abs() + 1e-30).all(),
            *((info == 0).all() for info in failures),
        ]
        ok = bool(torch.stack(checks).all())
    if not ok:
        raise integration_error(steps)


def integration_error(steps: int) -> GeodesicDomainError:
    """The error of a geodesic integration of ``steps`` RK4 steps that broke down, with
    what to do about it."""
    return GeodesicDomainError(
        f"the geodesic integration broke down ({steps} RK4 steps): it left the "
        "manifold (a factor lost rank) or the steps are too long for this vector; "
        "use a shorter tangent vector (e.g. a smaller rho) or more `steps`"
    )
