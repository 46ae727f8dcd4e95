r"""Sharpness of a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under FSDP2 every trainable parameter is a :class:`~torch.distributed.tensor.DTensor`:
each rank of a 1-D device mesh holds a block of its rows (placement ``Shard(0)``), and
the forward pass all-gathers a layer's parameters just before it runs. Each rank passes
its own rows of every batch, so the global batch is the union of the ranks' rows, and
the perturbation is one ball per global batch, sharded like the model and never
gathered whole.

How the loss is evaluated
    :func:`torch.func.functional_call` cannot swap tensors into an FSDP2 module (its
    pre-forward hook installs the all-gathered parameters). Instead the perturbed
    point is written, without autograd, into each sharded parameter's local tensor;
    ``loss_fn(model, batch)`` runs as in training and is differentiated with
    ``backward``; FSDP2 reduce-scatters the gradient into the parameters' sharded
    ``.grad``, averaged over the ranks. With the same number of loss terms on every
    rank (equal rows per rank, a mean loss) the mean over the ranks of the local losses
    is the global batch's loss and that gradient is its gradient; the value is the
    all-reduced mean of the local losses. The caller's ``.grad`` are set aside for the
    call (the passes' gradients would add to them); after each pass every FSDP2 module
    is resharded and the ``.grad`` are reset to ``None``; on exit the local tensors get
    back their values, copied from the ball's base point and from the few entries the
    rank sent away, so the parameters are bitwise unchanged, and the ``.grad`` are the
    caller's again. A rank whose ``loss_fn`` raises leaves the others waiting in FSDP2's
    collectives until the process group's timeout.

Where the ball lives
    The ball's geometry needs every block of a symmetry group (a head's
    :math:`G, H` pair) on one rank: its :math:`h \times h` Gram matrices, their
    inverses, the horizontal projection and the retraction are per-head algebra. FSDP2's
    default placement keeps whole heads of :math:`W_Q, W_K, W_V` on one rank when the
    number of heads is a multiple of the world size, but splits every head's columns
    of :math:`W_O` by its rows. Rather than reducing partial Grams over the mesh inside
    every operation of the geometry (a collective in each projection, retraction and
    pullback), each head is *owned* by the rank holding most of its entries, and the
    ball's copy of it lives there, whole: an all-to-all exchange
    (:class:`_Exchange`) moves the few entries held elsewhere (a :math:`W_O` head's
    other rows) to the owner when gradients arrive, and the perturbed entries back to
    their shards before each pass. The geometry then runs unchanged and exactly on
    each rank's heads (the same arithmetic as in one process); so does the adaptive
    metric on the entries each rank holds. Every norm, inner product and Gram matrix of
    the ball is a sum over disjoint pieces, so the only other collective is one
    all-reduce of the :math:`k \times k` Gram matrix (and of a norm where Auto-PGD
    needs one), through the ball's reduction hook. Any ``Shard(0)`` split works
    (uneven ones, heads split over ranks); other placements are refused
    (:class:`ShardingError`).

Memory
    Per rank, the ball holds its pieces (base point, perturbed point, Auto-PGD's three
    iterates and one or two gradients), the entries it sent away and the exchange's
    maps (strided boxes: a few integers per parameter and layer, not per entry):
    :meth:`ShardedBall.bytes_per_parameter` reports them per parameter of the whole
    model. With :math:`R` ranks and balanced heads that is about :math:`1/R` of one
    process's ball (:meth:`~geoopt_quotient.sharpness.layout.BallLayout.bytes_per_parameter`).
    The maps are derived from the plan's boxes a chunk of whole heads at a time
    (:data:`CHUNK_ENTRIES`), so that building them holds a few vectors of a chunk's
    length, not of a group's; they are kept per plan for the next call (:data:`_LAYOUTS`).
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import GeooptQuotientError
from ..manifolds import AdaptiveEuclidean
from ..manifolds.base import has_elementwise_metric
from ..symmetry.plan import BoundPlan, SymmetryGroup
from .apgd import (
    KEEP_GRADIENT_MAX_BYTES,
    BallGroup,
    as_scalar,
    explicit_path,
    state_vector_bytes,
)
from .ball import ball_groups, check_points
from .boxmap import BoxMap, box_map, joined
from .functional import check_depends_on_perturbation

__all__ = ["ShardedBall", "ShardingError", "is_sharded"]

#: How to shard a model so that :func:`~geoopt_quotient.geodesic_sharpness` can measure it.
HOW_TO_SHARD = (
    "shard every parameter by rows on a 1-D device mesh, FSDP2's default: "
    "fully_shard(module, mesh=init_device_mesh(device_type, (world_size,))) without a "
    "shard_placement_fn, or with shard_placement_fn=lambda param: Shard(0)"
)


class ShardingError(GeooptQuotientError, ValueError):
    """A sharded model (DTensor parameters) that a function cannot measure: a placement
    other than FSDP2's default, or a function without a sharded path (the message says
    what to do)."""


def refuse_sharded(model: torch.nn.Module, what: str) -> None:
    """Raise :class:`ShardingError` if ``model`` is sharded: ``what`` has no sharded path."""
    if is_sharded(model):
        raise ShardingError(
            f"{what} cannot measure a sharded (FSDP2/DTensor) model yet; measure an "
            "unsharded copy, or use geodesic_sharpness or adaptive_sharpness, which can"
        )


def _dtensor_type():
    """The DTensor class if its module is loaded (no parameter is one otherwise), or None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else getattr(module, "DTensor", None)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` is a DTensor (FSDP2, tensor parallel)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(
        isinstance(p, dtensor) for p in model.parameters() if p.requires_grad
    )


def fsdp_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The FSDP2 modules in ``model`` (those ``fully_shard`` wrapped)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class _Shard:
    """One parameter's rows over the ranks: rank ``r`` holds rows
    ``[min(r c, R), min((r + 1) c, R))``, :math:`c = \\lceil R / W \\rceil` (FSDP2's
    ``torch.chunk`` split)."""

    name: str
    param: torch.Tensor  # the sharded DTensor parameter
    local: torch.Tensor  # its local tensor (a view: writing it writes the shard)
    rows: int
    row_size: int
    chunk: int

    def local_numel(self, rank: int) -> int:
        start = min(rank * self.chunk, self.rows)
        stop = min((rank + 1) * self.chunk, self.rows)
        return (stop - start) * self.row_size


def _shards(model: torch.nn.Module, names: Sequence[str]) -> Tuple[List[_Shard], Any]:
    """The sharded parameters ``names`` of ``model`` (checked) and their process group."""
    from torch.distributed.tensor import Shard

    dtensor = _dtensor_type()
    params = dict(model.named_parameters())
    shards, mesh = [], None
    for name in names:
        p = params[name]
        if not isinstance(p, dtensor):
            raise ShardingError(
                f"parameter {name!r} is not sharded while others are DTensors: sharpness of a "
                f"sharded model needs every trainable parameter sharded; {HOW_TO_SHARD}"
            )
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ShardingError(
                f"parameter {name!r} is placed as {tuple(p.placements)} on a mesh of shape "
                f"{tuple(p.device_mesh.shape)}; sharpness supports one placement, Shard(0) on "
                f"a 1-D mesh: {HOW_TO_SHARD}"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ShardingError(f"parameter {name!r} is on another device mesh; {HOW_TO_SHARD}")
        local = p.to_local()
        rows = p.shape[0] if p.dim() else 1
        world = mesh.size()
        shards.append(_Shard(name, p, local, rows, p.numel() // max(rows, 1), -(-rows // world)))
    _check_row_blocks(shards, mesh)
    return shards, mesh.get_group()


def _check_row_blocks(shards: List[_Shard], mesh) -> None:
    """Every local shard is the contiguous row block of :class:`_Shard`, on every rank
    (agreed with one all-reduce, so that all ranks raise or none)."""
    import torch.distributed as dist

    rank = mesh.get_local_rank()
    wrong = [
        s.name
        for s in shards
        if s.local.numel() != s.local_numel(rank) or not s.local.is_contiguous()
    ]
    flag = torch.tensor([float(bool(wrong))], device=shards[0].local.device)
    dist.all_reduce(flag, group=mesh.get_group())
    if float(flag) > 0:
        where = f"parameter {wrong[0]!r} here" if wrong else "a parameter on another rank"
        raise ShardingError(
            f"{where}: a local shard is not the row block FSDP2 gives by default; {HOW_TO_SHARD}"
        )


class _Exchange:
    """Entries between the model's local shards and the ball's pieces on every rank.

    The model side is the concatenation of the local shards (in the plan's parameter
    order), the ball side that of the rank's pieces. Whole parameters are copied as
    ranges; other entries held and owned by the same rank as strided boxes
    (:class:`~geoopt_quotient.sharpness.boxmap.BoxMap`, one strided copy per box, e.g.
    per parameter of alike heads and layers); the rest go through one
    ``all_to_all_single``, in an order both sides derive from the plan (group, then
    entry of its point), gathered and scattered by boxes too. The maps are added chunk
    by chunk of a group's point (:data:`CHUNK_ENTRIES`), each chunk's described by
    boxes as it comes, so that no integer per entry of a whole group exists at once;
    a chunk whose boxes would hold fewer than :data:`MIN_ENTRIES_PER_BOX` entries on
    average (an irregular layout) keeps an index per entry instead.
    """

    def __init__(self, group, world: int, rank: int):
        self.group, self.world, self.rank = group, world, rank
        self.ranges: List[Tuple[int, int, int]] = []  # (model start, ball start, size)
        self.local_parts = _MapParts()  # (model position, ball position)
        self.send_parts = [_MapParts() for _ in range(world)]  # (model, among those sent)
        self.recv_parts = [_MapParts() for _ in range(world)]  # (among received, ball)

    def add_local(self, model_pos: torch.Tensor, ball_pos: torch.Tensor) -> None:
        """Entries this rank holds and owns: model positions to ball positions."""
        self.local_parts.add(model_pos, ball_pos)

    def add_sent(self, peer: int, model_pos: torch.Tensor) -> None:
        """Entries this rank holds for ``peer``'s pieces, next in the peer's order."""
        parts = self.send_parts[peer]
        parts.add(model_pos, parts.numel + torch.arange(model_pos.numel()))

    def add_received(self, peer: int, ball_pos: torch.Tensor) -> None:
        """Entries ``peer`` holds for this rank's pieces, next in the peer's order."""
        parts = self.recv_parts[peer]
        parts.add(parts.numel + torch.arange(ball_pos.numel()), ball_pos)

    def finish(self, device: torch.device) -> None:
        """Join the maps of the chunks (the peers' in turn) into one map each."""
        self.send_sizes = [parts.numel for parts in self.send_parts]
        self.recv_sizes = [parts.numel for parts in self.recv_parts]
        sent_at = [sum(self.send_sizes[:peer]) for peer in range(self.world)]
        received_at = [sum(self.recv_sizes[:peer]) for peer in range(self.world)]
        self.whole = BoxMap.of_ranges(self.ranges)  # whole parameters
        self.local = self.local_parts.finish(device)
        sent = _MapParts.of(self.send_parts, [(0, at) for at in sent_at])
        received = _MapParts.of(self.recv_parts, [(at, 0) for at in received_at])
        self.sent, self.received = sent.finish(device), received.finish(device)
        self.regular = all(m.index is None for m in (self.local, self.sent, self.received))
        del self.ranges, self.local_parts, self.send_parts, self.recv_parts

    def index_bytes(self) -> int:
        """Bytes of the maps (boxes or indices), but for the whole parameters' ranges."""
        return sum(t.nbytes() for t in (self.local, self.sent, self.received))

    def _all_to_all(self, outgoing: torch.Tensor, sizes_out, sizes_in) -> torch.Tensor:
        import torch.distributed as dist

        incoming = outgoing.new_empty(sum(sizes_in))
        if self.world > 1:
            dist.all_to_all_single(incoming, outgoing, sizes_in, sizes_out, group=self.group)
        return incoming

    def outgoing(self, model_flat: torch.Tensor) -> torch.Tensor:
        """The entries of ``model_flat`` this rank holds for other ranks' pieces."""
        out = model_flat.new_empty(sum(self.send_sizes))
        self.sent.copy(model_flat, out)
        return out

    def to_ball(self, model_flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The model's entries (``model_flat``) written into the ball's layout ``out``."""
        self.whole.copy(model_flat, out)
        self.local.copy(model_flat, out)
        incoming = self._all_to_all(self.outgoing(model_flat), self.send_sizes, self.recv_sizes)
        self.received.copy(incoming, out)
        return out

    def to_model(
        self, ball_flat: torch.Tensor, out: torch.Tensor, held: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ball's entries (``ball_flat``) written into the model's layout ``out``;
        ``held``: the entries other ranks own, given (no communication) instead of
        received from them."""
        self.whole.copy(ball_flat, out, reverse=True)
        self.local.copy(ball_flat, out, reverse=True)
        if held is None:
            outgoing = ball_flat.new_empty(sum(self.recv_sizes))
            self.received.copy(ball_flat, outgoing, reverse=True)
            held = self._all_to_all(outgoing, self.recv_sizes, self.send_sizes)
        self.sent.copy(held, out, reverse=True)
        return out


#: A map of more boxes than this whose boxes hold fewer entries on average is copied
#: by index: one strided copy per box would cost more than the index's reads.
MANY_BOXES = 64
MIN_ENTRIES_PER_BOX = 64
#: Entries of a group's point whose maps are derived at once while the ball is built
#: (a few int64 tensors of this length, then their boxes): whole blocks (heads), at
#: least one.
CHUNK_ENTRIES = 1 << 18


#: Per bound plan, each rank's pieces and exchange (:meth:`ShardedBall._layout`): they
#: depend on the plan's groups and the shards' split of rows alone, so a later call on
#: the same plan and mesh (a training monitor's, every few steps) reuses them instead of
#: deriving them again from a position per entry. Only exchanges of boxes (a few integers
#: each) are kept: the indices of an irregular layout, as large as its groups, are not.
_LAYOUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _IndexMap:
    """``out[index[1]] = source[index[0]]``: the fallback of an irregular map."""

    def __init__(self, source: torch.Tensor, target: torch.Tensor, device: torch.device):
        self.index = tuple(t.to(device) for t in _narrowed(source, target))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.index)

    def copy(self, source: torch.Tensor, out: torch.Tensor, reverse: bool = False) -> None:
        read, write = self.index[::-1] if reverse else self.index
        out.index_copy_(0, write.long(), source[read.long()])


@dataclass
class _Transfer:
    """A map between two flat buffers: its regular part as boxes, the rest (irregular
    chunks) as indices."""

    boxes: BoxMap
    index: _IndexMap | None = None

    def nbytes(self) -> int:
        return self.boxes.nbytes() + (self.index.nbytes() if self.index is not None else 0)

    def copy(self, source: torch.Tensor, out: torch.Tensor, reverse: bool = False) -> None:
        """``out[map[1]] = source[map[0]]`` (``reverse``: ``out[map[0]] = source[map[1]]``)."""
        self.boxes.copy(source, out, reverse)
        if self.index is not None:
            self.index.copy(source, out, reverse)


def _narrowed(*index: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Integer maps as int32 where every entry fits (half the memory of int64)."""
    small = all(t.numel() == 0 or int(t.max()) < 2**31 for t in index)
    return tuple(t.to(torch.int32 if small else torch.long) for t in index)


def _regular(boxes: BoxMap) -> bool:
    """Whether a map's boxes are worth copying one by one (few, or large on average)."""
    return boxes.boxes <= MANY_BOXES or boxes.numel >= MIN_ENTRIES_PER_BOX * boxes.boxes


class _MapParts:
    """A map of position pairs added chunk by chunk: each chunk's boxes, or where
    irregular its indices (int32 where they fit), each with the shift of its positions."""

    def __init__(self):
        self.boxes: List[BoxMap] = []
        self.box_shifts: List[Tuple[int, int]] = []
        self.index: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.index_shifts: List[Tuple[int, int]] = []
        self.numel = 0

    def add(self, source: torch.Tensor, target: torch.Tensor) -> None:
        if not source.numel():
            return
        boxes = box_map(source, target)
        if _regular(boxes):
            self.boxes.append(boxes)
            self.box_shifts.append((0, 0))
        else:
            self.index.append(_narrowed(source, target))
            self.index_shifts.append((0, 0))
        self.numel += source.numel()

    @classmethod
    def of(cls, parts: Sequence[_MapParts], shifts: Sequence[Tuple[int, int]]) -> _MapParts:
        """The maps ``parts`` in one, each one's positions moved by its ``shifts``."""
        out = cls()
        for part, (first, second) in zip(parts, shifts):
            out.boxes += part.boxes
            out.box_shifts += [(a + first, b + second) for a, b in part.box_shifts]
            out.index += part.index
            out.index_shifts += [(a + first, b + second) for a, b in part.index_shifts]
            out.numel += part.numel
        return out

    def finish(self, device: torch.device) -> _Transfer:
        index = None
        if self.index:
            source, target = (
                torch.cat([t.long() + shift[side] for t, shift in zip(tensors, self.index_shifts)])
                for side, tensors in enumerate(zip(*self.index))
            )
            index = _IndexMap(source, target, device)
        return _Transfer(joined(self.boxes, self.box_shifts), index)


def _chunks(shape: Sequence[int], block_dims: int, limit: int):
    """Sub-boxes ``(lo, shape)`` of a point of ``shape`` that cover it in row-major
    order, each of whole blocks (its last ``block_dims`` dimensions whole) and of at most
    ``limit`` entries where one block fits."""
    shape = list(shape)
    k = len(shape) - block_dims  # dimensions k.. of a chunk are whole
    size = math.prod(shape[k:])
    while k > 0 and size * shape[k - 1] <= limit:
        k -= 1
        size *= shape[k]
    if k == 0:
        yield [0] * len(shape), shape
        return
    step = max(1, limit // max(size, 1))
    for prefix in itertools.product(*(range(n) for n in shape[: k - 1])):
        for first in range(0, shape[k - 1], step):
            count = min(step, shape[k - 1] - first)
            yield [*prefix, first, *[0] * (len(shape) - k)], [*[1] * (k - 1), count, *shape[k:]]


@dataclass
class _Piece:
    """This rank's part of one plan group: where it sits in the ball's flat buffer."""

    group: SymmetryGroup
    start: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.start + self.numel].view(self.shape)


class ShardedBall:
    """The ball of one sharded model on this rank, and the loss evaluated at its points.

    Built once per sharpness call from the plan bound to the FSDP2 model (discovered
    on its logical shapes). :attr:`groups` are this rank's ball groups (its heads of
    each symmetry group, its entries of the adaptive rest); :meth:`objective` gives,
    for one batch (this rank's rows of it), the objective Auto-PGD evaluates through
    :meth:`evaluate_ball`, whose ``reduce_sum`` hook all-reduces the ball's inner
    products and Gram matrices.

    Parameters
    ----------
    model : torch.nn.Module
        The FSDP2 model (every trainable parameter a ``Shard(0)`` DTensor on one 1-D mesh).
    plan : BoundPlan
        The symmetry plan bound to it.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``, the mean loss of this rank's rows.
    make_groups : callable
        ``make_groups(groups, points) -> list of BallGroup``: the ball groups of plan
        groups at their (local) points, as one process would make them.

    Raises
    ------
    ShardingError
        For a placement other than FSDP2's default ``Shard(0)`` on a 1-D mesh (the
        message says how to shard), or parameters of several dtypes or devices.
    """

    def __init__(self, model: torch.nn.Module, plan: BoundPlan, loss_fn: Callable, make_groups):
        import torch.distributed as dist

        self.model, self.loss_fn = model, loss_fn
        _reshard(model)
        self.shards, self.process_group = _shards(model, plan.param_names)
        self.world = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        dtypes = {(s.local.dtype, s.local.device) for s in self.shards}
        if len(dtypes) != 1:
            raise ShardingError(
                "sharpness of a sharded model needs one dtype and device for its trainable "
                f"parameters, got {sorted(map(str, dtypes))}"
            )
        ((self.dtype, self.device),) = dtypes
        self.parameters = sum(s.param.numel() for s in self.shards)
        # the passes' gradients must not add to the caller's: set aside, given back on exit
        self.caller_grads = [s.param.grad for s in self.shards]
        for s in self.shards:
            s.param.grad = None
        self.pieces, self.exchange = self._cached_layout(plan)
        self.base = self._ball_flat()
        model_flat = self._model_flat()
        self.exchange.to_ball(model_flat, self.base)
        # with the base point, what restores the model bitwise: the entries it sent away
        self.saved = self.exchange.outgoing(model_flat)
        self.model_size = model_flat.numel()
        self._model_scratch: torch.Tensor | None = model_flat  # written over from now on
        pieces = [p for p in self.pieces if p.numel]
        ball_groups = make_groups([p.group for p in pieces], [p.of(self.base) for p in pieces])
        self.groups, self._parts = _fuse(ball_groups, pieces, self.base)
        self._perturbed: torch.Tensor | None = None

    # ------------------------------------------------------------------ layout
    def _model_flat(self) -> torch.Tensor:
        return torch.cat([s.local.detach().reshape(-1) for s in self.shards])

    def _ball_flat(self) -> torch.Tensor:
        return torch.empty(self.ball_size, dtype=self.dtype, device=self.device)

    def _cached_layout(self, plan: BoundPlan) -> Tuple[List[_Piece], _Exchange]:
        """:meth:`_layout`, derived once per plan, mesh and row split (:data:`_LAYOUTS`)."""
        split = tuple((s.name, s.rows, s.row_size, s.chunk) for s in self.shards)
        key = (self.world, self.rank, str(self.device), split)
        layouts = _LAYOUTS.setdefault(plan, {})
        if key not in layouts:
            pieces, exchange = self._layout(plan)
            if not exchange.regular:  # an index per entry is not kept between calls
                return pieces, exchange
            layouts[key] = (pieces, exchange, self.ball_size)
        pieces, exchange, self.ball_size = layouts[key]
        exchange = copy.copy(exchange)
        exchange.group = self.process_group  # this call's (the cached one's may be gone)
        return pieces, exchange

    def _layout(self, plan: BoundPlan) -> Tuple[List[_Piece], _Exchange]:
        """This rank's piece of each group, and the exchange of their entries."""
        world, rank = self.world, self.rank
        position = {s.name: i for i, s in enumerate(self.shards)}
        sizes = torch.tensor(
            [[s.local_numel(r) for s in self.shards] for r in range(world)], dtype=torch.long
        )
        offsets = torch.cumsum(sizes, 1) - sizes  # (world, params): local offsets
        exchange = _Exchange(self.process_group, world, rank)
        pieces, start = [], 0
        ordered = sorted(plan.groups, key=lambda g: g.kind == "adaptive")  # symmetric first
        for group in ordered:
            if group.is_whole_parameter:
                shard = self.shards[position[group.param_names[0]]]
                numel = shard.local_numel(rank)
                model_start = int(offsets[rank, position[shard.name]])
                exchange.ranges.append((model_start, start, numel))
                pieces.append(_Piece(group, start, torch.Size([numel])))
                start += numel
                continue
            if group.kind == "adaptive":  # element-wise: each entry stays where it is
                count = 0
                for source, model_pos in self._sources(group, 0, position, offsets):
                    mine = (source == rank).nonzero().reshape(-1)
                    exchange.add_local(model_pos[mine], start + count + torch.arange(mine.numel()))
                    count += mine.numel()
                pieces.append(_Piece(group, start, torch.Size([count])))
                start += count
                continue
            piece = self._blocks(group, position, offsets, start, exchange)
            pieces.append(piece)
            start += piece.numel
        self.ball_size = start
        exchange.finish(self.device)
        return pieces, exchange

    def _sources(self, group: SymmetryGroup, block_dims: int, position, offsets):
        """Chunk by chunk of whole blocks of ``group``'s point (:func:`_chunks`), for
        every entry (flattened): the rank holding it and its position in that rank's
        concatenated local shards."""
        shards = [self.shards[position[n]] for n in group.param_names]
        chunk_entries = torch.tensor([s.chunk * s.row_size for s in shards])
        columns = torch.tensor([position[s.name] for s in shards])
        flat_offsets = offsets.reshape(-1)  # (rank, parameter) at rank * parameters + k
        for lo, shape in _chunks(group.shape, block_dims, CHUNK_ENTRIES):
            which, within = (t.reshape(-1) for t in group.box_entries(lo, shape))
            per_rank = chunk_entries[which]
            source = torch.div(within, per_rank, rounding_mode="floor")
            model_pos = flat_offsets[source * offsets.shape[1] + columns[which]]
            model_pos += within - source * per_rank
            yield source, model_pos

    def _blocks(self, group, position, offsets, start: int, exchange: _Exchange) -> _Piece:
        """This rank's whole blocks (heads) of a symmetry group; each block is owned by
        the rank holding most of its entries (the lowest such rank on a tie)."""
        world, rank = self.world, self.rank
        ndim = group.manifold.ndim
        block_shape = group.shape[len(group.shape) - ndim :] if ndim else ()
        block = math.prod(block_shape)
        owned = [0] * world  # blocks each rank owns so far
        for source, model_pos in self._sources(group, ndim, position, offsets):
            source, model_pos = source.view(-1, block), model_pos.view(-1, block)
            counts = torch.zeros(len(source), world, dtype=torch.long)
            counts.scatter_add_(1, source, torch.ones_like(source))
            owner = counts.argmax(1)  # the first maximum
            slot = torch.zeros_like(owner)  # the block's place among its owner's blocks
            for r in range(world):
                mask = owner == r
                taken = int(mask.sum())
                slot[mask] = torch.arange(owned[r], owned[r] + taken)
                owned[r] += taken
            mine = owner == rank
            ball_pos = start + slot[mine, None] * block + torch.arange(block)  # in the piece
            from_rank = source[mine]  # who holds each entry of this rank's blocks
            held = from_rank == rank
            exchange.add_local(model_pos[mine][held], ball_pos[held])
            others = ~mine
            sent = source[others] == rank  # this rank's entries of others' blocks
            to_rank = owner[others, None].expand(-1, block)[sent]
            sent_pos = model_pos[others][sent]
            from_rank, received_pos = from_rank[~held], ball_pos[~held]
            for peer in range(world):
                if peer != rank:
                    exchange.add_sent(peer, sent_pos[to_rank == peer])
                    exchange.add_received(peer, received_pos[from_rank == peer])
        return _Piece(group, start, torch.Size([owned[rank], *block_shape]))

    # ------------------------------------------------------------------ reductions
    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the ranks (a new tensor, the same on every rank)."""
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total, group=self.process_group)
        return total

    def keep_best_gradient(self, keep: bool | None, state_dtype: torch.dtype | None = None) -> bool:
        """``keep_best_gradient`` resolved from the whole ball's size (its vectors stored
        as ``state_dtype`` asks), alike on every rank."""
        if keep is not None:
            return bool(keep)
        size = state_vector_bytes([g.point for g in self.groups], state_dtype)
        total = self.reduce_sum(torch.tensor(float(size), device=self.device))
        return bool(total <= KEEP_GRADIENT_MAX_BYTES)

    def bytes_per_parameter(
        self, keep_best_gradient: bool, state_dtype: torch.dtype | None = None
    ) -> Dict[str, float]:
        """This rank's ball memory per parameter of the whole model, by part (the
        iterates and gradients stored as ``state_dtype`` asks).

        ``base``: the ball's base point (a copy of the rank's entries, its heads whole);
        ``saved``: the rank's entries of other ranks' heads (with the base point they
        restore the model's shards, with no communication); ``perturbed``: the
        perturbed point; ``iterates``: Auto-PGD's current, previous and best
        perturbation; ``gradients``: the current gradient, and the best iterate's if
        kept; ``index``: the maps of the exchange (boxes, or indices where irregular);
        ``total``: their sum. Comparable with
        :meth:`~geoopt_quotient.sharpness.layout.BallLayout.bytes_per_parameter` of one
        process, which holds no ``saved`` entries (its ``index`` part: the index maps of
        unfused groups not laid out in strided blocks).
        """
        vector = state_vector_bytes([g.point for g in self.groups], state_dtype)
        item = self.base.element_size()
        parts = {
            "base": self.base.numel() * item,
            "saved": self.saved.numel() * item,
            "perturbed": self.ball_size * item,
            "iterates": 3 * vector,
            "gradients": (2 if keep_best_gradient else 1) * vector,
            "index": self.exchange.index_bytes(),
        }
        parts["total"] = sum(parts.values())
        return {part: size / self.parameters for part, size in parts.items()}

    def nonzero_parameters(self) -> Dict[str, torch.Tensor]:
        """Per parameter, a 0-d tensor: whether any of its entries (on any rank) is not 0."""
        local = torch.stack([s.local.any() for s in self.shards]).to(torch.float64)
        nonzero = self.reduce_sum(local) > 0
        return {s.name: flag for s, flag in zip(self.shards, nonzero)}

    def check_base_points(self) -> None:
        """Finite parameters and symmetric base points on their manifolds, on every rank:
        one all-reduce of the failures, so that every rank raises or none.

        Raises
        ------
        ValueError
            On every rank: for NaN/Inf entries, or a group off its manifold (here with
            :func:`~geoopt_quotient.sharpness.ball.check_points`' error, which names it).
        """
        finite = bool(torch.isfinite(self.base).all())
        error = None
        if finite:
            pieces = [p for p in self.pieces if p.numel]
            try:
                check_points([p.group for p in pieces], [p.of(self.base) for p in pieces])
            except ValueError as caught:
                error = caught
        flags = torch.tensor([float(not finite), float(error is not None)], device=self.device)
        not_finite, off_manifold = self.reduce_sum(flags).tolist()
        if not_finite:
            raise ValueError(
                "the model has NaN/Inf parameter entries: sharpness is undefined; check the "
                "checkpoint or the training run that produced it"
            )
        if error is not None:
            raise error
        if off_manifold:
            raise ValueError(
                "a symmetry group's base point is not on its manifold (a rank-deficient "
                "factor) on another rank, whose error says which; pass eps > 0 (e.g. eps=1e-6)"
            )

    # ------------------------------------------------------------------ evaluation
    def restore(self) -> None:
        """The model's local shards back to their saved values, and their ``.grad``
        back to what they were."""
        _reshard(self.model)
        self._write_model(self.exchange.to_model(self.base, self._model_buffer(), self.saved))
        for s, grad in zip(self.shards, self.caller_grads):
            s.param.grad = grad

    def objective(self, batch: Any) -> _ShardedObjective:
        """The objective of :func:`~geoopt_quotient.maximize_in_ball` on this rank's
        rows ``batch`` of one global batch."""
        return _ShardedObjective(self, batch)

    def perturbed_buffer(self) -> torch.Tensor:
        if self._perturbed is None:
            self._perturbed = self._ball_flat()
        return self._perturbed

    def write(self, ball_flat: torch.Tensor) -> None:
        """Write the ball's point ``ball_flat`` into the model's local shards."""
        _reshard(self.model)
        self._write_model(self.exchange.to_model(ball_flat, self._model_buffer()))

    def _model_buffer(self) -> torch.Tensor:
        """The one buffer of the local shards' size that each write and each gradient
        passes through (made once: a new one per pass would be faulted in page by page)."""
        if self._model_scratch is None:
            self._model_scratch = torch.empty(self.model_size, dtype=self.dtype, device=self.device)
        return self._model_scratch

    def flat_of(self, vector: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The flat buffer in the ball's layout whose views ``vector``'s tensors are (one
        per ball group, as Auto-PGD's vectors are made), or ``None`` if they are not."""
        first = vector[0] if len(vector) == len(self._parts) else None
        if first is None or first.dtype != self.dtype or first.device != self.device:
            return None
        storage = first.untyped_storage()
        if storage.nbytes() < self.ball_size * first.element_size():
            return None
        for t, (start, shape) in zip(vector, self._parts):
            alike = t.untyped_storage().data_ptr() == storage.data_ptr() and t.is_contiguous()
            if not (alike and t.storage_offset() == start and t.shape == shape):
                return None
        return first.as_strided((self.ball_size,), (1,), 0)

    def _write_model(self, model_flat: torch.Tensor) -> None:
        with torch.no_grad():
            views = model_flat.split([s.local.numel() for s in self.shards])
            torch._foreach_copy_([s.local.view(-1) for s in self.shards], list(views))

    def loss(
        self, batch: Any, grad: bool, autocast, out: torch.Tensor | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor | None]:
        """The global batch's loss (mean over the ranks) at the written point, and with
        ``grad`` its gradient in the ball's layout (written into ``out`` if given)."""
        try:
            with torch.enable_grad() if grad else torch.no_grad():
                with autocast.restored():
                    value = as_scalar(self.loss_fn(self.model, batch))
                if grad:
                    check_depends_on_perturbation(value, grads_found=True)
                    value.backward()
            flat = None
            if grad:
                grads = [s.param.grad for s in self.shards]
                check_depends_on_perturbation(value, any(g is not None for g in grads))
                with torch.no_grad():
                    flat = torch.cat(
                        [
                            torch.zeros_like(s.local).reshape(-1)
                            if g is None
                            else g.to_local().reshape(-1).to(self.dtype)
                            for s, g in zip(self.shards, grads)
                        ],
                        out=self._model_buffer(),
                    )
        finally:
            _reshard(self.model)
            for s in self.shards:
                s.param.grad = None
        mean = self.reduce_sum(value.detach().reshape(()).to(torch.float64)) / self.world
        if flat is None:
            return mean, None
        return mean, self.exchange.to_ball(flat, self._ball_flat() if out is None else out)


def _reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 module back to its sharded parameters (an evaluation without
    backward leaves the root's all-gathered ones registered)."""
    for module in fsdp_modules(model):
        module.reshard()


def _fuse(
    groups: List[BallGroup], pieces: List[_Piece], base: torch.Tensor
) -> Tuple[List[BallGroup], List]:
    """The element-wise adaptive groups of one ``eps``, adjacent at the end of the ball's
    buffer, as one ball group each (fewer, larger operations); ``parts``: per ball group,
    the pieces' span ``(start, shape)`` in the ball's buffer."""
    out: List[BallGroup] = []
    parts: List[Tuple[int, torch.Size]] = []
    for group, piece in zip(groups, pieces):
        m = group.manifold
        fusible = has_elementwise_metric(m) and m.ndim == 0 and group.path is None
        if fusible and out and parts[-1][2] == m.eps:
            start, _, eps = parts[-1]
            size = piece.start + piece.numel - start
            out[-1] = BallGroup(base[start : start + size], AdaptiveEuclidean(eps=eps))
            parts[-1] = (start, torch.Size([size]), eps)
            continue
        out.append(group)
        parts.append((piece.start, piece.shape, m.eps if fusible else None))
    return out, [(start, shape) for start, shape, _ in parts]


class _ShardedObjective:
    """One global batch's objective on a :class:`ShardedBall` (this rank's rows)."""

    def __init__(self, ball: ShardedBall, batch: Any):
        self.ball, self.batch = ball, batch
        self.reduce_sum = ball.reduce_sum

    def __call__(self, points: List[torch.Tensor]) -> torch.Tensor:
        from .precision import AutocastState

        flat = self.ball.perturbed_buffer()
        for point, (start, shape) in zip(points, self.ball._parts):
            flat[start : start + math.prod(shape)].view(shape).copy_(point.detach())
        self.ball.write(flat)
        return self.ball.loss(self.batch, False, AutocastState.capture())[0]

    def evaluate_ball(self, ball, paths, xi, grad: bool, autocast, recycled=None):
        """The loss at the perturbed points and its gradient with respect to ``xi``, as
        :meth:`~geoopt_quotient.sharpness.layout.BallLayout.objective` evaluates it
        (into the last vector of ``recycled`` where it is laid out as the ball is; else
        they are released before the loss runs)."""
        owner = self.ball
        spare = owner.flat_of(recycled[-1]) if grad and recycled else None
        if spare is not None:
            recycled.pop()  # the others stay free for the loop
        elif recycled:
            recycled.clear()  # none fits (all of the ball's vectors fit, or none): released
        flat = owner.perturbed_buffer()
        pullbacks, traced = [], {}
        for index, (path, x, v, (start, shape)) in enumerate(
            zip(paths, ball.points, xi, owner._parts)
        ):
            view = flat[start : start + math.prod(shape)].view(shape)
            point, pullback = explicit_path(path, x, v, lambda view=view: view)
            if point is None:
                leaf = v.detach().requires_grad_(grad)
                with torch.enable_grad() if grad else torch.no_grad():
                    point = path(x, leaf).to(x.dtype)
                traced[index] = (leaf, point)
                with torch.no_grad():
                    view.copy_(point)
            pullbacks.append(pullback)
        owner.write(flat)
        value, flat_grad = owner.loss(self.batch, grad, autocast, spare)
        if not grad:
            return value, None
        grads = [
            flat_grad[start : start + math.prod(shape)].view(shape) for start, shape in owner._parts
        ]
        for index, (leaf, point) in traced.items():
            (grads[index],) = torch.autograd.grad(point, leaf, grads[index])
        grads = [g if p is None else p(g) for g, p in zip(grads, pullbacks)]
        return value, grads


def sharded_ball(
    model: torch.nn.Module,
    plan: BoundPlan,
    loss_fn: Callable | None,
    *,
    path: str = "second_order",
    norm: bool = True,
) -> ShardedBall:
    """The :class:`ShardedBall` of ``model`` with the ball groups
    :func:`~geoopt_quotient.geodesic_sharpness` makes (``path``, ``norm`` as in
    :func:`~geoopt_quotient.sharpness.ball.ball_groups`)."""

    def make_groups(groups, points):
        return ball_groups(groups, points, path, norm)

    return ShardedBall(model, plan, loss_fn, make_groups)
