"""``assert_invariant``: a model's outputs must not change along its symmetries."""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional

import torch

from ..manifolds import DiagonalQuotient, GLQuotient
from ..symmetry import find_symmetries
from ..symmetry.plan import BoundPlan, SymmetryPlan
from .models import random_group_elements

__all__ = ["assert_invariant", "transformed_copy"]


def _elements(
    plan: BoundPlan, condition: float, generator: torch.Generator, like: torch.Tensor
) -> List:
    """Random group elements drawn on ``generator``'s device, moved to ``like``'s."""
    dtype = like.dtype
    elements: List[Optional[torch.Tensor]] = []
    for group in plan.symmetric_groups:
        shape = tuple(group.shape)
        if isinstance(group.manifold, GLQuotient):
            a = random_group_elements(
                shape[:-2], shape[-1], condition=condition, generator=generator, dtype=dtype
            )
        elif isinstance(group.manifold, DiagonalQuotient):
            batch = shape[:-2] + shape[-1:]
            a = random_group_elements(batch, 1, condition=condition, generator=generator)
            a = a[..., 0, 0].to(dtype)
        else:
            a = None  # not a group this helper knows how to act with
        elements.append(None if a is None else a.to(like.device))
    return elements


def transformed_copy(
    model: torch.nn.Module,
    plan: Optional[SymmetryPlan | BoundPlan] = None,
    *,
    condition: float = 10.0,
    seed: int = 0,
) -> torch.nn.Module:
    r"""A deep copy of ``model`` moved along every symmetric group of ``plan`` by a random
    group element with condition number ``condition`` (default plan: discovered).

    Parameters
    ----------
    model : torch.nn.Module
        The model; not changed.
    plan : SymmetryPlan, BoundPlan or None
        The symmetries to move along; ``None`` discovers them
        (:func:`~geoopt_quotient.find_symmetries`). Groups on other manifolds than
        :class:`~geoopt_quotient.GLQuotient` and :class:`~geoopt_quotient.DiagonalQuotient`
        are left as they are.
    condition : float
        Condition number :math:`\kappa \ge 1` of the random elements (default 10; see
        :func:`random_group_elements`).
    seed : int
        Seed of the elements' generator (a CPU generator: the same elements on every
        device).

    Returns
    -------
    torch.nn.Module
        The moved copy, which computes the same function as ``model`` when the plan's
        groups are symmetries.
    """
    bound = plan if isinstance(plan, BoundPlan) else (plan or find_symmetries(model)).bind(model)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    generator = torch.Generator().manual_seed(seed)  # the same elements on every device
    moved = bound.act(params, _elements(bound, condition, generator, next(iter(params.values()))))
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

    Returns
    -------
    torch.nn.Module
        The moved copy (:func:`transformed_copy`).

    Raises
    ------
    AssertionError
        If ``fn`` of the moved copy differs from ``fn(model)``.
    """
    other = transformed_copy(model, plan, condition=condition, seed=seed)
    torch.testing.assert_close(fn(other), fn(model), rtol=rtol, atol=atol)
    return other
