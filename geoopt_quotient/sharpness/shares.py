r"""Which blocks carry the maximiser: per-block shares of :math:`|\xi^*|^2` and of the
first-order loss increase.

The worst-case maximiser :math:`\xi^* = (\xi^*_g)_g` of one batch lives in the joint
ball :math:`|\xi|_w^2 = \sum_g |\xi_g|_{w_g}^2 \le \rho^2` of the plan's groups. Each
group's part splits further over the modules its point stacks (one attention layer's
heads, one MLP's hidden units), and its first-order loss increase

.. math::

    \langle \operatorname{grad} L(w), \xi^* \rangle_w
        = \sum_g \langle \operatorname{grad}_g L(w), \xi^*_g \rangle_{w_g},
    \qquad |\xi^*|_w^2 = \sum_g |\xi^*_g|_{w_g}^2,

splits the same way. :func:`maximiser_shares` computes both per (block, kind) from the
maximiser and the Riemannian gradient at :math:`w` that Auto-PGD computed anyway (its
first iterate's, :attr:`~geoopt_quotient.sharpness.BallMaxResult.initial_gradient`):
no extra forward or backward pass. A block is a numbered layer (``model.layers.3``) or,
outside the numbered layers, the module (``model.embed_tokens``, ``lm_head``). For a
geodesic measure both quantities are invariant under the symmetry group: the metric is
invariant and the maximiser and the gradient move with the weights.
"""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from ..symmetry.plan import BoundPlan
from .apgd import BallGroup

__all__ = ["block_of", "maximiser_shares", "mean_shares"]

_NUMBERED = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(name: str) -> str:
    """The block of a parameter or module name: up to its first numbered component
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``), else the module
    (``model.embed_tokens.weight`` -> ``model.embed_tokens``; ``bias`` -> ``bias``).

    Parameters
    ----------
    name : str
        A parameter's (or module's) dotted name.

    Returns
    -------
    str
        Its block.

    Examples
    --------
    >>> from geoopt_quotient.sharpness.shares import block_of
    >>> block_of("model.layers.3.mlp.up_proj.weight"), block_of("lm_head.weight")
    ('model.layers.3', 'lm_head')
    """
    numbered = _NUMBERED.match(name)
    if numbered:
        return numbered.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def _modules(param_names: Sequence[str]) -> List[str]:
    """The blocks of a group's parameters, in order, each once."""
    return list(dict.fromkeys(block_of(n) for n in param_names))


def _per_block(value: torch.Tensor, blocks: List[str]) -> List[Tuple[str, torch.Tensor]]:
    """A group's per-entry (or per-batch-element) values summed per block: the leading
    dimension is the blocks' when its size is their number, else the group is one."""
    if len(blocks) > 1 and value.dim() >= 1 and value.shape[0] == len(blocks):
        return list(zip(blocks, value.reshape(len(blocks), -1).sum(1)))
    return [(" + ".join(blocks) if len(blocks) > 1 else blocks[0], value.sum())]


def maximiser_shares(
    plan: BoundPlan,
    groups: Sequence[BallGroup],
    xi: Sequence[torch.Tensor],
    gradient: Sequence[torch.Tensor],
) -> List[Dict[str, float]]:
    r"""Per (block, kind): the maximiser's :math:`|\xi^*|^2` and first-order increase.

    Parameters
    ----------
    plan : BoundPlan
        The plan whose groups ``xi`` and ``gradient`` are given in.
    groups : sequence of BallGroup
        The ball's group of each plan group: base point and the manifold whose metric
        measures the ball.
    xi, gradient : sequence of torch.Tensor
        The maximiser and the Riemannian gradient at the base point, one tensor per plan
        group in its point's shape.

    Returns
    -------
    list of dict
        ``{"block", "kind", "norm_sq", "first_order"}`` per (block, kind), in the order
        first met; computed in float64, so that ``norm_sq`` sums to :math:`|\xi^*|_w^2`
        and ``first_order`` to :math:`\langle \operatorname{grad} L, \xi^* \rangle_w`
        to float64 rounding of the float64 products.
    """
    totals: Dict[Tuple[str, str], List[float]] = {}
    for group, ball, v, g in zip(plan.groups, groups, xi, gradient):
        point = ball.point.detach().double()
        v, g = v.detach().double(), g.detach().double()
        norm = ball.manifold.inner(point, v, v)
        first = ball.manifold.inner(point, g, v)
        blocks = _modules(group.param_names)
        for (block, n), (_, f) in zip(_per_block(norm, blocks), _per_block(first, blocks)):
            entry = totals.setdefault((block, group.kind), [0.0, 0.0])
            entry[0] += float(n)
            entry[1] += float(f)
    return [
        {"block": block, "kind": kind, "norm_sq": n, "first_order": f}
        for (block, kind), (n, f) in totals.items()
    ]


def mean_shares(per_batch: Sequence[Sequence[Mapping[str, float]]]) -> List[Dict[str, float]]:
    """The mean over batches of :func:`maximiser_shares` (the sharpness is the mean of
    the batches' values, and its shares are the mean of theirs).

    Parameters
    ----------
    per_batch : sequence of list of dict
        :func:`maximiser_shares` of each batch.

    Returns
    -------
    list of dict
        ``{"block", "kind", "norm_sq", "first_order"}`` per (block, kind).
    """
    totals: Dict[Tuple[str, str], List[float]] = {}
    for shares in per_batch:
        for row in shares:
            entry = totals.setdefault((row["block"], row["kind"]), [0.0, 0.0])
            entry[0] += row["norm_sq"] / len(per_batch)
            entry[1] += row["first_order"] / len(per_batch)
    return [
        {"block": block, "kind": kind, "norm_sq": n, "first_order": f}
        for (block, kind), (n, f) in totals.items()
    ]
