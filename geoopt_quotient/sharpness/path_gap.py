r"""How far the second-order path's maximiser is from the exact geodesic's point.

Worst-case sharpness on ``path="second_order"`` evaluates the loss at
:math:`R_w(\xi)`, the second-order retraction :math:`w + \xi - \tfrac12 \Gamma_w(\xi, \xi)`
of the symmetry groups and the straight line :math:`w + \xi` of the adaptive parameters,
instead of at the geodesic's end point :math:`\operatorname{Exp}_w(\xi)`. At the maximiser
:math:`\xi^*` of each batch, the result estimates the relative gap below from the path's
second-order term (:func:`estimated_path_gap`: no integration, no pass) and warns from
that estimate (:func:`warn_if_estimated_path_gap`); with ``path_report=True`` it reports

.. math::

    g = \frac{|R_w(\xi^*) - \operatorname{Exp}_w(\xi^*)|_w}{|\xi^*|_w}, \qquad
    L_b\big(\operatorname{Exp}_w(\xi^*)\big),

the relative path gap in the metric at :math:`w` (joint over the groups) and the loss at
the geodesic's point: one more forward pass per batch, no backward pass, and warns from
those (:func:`warn_if_path_gap`).

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

How it is computed. The report must be trustworthy, not more: the exact geodesic is
needed to a small fraction of the gap itself, which is :math:`O(\rho^3)` absolute, while
RK4's error is :math:`O(\rho^5 / n^4)` after :math:`n` steps. On the GL quotients the
geodesic is integrated with step doubling (:func:`_controlled_gap`): :math:`E_1, E_2,
\ldots` until the Richardson estimate :math:`|E_{2n} - E_n|_w / 15` of :math:`E_{2n}`'s
error is at most :data:`GEODESIC_TOLERANCE` (:math:`10^{-3}`) of :math:`|R - E_{2n}|_w`,
else the manifold's own ``expmap_steps`` (16 by default: the value of ``path="exact"``),
all in float64 from one factorisation of the span. The estimate, :math:`|\xi|_w`,
:math:`|w|_w` and the check of each integration come from the span's :math:`2h \times
2h` coordinates; of the point's rows only the accepted end point and :math:`R - E` are
formed, the norms from the factors' :math:`h \times h` Gram matrices
(:func:`_squared_norms`), each slice's float64 copies in buffers reused by the group's
other slices. At typical radii two integrations of 1 and 2 steps suffice; far out the
check falls back. On the adaptive parameters with
:math:`\varepsilon = 0` (element-wise metric :math:`\sum_i \eta_i^2 / w_i^2`) the gap
has a closed form, :math:`|R - \operatorname{Exp}|_w^2 = \sum_i (e^{a_i} - 1 -
a_i)^2` with :math:`a = \xi / w` (:func:`elementwise_gap`), computed in the weights'
dtype without cancellation (:func:`expm1_minus_identity`) and summed in float64. Other
groups keep the generic path: both points in float64 and their difference.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, List, Sequence, Tuple

import torch

from ..errors import GeooptQuotientWarning
from ..manifolds import GeodesicDomainError
from ..manifolds._linalg import block_length, capped, compute_dtype
from ..manifolds.base import acts_per_point, has_elementwise_metric
from ..manifolds.tangent import TangentSpace
from .apgd import BallGroup, as_scalar, prepare_ball, straight_path
from .precision import AutocastState

__all__ = [
    "PATH_GAP_TOLERANCE",
    "PathGapWarning",
    "estimated_path_gap",
    "path_gap",
    "warn_if_estimated_path_gap",
    "warn_if_path_gap",
]

#: :class:`PathGapWarning` fires when the mean over batches of
#: :math:`|L_b(\operatorname{Exp}) - L_b(R)|` exceeds this fraction of the sharpness.
PATH_GAP_TOLERANCE = 0.1


class PathGapWarning(GeooptQuotientWarning, UserWarning):
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
#: ... on an accelerator (where blocks are :func:`~geoopt_quotient.manifolds._linalg.capped`):
#: each slice's integration costs the same kernel launches whatever its size, so the
#: slices are larger there (256 MiB per float64 copy; BERT-base's GL(h) groups in one).
SLICE_ENTRIES_CAPPED = 1 << 25


def _group_gap(
    group: BallGroup, exact: BallGroup, v: torch.Tensor
) -> Tuple[float, float, torch.Tensor]:
    r"""(:math:`|R(v) - \operatorname{Exp}(v)|^2`, :math:`|v|^2`, :math:`\operatorname{Exp}(v)`)
    of one group, the first two in float64: the two points differ by :math:`O(|v|^3)`, which
    float32 rounding of each (relative :math:`10^{-7}` of the weights) would swamp at small
    radii. A large group is taken a slice at a time (:func:`_slices`), so that its float64
    copies take at most :data:`SLICE_ENTRIES` entries each (:data:`SLICE_ENTRIES_CAPPED`
    on an accelerator); the end point is in the point's dtype."""
    x = group.point.detach()
    if _closed_form_applies(group, exact):
        return elementwise_gap(x, v.detach())
    end = torch.empty_like(x, memory_format=torch.contiguous_format)
    difference_sq = step_sq = 0.0
    buffers = _Buffers()
    for part in _slices(group, exact):
        d, s, e = _slice_gap(group, exact, x[part], v.detach()[part], buffers)
        difference_sq, step_sq = difference_sq + d, step_sq + s
        end[part] = e
    return difference_sq, step_sq, end


def _slices(group: BallGroup, exact: BallGroup) -> List[Any]:
    """Index expressions covering a group's point, in pieces where its geometry allows:
    flat pieces of an element-wise adaptive group, slices along the batch dimension of a
    batch of quotient points (this package's GL quotients, whose paths act per point)."""
    x = group.point
    size, entries = x.numel(), SLICE_ENTRIES_CAPPED if capped(x.device) else SLICE_ENTRIES
    if size <= entries:
        return [Ellipsis]
    owners = [group.manifold, exact.manifold]
    owners += [getattr(p, "__self__", None) for p in (group.path, exact.path) if p is not None]
    elementwise = has_elementwise_metric(group.manifold) and group.manifold.ndim == 0
    if elementwise and len(owners) == 2 and x.dim() == 1:
        return [slice(i, i + entries) for i in range(0, size, entries)]
    if x.dim() > 2 and all(acts_per_point(m) for m in owners):
        rows = max(1, entries // (size // x.shape[0]))
        return [slice(i, i + rows) for i in range(0, x.shape[0], rows)]
    return [Ellipsis]


class _Buffers:
    """Tensors of a group's largest slice, made on first use and reused by its other
    slices: a fresh tensor of this size costs its page faults on every slice."""

    def __init__(self):
        self.kept: dict = {}

    def like(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A buffer ``name`` of ``t``'s shape and device and ``dtype`` (contiguous, its
        entries undefined)."""
        kept = self.kept.get(name)
        if kept is None or kept.numel() < t.numel() or kept.dtype != dtype:
            kept = self.kept[name] = torch.empty(t.numel(), dtype=dtype, device=t.device)
        return kept[: t.numel()].view(t.shape)

    def converted(self, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, a contiguous one written into buffer ``name``."""
        if t.dtype == dtype or not t.is_contiguous():
            return t.to(dtype)
        return self.like(name, t, dtype).copy_(t)


def _slice_gap(
    group: BallGroup, exact: BallGroup, x: torch.Tensor, v: torch.Tensor, buffers: _Buffers
) -> Tuple[float, float, torch.Tensor]:
    """:func:`_group_gap` of one slice, in float64 (float32 on MPS): the slice's copies
    in ``buffers``; the end point a new tensor."""
    wide = torch.float64 if x.device.type != "mps" else torch.float32  # MPS has no float64
    x, v = buffers.converted("x", x, wide), buffers.converted("v", v, wide)
    (ball, (retract,)) = prepare_ball(
        [BallGroup(x, group.manifold, group.path)], 1.0, "second_order"
    )
    (space,) = ball.spaces
    same_manifold = exact.path is None and exact.manifold is group.manifold
    if same_manifold and space.integrates_geodesic and retract is not straight_path:
        return _controlled_gap(space, retract(x, v), v, buffers.like("difference", x, x.dtype))
    (_, (geodesic,)) = prepare_ball([BallGroup(x, exact.manifold, exact.path)], 1.0, "exact")
    end = geodesic(x, v)
    difference_sq = 0.0
    if not (retract is straight_path and geodesic is straight_path):
        difference = retract(x, v) - end
        difference_sq = float(space.inner(difference, difference))
    return difference_sq, float(space.inner(v, v)), end


#: Relative accuracy asked of the coarse geodesics of :func:`_controlled_gap`: the
#: Richardson estimate of the accepted end point's error, at most this fraction of its
#: distance to the retraction's point.
GEODESIC_TOLERANCE = 1e-3

#: The rounding floor of :func:`_controlled_gap`, in units of the working dtype's
#: machine epsilon times :math:`|w|_w`: end points whose estimated error is below it
#: differ by rounding only, whatever their steps.
ROUNDING_FLOOR_EPS = 64


def _controlled_gap(space, retracted: torch.Tensor, v: torch.Tensor, difference: torch.Tensor):
    r""":func:`_slice_gap` of a GL quotient group (on its exponential map, the manifold's
    RK4 integration) with the fewest steps that its error control accepts.

    With :math:`E_n` the end point after :math:`n` RK4 steps (global error
    :math:`E_n - \operatorname{Exp} \approx C n^{-4}`), the error of :math:`E_{2n}` is
    about :math:`|E_{2n} - E_n| / 15` (step doubling, Richardson:
    :math:`E_n - E_{2n} \approx 15\, C (2n)^{-4}`). For :math:`n = 1, 2, 4, \ldots` while
    :math:`2n` is below the manifold's ``expmap_steps`` :math:`N`, :math:`E_{2n}` is
    accepted when that estimate, in the metric at :math:`w`, is at most
    :data:`GEODESIC_TOLERANCE` times :math:`|R - E_{2n}|_w` (the reported gap is then
    within about that fraction of the exact geodesic's), or below the rounding floor
    :data:`ROUNDING_FLOOR_EPS` :math:`\cdot\, \epsilon\, |w|_w`; the next doubling is
    tried only where the estimate divided by 16 (its prediction for :math:`E_{4n}`)
    would pass. Otherwise, or where a coarse integration breaks down, the end point is
    :math:`E_N`, the exponential map (``expmap``) itself.

    Where the span's integration applies (:mod:`~geoopt_quotient.manifolds._gl_geodesic`),
    :math:`|E_{2n} - E_n|_w`, :math:`|w|_w`, :math:`|\xi|_w` and the check of each
    accepted integration come from the span's :math:`2h \times 2h` coordinates
    (:class:`_SpanEnds`): of the point's rows only :math:`R - E_{2n}` is formed, into
    ``difference`` (a buffer of ``v``'s shape and dtype).
    """
    largest = space.manifold.expmap_steps
    ends = _SpanEnds(space, v)
    norms = ends.squared_norms()  # read with the first gap: one host synchronisation
    steps = 1
    coarse = ends(steps, checked=False) if 2 * steps < largest else None
    while coarse is not None and 2 * steps < largest:
        fine = ends(2 * steps)
        if fine is None:
            break
        torch.sub(retracted, ends.point(fine), out=difference)
        change = ends.squared_change(fine, coarse).view(1)
        gap_sq, change_sq, step_sq, x_sq = torch.cat(
            (_squared_norms(space, difference), change, norms)
        ).tolist()
        gap, error = math.sqrt(max(gap_sq, 0.0)), math.sqrt(max(change_sq, 0.0)) / 15
        floor = ROUNDING_FLOOR_EPS * torch.finfo(space.x.dtype).eps * math.sqrt(max(x_sq, 0.0))
        if error <= GEODESIC_TOLERANCE * gap or error <= floor:
            return gap**2, step_sq, ends.point(fine)
        if not error / 16 <= GEODESIC_TOLERANCE * gap:  # also NaN
            break
        steps, coarse = 2 * steps, fine
    end = ends(largest)  # the exponential map's own integration, bit for bit
    if end is None:
        raise GeodesicDomainError(f"the geodesic integration broke down ({largest} RK4 steps)")
    end = ends.point(end)
    gap_sq, step_sq, _ = torch.cat(
        (_squared_norms(space, torch.sub(retracted, end, out=difference)), norms)
    ).tolist()
    return gap_sq, step_sq, end


class _SpanEnds:
    r"""The end points of the geodesic from ``space.x`` along ``v`` for the step counts
    :func:`_controlled_gap` asks, the span's factorisation and first stage shared.

    Where the span's integration applies, an end is its ``(state, position)``
    (:meth:`~geoopt_quotient.manifolds._gl_geodesic.SpanGeodesic.end_point`, the
    position formed only where it is checked or asked for), and the norms come from the
    span's coordinates; elsewhere an end is the point of the tangent space's
    ``expmaps`` and the norms are the metric's on the rows (:func:`_squared_norms`)."""

    def __init__(self, space, v: torch.Tensor):
        self.space, self.v = space, v
        self.span = space.span_geodesic(v)
        self.expmaps = space.expmaps(v) if self.span is None else None

    def __call__(self, steps: int, checked: bool = True) -> Any:
        """The end after ``steps`` RK4 steps; ``None`` where its integration breaks
        down (``checked``) or fails (unchecked: the check's other parts skipped)."""
        if self.span is None:
            return self.expmaps(steps, checked)
        try:
            return self.span.end_point(steps, checked)
        except GeodesicDomainError:
            return None

    def point(self, end: Any) -> torch.Tensor:
        """The end point of an end (formed on the first call)."""
        if self.span is None:
            return end
        state, position = end
        return position if position is not None else self.span.ends(state)[0]

    def squared_norms(self) -> torch.Tensor:
        r""":math:`|\xi|_w^2` and :math:`|w|_w^2`, summed over the batch (a tensor of
        two, in the point's dtype; not read from the device)."""
        if self.span is None:
            return _squared_norms(self.space, self.v, self.space.x)
        speeds, _ = self.span.start_speeds()
        return torch.stack((speeds.sum(), self.span.squared_change(self.span.start, None)))

    def squared_change(self, fine: Any, coarse: Any) -> torch.Tensor:
        r""":math:`|E_{fine} - E_{coarse}|_w^2`, summed over the batch (a 0-dim tensor)."""
        if self.span is None:
            return _squared_norms(self.space, fine - coarse)[0]
        return self.span.squared_change(fine[0], coarse[0])


def _squared_norms(space, *vectors: torch.Tensor) -> torch.Tensor:
    r""":math:`|u|_w^2` of each vector, summed over the batch (a tensor, one entry per
    vector, in the point's dtype; not read from the device):
    :math:`\sum \operatorname{tr}(W_G\, u_G^\top u_G) + \operatorname{tr}(W_H\, u_H^\top
    u_H)` from the :math:`h \times h` Gram matrices of the factors (the metric's blocks
    :math:`W` are symmetric), no temporary of the vectors' size."""
    manifold, state = space.manifold, space.state
    w_g, w_h = manifold._blocks(state)
    squares = []
    for u in vectors:
        u_g, u_h = manifold.factors(u.to(state.dtype))
        squares.append((w_g * (u_g.mT @ u_g)).sum() + (w_h * (u_h.mT @ u_h)).sum())
    return torch.stack(squares).to(space.x.dtype)


def _closed_form_applies(group: BallGroup, exact: BallGroup) -> bool:
    r"""Whether :func:`elementwise_gap` gives the group's gap: the adaptive metric with
    :math:`\varepsilon = 0` on both paths of the manifold itself."""
    manifold = group.manifold
    return (
        has_elementwise_metric(manifold)
        and manifold.eps == 0
        and exact.manifold is manifold
        and group.path is None
        and exact.path is None
    )


#: Entries per block of :func:`elementwise_gap` (they stay in the processor's cache).
ELEMENTWISE_BLOCK = 1 << 16

#: Where :func:`expm1_minus_identity` switches from its power series to
#: :math:`\operatorname{expm1}(a) - a`.
SERIES_BOUND = 0.5


def elementwise_gap(x: torch.Tensor, v: torch.Tensor) -> Tuple[float, float, torch.Tensor]:
    r""":func:`_slice_gap` of an adaptive group with :math:`\varepsilon = 0`, in closed form.

    With :math:`a = \xi / w` (0 where :math:`w = 0`, a frozen entry), the geodesic is
    :math:`w e^{a}` and the straight line :math:`w + \xi = w (1 + a)`, so in the metric
    :math:`\sum_i \eta_i^2 / w_i^2` (element-wise or reduced over trailing dimensions,
    the same total)

    .. math::

        |R - \operatorname{Exp}|_w^2 = \sum_i d(a_i)^2, \quad
        d(a) = e^a - 1 - a, \qquad |\xi|_w^2 = \sum_i a_i^2,

    and :math:`\operatorname{Exp} = w e^a`. Computed block by block in the point's
    working dtype (:func:`expm1_minus_identity`: accurate where :math:`d` cancels), the
    squares summed in float64; where :math:`d` overflows (:math:`a > 88` in float32),
    again in float64 (the end point is then infinite in the point's dtype either way).
    """
    end = torch.empty_like(x, memory_format=torch.contiguous_format)
    sums = _finite_elementwise_sums(x, v, end)
    return sums[0], sums[1], end


def _finite_elementwise_sums(x, v, end) -> Tuple[float, float]:
    """:func:`_elementwise_sums` in the working dtype, again in float64 where the gap
    overflows it."""
    dtype = compute_dtype(x.dtype)
    sums = _elementwise_sums(x, v, end, dtype)
    if not math.isfinite(sums[0]) and dtype != torch.float64 and x.device.type != "mps":
        sums = _elementwise_sums(x, v, end, torch.float64)
    return sums


def _elementwise_sums(x, v, end, dtype) -> Tuple[float, float]:
    r""":math:`(\sum_i d(a_i)^2, \sum_i a_i^2)` of :func:`elementwise_gap`, in float64,
    and :math:`w e^a` written into ``end`` (not formed where ``end`` is ``None``)."""
    flat_x, flat_v = x.reshape(-1), v.reshape(-1)
    flat_end = None if end is None else end.view(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=x.device)
    step = block_length(flat_x.numel(), ELEMENTWISE_BLOCK, x.device)
    for start in range(0, flat_x.numel(), step):
        part = slice(start, start + step)
        w = flat_x[part].to(dtype)
        a = torch.div(flat_v[part].to(dtype), w).masked_fill_(w == 0, 0.0)  # a new tensor
        d = expm1_minus_identity(a)
        sums[0] += _sum_of_squares(d)
        sums[1] += _sum_of_squares(a)
        if flat_end is not None:
            flat_end[part] = torch.exp(a).mul_(w)
    return float(sums[0]), float(sums[1])


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_i t_i^2`, accumulated in float64."""
    return torch.linalg.vector_norm(t, dtype=torch.float64).square()


def expm1_minus_identity(a: torch.Tensor) -> torch.Tensor:
    r""":math:`d(a) = e^a - 1 - a` of each entry, a new tensor of ``a``'s dtype, to a few
    units of its rounding: the power series :math:`\sum_{k \ge 2} a^k / k!` for
    :math:`|a| <` :data:`SERIES_BOUND`, truncated where its tail falls below a quarter of
    the dtype's epsilon relative to :math:`a^2 / 2` at the largest :math:`|a|` of the
    tensor (fewer terms for smaller entries), and :math:`\operatorname{expm1}(a) - a`
    above (its cancellation then costs at most a factor :math:`2 / |a| \le 4`). The
    naive form loses all digits as :math:`a \to 0`: :math:`\operatorname{expm1}(a)`
    carries an error of :math:`\epsilon |a|` while :math:`d(a) \approx a^2 / 2`.
    """
    largest = float(a.abs().max()) if a.numel() else 0.0
    terms = _series_terms(a.dtype, _power_of_two_above(min(largest, SERIES_BOUND)))
    series = torch.full_like(a, 1.0 / math.factorial(terms))
    for k in range(terms - 1, 1, -1):
        series.mul_(a).add_(1.0 / math.factorial(k))
    series.mul_(a).mul_(a)
    if not largest < SERIES_BOUND:  # also NaN
        series = torch.where(a.abs() >= SERIES_BOUND, torch.expm1(a).sub_(a), series)
    return series


def _power_of_two_above(value: float) -> float:
    """The smallest power of two at least ``value`` (0 for 0)."""
    return 0.0 if value <= 0 else 2.0 ** math.ceil(math.log2(value))


@functools.cache
def _series_terms(dtype: torch.dtype, bound: float) -> int:
    r"""The highest power :math:`K` of :func:`expm1_minus_identity`'s series for entries
    up to ``bound`` (a power of two, at most :data:`SERIES_BOUND`): its tail relative to
    :math:`a^2/2`, about :math:`2 |a|^{K-1} / (K+1)!`, below a quarter of ``dtype``'s
    epsilon."""
    eps, power = torch.finfo(dtype).eps, 2
    while 2 * bound ** (power - 1) / math.factorial(power + 1) > eps / 4:
        power += 1
    return power


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


# ------------------------------------------------------------------- the estimate
#: The factor of the third-order estimate of :func:`estimated_path_gap`:
#: :math:`|R - \operatorname{Exp}| \approx \tfrac23 |c|^2 / |\xi|` per point.
THIRD_ORDER_FACTOR = 2.0 / 3.0

#: Entries per block of the adaptive estimate (:func:`_adaptive_estimate`) where blocks
#: are capped (an accelerator; :func:`block_length`): 4 MiB of float32, few enough blocks
#: that the operators' dispatch stays below their arithmetic.
ESTIMATE_BLOCK = 1 << 20
#: On the CPU: 256 KiB of float32, so that its operators after the first read the block
#: from the cache.
ESTIMATE_CPU_BLOCK = 1 << 16


def estimated_path_gap(
    groups: Sequence[BallGroup],
    exact: Sequence[BallGroup],
    xi: Sequence[torch.Tensor],
    spaces: Sequence[TangentSpace] | None = None,
) -> float:
    r"""An estimate of the relative path gap :math:`g` of :func:`path_gap` at ``xi``,
    from the second-order term of the path alone: no geodesic integrated, no forward
    pass, in the iteration's dtype.

    The exact geodesic is :math:`\operatorname{Exp}_w(\xi) = w + \xi - c + \tfrac16
    \dddot\gamma(0) + O(|\xi|^4)` with the curvature correction
    :math:`c = \tfrac12 \Gamma_w(\xi, \xi)`. Per group:

    * The adaptive parameters (:math:`\varepsilon = 0`) walk the straight line
      :math:`w + \xi`, which omits :math:`c` itself: with :math:`a = \xi / w` (0 where
      :math:`w = 0`), the geodesic :math:`w e^{a}` has :math:`-c = \xi^2 / (2 w)`, so
      :math:`|R - \operatorname{Exp}|_w^2 \approx |c|_w^2 = \tfrac14 \sum_i a_i^4`, the
      leading term of the closed form :math:`\sum_i (e^{a_i} - 1 - a_i)^2`
      (:func:`elementwise_gap`; relative error :math:`O(\max_i |a_i|)`).
    * A group on a second-order retraction :math:`R_w(\xi) = w + \xi - c` (the GL
      quotients) misses only the third-order term. Its size is estimated per point
      :math:`p` of the group from :math:`c_p = w_p + \xi_p - R_w(\xi)_p`, the
      correction that the iteration's retraction applies (read from the retraction's
      :math:`h \times h` coefficients where the tangent space has them,
      :meth:`~geoopt_quotient.manifolds.tangent.TangentSpace.retraction_corrections`:
      no retracted point, and no rounding of :math:`w + \xi` against it; else the
      difference of the two points): the Taylor terms of a
      geodesic scale as :math:`|\gamma^{(k)}(0)| \sim \kappa^{k-1} |\xi|^k` with a
      curvature scale :math:`\kappa`, which :math:`c` measures,
      :math:`\kappa \approx 2 |c_p| / |\xi_p|^2`; so

      .. math::

          |R_w(\xi)_p - \operatorname{Exp}_w(\xi)_p| \approx \tfrac16 \kappa^2
          |\xi_p|^3 = \tfrac23\, \frac{|c_p|^2}{|\xi_p|},

      a relative gap of :math:`\tfrac23 (|c_p| / |\xi_p|)^2`. On the one-dimensional
      model :math:`w e^{a}` (:math:`|c| = a^2/2`, :math:`|\xi| = |a|`, third-order
      term :math:`|a|^3/6`) this is the leading term exactly. On the GL quotients it
      is an estimate: within the asymptotic range about 0.8 of the integrated gap
      for ``inv`` and a third of it for ``mix`` on the tests' tiny models, close to it
      where the gap approaches 1, and growing without bound where the geodesic
      leaves the range of the expansion (:math:`|c_p|` comparable to
      :math:`|\xi_p|`), where the integrated report may have no value at all.
    * Any other group (a path of its own, :math:`\varepsilon > 0`, a straight line on
      another geometry): the report's own :math:`|R - \operatorname{Exp}|_w^2` in
      float64 (:func:`_group_gap`; none such in the layouts of the package's
      symmetries with :math:`\varepsilon = 0`).

    ``spaces``: the tangent spaces at the groups' points where already made (those of
    the search that found ``xi``, :attr:`~geoopt_quotient.sharpness.apgd.BallMaxResult.spaces`):
    their factorisations of the points serve again.

    Returns :math:`(\sum_g |R - \operatorname{Exp}|_{w_g}^2)^{1/2} / |\xi|_w`; 0 for
    :math:`\xi = 0`, NaN where a fallback integration breaks down. Where :math:`c` is
    the difference of two points, it carries the rounding of the weights' dtype
    (:math:`\epsilon |w|`): the estimate matters only where :math:`|c|` is far above it.
    """
    autocast = AutocastState.capture()
    squared = step = 0.0
    try:
        with autocast.disabled(), torch.no_grad():
            for index, (group, exact_group, v) in enumerate(zip(groups, exact, xi)):
                space = None if spaces is None else spaces[index]
                difference_sq, step_sq = _estimated_group_gap(group, exact_group, v.detach(), space)
                squared, step = squared + difference_sq, step + step_sq
    except GeodesicDomainError:
        return math.nan
    return math.sqrt(squared) / math.sqrt(step) if step > 0 else 0.0


def _estimated_group_gap(
    group: BallGroup, exact: BallGroup, v: torch.Tensor, space: TangentSpace | None = None
):
    r"""(estimated :math:`|R - \operatorname{Exp}|^2`, :math:`|v|^2`) of one group, in
    float64 (:func:`estimated_path_gap`); ``space``: the tangent space at its point
    where already made."""
    x = group.point.detach()
    if _closed_form_applies(group, exact):
        return _adaptive_estimate(x, v)
    (ball, (retract,)) = prepare_ball(
        [BallGroup(x, group.manifold, group.path)],
        1.0,
        "second_order",
        None if space is None else [space.at_same_point()],
    )
    if retract is straight_path or group.path is not None:
        difference_sq, step_sq, _ = _group_gap(group, exact, v)
        return difference_sq, step_sq
    (space,) = ball.spaces
    norms = space.retraction_corrections(v)
    if norms is None:
        correction = torch.add(x, v).sub_(retract(x, v)).to(v.dtype)
        norms = _point_squared_norms(space, correction, v)
    c_sq, v_sq = (n.double().clamp_min(0) for n in norms)
    moving = v_sq > 0
    third = THIRD_ORDER_FACTOR * c_sq[moving] / v_sq[moving].sqrt()
    return tuple(torch.stack((third.square().sum(), v_sq.sum())).tolist())


def _point_squared_norms(space, *vectors: torch.Tensor) -> List[torch.Tensor]:
    r""":math:`|u_p|_w^2` per point :math:`p` of the space's batch (one value where the
    manifold's inner product is not per point), for each vector, flat: on a GL
    quotient from the :math:`h \times h` Gram matrices of the factors, as
    :func:`_squared_norms`, without a new factorisation of the point."""
    if not space.integrates_geodesic:  # not a GL quotient's batched space
        return [space.manifold.inner(space.x, u).reshape(-1) for u in vectors]
    manifold, state = space.manifold, space.state
    w_g, w_h = manifold._blocks(state)
    squares = []
    for u in vectors:
        u_g, u_h = manifold.factors(u.to(state.dtype))
        per_point = (w_g * (u_g.mT @ u_g)).sum((-2, -1)) + (w_h * (u_h.mT @ u_h)).sum((-2, -1))
        squares.append(per_point.reshape(-1))
    return squares


def _adaptive_estimate(x: torch.Tensor, v: torch.Tensor) -> Tuple[float, float]:
    r"""(:math:`\tfrac14 \sum_i a_i^4`, :math:`\sum_i a_i^2`) with :math:`a = \xi / w`
    (0 where :math:`w = 0`), block by block in the working dtype: each block's two sums
    in that dtype (a relative rounding of typically :math:`\sqrt{n}\,\epsilon`, at most
    :math:`n \epsilon`, for its :math:`n` entries: far below what an estimate needs; a
    float64 accumulation of float32 entries is an order of magnitude slower on the CPU),
    the blocks' sums in float64.

    A block is first summed without the mask of :math:`w = 0` (which costs more than the
    rest of its sums: the zeros of a quantised model's weights fall in every block),
    with :math:`0/0` read as 0, and with :math:`\sum_i \xi_i w_i` beside it, finite only
    where no entry of :math:`\xi` or :math:`w` is NaN or infinite. Where all three sums
    are finite, the block has no :math:`\xi_i / 0` with :math:`\xi_i \ne 0` (its square
    would be infinite) and its NaNs are exactly the masked entries, so its sums are the
    masked ones bit for bit; the other blocks are summed again with the mask. Where blocks
    are capped (an accelerator: few large blocks, the mask's cost small beside a host
    read of which blocks to sum again), every block is summed with the mask at once."""
    dtype = compute_dtype(x.dtype)
    flat_x, flat_v = x.reshape(-1), v.reshape(-1)
    masked = capped(x.device)
    if masked:
        step = block_length(flat_x.numel(), ESTIMATE_BLOCK, x.device)
    else:
        step = ESTIMATE_CPU_BLOCK
    starts = range(0, flat_x.numel(), step)
    if not starts:
        return 0.0, 0.0
    sums = torch.stack([_block_sums(flat_x, flat_v, s, step, dtype, masked) for s in starts])
    if not masked:
        for block in torch.nonzero(~torch.isfinite(sums).all(1)).view(-1).tolist():
            sums[block, :2] = _block_sums(flat_x, flat_v, starts[block], step, dtype, True)
    fourth, second = sums[:, :2].double().sum(0).tolist()
    return fourth / 4, second


def _block_sums(
    x: torch.Tensor, v: torch.Tensor, start: int, step: int, dtype: torch.dtype, masked: bool
) -> torch.Tensor:
    r""":math:`\sum a^4, \sum a^2` of the entries ``start:start + step`` in ``dtype``
    (:func:`_adaptive_estimate`): :math:`a` set to 0 where :math:`w = 0` if ``masked``;
    otherwise NaN read as 0, and :math:`\sum \xi w` third."""
    w, xi = x[start : start + step].to(dtype), v[start : start + step].to(dtype)
    squares = torch.div(xi, w)
    if masked:
        squares.masked_fill_(w == 0, 0.0).square_()
        return torch.stack((torch.dot(squares, squares), squares.sum()))
    squares.square_().nan_to_num_(nan=0.0, posinf=math.inf)
    return torch.stack((torch.dot(squares, squares), squares.sum(), torch.dot(xi, w)))


def warn_if_estimated_path_gap(
    sharpness: Sequence[float], estimates: Sequence[float], rho: float
) -> None:
    r"""Warn (:class:`PathGapWarning`) when the estimated path gaps say that the
    retraction's losses likely stray from the geodesic's (no exact report asked).

    Of :func:`warn_if_path_gap`'s left side, the loss difference at the maximiser is
    :math:`|\langle \nabla L, \operatorname{Exp} - R \rangle| \le |\nabla L|_w\,
    \hat g_b |\xi^*_b|_w` to first order, with :math:`\hat g_b` the estimated relative
    gap (:func:`estimated_path_gap`). The loss's slope over the ball is about
    :math:`S_b / \rho`: :math:`S_b \approx |\nabla L|_w \rho` where the gradient
    dominates, :math:`S_b \approx \tfrac12 \lambda \rho^2` with slope
    :math:`\lambda \rho = 2 S_b / \rho` at the maximiser near a minimum. So
    :math:`|L_b(\operatorname{Exp}) - L_b(R)| \approx \hat g_b S_b` (up to the
    gradient's alignment with :math:`\operatorname{Exp} - R`, at most 1, and a factor
    of at most 2), and the test is

    .. math::

        \frac1B \sum_b \hat g_b \max(S_b, 0) > 0.1\, \frac1B \sum_b S_b,

    a mean of the estimated gaps weighted by the batches' sharpness; NaN (a fallback
    integration that broke down) warns.
    """
    batches = len(sharpness)
    weighted = sum(g * max(s, 0.0) for g, s in zip(estimates, sharpness)) / batches
    value = sum(sharpness) / batches
    if weighted <= PATH_GAP_TOLERANCE * abs(value):  # False for NaN: it warns
        return
    mean_gap = sum(estimates) / batches
    warnings.warn(
        f"at rho={rho:g} the second-order path is likely not faithful: at the maximisers "
        f"its point is an estimated {mean_gap:.3g} of the step away from the exact "
        f"geodesic's on average (from its curvature correction), so the loss there likely "
        f"differs by more than {PATH_GAP_TOLERANCE:.0%} of the sharpness {value:.3g} (the "
        "result's `estimated_path_gaps`). Pass path_report=True for the exact geodesic's "
        'gaps and losses, measure with path="exact", or use a smaller rho',
        PathGapWarning,
        stacklevel=4,
    )
