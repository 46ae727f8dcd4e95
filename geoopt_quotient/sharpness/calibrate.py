r"""Choosing a sharpness radius by a stated rule instead of by hand.

:func:`calibrate_rho` finds the radius :math:`\rho^\star` at which a measure's
worst-case sharpness is a given multiple of the mean clean loss,

.. math::

    S_{\max}(\rho^\star) = t\,\bar L, \qquad
    \bar L = \frac1B \sum_b L_b(w),

by bracketing :math:`\rho^\star` geometrically and bisecting in :math:`\log\rho`. Radii of
different balls (adaptive, geodesic ``inv``, geodesic ``mix``) live on different scales;
the same target :math:`t` puts them on a common footing: "the radius at which the
worst-case loss increase equals the clean loss" (:math:`t = 1`) means the same thing for
every measure and every model.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple, Union

import torch
from tqdm.auto import tqdm

from .._checks import check_choice, check_positive_float, check_positive_int
from .._progress import show_progress
from ..errors import GeooptQuotientError
from ..measures import MEASURES
from .defaults import default_radius
from .measure import (
    LossFn,
    SharpnessResult,
    ZeroSharpnessWarning,
    adaptive_sharpness,
    geodesic_sharpness,
    loss_probe,
    resolve_plan,
)
from .path_gap import PathGapWarning
from .results import ResultList

__all__ = ["MEASURES", "CalibrationError", "RhoEvaluation", "calibrate_radii", "calibrate_rho"]

#: The measures a radius can be calibrated for: adaptive sharpness, and geodesic
#: sharpness in the ``inv`` and ``mix`` metrics.

#: Factor by which the radius grows or shrinks while the target is being bracketed.
GROWTH = 2.0

#: Largest factor of one bracketing step (a log-log secant step is clipped to it).
MAX_GROWTH = 16.0
LOG_MAX_GROWTH = math.log(MAX_GROWTH)

#: A running maximum that does not grow over this factor of the radius (and over at
#: least two evaluations) while the target is still above it means that the estimate
#: lost the maximum (or the loss saturates).
FLAT_SPAN = 8.0

#: Bisection stops when the bracket is narrower than this, in :math:`\log\rho`: the
#: Auto-PGD estimate then jumps across the target between two indistinguishable radii.
LOG_RHO_RESOLUTION = 1e-3

#: Options the calibration sets itself, never passed by the user.
_RESERVED = ("rho", "metric", "progress")


class CalibrationError(GeooptQuotientError, ValueError):
    """The target cannot be bracketed (or the rule is undefined) for this model and data."""


@dataclass(frozen=True)
class RhoEvaluation:
    """One evaluation of the worst-case sharpness during a calibration.

    Attributes
    ----------
    rho : float
        The radius.
    value : float
        The worst-case sharpness at ``rho`` (:attr:`SharpnessResult.value`).
    clean_loss : float
        The mean clean loss over the batches.
    """

    rho: float
    value: float
    clean_loss: float

    @property
    def ratio(self) -> float:
        """``value / clean_loss``: the quantity that is matched to the target."""
        return self.value / self.clean_loss


def calibrate_rho(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    target: float,
    measure: str,
    rtol: float = 0.01,
    rho_start: float | None = None,
    rho_bounds: Tuple[float, float] = (1e-6, 1e3),
    max_evals: int = 40,
    progress: bool | None = None,
    return_history: bool = False,
    **options: Any,
) -> Union[float, Tuple[float, List[RhoEvaluation]]]:
    r"""The radius at which worst-case sharpness equals ``target`` times the mean clean loss.

    Solves :math:`S_{\max}(\rho) = t\,\bar L` for :math:`\rho`, with :math:`S_{\max}` the
    worst-case sharpness of ``measure`` (:func:`adaptive_sharpness`, or
    :func:`geodesic_sharpness` with ``metric=measure``) and :math:`\bar L` the mean clean
    loss over ``batches``. The search works on the running maximum
    :math:`\hat S(\rho) = \max\{S_{\max}(\rho') : \rho' \le \rho \text{ evaluated}\}`,
    a lower bound of the true worst case at :math:`\rho` (the balls are nested) that is
    monotone even where Auto-PGD loses the maximum at a larger radius. From
    ``rho_start`` the radius is doubled (or halved), then moved along the log-log secant
    of the last two radii (a factor 2 to 16 per step), until :math:`\hat S - t\bar L`
    changes sign; the bracket :math:`[\rho_-, \rho_+]` is then narrowed in
    :math:`\log\rho` (log-log secant kept inside the middle 80%, bisection when it
    stalls) until

    .. math::

        |S_{\max}(\rho) - t\,\bar L| \le \mathrm{rtol}\cdot t\,\bar L.

    Parameters
    ----------
    model, loss_fn, batches
        As for :func:`geodesic_sharpness`. ``batches`` is iterated once per evaluation
        and must give the same batches every time (a list, or a loader that does not
        shuffle); a one-shot iterator is turned into a list first.
    target : float
        :math:`t > 0`: the worst-case loss increase as a multiple of the clean loss
        (1: the increase equals the clean loss).
    measure : {"adaptive", "inv", "mix"}
        Adaptive sharpness, or geodesic sharpness in that metric.
    rtol : float
        Relative tolerance on the sharpness, in (0, 1); default 0.01, so the returned
        radius gives a sharpness within 1% of :math:`t\bar L` (as estimated by
        Auto-PGD with these options).
    rho_start : float or None
        First radius tried; the closer to the answer, the fewer evaluations. Default
        ``None``: the measure's default radius (:data:`DEFAULT_RADII`).
    rho_bounds : (float, float)
        The radii searched; a target not bracketed inside them raises
        :class:`CalibrationError`.
    max_evals : int
        Most sharpness evaluations in all (bracketing and bisection). Reached before
        bracketing: :class:`CalibrationError`; during bisection: a warning, and the
        evaluated radius closest to the target is returned.
    progress : bool or None
        A progress bar over the evaluations (default: when stderr is a terminal).
    return_history : bool
        Also return every evaluation, in order, as :class:`RhoEvaluation`.
    **options
        Options of the sharpness function: ``iters``, ``seed``, ``eps``,
        ``distributed``, ``process_group``, ``kind`` (only ``"worst"``), and for
        ``inv``/``mix`` also ``symmetries``, ``path``, ``norm``, ``curvature``. The same
        options, the same seed included, are used at every evaluation, so the sharpness
        is a deterministic function of :math:`\rho`. With ``process_group`` each rank
        passes its share of the batches (``all_batches[rank::world_size]``, see
        :func:`geodesic_sharpness`): every evaluation returns the gathered value on every
        rank, so the search makes the same steps and returns the same radius everywhere.
        With ``symmetries=None`` the symmetries are discovered once, not at every
        evaluation.

    Returns
    -------
    float
        The radius :math:`\rho^\star`: the evaluated radius whose running maximum
        :math:`\hat S` is closest to the target (relative error at most ``rtol`` unless a
        warning said otherwise). With ``return_history``, ``(rho, evaluations)``, the
        evaluations a :class:`~geoopt_quotient.sharpness.ResultList` of
        :class:`RhoEvaluation` (a list with ``to_frame`` and ``to_csv``).

    Raises
    ------
    CalibrationError
        The clean loss is not positive (the rule is undefined), the sharpness is still
        below the target at the largest radius (it saturates, or Auto-PGD overshoots
        every step), or already above it at the smallest, or ``max_evals`` ran out
        before the target was bracketed, or the running maximum stopped growing over a
        factor :data:`FLAT_SPAN` of the radius below the target (Auto-PGD loses the
        maximum at larger radii, typically with few ``iters``).
    ValueError
        For a non-positive ``target``, an unknown ``measure``, ``rtol`` outside (0, 1),
        ``rho_start`` outside ``rho_bounds``, or ``kind`` other than ``"worst"``.
    TypeError
        For an unknown option, or one that the calibration sets itself (``rho``,
        ``metric``, ``progress``).

    Warns
    -----
    RuntimeWarning
        When bisection stops before ``rtol`` is met (``max_evals`` used up, or the
        estimate jumps across the target between indistinguishable radii).
        Once per call (instead of one :class:`ZeroSharpnessWarning` per evaluation) when
        some estimates were 0 or below that of a smaller radius: the running maximum
        replaced them.
    PathGapWarning
        Once per call (instead of one per evaluation) when, at some radii evaluated on
        the second-order path, the exact geodesic's loss at the maximisers differed from
        the retraction's by more than 10% of the sharpness (with ``path_report=True``
        among the options), or the estimated path gaps said it likely did (by default;
        :func:`~geoopt_quotient.sharpness.path_gap.warn_if_estimated_path_gap`).

    Notes
    -----
    Auto-PGD finds a lower bound of the true maximum over the ball, and its estimate is
    monotone in :math:`\rho` only approximately (a larger ball can lead it to a worse
    local maximum within ``iters`` iterations). So :math:`\rho^\star` is where the
    *estimate* crosses the target: the true worst-case sharpness there is at least the
    target, and the radius at which the true maximum equals the target is at most
    :math:`\rho^\star`. Where the estimate is not monotone it can cross the target more
    than once; bisection returns one crossing inside the first bracket found, which
    may depend on ``rho_start``. Calibrate with the options (``iters``, ``seed``,
    ``path``, batches) the radius will be used with.

    Cost: each evaluation is one call of the sharpness function; bisection needs about
    :math:`\log_2(\log 2 / \log(1 + \mathrm{rtol}/p))` of them for a sharpness growing
    like :math:`\rho^p` (some 7-8 for ``rtol=0.01``), after the bracketing steps.

    Examples
    --------
    The adaptive radius at which the worst-case loss increase is half the clean loss:

    >>> import torch
    >>> from geoopt_quotient import calibrate_rho
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ... ).double()
    >>> batch = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    >>> def loss_fn(model, batch):
    ...     inputs, targets = batch
    ...     return torch.nn.functional.mse_loss(model(inputs), targets)
    >>> rho, history = calibrate_rho(
    ...     model, loss_fn, [batch], target=0.5, measure="adaptive", rtol=0.05, iters=5,
    ...     return_history=True,
    ... )
    >>> best = min(history, key=lambda evaluation: abs(evaluation.ratio - 0.5))
    >>> best.rho == rho, abs(best.ratio / 0.5 - 1) <= 0.05
    (True, True)
    """
    target = check_positive_float(target, "target")
    check_choice(measure, MEASURES, "measure")
    rtol = _check_rtol(rtol)
    low, high = _check_bounds(rho_bounds)
    rho_start = default_radius(measure) if rho_start is None else rho_start
    rho_start = check_positive_float(rho_start, "rho_start")
    if not low <= rho_start <= high:
        raise ValueError(f"`rho_start` {rho_start} is outside `rho_bounds` ({low}, {high})")
    max_evals = check_positive_int(max_evals, "max_evals")
    options = _check_options(measure, options)
    if iter(batches) is batches:  # a one-shot iterator: keep its batches for every call
        batches = list(batches)
    sharpness = _sharpness_of_rho(model, loss_fn, batches, measure, options)
    search = _Search(sharpness, target, rtol, max_evals, progress, measure)
    with search:
        best = search.run(rho_start, low, high)
    return (best.rho, ResultList(search.history)) if return_history else best.rho


def calibrate_radii(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    *,
    target: float,
    measures: Sequence[str] = MEASURES,
    return_history: bool = False,
    **options: Any,
) -> Union[Dict[str, float], Tuple[Dict[str, float], Dict[str, List[RhoEvaluation]]]]:
    r"""Comparable balls: the radius of every measure at which worst-case sharpness is the
    same multiple ``target`` of the mean clean loss on ``batches``.

    Calls :func:`calibrate_rho` once per measure with the same ``target``, batches and
    options, each search started at the measure's default radius
    (:data:`DEFAULT_RADII`). The radii returned make the measures comparable in one
    stated sense, :math:`S^{(m)}_{\max}(\rho_m) = t\,\bar L` for every measure
    :math:`m`: a loss increase of the same size, reached in balls of different shapes.

    Parameters
    ----------
    model, loss_fn, batches
        As for :func:`calibrate_rho` (the batches are listed once, so a one-shot iterator
        serves every measure).
    target : float
        :math:`t > 0`, the worst-case loss increase as a multiple of the clean loss.
    measures : sequence of {"adaptive", "inv", "mix"}
        The measures calibrated (default all three), in this order.
    return_history : bool
        Also return every measure's evaluations (:class:`RhoEvaluation`).
    **options
        Options of :func:`calibrate_rho` (``rtol``, ``rho_bounds``, ``max_evals``,
        ``progress``) and of the sharpness functions (``iters``, ``seed``, ``path``...),
        the same for every measure; options of the geodesic measures only (``path``,
        ``symmetries``, ``norm``, ``curvature``) are not passed to adaptive sharpness.

    Returns
    -------
    dict
        ``measure -> radius``. With ``return_history``, ``(radii, {measure:
        evaluations})``.

    Raises
    ------
    CalibrationError
        For the first measure whose target cannot be bracketed (see
        :func:`calibrate_rho`).
    ValueError
        For an unknown or repeated measure, or no measure.

    Examples
    --------
    A linear model with weights :math:`w = \tfrac12\mathbf 1 \in \mathbb R^4` and loss
    :math:`\tfrac14\sum_i (w_i - \tfrac32)^2 = 1`. The adaptive ball is
    :math:`|\delta| \le \rho/2`; the worst increase, every weight moved down by
    :math:`\rho/4`, is :math:`\rho/2 + \rho^2/16`, so the target 0.5 is met at
    :math:`\rho = \sqrt{24} - 4 \approx 0.899`:

    >>> import torch
    >>> from geoopt_quotient import calibrate_radii
    >>> model = torch.nn.Linear(4, 1, bias=False).double()
    >>> with torch.no_grad():
    ...     _ = model.weight.fill_(0.5)
    >>> inputs = torch.eye(4, dtype=torch.float64)
    >>> def loss_fn(model, inputs):
    ...     return (model(inputs) - 1.5).square().sum() / 4
    >>> radii = calibrate_radii(model, loss_fn, [inputs], target=0.5, measures=["adaptive"])
    >>> list(radii), round(radii["adaptive"], 2)
    (['adaptive'], 0.9)
    """
    measures = list(measures)
    if not measures:
        raise ValueError("`measures` is empty")
    for measure in measures:
        check_choice(measure, MEASURES, "measure")
    if len(set(measures)) != len(measures):
        raise ValueError(f"`measures` has repeated entries: {measures}")
    if iter(batches) is batches:
        batches = list(batches)
    geodesic_only = ("path", "symmetries", "norm", "curvature")
    radii: Dict[str, float] = {}
    histories: Dict[str, List[RhoEvaluation]] = {}
    for measure in measures:
        kept = {k: v for k, v in options.items() if measure != "adaptive" or k not in geodesic_only}
        radii[measure], histories[measure] = calibrate_rho(
            model, loss_fn, batches, target=target, measure=measure, return_history=True, **kept
        )
    return (radii, histories) if return_history else radii


def _check_rtol(rtol: float) -> float:
    rtol = check_positive_float(rtol, "rtol")
    if rtol >= 1:
        raise ValueError(f"`rtol` must be in (0, 1), got {rtol}")
    return rtol


def _check_bounds(bounds: Tuple[float, float]) -> Tuple[float, float]:
    try:
        low, high = bounds
    except (TypeError, ValueError) as error:
        raise TypeError(f"`rho_bounds` must be a pair (low, high), got {bounds!r}") from error
    low = check_positive_float(low, "rho_bounds[0]")
    high = check_positive_float(high, "rho_bounds[1]")
    if low >= high:
        raise ValueError(f"`rho_bounds` must have low < high, got ({low}, {high})")
    return low, high


def _function_for(measure: str) -> Callable[..., SharpnessResult]:
    return adaptive_sharpness if measure == "adaptive" else geodesic_sharpness


def _check_options(measure: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The sharpness function's keyword options, without those the calibration sets."""
    function = _function_for(measure)
    parameters = inspect.signature(function).parameters
    allowed = sorted(
        name
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _RESERVED
    )
    for name in options:
        if name in _RESERVED:
            raise TypeError(f"`{name}` is set by calibrate_rho; do not pass it as an option")
        if name not in allowed:
            raise TypeError(
                f"unknown option {name!r} for measure {measure!r} ({function.__name__}); "
                f"expected some of {allowed}"
            )
    kind = options.get("kind", "worst")
    if kind != "worst":
        raise ValueError(
            f"`kind` must be 'worst' for calibrate_rho, got {kind!r}: the rule is stated "
            "for worst-case sharpness"
        )
    return dict(options)


def _sharpness_of_rho(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    measure: str,
    options: Dict[str, Any],
) -> Callable[[float], RhoEvaluation]:
    """``rho -> RhoEvaluation`` with fixed options; the symmetries bound once."""
    function = _function_for(measure)
    if measure != "adaptive":
        eps = options.get("eps", 0.0)
        options = dict(
            options,
            metric=measure,
            symmetries=resolve_plan(
                model, options.get("symmetries"), measure, eps, probe=loss_probe(loss_fn, batches)
            ),
        )

    def evaluate(rho: float) -> RhoEvaluation:
        result = function(model, loss_fn, batches, rho=rho, progress=False, **options)
        clean = sum(result.clean_losses) / len(result.clean_losses)
        return RhoEvaluation(rho=rho, value=result.value, clean_loss=clean)

    return evaluate


class _Search:
    r"""Bracketing then bisection in log rho on the running maximum, keeping every evaluation.

    The true worst case is non-decreasing in :math:`\rho` (a larger ball contains the
    smaller one), so :math:`\hat S(\rho) = \max\{S(\rho') : \rho' \le \rho\}` over the
    evaluated radii is a lower bound of it at :math:`\rho` that is monotone by
    construction; the search compares :math:`\hat S`, not the raw Auto-PGD estimate, with
    the target. Steps are log-log secants (a sharpness growing like :math:`\rho^p` is hit
    in one step), kept within a factor :data:`GROWTH` to :data:`MAX_GROWTH` while
    bracketing and within the middle of the bracket while bisecting.
    """

    def __init__(
        self,
        sharpness: Callable[[float], RhoEvaluation],
        target: float,
        rtol: float,
        max_evals: int,
        progress: bool | None,
        measure: str,
    ) -> None:
        self.sharpness = sharpness
        self.target = target
        self.rtol = rtol
        self.max_evals = max_evals
        self.history: List[RhoEvaluation] = []
        self.zero_radii: List[float] = []
        self.unfaithful_radii: List[float] = []  # where PathGapWarning fired
        self.bar = tqdm(
            desc=f"calibrating rho ({measure}, target {target:g})",
            unit="eval",
            total=max_evals,
            disable=not show_progress(progress),
            leave=False,
        )

    def __enter__(self) -> _Search:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.bar.close()
        if exc_info[0] is None:
            self.warn_not_monotone()
            self.warn_unfaithful_path()

    # ------------------------------------------------------------ evaluations
    def evaluate(self, rho: float) -> float:
        """Evaluate the sharpness at ``rho``; ZeroSharpnessWarning is collected, not shown."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ZeroSharpnessWarning)
            warnings.simplefilter("always", PathGapWarning)
            point = self.sharpness(rho)
        if not point.clean_loss > 0:
            raise CalibrationError(
                f"the mean clean loss is {point.clean_loss:.6g}: the rule 'sharpness = target "
                "x clean loss' needs a positive clean loss"
            )
        for warning in caught:
            if issubclass(warning.category, ZeroSharpnessWarning):
                self.zero_radii.append(rho)
            elif issubclass(warning.category, PathGapWarning):
                self.unfaithful_radii.append(rho)
            else:
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
        self.history.append(point)
        self.bar.update(1)
        self.bar.set_postfix(rho=f"{rho:.4g}", ratio=f"{point.ratio:.4g}")
        return rho

    def lower(self, rho: float) -> float:
        """Running maximum of the sharpness over the evaluated radii up to ``rho``."""
        return max(p.value for p in self.history if p.rho <= rho)

    def ratio(self, rho: float) -> float:
        return self.lower(rho) / self.history[0].clean_loss

    def error(self, rho: float) -> float:
        """Relative error of the running maximum with respect to the target."""
        return self.ratio(rho) / self.target - 1

    def converged(self, rho: float) -> bool:
        return abs(self.error(rho)) <= self.rtol

    def budget_left(self) -> bool:
        return len(self.history) < self.max_evals

    def best(self) -> RhoEvaluation:
        rho = min({p.rho for p in self.history}, key=lambda r: abs(self.error(r)))
        return RhoEvaluation(rho, self.lower(rho), self.history[0].clean_loss)

    def secant(self, a: float, b: float) -> float | None:
        """log rho where the log-log line through (a, S(a)) and (b, S(b)) meets the target."""
        sa, sb = self.ratio(a), self.ratio(b)
        if not (sa > 0 and sb > 0 and sa != sb and a != b):
            return None
        slope = (math.log(sb) - math.log(sa)) / (math.log(b) - math.log(a))
        return math.log(b) + (math.log(self.target) - math.log(sb)) / slope

    # ------------------------------------------------------------ the search
    def run(self, rho_start: float, low: float, high: float) -> RhoEvaluation:
        rho = self.evaluate(rho_start)
        if self.converged(rho):
            return self.best()
        below, above = self.bracket(rho, low, high)
        if self.converged(below) or self.converged(above):
            return self.best()
        return self.bisect(below, above)

    def bracket(self, rho: float, low: float, high: float) -> Tuple[float, float]:
        """(a radius below the target, a radius above it), adjacent in the search."""
        growing = self.error(rho) < 0
        previous: float | None = None
        flat_since, flat_evals = rho, 0
        while (self.error(rho) < 0) == growing:
            if self.converged(rho):
                return rho, rho
            edge = high if growing else low
            if rho == edge:
                raise self.unbracketed(rho, growing)
            if growing and self.ratio(rho) > self.ratio(flat_since):
                flat_since, flat_evals = rho, 0
            elif rho != flat_since:
                flat_evals += 1
            if growing and flat_evals >= 2 and rho / flat_since >= FLAT_SPAN:
                raise self.flat(flat_since, rho)
            if not self.budget_left():
                raise CalibrationError(
                    f"the target was not bracketed in `max_evals`={self.max_evals} "
                    f"evaluations (last: rho={rho:.4g}, sharpness/clean loss "
                    f"{self.ratio(rho):.4g}, target {self.target:g}); raise `max_evals` or "
                    "start closer with `rho_start`"
                )
            factor = GROWTH
            guess = None if previous is None else self.secant(previous, rho)
            if guess is not None:
                factor = min(max(abs(guess - math.log(rho)), math.log(GROWTH)), LOG_MAX_GROWTH)
                factor = math.exp(factor)
            previous = rho
            rho = self.evaluate(min(rho * factor, high) if growing else max(rho / factor, low))
        return (previous, rho) if growing else (rho, previous)

    def unbracketed(self, rho: float, growing: bool) -> CalibrationError:
        ratio = f"sharpness/clean loss is {self.ratio(rho):.4g} at rho={rho:.4g}"
        if growing:
            return CalibrationError(
                f"{ratio}, the largest radius of `rho_bounds`, still below the target "
                f"{self.target:g}: the worst-case sharpness saturates below it (a bounded "
                "loss), or Auto-PGD overshoots at such radii (try more `iters`); choose a "
                "smaller target or raise `rho_bounds`"
            )
        return CalibrationError(
            f"{ratio}, the smallest radius of `rho_bounds`, already above the target "
            f"{self.target:g}: the loss is not smooth at the model (or its clean loss is "
            "nearly 0); choose a larger target or lower `rho_bounds`"
        )

    def flat(self, since: float, rho: float) -> CalibrationError:
        zeros = sum(1 for r in self.zero_radii if r > since)
        return CalibrationError(
            f"the sharpness estimate stopped growing with the radius: sharpness/clean loss "
            f"{self.ratio(rho):.4g} from rho={since:.4g} to rho={rho:.4g}, below the target "
            f"{self.target:g} ({zeros} of these evaluations found no loss increase at all). "
            "Auto-PGD loses the maximum at the larger radii (too few `iters`: its first "
            "steps overshoot), or the worst case saturates; raise `iters`, or choose a "
            "smaller target"
        )

    def bisect(self, below: float, above: float) -> float:
        """Shrink ``[below, above]`` in log rho until the target is met."""
        kept: List[str] = []
        while self.budget_left():
            if abs(math.log(above / below)) < LOG_RHO_RESOLUTION:
                self.warn_unconverged(
                    "the Auto-PGD estimate jumps across the target between radii that "
                    f"differ by less than {LOG_RHO_RESOLUTION:g} in log rho"
                )
                return self.best()
            lo, hi = math.log(below), math.log(above)
            guess = self.secant(below, above)
            if guess is None or kept[-2:] in (["below", "below"], ["above", "above"]):
                guess = 0.5 * (lo + hi)  # plain bisection when the secant stalls
            guess = min(max(guess, lo + 0.1 * (hi - lo)), hi - 0.1 * (hi - lo))
            rho = self.evaluate(math.exp(guess))
            if self.converged(rho):
                return self.best()
            if self.error(rho) < 0:
                below = rho
                kept.append("above")
            else:
                above = rho
                kept.append("below")
        self.warn_unconverged(f"`max_evals`={self.max_evals} evaluations were used up")
        return self.best()

    def warn_unconverged(self, reason: str) -> None:
        best = self.best()
        warnings.warn(
            f"calibrate_rho did not reach `rtol`={self.rtol:g}: {reason}; returning "
            f"rho={best.rho:.6g}, whose sharpness/clean loss {best.ratio:.6g} is "
            f"{100 * abs(self.error(best.rho)):.3g}% from the target {self.target:g}",
            RuntimeWarning,
            stacklevel=4,
        )

    def warn_unfaithful_path(self) -> None:
        """One :class:`PathGapWarning` for every evaluation at which the second-order path
        was not faithful (instead of one per evaluation)."""
        if not self.unfaithful_radii:
            return
        radii = ", ".join(f"{r:.3g}" for r in sorted(set(self.unfaithful_radii))[:8])
        warnings.warn(
            f"calibrate_rho: at {len(self.unfaithful_radii)} of {len(self.history)} radii "
            f"evaluated (rho = {radii}) the loss on the exact geodesic differed (or, "
            "estimated without path_report=True, likely differed) from the second-order "
            "path's by more than 10% of the sharpness at the maximisers: a "
            "radius there measures the retraction, not the geodesic ball; calibrate with "
            'path="exact", or use radii below these',
            PathGapWarning,
            stacklevel=4,
        )

    def warn_not_monotone(self) -> None:
        """One warning for every evaluation below the running maximum (and every zero)."""
        lost = [p.rho for p in self.history if p.value < self.lower(p.rho)]
        if not lost and not self.zero_radii:
            return
        warnings.warn(
            f"calibrate_rho: the Auto-PGD estimate fell below that of a smaller radius at "
            f"{len(lost)} of {len(self.history)} radii and found no loss increase at all at "
            f"{len(self.zero_radii)} (rho = "
            + ", ".join(f"{r:.3g}" for r in sorted(set(lost + self.zero_radii))[:8])
            + "): Auto-PGD lost the maximum there (too few `iters`). The search used the "
            "running maximum over smaller radii, a lower bound of the worst case; more "
            "`iters` make the radius more accurate",
            RuntimeWarning,
            stacklevel=4,
        )
