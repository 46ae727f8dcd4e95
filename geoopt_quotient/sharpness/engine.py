r"""The sharpness engine's loop: every batch at every radius, wherever it runs.

:func:`run` measures a model's batches at radii :math:`\rho_1 < \dots < \rho_K`: it
opens the ball of the plan at the model's parameters, measures each batch at every
radius (:func:`measure_batch`: Auto-PGD for the worst case, samples for the average),
and gathers one :class:`BatchRecord` per batch and radius, in batch order. Where that
runs is a :class:`Placement`, chosen by :func:`choose_placement`:

* :class:`Local`: one process, every batch.
* :class:`SharedBatches`: the ranks of a ``torch.distributed`` process group, each
  passing its share of the batches (``process_group=``;
  :class:`~geoopt_quotient.sharpness.ranks.BatchShare`).
* :class:`StridedBatches`: the older mode (``distributed=``, deprecated), every rank
  passing all batches and measuring every ``world_size``-th.
* :class:`ShardedModel`: a model sharded by FSDP2, every rank passing its rows of every
  batch, the ball split over the ranks
  (:class:`~geoopt_quotient.sharpness.sharded.ShardedBall`).

A placement opens the ball (a :class:`LocalBall` or a sharded one), runs the batches it
holds, and gathers the records and the wall time; the loop and the searches are the same
for all. :func:`~geoopt_quotient.geodesic_sharpness` turns the records into results.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .._checks import PATHS, check_choice, check_nonnegative_int, check_positive_int
from .._model_state import preserved_model_state
from .._progress import show_progress
from ..errors import GeooptQuotientWarning
from ..symmetry.plan import BoundPlan
from .apgd import (
    BallGroup,
    as_scalar,
    average_in_ball,
    check_scalar_finite,
    check_state_dtype,
    maximize_in_ball,
)
from .ball import LocalBall
from .functional import check_depends_on_perturbation, noting_batch
from .path_gap import estimated_path_gap, path_gap
from .ranks import BatchShare
from .sharded import ShardedBall, is_sharded, sharded_ball

__all__ = [
    "KINDS",
    "RESTART_SEED_STRIDE",
    "BatchRecord",
    "DistributedModeDeprecationWarning",
    "Local",
    "Measurement",
    "Placement",
    "Search",
    "ShardedModel",
    "SharedBatches",
    "StridedBatches",
    "choose_placement",
    "measure_batch",
    "run",
]

#: The two kinds of sharpness: the worst case (Auto-PGD) and the average case.
KINDS = ("worst", "average")

#: Seeds of the random starts: restart ``r`` of the batch with seed ``s`` (``seed + i``)
#: draws from ``s + r * RESTART_SEED_STRIDE``, away from the other batches' seeds.
RESTART_SEED_STRIDE = 1_000_003


class DistributedModeDeprecationWarning(GeooptQuotientWarning, FutureWarning):
    """The older ``distributed=`` mode (every rank passes all batches) is deprecated:
    pass ``process_group=`` with each rank's share of the batches instead."""


@dataclass
class Search:
    """How each batch is measured at each radius (checked on construction).

    Attributes
    ----------
    kind : {"worst", "average"}
        Auto-PGD's maximum, or the mean over Gaussian samples.
    iters : int
        Auto-PGD iterations, or samples.
    path : {"second_order", "exact", "straight"}
        The path of the perturbations.
    seed : int
        Batch ``i`` is measured with seed ``seed + i``.
    norm : bool
        The quotients' own metric (``True``) or the adaptive one (the norm ablation).
    restarts : int
        Worst case: more Auto-PGD searches from random points of the ball.
    keep_best_gradient : bool or None
        As for :func:`~geoopt_quotient.maximize_in_ball`.
    shares : bool
        Worst case: each block's and symmetry kind's share of the maximiser
        (:func:`~geoopt_quotient.sharpness.maximiser_shares`).
    path_report : bool
        Worst case on ``path="second_order"``: also the exact geodesic's report at the
        maximiser (:func:`~geoopt_quotient.sharpness.path_gap.path_gap`: its float64
        integration and one forward pass); without it only the estimate
        (:func:`~geoopt_quotient.sharpness.path_gap.estimated_path_gap`).
    share_storage : bool
        Worst case: the ball's base point shares the model's storage instead of copying
        it (:class:`~geoopt_quotient.sharpness.layout.BallLayout`).
    state_dtype : torch.dtype or None
        Worst case: the dtype of Auto-PGD's iterates and gradients, as
        :func:`~geoopt_quotient.maximize_in_ball` takes it (a name is converted).
    """

    kind: str
    iters: int
    path: str
    seed: int
    norm: bool
    restarts: int = 0
    keep_best_gradient: bool | None = None
    shares: bool = False
    path_report: bool = False
    share_storage: bool = False
    state_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self.iters = check_positive_int(self.iters, "iters")
        self.restarts = check_nonnegative_int(self.restarts, "restarts")
        if self.restarts and self.kind != "worst":
            raise ValueError("`restarts` is for the worst case (kind='worst') only")
        if self.shares and self.kind != "worst":
            raise ValueError("`shares` are those of the worst case's maximiser: use kind='worst'")
        if self.path_report and self.kind != "worst":
            raise ValueError(
                "`path_report` is on the worst case's maximiser: use kind='worst', or leave "
                "path_report=False"
            )
        if self.share_storage and self.kind != "worst":
            raise ValueError(
                "`share_storage` shares the worst case's base point with the model: use "
                "kind='worst', or leave share_storage=False"
            )
        self.state_dtype = check_state_dtype(self.state_dtype)
        if self.state_dtype is not None and self.kind != "worst":
            raise ValueError(
                "`state_dtype` is the dtype of the worst case's Auto-PGD state: use "
                "kind='worst', or leave state_dtype=None"
            )
        check_choice(self.path, PATHS, "path")
        check_choice(self.kind, KINDS, "kind")


@dataclass
class BatchRecord:
    """What was measured on one batch at one radius.

    Attributes
    ----------
    index : int
        The batch's index among all batches (global, over ranks).
    clean : float
        The loss at the unperturbed parameters.
    perturbed : float
        The worst (or mean) loss at the perturbed parameters.
    history : list of float
        The loss at every Auto-PGD iterate of the kept search, or at every sample.
    forward_passes, backward_passes : int
        The passes made, by all searches at this radius.
    seconds : float
        Wall time of the batch at this radius.
    path_gap, exact_loss : float or None
        Worst case on ``path="second_order"`` with ``Search.path_report``: the path gap
        at the maximiser and the loss on the exact geodesic there
        (:func:`~geoopt_quotient.sharpness.path_gap.path_gap`); else ``None``.
    shares : list of dict or None
        With ``Search.shares``: the maximiser's shares per block and kind.
    estimated_path_gap : float or None
        Worst case on ``path="second_order"``: the estimated path gap at the maximiser
        (:func:`~geoopt_quotient.sharpness.path_gap.estimated_path_gap`, no forward
        pass); else ``None``.
    """

    index: int
    clean: float
    perturbed: float
    history: List[float]
    forward_passes: int
    backward_passes: int
    seconds: float
    path_gap: Optional[float] = None
    exact_loss: Optional[float] = None
    shares: Optional[List[Dict[str, Any]]] = None
    estimated_path_gap: Optional[float] = None

    @property
    def sharpness(self) -> float:
        """The perturbed loss minus the clean loss."""
        return self.perturbed - self.clean


@dataclass
class Measurement:
    """What :func:`run` measured.

    Attributes
    ----------
    records : list of list of BatchRecord
        Per radius (in the order given), one record per batch, in batch order (the same
        on every rank).
    seconds : float
        Wall time of the whole measurement (the slowest rank's where ranks share batches).
    weights : dict of str to torch.Tensor
        The parameters (or, on a sharded model, whether each is not all zero), for the
        diagnosis of a worst case of exactly 0
        (:func:`~geoopt_quotient.sharpness.measure.zero_weight_parameters`).
    """

    records: List[List[BatchRecord]]
    seconds: float
    weights: Dict[str, torch.Tensor]


# ---------------------------------------------------------------------------- one batch
def measure_batch(
    search: Search, ball: Any, batch: Any, radii: Sequence[float], index: int, first: bool
) -> List[BatchRecord]:
    """Per radius, the :class:`BatchRecord` of batch ``index`` (seeded ``seed + index``).

    ``ball`` has the ball ``groups``, the batch's ``objective(batch)``, the ``exact``
    groups of the path-gap estimate and report (or ``None``) and ``keep_best_gradient``. The worst
    case's best perturbation is dropped here rather than kept alive while the next batch
    is measured. Its first evaluation differentiates the loss, which checks that it
    depends on the perturbation; the average case, which never differentiates, checks
    that on its clean loss on the ``first`` batch.
    """
    objective = ball.objective(batch)
    seed = search.seed + index
    if search.kind == "worst":
        options = dict(
            iters=search.iters,
            path=search.path,
            seed=seed,
            keep_best_gradient=ball.keep_best_gradient,
            state_dtype=search.state_dtype,
        )
        return _maximize_over_radii(
            ball.groups,
            objective,
            radii,
            index,
            search.restarts,
            ball.exact,
            options,
            search.path_report,
            getattr(ball, "shares_of", None),
        )
    records = []
    for rho in radii:
        t0 = time.perf_counter()
        clean, mean, samples = _average_batch(
            ball.groups, objective, rho, search.iters, search.path, seed, check=first
        )
        first = False
        seconds = time.perf_counter() - t0
        records.append(BatchRecord(index, clean, mean, samples, search.iters + 1, 0, seconds))
    return records


def _average_batch(
    groups: List[BallGroup],
    objective: Callable,
    rho: float,
    iters: int,
    path: str,
    seed: int,
    check: bool,
) -> tuple:
    """(clean loss, mean perturbed loss, samples) of one batch at one scale."""
    if check:  # new tensors: the stale-parameter check tells them from the model's
        with torch.enable_grad():
            clean_value = as_scalar(objective([g.point.clone().requires_grad_() for g in groups]))
        check_depends_on_perturbation(clean_value, grads_found=True)
    else:
        with torch.no_grad():
            clean_value = as_scalar(objective([g.point for g in groups]))
    clean_loss = check_scalar_finite(clean_value.detach())
    top, history = average_in_ball(groups, objective, rho=rho, samples=iters, path=path, seed=seed)
    return clean_loss, top, history


def _maximize_over_radii(
    groups: List[BallGroup],
    objective: Callable,
    radii: Sequence[float],
    index: int,
    restarts: int,
    exact: List[BallGroup] | None,
    options: Dict[str, Any],
    report: bool,
    shares_of: Callable | None = None,
) -> List[BatchRecord]:
    r"""Auto-PGD at each radius of the increasing ``radii``, monotone by construction.

    At :math:`\rho_1` one search from :math:`\xi = 0`. At each larger :math:`\rho_k`, a
    search from :math:`\xi = 0` (the single-radius run, bit for bit) and one from the best
    point :math:`\xi^*_{k-1}` so far, which lies in the larger ball (the balls at one base
    point are nested, and the path does not depend on the radius); the best of the two
    and of :math:`\xi^*_{k-1}` itself is kept, so the values never decrease. At every
    radius, ``restarts`` more searches from random points (:func:`_restart_searches`).
    With ``exact`` (the groups on the exact path), the estimated path gap at the kept
    maximiser (:func:`~geoopt_quotient.sharpness.path_gap.estimated_path_gap`: no
    pass) and, with ``report``, the exact one
    (:func:`~geoopt_quotient.sharpness.path_gap.path_gap`: one forward pass).
    ``options``: Auto-PGD's ``iters``, ``path``, ``seed`` and ``keep_best_gradient``. With
    ``shares_of``, ``shares_of(xi, gradient)`` of the kept maximiser and the gradient at
    the base point (the first search's first iterate's: no extra pass).
    """
    records: List[BatchRecord] = []
    best_value, best_xi = -math.inf, None
    gradient = None
    for rho in radii:
        t0 = time.perf_counter()
        keep = shares_of is not None and gradient is None
        run = maximize_in_ball(groups, objective, rho=rho, keep_initial_gradient=keep, **options)
        gradient = run.initial_gradient if keep else gradient
        clean, passes = run.initial_value, [run.evaluations, run.gradients]
        top, history, xi = run.value, run.history, run.xi
        if best_xi is not None:
            warm = maximize_in_ball(groups, objective, rho=rho, init=best_xi, **options)
            passes = [passes[0] + warm.evaluations, passes[1] + warm.gradients]
            if warm.value > top:
                top, history, xi = warm.value, warm.history, warm.xi
            if best_value > top:  # the previous maximiser, still feasible, stays ahead
                top, history, xi = best_value, warm.history, best_xi
        for extra in _restart_searches(groups, objective, rho, restarts, options):
            passes = [passes[0] + extra.evaluations, passes[1] + extra.gradients]
            if extra.value > top:
                top, history, xi = extra.value, extra.history, extra.xi
        best_value, best_xi = top, xi
        gap = exact_loss = estimate = None
        if exact is not None:
            estimate = estimated_path_gap(groups, exact, xi, run.spaces)
        if exact is not None and report:
            gap, exact_loss = path_gap(groups, exact, objective, xi)
            passes[0] += not math.isnan(gap)  # no forward where the geodesic broke down
        shares = None if shares_of is None else shares_of(xi, gradient)
        seconds = time.perf_counter() - t0
        records.append(
            BatchRecord(
                index, clean, top, history, *passes, seconds, gap, exact_loss, shares, estimate
            )
        )
    return records


def _restart_searches(
    groups: List[BallGroup],
    objective: Callable,
    rho: float,
    restarts: int,
    options: Dict[str, Any],
) -> Iterator[Any]:
    r"""``restarts`` Auto-PGD searches at radius ``rho``, each from a random point of the
    ball (``init="random"``: a Gaussian horizontal vector in the metric with standard
    deviation :math:`\rho` per dimension, projected onto the ball, so on its sphere but
    in the fewest dimensions), seeded from the batch's seed: deterministic."""
    seed = options["seed"]
    for restart in range(1, restarts + 1):
        start = dict(options, seed=seed + restart * RESTART_SEED_STRIDE)
        yield maximize_in_ball(groups, objective, rho=rho, init="random", **start)


# ---------------------------------------------------------------------------- placements
class Placement:
    """Where a measurement runs: which batches this process measures, with which ball,
    and how the records of all processes come together.

    Attributes
    ----------
    rank : int
        This process's rank (0 in one process); only rank 0 shows progress.
    deprecated : bool
        Whether this is the older ``distributed=`` mode
        (:class:`DistributedModeDeprecationWarning`).
    """

    rank = 0
    deprecated = False

    @contextlib.contextmanager
    def open(
        self, model: torch.nn.Module, plan: BoundPlan, loss_fn: Callable, search: Search
    ) -> Iterator[Any]:
        """The ball of ``plan`` at ``model`` (a :class:`~.ball.LocalBall` here), for the
        duration of the block."""
        yield LocalBall(
            model,
            plan,
            loss_fn,
            kind=search.kind,
            path=search.path,
            norm=search.norm,
            keep_best_gradient=search.keep_best_gradient,
            shares=search.shares,
            share_storage=search.share_storage,
        )

    def local(self, batches: Iterable[Any]) -> Iterable[Any]:
        """The batches this process iterates over."""
        return batches

    def run(self, measure: Callable[[int, Any], None], items: Iterable[Any]) -> None:
        """``measure(index, batch)`` for each batch this process measures, in order."""
        for index, batch in enumerate(items):
            with noting_batch(index):
                measure(index, batch)

    def gather(self, records: List[BatchRecord]) -> List[BatchRecord]:
        """Every process's records, in batch order (the same on every rank)."""
        return sorted(records, key=_index)

    def slowest(self, seconds: float) -> float:
        """The wall time the result reports, from this process's ``seconds``."""
        return seconds


def _index(record: BatchRecord) -> int:
    return record.index


class Local(Placement):
    """One process measures every batch."""


class StridedBatches(Placement):
    """The older mode (``distributed=``, deprecated): every rank passes all batches and
    measures batch ``i`` where ``i % world == rank``; the records are gathered
    (:func:`torch.distributed.all_gather_object`), so every rank returns the
    single-process result.

    Parameters
    ----------
    world, rank : int
        The size of the default process group, and this process's rank in it.
    """

    deprecated = True

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    def run(self, measure: Callable[[int, Any], None], items: Iterable[Any]) -> None:
        for index, batch in enumerate(items):
            if index % self.world == self.rank:
                with noting_batch(index):
                    measure(index, batch)

    def gather(self, records: List[BatchRecord]) -> List[BatchRecord]:
        if self.world > 1:
            import torch.distributed as dist

            shards: List[Any] = [None] * self.world
            dist.all_gather_object(shards, records)
            records = [r for shard in shards for r in shard]
        return sorted(records, key=_index)


class SharedBatches(Placement):
    """The ranks of a process group, each passing its share of the batches
    (``process_group=``), in rounds in which every rank says whether it failed
    (:meth:`~geoopt_quotient.sharpness.ranks.BatchShare.run`); every rank returns the
    single-process result, with the slowest rank's wall time.

    Parameters
    ----------
    share : BatchShare
        This rank's share of the batches.
    """

    def __init__(self, share: BatchShare):
        self.share, self.rank = share, share.rank

    def local(self, batches: Iterable[Any]) -> Iterable[Any]:
        return self.share.local

    def run(self, measure: Callable[[int, Any], None], items: Iterable[Any]) -> None:
        self.share.run(measure, items)

    def gather(self, records: List[BatchRecord]) -> List[BatchRecord]:
        return self.share.gather(records, key=_index)

    def slowest(self, seconds: float) -> float:
        return self.share.maximum(seconds)


class ShardedModel(Placement):
    """A model sharded by FSDP2: every rank passes its rows of every batch, and holds its
    piece of one ball per global batch
    (:class:`~geoopt_quotient.sharpness.sharded.ShardedBall`)."""

    @contextlib.contextmanager
    def open(
        self, model: torch.nn.Module, plan: BoundPlan, loss_fn: Callable, search: Search
    ) -> Iterator[Any]:
        """The sharded ball, checked on every rank, with ``keep_best_gradient`` resolved
        alike on every rank; the model's shards and gradients restored on exit."""
        if search.shares:
            raise ValueError("`shares` is not available for a sharded (FSDP2) model yet")
        ball = sharded_ball(model, plan, loss_fn, path=search.path, norm=search.norm)
        self.rank = ball.rank
        try:
            ball.check_base_points()
            keep = ball.keep_best_gradient(search.keep_best_gradient, search.state_dtype)
            yield _OpenShardedBall(ball, keep)
        finally:
            ball.restore()


@dataclass
class _OpenShardedBall:
    """A :class:`ShardedBall` as the loop uses it: groups, objective, no exact path."""

    ball: ShardedBall
    keep_best_gradient: bool
    exact = None

    @property
    def groups(self) -> List[BallGroup]:
        return self.ball.groups

    def objective(self, batch: Any) -> Any:
        return self.ball.objective(batch)

    def weights(self) -> Dict[str, torch.Tensor]:
        return self.ball.nonzero_parameters()


def choose_placement(
    model: torch.nn.Module,
    batches: Iterable[Any],
    search: Search,
    *,
    distributed: bool | None,
    process_group: Any,
) -> Placement:
    """Where to measure: :class:`ShardedModel` for an FSDP2 model, :class:`SharedBatches`
    with a ``process_group`` (a collective: the ranks exchange their share sizes),
    :class:`StridedBatches` for ``distributed=True`` or, with ``distributed=None``, an
    initialised process group of several ranks; else :class:`Local`.

    Raises
    ------
    ValueError
        For what a sharded model cannot do (``process_group``, ``restarts``, the average
        case), or ``process_group`` with ``distributed=True``.
    RuntimeError
        For ``distributed=True`` without an initialised process group.
    """
    if is_sharded(model):  # FSDP2: each rank holds its rows of the model and of each batch
        _check_sharded(search, process_group)
        return ShardedModel()
    if process_group is not None:
        if distributed:
            raise ValueError(
                "pass either `process_group` (each rank passes its share of the batches) or "
                "`distributed=True` (every rank passes all batches), not both"
            )
        return SharedBatches(BatchShare(batches, process_group))
    world, rank = _default_group(distributed)
    if distributed or world > 1:
        return StridedBatches(world, rank)
    return Local()


def _check_sharded(search: Search, process_group: Any) -> None:
    if process_group is not None:
        raise ValueError(
            "`process_group` splits the batches over the ranks, but a sharded (FSDP2) "
            "model needs every rank to pass its rows of every batch: leave "
            "process_group=None"
        )
    if search.restarts:
        raise ValueError("`restarts` is not available for a sharded (FSDP2) model yet")
    if search.kind != "worst":
        raise ValueError(
            "kind='average' is not supported for a sharded (FSDP2) model: its samples would "
            "need one generator stream per piece of the ball; use kind='worst'"
        )


def _default_group(distributed: bool | None) -> tuple:
    """(world size, rank) of the default process group for the older mode; (1, 0) when
    ``distributed=False`` or none is initialised."""
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized()
    if distributed and not active:
        raise RuntimeError(
            "`distributed=True` needs an initialised torch.distributed process group "
            "(e.g. run under torchrun and call torch.distributed.init_process_group)"
        )
    if distributed is False or not active:
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


# ---------------------------------------------------------------------------- the loop
def run(
    model: torch.nn.Module,
    loss_fn: Callable,
    batches: Iterable[Any],
    plan: BoundPlan,
    placement: Placement,
    search: Search,
    radii: Sequence[float],
    *,
    progress: bool | None,
    label: str,
) -> Measurement:
    """Measure every batch at every radius of the increasing ``radii``, where
    ``placement`` says; the model's state is restored on exit (also after an exception).

    Parameters
    ----------
    model, loss_fn, batches, plan
        As for :func:`~geoopt_quotient.geodesic_sharpness` (the plan bound to ``model``).
    placement : Placement
        Where it runs (:func:`choose_placement`).
    search : Search
        How each batch is measured.
    radii : sequence of float
        The radii, increasing.
    progress : bool or None
        Show a progress bar on rank 0 (``None``: when stderr is a terminal).
    label : str
        The progress bar's name of the measure (``"geodesic"``, ``"adaptive"``).

    Returns
    -------
    Measurement
        The records per radius and batch, the wall time and the weights.
    """
    start = time.perf_counter()
    records: List[List[BatchRecord]] = [[] for _ in radii]
    with preserved_model_state(model), placement.open(model, plan, loss_fn, search) as ball:
        bar = tqdm(
            placement.local(batches),
            desc=f"{label} sharpness",
            unit="batch",
            disable=not show_progress(progress) or placement.rank > 0,
            leave=False,
        )

        def measure(index: int, batch: Any) -> None:
            outcome = measure_batch(search, ball, batch, radii, index, first=not records[0])
            for per_radius, record in zip(records, outcome):
                per_radius.append(record)

        placement.run(measure, bar)
        weights = ball.weights()
    seconds = placement.slowest(time.perf_counter() - start)
    return Measurement([placement.gather(r) for r in records], seconds, weights)
