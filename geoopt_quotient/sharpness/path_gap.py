r"""How far the second-order path's maximiser is from the exact geodesic's point.

Worst-case sharpness on ``path="second_order"`` evaluates the loss at
:math:`R_w(\xi)`, the second-order retraction :math:`w + \xi - \tfrac12 \Gamma_w(\xi, \xi)`
of the symmetry groups and the straight line :math:`w + \xi` of the adaptive parameters,
instead of at the geodesic's end point :math:`\operatorname{Exp}_w(\xi)`. At the maximiser
:math:`\xi^*` of each batch, the result reports

.. math::

    g = \frac{|R_w(\xi^*) - \operatorname{Exp}_w(\xi^*)|_w}{|\xi^*|_w}, \qquad
    L_b\big(\operatorname{Exp}_w(\xi^*)\big),

the relative path gap in the metric at :math:`w` (joint over the groups) and the loss at
the geodesic's point: one more forward pass per batch, no backward pass.

What to expect. Both paths agree to second order wherever the retraction is of second
order: :math:`R_w(\xi) - \operatorname{Exp}_w(\xi) = O(|\xi|^3)`, so the symmetry groups'
share of :math:`g` is :math:`O(\rho^2)` for a maximiser on the sphere
:math:`|\xi^*| = \rho`. The adaptive parameters' straight line is only of first order for
their metric :math:`\sum_i \xi_i^2 / w_i^2`, whose geodesic is
:math:`w_i e^{\xi_i / w_i} = w_i + \xi_i + \xi_i^2 / (2 w_i) + O(\xi_i^3)`: their share is
:math:`\tfrac12 (\sum_i a_i^4)^{1/2} / |\xi|` with :math:`a_i = \xi_i / w_i`, at most
:math:`\rho / 2` and about :math:`\rho / (2 \sqrt{n})` for a step spread over :math:`n`
entries. The loss gap is :math:`|\langle \nabla L, R - \operatorname{Exp} \rangle| = O(g\,
\rho)` while the sharpness is :math:`O(\rho)` (a nonzero gradient) or :math:`O(\rho^2)`
(near a minimum): their ratio grows with :math:`\rho`, and :class:`PathGapWarning` says
when it passes :data:`PATH_GAP_TOLERANCE`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, List, Sequence, Tuple

import torch

from ..manifolds import AdaptiveEuclidean, GeodesicDomainError, GLQuotient
from .apgd import BallGroup, _prepare, _straight, as_scalar
from .precision import AutocastState

__all__ = ["PATH_GAP_TOLERANCE", "PathGapWarning", "path_gap", "warn_if_path_gap"]

#: :class:`PathGapWarning` fires when the mean over batches of
#: :math:`|L_b(\operatorname{Exp}) - L_b(R)|` exceeds this fraction of the sharpness.
PATH_GAP_TOLERANCE = 0.1


class PathGapWarning(UserWarning):
    """The second-order path's loss at the maximiser is far from the exact geodesic's."""


def exact_groups(
    groups: Sequence[BallGroup], plain: Sequence[BallGroup], exact: Sequence[BallGroup]
) -> List[BallGroup]:
    """``groups`` (a layout's, some of them the very objects of ``plain``) with each of
    ``plain``'s replaced by its counterpart in ``exact`` (the same groups on the exact path).

    The other groups (the layout's fused adaptive buffers) carry no path of their own:
    the exact path is their manifold's exponential map already.
    """
    counterpart = {id(p): e for p, e in zip(plain, exact)}
    return [counterpart.get(id(g), g) for g in groups]


def path_gap(
    groups: Sequence[BallGroup],
    exact: Sequence[BallGroup],
    objective: Callable[[List[torch.Tensor]], torch.Tensor],
    xi: Sequence[torch.Tensor],
) -> Tuple[float, float]:
    r"""The relative path gap :math:`g` at ``xi`` and the objective at the exact point.

    Parameters
    ----------
    groups : sequence of BallGroup
        The ball's groups on the second-order path (a group's own ``path``, else the
        retraction of its manifold).
    exact : sequence of BallGroup
        The same groups on the exact path (a group's own ``path``, else its manifold's
        exponential map).
    objective : callable
        ``objective(points) -> scalar tensor`` of the perturbed points (no gradient taken).
    xi : sequence of torch.Tensor
        The tangent vector, one per group.

    Returns
    -------
    gap : float
        :math:`|R_w(\xi) - \operatorname{Exp}_w(\xi)|_w / |\xi|_w`, the norms in the
        joint metric at the base points; 0 for :math:`\xi = 0` (both points are
        :math:`w`).
    exact_loss : float
        ``objective`` at :math:`\operatorname{Exp}_w(\xi)`.

    Both are NaN where the geodesic's integration breaks down
    (:class:`~geoopt_quotient.manifolds.GeodesicDomainError`): at that step the geodesic
    leaves the manifold, and the retraction's point has no exact counterpart.
    """
    try:
        return _path_gap(groups, exact, objective, xi)
    except GeodesicDomainError:
        return math.nan, math.nan


def _path_gap(groups, exact, objective, xi) -> Tuple[float, float]:
    autocast = AutocastState.capture()
    with autocast.disabled(), torch.no_grad():
        squared, step, points = 0.0, 0.0, []
        for group, exact_group, v in zip(groups, exact, xi):
            difference_sq, step_sq, end = _group_gap(group, exact_group, v)
            squared, step = squared + difference_sq, step + step_sq
            points.append(end.to(group.point.dtype))
            del end
        with autocast.restored():
            loss = float(as_scalar(objective(points)).detach())
    step = math.sqrt(step)
    return (math.sqrt(squared) / step if step > 0 else 0.0), loss


#: Entries of a group handled at once by :func:`_group_gap` (its float64 copies stay small).
SLICE_ENTRIES = 1 << 22


def _group_gap(
    group: BallGroup, exact: BallGroup, v: torch.Tensor
) -> Tuple[float, float, torch.Tensor]:
    r"""(:math:`|R(v) - \operatorname{Exp}(v)|^2`, :math:`|v|^2`, :math:`\operatorname{Exp}(v)`)
    of one group, the first two in float64: the two points differ by :math:`O(|v|^3)`, which
    float32 rounding of each (relative :math:`10^{-7}` of the weights) would swamp at small
    radii. A large group is taken a slice at a time (:func:`_slices`), so that its float64
    copies take at most :data:`SLICE_ENTRIES` entries each; the end point is in the point's
    dtype."""
    x = group.point.detach()
    end = torch.empty_like(x, memory_format=torch.contiguous_format)
    difference_sq = step_sq = 0.0
    for part in _slices(group, exact):
        d, s, e = _slice_gap(group, exact, x[part], v.detach()[part])
        difference_sq, step_sq = difference_sq + d, step_sq + s
        end[part] = e
    return difference_sq, step_sq, end


def _slices(group: BallGroup, exact: BallGroup) -> List[Any]:
    """Index expressions covering a group's point, in pieces where its geometry allows:
    flat pieces of an element-wise adaptive group, slices along the batch dimension of a
    batch of quotient points (this package's GL quotients, whose paths act per point)."""
    x = group.point
    size = x.numel()
    if size <= SLICE_ENTRIES:
        return [Ellipsis]
    owners = [group.manifold, exact.manifold]
    owners += [getattr(p, "__self__", None) for p in (group.path, exact.path) if p is not None]
    elementwise = type(group.manifold) is AdaptiveEuclidean and group.manifold.ndim == 0
    if elementwise and len(owners) == 2 and x.dim() == 1:
        return [slice(i, i + SLICE_ENTRIES) for i in range(0, size, SLICE_ENTRIES)]
    if x.dim() > 2 and all(isinstance(m, (GLQuotient, AdaptiveEuclidean)) for m in owners):
        rows = max(1, SLICE_ENTRIES // (size // x.shape[0]))
        return [slice(i, i + rows) for i in range(0, x.shape[0], rows)]
    return [Ellipsis]


def _slice_gap(
    group: BallGroup, exact: BallGroup, x: torch.Tensor, v: torch.Tensor
) -> Tuple[float, float, torch.Tensor]:
    wide = torch.float64 if x.device.type != "mps" else torch.float32  # MPS has no float64
    x, v = x.to(wide), v.to(wide)
    (ball, (retract,)) = _prepare([BallGroup(x, group.manifold, group.path)], 1.0, "second_order")
    (_, (geodesic,)) = _prepare([BallGroup(x, exact.manifold, exact.path)], 1.0, "exact")
    (space,) = ball.spaces
    end = geodesic(x, v)
    difference_sq = 0.0
    if not (retract is _straight and geodesic is _straight):
        difference = retract(x, v) - end
        difference_sq = float(space.inner(difference, difference))
    return difference_sq, float(space.inner(v, v)), end


def warn_if_path_gap(
    sharpness: Sequence[float],
    retraction_losses: Sequence[float],
    exact_losses: Sequence[float],
    rho: float,
) -> None:
    r"""Warn (:class:`PathGapWarning`) when the retraction's losses stray from the geodesic's.

    The test is on the mean over batches,
    :math:`\frac1B \sum_b |L_b(\operatorname{Exp}) - L_b(R)| > 0.1\, \frac1B \sum_b S_b`:
    the left side bounds how far the reported value (a mean) is from the same maximisers
    evaluated on the exact path, and a batch whose own sharpness is near 0 does not make
    a small, irrelevant absolute gap look large.
    """
    batches = len(sharpness)
    mean_gap = sum(abs(e - r) for e, r in zip(exact_losses, retraction_losses)) / batches
    value = sum(sharpness) / batches
    if mean_gap <= PATH_GAP_TOLERANCE * abs(value):  # False for NaN: it warns
        return
    how = (
        "the exact geodesic could not be integrated to the maximiser of some batch (it "
        "leaves the manifold)"
        if math.isnan(mean_gap)
        else f"at the maximisers, the loss on the exact geodesic differs from the "
        f"retraction's by {mean_gap:.3g} on average, more than {PATH_GAP_TOLERANCE:.0%} of "
        f"the sharpness {value:.3g}"
    )
    warnings.warn(
        f"at rho={rho:g} the second-order path is not faithful: {how} (the result's "
        '`path_gaps` and `exact_losses` hold them per batch). Measure with path="exact", '
        "or use a smaller rho",
        PathGapWarning,
        stacklevel=4,
    )
