r"""Index maps between flat buffers, described by strided boxes instead of one integer per entry.

A map sends entry :math:`k` of a sequence to position :math:`m_k` of one flat buffer
and :math:`b_k` of another (e.g. from a model's local shards to a ball's pieces). The
maps of real layouts are regular: cut :math:`k` into consecutive segments, and on each
both positions are affine functions of a row-major multi-index,

.. math::

    m_{k_0 + \mathrm{flat}(i)} = o^m + \textstyle\sum_d \sigma^m_d i_d, \qquad
    b_{k_0 + \mathrm{flat}(i)} = o^b + \textstyle\sum_d \sigma^b_d i_d, \qquad
    0 \le i < n,

so each segment is one strided view of each buffer (a *box*), and copying the map is
one strided copy per box. :func:`box_map` finds the boxes from the integer maps,
innermost dimension first: the greedy split of the sequence into arithmetic runs
(positive steps), then of the runs' first entries, among runs alike in shape and
strides, into arithmetic runs again, and so on. A head of :math:`h` rows, transposed in
the ball, is :math:`h`-long runs of one column stride, which the next level stacks: one
box per head, and heads and layers alike in one box each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from ..symmetry.structured import affine_grid

__all__ = ["BoxMap", "arithmetic_runs", "box_map", "joined"]

#: Dimensions of a box at most (``as_strided`` handles more; more means an irregular map).
MAX_DIMS = 8


def arithmetic_runs(
    values: np.ndarray, keys: np.ndarray | None = None
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy split of ``values`` (shape ``(n, c)``) into consecutive runs, each
    ``values[start + j] = values[start] + j * step`` with every component of ``step``
    positive, and ``keys`` (shape ``(n,)``) equal within a run.

    Greedy: a run starts at the first entry no run holds, takes its step from the next
    entry, and goes on while the steps stay equal. Vectorized over segments of equal
    differences: a segment of one difference whose first entry the run before holds is
    skipped, and within a chain of such segments the holding alternates.

    Returns
    -------
    starts, lengths, steps : numpy.ndarray
        Of shapes ``(r,)``, ``(r,)`` and ``(r, c)`` (steps of runs of length 1 are 0).
    """
    n, sides = values.shape
    if n <= 1:
        return np.zeros(n, np.int64), np.ones(n, np.int64), np.zeros((n, sides), np.int64)
    diffs = values[1:] - values[:-1]
    ok = (diffs > 0).all(1)
    if keys is not None:
        ok &= keys[1:] == keys[:-1]
    m = n - 1
    new = np.ones(m, bool)
    if m > 1:
        new[1:] = (diffs[1:] != diffs[:-1]).any(1) | ~ok[1:] | ~ok[:-1]
    first = np.flatnonzero(new)  # segment j: differences first[j] .. last[j] - 1
    last = np.append(first[1:], m)
    length = last - first
    barrier = ~ok[first]  # a barrier is a segment of its own
    # whether the run before holds a segment's first entry
    resets = np.ones(len(first), bool)
    resets[1:] = barrier[:-1] | (length[:-1] >= 2)
    base = np.zeros(len(first), bool)  # held at a chain's start: after a run of >= 2 steps
    base[1:] = ~barrier[:-1] & (length[:-1] >= 2)
    chain = np.maximum.accumulate(np.where(resets, np.arange(len(first)), 0))
    held = base[chain] ^ ((np.arange(len(first)) - chain) % 2 == 1)
    starts, lengths = [], []
    whole = ~barrier & ~held  # entries first .. last
    starts.append(first[whole])
    lengths.append(length[whole] + 1)
    tail = ~barrier & held & (length >= 2)  # entries first + 1 .. last
    starts.append(first[tail] + 1)
    lengths.append(length[tail])
    alone = barrier & ~held  # its first entry alone
    starts.append(first[alone])
    lengths.append(np.ones(int(alone.sum()), np.int64))
    if barrier[-1] or (held[-1] and length[-1] == 1):  # the last entry, held by none
        starts.append(np.array([m]))
        lengths.append(np.ones(1, np.int64))
    starts_, lengths_ = np.concatenate(starts), np.concatenate(lengths)
    order = np.argsort(starts_, kind="stable")
    starts_, lengths_ = starts_[order], lengths_[order]
    steps = np.zeros((len(starts_), sides), np.int64)
    multi = lengths_ > 1
    steps[multi] = diffs[starts_[multi]]
    return starts_, lengths_, steps


@dataclass(frozen=True)
class BoxMap:
    """A map of ``numel`` entries between two flat buffers as strided boxes.

    Box ``j`` takes the entries ``starts[j] : starts[j] + prod(shapes[j])`` of the
    sequence; its view of buffer ``c`` (0: source side, 1: destination side, as the
    map was built) has shape ``shapes[j]``, strides ``strides[j][c]`` and offset
    ``offsets[j][c]``.
    """

    numel: int
    starts: Tuple[int, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    strides: Tuple[Tuple[Tuple[int, ...], ...], ...]
    offsets: Tuple[Tuple[int, ...], ...]

    @classmethod
    def of_ranges(cls, ranges: List[Tuple[int, int, int]]) -> BoxMap:
        """The map of the ranges ``(start 0, start 1, size)``: one 1-D box each."""
        sizes = [size for _, _, size in ranges]
        return cls(
            sum(sizes),
            tuple(int(s) for s in np.cumsum([0, *sizes[:-1]])) if ranges else (),
            tuple((size,) for size in sizes),
            tuple(((1,), (1,)) for _ in ranges),
            tuple((first, second) for first, second, _ in ranges),
        )

    @property
    def boxes(self) -> int:
        return len(self.starts)

    def nbytes(self) -> int:
        """Bytes of the description (Python integers counted as 8 bytes each)."""
        dims = sum(len(s) for s in self.shapes)
        sides = len(self.offsets[0]) if self.offsets else 0
        return 8 * (len(self.starts) * (1 + sides) + dims * (1 + sides))

    def views(self, flat: torch.Tensor, side: int) -> List[torch.Tensor]:
        """The boxes' views of the flat buffer ``flat`` of side ``side``."""
        base = flat.storage_offset()
        return [
            flat.as_strided(shape, strides[side], base + offset[side])
            for shape, strides, offset in zip(self.shapes, self.strides, self.offsets)
        ]

    def copy(self, source: torch.Tensor, out: torch.Tensor, reverse: bool = False) -> None:
        """``out[map[1]] = source[map[0]]`` (``reverse``: ``out[map[0]] = source[map[1]]``)."""
        if not self.starts:
            return
        read, write = (1, 0) if reverse else (0, 1)
        torch._foreach_copy_(self.views(out, write), self.views(source, read))

    def positions(self) -> torch.Tensor:
        """The integer map, shape ``(numel, sides)`` (for checks)."""
        sides = len(self.offsets[0]) if self.offsets else 2
        out = torch.empty(self.numel, sides, dtype=torch.long)
        boxes = zip(self.starts, self.shapes, self.strides, self.offsets)
        for start, shape, strides, offset in boxes:
            size = int(np.prod(shape, dtype=np.int64))
            for side in range(sides):
                grid = affine_grid(offset[side], shape, strides[side])
                out[start : start + size, side] = grid.reshape(-1)
        return out


def box_map(*positions: torch.Tensor) -> BoxMap:
    """The :class:`BoxMap` of the integer maps ``positions`` (1-D, of one length; entry
    ``k`` of each is the position of sequence entry ``k`` in its buffer)."""
    values = np.stack([p.detach().cpu().numpy().astype(np.int64) for p in positions], 1)
    n, sides = values.shape
    starts, lengths, steps = arithmetic_runs(values)
    dims = np.zeros(len(starts), np.int64) + (lengths > 1)
    shapes = np.ones((len(starts), MAX_DIMS), np.int64)  # innermost last, padded in front
    strides = np.zeros((len(starts), MAX_DIMS, sides), np.int64)
    shapes[:, -1] = lengths
    strides[:, -1] = steps
    return _stacked(int(n), starts, values[starts], shapes, strides, dims)


def joined(maps: Sequence[BoxMap], shifts: Sequence[Sequence[int]]) -> BoxMap:
    """One map of the sequences of ``maps`` in turn, each map's positions moved by its
    ``shifts`` (one per side), alike boxes of consecutive maps stacked as
    :func:`box_map` stacks runs (the boxes of a map built in chunks become those of the
    whole map, or nearly)."""
    maps = [(m, shift) for m, shift in zip(maps, shifts) if m.boxes]
    if not maps:
        return BoxMap(0, (), (), (), ())
    sides = len(maps[0][0].offsets[0])
    rows = sum(m.boxes for m, _ in maps)
    starts, offsets = np.zeros(rows, np.int64), np.zeros((rows, sides), np.int64)
    dims = np.zeros(rows, np.int64)
    shapes = np.ones((rows, MAX_DIMS), np.int64)
    strides = np.zeros((rows, MAX_DIMS, sides), np.int64)
    row, numel = 0, 0
    for m, shift in maps:
        for start, shape, stride, offset in zip(m.starts, m.shapes, m.strides, m.offsets):
            starts[row], dims[row] = numel + start, len(shape)
            offsets[row] = np.asarray(offset) + np.asarray(shift)
            if shape:
                shapes[row, MAX_DIMS - len(shape) :] = shape
                strides[row, MAX_DIMS - len(shape) :] = np.asarray(stride).T
            row += 1
        numel += m.numel
    return _stacked(numel, starts, offsets, shapes, strides, dims)


def _stacked(
    n: int,
    starts: np.ndarray,
    offsets: np.ndarray,
    shapes: np.ndarray,
    strides: np.ndarray,
    dims: np.ndarray,
) -> BoxMap:
    """The boxes (sequence ``starts``, ``offsets`` per side, ``shapes`` and ``strides``
    padded in front to :data:`MAX_DIMS`, ``dims`` in use) stacked: runs of consecutive
    boxes alike in shape and strides whose offsets are arithmetic become one box of one
    more dimension, as long as any do."""
    sides = offsets.shape[1] if offsets.ndim == 2 else 0
    while len(starts) > 1:
        alike = np.concatenate([dims[:, None], shapes, strides.reshape(len(starts), -1)], 1)
        # only neighbours are compared: a key per segment of alike boxes (no sort)
        keys = np.cumsum(np.r_[True, (alike[1:] != alike[:-1]).any(1)])
        full = dims >= MAX_DIMS  # never stacked again: keys of their own
        keys[full] = keys.max() + 1 + np.arange(int(full.sum()))
        first, count, step = arithmetic_runs(offsets, keys)
        if len(first) == len(starts):
            break
        grown = count > 1
        starts, offsets = starts[first], offsets[first]
        shapes, strides, dims = shapes[first], strides[first], dims[first]
        at = MAX_DIMS - 1 - dims  # the new outer dimension's column
        rows = np.flatnonzero(grown)
        shapes[rows, at[rows]] = count[rows]
        strides[rows, at[rows]] = step[rows]
        dims = dims + grown
    return BoxMap(
        n,
        tuple(int(s) for s in starts),
        tuple(tuple(int(x) for x in row[MAX_DIMS - d :]) for row, d in zip(shapes, dims)),
        tuple(
            tuple(tuple(int(x) for x in row[MAX_DIMS - d :, c]) for c in range(sides))
            for row, d in zip(strides, dims)
        ),
        tuple(tuple(int(x) for x in row) for row in offsets),
    )
