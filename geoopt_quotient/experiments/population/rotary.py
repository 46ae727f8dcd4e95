r"""Does sharpness predict generalization in rotary transformers? The population study.

The population is :mod:`~geoopt_quotient.experiments.population.modular`'s: small
Llama-style models on modular arithmetic, each saved the first time its training loss
reaches a threshold :math:`\lambda`, so that the models of one threshold have the same
training loss and differ in test accuracy. For every threshold's population this module

1. calibrates one radius per measure (:func:`calibrate_study_radii`): the median over a few
   reference models of :func:`~geoopt_quotient.calibrate_rho`'s radius at which
   worst-case sharpness is ``target`` times the clean loss, which puts the balls of
   different shapes on one scale;
2. measures every model (:func:`measure_rotary_model`): adaptive sharpness, geodesic
   sharpness in the ``inv`` and ``mix`` metrics with the attention symmetries (rotary
   query-key, GL value-output) and geodesic ``inv`` with every symmetry it knows
   (``kinds="all"``: also the gated MLP's GL(1) per hidden unit), on the same
   training examples;
3. relates each measure to the generalization gap :math:`g` (test minus train error, and
   test minus train loss) across models (:func:`tau_records`): Kendall's :math:`\tau`
   with a bootstrap interval, the partial :math:`\tau` given the training loss
   (:func:`~geoopt_quotient.sharpness.stats.partial_kendall_tau`), and the same for the
   sharpness relative to the clean loss :math:`S / L(w)`.

Within one training run, sharpness falls with the loss, so checkpoints of one run rank by
training progress; the thresholds remove that (the partial :math:`\tau` checks what is
left of it).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..._extras import require
from ..._progress import progress_bar
from ...sharpness import adaptive_sharpness, calibrate_rho, geodesic_sharpness
from ...sharpness.stats import (
    kendall_tau,
    kendall_tau_bootstrap,
    partial_kendall_tau_bootstrap,
)
from ...symmetry import find_symmetries
from ..figures import sharpness_scatter
from ..records import RecordFile, fingerprint
from .modular import (
    PopulationSpec,
    answer_loss,
    sharpness_batches,
    threshold_name,
    train_rotary_population,
)
from .report import write_rows_csv

__all__ = [
    "QUANTITIES",
    "ROTARY_MEASURES",
    "TARGETS",
    "RotaryStudySettings",
    "calibrate_study_radii",
    "format_rotary_tau",
    "load_rotary_checkpoint",
    "measure_rotary_model",
    "measure_threshold",
    "reference_models",
    "rotary_frames",
    "rotary_rows",
    "rotary_share_rows",
    "rotary_tau_rows",
    "run_rotary_study",
    "share_tau_records",
    "tau_records",
    "write_rotary_files",
]

#: The measures: name -> (metric or None for adaptive sharpness, symmetry kinds).
ROTARY_MEASURES: Dict[str, Tuple[Optional[str], str]] = {
    "adaptive": (None, "default"),
    "geodesic_inv": ("inv", "default"),
    "geodesic_mix": ("mix", "default"),
    "geodesic_inv_all": ("inv", "all"),
}
#: The generalization gaps each measure is related to: test - train error, and loss.
TARGETS = ("gap", "loss_gap")
#: What is correlated with a gap: the sharpness, and the sharpness over the clean loss.
QUANTITIES = ("value", "relative")


@dataclass(frozen=True)
class RotaryStudySettings:
    """The sharpness side of the study.

    Attributes
    ----------
    target : float
        The calibration's rule: the radius of each measure is where its worst-case
        sharpness is ``target`` times the clean loss (median over the reference models).
    iters : int
        Auto-PGD iterations per batch (calibration and measurement).
    batch_size, max_examples : int
        The sharpness examples: the first ``max_examples`` pairs of each population seed's
        order, training examples of every model (:func:`.modular.sharpness_batches`).
    path : {"second_order", "exact"}
        The geodesic measures' path.
    seed : int
        The maximiser's seed, the same for every model.
    reference_models : int
        Models per threshold the radii are calibrated on (spread over the population).
    rtol, max_evals : float, int
        :func:`~geoopt_quotient.calibrate_rho`'s tolerance and evaluation budget.
    resamples : int
        Bootstrap resamples of the tau intervals.
    """

    target: float = 0.1
    iters: int = 10
    batch_size: int = 256
    max_examples: int = 512
    path: str = "second_order"
    seed: int = 0
    reference_models: int = 3
    rtol: float = 0.05
    max_evals: int = 24
    resamples: int = 2000


def _plan(model: torch.nn.Module, metric: str, kinds: str, probe: Any):
    return find_symmetries(model, metric=metric, kinds=kinds, verify=True, probe_inputs=probe)


def _sharpness(
    model: torch.nn.Module,
    batches: Sequence[Any],
    measure: str,
    rho: float,
    settings: RotaryStudySettings,
    plans: Dict[Tuple[str, str], Any],
):
    """One measure's :class:`~geoopt_quotient.SharpnessResult` at radius ``rho``."""
    metric, kinds = ROTARY_MEASURES[measure]
    common = dict(rho=rho, iters=settings.iters, seed=settings.seed, progress=False, shares=True)
    if metric is None:
        return adaptive_sharpness(model, answer_loss, batches, **common)
    if (metric, kinds) not in plans:
        plans[metric, kinds] = _plan(model, metric, kinds, batches[0][0]).bind(model)
    return geodesic_sharpness(
        model,
        answer_loss,
        batches,
        symmetries=plans[metric, kinds],
        metric=metric,
        path=settings.path,
        **common,
    )


def measure_rotary_model(
    model: torch.nn.Module,
    batches: Sequence[Any],
    radii: Mapping[str, float],
    settings: RotaryStudySettings,
) -> Dict[str, Any]:
    r"""Every measure of ``radii`` for one model, with its plan.

    Parameters
    ----------
    model : torch.nn.Module
        A model of the population.
    batches : sequence
        Its sharpness batches (:func:`.modular.sharpness_batches`).
    radii : mapping of str to float
        The radius of each measure of :data:`ROTARY_MEASURES` to measure.
    settings : RotaryStudySettings
        Auto-PGD iterations, seed and path.

    Returns
    -------
    dict
        ``measures``: per measure ``value``, ``clean_loss``, ``perturbed_loss``,
        ``relative`` (value / clean loss), ``rho``, ``per_batch``, ``seconds`` and
        ``shares`` (per block and symmetry kind, the maximiser's part of
        :math:`|\xi^*|^2` and of the first-order increase, with their fractions:
        :meth:`~geoopt_quotient.SharpnessResult.share_rows`);
        ``plan``: per geodesic measure, the plan's summary table (which groups of which
        layers are quotiented, and how).
    """
    plans: Dict[Tuple[str, str], Any] = {}
    measures, summaries = {}, {}
    for measure, rho in radii.items():
        result = _sharpness(model, batches, measure, rho, settings, plans)
        clean = sum(result.clean_losses) / len(result.clean_losses)
        measures[measure] = {
            "value": result.value,
            "clean_loss": clean,
            "perturbed_loss": sum(result.perturbed_losses) / len(result.perturbed_losses),
            "relative": result.value / clean if clean > 0 else math.inf,
            "rho": rho,
            "per_batch": result.per_batch,
            "seconds": result.seconds,
            "shares": result.share_rows(),
        }
        if ROTARY_MEASURES[measure][0] is not None:
            summaries[measure] = result.plan
    return {"measures": measures, "plan": summaries}


def calibrate_study_radii(
    models: Sequence[Tuple[str, torch.nn.Module, Sequence[Any]]],
    settings: RotaryStudySettings,
    measures: Sequence[str] = tuple(ROTARY_MEASURES),
    records: Optional[RecordFile] = None,
    key: str = "",
) -> Dict[str, Any]:
    """Each measure's radius: the median over ``models`` of the radius at which its
    worst-case sharpness is ``settings.target`` times the clean loss.

    Parameters
    ----------
    models : sequence of (str, model, batches)
        The reference models, by name, each with its sharpness batches.
    settings : RotaryStudySettings
        The rule (``target``), tolerance and Auto-PGD options.
    measures : sequence of str
        Names of :data:`ROTARY_MEASURES`.
    records, key : RecordFile, str
        Where finished calibrations are kept (one record per model and measure, with
        ``key`` as fingerprint) and reused.

    Returns
    -------
    dict
        ``radii`` (measure -> median radius), ``per_model`` (measure -> name -> radius),
        ``target``.
    """
    done = {}
    if records is not None:
        done = {(r["model"], r["measure"]): r["rho"] for r in records.select(fingerprint=key)}
    per_model: Dict[str, Dict[str, float]] = {m: {} for m in measures}
    for name, model, batches in models:
        plans: Dict[Tuple[str, str], Any] = {}
        for measure in measures:
            if (name, measure) not in done:
                rho = _calibrate_one(model, batches, measure, settings, plans)
                done[name, measure] = rho
                if records is not None:
                    entry = {"fingerprint": key, "model": name, "measure": measure, "rho": rho}
                    records.append(entry)
            per_model[measure][name] = done[name, measure]
    radii = {m: float(statistics.median(per_model[m].values())) for m in measures}
    return {"radii": radii, "per_model": per_model, "target": settings.target}


def _calibrate_one(
    model: torch.nn.Module,
    batches: Sequence[Any],
    measure: str,
    settings: RotaryStudySettings,
    plans: Dict[Tuple[str, str], Any],
) -> float:
    metric, kinds = ROTARY_MEASURES[measure]
    options: Dict[str, Any] = dict(iters=settings.iters, seed=settings.seed)
    if metric is not None:
        if (metric, kinds) not in plans:
            plans[metric, kinds] = _plan(model, metric, kinds, batches[0][0]).bind(model)
        options.update(symmetries=plans[metric, kinds], path=settings.path)
    return float(
        calibrate_rho(
            model,
            answer_loss,
            batches,
            target=settings.target,
            measure=metric or "adaptive",
            rtol=settings.rtol,
            max_evals=settings.max_evals,
            progress=False,
            **options,
        )
    )


def tau_records(
    models: Sequence[Mapping[str, Any]],
    measures: Sequence[str],
    *,
    resamples: int = 2000,
    seed: int = 0,
    control: str = "train_loss",
) -> List[Dict[str, Any]]:
    r"""Kendall's :math:`\tau` of every (measure, quantity) against every gap.

    One record per gap of :data:`TARGETS`, quantity of :data:`QUANTITIES` (the sharpness
    :math:`S`, and :math:`S / L(w)`) and measure, and one per gap for ``control`` itself
    (its own :math:`\tau`, the baseline any measure has to beat): ``tau``, ``p_value``,
    ``ci_low``, ``ci_high`` (percentile bootstrap over models), ``partial_tau``,
    ``partial_ci_low``, ``partial_ci_high`` (given ``control``), ``models``.

    Parameters
    ----------
    models : sequence of dict
        Per model the gaps, ``control`` and ``measures[name][quantity]``.
    measures : sequence of str
        The measures.
    resamples, seed : int
        The bootstrap's resamples and seed.
    control : str
        The per-model field the partial tau is conditioned on.

    Returns
    -------
    list of dict
        The records, gap by gap.
    """
    out = []
    controls = [float(m[control]) for m in models]
    for target in TARGETS:
        gaps = [float(m[target]) for m in models]
        columns = [(control, "value", controls)] + [
            (measure, quantity, [float(m["measures"][measure][quantity]) for m in models])
            for quantity in QUANTITIES
            for measure in measures
        ]
        for measure, quantity, values in columns:
            out.append(
                {
                    "target": target,
                    "quantity": quantity,
                    "measure": measure,
                    **_tau_entry(values, gaps, controls, resamples, seed, measure == control),
                }
            )
    return out


def share_tau_records(
    models: Sequence[Mapping[str, Any]],
    measures: Sequence[str],
    *,
    resamples: int = 2000,
    seed: int = 0,
) -> List[Dict[str, Any]]:
    """Which blocks carry the signal: Kendall's tau of each block's share of the
    maximiser against the error gap.

    One record per measure, (block, kind) that every model has, and share
    (``norm_share``: of :math:`|\\xi^*|^2`; ``first_order_share``: of the first-order
    increase): ``measure``, ``block``, ``kind``, ``share``, ``tau``, ``p_value``,
    ``ci_low``, ``ci_high``, ``models``. Shares constant over the models (a block alone
    in its measure) have no tau and are left out.

    Parameters
    ----------
    models : sequence of dict
        Per model the ``gap`` and ``measures[name]["shares"]``.
    measures : sequence of str
        The measures.
    resamples, seed : int
        The bootstrap's resamples and seed.

    Returns
    -------
    list of dict
        The records.
    """
    out = []
    gaps = [float(m["gap"]) for m in models]
    for measure in measures:
        tables = [
            {(r["block"], r["kind"]): r for r in m["measures"][measure].get("shares", ())}
            for m in models
        ]
        common = [k for k in tables[0] if all(k in t for t in tables)]
        for block, kind in common:
            for share in ("norm_share", "first_order_share"):
                values = [float(t[block, kind][share]) for t in tables]
                if not all(math.isfinite(v) for v in values) or len(set(values)) < 2:
                    continue
                tau, low, high = kendall_tau_bootstrap(values, gaps, resamples=resamples, seed=seed)
                out.append(
                    {
                        "measure": measure,
                        "block": block,
                        "kind": kind,
                        "share": share,
                        "tau": tau,
                        "p_value": kendall_tau(values, gaps)[1],
                        "ci_low": low,
                        "ci_high": high,
                        "models": len(values),
                    }
                )
    return out


def _tau_entry(
    values: Sequence[float],
    gaps: Sequence[float],
    controls: Sequence[float],
    resamples: int,
    seed: int,
    is_control: bool,
) -> Dict[str, Any]:
    tau, low, high = kendall_tau_bootstrap(values, gaps, resamples=resamples, seed=seed)
    entry = {"tau": tau, "p_value": kendall_tau(values, gaps)[1], "ci_low": low, "ci_high": high}
    if is_control:
        partial = (math.nan, math.nan, math.nan)
    else:
        partial = partial_kendall_tau_bootstrap(
            values, gaps, controls, resamples=resamples, seed=seed
        )
    entry.update(
        partial_tau=partial[0],
        partial_ci_low=partial[1],
        partial_ci_high=partial[2],
        models=len(values),
    )
    return entry


def reference_models(models: Sequence[Mapping[str, Any]], count: int) -> List[Mapping[str, Any]]:
    """``count`` models spread over the population: at the quantiles
    :math:`(i + \\tfrac12) / k` of test accuracy (ties by name).

    Parameters
    ----------
    models : sequence of dict
        Training records with ``test_accuracy`` and ``name``.
    count : int
        How many (at most all of them).

    Returns
    -------
    list of dict
        The chosen records, by increasing test accuracy.
    """
    ranked = sorted(models, key=lambda m: (m["test_accuracy"], m["name"]))
    count = min(count, len(ranked))
    return [ranked[int((i + 0.5) * len(ranked) / count)] for i in range(count)]


def load_rotary_checkpoint(path: str) -> torch.nn.Module:
    """A trained model of the population, in float32 and eval mode.

    Parameters
    ----------
    path : str
        Its Hugging Face checkpoint directory (``.../loss-T``).

    Returns
    -------
    torch.nn.Module
        The model.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def measure_threshold(
    models: Sequence[Dict[str, Any]],
    batches_of: Callable[[int], List[Any]],
    settings: RotaryStudySettings,
    records: Optional[RecordFile] = None,
    on_model: Optional[Callable[[str], None]] = None,
    measures: Sequence[str] = tuple(ROTARY_MEASURES),
) -> Dict[str, Any]:
    """Calibrate the radii on a threshold's population, measure every model, relate to
    the gaps.

    Parameters
    ----------
    models : sequence of dict
        The training records of the threshold's models
        (:func:`.modular.train_rotary_population`); each gets ``measures`` and ``plan``.
    batches_of : callable
        ``batches_of(population_seed)``: that seed's sharpness batches.
    settings : RotaryStudySettings
        Calibration, Auto-PGD and bootstrap settings.
    records : RecordFile, optional
        Finished calibrations and models, kept and reused (same settings and models).
    on_model : callable, optional
        Called with each model's name once it is measured.
    measures : sequence of str
        Names of :data:`ROTARY_MEASURES`.

    Returns
    -------
    dict
        ``calibration`` (:func:`calibrate_study_radii`), ``reference_models`` (their names),
        ``tau`` (:func:`tau_records`), ``share_tau`` (:func:`share_tau_records`),
        ``models`` (the records with their measures).
    """
    study = asdict(settings)
    study.pop("resamples")
    references = reference_models(models, settings.reference_models)
    key = fingerprint({"study": study, "calibrate": [m["checkpoint"] for m in references]})
    loaded = [
        (m["name"], load_rotary_checkpoint(m["checkpoint"]), batches_of(m["population_seed"]))
        for m in references
    ]
    calibration = calibrate_study_radii(
        loaded,
        settings,
        measures,
        records,
        key,
    )
    measure_key = fingerprint({"study": study, "radii": calibration["radii"]})
    done = {}
    if records is not None:
        done = {r["checkpoint"]: r for r in records.select(fingerprint=measure_key)}
    measured = []
    for model in models:
        result = done.get(model["checkpoint"])
        if result is None:
            loaded = load_rotary_checkpoint(model["checkpoint"])
            batches = batches_of(model["population_seed"])
            result = measure_rotary_model(loaded, batches, calibration["radii"], settings)
            result.update(checkpoint=model["checkpoint"], fingerprint=measure_key)
            if records is not None:
                records.append(result)
        measured.append({**model, "measures": result["measures"], "plan": result["plan"]})
        if on_model is not None:
            on_model(model["name"])
    return {
        "calibration": calibration,
        "reference_models": [m["name"] for m in references],
        "tau": tau_records(measured, measures, resamples=settings.resamples, seed=settings.seed),
        "share_tau": share_tau_records(
            measured, measures, resamples=settings.resamples, seed=settings.seed
        ),
        "models": measured,
    }


def run_rotary_study(
    out: str,
    spec: PopulationSpec,
    seeds: Sequence[int],
    models: int,
    settings: RotaryStudySettings,
    *,
    resume: bool = False,
    progress: bool = False,
    measures: Sequence[str] = tuple(ROTARY_MEASURES),
) -> Dict[str, Any]:
    """Train (or, with ``resume``, load) the population and run the study per threshold.

    Trains ``models`` runs per seed of ``seeds`` into ``OUT/checkpoints``
    (:func:`.modular.train_rotary_population`), then for each threshold of ``spec``
    :func:`measure_threshold` on the models that reached it, records in
    ``OUT/rotary-records.jsonl``.

    Parameters
    ----------
    out : str
        The output directory.
    spec : PopulationSpec
        The task, the recipes' ranges and the thresholds.
    seeds : sequence of int
        The population seeds.
    models : int
        Runs per seed.
    settings : RotaryStudySettings
        The sharpness side.
    resume : bool
        Continue the training runs and reuse the records of a previous run.
    progress : bool
        Progress of training and sharpness on stderr (lines when not a terminal).
    measures : sequence of str
        Names of :data:`ROTARY_MEASURES`.

    Raises
    ------
    ValueError
        When the sharpness examples are not training examples of every model, or fewer
        than 3 runs reached a threshold.

    Returns
    -------
    dict
        ``population`` (the spec, seeds, runs, the models per threshold), ``settings``,
        ``thresholds`` (per threshold name: ``calibration``, ``reference_models``,
        ``tau``), ``models`` (one record per model and threshold: recipe, training
        record, train and test loss and accuracy, gaps, ``measures``, ``plan``) and
        ``timings``.
    """
    start = time.perf_counter()
    root = Path(out)
    count = int(spec.fractions[0] * spec.task.p**2)
    if count < settings.max_examples:
        raise ValueError(
            f"the smallest training set ({count} pairs) is smaller than max_examples "
            f"{settings.max_examples}: the sharpness examples must be training examples "
            "of every model; lower max_examples or raise the smallest training fraction"
        )
    bar = progress_bar(total=len(seeds) * models, desc="training", unit="run", show=progress)
    with bar:
        trained = train_rotary_population(
            spec,
            seeds,
            models,
            str(root / "checkpoints"),
            resume=resume,
            on_model=lambda run: bar.update(1),
        )
    train_seconds = time.perf_counter() - start
    cache: Dict[int, List[Any]] = {}

    def batches_of(seed: int) -> List[Any]:
        if seed not in cache:
            cache[seed] = sharpness_batches(
                spec.task, seed, settings.max_examples, settings.batch_size
            )
        return cache[seed]

    records = RecordFile(root / "rotary-records.jsonl", resume=resume)
    results, measured = {}, []
    for threshold in spec.thresholds:
        population = [r for r in trained if r["threshold"] == threshold]
        if len(population) < 3:
            raise ValueError(
                f"only {len(population)} runs reached training loss {threshold:g} within "
                f"{spec.max_steps} steps: a population needs at least 3 (raise max_steps)"
            )
        result = _measure_with_progress(
            population, batches_of, settings, records, measures, threshold, progress
        )
        measured += result.pop("models")
        results[threshold_name(threshold)] = {"threshold": threshold, **result}
    return {
        "population": {
            "spec": asdict(spec),
            "seeds": list(seeds),
            "runs_per_seed": models,
            "models_per_threshold": {
                k: sum(1 for m in measured if m["threshold"] == v["threshold"])
                for k, v in results.items()
            },
        },
        "settings": asdict(settings),
        "measures": list(measures),
        "thresholds": results,
        "models": measured,
        "timings": {
            "training": train_seconds,
            "sharpness": time.perf_counter() - start - train_seconds,
            "total": time.perf_counter() - start,
        },
    }


def _measure_with_progress(
    population: Sequence[Dict[str, Any]],
    batches_of: Callable[[int], List[Any]],
    settings: RotaryStudySettings,
    records: RecordFile,
    measures: Sequence[str],
    threshold: float,
    progress: bool,
) -> Dict[str, Any]:
    """:func:`measure_threshold` with a progress display over its models."""
    desc = f"sharpness at {threshold_name(threshold)}"
    bar = progress_bar(total=len(population), desc=desc, unit="model", show=progress)
    with bar:
        return measure_threshold(
            population, batches_of, settings, records, lambda _: bar.update(1), measures
        )


#: Per-model fields copied into every row of :func:`rotary_rows`.
ROW_FIELDS = (
    "name",
    "population_seed",
    "index",
    "threshold",
    "step",
    "train_loss",
    "test_loss",
    "train_accuracy",
    "test_accuracy",
    "gap",
    "loss_gap",
)


def rotary_rows(document: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One flat record per (model, measure): the model's recipe and training record,
    then the measure's ``rho``, ``value``, ``clean_loss``, ``perturbed_loss``,
    ``relative``, and its maximiser's shares per block and kind (columns
    ``norm_share/BLOCK/KIND`` and ``first_order_share/BLOCK/KIND``).

    Parameters
    ----------
    document : dict
        The study's document (:func:`run_rotary_study`).

    Returns
    -------
    list of dict
        The rows.
    """
    rows = []
    for model in document["models"]:
        head = {k: model[k] for k in ROW_FIELDS}
        head.update(model["recipe"])
        for measure, entry in model["measures"].items():
            row = dict(head, measure=measure)
            for field in ("rho", "value", "clean_loss", "perturbed_loss", "relative"):
                row[field] = entry[field]
            for share in entry.get("shares", ()):
                where = f"{share['block']}/{share['kind']}"
                row[f"norm_share/{where}"] = share["norm_share"]
                row[f"first_order_share/{where}"] = share["first_order_share"]
            rows.append(row)
    return rows


def rotary_share_rows(document: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One flat record per (model, measure, block, kind): the maximiser's shares
    (:meth:`~geoopt_quotient.SharpnessResult.share_rows`) beside the model's gap.

    Parameters
    ----------
    document : dict
        The study's document.

    Returns
    -------
    list of dict
        The rows.
    """
    return [
        {
            "name": m["name"],
            "threshold": m["threshold"],
            "gap": m["gap"],
            "measure": measure,
            **share,
        }
        for m in document["models"]
        for measure, entry in m["measures"].items()
        for share in entry.get("shares", ())
    ]


def rotary_tau_rows(document: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """One record per (threshold, gap, quantity, measure): the tau tables of every
    threshold, flat.

    Parameters
    ----------
    document : dict
        The study's document.

    Returns
    -------
    list of dict
        The rows, each with ``population`` (the threshold's name).
    """
    return [
        {"population": name, **row}
        for name, result in document["thresholds"].items()
        for row in result["tau"]
    ]


def rotary_frames(document: Mapping[str, Any]):
    """:func:`rotary_rows` and :func:`rotary_tau_rows` as :class:`pandas.DataFrame`.

    Parameters
    ----------
    document : dict
        The study's document.

    Returns
    -------
    tuple of pandas.DataFrame
        ``(models, tau)``.
    """
    pandas = require("pandas", "rotary_frames")
    return pandas.DataFrame(rotary_rows(document)), pandas.DataFrame(rotary_tau_rows(document))


def write_rotary_files(document: Dict[str, Any], out: str, title: str = "") -> List[str]:
    """OUT/rotary-loss-T.png per threshold (sharpness against the error gap, one panel
    per measure), OUT/rotary.csv (:func:`rotary_rows`), OUT/rotary-tau.csv
    (:func:`rotary_tau_rows`), OUT/rotary-shares.csv (:func:`rotary_share_rows`), then
    OUT/rotary.json.

    Parameters
    ----------
    document : dict
        The study's document; it gets ``figures`` and ``tables``.
    out : str
        The output directory (made if missing).
    title : str
        A prefix of the figures' titles.

    Returns
    -------
    list of str
        The paths written, the JSON last.
    """
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    figures = {}
    for name, result in document["thresholds"].items():
        models = [m for m in document["models"] if m["threshold"] == result["threshold"]]
        radii = ", ".join(f"{m} {r:.3g}" for m, r in result["calibration"]["radii"].items())
        figures[name] = sharpness_scatter(
            {m: [x["measures"][m]["value"] for x in models] for m in document["measures"]},
            [x["gap"] for x in models],
            str(root / f"rotary-{name}.png"),
            ylabel="gap (test - train error)",
            title=f"{title}{len(models)} models at training loss {result['threshold']:g}; "
            f"ρ: {radii}",
            log_x=True,
        )
    document["figures"] = figures
    document["tables"] = {
        "models": write_rows_csv(rotary_rows(document), root / "rotary.csv"),
        "tau": write_rows_csv(rotary_tau_rows(document), root / "rotary-tau.csv"),
        "shares": write_rows_csv(rotary_share_rows(document), root / "rotary-shares.csv"),
    }
    path = root / "rotary.json"
    path.write_text(json.dumps(document, indent=1, default=float) + "\n")
    return [*figures.values(), *document["tables"].values(), str(path)]


def format_rotary_tau(document: Mapping[str, Any], target: str = "gap") -> str:
    """The tau tables as text: per threshold, per measure and quantity, tau [95% CI] and
    the partial tau given the training loss [95% CI], against ``target``.

    Parameters
    ----------
    document : dict
        The study's document.
    target : {"gap", "loss_gap"}
        The generalization gap.

    Returns
    -------
    str
        The tables, lines joined by newlines.
    """
    lines = []
    for name, result in document["thresholds"].items():
        rows = [r for r in result["tau"] if r["target"] == target]
        lines.append(f"{name} ({rows[0]['models']} models), against {target}:")
        head = f"{'measure':<20}{'quantity':<10}{'tau':>7}{'95% CI':>17}"
        head += f"{'partial':>9}{'95% CI':>17}"
        lines += [head, "-" * len(head)]
        for r in rows:
            lines.append(
                f"{r['measure']:<20}{r['quantity']:<10}{r['tau']:>+7.3f}"
                f"{_interval(r['ci_low'], r['ci_high']):>17}{r['partial_tau']:>+9.3f}"
                f"{_interval(r['partial_ci_low'], r['partial_ci_high']):>17}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def _interval(low: float, high: float) -> str:
    return "—" if math.isnan(low) else f"[{low:+.2f}, {high:+.2f}]"
