r"""The diagonal-network experiment of "Hide & Seek" (Table 1, Figure 3), end to end.

For one population seed: draw the data (:mod:`.data`), train :math:`M` diagonal networks
(:mod:`.train`), measure three worst-case sharpnesses of every model on the whole
training set (one batch), and correlate each with the test loss by Kendall's
:math:`\tau`.

Measures (:data:`MEASURES`), all maximised with Auto-PGD (:func:`maximize_in_ball`,
``iters`` steps from :math:`\xi = 0`) and reported as
:math:`\max_\xi L(\gamma_\xi(1)) - L(w)`. At an interpolant the worst case is nearly a
top-eigenvector problem of the loss Hessian, on which Auto-PGD converges slowly:
20 iterations left some values up to 30% below their 100-iteration values, while
100 and 300 iterations agree to a median 0.3% (max 0.5% adaptive, 2% inv, 4% mix),
hence the default of 100.

``adaptive``
    :class:`~geoopt_quotient.AdaptiveEuclidean` (:math:`\varepsilon = 0`) on the
    ``(2, d)`` point :math:`w = (u, v)`, straight line :math:`w + \xi`, ball
    :math:`|\xi / |w||_2 \le \rho`.
``inv``
    :class:`~geoopt_quotient.DiagonalQuotient` ``"inv"``, exact geodesic
    :math:`\beta_0 e^{2B}` (``expmap``), radius :math:`\rho`.
``mix``
    :class:`~geoopt_quotient.DiagonalQuotient` ``"mix"``, exact geodesic
    :math:`\beta_0(1 + 2B)`, radius :math:`\rho_{\text{mix}}`. The quotient excludes
    :math:`\beta_i = 0`, where the mix geodesic ends (``expmap`` raises there), so the
    ball is the closure of the quotient's metric ball: the geodesic is stopped at the
    boundary, :math:`\beta_0 \max(1 + 2B, 0)` (:func:`mix_geodesic_path`). Its
    sparse models have many :math:`\beta_{0,i} \approx 0`, so this matters.

Paths (``paths``, default both): the paper's Algorithm 1 perturbs along the
second-order retraction :math:`(u, v)(1 + B - B^2/2)`, the measures above along the
exact geodesic. ``inv_second_order`` and ``mix_second_order`` are inv and mix with the
retraction (:meth:`DiagonalQuotient.retr`), on the same balls; the mix product
:math:`\beta_0(1 + B - B^2/2)^2` grows like :math:`\rho^4 / (16\beta_{0,i}^3)` on
coordinates with :math:`\beta_{0,i} \to 0` (the budget allows
:math:`|B_i| \le \rho / (\sqrt2|\beta_{0,i}|)`).

Diagnostic, not in the paper (:data:`DIAGNOSTICS`): ``mix_unclamped``, the mix
geodesic continued through zero, i.e. the plain Euclidean ball of radius
:math:`\sqrt2\rho_{\text{mix}}` in :math:`\beta`.

Setups (:data:`SETUPS`): ``phase-transition`` (:mod:`.data`, :func:`.train.train_population`)
and ``step-size`` (:func:`.train.train_schedule_population`), after the public notebook
``diag_nets.ipynb`` of github.com/tml-epfl/sgd-sparse-features (Andriushchenko et al.,
2023), read for its settings, not copied: from it come n = 80 and d = 200 (here
n = 0.4 d), 20 non-zeros of :math:`|\mathcal N(0, 1)|` values scaled to unit norm, labels
without noise, 1000 test samples, :math:`u_0 = 0.1\cdot\mathbf 1, v_0 = 0`, full-batch
GD and SGD with one sample per step (its ``diag_nets.py``), the step sizes (its
gradient-flow step 0.01, its constant SGD step 0.25, its largest scheduled GD step 2.72)
and a step decay (÷4.8 after :math:`10^4` steps, its first schedule). What differs: the
notebook trains one model per algorithm and schedule for a fixed :math:`10^5` steps; here
each model has one step drawn log-uniformly in its algorithm's range, the support is
random (not the first 20 coordinates), and every model stops at training loss
:math:`10^{-5}` as the paper says.

Radii at several scales (``rho_scales``): every measure at :math:`s\rho` (and
:math:`s\rho_{\text{mix}}`) for each scale :math:`s`, on the same models; the
``tau_by_rho`` records of :mod:`geoopt_quotient.experiments.population.rho_grid`.

Radii: the inv and adaptive balls are dimensionless (relative perturbations of
:math:`\beta` or of :math:`(u, v)`) and coincide to first order (see :mod:`.analytic`),
so they share :math:`\rho = 0.1`: at most a 14% (:math:`\sqrt2\rho`) relative change.
The mix ball has the units of :math:`\beta`; the data have :math:`|\beta^*| = 1`, so
:math:`\rho_{\text{mix}} = \rho\,|\beta^*| = 0.1` perturbs :math:`\beta` by at most 14% of
the signal's norm. Exact geodesics (not the second-order retraction) because they
are available in closed form here, and the second-order mix retraction
:math:`\beta_0(1 + B - B^2/2)^2` is far from the geodesic where :math:`|B|` is large,
which is where :math:`\beta_{0,i} \approx 0`.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from ..._checks import GEODESIC_PATHS as PATHS
from ..._checks import METRICS, STRAIGHT, check_positive_float
from ..._progress import progress_bar
from ...manifolds import AdaptiveEuclidean, DiagonalQuotient
from ...measures import MEASURES, Measure
from ...sharpness.apgd import BallGroup, maximize_in_ball
from ...sharpness.stats import kendall_tau
from ..population.rho_grid import RhoSeries, study_scales, tau_by_rho
from ..records import RecordFile, fingerprint
from .data import DEFAULT_NOISE_STD, DEFAULT_SPARSITY, SparseRegression, make_sparse_regression
from .train import (
    DEFAULT_INIT_RANGE,
    DEFAULT_LARGE_STEPS,
    DEFAULT_MAX_STEPS,
    DEFAULT_STEP_DECAY,
    DEFAULT_STEP_FACTOR_RANGE,
    DEFAULT_TARGET_LOSS,
    STEP_SIZE_INIT,
    STEP_SIZE_RANGES,
    TrainedPopulation,
    sample_hyperparameters,
    sample_step_size_hyperparameters,
    step_sizes_for,
    train_population,
    train_schedule_population,
)

__all__ = [
    "DIAGNOSTICS",
    "MEASURES",
    "PAPER_TAU",
    "PATHS",
    "SETUPS",
    "format_table",
    "measure_names",
    "measure_path",
    "measure_population",
    "mix_geodesic_path",
    "run_diagonal",
    "summarize_runs",
]

PAPER_TAU: Dict[str, float] = {"adaptive": -0.68, "inv": -0.83, "mix": -0.86}
DIAGNOSTICS: Tuple[str, ...] = (Measure("mix", clamped=False).short_name,)  # "mix_unclamped"
#: The populations: ``phase-transition`` (initialisation scales at the l1 recovery
#: threshold, the default) and ``step-size`` (GD and SGD step sizes, after the public
#: notebook of Andriushchenko et al., 2023).
SETUPS: Tuple[str, ...] = ("phase-transition", "step-size")
DEFAULT_RHO = 0.1
DEFAULT_ITERS = 100
#: Name suffix of a geodesic measure along each path: ``inv``, ``inv_second_order``.
PATH_SUFFIX: Dict[str, str] = {"exact": "", "second_order": "_second_order"}
#: Samples per feature of the ``step-size`` setup: n = 80 for d = 200, as in the notebook.
STEP_SIZE_SAMPLES_PER_FEATURE = 0.4
#: Bootstrap resamples of the ``tau_by_rho`` intervals.
TAU_BY_RHO_RESAMPLES = 2000


def mix_geodesic_path(
    clamp: bool = True,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    r"""The exact mix geodesic at time 1 for a horizontal :math:`\xi = (Bu, Bv)`, as a
    representative of its quotient point: :math:`(u \max(1 + 2B, 0), v)`.

    The product is :math:`\beta_0 (1 + 2B)`, that of
    :meth:`DiagonalQuotient.expmap` (whose representative is
    :math:`(u, v)\sqrt{1 + 2B}`), while :math:`1 + 2B > 0`; beyond, ``clamp=True``
    stops the geodesic at :math:`\beta_i = 0` (the closure of the metric ball) and
    ``clamp=False`` continues the straight line in :math:`\beta`. The rate is the
    horizontal part :math:`B = \tfrac12(\xi_u / u + \xi_v / v)`.
    """

    def path(x: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        u, v = x[..., 0, :], x[..., 1, :]
        factor = 1 + (xi[..., 0, :] / u + xi[..., 1, :] / v)
        if clamp:
            factor = factor.clamp_min(0)
        return torch.stack((u * factor, v), dim=-2)

    return path


def measure_groups(rho: float, rho_mix: float) -> Dict[str, Tuple[Any, float]]:
    """Every diagonal measure's ball at the radii ``rho`` (adaptive, inv) and ``rho_mix``
    (mix): ``name -> (function of the point (u, v) giving its BallGroup, radius)``."""
    adaptive, inv, mix = (
        AdaptiveEuclidean(eps=0.0),
        DiagonalQuotient("inv"),
        DiagonalQuotient("mix"),
    )
    return {
        "adaptive": (lambda p: BallGroup(p, adaptive, lambda x, xi: x + xi), rho),
        "inv": (lambda p: BallGroup(p, inv, inv.expmap), rho),
        "mix": (lambda p: BallGroup(p, mix, mix_geodesic_path(clamp=True)), rho_mix),
        "mix_unclamped": (lambda p: BallGroup(p, mix, mix_geodesic_path(clamp=False)), rho_mix),
        "inv_second_order": (lambda p: BallGroup(p, inv, inv.retr), rho),
        "mix_second_order": (lambda p: BallGroup(p, mix, mix.retr), rho_mix),
    }


def measure_names(paths: Sequence[str] = PATHS) -> Tuple[str, ...]:
    """The measures computed along ``paths``: adaptive, inv and mix along each path, and
    the diagnostic ``mix_unclamped`` with the exact path.

    ``measure_names()`` is ``("adaptive", "inv", "mix", "inv_second_order",
    "mix_second_order", "mix_unclamped")``.

    Parameters
    ----------
    paths : sequence of {"exact", "second_order"}
        The geodesic paths measured (default both).

    Returns
    -------
    tuple of str
        The measures' names; a name without suffix is the exact path.

    Raises
    ------
    ValueError
        For no path or an unknown one.
    """
    unknown = [p for p in paths if p not in PATH_SUFFIX]
    if unknown or not paths:
        raise ValueError(f"`paths` must be some of {list(PATH_SUFFIX)}, got {list(paths)}")
    names = [Measure().short_name]
    for path in PATHS:
        if path in paths:
            names += [_geodesic(metric, path).short_name for metric in METRICS]
    return tuple(names) + (DIAGNOSTICS if "exact" in paths else ())


def _geodesic(metric: str, path: str) -> Measure:
    """Geodesic sharpness in ``metric`` along ``path``: the exact geodesic, this
    experiment's own, is the measure without a path of its own (``"inv"``)."""
    return Measure(metric, None if path == "exact" else path)


def measure_path(name: str) -> Tuple[str, str]:
    """``(measure, path)`` of a measure's name: ``"inv_second_order"`` ->
    ``("inv", "second_order")``, ``"adaptive"`` -> ``("adaptive", "straight")``,
    ``"mix_unclamped"`` -> ``("mix_unclamped", "exact")``: the
    :class:`~geoopt_quotient.Measure` of the name, its path split off.

    Raises
    ------
    ValueError
        For a name that is no measure's short name (:meth:`~geoopt_quotient.Measure.parse`).
    """
    measure = Measure.parse(name)
    if measure.is_adaptive:
        return name, STRAIGHT
    if measure.path is None:
        return measure.short_name, "exact"
    return replace(measure, path=None).short_name, measure.path


def measure_population(
    data: SparseRegression,
    points: torch.Tensor,
    *,
    rho: float = DEFAULT_RHO,
    rho_mix: float | None = None,
    iters: int = DEFAULT_ITERS,
    measures: Sequence[str] = measure_names(),
    scales: Sequence[float] = (1.0,),
    progress: bool = False,
    done: Mapping[Tuple[int, float], Mapping[str, float]] | None = None,
    on_model: Callable[[int, float, Dict[str, float]], None] | None = None,
) -> Tuple[Dict[float, Dict[str, List[float]]], Dict[str, float]]:
    r"""Worst-case sharpness of every model on the training set, at every scale of the radii.

    Parameters
    ----------
    data : SparseRegression
    points : torch.Tensor
        ``(M, 2, d)`` trained models.
    rho, rho_mix : float
        Radii at scale 1 (``rho_mix`` defaults to ``rho``); at scale :math:`s` the balls
        have radii :math:`s\rho` and :math:`s\rho_{\text{mix}}`.
    iters : int
        Auto-PGD iterations.
    measures : sequence of str
        Names from :func:`measure_names`.
    scales : sequence of float
        Multiples of the radii, each > 0.
    progress : bool
        Show the progress: a tqdm bar on a terminal, else a line every 10%
        (:func:`~geoopt_quotient._progress.progress_bar`).
    done : mapping, optional
        ``(model index, scale) -> {measure: value}`` already computed (a resumed run):
        skipped.
    on_model : callable, optional
        Called as ``on_model(index, scale, {measure: value})`` when a model is finished
        at a scale.

    Returns
    -------
    values : dict
        ``scale -> name -> [sharpness of model m]``.
    seconds : dict
        ``name -> wall time`` (all scales).
    """
    rho_mix = rho if rho_mix is None else rho_mix
    tables = {s: measure_groups(rho * s, rho_mix * s) for s in scales}
    unknown = [m for m in measures if m not in tables[scales[0]]]
    if unknown:
        raise ValueError(f"unknown measures {unknown}; expected some of {list(tables[scales[0]])}")

    def objective(perturbed: List[torch.Tensor]) -> torch.Tensor:
        point = perturbed[0]
        return data.train_loss(point[0] * point[1])

    done = dict(done or {})
    values = {s: {m: [] for m in measures} for s in scales}
    seconds: Dict[str, float] = {m: 0.0 for m in measures}
    bar = progress_bar(
        total=points.shape[0] * len(scales),
        desc="sharpness",
        unit="ball set",
        show=progress,
        leave=False,
    )
    for index, point in enumerate(points):
        for scale in scales:
            if (index, scale) not in done:
                record = {}
                for name in measures:
                    make_group, radius = tables[scale][name]
                    start = time.perf_counter()
                    result = maximize_in_ball(
                        [make_group(point)], objective, rho=radius, iters=iters
                    )
                    record[name] = result.value - result.initial_value
                    seconds[name] += time.perf_counter() - start
                done[index, scale] = record
                if on_model is not None:
                    on_model(index, scale, record)
            for name in measures:
                values[scale][name].append(done[index, scale][name])
            bar.update()
    bar.close()
    return values, seconds


def _versions() -> Dict[str, str]:
    import geoopt
    import scipy

    from ... import __version__

    return {
        "geoopt_quotient": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "geoopt": getattr(geoopt, "__version__", "unknown"),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "platform": platform.platform(),
    }


def _check_args(models: int, dim: int, rho: float, rho_mix: float | None, iters: int) -> None:
    for name, value, low in (("models", models, 2), ("dim", dim, 2), ("iters", iters, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
    check_positive_float(rho, "rho")
    if rho_mix is not None:
        check_positive_float(rho_mix, "rho_mix")


def train_setup(
    setup: str,
    models: int,
    dim: int,
    seed: int,
    device: torch.device,
    progress: bool,
    options: Mapping[str, Any],
) -> Tuple[SparseRegression, TrainedPopulation, Dict[str, List[Any]]]:
    """Draw the data and train the population of ``setup``; also the setup's own
    per-model columns."""
    common = dict(sparsity=options["sparsity"], seed=seed, device=device)
    if setup == "phase-transition":
        noise = DEFAULT_NOISE_STD if options["noise_std"] is None else options["noise_std"]
        data = make_sparse_regression(dim, n_train=options["n_train"], noise_std=noise, **common)
        scales, factors = sample_hyperparameters(
            models,
            seed=seed,
            init_range=options["init_range"],
            step_factor_range=options["step_factor_range"],
        )
        scales_t = torch.as_tensor(scales, dtype=data.x_train.dtype, device=device)
        factors_t = torch.as_tensor(factors, dtype=data.x_train.dtype, device=device)
        population = train_population(
            data,
            scales_t,
            step_sizes_for(data, scales_t, factors_t),
            target_loss=options["target_loss"],
            max_steps=options["max_steps"],
            progress=progress,
        )
        return data, population, {"step_factor": factors.tolist()}
    if setup != "step-size":
        raise ValueError(f"`setup` must be one of {list(SETUPS)}, got {setup!r}")
    n_train = options["n_train"]
    if n_train is None:
        n_train = max(2, round(STEP_SIZE_SAMPLES_PER_FEATURE * dim))
    noise = 0.0 if options["noise_std"] is None else options["noise_std"]
    data = make_sparse_regression(dim, n_train=n_train, noise_std=noise, nonnegative=True, **common)
    stochastic, steps = sample_step_size_hyperparameters(models, seed=seed)
    population = train_schedule_population(
        data,
        torch.as_tensor(stochastic),
        torch.as_tensor(steps),
        target_loss=options["target_loss"],
        max_steps=options["max_steps"],
        seed=seed,
        progress=progress,
    )
    algorithms = ["sgd" if s else "gd" for s in stochastic]
    return data, population, {"algorithm": algorithms, "initial_step_size": steps.tolist()}


def _setup_settings(setup: str, options: Mapping[str, Any]) -> Dict[str, Any]:
    """How the population was trained, for the JSON document."""
    if setup == "phase-transition":
        return {
            "init": "u = alpha * 1, v = 0",
            "init_range": list(options["init_range"]),
            "step_factor_range": list(options["step_factor_range"]),
            "algorithm": "full-batch gradient descent",
        }
    return {
        "init": f"u = {STEP_SIZE_INIT} * 1, v = 0",
        "algorithm": "even models full-batch GD, odd models SGD with batch size 1",
        "step_size_ranges": {k: list(v) for k, v in STEP_SIZE_RANGES.items()},
        "step_decay": f"step / {DEFAULT_STEP_DECAY} after {DEFAULT_LARGE_STEPS} steps",
    }


def _taus(
    values: Mapping[str, Sequence[float]], target: Sequence[float]
) -> Dict[str, Dict[str, float]]:
    taus = {}
    for name, column in values.items():
        t, p = kendall_tau(column, target)
        taus[name] = {"tau": t, "p": p}
    return taus


def _tau_by_rho_records(
    by_scale: Mapping[float, Mapping[str, Sequence[float]]],
    rho: float,
    rho_mix: float,
    target: Sequence[float],
) -> List[Dict[str, Any]]:
    """The ``tau_by_rho`` records of the paper's measures (not the diagnostics)."""
    series = []
    for name in next(iter(by_scale.values())):
        if name in DIAGNOSTICS:
            continue
        measure, path = measure_path(name)
        base = rho_mix if Measure.parse(name).metric == "mix" else rho
        for scale, values in by_scale.items():
            series.append(RhoSeries(scale, base * scale, measure, path, values[name]))
    return tau_by_rho(series, target, resamples=TAU_BY_RHO_RESAMPLES)


_DESCRIPTIONS = {
    "adaptive": "AdaptiveEuclidean(eps=0) on (u, v), straight line, radius rho",
    "inv": "DiagonalQuotient('inv'), exact geodesic (expmap), radius rho",
    "mix": "DiagonalQuotient('mix'), exact geodesic stopped at beta_i = 0, radius rho_mix",
    "inv_second_order": "DiagonalQuotient('inv'), second-order retraction "
    "(u, v)(1 + B - B^2/2), radius rho",
    "mix_second_order": "DiagonalQuotient('mix'), second-order retraction "
    "(u, v)(1 + B - B^2/2), radius rho_mix",
    "mix_unclamped": "diagnostic: mix geodesic continued through beta_i = 0 "
    "(Euclidean ball in beta), radius rho_mix",
}


def run_diagonal(
    models: int = 50,
    dim: int = 200,
    seed: int = 0,
    rho: float = DEFAULT_RHO,
    iters: int = DEFAULT_ITERS,
    device: str | torch.device = "cpu",
    progress: bool = True,
    *,
    setup: str = "phase-transition",
    paths: Sequence[str] = PATHS,
    rho_scales: Sequence[float] | None = None,
    rho_mix: float | None = None,
    n_train: int | None = None,
    noise_std: float | None = None,
    sparsity: float = DEFAULT_SPARSITY,
    init_range: Tuple[float, float] = DEFAULT_INIT_RANGE,
    step_factor_range: Tuple[float, float] = DEFAULT_STEP_FACTOR_RANGE,
    target_loss: float = DEFAULT_TARGET_LOSS,
    max_steps: int = DEFAULT_MAX_STEPS,
    records: RecordFile | None = None,
) -> Dict[str, Any]:
    r"""Train a population of diagonal networks and correlate sharpness with test loss.

    Parameters
    ----------
    models : int
        Population size :math:`M \ge 2`.
    dim : int
        Number of features :math:`d \ge 2`.
    seed : int
        Population seed (data, hyperparameters and SGD samples).
    rho : float
        Radius of the adaptive and inv balls.
    iters : int
        Auto-PGD iterations per ball.
    device : str or torch.device
        Where the data, the models and the sharpness computations live.
    progress : bool
        Progress of training (a tqdm bar, on a terminal only) and sharpness (a bar on a
        terminal, else a line every 10%).
    setup : {"phase-transition", "step-size"}
        The population (:data:`SETUPS`; the documentation's reproduction page and the
        modules :mod:`.data` and :mod:`.train` describe both).
    paths : sequence of {"exact", "second_order"}
        The paths of the geodesic measures (:func:`measure_names`).
    rho_scales : sequence of float, optional
        Multiples of every radius at which every measure is computed; 1 is always
        included. Given, the result has ``tau_by_rho`` records with bootstrap intervals
        (:data:`TAU_BY_RHO_RESAMPLES` resamples); ``None`` measures scale 1 only and
        leaves ``tau_by_rho`` ``None``.
    rho_mix : float, optional
        Radius of the mix ball, in units of :math:`|\beta^*| = 1`; default ``rho``.
    n_train, noise_std, sparsity
        Data settings (:func:`~geoopt_quotient.experiments.diagonal.data.make_sparse_regression`);
        ``None`` takes the setup's default (phase-transition: n at the :math:`\ell_1`
        recovery threshold, noise 0.1; step-size: n = 0.4 d, no noise).
    init_range, step_factor_range
        Log-uniform ranges of :math:`\alpha` and :math:`f` (:mod:`.train`), for the
        phase-transition setup.
    target_loss, max_steps
        Stopping rule of the training.
    records : RecordFile, optional
        Each model's sharpness values at each scale are appended there as soon as they
        are computed, and (model, scale) pairs already recorded for the same settings are
        not measured again.

    Returns
    -------
    dict
        ``settings``, ``data``, ``training`` (summary), ``per_model`` (columns: init
        scale, step size, steps, restarts, converged, train loss, test loss, population
        risk, norms, the setup's own columns, and ``sharpness_<measure>`` at scale 1),
        ``tau`` (``measure -> {"tau", "p"}`` against the test loss, scale 1),
        ``tau_population_risk``, ``by_scale`` (per scale: radii, sharpness columns,
        ``tau``), ``tau_by_rho`` (records of
        :mod:`~geoopt_quotient.experiments.population.rho_grid` for adaptive, inv and mix
        against the test loss), ``paper_tau``, ``timings`` (seconds), ``versions``. Everything is
        JSON-serialisable.
    """
    _check_args(models, dim, rho, rho_mix, iters)
    measures = measure_names(paths)
    scales = study_scales(rho_scales)
    rho_mix = float(rho if rho_mix is None else rho_mix)
    device = torch.device(device)
    start = time.perf_counter()
    options = dict(
        n_train=n_train,
        noise_std=noise_std,
        sparsity=sparsity,
        init_range=init_range,
        step_factor_range=step_factor_range,
        target_loss=target_loss,
        max_steps=max_steps,
    )
    data, population, setup_columns = train_setup(
        setup, models, dim, seed, device, progress, options
    )
    key = fingerprint(
        dict(options, setup=setup, models=models, dim=dim, seed=seed, rho=rho, rho_mix=rho_mix)
        | dict(iters=iters, measures=list(measures))
    )
    done, save = _resumed(records, key, seed, scales)
    by_scale, sharpness_seconds = measure_population(
        data,
        population.points,
        rho=rho,
        rho_mix=rho_mix,
        iters=iters,
        measures=measures,
        scales=scales,
        progress=progress,
        done=done,
        on_model=save,
    )
    per_model = _per_model(data, population, setup_columns)
    for name, column in by_scale[1.0].items():
        per_model[f"sharpness_{name}"] = column
    settings = {
        "setup": setup,
        "models": models,
        "dim": dim,
        "seed": seed,
        "rho": float(rho),
        "rho_mix": rho_mix,
        "rho_scales": list(scales),
        "paths": [p for p in PATHS if p in paths],
        "iters": iters,
        "device": str(device),
        "measures": {name: _DESCRIPTIONS[name] for name in measures},
        "sharpness_on": "training set, one batch; S = max L(perturbed) - L(w)",
        **_setup_settings(setup, options),
        "target_loss": target_loss,
        "max_steps": max_steps,
        "resumed_models": len(done),  # (model, scale) records reused
    }
    document = {"experiment": "diagonal", "settings": settings, "data": data.describe()}
    document.update(_diagonal_results(population, per_model, by_scale, rho, rho_mix, rho_scales))
    document["timings"] = {
        "train": population.seconds,
        "sharpness": sharpness_seconds,
        "total": time.perf_counter() - start,
    }
    document["versions"] = _versions()
    return document


def _resumed(
    records: RecordFile | None, key: str, seed: int, scales: Sequence[float]
) -> Tuple[Dict[Tuple[int, float], Any], Callable[[int, float, Dict[str, float]], None]]:
    """The ``(model, scale) -> values`` already in ``records`` for the run ``key``, and the
    function that appends a newly measured (model, scale) there."""
    done = {}
    if records is not None:
        done = {
            (r["model"], r["scale"]): r["sharpness"]
            for r in records.select(run=key, seed=seed)
            if r.get("scale") in scales
        }

    def save(index: int, scale: float, values: Dict[str, float]) -> None:
        if records is not None:
            record = {"run": key, "seed": seed, "model": index, "scale": scale}
            records.append(record | {"sharpness": values})

    return done, save


def _diagonal_results(
    population: TrainedPopulation,
    per_model: Dict[str, List[Any]],
    by_scale: Mapping[float, Mapping[str, Sequence[float]]],
    rho: float,
    rho_mix: float,
    rho_scales: Sequence[float] | None,
) -> Dict[str, Any]:
    """The entries of :func:`run_diagonal`'s document from ``training`` to ``paper_tau``:
    the training summary, the per-model columns and Kendall's tau at every scale."""
    test_loss = per_model["test_loss"]
    return {
        "training": {
            "converged": int(population.converged.sum()),
            "max_steps_used": int(population.steps.max()),
            "restarts": int(population.restarts.sum()),
        },
        "per_model": per_model,
        "tau": _taus(by_scale[1.0], test_loss),
        "tau_population_risk": _taus(by_scale[1.0], per_model["population_risk"]),
        "by_scale": [
            {
                "scale": scale,
                "rho": rho * scale,
                "rho_mix": rho_mix * scale,
                "sharpness": values,
                "tau": _taus(values, test_loss),
            }
            for scale, values in by_scale.items()
        ],
        "tau_by_rho": None
        if rho_scales is None
        else _tau_by_rho_records(by_scale, rho, rho_mix, test_loss),
        "paper_tau": dict(PAPER_TAU),
    }


def _per_model(
    data: SparseRegression, population: TrainedPopulation, setup_columns: Mapping[str, List[Any]]
) -> Dict[str, List[Any]]:
    beta = population.beta
    support = torch.zeros(data.dim, dtype=torch.bool, device=beta.device)
    support[data.support] = True
    off_support = beta[:, ~support].abs().sum(-1) / beta.abs().sum(-1).clamp_min(1e-300)
    columns = {
        "init_scale": population.init_scales,
        "step_size": population.step_sizes,
        "steps": population.steps,
        "restarts": population.restarts,
        "converged": population.converged,
        "train_loss": population.train_loss,
        "test_loss": data.test_loss(beta),
        "population_risk": data.population_risk(beta),
        "beta_l1": beta.abs().sum(-1),
        "beta_l2": beta.norm(dim=-1),
        "beta_error": (beta - data.beta_star).norm(dim=-1),
        "off_support_l1_fraction": off_support,
    }
    return {k: v.detach().cpu().tolist() for k, v in columns.items()} | dict(setup_columns)


# ----------------------------------------------------------------------------- summaries
def summarize_runs(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    r"""Kendall :math:`\tau` over population seeds: per seed, mean and (sample) std.

    Parameters
    ----------
    runs : sequence of dict
        Results of :func:`run_diagonal`, one per population seed; each has
        ``settings["seed"]`` and ``tau[measure]["tau"]``.

    Returns
    -------
    dict
        ``{"seeds": [...], "measures": {name: {"per_seed", "mean", "std", "paper"}}}``
        (``std`` is 0 for a single seed; ``paper`` is the paper's :math:`\tau`, or
        ``None`` for a diagnostic measure).

    Raises
    ------
    ValueError
        For no runs.
    """
    if not runs:
        raise ValueError("no runs to summarise")
    names = list(runs[0]["tau"])
    summary: Dict[str, Any] = {"seeds": [r["settings"]["seed"] for r in runs], "measures": {}}
    for name in names:
        taus = [float(r["tau"][name]["tau"]) for r in runs]
        std = float(np.std(taus, ddof=1)) if len(taus) > 1 else 0.0
        summary["measures"][name] = {
            "per_seed": taus,
            "mean": float(np.mean(taus)),
            "std": std,
            "paper": PAPER_TAU.get(measure_path(name)[0]),
        }
    return summary


def format_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table of :math:`\\tau` beside the paper's values, the paths side by side.

    One row per measure, one column per path (exact geodesic, second-order retraction;
    adaptive sharpness has only its straight line, in the first column); with several
    seeds each cell is mean ± std and the per-seed values follow the table.

    Parameters
    ----------
    summary : dict
        The result of :func:`summarize_runs`.

    Returns
    -------
    str
        The table, lines joined by newlines.
    """
    seeds = summary["seeds"]
    many = len(seeds) > 1
    rows: Dict[str, Dict[str, Mapping[str, Any]]] = {}
    for name, row in summary["measures"].items():
        measure, path = measure_path(name)
        rows.setdefault(measure, {})["second_order" if path == "second_order" else "first"] = row
    labels = {m: m if m in PAPER_TAU else f"{m} *" for m in rows}
    labels = {m: f"{label} (straight)" if m == "adaptive" else label for m, label in labels.items()}
    width = max(len("measure"), *map(len, labels.values())) + 2
    cell = 17 if many else 10
    head = f"{'measure':<{width}}{'exact':>{cell}}{'second order':>{cell + 4}}{'paper':>9}"
    lines = [head, "-" * len(head)]
    for measure, by_path in rows.items():
        texts = []
        for column in ("first", "second_order"):
            row = by_path.get(column)
            if row is None:
                texts.append("—")
            else:
                texts.append(f"{row['mean']:+.3f}" + (f" ± {row['std']:.3f}" if many else ""))
        paper = PAPER_TAU.get(measure)
        paper_text = "—" if paper is None else f"{paper:+.2f}"
        lines.append(
            f"{labels[measure]:<{width}}{texts[0]:>{cell}}{texts[1]:>{cell + 4}}{paper_text:>9}"
        )
    if any(m not in PAPER_TAU for m in rows):
        lines.append("* diagnostic, not in the paper")
    if many:
        lines.append("per seed (" + ", ".join(str(s) for s in seeds) + "):")
        for name, row in summary["measures"].items():
            lines.append(f"  {name}: " + ", ".join(f"{t:+.3f}" for t in row["per_seed"]))
    return "\n".join(lines)
