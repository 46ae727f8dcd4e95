r"""Writing manifold points back into parameters with strided copies, not index maps.

A symmetry group's point is a rearrangement of parameter entries: the query/key pair of
head :math:`j` of a BERT layer is :math:`[W_q^\top; b_q; W_k^\top; b_k]` restricted to
the head's rows. Each model evaluation writes the perturbed points back into parameter
tensors and its backward pass reads the parameters' gradients back into the points'
shapes. An index map does both in general, at the price of reading one integer per
entry, of a zero-filled gradient buffer and of a concatenation of all points first.

The layouts of real architectures are regular: within a parameter, the entries of one
point sit at positions that are an affine function of the parameter's index, once its
dimensions are split suitably, e.g. :math:`W_q \in \mathbb R^{768 \times 768}` seen as
``(12, 64, 768)`` (head, row in head, input) with strides ``(1538 * 64, 1, 64)`` into
the ``(12, 12, 1538, 64)`` point. :func:`strided_layout` finds such a description for
every piece of every parameter, or reports that there is none; :func:`write_back` then
copies each piece with one strided copy each way, and is differentiable to any order
(its backward is the adjoint copy, itself differentiable).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = ["Piece", "StridedLayout", "affine_split", "strided_layout", "write_back"]

#: A parameter split into more pieces than this is left to the index map.
MAX_PIECES_PER_PARAMETER = 64
#: Layouts with fewer entries per piece, on average, are left to the index map: each
#: piece costs a few Python-level tensor operations each way (about 12 us on a CPU),
#: against about 3 ns per entry that the strided copy saves over the index map; so the
#: two break even near 4,000 entries (``benchmarks/bench_small_kernels.py``, 1 thread: on
#: the tiny ViT of ``reproduce transformers``, 600 entries a piece, strided 0.44 ms and
#: index map 0.29 ms per write-back and its backward; on a 4-layer BERT of hidden size
#: 256, 37,600 a piece, 3.7 ms against 7.1 ms).
MIN_ENTRIES_PER_PIECE = 4096
#: Dimensions of one piece's strided view at most (``as_strided`` handles any number;
#: more means an irregular layout, for which the copy would be slow).
MAX_DIMS = 8


@dataclass(frozen=True)
class Piece:
    """Entries ``start : start + numel`` of a parameter (flattened) are the view
    ``points[source].as_strided(shape, strides, offset)`` of a source point."""

    source: int
    start: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StridedLayout:
    """Where every entry of the parameters ``names`` comes from in the source points."""

    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    pieces: Tuple[Tuple[Piece, ...], ...]
    source_shapes: Tuple[torch.Size, ...]

    @functools.cached_property
    def entries_per_piece(self) -> float:
        """The mean size of a piece (computed once: every write-back asks for it)."""
        pieces = sum(len(p) for p in self.pieces)
        return sum(s.numel() for s in self.shapes) / max(pieces, 1)

    def to_parameters(self, points: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """New parameter tensors with the points' entries copied in (no autograd)."""
        points = [p.contiguous() for p in points]
        out = []
        for shape, pieces in zip(self.shapes, self.pieces):
            source = points[pieces[0].source]
            flat = torch.empty(shape.numel(), dtype=source.dtype, device=source.device)
            for piece in pieces:
                target = flat[piece.start : piece.start + piece.numel].view(piece.shape)
                target.copy_(_view(points[piece.source], piece))
            out.append(flat.view(shape))
        return out

    def to_points(self, parameters: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """New point tensors with the parameters' entries copied in (no autograd)."""
        reference = parameters[0]
        out = [
            torch.empty(shape, dtype=reference.dtype, device=reference.device)
            for shape in self.source_shapes
        ]
        for parameter, pieces in zip(parameters, self.pieces):
            flat = parameter.reshape(-1)
            for piece in pieces:
                source = flat[piece.start : piece.start + piece.numel].view(piece.shape)
                _view(out[piece.source], piece).copy_(source)
        return out


def _view(point: torch.Tensor, piece: Piece) -> torch.Tensor:
    return point.as_strided(piece.shape, piece.strides, point.storage_offset() + piece.offset)


class _StridedCopy(torch.autograd.Function):
    """Points to parameters (``to_parameters``) or back; the backward of either
    direction is the other, so the copy is differentiable to any order."""

    @staticmethod
    def forward(ctx, layout: StridedLayout, to_parameters: bool, *tensors: torch.Tensor):
        ctx.layout, ctx.to_parameters = layout, to_parameters
        copy = layout.to_parameters if to_parameters else layout.to_points
        return tuple(copy(tensors))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, None, *_StridedCopy.apply(ctx.layout, not ctx.to_parameters, *grads))


def write_back(layout: StridedLayout, points: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The parameters ``layout.names`` assembled from ``points`` (differentiable: the
    backward pass copies the parameters' gradients into the points' shapes)."""
    tensors = _StridedCopy.apply(layout, True, *points)
    return dict(zip(layout.names, tensors))


def affine_split(positions: torch.Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]] | None:
    r"""Row-major dimensions :math:`(d_1, \dots, d_k)` of a 1-D integer tensor and strides
    :math:`(s_1, \dots, s_k)` with ``positions[flat(i)] = positions[0] + sum_j s_j i_j``,
    or ``None`` if there are none with positive strides and at most :data:`MAX_DIMS`
    dimensions.

    Innermost first: the longest run of equal differences from the start gives
    :math:`d_k` and :math:`s_k`; every row of that length must then be such a run, and
    the rows' first entries are split in turn.
    """
    rest = positions - positions[0]
    dims: List[int] = []
    strides: List[int] = []
    while rest.numel() > 1:
        if len(dims) == MAX_DIMS:
            return None
        diffs = rest[1:] - rest[:-1]
        stride = int(diffs[0])
        breaks = (diffs != stride).nonzero()
        run = int(breaks[0, 0]) + 1 if breaks.numel() else rest.numel()
        if stride <= 0 or rest.numel() % run:
            return None
        rows = rest.view(-1, run)
        expected = rows[:, :1] + stride * torch.arange(run, dtype=rows.dtype)
        if not torch.equal(rows, expected):
            return None
        dims.insert(0, run)
        strides.insert(0, stride)
        rest = rows[:, 0].contiguous()
    if not dims:
        dims, strides = [1], [1]
    return tuple(dims), tuple(strides)


def strided_layout(
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    source_shapes: Sequence[torch.Size],
    permutation: torch.Tensor,
) -> StridedLayout | None:
    """The strided description of a write-back, or ``None`` where one piece has none.

    ``permutation[k]`` is the position, in the concatenation of the flattened source
    points, of entry ``k`` of the concatenation of the flattened parameters.
    """
    sizes = torch.tensor([s.numel() for s in source_shapes])
    starts = torch.cumsum(sizes, 0) - sizes
    all_pieces = []
    begin = 0
    for shape in shapes:
        positions = permutation[begin : begin + shape.numel()].long()
        begin += shape.numel()
        pieces = _pieces(positions, starts)
        if pieces is None:
            return None
        all_pieces.append(pieces)
    return StridedLayout(
        tuple(names),
        tuple(torch.Size(s) for s in shapes),
        tuple(all_pieces),
        tuple(torch.Size(s) for s in source_shapes),
    )


def _pieces(positions: torch.Tensor, starts: torch.Tensor) -> Tuple[Piece, ...] | None:
    """One parameter's pieces: maximal runs of entries from one source, each affine."""
    source = torch.searchsorted(starts, positions, right=True) - 1
    changes = (source[1:] != source[:-1]).nonzero().reshape(-1) + 1
    bounds = [0, *changes.tolist(), positions.numel()]
    if len(bounds) - 1 > MAX_PIECES_PER_PARAMETER:
        return None
    pieces = []
    for lo, hi in pairwise(bounds):
        which = int(source[lo])
        local = positions[lo:hi] - int(starts[which])
        split = affine_split(local)
        if split is None:
            return None
        pieces.append(Piece(which, lo, split[0], split[1], int(local[0])))
    return tuple(pieces)
