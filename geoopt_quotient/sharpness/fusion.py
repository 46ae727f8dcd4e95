r"""Many small element-wise ball groups as one flat group.

A model's ball has one group per parameter tensor left to the adaptive geometry, and
Auto-PGD applies every operation of the metric (norm, gradient conversion, projection,
path) group by group. On small tensors (biases, LayerNorm weights, or every tensor of a
small model) the cost of those calls is Python and dispatch overhead, not arithmetic:
a tiny ViT's adaptive iteration spent longer in the geometry of its 40 tensors than in
its forward pass.

For an element-wise metric the ball does not see the grouping: with
:math:`x = (x_1, \dots, x_k)` concatenated,

.. math::

    |\xi|_x^2 = \sum_i \sum_j \frac{\xi_{ij}^2}{c(x_{ij})^2}, \qquad
    \gamma_x(\xi)_i = \gamma_{x_i}(\xi_i),

so the groups are fused into one flat point (a copy of the fused entries, bounded by
:data:`MAX_FUSED_ENTRIES`), and the perturbed flat point is split back into views of
the parameters' shapes (``split``: its backward is one ``cat``). The result differs from
the per-group computation only in the order of the sums in the norms (float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from ..manifolds import AdaptiveEuclidean
from .apgd import BallGroup

__all__ = ["MAX_ENTRIES_PER_TENSOR", "MAX_FUSED_ENTRIES", "FusedBall", "fuse_elementwise"]

#: Tensors up to this size are fused: above it, the per-call overhead is small next to
#: the tensor's own memory traffic, and fusing would only copy it.
MAX_ENTRIES_PER_TENSOR = 1 << 16
#: The fused copy of the points holds at most this many entries per dtype and device.
MAX_FUSED_ENTRIES = 1 << 24


@dataclass
class _Fused:
    members: List[int]
    shapes: List[torch.Size]

    @property
    def sizes(self) -> List[int]:
        return [s.numel() for s in self.shapes]


@dataclass
class FusedBall:
    """The ball's groups with the fusible ones merged, and the way back.

    Attributes
    ----------
    groups : list of BallGroup
        The groups that were not fused, in their order, then one flat group per fusion.
    """

    groups: List[BallGroup]
    _kept: List[int]
    _fused: List[_Fused]
    _count: int

    def unfuse(self, points: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Per-group points, in the original groups' order, from points of :attr:`groups`."""
        out: List[torch.Tensor | None] = [None] * self._count
        for index, point in zip(self._kept, points):
            out[index] = point
        for fusion, flat in zip(self._fused, points[len(self._kept) :]):
            pieces = flat.split(fusion.sizes)
            for index, shape, piece in zip(fusion.members, fusion.shapes, pieces):
                out[index] = piece.view(shape)
        return out  # type: ignore[return-value]


def _fusion_key(group: BallGroup) -> Tuple | None:
    """Groups with equal keys can share one flat point; ``None``: never fused."""
    manifold = group.manifold
    if type(manifold) is not AdaptiveEuclidean or manifold.ndim != 0 or group.path is not None:
        return None
    point = group.point
    if point.numel() > MAX_ENTRIES_PER_TENSOR or point.requires_grad:
        return None
    return point.dtype, point.device, manifold.eps


def fuse_elementwise(groups: Sequence[BallGroup]) -> FusedBall:
    """Fuse the small :class:`~geoopt_quotient.AdaptiveEuclidean` groups (element-wise
    metric, the ball's own path) that share dtype, device and :math:`\\varepsilon`.

    A set of fewer than two such groups is left alone.
    """
    candidates: Dict[Tuple, List[int]] = {}
    for index, group in enumerate(groups):
        key = _fusion_key(group)
        if key is not None:
            candidates.setdefault(key, []).append(index)
    fused: List[_Fused] = []
    flat_groups: List[BallGroup] = []
    for (_, _, eps), members in candidates.items():
        chosen, total = [], 0
        for index in members:
            size = groups[index].point.numel()
            if total + size <= MAX_FUSED_ENTRIES:
                chosen.append(index)
                total += size
        if len(chosen) < 2:
            continue
        points = [groups[i].point.reshape(-1) for i in chosen]
        flat_groups.append(BallGroup(torch.cat(points), AdaptiveEuclidean(eps=eps)))
        fused.append(_Fused(chosen, [groups[i].point.shape for i in chosen]))
    merged = {i for f in fused for i in f.members}
    kept = [i for i in range(len(groups)) if i not in merged]
    return FusedBall([groups[i] for i in kept] + flat_groups, kept, fused, len(groups))
