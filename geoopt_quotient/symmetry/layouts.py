"""Layout building blocks: how attention heads sit inside weight tensors.

Each function only slices, reshapes and concatenates, so it works on parameter values
and on index tensors alike (see :meth:`SymmetryGroup.from_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from geoopt.manifolds.base import Manifold

from ..manifolds import GLQuotient, PositiveScalingQuotient, RotaryGLQuotient
from .plan import SymmetryGroup

__all__ = [
    "PairSpec",
    "child_path",
    "head_columns",
    "head_rows",
    "linear_child",
    "stack_pairs",
]


def child_path(path: str, name: str) -> str:
    """The full name of ``name`` inside the module at ``path`` (``""``: the root).

    Parameters
    ----------
    path : str
        A module path as in ``model.named_modules()``.
    name : str
        A child or parameter name, relative to it.

    Returns
    -------
    str
        ``"path.name"``, or ``name`` for the root.
    """
    return f"{path}.{name}" if path else name


def linear_child(module: torch.nn.Module, name: str) -> torch.nn.Linear | None:
    """The child ``name`` of ``module`` if it is an ``nn.Linear``, else ``None``.

    Parameters
    ----------
    module : torch.nn.Module
        The parent module.
    name : str
        The attribute name of the child (``"q_proj"``).

    Returns
    -------
    torch.nn.Linear or None
        The child, or ``None`` when it is missing or of another class.
    """
    child = getattr(module, name, None)
    return child if isinstance(child, torch.nn.Linear) else None


def head_rows(
    weight: torch.Tensor,
    num_heads: int,
    head_dim: int,
    bias: torch.Tensor | None = None,
    extra_rows: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Per-head factors ``(heads, in [+1 +extra], head_dim)`` of an ``(out, in)`` projection.

    Head ``i`` is ``weight[i*hd:(i+1)*hd].T`` with the bias slice appended as a row,
    then any extra per-head rows (e.g. ``bias_k`` of ``nn.MultiheadAttention``).

    Parameters
    ----------
    weight : torch.Tensor
        Projection weight of shape ``(num_heads * head_dim, in)`` (``nn.Linear``
        layout: output rows).
    num_heads : int
        Number of heads.
    head_dim : int
        Size ``hd`` of each head.
    bias : torch.Tensor or None
        Projection bias of shape ``(num_heads * head_dim,)``, appended as one row per
        head; ``None``: no bias row.
    extra_rows : sequence of torch.Tensor
        Further tensors of ``num_heads * head_dim`` entries, each appended as one more
        row per head.

    Returns
    -------
    torch.Tensor
        Shape ``(num_heads, in + [1] + len(extra_rows), head_dim)``, built by views and
        concatenation only (it works on index tensors too).
    """
    parts = [weight.reshape(num_heads, head_dim, -1).mT]
    if bias is not None:
        parts.append(bias.reshape(num_heads, 1, head_dim))
    parts.extend(r.reshape(num_heads, 1, head_dim) for r in extra_rows)
    return torch.cat(parts, dim=-2)


def head_columns(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Per-head factors ``(heads, out, head_dim)`` of an output projection ``(out, heads*hd)``.

    Parameters
    ----------
    weight : torch.Tensor
        Output projection weight of shape ``(out, num_heads * head_dim)``: head ``i``
        reads columns ``i*hd:(i+1)*hd``.
    num_heads : int
        Number of heads.
    head_dim : int
        Size ``hd`` of each head.

    Returns
    -------
    torch.Tensor
        Shape ``(num_heads, out, head_dim)``, a view of ``weight``.
    """
    return weight.reshape(weight.shape[0], num_heads, head_dim).permute(1, 0, 2)


@dataclass
class PairSpec:
    """One attention module's GL(h) pair for every head.

    ``layout(*params)`` returns the ``(heads, n + m, h)`` point from the parameters
    named in ``params`` (name -> shape), in order.

    Parameters
    ----------
    kind : str
        ``"query-key"`` or ``"value-output"`` (specs of one kind and shape are stacked).
    module : str
        Path of the attention module in the model (used in labels).
    params : dict of str to torch.Size
        The parameters the layout reads, by full name, with their shapes, in the order
        of ``layout``'s arguments.
    layout : callable
        ``layout(*tensors) -> torch.Tensor`` of shape ``(num_heads, n + m, head_dim)``,
        built with indexing, views and concatenation only
        (see :meth:`SymmetryGroup.from_layout`).
    n, m : int
        Rows of the factors :math:`G` and :math:`H` of each head (of
        :class:`~geoopt_quotient.GLQuotient`).
    head_dim : int
        The rank :math:`h` of each pair.
    num_heads : int
        Number of pairs (heads) in the point.
    rotary_dim : int
        Rotating dimensions of each head (0: none, the group is GL(h); otherwise the
        group is the rotary-commuting subgroup of :class:`~geoopt_quotient.RotaryGLQuotient`).
    pairing : {"half", "interleaved"}
        How a rotary embedding pairs the dimensions (with ``rotary_dim > 0``).
    positive : bool
        Only positive scalings act (rank-one pairs of ReLU units:
        :class:`~geoopt_quotient.PositiveScalingQuotient`).
    label : str
        Which symmetry of its kind the pair is, where the kind alone does not say (e.g.
        ``"diagonal"`` for V/O's diagonal subgroup under an output gate); shown in the
        group's name, and specs with different labels are never stacked together.
    """

    kind: str
    module: str
    params: Dict[str, torch.Size]
    layout: Callable[..., torch.Tensor]
    n: int
    m: int
    head_dim: int
    num_heads: int
    rotary_dim: int = 0
    pairing: str = "half"
    positive: bool = False
    label: str = ""

    @property
    def signature(self) -> Tuple:
        rotary = (self.rotary_dim, self.pairing) if self.rotary_dim else ()
        sign = ("positive",) if self.positive else ()
        named = (self.label,) if self.label else ()
        return (self.kind, self.n, self.m, self.head_dim, self.num_heads, *rotary, *sign, *named)

    def manifold(self, metric: str, eps: float) -> Manifold:
        """The quotient of this pair: GL(h), or its rotary-commuting subgroup."""
        if self.rotary_dim:
            return RotaryGLQuotient(self.n, self.m, self.rotary_dim, self.pairing, metric, eps)
        if self.positive:
            return PositiveScalingQuotient(self.n, self.m, metric, eps)
        return GLQuotient(self.n, self.m, metric, eps)


def stack_pairs(
    specs: Sequence[PairSpec], metric: str, eps: float, manifold: Manifold | None = None
) -> List[SymmetryGroup]:
    """One batched group per set of specs with equal shapes: ``(modules, heads, n+m, h)``.

    Parameters
    ----------
    specs : sequence of PairSpec
        The pairs; specs with the same kind, ``n``, ``m``, ``head_dim`` and
        ``num_heads`` are stacked along a new leading dimension, in order.
    metric : {"mix", "inv"}
        Metric of the groups' :class:`~geoopt_quotient.GLQuotient`.
    eps : float
        Relaxation of the quotients' Gram matrices.
    manifold : geoopt.manifolds.Manifold or None
        A manifold for every group instead of ``GLQuotient(n, m, metric, eps)``.

    Returns
    -------
    list of SymmetryGroup
        One group per shape, with ``count`` the number of heads stacked.
    """
    buckets: Dict[Tuple, List[PairSpec]] = {}
    for spec in specs:
        buckets.setdefault(spec.signature, []).append(spec)
    groups = []
    for members in buckets.values():
        kind, num_heads = members[0].kind, members[0].num_heads
        params: Dict[str, torch.Size] = {}
        arity = []
        for spec in members:
            params.update(spec.params)
            arity.append(len(spec.params))

        def layout(*tensors, members=members, arity=arity):
            points, start = [], 0
            for spec, k in zip(members, arity):
                points.append(spec.layout(*tensors[start : start + k]))
                start += k
            return torch.stack(points)

        label = (
            members[0].module
            if len(members) == 1
            else (f"{members[0].module} .. {members[-1].module} ({len(members)} modules)")
        )
        which = f"{kind}: {members[0].label}" if members[0].label else kind
        groups.append(
            SymmetryGroup.from_layout(
                f"{label} [{which}]",
                manifold or members[0].manifold(metric, eps),
                params,
                layout,
                kind=kind,
                count=len(members) * num_heads,
            )
        )
    return groups
