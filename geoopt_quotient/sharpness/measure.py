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

import csv
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from tqdm.auto import tqdm

from .._checks import (
    check_choice,
    check_nonnegative_int,
    check_positive_float,
    check_positive_int,
)
from .._extras import require
from .._model_state import preserved_model_state
from ..manifolds import AdaptiveEuclidean
from ..manifolds._validation import is_finite
from ..symmetry import GeodesicEqualsAdaptiveWarning, find_symmetries
from ..symmetry.plan import BoundPlan, SymmetryGroup, SymmetryPlan
from .apgd import (
    PATHS,
    BallGroup,
    as_scalar,
    average_in_ball,
    check_scalar_finite,
    maximize_in_ball,
    path_function,
)
from .defaults import default_radius
from .functional import (
    RESOLUTION,
    PerturbedLoss,
    check_batches,
    check_depends_on_perturbation,
    noting_batch,
    trainable_parameters,
)
from .layout import BallLayout
from .path_gap import exact_groups, path_gap, warn_if_path_gap
from .precision import AutocastState
from .ranks import BatchShare
from .sharded import is_sharded, measure_sharded
from .shares import maximiser_shares, mean_shares

__all__ = [
    "SharpnessResult",
    "ZeroSharpnessWarning",
    "adaptive_sharpness",
    "geodesic_sharpness",
    "resolve_plan",
]

LossFn = Callable[[Any, Any], torch.Tensor]
Symmetries = Union[None, SymmetryPlan, BoundPlan, Sequence[SymmetryGroup]]
KINDS = ("worst", "average")
Radii = Union[float, Sequence[float]]


@dataclass
class SharpnessResult:
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
        restart, those of every search (``restarts``, a grid's warm starts) and one
        forward pass for ``exact_losses``; ``iters + 1`` and 0 for the average case.
    settings : dict
        The settings used (``measure``, ``rho``, ``iters``, ``path``, ``kind``, ``seed``,
        ``eps``, ``restarts``, and for geodesic sharpness ``metric``, ``norm``, ``curvature``).
    plan : str
        The symmetry plan's summary table
        (:meth:`~geoopt_quotient.symmetry.BoundPlan.summary`).
    path_gaps : list of float or None
        Worst case on ``path="second_order"`` only (else ``None``, and for an
        FSDP2-sharded model, which has no such report yet): per batch, the
        relative gap between the path's point and the exact geodesic's at the maximiser
        :math:`\xi^*`,
        :math:`|R_w(\xi^*) - \operatorname{Exp}_w(\xi^*)|_w / |\xi^*|_w` in the metric at
        :math:`w` (:mod:`~geoopt_quotient.sharpness.path_gap`; 0 for
        :math:`\xi^* = 0`, NaN where the geodesic cannot be integrated that far).
        :math:`O(\rho^2)` on the symmetry groups; the adaptive parameters' straight line
        adds :math:`O(\rho)`.
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

    def to_csv(self, path: str) -> str:
        """Write :meth:`rows` to a CSV file at ``path`` (no pandas needed); returns the path."""
        rows = self.rows()
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows else ["batch"])
            writer.writeheader()
            writer.writerows(rows)
        return path

    def to_frame(self):
        """:meth:`rows` as a :class:`pandas.DataFrame` (pandas comes with the
        ``experiments`` extra)."""
        pandas = require("pandas", "SharpnessResult.to_frame")
        return pandas.DataFrame(self.rows())


def resolve_plan(
    model: torch.nn.Module, symmetries: Symmetries, metric: str, eps: float = 0.0
) -> BoundPlan:
    """Bind ``symmetries`` to ``model``; ``None`` finds them
    (:func:`~geoopt_quotient.symmetry.find_symmetries`)."""
    if isinstance(symmetries, BoundPlan):
        return symmetries
    if symmetries is None:
        return find_symmetries(model, metric=metric, eps=eps).bind(model)
    if not isinstance(symmetries, SymmetryPlan):
        symmetries = SymmetryPlan(list(symmetries))
    return symmetries.bind(model)


def _ball_groups(
    plan: BoundPlan,
    points: List[torch.Tensor],
    path: str,
    norm: bool,
) -> List[BallGroup]:
    groups = []
    for group, point in zip(plan.groups, points):
        if norm or group.kind == "adaptive":  # the ball's own path (cached geometry)
            groups.append(BallGroup(point, group.manifold))
        else:  # adaptive ball, the quotient's path
            walk = path_function(group.manifold, path)
            groups.append(BallGroup(point, AdaptiveEuclidean(), walk))
    return groups


def _measure(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    plan: BoundPlan,
    *,
    radii: Sequence[float],
    iters: int,
    path: str,
    kind: str,
    seed: int,
    norm: bool,
    curvature: bool,
    progress: bool | None,
    settings: Dict[str, Any],
    distributed: bool | None = None,
    keep_best_gradient: bool | None = None,
    process_group: Any = None,
    restarts: int = 0,
    shares: bool = False,
) -> List[SharpnessResult]:
    """One result per radius of ``radii`` (increasing), each batch measured at all of them."""
    iters = check_positive_int(iters, "iters")
    restarts = check_nonnegative_int(restarts, "restarts")
    if restarts and kind != "worst":
        raise ValueError("`restarts` is for the worst case (kind='worst') only")
    check_choice(path, PATHS, "path")
    check_choice(kind, KINDS, "kind")
    check_batches(batches)
    if shares and kind != "worst":
        raise ValueError("`shares` are those of the worst case's maximiser: use kind='worst'")
    path = path if curvature else "straight"  # curvature off: straight lines everywhere
    perturbed_loss = PerturbedLoss(model, loss_fn)  # checks that loss_fn is callable
    if is_sharded(model):  # FSDP2: each rank holds its rows of the model and of each batch
        if process_group is not None:
            raise ValueError(
                "`process_group` splits the batches over the ranks, but a sharded (FSDP2) "
                "model needs every rank to pass its rows of every batch: leave "
                "process_group=None"
            )
        if restarts:
            raise ValueError("`restarts` is not available for a sharded (FSDP2) model yet")
        if shares:
            raise ValueError("`shares` is not available for a sharded (FSDP2) model yet")
        return measure_sharded(
            model,
            loss_fn,
            batches,
            plan,
            radii=radii,
            iters=iters,
            path=path,
            kind=kind,
            seed=seed,
            norm=norm,
            settings=settings,
            keep_best_gradient=keep_best_gradient,
        )
    start = time.perf_counter()
    records: List[List[Dict[str, Any]]] = [[] for _ in radii]
    share = _batch_share(batches, distributed, process_group)
    world, rank = _process_grid(distributed) if share is None else (share.world, share.rank)
    with preserved_model_state(model):
        base = trainable_parameters(model)
        check_parameters(base)
        warn_if_low_precision(base)
        points = [p.detach() for p in plan.gather(base)]
        check_points(plan, points)
        groups = _ball_groups(plan, points, path, norm)
        # the worst case's iterates live in the flat buffers of one layout; average-case
        # samples are drawn group by group, and stay as they were
        layout = BallLayout(plan, base, groups) if kind == "worst" else None
        exact = shares_of = None
        if layout is not None:
            if path == "second_order":  # the path-gap report's groups on the exact path
                exact = exact_groups(
                    layout.groups, groups, _ball_groups(plan, points, "exact", norm)
                )
            if shares:
                shares_of = _shares_function(plan, groups, layout)
            groups = layout.groups

        def objective_for(batch):
            if layout is not None:
                return layout.objective(lambda params: perturbed_loss(params, batch))

            def objective(perturbed_points: List[torch.Tensor]) -> torch.Tensor:
                return perturbed_loss(plan.scatter(_drain(perturbed_points), base), batch)

            return objective

        bar = tqdm(
            batches if share is None else share.local,
            desc=f"{settings['measure']} sharpness",
            unit="batch",
            disable=not _show_progress(progress) or rank > 0,
            leave=False,
        )

        def measure_batch(index: int, batch: Any) -> None:
            outcomes = _measure_batch(
                kind,
                groups,
                objective_for(batch),
                radii=radii,
                iters=iters,
                path=path,
                seed=seed + index,
                check_dependence=not records[0],
                keep_best_gradient=keep_best_gradient,
                restarts=restarts,
                exact=exact,
                shares_of=shares_of,
            )
            _record(records, index, outcomes)

        if share is not None:
            share.run(measure_batch, bar)
        else:
            for index, batch in enumerate(bar):
                if index % world != rank:
                    continue
                with noting_batch(index):
                    measure_batch(index, batch)
    seconds = time.perf_counter() - start
    summary = plan.summary()
    if share is not None:  # every rank returns the same result
        seconds = share.maximum(seconds)
    gather = (lambda r: _gather(r, world)) if share is None else share.gather
    return [
        _result(gather(per_radius), plan, base, kind, seconds, {**settings, "rho": rho}, summary)
        for rho, per_radius in zip(radii, records)
    ]


def _record(records: List[List[Dict[str, Any]]], index: int, outcomes: List[Outcome]) -> None:
    """Append batch ``index``'s outcome at each radius to that radius's records."""
    for per_radius, (clean_loss, top, history, passes, seconds, gap, shares) in zip(
        records, outcomes
    ):
        per_radius.append(
            dict(
                index=index,
                clean=clean_loss,
                top=top,
                history=history,
                passes=passes,
                seconds=seconds,
                gap=gap,
                shares=shares,
            )
        )


def _result(
    records: List[Dict[str, Any]],
    plan: BoundPlan,
    base: Dict[str, torch.Tensor],
    kind: str,
    seconds: float,
    settings: Dict[str, Any],
    summary: str,
) -> SharpnessResult:
    """The result of one radius from its per-batch records."""
    if not records:
        raise ValueError("`batches` is empty: give at least one batch")
    per_batch = [r["top"] - r["clean"] for r in records]
    if kind == "worst":
        flat = [r["index"] for r in records if r["top"] == r["clean"]]
        zero_weights = zero_weight_parameters(plan, base) if flat else []
        warn_if_no_ascent(flat, len(records), zero_weights)
    per_batch_shares = None if records[0]["shares"] is None else [r["shares"] for r in records]
    gaps = exact_losses = None
    if records[0]["gap"] is not None:
        gaps, exact_losses = (list(column) for column in zip(*(r["gap"] for r in records)))
        perturbed = [r["top"] for r in records]
        warn_if_path_gap(per_batch, perturbed, exact_losses, settings["rho"])
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        clean_losses=[r["clean"] for r in records],
        perturbed_losses=[r["top"] for r in records],
        histories=[r["history"] for r in records],
        seconds=seconds,
        seconds_per_batch=[r["seconds"] for r in records],
        forward_passes=[r["passes"][0] for r in records],
        backward_passes=[r["passes"][1] for r in records],
        settings=settings,
        plan=summary,
        path_gaps=gaps,
        exact_losses=exact_losses,
        shares=None if per_batch_shares is None else mean_shares(per_batch_shares),
        shares_per_batch=per_batch_shares,
    )


def _shares_function(
    plan: BoundPlan, groups: List[BallGroup], layout: BallLayout
) -> Callable[[List[torch.Tensor], List[torch.Tensor]], List[Dict[str, Any]]]:
    """``(xi, gradient) -> maximiser_shares`` for vectors of the layout's groups."""

    def shares_of(xi: List[torch.Tensor], gradient: List[torch.Tensor]) -> List[Dict[str, Any]]:
        return maximiser_shares(
            plan, groups, layout.plan_vectors(xi), layout.plan_vectors(gradient)
        )

    return shares_of


def _drain(points: List[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Yield and remove the entries of ``points``, first to last.

    The objective's caller builds a fresh list for every call; emptying it while the
    points are scattered into the parameters lets the copies of the symmetric groups go
    before the forward pass, instead of after it.
    """
    points.reverse()
    while points:
        yield points.pop()


#: (clean loss, worst or mean perturbed loss, history, (forward, backward passes),
#: seconds, (path gap, exact loss) or None, the maximiser's shares or None) of one batch
#: at one radius
Outcome = Tuple[
    float,
    float,
    List[float],
    Tuple[int, int],
    float,
    Optional[Tuple[float, float]],
    Optional[List[Dict[str, Any]]],
]


def _measure_batch(
    kind: str,
    groups: List[BallGroup],
    objective: Callable,
    *,
    radii: Sequence[float],
    iters: int,
    path: str,
    seed: int,
    check_dependence: bool,
    keep_best_gradient: bool | None = None,
    restarts: int = 0,
    exact: List[BallGroup] | None = None,
    shares_of: Callable | None = None,
) -> List[Outcome]:
    """Per radius, the :data:`Outcome` of one batch.

    The worst case's best perturbation is dropped here rather than kept alive while the
    next batch is measured. Its first evaluation differentiates the loss, which checks
    that it depends on the perturbation; the average case, which never differentiates,
    checks that on its clean loss when ``check_dependence``.
    """
    if kind == "worst":
        return _maximize_over_radii(
            groups,
            objective,
            radii,
            iters=iters,
            path=path,
            seed=seed,
            keep_best_gradient=keep_best_gradient,
            restarts=restarts,
            exact=exact,
            shares_of=shares_of,
        )
    outcomes: List[Outcome] = []
    for rho in radii:
        t0 = time.perf_counter()
        clean_loss, top, history = _average_batch(
            groups, objective, rho=rho, iters=iters, path=path, seed=seed, check=check_dependence
        )
        check_dependence = False
        seconds = time.perf_counter() - t0
        outcomes.append((clean_loss, top, history, (iters + 1, 0), seconds, None, None))
    return outcomes


def _average_batch(
    groups: List[BallGroup],
    objective: Callable,
    *,
    rho: float,
    iters: int,
    path: str,
    seed: int,
    check: bool,
) -> Tuple[float, float, List[float]]:
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
    *,
    restarts: int = 0,
    exact: List[BallGroup] | None = None,
    shares_of: Callable | None = None,
    **options: Any,
) -> List[Outcome]:
    r"""Auto-PGD at each radius of the increasing ``radii``, monotone by construction.

    At :math:`\rho_1` one search from :math:`\xi = 0`. At each larger :math:`\rho_k`, a
    search from :math:`\xi = 0` (the single-radius run, bit for bit) and one from the best
    point :math:`\xi^*_{k-1}` so far, which lies in the larger ball (the balls at one base
    point are nested, and the path does not depend on the radius); the best of the two
    and of :math:`\xi^*_{k-1}` itself is kept, so the values never decrease. At every
    radius, ``restarts`` more searches from random points (:func:`_restart_searches`).
    With ``exact`` (the groups on the exact path), the path gap at the kept maximiser
    (:func:`~geoopt_quotient.sharpness.path_gap.path_gap`: one forward pass). With
    ``shares_of``, ``shares_of(xi, gradient)`` of the kept maximiser and the gradient at
    the base point (the first search's first iterate's: no extra pass).
    """
    outcomes: List[Outcome] = []
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
        gap = None
        if exact is not None:
            gap = path_gap(groups, exact, objective, xi)
            passes[0] += not math.isnan(gap[0])  # no forward where the geodesic broke down
        shares = None if shares_of is None else shares_of(xi, gradient)
        seconds = time.perf_counter() - t0
        outcomes.append((clean, top, history, (passes[0], passes[1]), seconds, gap, shares))
    return outcomes


#: Seeds of the random starts: restart ``r`` of the batch with seed ``s`` (``seed + i``)
#: draws from ``s + r * RESTART_SEED_STRIDE``, away from the other batches' seeds.
RESTART_SEED_STRIDE = 1_000_003


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


class ZeroSharpnessWarning(UserWarning):
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


def _process_grid(distributed: bool | None) -> Tuple[int, int]:
    """(world size, rank) over which batches are sharded; (1, 0) when not distributed."""
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


def _batch_share(
    batches: Iterable[Any], distributed: bool | None, process_group: Any
) -> BatchShare | None:
    """This rank's share of the batches under ``process_group`` (a collective); ``None``
    without one (the older ``distributed`` mode, or one process)."""
    if process_group is None:
        return None
    if distributed:
        raise ValueError(
            "pass either `process_group` (each rank passes its share of the batches) or "
            "`distributed=True` (every rank passes all batches), not both"
        )
    return BatchShare(batches, process_group)


def _gather(records: List[Dict[str, Any]], world: int) -> List[Dict[str, Any]]:
    """Every rank's per-batch records, in batch order (the same on every rank)."""
    if world > 1:
        import torch.distributed as dist

        shards: List[Any] = [None] * world
        dist.all_gather_object(shards, records)
        records = [r for shard in shards for r in shard]
    return sorted(records, key=lambda r: r["index"])


def check_parameters(params: Dict[str, torch.Tensor]) -> None:
    """Floating-point and finite (one host read per device, not one per parameter).

    A parameter is finite when its smallest and largest entries are
    (:func:`~geoopt_quotient.manifolds._validation.is_finite`): one read of it, no
    boolean tensor of its size."""
    for name, p in params.items():
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; sharpness needs floats")
    by_device: Dict[torch.device, List[str]] = {}
    for name, p in params.items():
        by_device.setdefault(p.device, []).append(name)
    for names in by_device.values():
        finite = torch.stack([is_finite(params[n]) for n in names]).tolist()
        for name, ok in zip(names, finite):
            if not ok:
                raise ValueError(
                    f"parameter {name!r} has NaN/Inf entries: sharpness is undefined; check the "
                    "checkpoint or the training run that produced it"
                )


def warn_if_low_precision(params: Dict[str, torch.Tensor]) -> None:
    """Warn that perturbations of low-precision parameters are rounded to their dtype."""
    dtypes = sorted({p.dtype for p in params.values() if p.dtype in RESOLUTION}, key=str)
    if dtypes:
        names = ", ".join(f"{d} (resolution {RESOLUTION[d]} of a weight)" for d in dtypes)
        warnings.warn(
            f"the model has {names} parameters: a perturbation is rounded to that resolution "
            "when it is written into the model, which can change a sharpness value by tens "
            "of percent or round it to exactly 0 (user guide, 'Precision'); measure a "
            "float32 copy (model.float(); on the command line: --dtype float32), under "
            "torch.autocast for speed",
            stacklevel=4,
        )


def check_points(plan: BoundPlan, points: List[torch.Tensor]) -> None:
    """Every symmetric group's base point must lie on its manifold (full rank, no zeros)."""
    for group, point in zip(plan.groups, points):
        if group.kind == "adaptive":
            continue
        with AutocastState.capture().disabled():  # the rank test in full precision
            ok, reason = group.manifold.check_point_on_manifold(point, explain=True)
        if not ok:
            hint = " (e.g. eps=1e-6)" if "eps" in (reason or "") else ""
            raise ValueError(
                f"symmetry group {group.name!r} is not on its manifold: {reason}{hint}"
            )


def _over_radii(
    rho: Radii, measure: Callable[[List[float]], List[SharpnessResult]]
) -> Union[SharpnessResult, List[SharpnessResult]]:
    """``measure`` at one radius (its result) or at a grid of them (one result per radius,
    in the order given; measured once each, in increasing order)."""
    grid = _radius_grid(rho)
    if grid is None:
        check_positive_float(rho, "rho")
        return measure([rho])[0]
    radii = sorted(set(grid))
    by_radius = dict(zip(radii, measure(radii)))
    return [by_radius[r] for r in grid]


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


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    import sys

    return sys.stderr.isatty()


def geodesic_sharpness(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    rho: Radii | None = None,
    symmetries: Symmetries = None,
    metric: str = "mix",
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
        after an exception). It runs in eval mode.
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
        ``metric`` and ``eps``; a given plan carries its own manifolds.
    metric : {"mix", "inv"}
        Metric of the discovered quotients (default ``"mix"``).
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
        The older mode, where every rank passes all batches: shard them over the ranks
        of the default ``torch.distributed`` process group (batch ``i`` on rank
        ``i % world_size``) and gather the per-batch results, so every rank returns the
        single-process result. ``None``: when a process group is initialised and no
        ``process_group`` is given. Every rank must see the same ``batches``. ``True``
        together with ``process_group`` is a ``ValueError``.
    keep_best_gradient : bool or None
        Worst case: keep the best iterate's gradient, so that Auto-PGD's restarts from it
        cost no pass, at the price of one more parameter-sized vector alive throughout.
        ``None``: kept when that vector takes at most 1 GiB
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

    Returns
    -------
    SharpnessResult or list of SharpnessResult
        :attr:`~SharpnessResult.value` is the sharpness :math:`S_{\max}` (or
        :math:`S_{\mathrm{avg}}`), the mean over batches of
        :attr:`~SharpnessResult.per_batch`; the result also holds the clean and
        perturbed losses, the Auto-PGD histories, the passes made and the timings.
        For a sequence ``rho``, a list of one result per radius, in the order given
        (``settings["rho"]`` its radius; a repeated radius is measured once, and its
        results are one object); ``seconds`` is the whole call's time, the passes and
        ``seconds_per_batch`` those of the radius (both searches), and the history
        that of the better search (the warm-started one when the carried maximiser
        stays ahead). Worst case on ``path="second_order"``:
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
    ZeroSharpnessWarning
        When no Auto-PGD iterate increases the loss of a batch (worst case exactly 0).
    PathGapWarning
        Worst case on ``path="second_order"``, when at the maximisers the loss on the
        exact geodesic differs from the retraction's by more than 10% of the sharpness,
        on average over the batches:
        :math:`\frac1B \sum_b |L_b(\operatorname{Exp}_w \xi^*_b) - L_b(R_w \xi^*_b)|
        > 0.1\, S_{\max}` (user guide, "Is the second-order path faithful?"). Use
        ``path="exact"`` or a smaller ``rho``.

    Notes
    -----
    Cost: the worst case makes ``iters`` forward and backward passes per batch and one
    more forward pass (two on ``path="second_order"``: the path gap's); without the kept
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
    check_choice(metric, ("mix", "inv"), "metric")
    rho = default_radius(metric) if rho is None else rho
    plan = resolve_plan(model, symmetries, metric, eps)
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
    return _over_radii(
        rho,
        lambda radii: _measure(
            model,
            loss_fn,
            batches,
            plan,
            radii=radii,
            iters=iters,
            path=path,
            kind=kind,
            seed=seed,
            norm=norm,
            curvature=curvature,
            progress=progress,
            settings=settings,
            distributed=distributed,
            keep_best_gradient=keep_best_gradient,
            process_group=process_group,
            restarts=restarts,
            shares=shares,
        ),
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
        The older mode (every rank passes all batches), as for
        :func:`geodesic_sharpness`.
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

    Returns
    -------
    SharpnessResult or list of SharpnessResult
        The sharpness in :attr:`~SharpnessResult.value`, with per-batch values,
        losses, Auto-PGD histories, passes and timings; for a sequence ``rho``, one
        result per radius, as for :func:`geodesic_sharpness`.

    Raises
    ------
    ValueError, TypeError, IndependentLossError, StaleParameterError, NonFiniteError
        As :func:`geodesic_sharpness`.

    Warns
    -----
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
    return _over_radii(
        rho,
        lambda radii: _measure(
            model,
            loss_fn,
            batches,
            plan,
            radii=radii,
            iters=iters,
            path="straight",
            kind=kind,
            seed=seed,
            norm=True,
            curvature=True,
            progress=progress,
            settings=settings,
            distributed=distributed,
            keep_best_gradient=keep_best_gradient,
            process_group=process_group,
            restarts=restarts,
            shares=shares,
        ),
    )
