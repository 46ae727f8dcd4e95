"""The geometry's own checks: the domain of geodesics, the checks of their numerical
integration (the reference's and the batched kernels' alike) and the rank of factors."""

from __future__ import annotations

import math
from typing import List

import torch

from ..errors import GeooptQuotientError
from ._linalg import gram

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
    eigvals = torch.linalg.eigvalsh(_float64_gram(factor)).clamp_min(0)
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


def _float64_gram(factor: torch.Tensor) -> torch.Tensor:
    """The Gram matrices of ``factor`` (``(..., k, h)``) in float64, finite for finite
    entries: a float64 factor is first scaled to a largest entry of 1 (the ratio of
    singular values is scale-free, and entries near 1e300 would overflow when squared);
    the squares of a narrower dtype's entries lie far inside float64's range, and its
    factors are converted a few matrices at a time, without a float64 copy of the whole."""
    if factor.dtype != torch.float64:
        return gram(factor, dtype=torch.float64)
    # the largest |entry| from the extremes, exact (no copy of the factor for it)
    dims = (-2, -1)
    largest_entry = torch.maximum(factor.amax(dims, keepdim=True), -factor.amin(dims, keepdim=True))
    f = factor / largest_entry.clamp_min(torch.finfo(torch.float64).tiny)
    return f.mT @ f


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
