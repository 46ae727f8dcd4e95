r"""Structured layouts: a manifold point as boxes of strided parameter views.

A layout (see :meth:`~geoopt_quotient.symmetry.SymmetryGroup.from_layout`) builds a
point from parameters with views, transposes, reshapes, indexing and concatenation
only. Applied to integer tensors it gives an index map, one integer per entry: on a
7B-parameter model that is gigabytes, and seconds per layer to build and check. The same
map has a short description. The point is tiled by axis-aligned *boxes*; the entries of
one box are a strided view of one parameter,

.. math::

    \text{point}[s + i] = \text{param}_k\big[o + \textstyle\sum_d \sigma_d i_d\big],
    \qquad 0 \le i < n,

with box start :math:`s`, shape :math:`n`, strides :math:`\sigma` and offset :math:`o`
into the flattened parameter. :func:`trace` finds the boxes by running the layout on
*probes* that record them (the parameter side as :class:`StridedView`: shape, strides
and offset, no data), at a cost that grows with the number of boxes (about one per tensor and
head), not with the number of entries. Everything a plan needs follows from the boxes:
gathering and scattering (strided copies), whether entries repeat or two groups overlap
(sorted runs of each parameter's flat positions), the write-back as strided copies
(:func:`strided_pieces`), and the index map itself, built only where a consumer asks
for it. A layout the probes cannot follow (arithmetic, boolean masks, ...) makes
:func:`trace` return ``None``, and the caller builds the index map as before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from itertools import pairwise
from typing import Dict, List, Sequence, Tuple

import torch

from .strided import MAX_PIECES_PER_PARAMETER, Piece, affine_split

__all__ = ["Block", "PointStructure", "StridedView", "affine_grid", "trace"]

#: A layout cut into more boxes than this is left to the index map.
MAX_BLOCKS = 1 << 16
#: A parameter whose boxes make more runs of consecutive entries than this has its
#: overlap checked on a mask of its entries instead.
MAX_RUNS = 1 << 20
#: A box with at most this many runs lists them as Python integers (a few tensor
#: operations per box would cost more than the arithmetic).
SMALL_RUNS = 256


class _Unsupported(Exception):
    """The probes cannot follow an operation of the layout."""


@dataclass(frozen=True)
class Block:
    """Box ``start : start + shape`` of a point: a strided view of parameter ``param``.

    Parameters
    ----------
    param : int
        Position of the parameter among the group's parameters.
    start : tuple of int
        The box's first entry in the point.
    shape : tuple of int
        The box's shape.
    strides : tuple of int
        Strides of the view into the flattened parameter.
    offset : int
        Flat position in the parameter of the box's first entry.
    """

    param: int
    start: Tuple[int, ...]
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    offset: int

    @property
    def box(self) -> Tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.shape))

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The box's entries, a strided view of a flattened parameter."""
        return flat.as_strided(self.shape, self.strides, flat.storage_offset() + self.offset)

    def runs(self) -> Tuple[torch.Tensor | List[int], int] | None:
        """(first positions, length) of the runs of consecutive parameter positions the
        box covers, in increasing order (a list where there are at most
        :data:`SMALL_RUNS`, else a tensor); ``None`` if its view may repeat an entry or
        makes more than :data:`MAX_RUNS` runs."""
        dims = sorted((s, n) for s, n in zip(self.strides, self.shape) if n > 1)
        merged: List[List[int]] = []
        for stride, size in dims:  # innermost first
            if merged and merged[-1][0] * merged[-1][1] == stride:
                merged[-1][1] *= size
            else:
                merged.append([stride, size])
        reach = 0
        for stride, size in merged:
            if stride <= reach:
                return None  # the view may repeat an entry
            reach += stride * (size - 1)
        length = 1
        if merged and merged[0][0] == 1:
            length = merged.pop(0)[1]
        count = math.prod(size for _, size in merged)
        if count > MAX_RUNS:
            return None
        if count <= SMALL_RUNS:  # a few runs: Python integers cost less than tensor ops
            starts = [self.offset]
            for stride, size in reversed(merged):  # outermost first: increasing order
                starts = [first + stride * i for first in starts for i in range(size)]
            return starts, length
        found = torch.tensor([self.offset], dtype=torch.long)
        for stride, size in reversed(merged):
            found = (found[:, None] + stride * torch.arange(size)).reshape(-1)
        return found, length


@dataclass(frozen=True)
class PointStructure:
    """A point of shape :attr:`shape` tiled by :attr:`blocks` (see :class:`Block`)."""

    shape: torch.Size
    blocks: Tuple[Block, ...]

    @functools.cached_property
    def tiles(self) -> Tuple[Tuple[Tuple[Block, ...], int], ...]:
        """The blocks in ``(blocks, step)`` tiles: blocks alike but for their parameter,
        whose boxes follow each other along the point's first dimension ``step`` apart,
        e.g. one block of every layer of a group stacked over layers. A tile is one
        strided view of the point (:meth:`tile_view`), whatever its number of blocks."""
        if not self.shape:  # a scalar: one box
            return tuple(((block,), 1) for block in self.blocks)
        alike: Dict[Tuple, List[Block]] = {}
        for block in self.blocks:
            key = (block.shape, block.strides, block.offset, block.start[1:])
            alike.setdefault(key, []).append(block)
        out = []
        for blocks in alike.values():
            blocks.sort(key=lambda b: b.start[0])
            run = [blocks[0]]
            for block in blocks[1:]:
                step = block.start[0] - run[-1].start[0]
                if len(run) > 1 and step != run[1].start[0] - run[0].start[0]:
                    out.append((tuple(run), _step(run)))
                    run = []
                run.append(block)
            out.append((tuple(run), _step(run)))
        return tuple(out)

    def gather(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The point, read from the group's parameters in order (differentiable; without
        gradients, one copy per tile of several blocks, :attr:`tiles`, and one foreach
        copy of all the other boxes)."""
        dense = [t if t.is_contiguous() else t.reshape(-1) for t in tensors]
        out = torch.empty(self.shape, dtype=_common_dtype(dense), device=dense[0].device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in dense):
            for block in self.blocks:
                out[block.box].copy_(block.view(dense[block.param]))
            return out
        targets, sources = [], []
        for blocks, step in self.tiles:
            views = [block.view(dense[block.param]) for block in blocks]
            if len(views) > 1:  # stack casts each view up to the point's dtype
                torch.stack(views, out=self.tile_view(out, blocks, step))
            else:
                targets += [self.box_view(out, block) for block in blocks]
                sources += views
        if targets:
            torch._foreach_copy_(targets, sources)
        return out

    @staticmethod
    def box_view(point: torch.Tensor, block: Block) -> torch.Tensor:
        """The box of ``block`` in ``point``, one strided view (no slice per dimension)."""
        return point.as_strided(block.shape, point.stride(), _box_start(point, block))

    @staticmethod
    def tile_view(point: torch.Tensor, blocks: Sequence[Block], step: int) -> torch.Tensor:
        """The boxes of a tile (:attr:`tiles`) in ``point``: one strided view, its first
        dimension the tile's blocks."""
        first = blocks[0]
        return point.as_strided(
            (len(blocks), *first.shape),
            (step * point.stride(0), *point.stride()),
            _box_start(point, first),
        )

    def positions(self, starts: Sequence[int], size: int, device) -> torch.Tensor:
        """Each entry's position in a flat buffer of ``size`` entries where parameter
        ``k``'s flattened entries start at ``starts[k]``: one ``arange`` and one foreach
        copy, and a view per tile (:attr:`tiles`) whose parameters start equally far
        apart, as the layers of a stack laid out alike do (a view per block in others)."""
        everything = torch.arange(size, device=device)
        out = torch.empty(self.shape, dtype=torch.long, device=device)
        targets, sources = [], []
        for blocks, step in self.tiles:
            first = blocks[0]
            begins = [starts[b.param] + b.offset for b in blocks]
            apart = begins[1] - begins[0] if len(begins) > 1 else -1
            if apart >= 0 and all(b - a == apart for a, b in pairwise(begins)):
                targets.append(self.tile_view(out, blocks, step))
                shape, strides = (len(blocks), *first.shape), (apart, *first.strides)
                sources.append(everything.as_strided(shape, strides, begins[0]))
                continue
            for block, begin in zip(blocks, begins):
                targets.append(self.box_view(out, block))
                sources.append(everything.as_strided(block.shape, block.strides, begin))
        torch._foreach_copy_(targets, sources)
        return out

    def box_entries(
        self, lo: Sequence[int], shape: Sequence[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """For the point's entries ``lo : lo + shape``: the parameter each comes from and
        its position in that flattened parameter (``torch.long``, shape ``shape`` each),
        each block's part of the box filled from its strides, with no tensor of the whole
        point's or the parameters' size.

        Raises
        ------
        ValueError
            If the blocks do not cover the box exactly once.
        """
        params = torch.empty(tuple(shape), dtype=torch.long)
        positions = torch.empty(tuple(shape), dtype=torch.long)
        filled = 0
        for block in self.blocks:
            first = [max(a, b) for a, b in zip(lo, block.start)]
            stop = [min(a + n, b + m) for a, n, b, m in zip(lo, shape, block.start, block.shape)]
            if any(a >= b for a, b in zip(first, stop)):
                continue
            begin = block.offset
            begin += sum(s * (a - b) for s, a, b in zip(block.strides, first, block.start))
            sizes = [b - a for a, b in zip(first, stop)]
            box = tuple(slice(a - o, b - o) for a, b, o in zip(first, stop, lo))
            positions[box] = affine_grid(begin, sizes, block.strides)
            params[box] = block.param
            filled += math.prod(sizes)
        if filled != positions.numel():
            raise ValueError(f"the blocks cover {filled} of the box's {positions.numel()} entries")
        return params, positions

    def scatter(self, point: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """New parameter tensors: ``tensors`` with the point written in (differentiable)."""
        dtype = _common_dtype(tensors)
        point = point.to(dtype)
        touched = {block.param for block in self.blocks}
        flats = [
            t.reshape(-1).to(dtype, copy=k in touched) if t.dtype != dtype or k in touched else t
            for k, t in enumerate(tensors)
        ]
        for block in self.blocks:
            block.view(flats[block.param]).copy_(point[block.box])
        return [f.view(t.shape) for f, t in zip(flats, tensors)]

    def runs(self, shapes: Sequence[torch.Size]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter (of ``shapes``), the (starts, lengths) of the runs of its
        entries the point covers, sorted by start. Runs overlap exactly where the point
        repeats an entry (:func:`overlap`). Boxes whose view may repeat an entry, or
        that make too many runs, are listed entry by entry."""
        small: List[List[Tuple[int, int]]] = [[] for _ in shapes]
        parts: List[List[Tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in shapes]
        for block in self.blocks:
            found = block.runs()
            if found is None:
                positions = block.view(torch.arange(shapes[block.param].numel()))
                parts[block.param].append(runs_of(positions.reshape(-1).sort().values))
            elif isinstance(found[0], list):
                small[block.param] += [(start, found[1]) for start in found[0]]
            else:
                parts[block.param].append((found[0], torch.full_like(found[0], found[1])))
        return [_sorted_runs(few, many) for few, many in zip(small, parts)]


def _box_start(point: torch.Tensor, block: Block) -> int:
    """The storage offset of ``block``'s first entry in ``point``."""
    return point.storage_offset() + sum(s * t for s, t in zip(block.start, point.stride()))


def _step(blocks: Sequence[Block]) -> int:
    """How far apart along the point's first dimension the boxes of a tile start."""
    return blocks[1].start[0] - blocks[0].start[0] if len(blocks) > 1 else 1


def _common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The tensors' promoted dtype (their own where they share one: no dispatch)."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def _sorted_runs(
    few: List[Tuple[int, int]], many: List[Tuple[torch.Tensor, torch.Tensor]]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One parameter's runs, sorted and coalesced: ``few`` as Python pairs (sorted and
    joined in Python where they are all there is), ``many`` as tensors."""
    if not many:
        starts, lengths = [], []
        for start, length in sorted(few):
            if starts and starts[-1] + lengths[-1] == start:
                lengths[-1] += length  # starts where its predecessor ends: one run
            else:
                starts.append(start)
                lengths.append(length)
        return torch.tensor(starts, dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    if few:
        starts, lengths = zip(*few)
        many = [*many, (torch.tensor(starts), torch.tensor(lengths))]
    starts = torch.cat([s for s, _ in many])
    lengths = torch.cat([n for _, n in many])
    order = torch.argsort(starts)
    return coalesced(starts[order], lengths[order])


def affine_grid(offset: int, shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """The positions ``offset + sum_d i_d strides[d]`` for ``0 <= i < shape``
    (``torch.long``, shape ``shape``): a strided view's entries, as integers."""
    grid = torch.full((), offset, dtype=torch.long)
    for n, stride in zip(shape, strides):
        grid = grid[..., None] + stride * torch.arange(n)
    return grid


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return tuple(strides)


# ----------------------------------------------------------------------- probes


class StridedView:
    """A strided view of a flattened parameter, as arithmetic on (shape, strides, offset):
    the subset of a tensor's view operations that layouts use, with PyTorch's rules for
    when a view exists, at a fraction of the cost of a ``meta`` tensor's dispatch."""

    __slots__ = ("offset", "shape", "strides")

    def __init__(self, shape: Sequence[int], strides: Sequence[int], offset: int = 0):
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.offset = offset

    @classmethod
    def contiguous(cls, shape: Sequence[int]) -> StridedView:
        return cls(shape, contiguous_strides(shape))

    def numel(self) -> int:
        return math.prod(self.shape)

    def permute(self, dims: Sequence[int]) -> StridedView:
        return StridedView(
            [self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset
        )

    def unsqueeze(self, dim: int) -> StridedView:
        # PyTorch's stride for the new dimension: the extent of the one it precedes
        stride = self.shape[dim] * self.strides[dim] if dim < len(self.shape) else 1
        return StridedView(
            _spliced(self.shape, dim, dim, 1), _spliced(self.strides, dim, dim, stride), self.offset
        )

    def narrow(self, dim: int, start: int, length: int) -> StridedView:
        return StridedView(
            _spliced(self.shape, dim, dim + 1, length),
            self.strides,
            self.offset + start * self.strides[dim],
        )

    def select(self, dim: int, index: int) -> StridedView:
        return StridedView(
            _spliced(self.shape, dim, dim + 1),
            _spliced(self.strides, dim, dim + 1),
            self.offset + index * self.strides[dim],
        )

    def view(self, shape: Sequence[int]) -> StridedView:
        """The view of ``shape`` (same number of entries); ``RuntimeError`` where
        PyTorch's ``Tensor.view`` would refuse it (no strides give those entries)."""
        shape = tuple(shape)
        if math.prod(shape) != self.numel():
            raise RuntimeError(f"shape {shape} is invalid for {self.numel()} entries")
        strides = _view_strides(self.shape, self.strides, shape)
        if strides is None:
            raise RuntimeError("view size is not compatible with the view's strides")
        return StridedView(shape, strides, self.offset)


def _view_strides(
    old_shape: Tuple[int, ...], old_strides: Tuple[int, ...], new_shape: Tuple[int, ...]
) -> Tuple[int, ...] | None:
    """Strides of ``new_shape`` viewing the entries of a strided view, or ``None``: the old
    dimensions are cut into chunks that are contiguous among themselves, and each chunk
    must be a product of consecutive new dimensions (PyTorch's ``computeStride``)."""
    if math.prod(old_shape) == 0:
        return old_strides if old_shape == new_shape else contiguous_strides(new_shape)
    if not old_shape:  # one entry: every new dimension has size 1
        return (1,) * len(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base = old_strides[-1] if old_strides else 1
    tensor_numel = view_numel = 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[d]
        if d == 0 or (old_shape[d - 1] != 1 and old_strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base = old_strides[d - 1]
                tensor_numel = view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_strides)


@dataclass(frozen=True)
class _Box:
    param: int
    start: Tuple[int, ...]
    view: StridedView  # a view of the flattened parameter, of the box's shape


class _Probe:
    """Stands for a tensor in a layout: its shape and the boxes that tile it."""

    def __init__(self, shape: Sequence[int], boxes: List[_Box]):
        self.shape = torch.Size(shape)
        self.boxes = boxes
        if len(boxes) > MAX_BLOCKS:
            raise _Unsupported("too many boxes")

    # -- shape queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    # -- views
    def permute(self, *dims) -> _Probe:
        dims = _dims(dims)
        dims = tuple(d % self.ndim for d in dims)
        boxes = [
            _Box(b.param, tuple(b.start[d] for d in dims), b.view.permute(dims)) for b in self.boxes
        ]
        return _Probe([self.shape[d] for d in dims], boxes)

    def transpose(self, a: int, b: int) -> _Probe:
        dims = list(range(self.ndim))
        dims[a], dims[b] = dims[b], dims[a]
        return self.permute(dims)

    @property
    def mT(self) -> _Probe:
        return self.transpose(-2, -1)

    @property
    def T(self) -> _Probe:
        return self.permute(tuple(reversed(range(self.ndim))))

    def unsqueeze(self, dim: int) -> _Probe:
        dim = dim % (self.ndim + 1)
        boxes = [
            _Box(b.param, _spliced(b.start, dim, dim, 0), b.view.unsqueeze(dim)) for b in self.boxes
        ]
        return _Probe(_spliced(self.shape, dim, dim, 1), boxes)

    def contiguous(self) -> _Probe:
        return self

    def reshape(self, *shape) -> _Probe:
        return _reshape(self, _infer(_dims(shape), self.numel()))

    view = reshape

    def flatten(self) -> _Probe:
        return self.reshape(-1)

    def narrow(self, dim: int, start: int, length: int) -> _Probe:
        return _narrow(self, dim % self.ndim, start, start + length)

    def select(self, dim: int, index: int) -> _Probe:
        return _select(self, dim % self.ndim, index)

    def __getitem__(self, key) -> _Probe:
        items = key if isinstance(key, tuple) else (key,)
        consumed = sum(1 for k in items if k is not None and k is not Ellipsis)
        out, dim = self, 0
        for item in items:
            if item is None:
                out, dim = out.unsqueeze(dim), dim + 1
            elif item is Ellipsis:
                dim += self.ndim - consumed
            elif isinstance(item, bool):
                raise _Unsupported("boolean index")
            elif isinstance(item, int):
                out = _select(out, dim, item)
            elif isinstance(item, slice):
                lo, hi, step = item.indices(out.shape[dim])
                if step != 1:
                    raise _Unsupported("stepped slice")
                out, dim = _narrow(out, dim, lo, max(lo, hi)), dim + 1
            else:
                out, dim = _take(out, dim, item), dim + 1
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.cat, torch.concat, torch.concatenate):
            return _cat(*args, **kwargs)
        if func is torch.stack:
            return _stack(*args, **kwargs)
        raise _Unsupported(getattr(func, "__name__", str(func)))


def _spliced(items: Sequence[int], start: int, stop: int, *new: int) -> Tuple[int, ...]:
    """``items`` with ``items[start:stop]`` replaced by ``new``."""
    return (*items[:start], *new, *items[stop:])


def _dims(args) -> Tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _infer(shape: Tuple[int, ...], numel: int) -> Tuple[int, ...]:
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(numel // known if s == -1 else s for s in shape)
    if math.prod(shape) != numel:
        raise _Unsupported("reshape of the wrong size")
    return shape


def _select(x: _Probe, dim: int, index: int) -> _Probe:
    size = x.shape[dim]
    if not -size <= index < size:
        raise _Unsupported("index out of range")
    index %= size
    boxes = []
    for b in x.boxes:
        lo = b.start[dim]
        if lo <= index < lo + b.view.shape[dim]:
            start = b.start[:dim] + b.start[dim + 1 :]
            boxes.append(_Box(b.param, start, b.view.select(dim, index - lo)))
    return _Probe(x.shape[:dim] + x.shape[dim + 1 :], boxes)


def _narrow(x: _Probe, dim: int, lo: int, hi: int) -> _Probe:
    boxes = []
    for b in x.boxes:
        first, last = b.start[dim], b.start[dim] + b.view.shape[dim]
        a, e = max(first, lo), min(last, hi)
        if a < e:
            start = _spliced(b.start, dim, dim + 1, a - lo)
            boxes.append(_Box(b.param, start, b.view.narrow(dim, a - first, e - a)))
    return _Probe(_spliced(x.shape, dim, dim + 1, hi - lo), boxes)


def _take(x: _Probe, dim: int, index) -> _Probe:
    """``x`` indexed along ``dim`` by a 1-D integer tensor or list: runs of consecutive
    indices become slices, concatenated."""
    index = torch.as_tensor(index)
    if index.dim() != 1 or index.dtype in (torch.bool, torch.uint8) or index.is_floating_point():
        raise _Unsupported("index tensor")
    if not index.numel():
        raise _Unsupported("empty index")
    index = torch.where(index < 0, index + x.shape[dim], index)
    breaks = ((index[1:] - index[:-1]) != 1).nonzero().reshape(-1) + 1
    bounds = [0, *breaks.tolist(), index.numel()]
    if len(bounds) > MAX_BLOCKS:
        raise _Unsupported("too many runs")
    parts = []
    for a, e in pairwise(bounds):
        first = int(index[a])
        parts.append(_narrow(x, dim, first, first + e - a))
    return parts[0] if len(parts) == 1 else _cat(parts, dim)


def _cat(tensors, dim: int = 0) -> _Probe:
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, _Probe) for t in tensors):
        raise _Unsupported("concatenation with a non-probe")
    first = tensors[0]
    dim %= first.ndim
    boxes, at = [], 0
    for t in tensors:
        if t.ndim != first.ndim or any(
            t.shape[d] != first.shape[d] for d in range(first.ndim) if d != dim
        ):
            raise _Unsupported("concatenation of mismatched shapes")
        for b in t.boxes:
            start = _spliced(b.start, dim, dim + 1, b.start[dim] + at)
            boxes.append(_Box(b.param, start, b.view))
        at += t.shape[dim]
    return _Probe(_spliced(first.shape, dim, dim + 1, at), boxes)


def _stack(tensors, dim: int = 0) -> _Probe:
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, _Probe) for t in tensors):
        raise _Unsupported("stack with a non-probe")
    return _cat([t.unsqueeze(dim % (tensors[0].ndim + 1)) for t in tensors], dim)


def _reshape(x: _Probe, shape: Tuple[int, ...]) -> _Probe:
    """``x`` reshaped: size-1 dimensions dropped, then each group of old dimensions
    merged and split into the new ones, then the new size-1 dimensions inserted."""
    if tuple(shape) == tuple(x.shape):
        return x
    for dim in reversed(range(x.ndim)):
        if x.shape[dim] == 1:
            x = _select(x, dim, 0)
    old, new = list(x.shape), [s for s in shape if s != 1]
    i = j = at = 0
    while i < len(old):
        i2, j2, a, b = i + 1, j + 1, old[i], new[j]
        while a != b:
            if a < b:
                a, i2 = a * old[i2], i2 + 1
            else:
                b, j2 = b * new[j2], j2 + 1
        if i2 - i > 1:
            x = _merge(x, at, i2 - i)
        if j2 - j > 1:
            x = _split(x, at, new[j:j2])
        at, i, j = at + j2 - j, i2, j2
    for dim, size in enumerate(shape):
        if size == 1:
            x = x.unsqueeze(dim)
    return x


def _merge(x: _Probe, dim: int, count: int) -> _Probe:
    """Dimensions ``dim .. dim + count - 1`` of ``x`` merged into one: each box is cut
    until its part of those dimensions is a run of the merged one and its view merges."""
    sizes = x.shape[dim : dim + count]
    inner = contiguous_strides(sizes)
    merged = math.prod(sizes)
    boxes: List[_Box] = []

    def place(param: int, start: Tuple[int, ...], view: torch.Tensor) -> None:
        lens = view.shape[dim : dim + count]
        cut = next((k for k in range(count) if lens[k] > 1), None)
        local = start[dim : dim + count]
        run = cut is None or all(lens[k] == sizes[k] for k in range(cut + 1, count))
        if run:
            try:
                flat = view.view(_spliced(view.shape, dim, dim + count, math.prod(lens)))
            except RuntimeError:
                flat = None
            if flat is not None:
                position = sum(s * st for s, st in zip(local, inner))
                boxes.append(_Box(param, _spliced(start, dim, dim + count, position), flat))
                if len(boxes) > MAX_BLOCKS:
                    raise _Unsupported("too many boxes")
                return
        for i in range(lens[cut]):
            moved = _spliced(start, dim + cut, dim + cut + 1, start[dim + cut] + i)
            place(param, moved, view.narrow(dim + cut, i, 1))

    for b in x.boxes:
        place(b.param, b.start, b.view)
    return _Probe(_spliced(x.shape, dim, dim + count, merged), boxes)


def _split(x: _Probe, dim: int, sizes: Sequence[int]) -> _Probe:
    """Dimension ``dim`` of ``x`` split into ``sizes`` (row-major): each box's run of it
    is cut into boxes of the new dimensions."""
    boxes = []
    for b in x.boxes:
        first, length = b.start[dim], b.view.shape[dim]
        for start, lens, lo in _row_major_boxes(first, first + length, tuple(sizes)):
            part = b.view.narrow(dim, lo - first, math.prod(lens))
            view = part.view(part.shape[:dim] + lens + part.shape[dim + 1 :])
            boxes.append(_Box(b.param, b.start[:dim] + start + b.start[dim + 1 :], view))
    if len(boxes) > MAX_BLOCKS:
        raise _Unsupported("too many boxes")
    return _Probe(x.shape[:dim] + tuple(sizes) + x.shape[dim + 1 :], boxes)


def _row_major_boxes(lo: int, hi: int, sizes: Tuple[int, ...]):
    """Boxes ``(start, shape, first flat position)`` tiling the flat range ``[lo, hi)``
    of a row-major array of shape ``sizes``, in order."""
    if len(sizes) == 1:
        return [((lo,), (hi - lo,), lo)]
    row = math.prod(sizes[1:])
    out = []
    at = lo
    if at % row:  # a partial first row
        end = min(hi, (at // row + 1) * row)
        base = (at // row) * row
        for start, lens, first in _row_major_boxes(at - base, end - base, sizes[1:]):
            out.append(((at // row, *start), (1, *lens), first + base))
        at = end
    if hi - at >= row:  # whole rows
        rows = (hi - at) // row
        out.append(((at // row,) + (0,) * (len(sizes) - 1), (rows, *sizes[1:]), at))
        at += rows * row
    if at < hi:  # a partial last row
        base = (at // row) * row
        for start, lens, first in _row_major_boxes(at - base, hi - base, sizes[1:]):
            out.append(((at // row, *start), (1, *lens), first + base))
    return out


def trace(layout, shapes: Sequence[torch.Size]) -> PointStructure | None:
    """The boxes of ``layout(*parameters)`` for parameters of ``shapes``, or ``None``
    where the layout does something the probes cannot follow.

    Parameters
    ----------
    layout : callable
        A layout (see :meth:`~geoopt_quotient.symmetry.SymmetryGroup.from_layout`).
    shapes : sequence of torch.Size
        The shapes of its arguments.

    Returns
    -------
    PointStructure or None
        The point's shape and boxes.
    """
    leaves = []
    for k, shape in enumerate(shapes):
        view = StridedView.contiguous(shape)
        leaves.append(_Probe(shape, [_Box(k, (0,) * len(shape), view)]))
    try:
        out = layout(*leaves)
    except Exception:  # any failure: the index map decides (and reports it)
        return None
    if not isinstance(out, _Probe) or sum(b.view.numel() for b in out.boxes) != out.numel():
        return None
    blocks = tuple(
        Block(b.param, b.start, b.view.shape, b.view.strides, b.view.offset)
        for b in out.boxes
        if b.view.numel()
    )
    return PointStructure(out.shape, blocks)


# ------------------------------------------------------------- runs and overlaps


def overlap(starts: torch.Tensor, lengths: torch.Tensor) -> int | None:
    """Position (in sorted order) of a run that overlaps its predecessor, or ``None``.

    ``starts`` must be sorted; runs are pairwise disjoint exactly when each ends before
    the next one starts.
    """
    if starts.numel() < 2:
        return None
    clash = (starts[1:] < starts[:-1] + lengths[:-1]).nonzero()
    return int(clash[0, 0]) + 1 if clash.numel() else None


def coalesced(starts: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted runs with each run that starts where its predecessor ends joined to it
    (overlapping runs stay apart, so :func:`overlap` still finds them)."""
    if starts.numel() < 2:
        return starts, lengths
    ends = starts + lengths
    first = torch.cat([torch.ones(1, dtype=torch.bool), starts[1:] != ends[:-1]])
    if bool(first.all()):
        return starts, lengths
    heads = first.nonzero().reshape(-1)
    last = torch.cat([heads[1:], torch.tensor([starts.numel()])]) - 1
    return starts[heads], ends[last] - starts[heads]


def complement(starts: torch.Tensor, lengths: torch.Tensor, size: int):
    """The runs of ``[0, size)`` that sorted, disjoint runs leave uncovered."""
    ends = torch.cat([torch.zeros(1, dtype=torch.long), starts + lengths])
    begins = torch.cat([starts, torch.tensor([size])])
    keep = begins > ends
    return ends[keep], (begins - ends)[keep]


def runs_of(entries: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted runs (starts, lengths) of consecutive values among sorted ``entries``."""
    entries = entries.long()
    if not entries.numel():
        return entries, entries
    breaks = (entries[1:] - entries[:-1] != 1).nonzero().reshape(-1) + 1
    first = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
    last = torch.cat([breaks, torch.tensor([entries.numel()])])
    return entries[first], last - first


def range_structure(starts: torch.Tensor, lengths: torch.Tensor, param: int = 0) -> PointStructure:
    """The 1-D point made of runs of one parameter's flat entries, in order."""
    blocks, at = [], 0
    for start, length in zip(starts.tolist(), lengths.tolist()):
        blocks.append(Block(param, (at,), (length,), (1,), start))
        at += length
    return PointStructure(torch.Size([at]), tuple(blocks))


# ------------------------------------------------------------ strided write-back


def strided_pieces(
    structures: Sequence[Tuple[PointStructure, Sequence[str]]],
    names: Sequence[str],
    shapes: Sequence[torch.Size],
) -> Tuple[Tuple[Piece, ...], ...] | None:
    """Per parameter of ``names``, the :class:`~geoopt_quotient.symmetry.strided.Piece`
    s of the write-back from the points of ``structures`` (each with its group's
    parameter names), or ``None`` where a parameter would need more than
    :data:`~geoopt_quotient.symmetry.strided.MAX_PIECES_PER_PARAMETER`.

    Each box is cut into runs of consecutive parameter entries, all of one shape (one
    run per box in most layouts; one per row where a box takes columns). In parameter
    order, the runs that come from one point with one shape are one piece where their
    positions in the point are an affine function of their number
    (:func:`~geoopt_quotient.symmetry.strided.affine_split`): the same description as
    from the index map, at the cost of one integer per run.
    """
    found: Dict[str, List[Tuple[torch.Tensor, torch.Tensor, Tuple]]] = {n: [] for n in names}
    for source, (structure, group_names) in enumerate(structures):
        point_strides = contiguous_strides(structure.shape)
        for block in structure.blocks:
            cut = _block_runs(block, point_strides)
            if cut is None:
                return None
            starts, offsets, shape, strides = cut
            found[group_names[block.param]].append((starts, offsets, (source, shape, strides)))
    out = []
    for name, shape in zip(names, shapes):
        pieces = _param_pieces(found[name], shape.numel())
        if pieces is None or len(pieces) > MAX_PIECES_PER_PARAMETER:
            return None
        out.append(pieces)
    return tuple(out)


def _block_runs(block: Block, point_strides: Tuple[int, ...]):
    """(parameter starts, point offsets, shape, point strides) of the runs of a box:
    its longest row-major contiguous tail of dimensions, once per outer index."""
    dims = sorted(
        ((s, n, p) for s, n, p in zip(block.strides, block.shape, point_strides) if n > 1),
        key=lambda d: -d[0],
    )
    tail, step = len(dims), 1
    while tail > 0 and dims[tail - 1][0] == step:
        step *= dims[tail - 1][1]
        tail -= 1
    outer, inner = dims[:tail], dims[tail:]
    if math.prod(n for _, n, _ in outer) > MAX_RUNS:
        return None
    starts = torch.tensor([block.offset])
    offsets = torch.tensor([sum(s * p for s, p in zip(block.start, point_strides))])
    for s, n, p in outer:
        steps = torch.arange(n)
        starts = (starts[:, None] + s * steps).reshape(-1)
        offsets = (offsets[:, None] + p * steps).reshape(-1)
    shape = tuple(n for _, n, _ in inner) or (1,)
    strides = tuple(p for _, _, p in inner) or (1,)
    return starts, offsets, shape, strides


def _param_pieces(found, size: int) -> Tuple[Piece, ...] | None:
    """One parameter's pieces from its runs (``None`` unless they tile ``[0, size)``)."""
    if not found:
        return None
    keys = list({key: None for _, _, key in found})
    starts = torch.cat([s for s, _, _ in found])
    offsets = torch.cat([o for _, o, _ in found])
    which = torch.cat([torch.full_like(s, keys.index(k)) for s, _, k in found])
    lengths = torch.tensor([math.prod(k[1]) for k in keys])[which]
    order = torch.argsort(starts)
    starts, offsets, which, lengths = starts[order], offsets[order], which[order], lengths[order]
    ends = starts + lengths
    if int(starts[0]) != 0 or int(ends[-1]) != size or not torch.equal(starts[1:], ends[:-1]):
        return None  # a gap or an overlap: not a partition
    breaks = (which[1:] != which[:-1]).nonzero().reshape(-1) + 1
    bounds = [0, *breaks.tolist(), starts.numel()]
    if len(bounds) - 1 > MAX_PIECES_PER_PARAMETER:
        return None
    pieces = []
    for lo, hi in pairwise(bounds):
        source, shape, strides = keys[int(which[lo])]
        split = affine_split(offsets[lo:hi])
        if split is None:
            return None
        dims, steps = split
        if hi - lo == 1:
            dims, steps = (), ()
        pieces.append(
            Piece(source, int(starts[lo]), dims + shape, steps + strides, int(offsets[lo]))
        )
    return tuple(pieces)
