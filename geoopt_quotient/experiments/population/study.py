r"""Sharpness versus generalization over a population of classifier checkpoints.

For every checkpoint: adaptive sharpness and geodesic sharpness in the inv and mix
metrics (and, on request, the ablations of Appendix G of "Hide & Seek": the quotient
norm or the curvature switched off), on the same training examples in the same batches
for every model, as in the paper. Then, per measure, Kendall's

.. math::

    \tau = \frac{2}{M(M-1)} \sum_{i<j} \operatorname{sign}(s_i - s_j)\,
        \operatorname{sign}(g_i - g_j)

between sharpness :math:`s` and generalization gap :math:`g` (test error minus train
error) over the :math:`M` models, with a percentile bootstrap confidence interval over
models. Below :data:`MIN_MODELS` models that interval is unreliable, and the table, the
JSON document and the figure say so (:func:`few_models_warning`).

With ``rho_scales`` (:func:`run_population`), every measure is also computed at each
multiple :math:`s` of its radius, on the same batches with the same seed, and
:math:`\tau` is reported per (scale, measure, path) in the records of
:mod:`geoopt_quotient.experiments.population.rho_grid`. Each model measures all its scales
in one call per measure, on the monotone radius grid
(:func:`~geoopt_quotient.geodesic_sharpness` with a sequence of radii): the search at
each radius also starts from the maximiser of the next smaller one, so a model's values
never decrease with the scale, and each is at least that of a study run with the radii
:math:`s\rho` alone (:func:`scaled_settings`); the smallest scale's values are exactly
those.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..._checks import PATHS, STRAIGHT, check_choice, check_positive_float
from ..._progress import progress_bar
from ...integrations.measures import measure_sharpness, named_measure
from ...measures import ABLATIONS, NAMED_MEASURES
from ...sharpness import DEFAULT_RADII
from ...sharpness.stats import kendall_tau, kendall_tau_bootstrap
from ..causal_lm import (
    is_causal_lm,
    load_causal_lm,
    load_text_batches,
    load_text_blocks,
    next_token_error,
    next_token_loss,
)
from ..classifiers import (
    ARRAY_SUFFIXES,
    DTYPES,
    TEXT_SUFFIXES,
    Batch,
    InputError,
    classification_loss,
    error_rate,
    is_regression,
    load_batches,
    load_checkpoint,
    read_config,
)
from ..figures import sharpness_scatter
from ..records import RecordFile, fingerprint
from .rho_grid import RhoSeries, study_scales, tau_by_rho

__all__ = [
    "ABLATIONS",
    "FORMATS",
    "MEASURES",
    "MIN_MODELS",
    "PAPER_TAU",
    "PROTOCOLS",
    "JointModels",
    "StudySettings",
    "few_models_warning",
    "find_checkpoints",
    "format_tau_table",
    "measure_model",
    "measure_model_over_scales",
    "measure_path",
    "measure_radius",
    "read_gaps",
    "run_population",
    "scaled_settings",
    "scatter_figure",
    "sharpness_to_clean_loss",
    "tau_table",
]

#: The measures of a study: adaptive sharpness and geodesic sharpness in each metric.
MEASURES = NAMED_MEASURES
#: Kendall tau between sharpness and generalization gap in the paper's Table 1.
PAPER_TAU = {
    "ImageNet, 72 CLIP ViT-B/32": {"adaptive": -0.41, "geodesic_inv": -0.71, "geodesic_mix": -0.70},
    "MNLI, 35 BERT-base": {"adaptive": 0.06, "geodesic_inv": 0.28, "geodesic_mix": 0.38},
}
#: Checkpoint formats: Hugging Face directories, or model-soups CLIP state dicts (``*.pt``).
FORMATS = ("hf", "model-soups")
#: The paper's evaluation protocols: sharpness examples, batch size, Auto-PGD iterations.
PROTOCOLS = {
    "imagenet": {"max_examples": 2048, "batch_size": 256, "iters": 20},
    "mnli": {"max_examples": 1024, "batch_size": 128, "iters": 20},
}
#: Populations smaller than this get a warning beside tau. A bootstrap resample of M
#: models holds about 0.63 M distinct ones (4 of 6), so its tau takes only a few values,
#: resamples in which a column is constant have no tau and are left out, and the
#: percentile interval can collapse to a single value such as [-1.00, -1.00].
MIN_MODELS = 8


def few_models_warning(models: int, *, interval: bool = True) -> Optional[str]:
    """The warning for a population of ``models`` models, or None from :data:`MIN_MODELS` on.

    Parameters
    ----------
    models : int
        Number of models in the population.
    interval : bool
        Whether the warning also speaks of tau's bootstrap interval (default ``True``).

    Returns
    -------
    str or None
        The warning, or ``None`` for :data:`MIN_MODELS` models or more.
    """
    if models >= MIN_MODELS:
        return None
    extra = " and its bootstrap interval unreliable" if interval else ""
    return f"only {models} models (fewer than {MIN_MODELS}): tau is coarse{extra}"


@dataclass(frozen=True)
class StudySettings:
    """Everything that determines the sharpness values of a population.

    Attributes
    ----------
    rho_adaptive, rho_inv, rho_mix : float
        Ball radii of adaptive sharpness and of the geodesic balls per metric (defaults
        :data:`~geoopt_quotient.sharpness.DEFAULT_RADII`: 0.01, 0.003, 0.003). The
        no-norm ablations use the adaptive ball (``rho_adaptive``); the no-curvature
        ablations the quotient ball of their metric.
    iters : int
        Auto-PGD iterations per batch (worst case) or samples (average case).
    kind : {"worst", "average"}
        Worst-case or average-case sharpness.
    path : {"second_order", "exact", "straight"}
        The geodesic: second-order retraction or exact exponential map.
    seed : int
        Seed of the maximiser, the same for every model.
    batch_size, max_examples, max_length : int
        The sharpness examples: the first ``max_examples`` of the data file in batches
        of ``batch_size`` (text truncated to ``max_length`` tokens).
    ablations : bool
        Also measure :data:`ABLATIONS`.
    verify : bool
        Check every model's discovered symmetries on its first batch.
    eps : float
        Relaxation of the quotients' Gram matrices (0: exact quotient).
    dtype : {"auto", "float32", "float64", "bfloat16", "float16"}
        The dtype Hugging Face checkpoints are loaded in ("auto": each checkpoint's own).
        Use "float32" for bfloat16 checkpoints: perturbations of half-precision weights
        are rounded to their resolution.
    """

    rho_adaptive: float = DEFAULT_RADII["adaptive"]
    rho_inv: float = DEFAULT_RADII["inv"]
    rho_mix: float = DEFAULT_RADII["mix"]
    iters: int = 20
    kind: str = "worst"
    path: str = "second_order"
    seed: int = 0
    batch_size: int = 128
    max_examples: Optional[int] = 1024
    max_length: int = 128
    ablations: bool = False
    verify: bool = True
    eps: float = 0.0
    dtype: str = "auto"

    def __post_init__(self) -> None:
        check_choice(self.kind, ("worst", "average"), "kind")
        check_choice(self.dtype, DTYPES, "dtype")
        check_choice(self.path, PATHS, "path")
        for name in ("rho_adaptive", "rho_inv", "rho_mix"):
            check_positive_float(getattr(self, name), name)

    @property
    def measures(self) -> Tuple[str, ...]:
        return MEASURES + (ABLATIONS if self.ablations else ())


def scaled_settings(settings: StudySettings, scale: float) -> StudySettings:
    r"""``settings`` with every radius multiplied by ``scale``: :math:`\rho \to s\rho`.

    Scale 1 returns ``settings`` itself, so that its records and fingerprint are those of
    a study without scales.
    """
    if scale == 1:
        return settings
    return replace(
        settings,
        rho_adaptive=scale * settings.rho_adaptive,
        rho_inv=scale * settings.rho_inv,
        rho_mix=scale * settings.rho_mix,
    )


def measure_radius(settings: StudySettings, measure: str) -> float:
    """The radius of ``measure``'s ball: the adaptive one for adaptive sharpness and the
    no-norm ablations, the quotient ball of the metric otherwise."""
    return getattr(settings, f"rho_{named_measure(measure).ball}")


def measure_path(settings: StudySettings, measure: str) -> str:
    """How ``measure`` perturbs the weights, as
    :mod:`~geoopt_quotient.experiments.population.rho_grid` names it: the straight line
    for adaptive sharpness and the no-curvature ablations, the study's ``path`` for the
    geodesic measures."""
    return STRAIGHT if named_measure(measure).straight else settings.path


# ---------------------------------------------------------------- inputs
def find_checkpoints(root: str, format: str = "hf") -> List[str]:
    """The checkpoints directly under ``root``, sorted: the directories with a config.json
    (``format="hf"``), or the ``*.pt`` files (``format="model-soups"``).

    Parameters
    ----------
    root : str
        The directory that holds the population's checkpoints.
    format : {"hf", "model-soups"}
        Hugging Face checkpoint directories (default) or model-soups state dicts.

    Returns
    -------
    list of str
        The checkpoints' paths, sorted.

    Raises
    ------
    InputError
        If ``root`` is not a directory, is itself one checkpoint, or holds fewer than 3
        checkpoints.
    ValueError
        For an unknown ``format``.
    """
    check_choice(format, FORMATS, "format")
    path = Path(root)
    if not path.is_dir():
        raise InputError(f"--checkpoints {root}: not a directory")
    if format == "model-soups":
        from ..model_soups import checkpoint_files

        files = [str(p) for p in checkpoint_files(root)]
        if len(files) < 3:
            raise InputError(
                f"--checkpoints {root}: found {len(files)} model-soups checkpoints (*.pt); "
                "a population study needs at least 3"
            )
        return files
    if (path / "config.json").exists():
        raise InputError(
            f"--checkpoints {root}: this is one checkpoint; give the directory that holds "
            "the population's checkpoint directories"
        )
    found = sorted(str(p) for p in path.iterdir() if (p / "config.json").is_file())
    if len(found) < 3:
        raise InputError(
            f"--checkpoints {root}: found {len(found)} checkpoint directories (with a "
            "config.json); a population study needs at least 3"
        )
    return found


def read_gaps(path: str, names: Sequence[str]) -> Dict[str, float]:
    """Generalization gaps from a CSV with a header.

    Columns: ``checkpoint`` (the directory name) and either ``gap`` or both
    ``train_error`` and ``test_error`` (gap = test error - train error). Every name in
    ``names`` must have one finite value.

    Parameters
    ----------
    path : str
        The CSV file (UTF-8).
    names : sequence of str
        The checkpoints' names (directory or file names) whose gaps are wanted; a
        ``checkpoint`` entry is reduced to its last path component.

    Returns
    -------
    dict of str to float
        The gap of each name, in the order of ``names``.

    Raises
    ------
    InputError
        For an unreadable file, a missing column, a value that is not a finite number,
        a checkpoint listed twice, or a name without a gap.
    """
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as error:
        raise InputError(f"--gaps {path}: {error.strerror or error}") from error
    columns = set(rows[0]) if rows else set()
    if "checkpoint" not in columns or not (
        "gap" in columns or {"train_error", "test_error"} <= columns
    ):
        raise InputError(
            f"--gaps {path}: expected a header with 'checkpoint' and 'gap' (or 'train_error' "
            f"and 'test_error'), found {sorted(columns) or 'no rows'}"
        )
    gaps: Dict[str, float] = {}
    for number, row in enumerate(rows, start=2):
        name = (row["checkpoint"] or "").strip().rstrip("/").split("/")[-1]
        try:
            if "gap" in row and row["gap"] not in (None, ""):
                value = float(row["gap"])
            else:
                value = float(row["test_error"]) - float(row["train_error"])
        except (TypeError, ValueError):
            raise InputError(f"{path}, line {number}: not a number in {dict(row)}") from None
        if not math.isfinite(value):
            raise InputError(f"{path}, line {number}: gap is not finite")
        if name in gaps:
            raise InputError(f"{path}, line {number}: checkpoint {name!r} listed twice")
        gaps[name] = value
    missing = [n for n in names if n not in gaps]
    if missing:
        raise InputError(f"--gaps {path}: no gap for {', '.join(missing)}")
    return {n: gaps[n] for n in names}


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (first 16 hex digits)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def checkpoint_signature(directory: str) -> Dict[str, Any]:
    """What identifies a checkpoint's weights without reading them: config digest, sizes, times.

    For a single-file checkpoint (model-soups ``*.pt``): its name, size and time.
    """
    root = Path(directory)
    if root.is_file():
        return {"weights": [[root.name, root.stat().st_size, root.stat().st_mtime_ns]]}
    weights = sorted(root.glob("model*.safetensors"))
    return {
        "config": file_digest(str(root / "config.json")),
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights],
    }


# ---------------------------------------------------------------- one model
def measure_model(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[Any],
    settings: StudySettings,
    *,
    probe_inputs: Any = None,
    on_measure: Optional[Callable[[str], None]] = None,
    plans: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Dict[str, Any]]:
    """Every measure of ``settings`` for one model: value, per-batch values, losses, seconds.

    The symmetries are discovered once per metric (and checked on ``probe_inputs`` when
    ``settings.verify``), unless ``plans`` gives them. Batches are not sharded over
    processes here: in a population, models are (or, with a model sharded over the
    processes, each process passes its rows of every batch: :class:`JointModels`).

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``.
    batches : sequence
        The sharpness batches, the same for every model of the population.
    settings : StudySettings
        The measures, radii and Auto-PGD options.
    probe_inputs : object
        Inputs for the symmetry check (``settings.verify``), as for
        :func:`~geoopt_quotient.find_symmetries`; ``None`` builds them from the model's
        config.
    on_measure : callable or None
        Called with each measure's name before it is measured (e.g. for a progress
        line).
    plans : mapping of str to BoundPlan, optional
        The bound plan of each metric, found beforehand (e.g. on the model before it was
        sharded); the metrics it lacks are discovered here, unchecked.

    Returns
    -------
    dict
        Per measure: ``value``, ``per_batch``, ``clean_loss``, ``perturbed_loss`` and
        ``seconds``; with a geodesic measure also ``"_plan"``, the symmetric groups
        (name to count of heads) and the plan's notes.
    """
    return measure_model_over_scales(
        model,
        loss_fn,
        batches,
        settings,
        None,
        probe_inputs=probe_inputs,
        on_measure=on_measure,
        plans=plans,
    )[0]


def measure_model_over_scales(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[Any],
    settings: StudySettings,
    scales: Optional[Sequence[float]],
    *,
    probe_inputs: Any = None,
    on_measure: Optional[Callable[[str], None]] = None,
    plans: Optional[Mapping[str, Any]] = None,
) -> List[Dict[str, Dict[str, Any]]]:
    r""":func:`measure_model` at several multiples of the radii, in one call per measure.

    Each measure is measured on the grid :math:`s_1 \rho < \dots < s_K \rho` of its
    radius :math:`\rho` (a sequence ``rho`` of
    :func:`~geoopt_quotient.geodesic_sharpness`), monotone by construction: per batch,
    the value at :math:`s_k\rho` is at least that at :math:`s_{k-1}\rho` and at least
    that of a call at :math:`s_k\rho` alone.

    Parameters
    ----------
    model, loss_fn, batches, settings, probe_inputs, on_measure, plans
        As for :func:`measure_model`.
    scales : sequence of float or None
        The multiples :math:`s_k > 0`, increasing; ``None``: the radii of ``settings``
        alone (one single-radius call per measure, as :func:`measure_model`).

    Returns
    -------
    list of dict
        One :func:`measure_model` result per scale, in the order of ``scales``.
    """
    radii: Dict[str, Any] = {m: measure_radius(settings, m) for m in settings.measures}
    if scales is not None:
        grids = [scaled_settings(settings, s) for s in scales]
        radii = {m: [measure_radius(g, m) for g in grids] for m in settings.measures}
    plans = dict(plans or {})
    measured = measure_sharpness(
        model,
        loss_fn,
        batches,
        settings.measures,
        radii,
        iters=settings.iters,
        kind=settings.kind,
        path=settings.path,
        seed=settings.seed,
        eps=settings.eps,
        verify=settings.verify,
        probe_inputs=probe_inputs,
        plans=plans,
        on_measure=on_measure,
    )
    count = 1 if scales is None else len(scales)
    per_scale: List[Dict[str, Dict[str, Any]]] = [{} for _ in range(count)]
    for measure, outcome in measured.items():
        for results, result in zip(per_scale, outcome if scales is not None else [outcome]):
            results[measure] = {
                "value": result.value,
                "per_batch": result.per_batch,
                "clean_loss": float(np.mean(result.clean_losses)),
                "perturbed_loss": float(np.mean(result.perturbed_losses)),
                "seconds": result.seconds if scales is None else sum(result.seconds_per_batch),
            }
    if plans:
        bound = next(iter(plans.values()))
        results_plan = {g.name: g.count for g in bound.symmetric_groups}
        for results in per_scale:
            results["_plan"] = {"symmetric_groups": results_plan, "notes": list(bound.notes)}
    return per_scale


#: ``prepare(model, batches, settings) -> (rows, plans)`` of :class:`JointModels`.
Prepare = Callable[
    [torch.nn.Module, List[Batch], StudySettings], Tuple[List[Batch], Dict[str, Any]]
]


@dataclass(frozen=True)
class JointModels:
    r"""Every process measures every model together, instead of each process its own.

    For models too large for one device, under ``torch.distributed``: every process
    loads each checkpoint on ``load_device`` (its batches on the study's device), and
    ``prepare(model, batches, settings)`` shards the model in place over the processes
    (e.g. with FSDP2's ``fully_shard``) and returns this process's rows of every batch
    and the bound plan of each metric of ``settings.measures`` (found, and checked, on
    the model before it was sharded). The sharpness functions then measure the sharded
    model on those rows, one ball per global batch; the error rates (measured gaps) are
    those of the sharded model on whole batches, every process passing the same ones
    (the sharded forward passes are collectives). Process 0 writes the records.

    Attributes
    ----------
    prepare : callable
        ``prepare(model, batches, settings) -> (rows, plans)``, called on every process
        in the same order.
    load_device : torch.device or str
        Where each checkpoint is loaded before ``prepare`` (default ``"cpu"``: a model
        too large for one device is sharded from host memory).
    """

    prepare: Prepare
    load_device: torch.device | str = "cpu"


@dataclass(frozen=True)
class _LoadedCheckpoint:
    """A model with its sharpness batches and loss, and a way to measure its error on a
    data source (``None``: the model has no error rate, e.g. a regression model)."""

    model: torch.nn.Module
    batches: List[Batch]
    loss_fn: Callable[[Any, Batch], torch.Tensor]
    error_on: Optional[Callable[[str], float]]


def _load_hf(
    directory: str,
    settings: StudySettings,
    data: str,
    device: torch.device,
    model_device: Optional[torch.device] = None,
) -> _LoadedCheckpoint:
    """A Hugging Face checkpoint directory: a classifier with ``.jsonl`` text or ``.npz``
    arrays, or a causal LM with plain text (:func:`_load_causal_lm`); the model on
    ``model_device`` (default ``device``), the batches on ``device``."""
    if is_causal_lm(read_config(directory)):
        return _load_causal_lm(directory, settings, data, device, model_device)
    model, tokenizer = load_checkpoint(directory, model_device or device, dtype=settings.dtype)
    batch_args = dict(max_length=settings.max_length, device=device)
    batches: List[Batch] = load_batches(
        data,
        model,
        tokenizer,
        batch_size=settings.batch_size,
        max_examples=settings.max_examples,
        **batch_args,
    )

    def error_on(path: str) -> float:
        split = load_batches(path, model, tokenizer, batch_size=settings.batch_size, **batch_args)
        return error_rate(model, split)

    regression = is_regression(model.config)
    return _LoadedCheckpoint(
        model, batches, classification_loss(regression), None if regression else error_on
    )


def _causal_lm_text(path: str, where: str) -> None:
    if Path(path).suffix.lower() in TEXT_SUFFIXES + ARRAY_SUFFIXES:
        raise InputError(
            f"{where}: a causal LM is measured on plain text (its next-token loss), not on "
            f"{Path(path).suffix} examples; give a text file, e.g. train.txt"
        )


def _load_causal_lm(
    directory: str,
    settings: StudySettings,
    data: str,
    device: torch.device,
    model_device: Optional[torch.device] = None,
) -> _LoadedCheckpoint:
    """A causal LM: next-token loss on ``settings.max_examples`` blocks of
    ``settings.max_length`` tokens of the text ``data``, drawn with seed 0; the error
    rate is the next-token error over every block of a text."""
    _causal_lm_text(data, f"data {data}")
    model, tokenizer = load_causal_lm(directory, model_device or device, dtype=settings.dtype)
    batches = load_text_batches(
        data,
        model,
        tokenizer,
        block_size=settings.max_length,
        batch_size=settings.batch_size,
        max_blocks=settings.max_examples,
        seed=0,
        device=device,
        where=f"data {data}",
    )

    def error_on(path: str) -> float:
        _causal_lm_text(path, f"text {path}")
        blocks = load_text_blocks(path, model, tokenizer, settings.max_length)
        split = [({"input_ids": ids}, ids) for ids in blocks.to(device).split(settings.batch_size)]
        return next_token_error(model, split)

    return _LoadedCheckpoint(model, batches, next_token_loss, error_on)


def _load_model_soups(
    path: str, settings: StudySettings, data: str, device: torch.device, workers: int
) -> _LoadedCheckpoint:
    """A model-soups CLIP ``*.pt``; data are ``ImageFolder`` trees, preprocessed as CLIP's.

    The sharpness examples are ``settings.max_examples`` images of ``data`` drawn with a
    fixed seed; error rates are over every image of a folder.
    """
    from ..images import image_batches, iter_image_batches, read_image_folder
    from ..model_soups import load_model_soups_checkpoint

    model = load_model_soups_checkpoint(path, device)
    size, classes = model.architecture.image_size, model.architecture.num_classes

    def folder(root: str):
        found = read_image_folder(root)
        if len(found.classes) != classes:
            raise InputError(
                f"images {root}: {len(found.classes)} class directories, but checkpoint "
                f"{path} has {classes} classes (labels are the sorted class directories: "
                "every class needs its directory, an empty one is fine)"
            )
        return found

    folder(data)
    batches = image_batches(
        data,
        size,
        batch_size=settings.batch_size,
        max_examples=settings.max_examples,
        device=device,
        workers=workers,
    )

    def error_on(root: str) -> float:
        split = iter_image_batches(
            folder(root), size, batch_size=settings.batch_size, device=device, workers=workers
        )
        return error_rate(model, split)

    return _LoadedCheckpoint(model, batches, classification_loss(False), error_on)


def measure_checkpoint(
    checkpoint: str,
    settings: StudySettings,
    data: str,
    train_data: Optional[str],
    test_data: Optional[str],
    device: torch.device,
    on_measure: Callable[[str], None],
    format: str = "hf",
    workers: int = 0,
    scales: Sequence[Tuple[float, str]] = ((1.0, ""),),
    on_record: Optional[Callable[[Dict[str, Any]], None]] = None,
    joint: Optional[JointModels] = None,
) -> List[Dict[str, Any]]:
    """Load one checkpoint, measure its sharpness (and its gap when train/test are given).

    ``scales``: ``(scale, fingerprint)`` pairs, increasing; one record per pair, in that
    order, each with the measures at ``scale`` times the radii of ``settings`` on the same
    batches. Several scales are measured in one call per measure, on the monotone grid
    (:func:`measure_model_over_scales`). Records at a scale other than 1 have a ``scale``
    key. ``on_record`` receives each record once all are measured. With ``joint`` the
    model is prepared (sharded) before anything is measured.
    """
    start = time.perf_counter()
    if format == "model-soups":
        loaded = _load_model_soups(checkpoint, settings, data, device, workers)
    else:
        model_device = None if joint is None else torch.device(joint.load_device)
        loaded = _load_hf(checkpoint, settings, data, device, model_device)
    model, batches, plans = loaded.model, loaded.batches, None
    record: Dict[str, Any] = {
        "checkpoint": Path(checkpoint).name,
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "signature": checkpoint_signature(checkpoint),
    }
    if joint is not None:  # sharded in place: error_on measures the sharded model
        batches, plans = joint.prepare(model, batches, settings)
    if train_data is not None and test_data is not None:
        if loaded.error_on is None:
            raise InputError(f"checkpoint {checkpoint}: error rates need a classifier")
        splits = (("train", train_data), ("test", test_data))
        errors = {split: loaded.error_on(path) for split, path in splits}
        record.update(
            train_error=errors["train"],
            test_error=errors["test"],
            gap=errors["test"] - errors["train"],
        )
    if len(scales) == 1:
        ((scale, _),) = scales
        per_scale = [
            measure_model(
                model,
                loaded.loss_fn,
                batches,
                scaled_settings(settings, scale),
                probe_inputs=batches[0][0],
                on_measure=on_measure,
                plans=plans,
            )
        ]
    else:
        per_scale = measure_model_over_scales(
            model,
            loaded.loss_fn,
            batches,
            settings,
            [scale for scale, _ in scales],
            probe_inputs=batches[0][0],
            on_measure=_with_scales(on_measure, len(scales)),
            plans=plans,
        )
    seconds = (time.perf_counter() - start) / len(scales)
    records = []
    for (scale, study), measures in zip(scales, per_scale):
        finished = dict(record, plan=measures.pop("_plan", {}), measures=measures)
        finished["seconds"] = seconds
        finished["fingerprint"] = study
        if scale != 1:
            finished["scale"] = scale
        if on_record is not None:
            on_record(finished)
        records.append(finished)
    return records


def _with_scales(on_measure: Callable[[str], None], count: int) -> Callable[[str], None]:
    return lambda measure: on_measure(f"{measure} at {count} radii")


# ---------------------------------------------------------------- statistics
def tau_table(
    values: Mapping[str, Sequence[float]],
    gaps: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Dict[str, Dict[str, Any]]:
    """Per measure: Kendall tau, its p-value and a bootstrap confidence interval over models.

    Each row also has ``warning``: :func:`few_models_warning` (None from
    :data:`MIN_MODELS` models on).

    Parameters
    ----------
    values : dict of str to sequence of float
        Per measure, the sharpness of each model.
    gaps : sequence of float
        The generalization gap of each model, in the same order.
    resamples : int
        Bootstrap resamples (default 2000).
    confidence : float
        Coverage of the interval (default 0.95).
    seed : int
        Seed of the bootstrap.

    Returns
    -------
    dict
        Per measure: ``tau``, ``p_value``, ``ci_low``, ``ci_high``, ``models`` and
        ``warning``.
    """
    table = {}
    warning = few_models_warning(len(gaps))
    for measure, column in values.items():
        tau, p_value = kendall_tau(column, gaps)
        _, low, high = kendall_tau_bootstrap(
            column, gaps, resamples=resamples, confidence=confidence, seed=seed
        )
        table[measure] = {
            "tau": tau,
            "p_value": p_value,
            "ci_low": low,
            "ci_high": high,
            "models": len(gaps),
            "warning": warning,
        }
    return table


def format_tau_table(table: Mapping[str, Mapping[str, Any]], confidence: float = 0.95) -> str:
    """Plain-text tau table with the bootstrap interval, beside the paper's Table 1.

    Rows with a ``warning`` (too few models) have ``!`` beside tau, and the warning is
    printed under the table.

    Parameters
    ----------
    table : dict
        The result of :func:`tau_table`.
    confidence : float
        The interval's coverage, for the column header (default 0.95).

    Returns
    -------
    str
        The table, lines joined by newlines.
    """
    papers = list(PAPER_TAU)
    width = max(len("measure"), *map(len, table)) + 2
    warnings = list(dict.fromkeys(r["warning"] for r in table.values() if r.get("warning")))
    gap = "  " if warnings else ""
    ci = f"{round(100 * confidence)}% CI"
    head = f"{'measure':<{width}}{'tau':>8}{gap}{ci:>18}{'p':>9}" + "".join(
        f"{'paper: ' + p.split(',')[0]:>17}" for p in papers
    )
    lines = [head, "-" * len(head)]
    for measure, row in table.items():
        interval = f"[{row['ci_low']:+.2f}, {row['ci_high']:+.2f}]"
        mark = " !" if row.get("warning") else gap
        line = f"{measure:<{width}}{row['tau']:>+8.3f}{mark}{interval:>18}{row['p_value']:>9.2g}"
        for paper in papers:
            reference = PAPER_TAU[paper].get(measure)
            line += f"{'—' if reference is None else f'{reference:+.2f}':>17}"
        lines.append(line)
    lines += [f"! {w}" for w in warnings]
    return "\n".join(lines)


def scatter_figure(
    models: Sequence[Mapping[str, Any]], measures: Sequence[str], path: str, title: str = ""
) -> str:
    """Sharpness (x, log scale) against generalization gap (y), one panel per measure.

    Parameters
    ----------
    models : sequence of dict
        Per model, ``gap`` and ``measures[name]["value"]`` (the records of a study).
    measures : sequence of str
        The measures to plot, one panel each.
    path : str
        Where to write the PNG.
    title : str
        Title of the figure (default none).

    Returns
    -------
    str
        ``path``.
    """
    gaps = [m["gap"] for m in models]
    panels = {name: [m["measures"][name]["value"] for m in models] for name in measures}
    return sharpness_scatter(
        panels,
        gaps,
        path,
        ylabel="generalization gap (test - train error)",
        title=title or None,
        log_x=True,
    )


# ---------------------------------------------------------------- the population
def _process_grid() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _rounds(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _gather(record: Optional[Dict[str, Any]], world: int) -> List[Optional[Dict[str, Any]]]:
    if world == 1:
        return [record]
    import torch.distributed as dist

    shards: List[Any] = [None] * world
    dist.all_gather_object(shards, record)
    return shards


def _input_digest(path: str) -> str:
    """:func:`file_digest` of a data file, or the digest of an image folder's listing."""
    if Path(path).is_dir():
        from ..images import folder_digest

        return folder_digest(path)
    return file_digest(path)


def study_fingerprint(
    settings: StudySettings,
    data: str,
    train_data: Optional[str],
    test_data: Optional[str],
    format: str = "hf",
    grid: Optional[Sequence[float]] = None,
) -> str:
    """The fingerprint of a study's records: settings, data, format, and for a radius grid
    its scales (a value at one scale depends on the smaller ones: records of one grid are
    not those of another, nor of a study at that scale alone)."""
    files = {"data": data, "train": train_data, "test": test_data}
    digests = {k: _input_digest(v) for k, v in files.items() if v is not None}
    recorded = asdict(settings)
    if recorded["dtype"] == "auto":  # as before the option: resumable
        del recorded["dtype"]
    study = {"settings": recorded, "files": digests}
    if format != "hf":  # fingerprints of Hugging Face runs stay as they were
        study["format"] = format
    if grid is not None:
        study["rho_grid"] = [float(s) for s in grid]
    return fingerprint(study)


def run_population(
    checkpoints: Sequence[str],
    data: str,
    settings: StudySettings,
    *,
    gaps: Optional[Mapping[str, float]] = None,
    train_data: Optional[str] = None,
    test_data: Optional[str] = None,
    records: Optional[RecordFile] = None,
    device: torch.device | str = "cpu",
    progress: bool = False,
    resamples: int = 2000,
    format: str = "hf",
    workers: int = 0,
    rho_scales: Optional[Sequence[float]] = None,
    joint: Optional[JointModels] = None,
) -> Dict[str, Any]:
    """Measure every checkpoint and correlate each measure with the generalization gap.

    Parameters
    ----------
    checkpoints : sequence of str
        Checkpoints (see :func:`find_checkpoints`); names must be unique.
    data : str
        The sharpness examples, the same for all: ``.jsonl`` text or ``.npz`` arrays
        (``format="hf"``; plain text for causal LMs, whose loss is the next-token loss on
        ``settings.max_examples`` blocks of ``settings.max_length`` tokens drawn with seed
        0, and whose error rate is the next-token error,
        :mod:`~geoopt_quotient.experiments.causal_lm`), or an ``ImageFolder`` directory
        (``format="model-soups"``: ``settings.max_examples`` of its images, drawn with a
        fixed seed).
    settings : StudySettings
        The measures, radii and Auto-PGD options.
    gaps : mapping, optional
        Checkpoint name -> generalization gap. Without it, ``train_data`` and
        ``test_data`` are required and each gap is measured: test error - train error.
    train_data, test_data : str, optional
        The examples on which each model's train and test error are measured (same
        formats as ``data``); used when ``gaps`` is not given.
    records : RecordFile, optional
        Finished models are appended as they finish; records there with the same
        settings, data and checkpoint weights are reused (resume).
    device : torch device
        Where the models and batches are put.
    progress : bool
        Progress over models: a bar on a terminal (the current measure in its postfix),
        else a line every 10% (:func:`~geoopt_quotient._progress.progress_bar`).
    resamples : int
        Bootstrap resamples of the tau confidence intervals.
    format : {"hf", "model-soups"}
        Hugging Face checkpoint directories with data files, or model-soups CLIP state
        dicts (:mod:`geoopt_quotient.experiments.model_soups`) with ``ImageFolder`` directories
        for ``data``, ``train_data`` and ``test_data``.
    workers : int
        Processes decoding images (``format="model-soups"``; 0: the main process).
    rho_scales : sequence of float, optional
        Also measure every model at these multiples :math:`s` of every radius
        (:func:`scaled_settings`; scale 1 is always measured), on the same batches, all
        of a model's scales in one call per measure on the monotone radius grid
        (:func:`measure_model_over_scales`: values never decrease with the scale). Each
        (model, scale) is a record of its own; a resumed run reuses the models whose
        every scale was measured on the same grid, and measures the others again.
    joint : JointModels, optional
        Every process measures every model together, each model sharded over the
        processes by ``joint.prepare`` (``format="hf"`` only), instead of the models
        being shared out over the processes.

    Raises
    ------
    InputError
        For inputs that cannot be used. An exception raised while one model is measured
        carries the note ``while measuring model 'NAME'`` (Python 3.11 and later).

    Returns
    -------
    dict
        ``settings``, ``models`` (per checkpoint: gap, per-measure values and losses,
        seconds), ``tau`` (per measure: tau, p-value, CI, warning), ``warning``
        (:func:`few_models_warning`, None from :data:`MIN_MODELS` models on),
        ``paper_tau``, ``timings``, ``processes``. With ``torch.distributed``
        initialised the models are shared out over the ranks (model ``i`` of each round
        of ``world_size`` on rank ``i``; with ``joint``, every rank measures every model)
        and every rank returns the same document. With
        ``rho_scales`` also: ``rho_scales`` (the scales measured, 1 included), per model
        ``by_scale`` (scale as text, e.g. ``"3"`` -> that scale's ``measures``),
        ``tau_by_rho`` (the records of
        :func:`~geoopt_quotient.experiments.population.rho_grid.tau_by_rho`, one per
        (scale, measure, path)) and ``sharpness_to_clean_loss``
        (:func:`sharpness_to_clean_loss`). Everything else is the study at scale 1.
    """
    start = time.perf_counter()
    check_choice(format, FORMATS, "format")
    names = [Path(c).name for c in checkpoints]
    if len(set(names)) != len(names):
        raise InputError("checkpoint names must be unique")
    if gaps is None and (train_data is None or test_data is None):
        raise InputError("give the gaps (a CSV), or train and test data to measure them")
    device = torch.device(device)
    scales = study_scales(rho_scales)
    grid = list(scales) if len(scales) > 1 else None
    studies = {
        scale: study_fingerprint(
            scaled_settings(settings, scale), data, train_data, test_data, format, grid
        )
        for scale in scales
    }
    done = _finished_records(records, checkpoints, studies)
    world, rank = _process_grid()
    if joint is not None and format != "hf":
        raise InputError(f"models of format {format!r} cannot be measured jointly")
    measure = functools.partial(
        measure_checkpoint,
        settings=settings,
        data=data,
        train_data=train_data,
        test_data=test_data,
        device=device,
        format=format,
        workers=workers,
        joint=joint,
    )
    _measure_missing(
        checkpoints, scales, studies, done, measure, records, joint, progress and rank == 0
    )
    models = _model_records(names, done, gaps, scales if rho_scales is not None else None)
    gap_values = [m["gap"] for m in models]
    by_rho = {}
    if rho_scales is not None:
        by_rho = {
            "rho_scales": list(scales),
            "tau_by_rho": _tau_by_rho_records(models, settings, scales, gap_values, resamples),
            "sharpness_to_clean_loss": sharpness_to_clean_loss(models, settings, scales),
        }
    return {
        "settings": asdict(settings),
        "data": {"sharpness": data, "train": train_data, "test": test_data},
        "gap_source": "measured" if gaps is None else "given",
        "format": format,
        "models": models,
        **study_summary(models, settings, resamples),
        "timings": {"total": time.perf_counter() - start},
        "processes": world,
        **by_rho,
    }


def _measure_missing(
    checkpoints: Sequence[str],
    scales: Sequence[float],
    studies: Mapping[float, str],
    done: Dict[Tuple[str, float], Dict[str, Any]],
    measure: Callable[..., List[Dict[str, Any]]],
    records: Optional[RecordFile],
    joint: Optional[JointModels],
    progress: bool,
) -> None:
    """Measure every checkpoint that lacks a record at some scale, and add its records to
    ``done``: the models are shared out over the processes in rounds (model ``i`` of each
    round on rank ``i``), or, with ``joint``, every process measures every model.

    ``measure(checkpoint, on_measure=, scales=, on_record=)`` is
    :func:`measure_checkpoint` with the study's other arguments.
    """
    world, rank = _process_grid()
    # the processes over which the models are shared out: one, when all measure each
    shares = 1 if joint is not None else world
    todo = [c for c in checkpoints if any((Path(c).name, s) not in done for s in scales)]
    append_now = records is not None and shares == 1 and rank == 0
    bar = progress_bar(
        total=len(checkpoints),
        initial=len(done),
        desc="models",
        unit="model",
        show=progress,
        dynamic_ncols=True,
    )
    with bar:
        for round_ in _rounds(todo, shares):
            share = rank if shares > 1 else 0
            mine = round_[share] if share < len(round_) else None
            record = None
            if mine is not None:
                name = Path(mine).name
                try:
                    record = measure(
                        mine,
                        on_measure=lambda m, name=name: bar.set_postfix_str(f"{name}: {m}"),
                        # a grid's values depend on all its radii: a model measures all or none
                        scales=tuple((s, studies[s]) for s in scales),
                        on_record=records.append if append_now else None,
                    )
                except Exception as error:
                    if hasattr(error, "add_note"):  # Python >= 3.11
                        error.add_note(f"while measuring model {name!r}")
                    raise
            for finished in _gather(record, shares):
                if finished is None:
                    continue
                for one in finished:
                    done[one["checkpoint"], float(one.get("scale", 1.0))] = one
                    if records is not None and shares > 1 and rank == 0:
                        records.append(one)
                bar.update(1)


def _model_records(
    names: Sequence[str],
    done: Mapping[Tuple[str, float], Dict[str, Any]],
    gaps: Optional[Mapping[str, float]],
    scales: Optional[Sequence[float]],
) -> List[Dict[str, Any]]:
    """Each model's record at scale 1, with its given gap and, with ``scales``, its
    ``by_scale`` measures."""
    models = []
    for name in names:
        model = dict(done[name, 1.0])
        model.pop("scale", None)
        if gaps is not None:
            model["gap"] = float(gaps[name])
        if scales is not None:
            model["by_scale"] = {f"{s:g}": done[name, s]["measures"] for s in scales}
        models.append(model)
    return models


def study_summary(
    models: Sequence[Mapping[str, Any]], settings: StudySettings, resamples: int
) -> Dict[str, Any]:
    """``tau`` (:func:`tau_table` of every measure against the models' ``gap``),
    ``warning`` (:func:`few_models_warning`) and ``paper_tau``: the summary of a study's
    model records, in the study's measures' order."""
    gaps = [m["gap"] for m in models]
    values = {m: [r["measures"][m]["value"] for r in models] for m in settings.measures}
    return {
        "tau": tau_table(values, gaps, resamples=resamples, seed=settings.seed),
        "warning": few_models_warning(len(models)),
        "paper_tau": PAPER_TAU,
    }


def _finished_records(
    records: Optional[RecordFile], checkpoints: Sequence[str], studies: Mapping[float, str]
) -> Dict[Tuple[str, float], Dict[str, Any]]:
    """(name, scale) -> the record of a finished model at that scale: same settings (radii
    scaled), same data, same checkpoint weights."""
    done: Dict[Tuple[str, float], Dict[str, Any]] = {}
    if records is None:
        return done
    directories = {Path(c).name: c for c in checkpoints}
    signatures: Dict[str, Any] = {}
    for scale, study in studies.items():
        for record in records.select(fingerprint=study):
            name = record.get("checkpoint")
            if name not in directories:
                continue
            if name not in signatures:
                signatures[name] = checkpoint_signature(directories[name])
            if record.get("signature") == signatures[name]:
                done[name, scale] = record
    return done


def _tau_by_rho_records(
    models: Sequence[Mapping[str, Any]],
    settings: StudySettings,
    scales: Sequence[float],
    gaps: Sequence[float],
    resamples: int,
) -> List[Dict[str, Any]]:
    """The ``tau_by_rho`` records: one per (scale, measure, path), against the gaps."""
    series = [
        RhoSeries(
            scale,
            measure_radius(scaled_settings(settings, scale), measure),
            measure,
            measure_path(settings, measure),
            [m["by_scale"][f"{scale:g}"][measure]["value"] for m in models],
        )
        for measure in settings.measures
        for scale in scales
    ]
    return tau_by_rho(series, gaps, resamples=resamples, seed=settings.seed)


def sharpness_to_clean_loss(
    models: Sequence[Mapping[str, Any]], settings: StudySettings, scales: Sequence[float]
) -> List[Dict[str, Any]]:
    r"""Which regime each scale is in: mean sharpness over mean clean loss, per measure.

    For every (scale, measure): :math:`\bar s / \bar L`, the mean over models of the
    sharpness value over the mean over models of the clean loss on the sharpness batches
    (the same batches for every measure). Well below 1 the perturbation is a small change
    of the loss; well above 1 it dominates it.

    Returns
    -------
    list of dict
        ``{"scale", "rho", "measure", "mean_sharpness", "mean_clean_loss", "ratio"}``.
    """
    rows = []
    for scale in scales:
        for measure in settings.measures:
            entries = [m["by_scale"][f"{scale:g}"][measure] for m in models]
            sharpness = float(np.mean([e["value"] for e in entries]))
            clean = float(np.mean([e["clean_loss"] for e in entries]))
            rows.append(
                {
                    "scale": scale,
                    "rho": measure_radius(scaled_settings(settings, scale), measure),
                    "measure": measure,
                    "mean_sharpness": sharpness,
                    "mean_clean_loss": clean,
                    "ratio": sharpness / clean if clean > 0 else math.inf,
                }
            )
    return rows
