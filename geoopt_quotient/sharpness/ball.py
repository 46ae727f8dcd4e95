r"""The ball of a symmetry plan at a model's parameters, in one process.

Sharpness perturbs the parameters :math:`w` inside the joint ball
:math:`|\xi|_w \le \rho` of the plan's groups (:mod:`~geoopt_quotient.sharpness.apgd`).
This module makes that ball from a model and a bound plan: the checks of the base point
(floating-point, finite parameters; symmetric groups on their manifolds), the ball
groups of the plan's groups (:func:`ball_groups`: each group's metric and path, or the
adaptive metric with the quotient's path for the ``norm=False`` ablation), and
:class:`LocalBall`, which holds them with the objective of each batch. The ball of a
model sharded by FSDP2 is :class:`~geoopt_quotient.sharpness.sharded.ShardedBall`,
which makes its groups with :func:`ball_groups` as well.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence

import torch

from ..manifolds import AdaptiveEuclidean
from ..manifolds._validation import is_finite
from ..symmetry.plan import BoundPlan, SymmetryGroup
from .apgd import BallGroup, path_function
from .functional import RESOLUTION, PerturbedLoss, trainable_parameters
from .layout import BallLayout
from .path_gap import exact_groups
from .precision import AutocastState
from .shares import maximiser_shares

__all__ = [
    "LocalBall",
    "ball_groups",
    "check_parameters",
    "check_points",
    "warn_if_low_precision",
]


def ball_groups(
    groups: Sequence[SymmetryGroup],
    points: Sequence[torch.Tensor],
    path: str,
    norm: bool,
) -> List[BallGroup]:
    """The ball groups of the plan's ``groups`` at their base ``points``.

    Parameters
    ----------
    groups : sequence of SymmetryGroup
        The plan's groups (or this rank's part of them), in the order of ``points``.
    points : sequence of torch.Tensor
        Each group's base point.
    path : {"second_order", "exact", "straight"}
        The path from a tangent vector to a perturbed point.
    norm : bool
        ``True``: each group's own ball (its manifold's metric and path, with its cached
        geometry). ``False`` (the norm ablation): the adaptive metric on the symmetric
        groups, perturbed along their quotient's ``path``.

    Returns
    -------
    list of BallGroup
        One per group.
    """
    out = []
    for group, point in zip(groups, points):
        if norm or group.kind == "adaptive":  # the ball's own path (cached geometry)
            out.append(BallGroup(point, group.manifold))
        else:  # adaptive ball, the quotient's path
            walk = path_function(group.manifold, path)
            out.append(BallGroup(point, AdaptiveEuclidean(), walk))
    return out


def check_parameters(params: Mapping[str, torch.Tensor]) -> None:
    r"""Floating-point and finite: a constant number of operators and one host read per
    device and dtype, whatever the number of parameters.

    The parameters of one device and dtype are read in one call
    (``torch._foreach_norm``, one multi-tensor kernel on an accelerator): each one's
    Euclidean norm :math:`(\sum_i w_i^2)^{1/2}`, accumulated in float32 at least, is
    finite only where every entry is (a NaN or an infinity makes the sum NaN or
    infinite). A norm that overflows a finite parameter (entries above about
    :math:`10^{19}` in float32) is told apart by the exact test of that parameter alone
    (its smallest and largest entries,
    :func:`~geoopt_quotient.manifolds._validation.is_finite`), which names the culprit.
    (The :math:`\ell_1` norm would overflow later, but PyTorch's CPU kernel for it is
    about four times slower than the vectorised sum of squares.)

    Raises
    ------
    TypeError
        For a parameter that is not floating point.
    ValueError
        For a parameter with NaN/Inf entries.
    """
    for name, p in params.items():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; sharpness needs floats")
    by_kind: Dict[tuple, List[str]] = {}
    for name, p in params.items():
        by_kind.setdefault((p.device, p.dtype), []).append(name)
    for (_, dtype), names in by_kind.items():
        tensors = [params[n] for n in names]
        norms = torch._foreach_norm(tensors, 2, dtype=_norm_dtype(dtype))
        finite = torch.isfinite(torch.stack(norms)).tolist()
        for name, ok in zip(names, finite):
            if not ok and not bool(is_finite(params[name])):
                raise ValueError(
                    f"parameter {name!r} has NaN/Inf entries: sharpness is undefined; check the "
                    "checkpoint or the training run that produced it"
                )


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of :func:`check_parameters`'s norms: float32 at least (a sum of float16
    squares overflows at 65504)."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


def warn_if_low_precision(params: Mapping[str, torch.Tensor]) -> None:
    """Warn that perturbations of low-precision parameters are rounded to their dtype."""
    dtypes = sorted({p.dtype for p in params.values() if p.dtype in RESOLUTION}, key=str)
    if dtypes:
        names = ", ".join(f"{d} (resolution {RESOLUTION[d]} of a weight)" for d in dtypes)
        warnings.warn(
            f"the model has {names} parameters: a perturbation is rounded to that resolution "
            "when it is written into the model, which can change a sharpness value by tens "
            "of percent or round it to exactly 0 (user guide, 'Precision'); measure a "
            "float32 copy (model.float(); on the command line: --dtype float32), under "
            "torch.autocast for speed",
            stacklevel=4,
        )


def check_points(groups: Sequence[SymmetryGroup], points: Sequence[torch.Tensor]) -> None:
    """Every symmetric group's base point must lie on its manifold (full rank, no zeros).

    Raises
    ------
    ValueError
        Naming the first group that is not, and why (``eps > 0`` as the remedy where the
        manifold's reason mentions it).
    """
    for group, point in zip(groups, points):
        if group.kind == "adaptive":
            continue
        with AutocastState.capture().disabled():  # the rank test in full precision
            ok, reason = group.manifold.check_point_on_manifold(point, explain=True)
        if not ok:
            hint = " (e.g. eps=1e-6)" if "eps" in (reason or "") else ""
            raise ValueError(
                f"symmetry group {group.name!r} is not on its manifold: {reason}{hint}"
            )


class LocalBall:
    r"""The ball of ``plan`` at ``model``'s parameters, held in this process.

    Built once per sharpness call, after the checks of the base point. The worst case's
    iterates live in the flat buffers of one
    :class:`~geoopt_quotient.sharpness.layout.BallLayout`; the average case's samples
    are drawn group by group, and the perturbed points scattered into the parameters.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its trainable parameters are the base point :math:`w`.
    plan : BoundPlan
        The symmetry plan bound to it.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``, called on perturbed parameters
        (:class:`~geoopt_quotient.sharpness.functional.PerturbedLoss`).
    kind : {"worst", "average"}
        The worst case (a flat layout; with ``path="second_order"`` also the groups on
        the exact path, for the path-gap report) or the average case.
    path : str
        The path of the perturbations.
    norm : bool
        As for :func:`ball_groups`.
    keep_best_gradient : bool or None
        Passed on to Auto-PGD (:func:`~geoopt_quotient.maximize_in_ball`).
    shares : bool
        Worst case: keep :attr:`shares_of`, the maximiser's shares per block and kind.
    share_storage : bool
        Worst case: the model's parameters that the layout fuses move into its base
        point's flat buffers (:class:`~geoopt_quotient.sharpness.layout.BallLayout`'s
        ``parameters``), instead of being copied there.

    Attributes
    ----------
    groups : list of BallGroup
        The ball groups Auto-PGD or the average case runs on.
    exact : list of BallGroup or None
        Worst case on ``path="second_order"``: the groups on the exact path
        (:func:`~geoopt_quotient.sharpness.path_gap.exact_groups`); else ``None``.
    keep_best_gradient : bool or None
        As given.

    Raises
    ------
    TypeError, ValueError
        From :func:`check_parameters` and :func:`check_points`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        plan: BoundPlan,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        kind: str,
        path: str,
        norm: bool,
        keep_best_gradient: bool | None,
        shares: bool = False,
        share_storage: bool = False,
    ):
        self.plan = plan
        self.loss = PerturbedLoss(model, loss_fn)
        self.base = trainable_parameters(model)
        check_parameters(self.base)
        warn_if_low_precision(self.base)
        points = [p.detach() if p.requires_grad else p for p in plan.gather(self.base)]
        check_points(plan.groups, points)
        groups = ball_groups(plan.groups, points, path, norm)
        self.layout = None
        if kind == "worst":
            owned = dict(model.named_parameters()) if share_storage else None
            self.layout = BallLayout(plan, self.base, groups, owned)
            if share_storage:  # views of the storage they moved into, not of the old one
                self.base = trainable_parameters(model)
        self.exact = self.shares_of = on_exact = None
        if self.layout is not None:
            if shares:
                self.shares_of = _shares_function(plan, groups, self.layout)
            if path == "second_order":  # the path-gap report's groups on the exact path
                on_exact = ball_groups(plan.groups, points, "exact", norm)
                self.exact = exact_groups(self.layout.groups, groups, on_exact)
            groups = self.layout.groups
            del points, on_exact
        self.groups = groups
        self.keep_best_gradient = keep_best_gradient

    def objective(self, batch: Any) -> Callable[[List[torch.Tensor]], torch.Tensor]:
        """The loss of ``batch`` as a function of the perturbed points of :attr:`groups`."""
        if self.layout is not None:
            return self.layout.objective(lambda params: self.loss(params, batch))

        def objective(perturbed_points: List[torch.Tensor]) -> torch.Tensor:
            return self.loss(self.plan.scatter(_drain(perturbed_points), self.base), batch)

        return objective

    def weights(self) -> Dict[str, torch.Tensor]:
        """The model's trainable parameters (name to tensor), the base point."""
        return self.base


def _shares_function(
    plan: BoundPlan, groups: List[BallGroup], layout: BallLayout
) -> Callable[[List[torch.Tensor], List[torch.Tensor]], List[Dict[str, Any]]]:
    """``(xi, gradient) -> maximiser_shares`` for vectors of the layout's groups."""

    def shares_of(xi: List[torch.Tensor], gradient: List[torch.Tensor]) -> List[Dict[str, Any]]:
        return maximiser_shares(
            plan, groups, layout.plan_vectors(xi), layout.plan_vectors(gradient)
        )

    return shares_of


def _drain(points: List[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Yield and remove the entries of ``points``, first to last.

    The objective's caller builds a fresh list for every call; emptying it while the
    points are scattered into the parameters lets the copies of the symmetric groups go
    before the forward pass, instead of after it.
    """
    points.reverse()
    while points:
        yield points.pop()
