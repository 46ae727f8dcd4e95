"""``assert_invariant``: a model's outputs must not change along its symmetries."""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional

import torch

from ..manifolds.base import random_group_element
from ..symmetry import find_symmetries
from ..symmetry.plan import BoundPlan, SymmetryPlan

__all__ = ["assert_invariant", "transformed_copy"]


def _elements(
    plan: BoundPlan, condition: float, generator: torch.Generator, like: torch.Tensor
) -> List[Optional[torch.Tensor]]:
    """One random element of each symmetric group's own group (``None`` where it has
    none), drawn on ``generator``'s device in float64 and moved to ``like``'s."""
    elements: List[Optional[torch.Tensor]] = []
    for group in plan.symmetric_groups:
        shape = tuple(group.shape)
        a = random_group_element(
            group.manifold, shape[:-2], h=shape[-1], max_condition=condition, generator=generator
        )
        elements.append(None if a is None else a.to(device=like.device, dtype=like.dtype))
    return elements


def transformed_copy(
    model: torch.nn.Module,
    plan: Optional[SymmetryPlan | BoundPlan] = None,
    *,
    condition: float = 10.0,
    seed: int = 0,
    first_factor_only: bool = False,
) -> torch.nn.Module:
    r"""A deep copy of ``model`` moved along every symmetric group of ``plan`` by a random
    group element with condition number ``condition`` (default plan: discovered).

    Each group's element is drawn from the group its manifold divides by
    (``manifold.random_element``): :math:`\mathrm{GL}(h)` for
    :class:`~geoopt_quotient.GLQuotient`, the rotary-commuting subgroup for
    :class:`~geoopt_quotient.RotaryGLQuotient`, positive scalings for
    :class:`~geoopt_quotient.PositiveScalingQuotient`, non-zero scalings for
    :class:`~geoopt_quotient.DiagonalQuotient`.

    Parameters
    ----------
    model : torch.nn.Module
        The model; not changed.
    plan : SymmetryPlan, BoundPlan or None
        The symmetries to move along; ``None`` discovers them
        (:func:`~geoopt_quotient.find_symmetries`). Groups on manifolds without a group
        (the adaptive geometry, Geoopt's own manifolds) are left as they are.
    condition : float
        Bound :math:`\kappa \ge 1` on the condition number of the random elements
        (default 10).
    seed : int
        Seed of the elements' generator (a CPU generator: the same elements on every
        device).
    first_factor_only : bool
        Move each group's first factor only (:math:`G A^{-1}` with :math:`H` kept):
        not a symmetry, so the copy computes another function (a negative control).

    Returns
    -------
    torch.nn.Module
        The moved copy, which computes the same function as ``model`` when the plan's
        groups are symmetries.
    """
    bound = plan if isinstance(plan, BoundPlan) else (plan or find_symmetries(model)).bind(model)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    generator = torch.Generator().manual_seed(seed)  # the same elements on every device
    elements = _elements(bound, condition, generator, next(iter(params.values())))
    moved = bound.act(params, elements, first_factor_only=first_factor_only)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, value in moved.items():
            other.get_parameter(name).copy_(value)
    return other


def assert_invariant(
    fn: Callable[[torch.nn.Module], Any],
    model: torch.nn.Module,
    plan: Optional[SymmetryPlan | BoundPlan] = None,
    *,
    condition: float = 10.0,
    seed: int = 0,
    rtol: float = 1e-6,
    atol: float = 1e-8,
    first_factor_only: bool = False,
) -> torch.nn.Module:
    """Assert ``fn(model)`` equals ``fn`` of the model moved along its symmetries.

    ``fn`` maps a model to a tensor (or nested tensors), e.g. ``lambda m: m(x)`` or a
    sharpness value. Returns the moved copy for further checks.

    Parameters
    ----------
    fn : callable
        ``fn(model)`` returns what must not change: a tensor, a number or nested
        containers of them.
    model : torch.nn.Module
        The model; not changed.
    plan : SymmetryPlan, BoundPlan or None
        The symmetries; ``None`` discovers them.
    condition : float
        Condition number of the random group elements (default 10).
    seed : int
        Seed of the group elements.
    rtol, atol : float
        Tolerances of :func:`torch.testing.assert_close` (defaults 1e-6 and 1e-8).
    first_factor_only : bool
        Move one factor of each group only (see :func:`transformed_copy`): the
        assertion must then fail, which shows that ``fn`` can see the symmetries.

    Returns
    -------
    torch.nn.Module
        The moved copy (:func:`transformed_copy`).

    Raises
    ------
    AssertionError
        If ``fn`` of the moved copy differs from ``fn(model)``.
    """
    other = transformed_copy(
        model, plan, condition=condition, seed=seed, first_factor_only=first_factor_only
    )
    torch.testing.assert_close(fn(other), fn(model), rtol=rtol, atol=atol)
    return other
