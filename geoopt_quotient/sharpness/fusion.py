r"""Many small ball groups as few: element-wise groups as one flat group, quotient groups
of one geometry as one batch.

A model's ball has one group per parameter tensor left to the adaptive geometry and one
per symmetry group, and Auto-PGD applies every operation of the metric (norm, gradient
conversion, projection, path) group by group. On small tensors (biases, LayerNorm
weights, every tensor of a small model) the cost of those calls is Python and dispatch
overhead, not arithmetic: a tiny ViT's adaptive iteration spent longer in the geometry
of its 40 tensors than in its forward pass, and its two GL(h) groups (query-key and
value-output) each paid the dozens of small operations of the quotient geometry.

**Element-wise groups.** For an element-wise metric the ball does not see the grouping:
with :math:`x = (x_1, \dots, x_k)` concatenated,

.. math::

    |\xi|_x^2 = \sum_i \sum_j \frac{\xi_{ij}^2}{c(x_{ij})^2}, \qquad
    \gamma_x(\xi)_i = \gamma_{x_i}(\xi_i),

so the groups are fused into one flat point (a copy of the fused entries, bounded by
:data:`MAX_FUSED_ENTRIES`). Each tensor starts at a multiple of
:data:`~geoopt_quotient.sharpness.apgd.ALIGNMENT` bytes, as a tensor of its own would:
the perturbed parameters are views of the flat point, and a weight that starts
mid-cache-line slows the model's products (measured on the tiny ViT: 0.25 ms of a 4.4 ms
forward pass). The gaps are zero and stay zero (below).

**Quotient groups.** :class:`~geoopt_quotient.GLQuotient` acts on a batch of
:math:`(n + m) \times h` pairs, each point independently, and the ball's metric is the
sum over the batch. Groups with the same :math:`n`, rank :math:`h` and geometry are
stacked into one batch; a group with fewer :math:`H` rows :math:`m_i < m` is padded with
zero rows at the end. A zero row of :math:`H` changes neither :math:`H^\top H` nor any
product with it, and every operation of the geometry keeps it zero: the gradient there
is zero (no parameter is attached), and the Riemannian gradient, the horizontal
projection, the retraction and its pullback, the Christoffel term and the Auto-PGD
combination are all of the form (row of :math:`H`, of :math:`\xi_H` or of the cotangent)
times an :math:`h \times h` matrix. The tiny ViT's query-key (:math:`33 + 33` rows) and
value-output (:math:`33 + 32`) groups become one batch of 16 heads.

Both fusions hold for iterates that start at zero, as the worst case's do: a random
start would draw noise into the gaps. Results differ from the per-group computation
only in the order of sums (float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from ..manifolds import AdaptiveEuclidean, GLQuotient
from .apgd import ALIGNMENT, BallGroup

__all__ = [
    "MAX_ENTRIES_PER_TENSOR",
    "MAX_FUSED_ENTRIES",
    "FusedBall",
    "fuse_elementwise",
    "fuse_groups",
    "fuse_quotients",
]

#: Tensors up to this size are fused: above it, the per-call overhead is small next to
#: the tensor's own memory traffic, and fusing would only copy it.
MAX_ENTRIES_PER_TENSOR = 1 << 16
#: The fused copy of the points holds at most this many entries per dtype and device.
MAX_FUSED_ENTRIES = 1 << 24


@dataclass
class _Flat:
    """Members concatenated into one flat point, each starting at an aligned offset."""

    members: List[int]
    shapes: List[torch.Size]
    chunks: List[int]  # split sizes along the flat point: member, gap, member, gap...

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        pieces = flat.split(self.chunks)[::2]
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]


@dataclass
class _Stacked:
    """Members stacked along the batch of one quotient point, with zero rows at the end
    of the shorter ones."""

    members: List[int]
    shapes: List[torch.Size]
    counts: List[int]  # points in each member's (flattened) batch

    def split(self, stacked: torch.Tensor) -> List[torch.Tensor]:
        out = []
        for piece, shape in zip(stacked.split(self.counts), self.shapes):
            rows = shape[-2]
            out.append((piece if rows == piece.shape[-2] else piece[:, :rows]).view(shape))
        return out


@dataclass
class FusedBall:
    """The ball's groups with the fusible ones merged, and the way back.

    Attributes
    ----------
    groups : list of BallGroup
        The groups that were not fused, in their order, then one group per fusion.
    """

    groups: List[BallGroup]
    _kept: List[int]
    _fused: List[_Flat | _Stacked]
    _count: int

    def unfuse(self, points: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Per-group points, in the original groups' order, from points of :attr:`groups`
        (views: differentiable, and the gaps get no gradient)."""
        out: List[torch.Tensor | None] = [None] * self._count
        for index, point in zip(self._kept, points):
            out[index] = point
        for fusion, fused in zip(self._fused, points[len(self._kept) :]):
            for index, piece in zip(fusion.members, fusion.split(fused)):
                out[index] = piece
        return out  # type: ignore[return-value]


def _small(group: BallGroup) -> bool:
    point = group.point
    return (
        group.path is None and point.numel() <= MAX_ENTRIES_PER_TENSOR and not point.requires_grad
    )


def _elementwise_key(group: BallGroup) -> Tuple | None:
    """Groups with equal keys can share one flat point (the key starts with the function
    that builds it); ``None``: never fused."""
    manifold = group.manifold
    if type(manifold) is not AdaptiveEuclidean or manifold.ndim != 0 or not _small(group):
        return None
    return _flat_group, group.point.dtype, group.point.device, manifold.eps


def _quotient_key(group: BallGroup) -> Tuple | None:
    """Groups with equal keys can share one batch (the key starts with the function
    that builds it); ``None``: never fused."""
    manifold = group.manifold
    if type(manifold) is not GLQuotient or not _small(group):
        return None
    point = group.point
    return (
        _stacked_group,
        point.dtype,
        point.device,
        point.shape[-1],
        manifold.n,
        manifold.metric,
        manifold.eps,
        manifold.retraction,
        manifold.expmap_steps,
    )


def _flat_group(groups: Sequence[BallGroup], members: List[int]) -> Tuple[BallGroup, _Flat]:
    points = [groups[i].point for i in members]
    step = max(ALIGNMENT // points[0].dtype.itemsize, 1)
    chunks: List[int] = []
    for point in points:
        size = point.numel()
        chunks += [size, -size % step]
    chunks[-1] = 0  # no gap after the last
    flat = torch.zeros(sum(chunks), dtype=points[0].dtype, device=points[0].device)
    fusion = _Flat(members, [p.shape for p in points], chunks)
    for piece, point in zip(fusion.split(flat), points):
        piece.copy_(point)
    return BallGroup(flat, AdaptiveEuclidean(eps=groups[members[0]].manifold.eps)), fusion


def _stacked_group(groups: Sequence[BallGroup], members: List[int]) -> Tuple[BallGroup, _Stacked]:
    points = [groups[i].point for i in members]
    first: GLQuotient = groups[members[0]].manifold
    m = max(groups[i].manifold.m for i in members)
    rank = points[0].shape[-1]
    counts = [p.numel() // (p.shape[-2] * rank) for p in points]
    stacked = torch.zeros(
        sum(counts), first.n + m, rank, dtype=points[0].dtype, device=points[0].device
    )
    fusion = _Stacked(members, [p.shape for p in points], counts)
    for piece, point in zip(fusion.split(stacked), points):
        piece.copy_(point)
    manifold = GLQuotient(
        first.n,
        m,
        first.metric,
        first.eps,
        retraction=first.retraction,
        expmap_steps=first.expmap_steps,
    )
    return BallGroup(stacked, manifold), fusion


def _fuse(groups: Sequence[BallGroup], keys: Sequence[Callable]) -> FusedBall:
    """Each set of at least two groups with the same key (of the first of the key
    functions ``keys`` that gives one) merged into one group by the builder the key
    starts with, up to :data:`MAX_FUSED_ENTRIES` entries."""
    candidates: Dict[Tuple, List[int]] = {}
    for index, group in enumerate(groups):
        for key_of in keys:
            key = key_of(group)
            if key is not None:
                candidates.setdefault(key, []).append(index)
                break
    fused, new_groups = [], []
    for key, members in candidates.items():
        chosen, total = [], 0
        for index in members:
            size = groups[index].point.numel()
            if total + size <= MAX_FUSED_ENTRIES:
                chosen.append(index)
                total += size
        if len(chosen) < 2:
            continue
        build = key[0]
        group, fusion = build(groups, chosen)
        new_groups.append(group)
        fused.append(fusion)
    merged = {i for f in fused for i in f.members}
    kept = [i for i in range(len(groups)) if i not in merged]
    return FusedBall([groups[i] for i in kept] + new_groups, kept, fused, len(groups))


def fuse_elementwise(groups: Sequence[BallGroup]) -> FusedBall:
    """Fuse the small :class:`~geoopt_quotient.AdaptiveEuclidean` groups (element-wise
    metric, the ball's own path) that share dtype, device and :math:`\\varepsilon` into
    one flat group each. A set of fewer than two such groups is left alone."""
    return _fuse(groups, [_elementwise_key])


def fuse_quotients(groups: Sequence[BallGroup]) -> FusedBall:
    """Stack the small :class:`~geoopt_quotient.GLQuotient` groups (the ball's own path)
    that share dtype, device, :math:`n`, :math:`h` and geometry (metric, ``eps``,
    retraction) into one batch each, the shorter :math:`H` padded with zero rows. A set
    of fewer than two such groups is left alone."""
    return _fuse(groups, [_quotient_key])


def fuse_groups(groups: Sequence[BallGroup]) -> FusedBall:
    """Both fusions at once (:func:`fuse_elementwise` and :func:`fuse_quotients`)."""
    return _fuse(groups, [_elementwise_key, _quotient_key])
