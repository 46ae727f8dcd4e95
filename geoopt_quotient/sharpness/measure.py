r"""Geodesic and adaptive sharpness of a model (Eq. 3 of "Hide & Seek").

.. math::

    S_{\max} = \frac1B \sum_b \Big[\max_{\xi \in \mathcal H_w,\ |\xi|_w \le \rho}
        L_b(\gamma_\xi(1)) - L_b(w)\Big], \qquad
    S_{\mathrm{avg}} = \frac1B \sum_b \mathbb E_{\xi}\big[L_b(\gamma_\xi(1)) - L_b(w)\big],

with :math:`\gamma_\xi` the geodesic (or second-order retraction) from :math:`w` with
velocity :math:`\xi`, :math:`\mathcal H_w` the horizontal space of the symmetry
quotients, :math:`|\cdot|_w` their GL-invariant metric, joint with the adaptive metric
:math:`\sum \xi^2 / |w|^2` for every parameter outside a symmetry group.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .._checks import check_choice, check_positive_float
from ..errors import GeooptQuotientWarning
from ..symmetry import GeodesicEqualsAdaptiveWarning, find_symmetries
from ..symmetry.plan import (
    BoundPlan,
    PlanError,
    SymmetryGroup,
    SymmetryPlan,
    bound_once,
    plan_metric,
)
from ..symmetry.verify import ProbeError
from .defaults import default_radius
from .engine import (
    BatchRecord,
    DistributedModeDeprecationWarning,
    Measurement,
    Search,
    choose_placement,
    run,
)
from .functional import check_batches, check_loss_fn
from .path_gap import warn_if_estimated_path_gap, warn_if_path_gap
from .results import ResultList, Table
from .shares import mean_shares

__all__ = [
    "SharpnessResult",
    "ZeroSharpnessWarning",
    "adaptive_sharpness",
    "geodesic_sharpness",
    "resolve_plan",
]

LossFn = Callable[[Any, Any], torch.Tensor]
Symmetries = Union[None, SymmetryPlan, BoundPlan, Sequence[SymmetryGroup]]
Radii = Union[float, Sequence[float]]


@dataclass
class SharpnessResult(Table):
    r"""Sharpness of one model.

    Attributes
    ----------
    value : float
        Mean over batches of (perturbed loss - clean loss).
    per_batch : list of float
        The sharpness of each batch.
    clean_losses, perturbed_losses : list of float
        Loss at the unperturbed parameters and at the worst (or mean) perturbation.
    histories : list of list of float
        Per batch, the loss at every Auto-PGD iterate (worst case) or sample (average).
    seconds : float
        Wall time of the whole call, in seconds.
    seconds_per_batch : list of float
        Wall time of each batch, in seconds.
    forward_passes, backward_passes : list of int
        Per batch, the evaluations of ``loss_fn`` and the backward passes through it:
        ``iters + 1`` and ``iters`` for the worst case, plus one of each per Auto-PGD
        restart, those of every search (``restarts``, a grid's warm starts) and, with
        ``path_report=True``, one forward pass for ``exact_losses``; ``iters + 1`` and 0
        for the average case.
    settings : dict
        The settings used (``measure``, ``rho``, ``iters``, ``path``, ``kind``, ``seed``,
        ``eps``, ``restarts``, and for geodesic sharpness ``metric``, ``norm``, ``curvature``).
    plan : str
        The symmetry plan's summary table
        (:meth:`~geoopt_quotient.symmetry.BoundPlan.summary`).
    path_gaps : list of float or None
        Worst case on ``path="second_order"`` with ``path_report=True`` only (else
        ``None``, and for an FSDP2-sharded model, which has no such report yet): per
        batch, the
        relative gap between the path's point and the exact geodesic's at the maximiser
        :math:`\xi^*`,
        :math:`|R_w(\xi^*) - \operatorname{Exp}_w(\xi^*)|_w / |\xi^*|_w` in the metric at
        :math:`w` (:mod:`~geoopt_quotient.sharpness.path_gap`; 0 for
        :math:`\xi^* = 0`, NaN where the geodesic cannot be integrated that far).
        :math:`O(\rho^2)` on the symmetry groups; the adaptive parameters' straight line
        adds :math:`O(\rho)`.
    estimated_path_gaps : list of float or None
        Worst case on ``path="second_order"`` (else ``None``, and for an FSDP2-sharded
        model): per batch, an estimate of ``path_gaps`` from the maximiser alone, without
        integrating the geodesic or a forward pass: the adaptive parameters' share
        exactly, the symmetry groups' from their curvature correction
        :math:`c = \tfrac12 \Gamma_w(\xi^*, \xi^*)` as :math:`\tfrac23 |c|^2 / |\xi^*|`
        per point (:func:`~geoopt_quotient.sharpness.path_gap.estimated_path_gap`).
    exact_losses : list of float or None
        Alongside ``path_gaps``: per batch, the loss at
        :math:`\operatorname{Exp}_w(\xi^*)`, the exact geodesic's point at the same
        maximiser (one more forward pass). ``exact_losses[b] - clean_losses[b]`` is a
        lower bound of the exact path's sharpness of batch ``b``.
    shares : list of dict or None
        With ``shares=True``: per (block, kind) of the plan, the mean over batches of the
        maximiser's :math:`|\xi^*_{\text{block}}|^2` in the metric (``norm_sq``; they sum
        to the mean :math:`|\xi^*|_w^2`, :math:`\rho^2` for maximisers on the sphere)
        and of its first-order loss increase
        :math:`\langle \operatorname{grad} L(w), \xi^*_{\text{block}} \rangle_w`
        (``first_order``), from the maximiser itself
        (:func:`~geoopt_quotient.sharpness.maximiser_shares`); :meth:`share_rows`
        as a table. ``None`` otherwise.
    shares_per_batch : list of list of dict or None
        The same per batch.
    """

    value: float
    per_batch: List[float]
    clean_losses: List[float]
    perturbed_losses: List[float]
    histories: List[List[float]]
    seconds: float
    seconds_per_batch: List[float]
    forward_passes: List[int] = field(default_factory=list)
    backward_passes: List[int] = field(default_factory=list)
    settings: Dict[str, Any] = field(default_factory=dict)
    plan: str = ""
    path_gaps: Optional[List[float]] = None
    exact_losses: Optional[List[float]] = None
    shares: Optional[List[Dict[str, Any]]] = None
    shares_per_batch: Optional[List[List[Dict[str, Any]]]] = None
    estimated_path_gaps: Optional[List[float]] = None

    def to_dict(self) -> Dict[str, Any]:
        """Every attribute, as plain Python values (JSON-serialisable)."""
        return asdict(self)

    def rows(self) -> List[Dict[str, Any]]:
        """One flat record per batch: its index, sharpness, clean and perturbed loss,
        passes and seconds, followed by the settings (the same in every row), and the
        ``path_gap`` and ``exact_loss`` where the result has them."""
        columns = zip(
            self.per_batch,
            self.clean_losses,
            self.perturbed_losses,
            self.forward_passes or [None] * len(self.per_batch),
            self.backward_passes or [None] * len(self.per_batch),
            self.seconds_per_batch,
        )
        rows = [
            {
                "batch": index,
                "sharpness": sharpness,
                "clean_loss": clean,
                "perturbed_loss": perturbed,
                "forward_passes": forward,
                "backward_passes": backward,
                "seconds": seconds,
                **self.settings,
            }
            for index, (sharpness, clean, perturbed, forward, backward, seconds) in enumerate(
                columns
            )
        ]
        if self.path_gaps is not None:
            for row, gap, exact in zip(rows, self.path_gaps, self.exact_losses or []):
                row.update(path_gap=gap, exact_loss=exact)
        return rows

    def share_rows(self) -> List[Dict[str, Any]]:
        r""":attr:`shares` as flat records, each with its fraction of the totals:
        ``block``, ``kind``, ``norm_sq``, ``norm_share`` (of :math:`|\xi^*|^2`),
        ``first_order``, ``first_order_share`` (of the first-order total; NaN when it is
        0); empty without shares."""
        rows = [dict(r) for r in self.shares or []]
        norm = sum(r["norm_sq"] for r in rows)
        first = sum(r["first_order"] for r in rows)
        for row in rows:
            row["norm_share"] = row["norm_sq"] / norm if norm else math.nan
            row["first_order_share"] = row["first_order"] / first if first else math.nan
        return rows


def resolve_plan(
    model: torch.nn.Module,
    symmetries: Symmetries,
    metric: str,
    eps: float = 0.0,
    probe: Callable[[torch.nn.Module], Any] | None = None,
) -> BoundPlan:
    """Bind ``symmetries`` to ``model``; ``None`` finds them
    (:func:`~geoopt_quotient.symmetry.find_symmetries`), proven on probe inputs built
    from the model's config, or else on ``probe`` (e.g. the loss on the first batch).
    A plan bound to the same model before, neither changed since, gets the same
    :class:`~geoopt_quotient.symmetry.BoundPlan`
    (:func:`~geoopt_quotient.symmetry.plan.bound_once`), and with it what the sharpness
    ball keeps per bound plan (its layout of the parameters).

    Raises
    ------
    PlanError
        If a given plan's quotients use another metric than ``metric``
        (:func:`resolve_metric`), or if discovery has no probe to prove its groups on.
    """
    resolve_metric(symmetries, metric)
    if isinstance(symmetries, BoundPlan):
        return symmetries
    if symmetries is None:
        return discover(model, metric, eps, fallback=probe).bind(model)
    if not isinstance(symmetries, SymmetryPlan):
        symmetries = SymmetryPlan(list(symmetries))
    return bound_once(symmetries, model)


def discover(
    model: torch.nn.Module,
    metric: str,
    eps: float = 0.0,
    *,
    fallback: Callable[[torch.nn.Module], Any] | None = None,
    **options: Any,
) -> SymmetryPlan:
    """:func:`~geoopt_quotient.symmetry.find_symmetries`, each group proven on probe inputs
    built from the model (its config, or its first layer); where none can be built or run,
    on ``fallback`` (e.g. :func:`loss_probe`, the loss on the first batch), so that the
    user's ``loss_fn`` is called only where nothing else proves the plan.

    Raises
    ------
    ProbeError
        Where no probe runs the model and there is no ``fallback``.
    """
    try:
        return find_symmetries(model, metric=metric, eps=eps, **options)
    except ProbeError:
        if fallback is None:
            raise
        return find_symmetries(model, metric=metric, eps=eps, probe_inputs=fallback, **options)


def resolve_metric(symmetries: Symmetries, metric: str | None) -> str:
    """The metric a geodesic measure measures in: ``metric``, or when ``None`` the given
    plan's (``"mix"`` without one).

    Raises
    ------
    PlanError
        If the plan's quotients use another metric than ``metric``: the result would be
        labelled with one metric and measured in the other.
    """
    own = None
    if isinstance(symmetries, (SymmetryPlan, BoundPlan)):
        own = symmetries.metric
    elif symmetries is not None:
        own = plan_metric(symmetries)
    if metric is None:
        return own if own in ("mix", "inv") else "mix"
    check_choice(metric, ("mix", "inv"), "metric")
    if own is not None and own != metric:
        raise PlanError(
            f"the symmetry plan's quotients use the {own!r} metric, but metric={metric!r} was "
            f"asked for: find the plan with find_symmetries(model, metric={metric!r}), or "
            f"measure with metric={own!r} (or leave metric unset to use the plan's)"
        )
    return metric


def loss_probe(loss_fn: LossFn, batches: Any) -> Callable[[torch.nn.Module], Any] | None:
    """``model -> loss_fn(model, first batch)`` when ``batches`` can be indexed without
    being consumed (a list or tuple), else ``None``."""
    if isinstance(batches, (list, tuple)) and batches:
        first = batches[0]
        return lambda model: loss_fn(model, first)
    return None


def _measure(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    plan: BoundPlan,
    rho: Radii,
    settings: Dict[str, Any],
    *,
    curvature: bool,
    progress: bool | None,
    distributed: bool | None,
    process_group: Any,
    **search: Any,
) -> Union[SharpnessResult, List[SharpnessResult]]:
    """The result at ``rho``, or one per radius of a grid (:func:`_radii`), measured by the
    engine (:func:`~geoopt_quotient.sharpness.engine.run`) where ``distributed`` and
    ``process_group`` say (:func:`~geoopt_quotient.sharpness.engine.choose_placement`);
    ``search``: the :class:`~geoopt_quotient.sharpness.engine.Search` options."""
    radii, arrange = _radii(rho)
    if not curvature:  # curvature off: straight lines everywhere
        search["path"] = "straight"
    search = Search(**search)
    if search.state_dtype is not None:
        settings = {**settings, "state_dtype": str(search.state_dtype).removeprefix("torch.")}
    check_batches(batches)
    check_loss_fn(loss_fn)
    placement = choose_placement(
        model, batches, search, distributed=distributed, process_group=process_group
    )
    if placement.deprecated:
        warnings.warn(OLDER_MODE, DistributedModeDeprecationWarning, stacklevel=3)
    measured = run(
        model, loss_fn, batches, plan, placement, search, radii,
        progress=progress, label=settings["measure"],
    )  # fmt: skip
    summary = plan.summary()
    return arrange(
        [
            _result(per_radius, plan, measured, search.kind, {**settings, "rho": radius}, summary)
            for radius, per_radius in zip(radii, measured.records)
        ]
    )


#: The deprecation of the older distributed mode, and what to pass instead.
OLDER_MODE = (
    "the older distributed mode (every rank passes all batches and measures every "
    "world_size-th; on with distributed=True, and by default when a process group of "
    "several ranks is initialised) is deprecated and will be removed: pass "
    "process_group=torch.distributed.group.WORLD with each rank's share of the batches, "
    "batches[rank::world_size] (the same result on every rank), or distributed=False to "
    "measure all the batches given on each rank without communication"
)


def _result(
    records: List[BatchRecord],
    plan: BoundPlan,
    measured: Measurement,
    kind: str,
    settings: Dict[str, Any],
    summary: str,
) -> SharpnessResult:
    """The result of one radius from its per-batch records: the one place where the
    engine's records become a :class:`SharpnessResult`, and where the warnings about its
    value are given (:class:`ZeroSharpnessWarning`,
    :class:`~geoopt_quotient.sharpness.path_gap.PathGapWarning`)."""
    if not records:
        raise ValueError("`batches` is empty: give at least one batch")
    per_batch = [r.sharpness for r in records]
    perturbed = [r.perturbed for r in records]
    if kind == "worst":
        flat = [r.index for r in records if r.perturbed == r.clean]
        zero_weights = zero_weight_parameters(plan, measured.weights) if flat else []
        warn_if_no_ascent(flat, len(records), zero_weights)
    per_batch_shares = None if records[0].shares is None else [r.shares for r in records]
    gaps = exact_losses = estimates = None
    if records[0].estimated_path_gap is not None:
        estimates = [r.estimated_path_gap for r in records]
    if records[0].path_gap is not None:
        gaps = [r.path_gap for r in records]
        exact_losses = [r.exact_loss for r in records]
        warn_if_path_gap(per_batch, perturbed, exact_losses, settings["rho"])
    elif estimates is not None:
        warn_if_estimated_path_gap(per_batch, estimates, settings["rho"])
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        clean_losses=[r.clean for r in records],
        perturbed_losses=perturbed,
        histories=[r.history for r in records],
        seconds=measured.seconds,
        seconds_per_batch=[r.seconds for r in records],
        forward_passes=[r.forward_passes for r in records],
        backward_passes=[r.backward_passes for r in records],
        settings=settings,
        plan=summary,
        path_gaps=gaps,
        exact_losses=exact_losses,
        shares=None if per_batch_shares is None else mean_shares(per_batch_shares),
        shares_per_batch=per_batch_shares,
        estimated_path_gaps=estimates,
    )


class ZeroSharpnessWarning(GeooptQuotientWarning, UserWarning):
    """Worst-case sharpness exactly 0: no perturbation increased the loss."""


def zero_weight_parameters(plan: BoundPlan, params: Dict[str, torch.Tensor]) -> List[str]:
    """The parameters of ``plan``'s adaptive groups with ``eps = 0`` whose entries are all 0.

    The adaptive ball cannot move a weight that is exactly 0 (its metric weight
    :math:`1 / |w|^2` is infinite), so a loss whose gradient lives only on such weights (a
    freshly initialised LoRA adapter, :math:`B = 0`) has no ascent direction in it.
    """
    return [
        name
        for group in plan.adaptive_groups
        if getattr(group.manifold, "eps", None) == 0
        for name in group.param_names
        if not params[name].any()
    ]


def zero_weight_cause(names: Sequence[str]) -> str:
    """The likely cause that :func:`zero_weight_parameters` found, as a sentence part."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"weights that are exactly 0 ({shown}): with `eps=0` the adaptive ball cannot move "
        "them, and the gradient may live only there (e.g. a freshly initialised LoRA "
        "adapter, B = 0); pass `eps > 0` (ASAM's 0.01) to perturb them"
    )


def warn_if_no_ascent(batches: List[int], total: int, zero_weights: Sequence[str] = ()) -> None:
    """Warn when Auto-PGD found no iterate above the clean loss on some batches.

    ``zero_weights``: parameters all of whose entries are 0 in the adaptive ball with
    ``eps = 0`` (:func:`zero_weight_parameters`), named first among the likely causes.
    """
    if not batches:
        return
    which = "every batch" if len(batches) == total else f"batches {batches} of {total}"
    first = f"{zero_weight_cause(zero_weights)}, " if zero_weights else ""
    warnings.warn(
        f"worst-case sharpness is exactly 0 on {which}: no Auto-PGD iterate increased the "
        f"loss. Likely causes: {first}a loss that does not change under small perturbations (a "
        "piecewise-constant loss such as an accuracy, or one rounded to float16/bfloat16: "
        "compute it in float32), a gradient exactly 0 at the unperturbed parameters (a "
        "stationary point), `rho` so large that every step overshoots (try a smaller one), "
        "or too few `iters`",
        ZeroSharpnessWarning,
        stacklevel=4,
    )


def _radii(rho: Radii) -> Tuple[List[float], Callable[[List[SharpnessResult]], Any]]:
    """The radii to measure at, increasing (a repeated one once), and the map from their
    results to what the call returns: the result of a single radius, or for a grid one
    result per radius in the order given, in a :class:`~.results.ResultList`."""
    grid = _radius_grid(rho)
    if grid is None:
        check_positive_float(rho, "rho")
        return [rho], lambda results: results[0]
    radii = sorted(set(grid))
    return radii, lambda results: ResultList(dict(zip(radii, results))[r] for r in grid)


def _radius_grid(rho: Radii) -> List[float] | None:
    """The radii of a grid ``rho`` (a sequence or a 1-d array) as floats, checked; ``None``
    for a single radius."""
    if hasattr(rho, "tolist") and getattr(rho, "ndim", 0) == 1:
        rho = rho.tolist()
    if isinstance(rho, str) or not isinstance(rho, Sequence):
        return None
    if not rho:
        raise ValueError("`rho` is an empty sequence: give at least one radius")
    return [check_positive_float(r, "rho") for r in rho]


def geodesic_sharpness(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    rho: Radii | None = None,
    symmetries: Symmetries = None,
    metric: str | None = None,
    iters: int = 20,
    path: str = "second_order",
    kind: str = "worst",
    seed: int = 0,
    norm: bool = True,
    curvature: bool = True,
    eps: float = 0.0,
    progress: bool | None = None,
    distributed: bool | None = None,
    keep_best_gradient: bool | None = None,
    process_group: Any = None,
    restarts: int = 0,
    shares: bool = False,
    path_report: bool = False,
    share_storage: bool = False,
    state_dtype: torch.dtype | str | None = None,
) -> Union[SharpnessResult, List[SharpnessResult]]:
    r"""Geodesic sharpness: worst (or average) loss increase over a geodesic ball on the quotient.

    The worst case (Eq. 3 of da Silva, Dangel & Oore 2025; ``kind="worst"``) is, for
    parameters :math:`w` and batches :math:`b = 1, \dots, B`,

    .. math::

        S_{\max}(w) = \frac1B \sum_{b=1}^B \Big[\max_{\xi \in \mathcal H_w,\
            |\xi|_w \le \rho} L_b(\gamma_\xi(1)) - L_b(w)\Big],

    and the average case (``kind="average"``) replaces the maximum by the mean over
    :math:`\xi \sim \mathcal N(0, \rho^2 I)` in the metric on :math:`\mathcal H_w`.
    :math:`\gamma_\xi` is the geodesic from :math:`w` with initial velocity :math:`\xi`
    (or the second-order retraction :math:`w + \xi - \tfrac12\Gamma_w(\xi, \xi)`),
    :math:`\mathcal H_w` the horizontal space of the symmetry quotients and
    :math:`|\xi|_w^2 = \sum_g |\xi_g|_{w_g}^2` the joint norm of their GL-invariant
    metrics and of the adaptive metric :math:`\sum_i \xi_i^2 / (|w_i| + \varepsilon)^2`
    on every parameter outside a symmetry group. The maximum is estimated by Auto-PGD
    (:func:`~geoopt_quotient.maximize_in_ball`), which gives a lower bound.

    Parameters
    ----------
    model : torch.nn.Module
        Never written to: during each call of ``loss_fn`` the perturbed tensors are
        swapped into it (:func:`torch.func.functional_call`) and the original parameters
        put back on every exit, so it is bitwise unchanged afterwards; train/eval mode,
        ``requires_grad`` flags and the global RNG state are restored on return (also
        after an exception). It runs in eval mode. Its values are never written; with
        ``share_storage=True`` its parameters' storage changes (below).
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``. Every use of the model's parameters
        inside the call sees the perturbed values: calls of the model or of any
        submodule, ``.forward``, parameter reads, ``model.parameters()``, tied weights,
        and the model object the loss closes over. A loss with no autograd path to any
        parameter raises :class:`IndependentLossError`; one that uses a parameter tensor
        taken before the call, :class:`StaleParameterError`. An exception raised inside
        carries a note with the batch index.
    batches : iterable
        Each batch gets its own maximiser run; the result is the mean over batches.
    rho : float, sequence of float or None
        Radius :math:`\rho > 0` of the ball, in the joint metric norm :math:`|\xi|_w`
        above. The adaptive and ``inv`` norms are relative to the size of the weights
        (invariant under scaling them); the ``mix`` norm of a pair is
        :math:`(|\xi_G H^\top|_F^2 + |G \xi_H^\top|_F^2)^{1/2}` (for ``eps=0``), the size
        of the first-order change of the product :math:`G H^\top`. Radii of different
        metrics are thus on different scales (:func:`~geoopt_quotient.calibrate_rho`
        puts them on a common one). Default ``None``: the metric's default radius
        (:data:`~geoopt_quotient.sharpness.DEFAULT_RADII`, ``inv`` 0.05, ``mix`` 0.01).
        A sequence of radii :math:`\rho_1 < \dots < \rho_K` (in any order) is a grid,
        monotone by construction: each batch is measured at every radius in increasing
        order, and at each :math:`\rho_k > \rho_1` Auto-PGD runs from :math:`\xi = 0` and
        from the best :math:`\xi` found at :math:`\rho_{k-1}` (in the larger ball: the
        balls at :math:`w` are nested and the path does not depend on :math:`\rho`),
        keeping the best of the two and of that :math:`\xi`; so the values never
        decrease with the radius and are at least a single-radius call's. Worst case
        only; the average case measures each radius on its own.
    symmetries : SymmetryPlan, list of SymmetryGroup, BoundPlan or None
        The symmetry groups. ``None`` discovers them (:func:`find_symmetries`) with
        ``metric`` and ``eps``, each group proven on the model before use (on inputs
        built from its config, else on ``loss_fn`` of the first batch when ``batches``
        is a list); a given plan carries its own manifolds, and its metric.
    metric : {"mix", "inv"} or None
        The quotients' metric: of the discovered ones, or that of the given plan, which
        must agree (a :class:`PlanError` says which to change); the result's settings
        record it. Default ``None``: the given plan's, else ``"mix"``.
    iters : int
        Auto-PGD iterations per batch (worst case) or samples (average case); default 20.
    path : {"second_order", "exact", "straight"}
        Second-order retraction (default), exact exponential map, or straight line.
    kind : {"worst", "average"}
        Worst-case (Auto-PGD maximum, default) or average-case sharpness.
    seed : int
        Seed of the average case's samples (batch ``i`` uses ``seed + i``); the worst
        case starts at :math:`\xi = 0` and is deterministic.
    norm : bool
        ``False`` ablates the quotient norm: the adaptive ball, but geodesic paths.
    curvature : bool
        ``False`` ablates the curvature: the quotient ball, but straight paths.
        With both ``False`` the value equals :func:`adaptive_sharpness`.
    eps : float
        Relaxation :math:`\varepsilon \ge 0` of the discovered quotients' Gram matrices
        and offset of the adaptive metric's scale :math:`|w| + \varepsilon`; default 0.
    progress : bool or None
        Show a progress bar (default: when stderr is a terminal).
    distributed : bool or None
        Deprecated (:class:`~geoopt_quotient.sharpness.DistributedModeDeprecationWarning`
        where it spreads work): pass ``process_group`` with each rank's share
        ``batches[rank::world_size]`` instead, for the same result. The older mode,
        where every rank passes all batches: shard them over the ranks
        of the default ``torch.distributed`` process group (batch ``i`` on rank
        ``i % world_size``) and gather the per-batch results, so every rank returns the
        single-process result. ``None``: when a process group is initialised and no
        ``process_group`` is given. Every rank must see the same ``batches``. ``True``
        together with ``process_group`` is a ``ValueError``.
    keep_best_gradient : bool or None
        Worst case: keep the best iterate's gradient, so that Auto-PGD's restarts from it
        cost no pass, at the price of two more parameter-sized vectors alive throughout:
        that gradient, and the current one's own (not kept, each gradient is written over
        the perturbed parameters once the backward pass is done with them; the symmetry
        groups' over their own copy of their points; a sharded model's ball has a
        gradient vector of its own either way). ``None``: kept when a vector takes at
        most 1 GiB
        (:data:`~geoopt_quotient.sharpness.apgd.KEEP_GRADIENT_MAX_BYTES`; about 268M
        float32 parameters, per rank on a sharded model). The values are the same either
        way.
    process_group : ProcessGroup or None
        Measure over the ranks of this ``torch.distributed`` process group (e.g.
        ``torch.distributed.group.WORLD``), each rank passing only its share of the
        batches: ``batches`` is then this rank's share as
        :class:`~torch.utils.data.DistributedSampler` with ``shuffle=False`` deals them
        out. Of :math:`B` global batches on :math:`W` ranks, rank :math:`r` passes the
        global batches :math:`r, r + W, r + 2W, \dots` (``all_batches[r::W]``); the
        shares differ in length by one at most and none may be empty. Each batch is
        seeded by its global index, the per-batch records are gathered in global order,
        and every rank returns the same result: the one-process result on all batches
        (``seconds`` is the slowest rank's). The ranks say after each round of :math:`W`
        batches whether they failed: a rank that raised re-raises, every other raises
        :class:`~geoopt_quotient.sharpness.ranks.RankFailedError`; none waits. Every rank
        passes the same other arguments. ``None`` (default): no communication.
    restarts : int
        Worst case: this many more Auto-PGD searches per batch and radius, each from a
        random point of the ball (a Gaussian horizontal :math:`\xi` in the metric,
        projected onto the ball: on its sphere :math:`|\xi|_w = \rho` unless the ball
        has very few dimensions), seeded from ``seed`` and the batch index, so the
        result is deterministic. The best of all searches is kept: the value is at least
        that of ``restarts=0`` with the same ``seed``, whose search from
        :math:`\xi = 0` is among them. Default 0; not available for an FSDP2-sharded
        model.
    shares : bool
        Worst case: also each block's and symmetry kind's share of every batch's
        maximiser, its :math:`|\xi^*|^2` in the metric and its first-order loss increase
        :math:`\langle \operatorname{grad} L(w), \xi^* \rangle_w`
        (:attr:`SharpnessResult.shares`; from the maximiser and the first iterate's
        gradient: no extra pass, one more vector of the ball's size per batch). Default
        ``False``; not available for an FSDP2-sharded model.
    path_report : bool
        Worst case on ``path="second_order"``: also integrate the exact geodesic to each
        batch's maximiser (float64, error-controlled RK4) and evaluate the loss there
        (:attr:`~SharpnessResult.path_gaps`, :attr:`~SharpnessResult.exact_losses`; one
        more forward pass per batch and radius, about a third of a 6-iteration call on
        a small BERT on the CPU). Default ``False``: only the estimate
        :attr:`~SharpnessResult.estimated_path_gaps`, from the maximiser's curvature
        correction (no pass), which still gives :class:`PathGapWarning`. Worst case
        only (``kind="average"`` raises ``ValueError``); not available for an
        FSDP2-sharded model (``None``).
    share_storage : bool
        Worst case: the ball's base point shares the model's storage instead of holding
        a copy of it, one parameter-sized vector less (4 bytes per float32 parameter
        outside the symmetry groups; :ref:`memory`). The model's trainable parameters
        outside the symmetry groups move into one flat buffer per dtype and device: the
        same :class:`~torch.nn.Parameter` objects and values, each now a view of that
        buffer, which they keep after the call (a later call reuses it without a copy).
        Only the storage changes, never a value; but a tensor taken earlier that
        aliases a parameter's old storage (e.g. from ``model.state_dict()``) no longer
        follows the model. Parameters that share their storage with another parameter,
        and tensor subclasses (a sharded ``DTensor``), stay and are copied. Default
        ``False``; worst case only (``kind="average"`` raises ``ValueError``).
    state_dtype : torch.dtype, str or None
        Worst case: the dtype of Auto-PGD's iterates and gradients. ``None`` (default):
        float32 or better. ``torch.bfloat16`` (or ``"bfloat16"``): a bfloat16 model's
        in bfloat16, half their memory (:ref:`memory`), computed in float32 and rounded
        once when written; the ball then leaves room for that rounding and shrinks by up
        to :math:`2^{-8}` of :math:`\rho`, and the search's iterates differ from the
        float32 state's by bfloat16 rounding (user guide, "Precision", gives the measured
        differences). Parameters of other dtypes keep a float32 or better state
        (:func:`~geoopt_quotient.sharpness.apgd.state_dtype_for`). Recorded in
        :attr:`~SharpnessResult.settings` when given.

    Returns
    -------
    SharpnessResult or ResultList
        :attr:`~SharpnessResult.value` is the sharpness :math:`S_{\max}` (or
        :math:`S_{\mathrm{avg}}`), the mean over batches of
        :attr:`~SharpnessResult.per_batch`; the result also holds the clean and
        perturbed losses, the Auto-PGD histories, the passes made and the timings.
        For a sequence ``rho``, a :class:`ResultList` (a list with ``to_frame`` and
        ``to_csv``) of one result per radius, in the order given
        (``settings["rho"]`` its radius; a repeated radius is measured once, and its
        results are one object); ``seconds`` is the whole call's time, the passes and
        ``seconds_per_batch`` those of the radius (both searches), and the history
        that of the better search (the warm-started one when the carried maximiser
        stays ahead). Worst case on ``path="second_order"``:
        :attr:`~SharpnessResult.estimated_path_gaps`, and with ``path_report=True``
        :attr:`~SharpnessResult.path_gaps` and :attr:`~SharpnessResult.exact_losses`,
        how far the retraction's point at each batch's maximiser is from the exact
        geodesic's, and the loss there (one more forward pass per batch and radius).

    Raises
    ------
    ValueError
        For a non-positive ``rho`` or ``iters``, an unknown ``metric``, ``path`` or
        ``kind``, no batches, parameters with NaN/Inf entries, or a symmetry group whose
        base point is not on its manifold (a rank-deficient factor with ``eps=0``); with
        ``process_group``, shares that are not those of a strided deal (see there) or an
        empty share, on every rank, or ``distributed=True`` as well.
    TypeError
        For non-floating-point parameters, or a ``loss_fn`` that does not return a
        scalar tensor.
    RankFailedError
        With ``process_group``, on every rank but the one that raised.
    IndependentLossError, StaleParameterError
        When ``loss_fn`` does not depend on the perturbed parameters (see ``loss_fn``).
    NonFiniteError
        When the loss or its gradient becomes NaN/Inf during the maximisation.

    Warns
    -----
    DistributedModeDeprecationWarning
        In the older ``distributed`` mode (see there).
    ZeroSharpnessWarning
        When no Auto-PGD iterate increases the loss of a batch (worst case exactly 0).
    PathGapWarning
        Worst case on ``path="second_order"``, when at the maximisers the loss on the
        exact geodesic differs from the retraction's by more than 10% of the sharpness,
        on average over the batches:
        :math:`\frac1B \sum_b |L_b(\operatorname{Exp}_w \xi^*_b) - L_b(R_w \xi^*_b)|
        > 0.1\, S_{\max}` (user guide, "Is the second-order path faithful?"); without
        ``path_report``, when the estimated gaps say so,
        :math:`\frac1B \sum_b \hat g_b S_b > 0.1\, S_{\max}`
        (:func:`~geoopt_quotient.sharpness.path_gap.warn_if_estimated_path_gap`). Use
        ``path="exact"`` or a smaller ``rho``.

    Notes
    -----
    Cost: the worst case makes ``iters`` forward and backward passes per batch and one
    more forward pass (two on ``path="second_order"`` with ``path_report=True``: the
    path gap's); without the kept
    best gradient, also one forward and backward pass per Auto-PGD restart (up to 7 for
    20 iterations; see :func:`maximize_in_ball`). The average case makes ``iters + 1``
    forward passes. :class:`SharpnessResult` reports the passes made per batch. A grid of
    :math:`K` radii makes :math:`2K - 1` worst-case searches per batch (plus ``restarts``
    per radius), and keeps one more vector of the ball alive (the maximiser
    carried to the next radius). Between passes the geometry works on few, large tensors: in
    the worst case, the parameters left to the adaptive metric form one flat buffer per
    dtype and device, which the model reads as views, and discovery stacks the attention
    heads of all layers into one group per kind (``geoopt_quotient.sharpness.layout``).

    Devices and precision: the model, its batches and ``loss_fn`` may live on any device;
    the perturbations are made on the parameters' device. Called under
    ``torch.autocast``, only ``loss_fn`` runs in the autocast precision; the ball, the
    paths and the Auto-PGD iterates stay in float32 or better (also for a bfloat16 or
    float16 model, whose perturbed weights are rounded to its dtype: it warns). Measure
    in float32 (user guide, "Precision"). A CUDA run reads one scalar pair from the device per
    Auto-PGD iteration (the exact path adds its integration check).

    References
    ----------
    da Silva, Dangel & Oore (2025), "Hide & Seek: Transformer Symmetries Obscure
    Sharpness & Riemannian Geometry Finds It", ICML :cite:`dasilva2025hide`; Auto-PGD:
    Croce & Hein (2020) :cite:`croce2020reliable`.

    Examples
    --------
    Worst-case sharpness of one attention layer; its query/key and value/output
    weights are found and measured on their GL(h) quotients:

    >>> import torch
    >>> from geoopt_quotient import geodesic_sharpness
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    >>> x = torch.randn(4, 5, 8, dtype=torch.float64)
    >>> def loss_fn(model, x):
    ...     out, _ = model(x, x, x)
    ...     return out.pow(2).mean()
    >>> result = geodesic_sharpness(model, loss_fn, [x], rho=0.1, iters=5)
    >>> result.value > 0
    True
    >>> len(result.per_batch), result.settings["metric"]
    (1, 'mix')
    >>> result.plan.splitlines()[0].split()
    ['kind', 'symmetry', 'group', 'manifold', 'point', 'shape', 'count']
    """
    metric = resolve_metric(symmetries, metric)
    rho = default_radius(metric) if rho is None else rho
    plan = resolve_plan(model, symmetries, metric, eps, probe=loss_probe(loss_fn, batches))
    caveat = plan.geodesic_caveat()
    if caveat is not None:
        warnings.warn(caveat, GeodesicEqualsAdaptiveWarning, stacklevel=2)
    settings = dict(
        measure="geodesic",
        rho=rho,
        metric=metric,
        iters=iters,
        path=path,
        kind=kind,
        seed=seed,
        norm=norm,
        curvature=curvature,
        eps=eps,
        restarts=restarts,
    )
    return _measure(
        model,
        loss_fn,
        batches,
        plan,
        rho,
        settings,
        curvature=curvature,
        progress=progress,
        distributed=distributed,
        process_group=process_group,
        kind=kind,
        iters=iters,
        path=path,
        seed=seed,
        norm=norm,
        restarts=restarts,
        keep_best_gradient=keep_best_gradient,
        shares=shares,
        path_report=path_report,
        share_storage=share_storage,
        state_dtype=state_dtype,
    )


def adaptive_sharpness(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    rho: Radii | None = None,
    iters: int = 20,
    kind: str = "worst",
    seed: int = 0,
    eps: float = 0.0,
    progress: bool | None = None,
    distributed: bool | None = None,
    keep_best_gradient: bool | None = None,
    process_group: Any = None,
    restarts: int = 0,
    shares: bool = False,
    share_storage: bool = False,
    state_dtype: torch.dtype | str | None = None,
) -> Union[SharpnessResult, List[SharpnessResult]]:
    r"""Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023) with the same maximiser.

    The ball :math:`|\delta / (|w| + \varepsilon)|_2 \le \rho` over every trainable
    parameter, straight-line perturbations :math:`w + \delta`:

    .. math::

        S_{\max}(w) = \frac1B \sum_{b=1}^B \Big[\max_{|\delta \oslash c|_2 \le \rho}
            L_b(w + \delta) - L_b(w)\Big], \qquad c = |w| + \varepsilon,

    that is :func:`geodesic_sharpness` with no symmetry group (the metric of
    :class:`~geoopt_quotient.AdaptiveEuclidean` on every parameter). Entries with
    :math:`c_i = 0` (a zero weight with ``eps=0``) are not perturbed. Not invariant
    under the symmetries: two representatives of one network can have different
    values.

    Parameters
    ----------
    model : torch.nn.Module
        As for :func:`geodesic_sharpness`: never written to, and restored on return.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``, as for :func:`geodesic_sharpness`.
    batches : iterable
        Each batch gets its own maximiser run; the result is the mean over batches.
    rho : float, sequence of float or None
        Radius :math:`\rho > 0` of the ball, relative to the parameters' magnitudes:
        each entry moves by :math:`|\delta_i| \le \rho\, (|w_i| + \varepsilon)` at most.
        Default ``None``: 0.2 (:data:`~geoopt_quotient.sharpness.DEFAULT_RADII`).
        A sequence of radii is a grid, monotone by construction, as for
        :func:`geodesic_sharpness`: one result per radius.
    iters : int
        Auto-PGD iterations per batch (worst case) or samples (average case); default 20.
    kind : {"worst", "average"}
        Worst-case (default) or average-case sharpness (mean over
        :math:`\delta = c \odot z`, :math:`z \sim \mathcal N(0, \rho^2 I)`).
    seed : int
        Seed of the average case's samples (batch ``i`` uses ``seed + i``).
    eps : float
        Offset :math:`\varepsilon \ge 0` of the scale :math:`c = |w| + \varepsilon`;
        default 0 (Andriushchenko et al.), ASAM's :math:`\eta` (0.01 in Kwon et al.).
    progress : bool or None
        Show a progress bar (default: when stderr is a terminal).
    distributed : bool or None
        Deprecated: the older mode (every rank passes all batches), as for
        :func:`geodesic_sharpness`; pass ``process_group`` instead.
    keep_best_gradient : bool or None
        As for :func:`geodesic_sharpness`; the values are the same either way.
    process_group : ProcessGroup or None
        Each rank passes its share of the batches (``all_batches[rank::world_size]``), as
        for :func:`geodesic_sharpness`; every rank returns the same result, the
        one-process result on all batches. ``None`` (default): no communication.
    restarts : int
        Worst case: more Auto-PGD searches from seeded random points of the ball, the
        best kept, as for :func:`geodesic_sharpness` (default 0).
    shares : bool
        Worst case: each block's share of the maximiser, as for
        :func:`geodesic_sharpness` (default ``False``).
    share_storage : bool
        Worst case: share the model's storage as the ball's base point instead of
        copying it, as for :func:`geodesic_sharpness` (default ``False``).
    state_dtype : torch.dtype, str or None
        Worst case: the dtype of the iterates and gradients, as for
        :func:`geodesic_sharpness` (default ``None``: float32 or better).

    Returns
    -------
    SharpnessResult or ResultList
        The sharpness in :attr:`~SharpnessResult.value`, with per-batch values,
        losses, Auto-PGD histories, passes and timings; for a sequence ``rho``, one
        result per radius, as for :func:`geodesic_sharpness`.

    Raises
    ------
    ValueError, TypeError, IndependentLossError, StaleParameterError, NonFiniteError
        As :func:`geodesic_sharpness`.

    Warns
    -----
    DistributedModeDeprecationWarning
        In the older ``distributed`` mode, as for :func:`geodesic_sharpness`.
    ZeroSharpnessWarning
        When no Auto-PGD iterate increases the loss of a batch.

    References
    ----------
    Kwon et al. (2021), "ASAM: Adaptive Sharpness-Aware Minimization for
    Scale-Invariant Learning of Deep Neural Networks", ICML :cite:`kwon2021asam`;
    Andriushchenko et al. (2023), "A Modern Look at the Relationship between Sharpness
    and Generalization", ICML :cite:`andriushchenko2023modern`.

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient import adaptive_sharpness
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ... ).double()
    >>> batch = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    >>> def loss_fn(model, batch):
    ...     inputs, targets = batch
    ...     return torch.nn.functional.mse_loss(model(inputs), targets)
    >>> result = adaptive_sharpness(model, loss_fn, [batch], rho=0.05, iters=10)
    >>> result.value > 0
    True
    >>> result.perturbed_losses[0] > result.clean_losses[0]
    True
    """
    rho = default_radius("adaptive") if rho is None else rho
    plan = SymmetryPlan(adaptive_eps=eps).bind(model)
    settings = dict(
        measure="adaptive",
        rho=rho,
        iters=iters,
        path="straight",
        kind=kind,
        seed=seed,
        eps=eps,
        restarts=restarts,
    )
    return _measure(
        model,
        loss_fn,
        batches,
        plan,
        rho,
        settings,
        curvature=True,
        progress=progress,
        distributed=distributed,
        process_group=process_group,
        kind=kind,
        iters=iters,
        path="straight",
        seed=seed,
        norm=True,
        restarts=restarts,
        keep_best_gradient=keep_best_gradient,
        shares=shares,
        share_storage=share_storage,
        state_dtype=state_dtype,
    )
