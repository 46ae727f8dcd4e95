"""Symmetry plans: which parameter entries form which manifold point.

A :class:`SymmetryGroup` says how one manifold point (e.g. the query/key pairs of every
head of every layer, stacked) is gathered from model parameters and scattered back.
Its *layout* is an ordinary function of tensors, written once with slicing, ``.mT``,
``reshape`` and ``torch.cat``; applied to integer index tensors it yields an index map,
so gathering and scattering are both exact and differentiable. Everything a plan does
not cover is left to the adaptive geometry (:class:`~geoopt_quotient.AdaptiveEuclidean`).
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import torch
from geoopt.manifolds.base import Manifold
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import GeooptQuotientError, GeooptQuotientWarning
from ..manifolds import AdaptiveEuclidean
from ..manifolds.base import QuotientManifold, group_label
from . import strided, structured
from .strided import StridedLayout, strided_layout, write_back
from .structured import PointStructure

__all__ = [
    "BoundPlan",
    "GeodesicEqualsAdaptiveWarning",
    "PlanError",
    "SymmetryGroup",
    "SymmetryPlan",
]

Layout = Callable[..., torch.Tensor]


class PlanError(GeooptQuotientError, ValueError):
    """A symmetry plan does not fit the model it is applied to."""


class GeodesicEqualsAdaptiveWarning(GeooptQuotientWarning, UserWarning):
    """Geodesic sharpness was asked for where the plan quotients nothing (or leaves some
    attention to the adaptive geometry): there it is adaptive sharpness."""


#: The note that :func:`~geoopt_quotient.find_symmetries` leaves on a plan without groups.
NO_SYMMETRY = "no symmetry found: every parameter uses the adaptive geometry"


@dataclass(frozen=True)
class SymmetryGroup:
    """One manifold point assembled from parameter entries.

    Parameters
    ----------
    name : str
        Human-readable label (module path and kind).
    manifold : geoopt.manifolds.Manifold
        The geometry of the point.
    param_names : tuple of str
        Parameters (as in ``model.named_parameters()``) the point draws from.
    param_shapes : tuple of torch.Size
        Their shapes.
    index : torch.Tensor
        Integer tensor of the point's shape: entry ``k`` of the point is entry
        ``index[k]`` of ``torch.cat([p.reshape(-1) for p in params])``, int32 when the
        parameters have fewer than :math:`2^{31}` entries (half the memory of int64).
        Groups made by :meth:`from_layout` keep the structure of the map instead (boxes
        of strided parameter views, :mod:`~geoopt_quotient.symmetry.structured`) and
        build ``index`` on first use only.
    kind : str
        ``"query-key"``, ``"value-output"``, ``"adaptive"``, ``"manifold-parameter"``...
    count : int
        Number of elementary symmetry blocks (e.g. heads) stacked in the point.
    """

    name: str
    manifold: Manifold
    param_names: Tuple[str, ...]
    param_shapes: Tuple[torch.Size, ...]
    index: torch.Tensor = field(repr=False)
    kind: str = "custom"
    count: int = 1

    @classmethod
    def from_layout(
        cls,
        name: str,
        manifold: Manifold,
        params: Mapping[str, Sequence[int]],
        layout: Layout,
        *,
        kind: str = "custom",
        count: int = 1,
    ) -> SymmetryGroup:
        """Build a group from a layout function.

        ``layout(*tensors)`` receives one tensor per entry of ``params`` (in order, with
        those shapes) and returns the point, using only indexing, views, transposes,
        ``reshape``, ``stack`` and ``cat``: no arithmetic.

        The layout is first run on probes that record which strided view of which
        parameter fills each box of the point
        (:mod:`~geoopt_quotient.symmetry.structured`): the group then keeps that
        description, at a cost that grows with the number of tensors and heads, and
        builds :attr:`index` only when asked. A layout the probes cannot follow is
        applied to integer tensors instead.

        Examples
        --------
        The query/key pair of one head of an ``nn.Linear``-based attention layer::

            def qk(wq, bq, wk, bk):
                g = torch.cat([wq[rows].mT, bq[rows][None]], dim=0)
                h = torch.cat([wk[rows].mT, bk[rows][None]], dim=0)
                return torch.cat([g, h], dim=0)
        """
        names = tuple(params)
        shapes = tuple(torch.Size(s) for s in params.values())
        structure = structured.trace(layout, shapes)
        if structure is not None:
            group = StructuredGroup(name, manifold, names, shapes, structure, kind, count)
            if any(structured.overlap(*r) is not None for r in group.runs()):
                raise PlanError(f"layout of group {name!r} uses some parameter entry twice")
            return group
        offsets = sum(shape.numel() for shape in shapes)
        dtype = torch.int32 if offsets <= 2**31 else torch.long  # as _index_tensors numbers
        index = layout(*_index_tensors(shapes))
        if not isinstance(index, torch.Tensor) or index.dtype != dtype:
            raise PlanError(f"layout of group {name!r} must return a tensor built from its inputs")
        if not _distinct(index.reshape(-1), offsets):
            raise PlanError(f"layout of group {name!r} uses some parameter entry twice")
        return cls(name, manifold, names, shapes, _compact(index, offsets), kind, count)

    @property
    def shape(self) -> torch.Size:
        return self.index.shape

    @property
    def is_whole_parameter(self) -> bool:
        """Whether the group is one whole parameter in its own shape."""
        return False

    def gather(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The point, read from ``params`` (differentiable)."""
        flat = torch.cat([params[n].reshape(-1) for n in self.param_names])
        return flat[self.index.to(flat.device)]

    def scatter(
        self, point: torch.Tensor, params: Mapping[str, torch.Tensor]
    ) -> Dict[str, torch.Tensor]:
        """New tensors for :attr:`param_names`: ``params`` with the point written in."""
        flat = torch.cat([params[n].reshape(-1) for n in self.param_names])
        index = self.index.reshape(-1).to(flat.device)
        flat = flat.index_put((index,), point.reshape(-1).to(flat.dtype))
        out, start = {}, 0
        for n, shape in zip(self.param_names, self.param_shapes):
            out[n] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return out

    def positions(self, starts: Mapping[str, int], size: int, device) -> torch.Tensor:
        """Each entry's position in a flat buffer of ``size`` entries that holds parameter
        ``n``'s flattened entries from ``starts[n]`` on (``torch.long``, on ``device``)."""
        flat = torch.cat(
            [
                torch.arange(starts[n], starts[n] + s.numel(), device=device)
                for n, s in zip(self.param_names, self.param_shapes)
            ]
        )
        return flat[self.index.to(device)]

    def box_entries(
        self, lo: Sequence[int], shape: Sequence[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """For the point's entries ``lo : lo + shape``: the position among
        :attr:`param_names` of the parameter each comes from, and its position in that
        flattened parameter (``torch.long``, shape ``shape`` each); from the group's
        boxes where it has them, without :attr:`index`."""
        index = self.index[tuple(slice(a, a + n) for a, n in zip(lo, shape))].long()
        numels = torch.tensor([s.numel() for s in self.param_shapes])
        ends = torch.cumsum(numels, 0)
        which = torch.searchsorted(ends, index, right=True)
        return which, index - (ends - numels)[which]

    def covered(self) -> Dict[str, torch.Tensor]:
        """Per parameter, the flat entry indices this group covers."""
        flat = self.index.reshape(-1)
        out, start = {}, 0
        for n, shape in zip(self.param_names, self.param_shapes):
            numel = shape.numel()
            sel = flat[(flat >= start) & (flat < start + numel)] - start
            if sel.numel():
                out[n] = sel
            start += numel
        return out

    def runs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per parameter, the (starts, lengths) of the runs of consecutive flat entries
        the group covers, sorted by start (overlapping where it repeats an entry)."""
        covered = self.covered()
        return [
            structured.runs_of(covered[n].sort().values.long())
            if n in covered
            else (torch.zeros(0, dtype=torch.long),) * 2
            for n in self.param_names
        ]

    def with_manifold(self, manifold: Manifold) -> SymmetryGroup:
        return replace(self, manifold=manifold)


class StructuredGroup(SymmetryGroup):
    """A group described by the boxes of its point
    (:class:`~geoopt_quotient.symmetry.structured.PointStructure`): it gathers and
    scatters with strided copies, and builds :attr:`index` only when asked."""

    def __init__(
        self,
        name: str,
        manifold: Manifold,
        param_names: Tuple[str, ...],
        param_shapes: Tuple[torch.Size, ...],
        structure: PointStructure,
        kind: str = "custom",
        count: int = 1,
    ):
        values = dict(
            name=name,
            manifold=manifold,
            param_names=tuple(param_names),
            param_shapes=tuple(torch.Size(s) for s in param_shapes),
            structure=structure,
            kind=kind,
            count=count,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)

    __hash__ = object.__hash__

    def __eq__(self, other) -> bool:
        return self is other

    def __repr__(self) -> str:
        return (
            f"SymmetryGroup(name={self.name!r}, manifold={self.manifold!r}, "
            f"param_names={self.param_names!r}, shape={tuple(self.shape)}, kind={self.kind!r}, "
            f"count={self.count!r})"
        )

    @property
    def index(self) -> torch.Tensor:
        """The index map (see :class:`SymmetryGroup`), built on first use."""
        cached = self.__dict__.get("_index")
        if cached is None:
            total = sum(shape.numel() for shape in self.param_shapes)
            cached = _compact(self.structure.gather(_index_tensors(self.param_shapes)), total)
            object.__setattr__(self, "_index", cached)
        return cached

    @property
    def shape(self) -> torch.Size:
        return self.structure.shape

    def gather(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.structure.gather([params[n] for n in self.param_names])

    def scatter(self, point, params):
        tensors = self.structure.scatter(point, [params[n] for n in self.param_names])
        return dict(zip(self.param_names, tensors))

    def positions(self, starts, size, device):
        return self.structure.positions([starts[n] for n in self.param_names], size, device)

    def box_entries(self, lo, shape):
        return self.structure.box_entries(lo, shape)

    def runs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        cached = self.__dict__.get("_runs")  # a few runs per tensor once coalesced
        if cached is None:
            cached = self.structure.runs(self.param_shapes)
            object.__setattr__(self, "_runs", cached)
        return cached

    def with_manifold(self, manifold: Manifold) -> SymmetryGroup:
        return StructuredGroup(
            self.name,
            manifold,
            self.param_names,
            self.param_shapes,
            self.structure,
            self.kind,
            self.count,
        )


def _index_tensors(shapes: Sequence[torch.Size]) -> List[torch.Tensor]:
    """One integer tensor per shape, numbering the entries of all of them in turn: int32
    where that holds every entry (half the memory traffic of int64)."""
    total = sum(shape.numel() for shape in shapes)
    dtype = torch.int32 if total <= 2**31 else torch.long
    tensors, start = [], 0
    for shape in shapes:
        tensors.append(torch.arange(start, start + shape.numel(), dtype=dtype).reshape(shape))
        start += shape.numel()
    return tensors


def _distinct(index: torch.Tensor, bound: int) -> bool:
    """Whether the entries of ``index`` (all in ``[0, bound)``) are distinct: one byte per
    possible entry, marked once each (linear time, no sort)."""
    hit = torch.zeros(bound, dtype=torch.bool)
    hit[index] = True
    return int(hit.sum()) == index.numel()


def is_permutation(source: torch.Tensor) -> bool:
    """Whether ``source`` holds each of ``0 .. len - 1`` once (linear time, no sort)."""
    if source.numel() and (int(source.min()) < 0 or int(source.max()) >= source.numel()):
        return False
    hit = torch.zeros(source.numel(), dtype=torch.bool)
    hit[source] = True
    return bool(hit.all())


def fits_strided(layout: StridedLayout, points: Sequence[torch.Tensor]) -> bool:
    """Whether ``points`` have the layout's shapes and one dtype and device, in pieces
    large enough for strided copies to pay (:data:`strided.MIN_ENTRIES_PER_PIECE`)."""
    first = points[0]
    return layout.entries_per_piece >= strided.MIN_ENTRIES_PER_PIECE and all(
        p.shape == shape and p.dtype == first.dtype and p.device == first.device
        for p, shape in zip(points, layout.source_shapes)
    )


def _compact(index: torch.Tensor, bound: int) -> torch.Tensor:
    """``index`` (entries below ``bound``), contiguous and as int32 where that holds them."""
    return index.to(torch.int32 if bound <= 2**31 else index.dtype).contiguous()


@dataclass(frozen=True)
class WholeParameterGroup(SymmetryGroup):
    """A group that is exactly one parameter tensor (no copy on gather/scatter).

    Its :attr:`index`, the identity map, is a ``meta`` tensor: its shape without its
    entries, since an int64 index per parameter entry would take twice the memory of a
    float32 model. :meth:`covered` builds the entries when asked.
    """

    @property
    def is_whole_parameter(self) -> bool:
        return True

    def gather(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return params[self.param_names[0]]

    def scatter(self, point, params):
        return {self.param_names[0]: point}

    def positions(self, starts, size, device):
        start = starts[self.param_names[0]]
        return torch.arange(start, start + self.index.numel(), device=device).view(self.shape)

    def box_entries(self, lo, shape):
        strides = structured.contiguous_strides(self.shape)
        grid = structured.affine_grid(sum(a * s for a, s in zip(lo, strides)), shape, strides)
        return torch.zeros_like(grid), grid

    def covered(self) -> Dict[str, torch.Tensor]:
        return {self.param_names[0]: torch.arange(self.index.numel())}

    def runs(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        size = self.index.numel()
        return [
            (torch.zeros(1 if size else 0, dtype=torch.long), torch.full((1 if size else 0,), size))
        ]


def whole_parameter_group(
    name: str, shape: Sequence[int], manifold: Manifold, kind: str = "adaptive"
) -> SymmetryGroup:
    """A group holding all of one parameter, in its own shape."""
    shape = torch.Size(shape)
    index = torch.empty(shape, dtype=torch.long, device="meta")
    return WholeParameterGroup(name, manifold, (name,), (shape,), index, kind, 1)


@dataclass
class SymmetryPlan:
    """A list of symmetry groups; the adaptive geometry covers every other parameter.

    Parameters
    ----------
    groups : list of SymmetryGroup
        Disjoint groups (no parameter entry in two groups).
    adaptive_eps : float
        ``eps`` of the :class:`AdaptiveEuclidean` geometry of the uncovered entries.
    notes : list of str
        What discovery recognised but did not handle (shown by :meth:`summary`).
    """

    groups: List[SymmetryGroup] = field(default_factory=list)
    adaptive_eps: float = 0.0
    notes: List[str] = field(default_factory=list)

    @property
    def metric(self) -> str | None:
        """The invariant metric of the plan's quotients (see :func:`plan_metric`)."""
        return plan_metric(self.groups)

    def with_metric(self, metric: str, eps: float = 0.0) -> SymmetryPlan:
        """The same groups, each quotient in ``metric`` with a relaxation of at least ``eps``
        (``QuotientManifold.with_metric``; other manifolds as they are): a plan proven in one
        metric serves the other without a second proof."""
        groups = [
            g.with_manifold(g.manifold.with_metric(metric, eps))
            if isinstance(g.manifold, QuotientManifold)
            else g
            for g in self.groups
        ]
        return SymmetryPlan(groups, self.adaptive_eps, list(self.notes))

    def bind(self, model: torch.nn.Module, *, trainable_only: bool = True) -> BoundPlan:
        """Check the plan against ``model`` and add adaptive groups for the rest."""
        params = dict(model.named_parameters())
        if trainable_only:
            params = {n: p for n, p in params.items() if p.requires_grad}
        if not params:
            raise PlanError(
                "the model has no trainable parameters to perturb: set requires_grad=True on "
                "the parameters to measure"
            )
        coverage: Dict[str, _Coverage] = {}
        for position, group in enumerate(self.groups):
            for n, shape in zip(group.param_names, group.param_shapes):
                if n not in params:
                    raise PlanError(
                        f"group {group.name!r} names parameter {n!r}, which the model does not "
                        "have (or which is frozen)"
                    )
                if params[n].shape != shape:
                    raise PlanError(
                        f"group {group.name!r} expects {n!r} of shape {tuple(shape)}, the model's "
                        f"is {tuple(params[n].shape)}"
                    )
            ok, reason = group.manifold._check_shape(tuple(group.shape), group.name)
            if not ok:
                raise PlanError(f"group {group.name!r}: {reason}")
            _claim(group, position, self.groups, coverage)
        adaptive = AdaptiveEuclidean(eps=self.adaptive_eps)
        extra: List[SymmetryGroup] = []
        for n, p in params.items():
            claimed = coverage.get(n)
            if claimed is None:
                extra.append(whole_parameter_group(n, p.shape, adaptive))
                continue
            starts, lengths = structured.complement(claimed.starts, claimed.lengths, p.numel())
            if starts.numel():
                extra.append(_rest_group(n, p.shape, adaptive, starts, lengths))
        return BoundPlan(list(self.groups) + extra, tuple(params), self.notes)

    def __add__(self, other: SymmetryPlan) -> SymmetryPlan:
        return SymmetryPlan(self.groups + other.groups, self.adaptive_eps, self.notes + other.notes)


#: How many bindings :func:`bound_once` keeps per model (the latest).
BINDINGS_PER_MODEL = 4
#: model -> its latest bindings, newest last (:func:`bound_once`); weak on the model
_BINDINGS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def bound_once(plan: SymmetryPlan, model: torch.nn.Module) -> BoundPlan:
    """``plan.bind(model)``, or the :class:`BoundPlan` an earlier call returned where
    neither changed since: the same groups (the same objects, in order), ``adaptive_eps``
    and notes, and the same trainable parameters (the same tensors, names and shapes).

    A measure called again with the same plan (a plan found once and passed to each
    call) thus gets the same bound plan, and with it what is kept per bound plan (the
    sharpness ball's layout of the parameters), instead of deriving it again. The bound
    plans are kept while the model lives, the latest :data:`BINDINGS_PER_MODEL` per
    model, with what they keep (index tensors of groups without a strided layout)."""
    signature = _parameter_signature(model)
    key = (tuple(plan.groups), plan.adaptive_eps, tuple(plan.notes))
    bindings = _BINDINGS.setdefault(model, [])
    for binding in bindings:
        if _same_key(binding[0], key) and _same_signature(binding[1], signature):
            return binding[2]
    bound = plan.bind(model)
    references = [(name, weakref.ref(p), shape, grad) for name, p, shape, grad in signature]
    bindings.append((key, references, bound))
    del bindings[:-BINDINGS_PER_MODEL]
    return bound


def _parameter_signature(model: torch.nn.Module) -> List[Tuple]:
    return [(n, p, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]


def _same_key(kept: Tuple, key: Tuple) -> bool:
    groups, eps, notes = kept
    return (
        len(groups) == len(key[0])
        and all(a is b for a, b in zip(groups, key[0]))
        and eps == key[1]
        and notes == key[2]
    )


def _same_signature(kept: List[Tuple], signature: List[Tuple]) -> bool:
    return len(kept) == len(signature) and all(
        ref() is p and name == n and shape == s and trainable == t
        for (name, ref, shape, trainable), (n, p, s, t) in zip(kept, signature)
    )


@dataclass
class _Coverage:
    """The runs of one parameter's flat entries claimed so far (sorted, disjoint), and
    the position of the group owning each."""

    starts: torch.Tensor
    lengths: torch.Tensor
    owners: torch.Tensor


def _claim(
    group: SymmetryGroup,
    position: int,
    groups: Sequence[SymmetryGroup],
    coverage: Dict[str, _Coverage],
) -> None:
    """Add the runs of entries ``group`` covers to ``coverage`` (per parameter), or raise
    where another group has one: per parameter, the claimed runs and the group's are
    sorted together, and disjoint exactly when each run ends before the next starts."""
    for name, (starts, lengths) in zip(group.param_names, group.runs()):
        if not starts.numel():
            continue
        owners = torch.full_like(starts, position)
        claimed = coverage.get(name)
        if claimed is not None:
            starts = torch.cat([claimed.starts, starts])
            lengths = torch.cat([claimed.lengths, lengths])
            owners = torch.cat([claimed.owners, owners])
            order = torch.argsort(starts, stable=True)
            starts, lengths, owners = starts[order], lengths[order], owners[order]
        clash = structured.overlap(starts, lengths)
        if clash is not None:
            pair = (int(owners[clash - 1]), int(owners[clash]))
            other = groups[min(pair)] if min(pair) != position else groups[max(pair)]
            raise PlanError(
                f"parameter {name!r} is covered by two groups, {other.name!r} ({other.kind}) "
                f"and {group.name!r} ({group.kind}): overlapping symmetry groups are not "
                "combined (their actions need not commute, and a plan puts each entry in one "
                "point); keep one of them"
            )
        coverage[name] = _Coverage(starts, lengths, owners)


def _rest_group(
    name: str,
    shape: torch.Size,
    manifold: Manifold,
    starts: torch.Tensor,
    lengths: torch.Tensor,
) -> SymmetryGroup:
    """The entries of one parameter that no group covers (runs ``starts``, ``lengths``),
    in order, as one flat point."""
    label = name + " (rest)"
    if starts.numel() <= structured.MAX_BLOCKS:
        rest = structured.range_structure(starts, lengths)
        return StructuredGroup(label, manifold, (name,), (shape,), rest, "adaptive", 1)
    ends = torch.cumsum(lengths, 0)
    entries = torch.arange(int(ends[-1])) + torch.repeat_interleave(
        starts - ends + lengths, lengths
    )
    index = _compact(entries, shape.numel())
    return SymmetryGroup(label, manifold, (name,), (shape,), index, "adaptive", 1)


@dataclass
class BoundPlan:
    """A plan checked against one model: groups cover each trainable entry exactly once.

    Made by :meth:`SymmetryPlan.bind`, which adds an adaptive group
    (:class:`~geoopt_quotient.AdaptiveEuclidean`) for every parameter, or rest of a
    parameter, that no symmetry group covers.

    Attributes
    ----------
    groups : list of SymmetryGroup
        The plan's symmetry groups, then the adaptive ones (``kind == "adaptive"``).
    param_names : tuple of str
        The parameters the plan covers (the model's trainable ones, by default), in
        ``model.named_parameters()`` order.
    notes : list of str
        The plan's notes (what discovery recognised but did not handle).
    """

    groups: List[SymmetryGroup]
    param_names: Tuple[str, ...]
    notes: List[str] = field(default_factory=list)

    @property
    def metric(self) -> str | None:
        """The invariant metric of the plan's quotients (see :func:`plan_metric`)."""
        return plan_metric(self.groups)

    @property
    def symmetric_groups(self) -> List[SymmetryGroup]:
        return [g for g in self.groups if g.kind != "adaptive"]

    @property
    def adaptive_groups(self) -> List[SymmetryGroup]:
        return [g for g in self.groups if g.kind == "adaptive"]

    def gather(self, params: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
        return [g.gather(params) for g in self.groups]

    def adaptive_reasons(self) -> List[str]:
        """The notes saying why something attention-like was left to the adaptive geometry."""
        return [
            note
            for note in self.notes
            if "adaptive" in note and not note.startswith(("verif", NO_SYMMETRY))
        ]

    def geodesic_caveat(self) -> str | None:
        """Why geodesic sharpness on this plan is, in whole or in part, adaptive sharpness
        (``None`` where every recognised symmetry is quotiented).

        Returns
        -------
        str or None
            A message for a warning.
        """
        reasons = self.adaptive_reasons()
        why = "".join(f"\n  - {reason}" for reason in reasons)
        if not self.symmetric_groups:
            return (
                "the symmetry plan has no symmetric group: every parameter uses the adaptive "
                'geometry, so "geodesic" sharpness equals adaptive sharpness here' + why
            )
        if reasons:
            return (
                "the symmetry plan leaves some attention to the adaptive geometry, where "
                '"geodesic" sharpness is adaptive sharpness:' + why
            )
        return None

    def scatter(
        self, points: Iterable[torch.Tensor], params: Mapping[str, torch.Tensor]
    ) -> Dict[str, torch.Tensor]:
        """``params`` with every group's point written back (differentiable).

        The groups partition the trainable entries. Where every parameter is a few
        strided views of the points (:mod:`~geoopt_quotient.symmetry.strided`: the
        layouts of real architectures) and the views are large enough to pay, each is
        written with strided copies, forward and backward; otherwise all indexed groups
        are written with one permutation of their concatenated points (one gather
        forward, one scatter backward) instead of a copy of the parameters per group.
        """
        points = list(points)
        out = dict(params)
        partition = self._partition
        if partition is None:  # groups do not partition their parameters
            for group, point in zip(self.groups, points):
                out.update(group.scatter(point, out))
            return out
        indexed, names, shapes = partition
        for group, point in zip(self.groups, points):
            if isinstance(group, WholeParameterGroup):
                out[group.param_names[0]] = point
        sources = [points[i] for i in indexed]
        layout = self._strided
        if layout is not None and fits_strided(layout, sources):
            out.update(write_back(layout, sources))
        elif indexed:
            perm = self._permutation[3]
            joined = torch.cat([p.reshape(-1) for p in sources])
            flat = joined.index_select(0, self._on_device(perm, joined.device))
            for name, shape, piece in zip(names, shapes, flat.split([s.numel() for s in shapes])):
                out[name] = piece.view(shape)
        return out

    def _on_device(self, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        cache = self.__dict__.setdefault("_device_cache", {})
        if device not in cache:
            cache[device] = index.to(device)
        return cache[device]

    @functools.cached_property
    def _strided(self) -> StridedLayout | None:
        """The write-back as strided copies, if every piece of it is one."""
        partition = self._partition
        if partition is None or not partition[0]:
            return None
        indexed, names, shapes = partition
        sources = [self.groups[i].shape for i in indexed]
        groups = [self.groups[i] for i in indexed]
        if all(isinstance(g, StructuredGroup) for g in groups):
            pieces = structured.strided_pieces(
                [(g.structure, g.param_names) for g in groups], names, shapes
            )
            if pieces is None:
                return None
            return StridedLayout(
                tuple(names), tuple(shapes), pieces, tuple(torch.Size(s) for s in sources)
            )
        return strided_layout(names, shapes, sources, self._permutation[3])

    def _indexed(self) -> Tuple[List[int], Dict[str, torch.Size]]:
        """Positions of the groups other than whole parameters, and their parameters'
        shapes by name (in order of first appearance)."""
        indexed = [i for i, g in enumerate(self.groups) if not isinstance(g, WholeParameterGroup)]
        shapes: Dict[str, torch.Size] = {}
        for i in indexed:
            for name, shape in zip(self.groups[i].param_names, self.groups[i].param_shapes):
                shapes.setdefault(name, shape)
        return indexed, shapes

    @functools.cached_property
    def _partition(self):
        """(indexed group positions, parameter names, shapes) where the groups other than
        whole parameters cover each entry of their parameters once; else ``None``.
        Decided on the groups' runs of entries, without an index map."""
        indexed, shapes = self._indexed()
        if not all(isinstance(self.groups[i], StructuredGroup) for i in indexed):
            permutation = self._permutation
            return None if permutation is None else permutation[:3]
        runs: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in shapes}
        for i in indexed:
            for name, found in zip(self.groups[i].param_names, self.groups[i].runs()):
                runs[name].append(found)
        for name, shape in shapes.items():
            starts = torch.cat([r[0] for r in runs[name]])
            lengths = torch.cat([r[1] for r in runs[name]])
            order = torch.argsort(starts)
            starts, lengths = starts[order], lengths[order]
            if (
                int(lengths.sum()) != shape.numel()
                or structured.overlap(starts, lengths) is not None
            ):
                return None
        return indexed, list(shapes), list(shapes.values())

    @functools.cached_property
    def _permutation(self):
        """(indexed group positions, parameter names, shapes, permutation) or ``None``."""
        indexed, shapes = self._indexed()
        starts, total = {}, 0
        for name, shape in shapes.items():
            starts[name], total = total, total + shape.numel()
        sources = []
        for i in indexed:
            group = self.groups[i]
            sizes = torch.tensor([s.numel() for s in group.param_shapes])
            local = torch.cumsum(sizes, 0) - sizes
            start = torch.tensor([starts[n] for n in group.param_names])
            flat = group.index.reshape(-1)
            which = torch.searchsorted(local, flat, right=True) - 1
            sources.append(flat - local[which] + start[which])
        source = torch.cat(sources) if sources else torch.zeros(0, dtype=torch.long)
        if source.numel() != total or not is_permutation(source):
            return None
        perm = torch.empty_like(source)
        perm[source] = torch.arange(total)
        if total < 2**31:
            perm = perm.to(torch.int32)
        return indexed, list(shapes), list(shapes.values()), perm

    def act(
        self,
        params: Mapping[str, torch.Tensor],
        elements: Sequence[torch.Tensor | None],
        *,
        first_factor_only: bool = False,
    ) -> Dict[str, torch.Tensor]:
        """Apply group elements (one per symmetric group, ``None`` to skip) to ``params``.

        With ``first_factor_only`` each element moves its group's first factor alone
        (``QuotientManifold.act_on_first_factor``): not a symmetry, a control that must
        change the model's outputs.
        """
        groups = self.symmetric_groups
        if len(elements) != len(groups):
            raise PlanError(f"expected {len(groups)} group elements, got {len(elements)}")
        out = dict(params)
        for group, a in zip(groups, elements):
            if a is None:
                continue
            act = group.manifold.act_on_first_factor if first_factor_only else group.manifold.act
            out.update(group.scatter(act(group.gather(out), a), out))
        return out

    def summary(self, max_adaptive_rows: int = 24) -> str:
        """A readable table of the plan.

        One row per symmetric group (kind, symmetry group per block with its dimension,
        module, manifold, point shape, count), then
        the parameters left to the adaptive geometry with layer indices collapsed
        (``encoder.layer.*.output.dense.weight``), then the notes.
        """
        no_symmetry = NO_SYMMETRY
        rows = [("kind", "symmetry", "group", "manifold", "point shape", "count")]
        for g in self.symmetric_groups:
            name = g.name
            suffix = f" [{g.kind}]"
            if name.endswith(suffix):
                name = name[: -len(suffix)]
            rows.append(
                (
                    g.kind,
                    symmetry_label(g.manifold, g.shape[-1]),
                    name,
                    _manifold_label(g.manifold),
                    str(tuple(g.shape)),
                    str(g.count),
                )
            )
        lines = _table(rows) if len(rows) > 1 else [no_symmetry]
        n_adaptive = sum(g.shape.numel() for g in self.adaptive_groups)
        n_sym = sum(g.shape.numel() for g in self.symmetric_groups)
        lines.append(
            f"{n_sym} parameter entries in {len(self.symmetric_groups)} symmetric groups; "
            f"{n_adaptive} entries in {len(self.adaptive_groups)} tensors left to the "
            "adaptive geometry"
        )
        patterns: Dict[str, List[int]] = {}
        for g in self.adaptive_groups:
            key = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", g.name)
            tally = patterns.setdefault(key, [0, 0])
            tally[0] += 1
            tally[1] += g.shape.numel()
        if patterns:
            adaptive = [("adaptive parameters", "tensors", "entries")]
            adaptive += [(k, str(n), str(e)) for k, (n, e) in patterns.items()]
            if len(adaptive) > max_adaptive_rows + 1:
                rest = adaptive[max_adaptive_rows + 1 :]
                adaptive = adaptive[: max_adaptive_rows + 1]
                adaptive.append(
                    (
                        f"... {len(rest)} more",
                        str(sum(int(r[1]) for r in rest)),
                        str(sum(int(r[2]) for r in rest)),
                    )
                )
            lines.append("")
            lines.extend(_table(adaptive))
        notes = [note for note in self.notes if note != no_symmetry or len(rows) > 1]
        if notes:
            lines.append("")
        lines.extend(f"note: {note}" for note in notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def plan_metric(groups: Iterable[SymmetryGroup]) -> str | None:
    """The invariant metric (``"mix"`` or ``"inv"``) the groups' quotients measure in:
    ``None`` when no group has a choice of metric, ``"mixed"`` when they disagree.

    Parameters
    ----------
    groups : iterable of SymmetryGroup
        The groups of a plan.

    Returns
    -------
    str or None
        The metric.
    """
    metrics = {getattr(g.manifold, "metric", None) for g in groups} - {None}
    if len(metrics) > 1:
        return "mixed"
    return next(iter(metrics), None)


def _table(rows: Sequence[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def symmetry_label(manifold: Manifold, rank: int) -> str:
    """The group that acts on one block of a point, with its dimension: ``GL(8) [64]``,
    ``rotary C*^4 [8]``, ``rotary C*^2 x GL(4) [20]``, ``GL(1)+ [1]`` (positive
    scalings), ``GL(1)^6 [6]``; ``-`` if unknown.

    Parameters
    ----------
    manifold : geoopt.manifolds.Manifold
        The group's geometry.
    rank : int
        The trailing size of its points (the head size of an attention pair).

    Returns
    -------
    str
        A short label.
    """
    return group_label(manifold, rank)


def _manifold_label(manifold: Manifold) -> str:
    """Short label: ``GLQuotient(17+17, mix)``, ``DiagonalQuotient(inv)``, ``Sphere()``."""
    name = type(manifold).__name__
    parts = []
    if hasattr(manifold, "n") and hasattr(manifold, "m"):
        parts.append(f"{manifold.n}+{manifold.m}")
    if isinstance(getattr(manifold, "metric", None), str):
        parts.append(manifold.metric)
    eps = getattr(manifold, "eps", None)
    if isinstance(eps, float) and eps > 0:
        parts.append(f"eps={eps:g}")
    if parts:
        return f"{name}({', '.join(parts)})"
    extra = manifold.extra_repr() if hasattr(manifold, "extra_repr") else ""
    return f"{name}({extra})"
