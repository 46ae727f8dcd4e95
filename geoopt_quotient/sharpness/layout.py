r"""The ball's layout: the model's parameters as a few flat buffers, made once per call.

Auto-PGD's worst case evaluates the loss at perturbed parameters and differentiates it,
:math:`N` times per batch. Between two passes, the ball's arithmetic (Gram matrix,
combination, projection, metric norms, path) should cost a constant number of
operations, not some per parameter tensor, and the perturbed parameters should reach
the model without a copy per tensor. :class:`BallLayout` arranges this:

- every parameter that is a whole :class:`~geoopt_quotient.AdaptiveEuclidean` group on
  the ball's own path lives in one flat buffer per ``(dtype, device, eps)``: one ball
  group, whose perturbed point :math:`x + \xi` is written into the buffer the model
  reads, as views;
- every other parameter (those of the symmetry groups, stacked over the layers by
  discovery, and any other group) lives in one flat buffer per ``(dtype, device)``,
  written from the groups' perturbed points with a few strided copies (a block of rows
  of one parameter over the layers and heads, :func:`strided_blocks`: no index per
  entry), or one index copy where the layout is not that regular; the
  :class:`~geoopt_quotient.GLQuotient` groups of one geometry are stacked into one batch
  whose two factors have equal rows (:class:`_Stack`), so that the geometry's operations
  are one batched product each;
- the loss sees views of these buffers (no copy per tensor), and its gradient is taken
  from each parameter as the backward pass completes it (:class:`_GradientLeaves`): the
  fused adaptive buffer's is written into a flat gradient block by block, each block
  converted to the Riemannian gradient with its Gram entries as soon as it is complete,
  while in cache (:class:`_Arrival`, on the CPU), so that per Auto-PGD iteration the
  gradient is written once and not read again before the update; the other groups'
  is copied straight into their shapes by the parts of the blocks in each parameter
  (:class:`_Scatter`), into the vector their perturbed points were written from, so
  that no buffer as large as those groups stands between (with index maps: one copy
  per segment into a flat gradient, then one index gather).

With the element-wise metric, fusing the groups changes nothing but the order of sums:
with :math:`x = (x_1, \dots, x_k)` concatenated,
:math:`|\xi|_x^2 = \sum_i |\xi_i|_{x_i}^2` and :math:`\gamma_x(\xi)_i = x_i + \xi_i`.
Each parameter starts at a multiple of
:data:`~geoopt_quotient.sharpness.buffers.ALIGNMENT` bytes, as a tensor of its own would;
the gaps are zero in the base point, the iterates (which start at zero) and the
gradients, and stay zero.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..manifolds import AdaptiveEuclidean
from ..manifolds.base import has_elementwise_metric, stack_key
from ..symmetry.plan import BoundPlan, SymmetryGroup
from .apgd import BallGroup, as_scalar, explicit_path, state_dtype_for, state_vector_bytes
from .buffers import ALIGNMENT
from .functional import check_depends_on_perturbation

__all__ = ["BallLayout"]

Key = Tuple[torch.dtype, torch.device]


class FlatBuffer:
    """Parameters at aligned offsets of one flat buffer; zero-filled gaps between them."""

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[torch.Size],
        dtype,
        device,
        trailing: int = 0,
    ):
        self.names, self.shapes = list(names), [torch.Size(s) for s in shapes]
        self.dtype, self.device = dtype, device
        step = max(ALIGNMENT // dtype.itemsize, 1)
        self.starts: List[int] = []
        self.chunks: List[int] = []  # parameters, with a gap before those that need one
        self.is_gap: List[bool] = []
        end = 0
        for shape in self.shapes:
            start = -(-end // step) * step
            if start > end:
                self.chunks.append(start - end)
                self.is_gap.append(True)
            self.starts.append(start)
            self.chunks.append(shape.numel())
            self.is_gap.append(False)
            end = start + shape.numel()
        if trailing:  # a zero gap at the end: where padding entries are written
            self.chunks.append(trailing)
            self.is_gap.append(True)
        self.size = end + trailing

    def empty(self) -> torch.Tensor:
        return torch.empty(self.size, dtype=self.dtype, device=self.device)

    def pieces(self, flat: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(parameter views, gap views) of a flat buffer of this layout."""
        return _pieces(flat, self.chunks, self.is_gap, self.shapes)

    def filled(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new flat buffer holding ``tensors`` (zero in the gaps)."""
        flat = self.empty()
        views, gaps = self.pieces(flat)
        torch._foreach_copy_(views, list(tensors))
        _zero(gaps)
        return flat

    def segments(self, count: int) -> List[_Segment]:
        """At most ``count`` consecutive runs of whole chunks, of about equal size."""
        out, first, begin, target = [], 0, 0, max(1, -(-self.size // count))
        position, shapes = 0, iter(self.shapes)
        taken: List[torch.Size] = []
        for index, (chunk, gap) in enumerate(zip(self.chunks, self.is_gap)):
            position += chunk
            if not gap:
                taken.append(next(shapes))
            last = index + 1 == len(self.chunks)
            if (not gap and position - begin >= target) or last:
                chunks = slice(first, index + 1)
                size = position - begin
                out.append(_Segment(begin, size, self.chunks[chunks], self.is_gap[chunks], taken))
                first, begin, taken = index + 1, position, []
        return out


def _pieces(
    flat: torch.Tensor, chunks: List[int], is_gap: List[bool], shapes: List[torch.Size]
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(parameter views, gap views) of ``flat``, split into ``chunks``."""
    parts = flat.split(chunks)
    views = [p for p, gap in zip(parts, is_gap) if not gap]
    gaps = [p for p, gap in zip(parts, is_gap) if gap]
    return [v.view(s) if v.dim() != len(s) else v for v, s in zip(views, shapes)], gaps


@dataclass
class _Segment:
    """Entries ``start : start + size`` of a flat buffer: whole parameters and gaps."""

    start: int
    size: int
    chunks: List[int]
    is_gap: List[bool]
    shapes: List[torch.Size]
    #: By block length: :meth:`blocks`, made once
    _by_step: Dict[int, List[Tuple]] = field(default_factory=dict, repr=False, compare=False)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.start + self.size]

    def blocks(self, step: int) -> List[Tuple[int, int, int, List[Tuple[int, int, int, int]]]]:
        """The segment's entries by blocks of ``step`` entries of the flat buffer: per
        block ``(block, start, stop, pieces)``, each piece ``(start, stop, chunk, chunk's
        start)`` the part of a chunk in the block (positions in the flat buffer)."""
        if step not in self._by_step:
            self._by_step[step] = segment_blocks(self.start, self.size, self.chunks, step)
        return self._by_step[step]

    def pieces(self, flat: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """(parameter views, gap views) of ``flat`` (the segment's own entries)."""
        return _pieces(flat, self.chunks, self.is_gap, self.shapes)


def segment_blocks(start: int, size: int, chunks: List[int], step: int) -> List[Tuple]:
    """:meth:`_Segment.blocks`: the chunks and the blocks walked side by side."""
    out: List[Tuple] = []
    position, end = start, start + size
    chunk, chunk_start = 0, start
    while position < end:
        block = position // step
        stop = min((block + 1) * step, end)
        pieces = []
        while chunk < len(chunks) and chunk_start < stop:
            chunk_stop = chunk_start + chunks[chunk]
            lo, hi = max(chunk_start, position), min(chunk_stop, stop)
            if lo < hi:
                pieces.append((lo, hi, chunk, chunk_start))
            if chunk_stop > stop:
                break
            chunk, chunk_start = chunk + 1, chunk_stop
        out.append((block, position, stop, pieces))
        position = stop
    return out


#: The fewest blocks of its sweep for which a gradient is converted as it arrives
#: (:class:`_Arrival`): a smaller gradient is still in cache when swept after the pass
#: (the sweep runs then, from :meth:`~geoopt_quotient.sharpness.apgd.TangentBall.gradient_sweep`'s
#: record), and the arrival's views per piece and block would cost more than they save
#: (on the tiny ViT of 18k parameters, 120 operators more per iteration).
ARRIVAL_MIN_BLOCKS = 8

#: The flat gradient is written segment by segment: a segment's gradients are copied
#: into it (one copy operation) as soon as the backward pass has made all of them, so at
#: most about one segment's worth waits at once. A buffer has one segment per this many
#: bytes (whole parameters each), at least one and at most :data:`GRADIENT_SEGMENTS`.
GRADIENT_SEGMENT_BYTES = 8 << 20

#: The most segments of one flat buffer.
GRADIENT_SEGMENTS = 64


def _segment_count(flat: FlatBuffer) -> int:
    return max(1, min(GRADIENT_SEGMENTS, flat.size * flat.dtype.itemsize // GRADIENT_SEGMENT_BYTES))


def _zero(tensors: List[torch.Tensor]) -> None:
    if tensors:
        torch._foreach_zero_(tensors)


def _write_segment(
    segment: _Segment, out: torch.Tensor, grads: Sequence[torch.Tensor | None], arrival=None
) -> None:
    """The gradients of ``segment``'s parameters (``None``: zero) written into its part of
    the flat gradient ``out``, zeros in its gaps: one copy operation for all, or, with an
    ``arrival``, block by block (:class:`_Arrival`)."""
    if arrival is not None:
        arrival.write(segment, grads)
        return
    views, gaps = segment.pieces(segment.of(out))
    present = [(v, g) for v, g in zip(views, grads) if g is not None]
    if present:
        torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
    _zero([v for v, g in zip(views, grads) if g is None] + gaps)


class _Receiver:
    """One evaluation's gradients of one flat buffer's parameters, taken as the backward
    pass makes them (:class:`_GradientLeaves`) and written segment by segment
    (:func:`_write_segment`) as soon as a segment's are complete; :meth:`finish` writes the
    rest (zero where a parameter got no gradient). ``written_over``: per segment, the
    leaves whose storage ``out`` is (the gradient written over the perturbed point they
    view, once autograd has completed their gradient, i.e. once every node that reads
    them has run): their versions are bumped with each write, so that autograd raises,
    instead of reading a gradient as a weight, where a node still to run saved one of
    them by another way (a ``detach()`` of it, say)."""

    def __init__(
        self,
        segments: List[_Segment],
        out: torch.Tensor,
        arrival=None,
        written_over: List[List[torch.Tensor]] | None = None,
    ):
        self.segments, self.out, self.arrival = segments, out, arrival
        self.written_over = written_over
        self.waiting: List[List | None] = [[None] * len(s.shapes) for s in segments]
        self.missing = [len(s.shapes) for s in segments]

    def take(self, segment: int, index: int, grad: torch.Tensor) -> None:
        waiting = self.waiting[segment]
        if waiting is None or waiting[index] is not None:
            raise RuntimeError(
                "a perturbed parameter's gradient arrived twice in one backward pass: "
                "loss_fn must return one scalar, differentiated once"
            )
        waiting[index] = grad
        self.missing[segment] -= 1
        if self.missing[segment] == 0:
            self._write(segment)

    def _write(self, segment: int) -> None:
        grads, self.waiting[segment] = self.waiting[segment], None
        _write_segment(self.segments[segment], self.out, grads, self.arrival)  # type: ignore[arg-type]
        if self.written_over is not None:
            # the leaves' values are gone: a node still to run that saved one raises
            torch.autograd.graph.increment_version(self.written_over[segment])

    def finish(self) -> None:
        for segment, grads in enumerate(self.waiting):
            if grads is not None:
                self._write(segment)


class _Inbox:
    """Where a :class:`_GradientLeaves`' hooks hand their gradients: the current
    evaluation's :class:`_Receiver`, else ``None`` (the hooks hold this, not the leaves,
    so that the leaves and their buffer are freed with the layout, without a cycle)."""

    receiver: _Receiver | None = None


def _hand_over(inbox: _Inbox, segment: int, index: int, zero: torch.Tensor, grad: torch.Tensor):
    """A leaf's hook: its gradient to the receiver, an expanded zero to autograd."""
    if inbox.receiver is None:  # differentiated outside an evaluation: keep it
        return grad
    inbox.receiver.take(segment, index, grad)
    return zero


class _GradientLeaves:
    """The leaves the loss differentiates for one flat buffer: one per parameter, a view
    of the buffer, made once. Each carries a hook that hands its gradient to the current
    :class:`_Receiver` and gives autograd an expanded zero (no memory) in its place, so
    that the gradient is freed once written, during the backward pass: autograd runs a
    leaf's hooks as soon as its gradient is complete, whereas a node made before the
    forward pass (a view of a segment) would run only after all the model's own."""

    def __init__(self, flat: FlatBuffer, buffer: torch.Tensor, segments: List[_Segment]):
        self.inbox = _Inbox()
        views = flat.pieces(buffer)[0]
        # ``.data``: each leaf with a version counter of its own, not the buffer's, so
        # that a gradient written over one segment does not stale the others' leaves
        self.leaves = [v.data.requires_grad_() for v in views]
        zero = buffer.new_zeros(())
        where = [(s, i) for s, segment in enumerate(segments) for i in range(len(segment.shapes))]
        counts = [len(segment.shapes) for segment in segments]
        starts = [sum(counts[:s]) for s in range(len(counts))]
        #: the leaves of each segment
        self.by_segment = [self.leaves[a : a + n] for a, n in zip(starts, counts)]
        for leaf, (segment, index) in zip(self.leaves, where):
            hook = functools.partial(
                _hand_over, self.inbox, segment, index, zero.expand(leaf.shape)
            )
            leaf.register_hook(hook)


class _Arrival:
    """Writes the parameters' gradients into a flat gradient block by block (the blocks
    of a :class:`~geoopt_quotient.manifolds.adaptive.GradientSweep` over it), and runs
    the sweep on each block as soon as all its entries are written, while it is in cache:
    the flat gradient is written once, and the sweep reads the gradients from there
    instead of a second pass over the whole buffer. The values are those of one copy
    followed by the sweep (the sweep's blocks are independent, and added up in their
    order whatever the order of arrival). Blocks whose entries do not all arrive (a
    segment with no gradient, zeroed by :meth:`BallLayout.flat_gradients`) are left to
    the sweep's :meth:`~geoopt_quotient.manifolds.adaptive.GradientSweep.finish`."""

    def __init__(self, sweep, out: torch.Tensor):
        self.sweep, self.out = sweep, out
        step = sweep.step
        self.missing = [min(step, out.numel() - start) for start in range(0, out.numel(), step)]

    def write(self, segment: _Segment, grads: Sequence[torch.Tensor | None]) -> None:
        """The gradients of ``segment``'s parameters (``None``: zero) and zeros in its
        gaps, written into the flat gradient block by block, each complete block swept."""
        sources: List[torch.Tensor | None] = []
        grads = iter(grads)
        for gap in segment.is_gap:
            g = None if gap else next(grads)
            sources.append(None if g is None else g.reshape(-1))  # a strided one: copied
        flat = self.out
        for block, position, stop, pieces in segment.blocks(self.sweep.step):
            copies = [(lo, hi, o, sources[c]) for lo, hi, c, o in pieces if sources[c] is not None]
            if copies:
                torch._foreach_copy_(
                    [flat[lo:hi] for lo, hi, _, _ in copies],
                    [src[lo - o : hi - o] for lo, hi, o, src in copies],
                )
            _zero([flat[lo:hi] for lo, hi, c, _ in pieces if sources[c] is None])
            self.missing[block] -= stop - position
            if self.missing[block] == 0:
                self.sweep.block(block)


def _fusible(group: SymmetryGroup, ball_group: BallGroup) -> Tuple | None:
    """The key of the flat adaptive buffer a group joins, or ``None``."""
    manifold = ball_group.manifold
    if (
        not has_elementwise_metric(manifold)
        or manifold.ndim != 0
        or ball_group.path is not None
        or ball_group.point.requires_grad
        or len(group.param_names) != 1
        or not group.is_whole_parameter  # a whole parameter, in its own shape
    ):
        return None
    point = ball_group.point
    return point.dtype, point.device, manifold.eps


#: ``(offset, shape, strides)`` of a strided view of a 1-d tensor
View = Tuple[int, Tuple[int, ...], Tuple[int, ...]]


def _strided(flat: torch.Tensor, view: View) -> torch.Tensor:
    """The strided view ``view`` of the contiguous tensor ``flat`` (read as 1-d, from
    its first entry)."""
    offset, shape, strides = view
    return flat.as_strided(shape, strides, flat.storage_offset() + offset)


@dataclass(frozen=True)
class _Block:
    """Entries of group ``group``'s point (a strided view of it, ``point``) and the
    entries of the flat buffer they are (a strided view of the same shape, ``flat``):
    rows of a factor over a stack's batch, say, all the parameter entries of a block of
    rows or columns of weight matrices laid out alike in every layer."""

    group: int  # position among the rest's groups
    point: View
    flat: View


@dataclass
class _Rest:
    """The parameters of the unfused groups in one flat buffer, and the maps between it
    and the groups' points: a few strided blocks (:func:`strided_blocks`) where the
    entries are laid out regularly, else index maps over the concatenation of those
    groups' points (:func:`index_maps`)."""

    flat: FlatBuffer
    groups: List[int]  # positions among the layout's groups
    shapes: List[torch.Size]
    #: buffer position of each entry of the joined points, or None (``blocks``)
    destination: torch.Tensor | None
    #: position in the joined points of each buffer entry (:func:`index_maps`), or None
    source: torch.Tensor | None = None
    #: With no index maps: the blocks that cover every parameter entry once, and per
    #: group the views of its padding (entries of no parameter, kept zero)
    blocks: Tuple[List[_Block], List[List[View]]] | None = None
    _gaps: Tuple[torch.Tensor, List[torch.Tensor]] | None = None  # a buffer, its gap views
    #: The groups' perturbed points joined in one buffer, and its views in the groups'
    #: shapes (:meth:`perturbed_points`)
    _joined: Tuple[torch.Tensor, List[torch.Tensor]] | None = None
    #: The buffer of :meth:`perturbed_points` and :meth:`gradient_buffer` (:meth:`scratch`)
    _scratch: torch.Tensor | None = None
    #: ``(out, its blocks' views, those of perturbed_points)`` of :meth:`_write_views`
    _written: Tuple | None = None
    #: :meth:`parameter_blocks`
    _by_parameter: List[List[_Block]] | None = None

    def scratch(self) -> torch.Tensor:
        """One buffer for the joined perturbed points and the flat gradient, whose uses
        never overlap: the points are read once, when :meth:`write` gathers them into the
        flat buffer the model reads, before the forward pass (the retractions' pullbacks
        keep what they need of them, :func:`~.apgd.explicit_path`); the gradient is
        written by the backward pass and read into the groups' shapes (:meth:`read`)
        before the next update writes points there again."""
        if self._scratch is None:
            size = max(sum(s.numel() for s in self.shapes), self.flat.size)
            self._scratch = torch.empty(size, dtype=self.flat.dtype, device=self.flat.device)
        return self._scratch

    def perturbed_points(self) -> List[torch.Tensor]:
        """Buffers for the groups' perturbed points (contiguous, of the groups' shapes and
        the flat buffer's dtype), the same at every call: views of one buffer, their
        concatenation, so that points written there are joined already. A new joined
        buffer per evaluation, as large as the groups, would be faulted in page by page
        (glibc maps a block above its mmap threshold, at most 32 MiB, afresh each time).
        They share their memory with :meth:`gradient_buffer` (:meth:`scratch`)."""
        if self._joined is None:
            sizes = [s.numel() for s in self.shapes]
            joined = self.scratch()[: sum(sizes)]
            views = [part.view(shape) for part, shape in zip(joined.split(sizes), self.shapes)]
            self._joined = (joined, views)
        return self._joined[1]

    def gradient_buffer(self) -> torch.Tensor:
        """Where the flat buffer's gradient is written (:meth:`BallLayout.gradient_buffers`),
        in the memory of :meth:`perturbed_points` (:meth:`scratch`)."""
        return self.scratch()[: self.flat.size]

    def staging_bytes(self) -> int:
        """Memory of :meth:`scratch`: the joined perturbed points, and the flat gradient
        the layout reads the groups' gradients from; none with :attr:`blocks`, whose
        points and gradients are the evaluation's own vectors (:meth:`scatters`)."""
        if self.scatters():
            return 0
        return max(sum(s.numel() for s in self.shapes), self.flat.size) * self.flat.dtype.itemsize

    def scatters(self) -> bool:
        """Whether the groups' perturbed points are written into the flat buffer from
        the evaluation's own vectors and their gradients straight into them, parameter
        by parameter (:class:`_Scatter`): with :attr:`blocks`, no staging buffer."""
        return self.blocks is not None

    def parameter_blocks(self) -> List[List[_Block]]:
        """:func:`parameter_blocks` of :attr:`blocks`, made once."""
        if self._by_parameter is None:
            self._by_parameter = parameter_blocks(self.blocks[0], self.flat)
        return self._by_parameter

    def index_bytes(self) -> int:
        """Memory of the index maps (:func:`index_maps`; none with :attr:`blocks`)."""
        maps = [m for m in (self.destination, self.source) if m is not None]
        return sum(m.numel() * m.element_size() for m in maps)

    def write(self, points: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """The points written into the flat buffer ``out``: one gather where every
        entry of a parameter comes from one entry of the points (its gaps then zeroed),
        else one index copy; the points of several groups first joined in
        :meth:`perturbed_points`, where those written there already are. With
        :attr:`blocks`: one strided copy per block, then the gaps zeroed."""
        if self.blocks is not None:
            points = [p.to(out.dtype).contiguous() for p in points]
            targets, sources = self._write_views(points, out)
            torch._foreach_copy_(targets, sources)
            self._zero_gaps(out)
            return
        if len(points) == 1:
            joined = points[0].reshape(-1).to(out.dtype)
        else:
            for point, buffer in zip(points, self.perturbed_points()):
                if point.data_ptr() != buffer.data_ptr():
                    buffer.copy_(point)
            joined = self._joined[0]
        if self.source is None:
            out.index_copy_(0, self.destination, joined)
            return
        torch.index_select(joined, 0, self.source, out=out)
        self._zero_gaps(out)

    def _write_views(
        self, points: Sequence[torch.Tensor], out: torch.Tensor
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """The blocks' views of ``out`` and of ``points``: made once where the points are
        in :meth:`perturbed_points` (as the explicit paths write them) and ``out`` is the
        same buffer, else anew (views of other points are not kept: they would keep the
        points alive)."""
        blocks = self.blocks[0] if self.blocks is not None else []
        joined = self._joined[1] if self._joined is not None else []
        in_place = len(joined) == len(points) and all(
            p.data_ptr() == j.data_ptr() and p.shape == j.shape for p, j in zip(points, joined)
        )
        if in_place and self._written is not None and self._written[0] is out:
            return self._written[1], self._written[2]
        flats = [p.view(-1) for p in (joined if in_place else points)]
        targets = [_strided(out, block.flat) for block in blocks]
        sources = [_strided(flats[block.group], block.point) for block in blocks]
        if in_place:
            self._written = (out, targets, sources)
        return targets, sources

    def _zero_gaps(self, out: torch.Tensor) -> None:
        if self._gaps is None or self._gaps[0] is not out:
            self._gaps = (out, self.flat.pieces(out)[1])
        _zero(self._gaps[1])

    def read(
        self, grad: torch.Tensor, out: Sequence[torch.Tensor] | None = None
    ) -> List[torch.Tensor]:
        """The groups' parts of the flat ``grad``, one gather per group by the index
        maps, written into ``out`` (contiguous tensors of the groups' shapes and
        ``grad``'s dtype), else into new tensors. (With :attr:`blocks` the gradient
        never lies in a flat buffer: :class:`_Scatter`.)"""
        sizes = [s.numel() for s in self.shapes]
        if out is None:  # tensors of their own: views of one would share a version
            # counter, so that writing one in place would invalidate what the tangent
            # spaces keep of the others (their products with the point)
            out = [grad.new_empty(shape) for shape in self.shapes]
        for o, destination in zip(out, self.destination.split(sizes)):  # fits, if given
            torch.index_select(grad, 0, destination, out=o.view(-1))
        return list(out)


class _Scatter:
    """Writes the gradients of a flat buffer's parameters straight into the groups'
    gradients (contiguous tensors of the groups' shapes), as the backward pass makes
    them: per parameter, one strided copy per part of a block in it
    (:func:`parameter_blocks`), with no flat gradient between (a staging buffer as
    large as the groups). A parameter with no gradient leaves zeros; so do the groups'
    padding entries. Values are those of copying into the flat gradient and reading
    the blocks out of it (the same entries, copied)."""

    def __init__(self, rest: _Rest, segments: List[_Segment], out: Sequence[torch.Tensor]):
        self.by_parameter = rest.parameter_blocks()
        self.flats = [o.view(-1) for o in out]
        self.first: Dict[int, int] = {}
        count = 0
        for segment in segments:
            self.first[segment.start] = count
            count += len(segment.shapes)
        padding = rest.blocks[1]
        _zero([_strided(self.flats[j], view) for j, views in enumerate(padding) for view in views])

    def write(self, segment: _Segment, grads: Sequence[torch.Tensor | None]) -> None:
        """The gradients of ``segment``'s parameters (``None``: zero) copied into their
        entries of the groups' gradients."""
        first = self.first[segment.start]
        targets, sources, zeros = [], [], []
        for index, grad in enumerate(grads):
            parts = self.by_parameter[first + index]
            views = [_strided(self.flats[part.group], part.point) for part in parts]
            if grad is None:
                zeros += views
                continue
            grad = grad.contiguous()  # read as 1-d by as_strided: no view taken
            targets += views
            sources += [_strided(grad, part.flat) for part in parts]
        if targets:
            torch._foreach_copy_(targets, sources)
        _zero(zeros)


def parameter_blocks(blocks: Sequence[_Block], flat: FlatBuffer) -> List[List[_Block]]:
    """Per parameter of ``flat`` (in its order), the parts of ``blocks`` in it, their
    ``flat`` views taken from the parameter's first entry: a block is split along its
    dimension of largest stride (the layers, say) until each part lies in one parameter.
    So a parameter's gradient, a tensor of its own, is copied into the groups' shapes
    without a flat buffer between (:class:`_Scatter`)."""
    ends = [start + shape.numel() for start, shape in zip(flat.starts, flat.shapes)]
    out: List[List[_Block]] = [[] for _ in flat.shapes]
    pending = [(block.group, block.point, block.flat) for block in blocks]
    while pending:
        group, point, view = pending.pop()
        offset, shape, strides = view
        if 0 in shape:
            continue
        low = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
        high = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
        owner = bisect.bisect_right(flat.starts, low) - 1
        if owner >= 0 and high < ends[owner]:
            out[owner].append(_Block(group, point, (offset - flat.starts[owner], shape, strides)))
            continue
        spread = [d for d, n in enumerate(shape) if n > 1]
        if not spread:  # one entry outside every parameter: the blocks are wrong
            raise RuntimeError(f"a block's entry {offset} is in no parameter of the buffer")
        dim = max(spread, key=lambda d: abs(strides[d]))
        for i in reversed(range(shape[dim])):
            pending.append((group, _entry_of(point, dim, i), _entry_of(view, dim, i)))
    return out


def _entry_of(view: View, dim: int, index: int) -> View:
    """The strided view ``view`` at ``index`` of its dimension ``dim`` (dropped)."""
    offset, shape, strides = view
    start = offset + index * strides[dim]
    kept = [d for d in range(len(shape)) if d != dim]
    return start, tuple(shape[d] for d in kept), tuple(strides[d] for d in kept)


def covered_once(groups: Sequence[SymmetryGroup], flat: FlatBuffer) -> bool:
    """Whether ``groups`` write every entry of ``flat``'s parameters exactly once: per
    parameter, their runs of entries (a few each, :meth:`SymmetryGroup.runs`), sorted
    together, are disjoint and add up to its size: :func:`written_once` of the groups'
    positions, from a few runs instead of a count per buffer entry."""
    runs: Dict[str, List[Tuple[int, int]]] = {n: [] for n in flat.names}
    for group in groups:
        for name, (starts, lengths) in zip(group.param_names, group.runs()):
            runs[name] += zip(starts.tolist(), lengths.tolist())
    for name, shape in zip(flat.names, flat.shapes):
        end = 0
        for start, length in sorted(runs[name]):
            if start < end:
                return False  # an entry written twice
            end = start + length
        if sum(length for _, length in runs[name]) != shape.numel():
            return False
    return True


def written_once(destination: torch.Tensor, flat: FlatBuffer) -> bool:
    """Whether every parameter entry of ``flat`` is the position of exactly one entry of
    ``destination`` (the gaps, the stacks' padding among them, of any number): a count
    per buffer entry, less one, zero everywhere once the gaps' counts are zeroed."""
    written = torch.bincount(destination, minlength=flat.size).sub_(1)
    _zero(flat.pieces(written)[1])
    return not bool(written.any())


def index_maps(
    destination: torch.Tensor, flat: FlatBuffer, once: bool | None = None
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """``(destination, source)`` of :class:`_Rest` from the buffer position of each
    entry of the joined points (int64), in int32 where every position fits.

    A scatter (``index_copy_``) of the points into the buffer moves the same bytes as a
    gather (``index_select``) from them, but costs about twice the time on the CPU, and
    int64 indices read twice the bytes of int32 ones. ``source`` inverts
    ``destination`` where every entry of a parameter is written by exactly one entry of
    the points (:func:`written_once`; ``once``: its answer where already known, e.g.
    from :func:`covered_once`; the gaps, the stacks' padding among them, are written by
    any: they are zeroed after the gather); ``None`` otherwise (the index copy is kept)."""
    small = max(flat.size, destination.numel()) < 2**31
    index_dtype = torch.int32 if small else torch.int64
    if not (written_once(destination, flat) if once is None else once):
        return destination.to(index_dtype), None
    source = torch.zeros(flat.size, dtype=torch.int64, device=destination.device)
    source[destination] = torch.arange(destination.numel(), device=destination.device)
    return destination.to(index_dtype), source.to(index_dtype)


def _affine(positions: torch.Tensor) -> Tuple[int, Tuple[int, ...]] | None:
    """``(offset, strides)`` with ``positions[i] = offset + sum_k i_k strides_k`` (non-
    negative strides), else ``None``: the offset and strides read from the entries next
    to the first, then every entry compared with that strided view of a range (no
    tensor of the positions' size made where the range is not much longer)."""
    if positions.numel() == 0:
        return None
    origin = [0] * positions.dim()
    offset = int(positions[tuple(origin)])
    strides = []
    for dim, size in enumerate(positions.shape):
        index = list(origin)
        index[dim] = min(1, size - 1)
        stride = int(positions[tuple(index)]) - offset if size > 1 else 0
        if stride < 0:
            return None
        strides.append(stride)
    span = sum((n - 1) * step for n, step in zip(positions.shape, strides)) + 1
    device = positions.device
    if span <= 2 * positions.numel():
        line = torch.arange(offset, offset + span, dtype=positions.dtype, device=device)
        expected = line.as_strided(positions.shape, strides)
    else:
        expected = torch.full_like(positions, offset)
        for dim, (size, stride) in enumerate(zip(positions.shape, strides)):
            steps = torch.arange(size, device=device) * stride
            expected += steps.view([-1 if d == dim else 1 for d in range(positions.dim())])
    return (offset, tuple(strides)) if torch.equal(positions, expected) else None


def _affine_rows(
    positions: torch.Tensor,
) -> Tuple[Tuple[int, ...], Tuple[int, Tuple[int, ...]]] | None:
    r"""``(shape, (offset, strides))`` of the run of rows ``positions`` (shaped ``(...,
    rows, columns)``) as one strided view of the flat buffer: the run whole where its
    positions are affine (:func:`_affine`), else its rows split into ``rows / k`` equal
    runs of ``k`` (``(..., rows / k, k, columns)``), ``k`` the rows before the first
    break in the rows' step, where that is affine: the rows of several heads of one
    parameter in one factor (a grouped-query attention's query heads sharing a key
    head: the positions of row :math:`r` are
    :math:`o + (r / k)\, s_h + (r \bmod k)\, s_r + c\, s_c`); else ``None``."""
    rows = positions.shape[-2]
    steps = positions[(0,) * (positions.dim() - 2)][:, 0].diff()
    breaks = (steps != steps[0]).nonzero() if rows > 2 else steps.new_empty(0)
    if not breaks.numel():  # the rows' step is constant: the run whole, if at all
        affine = _affine(positions)
        return None if affine is None else (tuple(positions.shape), affine)
    k = int(breaks[0]) + 1
    if rows % k:
        return None
    split = positions.unflatten(-2, (rows // k, k))  # a view
    affine = _affine(split)
    return None if affine is None else (tuple(split.shape), affine)


def _split_strides(strides: Tuple[int, ...], shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a contiguous point's view ``shape`` of a run of rows whose own
    strides are ``strides`` (``(..., rows, columns)``): the same where the run is not
    split (:func:`_affine_rows`), else those of its rows split into equal runs."""
    if len(shape) == len(strides):
        return strides
    k = shape[-2]
    return (*strides[:-2], k * strides[-2], strides[-2], strides[-1])


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def strided_blocks(
    destinations: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size],
    batches: Sequence[List[Tuple[int, ...]]],
    flat: FlatBuffer,
    trash: int,
    padded: Sequence[bool] | None = None,
) -> Tuple[List[_Block], List[List[View]]] | None:
    """The :attr:`_Rest.blocks` of groups whose entries go to the flat buffer positions
    ``destinations`` (one flattened tensor per group, of the group's ``shapes``; the
    padding to ``trash``), or ``None`` where they are not a few strided blocks.

    Each group's point is read as ``(batch, rows, columns)``, its batch split into its
    members' ``batches`` (their leading dimensions, e.g. layers and heads). In each
    member, a run of consecutive rows whose entries belong to one parameter is one block
    where its positions are affine in (member's batch, row, column), as the rows of a
    factor are where every layer's parameters are laid out alike, or in (member's
    batch, head, row, column) where the run holds several heads' rows
    (:func:`_affine_rows`): then the write into
    the flat buffer and the read of the gradient are one strided copy per block, with
    no index per entry, and as many copies whatever the depth. Rows all of whose
    positions are ``trash`` are padding (zeroed in the gradient); ``padded[g]`` ``False``
    says that group ``g`` has none (its rows are not searched for it)."""
    starts = torch.tensor(flat.starts, dtype=torch.int64)
    blocks: List[_Block] = []
    padding: List[List[View]] = []
    padded = [True] * len(destinations) if padded is None else padded
    for group, (destination, shape, members) in enumerate(zip(destinations, shapes, batches)):
        if len(shape) < 2:
            return None
        rows, width = shape[-2], shape[-1]
        cube, first, pads = destination.view(-1, rows, width), 0, []
        for leading in members:
            count = math.prod(leading)
            part = cube[first : first + count].view(*leading, rows, width)
            strides = _contiguous_strides(part.shape)
            base = first * rows * width
            runs = _row_runs(part, starts, trash if padded[group] else None)
            if runs is None:
                return None
            for begin, end, is_padding in runs:
                extent = (*leading, end - begin, width)
                if is_padding:
                    pads.append((base + begin * width, extent, strides))
                    continue
                found = _affine_rows(part[..., begin:end, :])
                if found is None:
                    return None
                shape, (offset, flat_strides) = found
                view = (base + begin * width, shape, _split_strides(strides, shape))
                blocks.append(_Block(group, view, (offset, shape, flat_strides)))
            first += count
        if first != cube.shape[0]:
            return None
        padding.append(pads)
    return blocks, padding


def _row_runs(
    part: torch.Tensor, starts: torch.Tensor, trash: int | None
) -> List[Tuple[int, int, bool]] | None:
    """Runs ``(begin, end, padding)`` of consecutive rows of ``part`` (positions shaped
    ``(..., rows, columns)``) whose entries all belong to one parameter (the one whose
    start precedes the row's first entry), or are all ``trash``; ``None`` where a row
    mixes padding and entries. ``trash`` ``None``: no padding (no row is searched)."""
    rows = part.shape[-2]
    if trash is None:
        first = part[(0,) * (part.dim() - 2)][:, 0].contiguous()
        padding_rows = [False] * rows
    else:
        by_row = part.movedim(-2, 0).reshape(rows, -1)
        is_trash = by_row == trash
        if not bool((is_trash.all(1) | ~is_trash.any(1)).all()):
            return None
        first = by_row[:, 0].contiguous()
        padding_rows = is_trash.all(1).tolist()
    owner = torch.searchsorted(starts, first, right=True).tolist()
    runs: List[Tuple[int, int, bool]] = []
    for row in range(rows):
        key = (padding_rows[row], -1 if padding_rows[row] else owner[row])
        if runs and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], row + 1, key)
        else:
            runs.append((row, row + 1, key))
    return [(begin, end, key[0]) for begin, end, key in runs]


class BallLayout:
    """Where the ball's vectors and the model's perturbed parameters live.

    Built once per sharpness call from the bound plan, the base parameters and the ball
    groups of the plan's groups (one per plan group, in its order). :attr:`groups` are
    the groups Auto-PGD works on: the unfused ones in their order, then one flat group
    per fused buffer. :meth:`objective` gives, for one batch, the objective that
    :func:`~geoopt_quotient.maximize_in_ball` evaluates through :meth:`evaluate`.

    Parameters
    ----------
    plan : BoundPlan
        The symmetry plan bound to the model.
    base : dict of str to torch.Tensor
        The base parameters (detached), by name.
    groups : list of BallGroup
        One ball group per group of ``plan``, with the gathered base points.
    parameters : dict of str to torch.Tensor, optional
        The model's own parameters, by name: the fused groups' base point then shares
        their storage instead of copying it (:func:`shared_base`): each parameter that
        owns its storage alone moves into the flat buffer (the same object, the same
        values, now a view of it), and parameters that are already views of an earlier
        call's buffer laid out alike are used where they are. One parameter-sized
        vector less (:meth:`bytes_per_parameter`); the base point is only read, never
        written. The parameters of the other groups (the symmetry groups) move alike
        into their flat buffer, which is the one the model reads their perturbed point
        from: it holds that point during each pass, and their base point again after it
        (:meth:`restore`, from the groups' stacked points); one buffer as large as those
        parameters less. Parameters that cannot move (a tensor subclass such as a
        sharded ``DTensor``, storage shared with another tensor of the model) are
        copied.
    """

    def __init__(
        self,
        plan: BoundPlan,
        base: Dict[str, torch.Tensor],
        groups: List[BallGroup],
        parameters: Dict[str, torch.Tensor] | None = None,
    ):
        fused: Dict[Tuple, List[int]] = {}
        rest: List[int] = []
        for index, (group, ball_group) in enumerate(zip(plan.groups, groups)):
            key = _fusible(group, ball_group)
            if key is None:
                rest.append(index)
            else:
                fused.setdefault(key, []).append(index)
        self.plan = plan
        stacks = group_stacks(groups, rest)
        self._stack_list = stacks
        self._fused_members = list(fused.values())
        self.groups: List[BallGroup] = [stack.group(groups) for stack in stacks]
        self._fused: List[FlatBuffer] = []
        self.shared_bytes = 0
        for (dtype, device, eps), members in fused.items():
            names = [plan.groups[i].param_names[0] for i in members]
            flat = FlatBuffer(names, [base[n].shape for n in names], dtype, device)
            if parameters is None:
                point = flat.filled([base[n] for n in names])
            else:
                point, shared = shared_base(flat, parameters)
                self.shared_bytes += shared
            self.groups.append(BallGroup(point, AdaptiveEuclidean(eps=eps)))
            self._fused.append(flat)
        self._rests = self._rest_buffers(plan, base, self.groups, stacks)
        #: the unfused groups' flat buffers where they are the model's own storage
        #: (``parameters`` given): written with the perturbed points for each pass and
        #: with the base point (the groups' stacked copy) after it (:meth:`restore`)
        self._in_place: List[torch.Tensor] | None = None
        self.in_place_bytes = 0
        if parameters is not None:
            self._in_place = []
            for rest in self._rests:
                buffer, shared = shared_base(rest.flat, parameters)
                self._in_place.append(buffer)
                self.in_place_bytes += shared
            fused_points = [g.point for g in self.groups[len(stacks) :]]
            release_left_behind(parameters, fused_points + self._in_place)
        self._perturbed_written = False
        self.flats: List[FlatBuffer] = self._fused + [r.flat for r in self._rests]
        self.names = [n for flat in self.flats for n in flat.names]
        self._buffers: List[torch.Tensor] | None = None
        self._segments = [flat.segments(_segment_count(flat)) for flat in self.flats]
        self._leaves: List[_GradientLeaves] | None = None
        self._grads: List[torch.Tensor] = []
        self._own: List[torch.Tensor] | None = None
        #: whether an evaluation may write the gradient over the perturbed points
        #: (:meth:`evaluation_vector`); cleared where a loss reads a weight after the
        #: backward pass is done with it
        self.lends = True
        self._rest_points: List[torch.Tensor | None] = [None] * len(stacks)

    @staticmethod
    def _rest_buffers(
        plan: BoundPlan,
        base: Dict[str, torch.Tensor],
        groups: List[BallGroup],
        stacks: List[_Stack],
    ) -> List[_Rest]:
        """The unfused groups' flat buffers, one per ``(dtype, device)``; ``groups`` are
        the layout's (one per stack, first)."""
        by_key: Dict[Key, List[int]] = {}
        for position in range(len(stacks)):
            point = groups[position].point
            by_key.setdefault((point.dtype, point.device), []).append(position)
        out = []
        known = _STRUCTURES.setdefault(plan, {})
        for (dtype, device), positions in by_key.items():
            shapes = [groups[p].point.shape for p in positions]
            structure_key = (
                dtype,
                device,
                tuple((tuple(stacks[p].members), stacks[p].padded) for p in positions),
                tuple(tuple(shape) for shape in shapes),
            )
            if structure_key in known:  # an earlier call's, on this plan: no index made
                flat, blocks = known[structure_key]
                out.append(_Rest(flat, positions, shapes, None, None, blocks))
                continue
            names: List[str] = []
            for p in positions:
                for index in stacks[p].members:
                    names += [n for n in plan.groups[index].param_names if n not in names]
            padded = any(stacks[p].padded for p in positions)
            trailing = max(ALIGNMENT // dtype.itemsize, 1) if padded else 0
            flat = FlatBuffer(names, [base[n].shape for n in names], dtype, device, trailing)
            start = dict(zip(flat.names, flat.starts))
            trash = flat.size - trailing
            destinations = [stacks[p].destination(plan, start, trash, device) for p in positions]
            members = [plan.groups[i] for p in positions for i in stacks[p].members]
            once = covered_once(members, flat)
            blocks = destination = source = None
            if once:  # every parameter entry written once: blocks may do
                batches = [stacks[p].batch_shapes(plan, groups[p]) for p in positions]
                padded = [stacks[p].padded for p in positions]
                blocks = strided_blocks(destinations, shapes, batches, flat, trash, padded)
            if blocks is None:  # the index maps only where no blocks do
                destination, source = index_maps(torch.cat(destinations), flat, once)
            else:  # no index per entry: kept for the next call on this plan
                known[structure_key] = (flat, blocks)
            out.append(_Rest(flat, positions, shapes, destination, source, blocks))
        return out

    def plan_vectors(self, vectors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """A vector of :attr:`groups` (e.g. an Auto-PGD iterate or gradient) as one tensor
        per group of the plan, in the plan's order and each group's point shape: the
        inverse of the layout's stacking and fusing (views where possible, no copy of the
        fused buffers)."""
        out: List[torch.Tensor | None] = [None] * len(self.plan.groups)
        for stack, vector in zip(self._stack_list, vectors):
            for index, piece in zip(stack.members, stack.unstacked(vector, self.plan)):
                out[index] = piece
        unfused = len(self._stack_list)
        for members, flat, vector in zip(self._fused_members, self._fused, vectors[unfused:]):
            views, _ = flat.pieces(vector)
            for index, view in zip(members, views):
                out[index] = view.view(self.plan.groups[index].shape)
        return out  # type: ignore[return-value]

    def vector_bytes(self, state_dtype: torch.dtype | None = None) -> int:
        """Memory of one vector of the ball (its groups, stored as ``state_dtype`` asks:
        :func:`~geoopt_quotient.sharpness.apgd.state_dtype_for`)."""
        return state_vector_bytes([g.point for g in self.groups], state_dtype)

    def buffer_bytes(self) -> int:
        """Memory of the perturbed parameters' flat buffers (one copy of the model's
        trainable parameters, plus alignment gaps)."""
        return sum(f.size * f.dtype.itemsize for f in self.flats)

    def bytes_per_parameter(
        self, keep_best_gradient: bool, state_dtype: torch.dtype | None = None
    ) -> Dict[str, float]:
        """The ball's memory per trainable model parameter during Auto-PGD, by part, with
        its iterates and gradients stored as ``state_dtype`` asks
        (:func:`~geoopt_quotient.sharpness.apgd.state_dtype_for`).

        ``base``: the fused groups' base point (a copy of their parameters) and the
        symmetry groups' gathered points; ``perturbed``: the flat buffers the model reads
        (less the symmetry groups' where they are the model's own storage, written in
        place and restored);
        ``iterates``: the current, previous and best perturbation; ``gradients``: the
        current gradient and the best iterate's, if kept; else the gradient is the
        layout's :meth:`evaluation_vector`, over the fused groups' perturbed points, and
        only its tensors for the other groups count here (in their parameters' dtype),
        with the Riemannian gradient's vector where the state's dtype is another;
        ``staging``: where the unfused
        groups' flat buffer has index maps, one buffer for their perturbed points,
        joined before they are written into it, and for its gradient, before it is read
        into the groups' shapes (:meth:`_Rest.scratch`; none with strided blocks:
        :meth:`_Rest.scatters`);
        ``index``: the maps between the unfused groups' entries and their flat buffer
        (an integer per entry, :func:`index_maps`); ``total``: their sum. The model's own
        parameters and the pass's activations are not counted.
        """
        parameters = sum(math.prod(s) for f in self.flats for s in f.shapes)
        vector = self.vector_bytes(state_dtype)
        parts = {
            "base": self.base_bytes(),
            "perturbed": self.buffer_bytes() - self.in_place_bytes,
            "iterates": 3 * vector,
            "gradients": 2 * vector if keep_best_gradient else self._lent_bytes(state_dtype),
            "staging": sum(rest.staging_bytes() for rest in self._rests),
            "index": sum(rest.index_bytes() for rest in self._rests),
        }
        parts["total"] = sum(parts.values())
        return {part: size / parameters for part, size in parts.items()}

    def _own_rest_bytes(self) -> int:
        """Memory of :meth:`evaluation_vector`'s tensors of the unfused groups."""
        return sum(
            math.prod(shape) * rest.flat.dtype.itemsize
            for rest in self._rests
            for shape in rest.shapes
        )

    def _lent_bytes(self, state_dtype: torch.dtype | None) -> int:
        """Memory of the gradient where it is :meth:`evaluation_vector`: that vector's
        tensors of the unfused groups, and a vector of the state where the state's dtype
        is not the parameters' (a float32 state of a bfloat16 model: the Riemannian
        gradient is made in new tensors of the state's dtype)."""
        points = [g.point for g in self.groups]
        converted = any(state_dtype_for(p.dtype, state_dtype) != p.dtype for p in points)
        return self._own_rest_bytes() + (self.vector_bytes(state_dtype) if converted else 0)

    def base_bytes(self) -> int:
        """Memory of the groups' base points beside the model's own parameters (less
        what shares their storage)."""
        points = sum(g.point.numel() * g.point.element_size() for g in self.groups)
        return points - self.shared_bytes

    def _perturbed_buffers(self) -> List[torch.Tensor]:
        if self._buffers is None:
            self._buffers = [flat.empty() for flat in self._fused]
            for flat, buffer in zip(self._fused, self._buffers):
                _zero(flat.pieces(buffer)[1])
            if self._in_place is not None:
                self._buffers += self._in_place
            else:
                self._buffers += [rest.flat.empty() for rest in self._rests]
        return self._buffers

    def restore(self) -> None:
        """The base point written back into the unfused groups' flat buffers that are the
        model's own storage, after a pass read the perturbed point there (from the
        groups' stacked base points, an exact copy: no rounding). Nothing to do where
        no pass wrote since, or where the buffers are the layout's own."""
        if not self._perturbed_written or self._in_place is None:
            return
        with torch.no_grad():
            for rest, buffer in zip(self._rests, self._in_place):
                rest.write([self.groups[p].point for p in rest.groups], buffer)
        self._perturbed_written = False

    def perturbed_buffer(self, index: int) -> torch.Tensor | None:
        """Where the perturbed point of group ``index`` is written: the fused groups'
        flat buffers are the ones the model reads; the other groups' points are views of
        one buffer per flat buffer, joined as its write reads them
        (:meth:`_Rest.perturbed_points`); ``None`` for the groups whose points are
        written from the evaluation's own vectors (:meth:`evaluation_vectors`)."""
        unfused = len(self._rest_points)
        if index >= unfused:
            return self._perturbed_buffers()[index - unfused]
        if self._rest_of(index).scatters():
            return None
        if self._rest_points[index] is None:
            rest = self._rest_of(index)
            for position, view in zip(rest.groups, rest.perturbed_points()):
                self._rest_points[position] = view
        return self._rest_points[index]  # type: ignore[return-value]

    def _rest_of(self, index: int) -> _Rest:
        return next(r for r in self._rests if index in r.groups)

    def evaluation_vectors(self, spare: Sequence[torch.Tensor] | None) -> List[torch.Tensor | None]:
        """Per group, where an evaluation writes its perturbed point and then its
        gradient, for the groups whose flat buffer :meth:`~_Rest.scatters`: their
        tensors of ``spare`` (a vector no longer needed, which :meth:`fits`), else new
        ones; ``None`` for the other groups (:meth:`perturbed_buffer`). The point is
        read once, when :meth:`parameters` writes it into the flat buffer the model
        reads, before the pass; the gradient is written during the backward pass."""
        out: List[torch.Tensor | None] = [None] * len(self.groups)
        for rest in self._rests:
            if not rest.scatters():
                continue
            dtype, device = rest.flat.dtype, rest.flat.device
            for position, shape in zip(rest.groups, rest.shapes):
                if spare is not None:
                    out[position] = spare[position]
                else:
                    out[position] = torch.empty(shape, dtype=dtype, device=device)
        return out

    def evaluation_vector(self) -> List[torch.Tensor]:
        """The layout's own vector of :attr:`groups`, the same at every call, into which
        an evaluation with ``own_vector`` (:meth:`LayoutObjective.evaluate_ball`) writes
        the perturbed points and then their gradient: the fused groups' tensors are the
        flat buffers the model reads (the gradient of each segment written over its
        point once the backward pass is done with it), the other groups' tensors of
        their own, whence the points are copied into the buffer the model reads."""
        if self._own is None:
            own: List[torch.Tensor | None] = [None] * len(self._rest_points)
            for rest in self._rests:
                dtype, device = rest.flat.dtype, rest.flat.device
                for position, shape in zip(rest.groups, rest.shapes):
                    own[position] = torch.empty(shape, dtype=dtype, device=device)
            self._own = own + self._perturbed_buffers()[: len(self._fused)]  # type: ignore[operator]
        return self._own

    def has_evaluation_vector(self) -> bool:
        """Whether :meth:`evaluation_vector` was made (by an evaluation that returned
        its gradient there)."""
        return self._own is not None

    def owns(self, vector: Sequence[torch.Tensor]) -> bool:
        """Whether ``vector`` holds the tensors of :meth:`evaluation_vector` (by
        identity)."""
        own = self._own
        return own is not None and all(v is o for v, o in zip(vector, own))

    def _as_own(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """``grads`` where each of its tensors is :meth:`evaluation_vector`'s (a new
        list: the caller may replace its entries); else with copies of those that are
        (a gradient that autograd or a pullback made anew for some group): a caller may
        keep that vector."""
        own = self.evaluation_vector()
        if all(g is o for g, o in zip(grads, own)):
            return grads
        mine = {id(o) for o in own}
        return [g.clone() if id(g) in mine else g for g in grads]

    def objective(self, loss: Callable[[Dict[str, torch.Tensor]], Any]) -> LayoutObjective:
        """The objective of :func:`~geoopt_quotient.maximize_in_ball` for ``loss(params)``
        (a function of the perturbed parameters by name, e.g. one batch's loss)."""
        return LayoutObjective(self, loss)

    def parameters(
        self,
        points: Sequence[torch.Tensor],
        grad: bool,
        spare: Sequence[torch.Tensor] | None = None,
        sweep: Callable[[int, torch.Tensor], Any] | None = None,
        own: Sequence[torch.Tensor | None] | None = None,
        own_vector: bool = False,
    ) -> Tuple[List, Dict]:
        """(leaves, parameters by name) for perturbed ``points`` of :attr:`groups`: the
        points written into the flat buffers (unless already there), one leaf per buffer
        (requiring grad if ``grad``), and the parameters as views of the leaves.

        The gradients of the next :meth:`flat_gradients` go into the fused groups'
        vectors of ``spare`` (a vector of :attr:`groups` no longer needed, which
        :meth:`fits`), and for the other groups into ``own``
        (:meth:`evaluation_vectors`, made from ``spare`` if not given) or buffers of the
        layout's own: not into new allocations, which for a model-sized buffer cost a
        page fault per page. ``sweep(group, gradient)``: the sweep of a fused group's
        gradient, run as the backward pass writes it (:class:`_Arrival`), or ``None``
        (:meth:`~geoopt_quotient.sharpness.apgd.TangentBall.gradient_sweep`).
        ``own_vector``: the fused groups' gradients are written over their points, in
        the flat buffers the model reads (:meth:`evaluation_vector`; ``spare`` unused)."""
        buffers = self._perturbed_buffers()
        unfused = len(self._rest_points)
        with torch.no_grad():
            for point, buffer in zip(points[unfused:], buffers):
                if point.data_ptr() != buffer.data_ptr():
                    buffer.copy_(point.detach())
            for rest, buffer in zip(self._rests, buffers[len(self._fused) :]):
                self._perturbed_written = True
                rest.write([points[p].detach() for p in rest.groups], buffer)
        if not grad:
            views = [v for f, b in zip(self.flats, buffers) for v in f.pieces(b)[0]]
            return [], dict(zip(self.names, views))
        self._grads = self.gradient_buffers(spare, own, own_vector)
        if self._leaves is None:
            self._leaves = [
                _GradientLeaves(flat, buffer, segments)
                for flat, buffer, segments in zip(self.flats, buffers, self._segments)
            ]
        leaves = []
        fused = len(self._fused)
        for position, (made, segments, out) in enumerate(
            zip(self._leaves, self._segments, self._grads)
        ):
            # written above: a graph of an earlier pass that saved a leaf is stale
            torch.autograd.graph.increment_version(made.leaves)
            written_over = made.by_segment if own_vector and position < fused else None
            arrival = None
            if sweep is not None and position < fused:
                sweeping = sweep(unfused + position, out)
                pays = sweeping is not None and sweeping.blocks >= ARRIVAL_MIN_BLOCKS
                arrival = _Arrival(sweeping, out) if pays else None
            elif position >= fused:
                rest = self._rests[position - fused]
                arrival = _Scatter(rest, segments, out) if rest.scatters() else None
            made.inbox.receiver = _Receiver(segments, out, arrival, written_over)
            leaves += made.leaves
        return leaves, dict(zip(self.names, leaves))

    def gradient_buffers(
        self,
        spare: Sequence[torch.Tensor] | None,
        own: Sequence[torch.Tensor | None] | None = None,
        own_vector: bool = False,
    ) -> List:
        """Where the flat buffers' gradients go: the fused groups' vectors of ``spare``
        (which :meth:`fits`), else new buffers, or with ``own_vector`` the flat buffers
        the model reads (over their points); for the other groups, the groups'
        tensors of ``own`` (:meth:`evaluation_vectors`) where their buffer
        :meth:`~_Rest.scatters` (a list per buffer), else a flat buffer of the
        layout's own, read out at once (:meth:`point_gradients`), the same at every
        call."""
        unfused = len(self._rest_points)
        if own_vector:
            out: List = self._perturbed_buffers()[: len(self._fused)]
        elif spare is None:
            out = [flat.empty() for flat in self._fused]
        else:
            out = list(spare[unfused:])
        if own is None:
            own = self.evaluation_vectors(spare)
        for rest in self._rests:
            if rest.scatters():
                out.append([own[p] for p in rest.groups])
            else:
                out.append(rest.gradient_buffer())
        return out

    def fits(self, vector: Sequence[torch.Tensor]) -> bool:
        """Whether ``vector`` (one tensor per group of :attr:`groups`) can receive the
        gradients: contiguous, in the flat buffers' dtypes, the fused groups' flat."""
        unfused = len(self._rest_points)
        fused = zip(vector[unfused:], self._fused)
        if not all(_fits(v, flat) for v, flat in fused):
            return False
        return all(
            _fits_shape(vector[p], rest.flat.dtype, rest.flat.device, shape)
            for rest in self._rests
            for p, shape in zip(rest.groups, rest.shapes)
        )

    def flat_gradients(self) -> List[torch.Tensor]:
        """The flat gradients of the last :meth:`parameters` call with ``grad=True``, after
        its backward pass (zero for the parameters that got no gradient)."""
        for made in self._leaves or []:
            if made.inbox.receiver is not None:
                made.inbox.receiver.finish()
                made.inbox.receiver = None
        flat, self._grads = self._grads, []
        return flat

    def point_gradients(
        self,
        flat_grads: Sequence[torch.Tensor | None],
        spare: Sequence[torch.Tensor] | None = None,
    ) -> List[torch.Tensor]:
        """The gradients with respect to the groups' perturbed points, from the flat
        buffers' gradients (in the groups' order; the fused ones are the buffers'), the
        other groups' written into their vectors of ``spare`` (which :meth:`fits`)."""
        unfused = len(self._rest_points)
        out: List[torch.Tensor | None] = [None] * len(self.groups)
        for position, grad in enumerate(flat_grads[: len(self._fused)]):
            out[unfused + position] = grad
        for rest, grad in zip(self._rests, flat_grads[len(self._fused) :]):
            if rest.scatters():  # written there by the backward pass (_Scatter)
                read = grad
            else:
                read = rest.read(grad, None if spare is None else [spare[p] for p in rest.groups])
            for position, g in zip(rest.groups, read):
                out[position] = g
        return out  # type: ignore[return-value]


#: Per bound plan, the flat buffers of its unfused groups and their strided blocks
#: (:meth:`BallLayout._rest_buffers`): they depend on the plan's groups, their points'
#: shapes, dtype and device alone, so the next call on the same plan (a training
#: monitor's, every few steps) reuses them instead of deriving them again from a
#: position per entry. Index maps (:func:`index_maps`) are not kept: as large as the
#: groups, they would stay in memory between calls.
_STRUCTURES: WeakIdKeyDictionary = WeakIdKeyDictionary()

#: The parameters that :func:`shared_base` moved, and the storage each moved into: a
#: later call may move them again, out of a buffer that holds nothing else.
_MOVED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_base(flat: FlatBuffer, parameters: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """A flat base point of ``flat``'s layout that shares the storage of the model's
    ``parameters`` (by name), and the bytes of it that do.

    Where the parameters of ``flat`` are already views of one buffer laid out as
    ``flat`` (an earlier call's), that buffer is the point: nothing is copied. Otherwise
    the point is a new buffer holding their values, and each parameter that may move
    (:func:`_movable`) moves into it (``param.data`` becomes its view, so the old storage
    is freed once nothing else holds it); the others stay where they are, their entries
    copied.
    """
    params = [parameters[n] for n in flat.names]
    owners = _storage_owners(parameters)
    point = _laid_out(flat, params, owners)
    if point is not None:
        _zero(flat.pieces(point)[1])
        return point, flat.size * flat.dtype.itemsize
    point = flat.filled([p.detach() for p in params])
    ours = _moved_counts(parameters)
    shared = 0
    with torch.no_grad():
        for param, view in zip(params, flat.pieces(point)[0]):
            if _movable(param, view, owners, ours):
                param.data = view
                _MOVED[param] = _storage_key(view)
                shared += view.numel() * view.element_size()
    return point, shared


def release_left_behind(parameters: Dict[str, torch.Tensor], points: Sequence[torch.Tensor]):
    """Each parameter that an earlier call moved into a buffer that is not among this
    call's ``points`` gets a storage of its own (a copy), so that the earlier buffer is
    freed once none of its parameters is left in it."""
    keep = {_storage_key(p) for p in points}
    with torch.no_grad():
        for param in _distinct(parameters):
            key = _MOVED.get(param)
            if key is not None and key not in keep and _storage_key(param) == key:
                param.data = param.data.clone()
                del _MOVED[param]


def _storage_key(tensor: torch.Tensor) -> Tuple[str, int]:
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def _distinct(parameters: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    """The parameter objects of ``parameters``, each once (a tied one has several names)."""
    return list({id(p): p for p in parameters.values()}.values())


def _storage_owners(parameters: Dict[str, torch.Tensor]) -> Dict[Tuple[str, int], int]:
    """How many of the model's parameter objects use each storage."""
    owners: Dict[Tuple[str, int], int] = {}
    for param in _distinct(parameters):
        if _plain(param):
            key = _storage_key(param)
            owners[key] = owners.get(key, 0) + 1
    return owners


def _moved_counts(parameters: Dict[str, torch.Tensor]) -> Dict[Tuple[str, int], int]:
    """How many of the model's parameter objects are in each storage they were moved into."""
    counts: Dict[Tuple[str, int], int] = {}
    for param in _distinct(parameters):
        key = _MOVED.get(param)
        if key is not None and _plain(param) and _storage_key(param) == key:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _plain(param: torch.Tensor) -> bool:
    """A dense tensor of torch's own (not a subclass such as ``DTensor``), with storage."""
    data = param.data
    return type(data) is torch.Tensor and data.layout == torch.strided and not data.is_meta


def _movable(param: torch.Tensor, view: torch.Tensor, owners: Dict, ours: Dict) -> bool:
    """Whether ``param`` may move into ``view``: plain, contiguous, in the view's dtype,
    device and shape, and alone in a storage of its own size, or in a buffer an earlier
    call moved it into that holds no other parameter but those moved there."""
    data = param.data
    if not (
        _plain(param)
        and data.dtype == view.dtype
        and data.device == view.device
        and data.shape == view.shape
        and data.is_contiguous()
    ):
        return False
    key = _storage_key(param)
    if _MOVED.get(param) == key:
        return owners.get(key) == ours.get(key)
    alone = data.untyped_storage().nbytes() == data.numel() * data.element_size()
    return alone and data.storage_offset() == 0 and owners.get(key) == 1


def _laid_out(flat: FlatBuffer, params: List[torch.Tensor], owners: Dict) -> torch.Tensor | None:
    """The buffer that ``params`` are views of, if they are laid out as ``flat`` in one
    storage of ``flat``'s size that no other parameter uses; else ``None``."""
    if not params or not all(_plain(p) for p in params):
        return None
    first = params[0].data
    key, nbytes = _storage_key(first), flat.size * flat.dtype.itemsize
    if first.untyped_storage().nbytes() != nbytes:
        return None
    for param, start, shape in zip(params, flat.starts, flat.shapes):
        data = param.data
        if (
            _storage_key(data) != key
            or data.dtype != flat.dtype
            or data.storage_offset() != start
            or data.shape != shape
            or not data.is_contiguous()
        ):
            return None
    if owners.get(key) != len({id(p) for p in params}):
        return None
    return first.as_strided((flat.size,), (1,), 0)


def _fits(vector: torch.Tensor, flat: FlatBuffer) -> bool:
    """Whether ``vector`` can hold a flat buffer of ``flat``'s layout."""
    return _fits_shape(vector, flat.dtype, flat.device, torch.Size((flat.size,)))


def _fits_shape(vector: torch.Tensor, dtype, device, shape: torch.Size) -> bool:
    return (
        vector.shape == shape
        and vector.dtype == dtype
        and vector.device == device
        and vector.is_contiguous()
    )


#: Quotient groups of one geometry are stacked into one batch whose two factors have
#: equal rows (the shorter ones padded with zero rows), where a group's padding adds at
#: most this fraction to its entries.
MAX_PADDING = 1 / 8


def _stack_key(group: BallGroup) -> Tuple | None:
    """Groups with equal keys can be stacked (:class:`_Stack`); ``None``: never."""
    manifold = group.manifold
    key = stack_key(manifold)
    if key is None or group.path is not None or group.point.requires_grad:
        return None
    point = group.point
    return (point.dtype, point.device, point.shape[-1], *key)


@dataclass
class _Stack:
    r"""Ball groups (plan indices ``members``) as one: a single group as it is
    (``rows = 0``), or :class:`~geoopt_quotient.GLQuotient` groups of one geometry as one
    batch of points :math:`(G; H)` with ``rows`` rows in each factor, the missing rows
    zero.

    :class:`~geoopt_quotient.GLQuotient` acts on each point of a batch independently and
    the ball's metric is the sum over the batch, so stacking changes only the order of
    sums. A zero row of :math:`G` or :math:`H` changes neither Gram matrix nor any
    product with it, and every operation of the geometry keeps it zero: the gradient
    there is zero (it is read from a zero gap of the flat gradient), and the Riemannian
    gradient, the horizontal projection, the retraction and its pullback, the
    Christoffel term and the Auto-PGD combination are all of the form (row of the point,
    of :math:`\xi` or of the cotangent) times an :math:`h \times h` matrix. Holds for
    iterates that start at zero (or in the stack), as the worst case's do. With equal
    factors, the geometry's operations are batched products over both factors at once
    (:mod:`~geoopt_quotient.manifolds._gl_tangent`).
    """

    members: List[int]
    rows: int = 0

    @property
    def padded(self) -> bool:
        return self.rows > 0

    def group(self, groups: Sequence[BallGroup]) -> BallGroup:
        """The ball group of the stack."""
        if not self.padded:
            return groups[self.members[0]]
        first = groups[self.members[0]]
        pieces = [groups[i].point for i in self.members]
        point = self._stacked(pieces, [groups[i].manifold for i in self.members], 0)
        stacked = first.manifold.stacked(self.rows)
        return BallGroup(point.to(first.point.dtype), stacked)

    def unstacked(self, vector: torch.Tensor, plan: BoundPlan) -> List[torch.Tensor]:
        """The members' parts of a vector of the stack's shape, in their own shapes (the
        inverse of :meth:`_stacked`, padding dropped)."""
        if not self.padded:
            return [vector]
        shapes = [plan.groups[i].shape for i in self.members]
        counts = [math.prod(s[:-2]) for s in shapes]
        out = []
        for part, shape, index in zip(vector.split(counts), shapes, self.members):
            manifold = plan.groups[index].manifold
            n, m = manifold.n, manifold.m
            rows = torch.cat((part[:, :n], part[:, self.rows : self.rows + m]), dim=1)
            out.append(rows.reshape(shape))
        return out

    def _stacked(self, pieces: List[torch.Tensor], manifolds: List, fill) -> torch.Tensor:
        """``pieces`` (points or index tensors of the members) in the stack's shape, the
        padding ``fill``."""
        rank = pieces[0].shape[-1]
        flat = [p.reshape(-1, p.shape[-2], rank) for p in pieces]
        out = flat[0].new_full((sum(f.shape[0] for f in flat), 2 * self.rows, rank), fill)
        for part, piece, manifold in zip(out.split([f.shape[0] for f in flat]), flat, manifolds):
            n, m = manifold.n, manifold.m
            part[:, :n] = piece[:, :n]
            part[:, self.rows : self.rows + m] = piece[:, n:]
        return out

    def batch_shapes(self, plan: BoundPlan, group: BallGroup) -> List[Tuple[int, ...]]:
        """The members' batch shapes (their points' leading dimensions), in the order of
        the stack's batch; the group's own for a single group."""
        if not self.padded:
            return [tuple(group.point.shape[:-2])]
        return [tuple(plan.groups[i].shape[:-2]) for i in self.members]

    def destination(
        self, plan: BoundPlan, start: Dict[str, int], trash: int, device
    ) -> torch.Tensor:
        """Position in the flat buffer of each entry of the stack's point (flattened), on
        ``device``; ``trash`` for the padding."""
        own = [plan.groups[i].positions(start, trash, device).reshape(-1) for i in self.members]
        if not self.padded:
            return own[0]
        pieces = [d.view(plan.groups[i].shape) for d, i in zip(own, self.members)]
        manifolds = [plan.groups[i].manifold for i in self.members]
        return self._stacked(pieces, manifolds, trash).reshape(-1)


def group_stacks(groups: Sequence[BallGroup], indices: List[int]) -> List[_Stack]:
    """The groups ``indices`` as stacks: those of one :func:`_stack_key` whose factors
    pad to the longest one's rows within :data:`MAX_PADDING` as one, the others alone
    (in the order of their first member)."""
    by_key: Dict[Tuple, List[int]] = {}
    for index in indices:
        key = _stack_key(groups[index])
        by_key.setdefault(("alone", index) if key is None else key, []).append(index)
    out = []
    for key, members in by_key.items():
        if key[0] == "alone":
            out.append(_Stack(members))
            continue
        rows = max(max(groups[i].manifold.n, groups[i].manifold.m) for i in members)
        fits = [i for i in members if _padding(groups[i], rows) <= MAX_PADDING]
        alone = [i for i in members if i not in fits]
        if fits and (len(fits) > 1 or _padding(groups[fits[0]], rows) > 0):
            out.append(_Stack(fits, rows))
        else:
            alone = members
        out += [_Stack([i]) for i in alone]
    return out


def _padding(group: BallGroup, rows: int) -> float:
    """The fraction of zero entries that padding ``group``'s factors to ``rows`` adds."""
    manifold = group.manifold
    return 2 * rows / (manifold.n + manifold.m) - 1


class LayoutObjective:
    """One batch's objective on a :class:`BallLayout`: plain calls take points of the
    layout's groups; :meth:`evaluate_ball` is Auto-PGD's evaluation through the flat
    buffers."""

    def __init__(self, layout: BallLayout, loss: Callable[[Dict[str, torch.Tensor]], Any]):
        self.layout = layout
        self.loss = loss

    def perturbed_buffer(self, index: int) -> torch.Tensor | None:
        """Where :meth:`evaluate_ball` reads group ``index``'s perturbed point from
        (:meth:`BallLayout.perturbed_buffer`); ``None`` where that is the evaluation's
        own vector (:meth:`BallLayout.evaluation_vectors`)."""
        return self.layout.perturbed_buffer(index)

    def __call__(self, points: List[torch.Tensor]) -> Any:
        try:
            _, params = self.layout.parameters(points, grad=False)
            return self.loss(params)
        finally:
            self.layout.restore()

    def owns(self, vector: Sequence[torch.Tensor]) -> bool:
        """Whether ``vector`` is the layout's :meth:`~BallLayout.evaluation_vector`."""
        return self.layout.owns(vector)

    def evaluate_ball(
        self, ball, paths, xi, grad: bool, autocast, recycled=None, own_vector: bool = False
    ):
        r"""The loss at the perturbed points and its gradient with respect to ``xi``,
        written into one of the free vectors that ``recycled`` holds, if any, where they
        fit (:meth:`BallLayout.parameters`: all of the ball's vectors fit, or none); they
        are released before the loss runs otherwise.

        With ``own_vector`` the gradient is the layout's
        :meth:`~BallLayout.evaluation_vector` instead (:meth:`owns` tells it), written
        over the perturbed points there, and ``recycled`` is left as it is: one vector of
        the model's size less at once. The caller reads that gradient before the next
        evaluation, which writes over it, and never writes into it. Where the loss reads
        a weight after the backward pass is done with it (a ``detach()`` of it, say, which
        autograd finds by the weight's version), the evaluation runs again with the
        gradient in a vector of its own, as all later ones do (:attr:`BallLayout.lends`).

        Paths with an explicit pullback (the straight line, the retractions of this
        package's quotients) write the perturbed point into the layout's buffer and map
        the gradient back without autograd; other paths are differentiated by autograd
        from the point's gradient. The model's own storage holds the base point again
        when this returns or raises (:meth:`BallLayout.restore`).
        """
        layout = self.layout
        own_vector = own_vector and layout.lends
        try:
            return self._evaluate_ball(ball, paths, xi, grad, autocast, recycled, own_vector)
        except RuntimeError as error:
            if not (own_vector and grad and _modified_in_place(error)):
                raise
            # the loss reads a weight after its gradient is complete, by an alias the
            # version check caught: the gradient goes to a vector of its own from now
            layout.lends = False
            return self._evaluate_ball(ball, paths, xi, grad, autocast, recycled, False)
        finally:
            layout.restore()

    def _evaluate_ball(self, ball, paths, xi, grad: bool, autocast, recycled, own_vector):
        layout = self.layout
        own_vector = own_vector and grad
        if grad and recycled and not layout.fits(recycled[-1]):
            # all of the ball's vectors fit, or none (a float32 state of a bfloat16
            # model): released, whether or not one would be taken, instead of piling up
            recycled.clear()
        spare = recycled.pop() if grad and recycled and not own_vector else None
        points, pullbacks, traced = [], [], {}
        written, zero = ball.take_written(xi), ball.is_zero(xi)
        # a value alone: the points go where the last gradient was, read by now
        reuse = own_vector or (not grad and layout.has_evaluation_vector())
        target = layout.evaluation_vector() if reuse else spare
        own = layout.evaluation_vectors(target)
        for index, (path, x, v) in enumerate(zip(paths, ball.points, xi)):
            if own[index] is None:
                buffer = functools.partial(layout.perturbed_buffer, index)
            else:
                buffer = functools.partial(_given, own[index])
            point, pullback = explicit_path(path, x, v, buffer, written[index], zero)
            if point is None:
                leaf = v.detach().requires_grad_(grad)
                with torch.enable_grad() if grad else torch.no_grad():
                    point = path(x, leaf).to(x.dtype)
                traced[index] = leaf
            points.append(point)
            pullbacks.append(pullback)
        sweep = ball.gradient_sweep
        leaves, params = layout.parameters(points, grad, spare, sweep, own, own_vector)
        points = {index: points[index] for index in traced}  # the rest are read: free
        del own
        with torch.enable_grad() if grad else torch.no_grad():
            with autocast.restored():
                value = as_scalar(self.loss(params))
            if not grad:
                return value.detach().reshape(()), None
            check_depends_on_perturbation(value, grads_found=True)
            # the gradients go to the layout during the pass (the leaves' hooks); autograd
            # returns what the hooks left it: expanded zeros, or None for an unused leaf
            captured = torch.autograd.grad(value, leaves, allow_unused=True)
        check_depends_on_perturbation(value, any(g is not None for g in captured))
        grads = layout.point_gradients(layout.flat_gradients(), target)
        for index, leaf in traced.items():
            (grads[index],) = torch.autograd.grad(points[index], leaf, grads[index])
        grads = [g if p is None else p(g) for g, p in zip(grads, pullbacks)]
        if own_vector:
            grads = layout._as_own(grads)
        return value.detach().reshape(()), grads


def _modified_in_place(error: RuntimeError) -> bool:
    """Whether autograd raised ``error`` for a saved tensor written since."""
    return "modified by an inplace operation" in str(error)


def _given(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
