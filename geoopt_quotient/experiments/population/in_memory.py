r"""A population study of models in memory: the CLI's study without checkpoints on disk.

:func:`measure_population` takes the models (or factories that build them), a
``loss_fn``, the sharpness batches and the generalization gaps, and returns the document
of :func:`~geoopt_quotient.experiments.population.run_population`: per model the
sharpness of every measure, per measure Kendall's :math:`\tau` against the gaps with its
bootstrap interval. With ``out`` it also writes the same files as the ``population``
command (figure, JSON, CSV tables) and keeps a record per finished model, so that an
interrupted study resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

from ..._progress import progress_bar
from ...integrations.monitor import model_device, to_device
from ..records import RecordFile, fingerprint
from .report import write_population_files
from .study import StudySettings, measure_model, study_summary

__all__ = ["measure_population"]

ModelOrFactory = Union[torch.nn.Module, Callable[[], torch.nn.Module]]


def measure_population(
    models: Union[Mapping[str, ModelOrFactory], Sequence[ModelOrFactory]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[Any],
    gaps: Union[Mapping[str, float], Sequence[float]],
    settings: Optional[StudySettings] = None,
    *,
    out: Optional[Union[str, Path]] = None,
    resume: bool = False,
    label: str = "",
    probe_inputs: Any = None,
    resamples: int = 2000,
    progress: bool = False,
) -> Dict[str, Any]:
    r"""Sharpness of every model, and Kendall's :math:`\tau` of each measure against the gaps.

    For models :math:`i = 1, \dots, M` with sharpness :math:`s_i` (one measure) and
    generalization gaps :math:`g_i`,

    .. math::

        \tau = \frac{2}{M(M-1)} \sum_{i<j} \operatorname{sign}(s_i - s_j)\,
            \operatorname{sign}(g_i - g_j),

    with a percentile bootstrap interval over models, per measure of ``settings``
    (:func:`~geoopt_quotient.experiments.population.tau_table`). Every model is measured
    on the same ``batches`` with the same seed
    (:func:`~geoopt_quotient.experiments.population.measure_model`).

    Parameters
    ----------
    models : mapping of str to model or factory, or sequence
        The models by name (a sequence is named ``model_0``, ``model_1``, ...). A
        callable that is not a module is a factory, called when its model is measured,
        so that one model at a time lives in memory.
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``, the same for every model.
    batches : sequence
        The sharpness batches, the same for every model (moved to each model's device).
    gaps : mapping of str to float, or sequence of float
        The generalization gap of each model (test error minus train error), by name or
        in the order of ``models``.
    settings : StudySettings or None
        Measures, radii and Auto-PGD options (``batch_size``, ``max_examples`` and
        ``max_length`` are not used: the batches are given); ``None``: the defaults.
    out : str or path-like, optional
        Directory for ``population-records.jsonl`` (one record per finished model) and,
        at the end, the files of the ``population`` command: ``population.png``,
        ``population.json``, ``population.csv``, ``population-tau.csv``
        (:func:`~geoopt_quotient.experiments.population.report.write_population_files`;
        the figure needs matplotlib).
    resume : bool
        Reuse the records in ``out`` of models with the same name and weights, measured
        with the same settings on the same batches (``loss_fn`` is identified by its
        qualified name only). A factory is called to check its weights.
    label : str
        What the models are, for the figure's title (default: ``"M models"``).
    probe_inputs : object
        Inputs for the symmetry check (``settings.verify``), as for
        :func:`~geoopt_quotient.find_symmetries`; ``None`` builds them from the model's
        config (Hugging Face models); give them, or ``verify=False``, for other models.
    resamples : int
        Bootstrap resamples of the tau intervals.
    progress : bool
        A progress bar over models (a line every 10% when not on a terminal).

    Returns
    -------
    dict
        ``settings``, ``models`` (per model: ``checkpoint`` (its name), ``gap``,
        ``measures``, ``plan``, ``seconds``), ``tau``, ``warning``, ``paper_tau``,
        ``timings``, ``gap_source`` ``"given"``; with ``out`` also the paths
        ``figure``, ``tables``. :func:`.report.population_rows` and
        :func:`.report.population_frames` make tables of it.

    Raises
    ------
    ValueError
        For names given twice, a gap missing or not finite, or fewer than 3 models.

    Examples
    --------
    >>> import torch
    >>> from geoopt_quotient.experiments.population import StudySettings, measure_population
    >>> def factory(width):
    ...     def build():
    ...         torch.manual_seed(width)
    ...         return torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.Tanh(),
    ...                                    torch.nn.Linear(width, 1))
    ...     return build
    >>> batch = torch.randn(8, 2), torch.randn(8, 1)
    >>> def loss_fn(model, batch):
    ...     return torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    >>> document = measure_population(
    ...     {f"w{w}": factory(w) for w in (2, 4, 8)}, loss_fn, [batch], [0.1, 0.2, 0.3],
    ...     StudySettings(iters=2, verify=False), resamples=50)
    >>> sorted(document["tau"]), document["models"][0]["checkpoint"]
    (['adaptive', 'geodesic_inv', 'geodesic_mix'], 'w2')
    """
    start = time.perf_counter()
    settings = StudySettings() if settings is None else settings
    named = _named_models(models)
    gap_of = _named_gaps(gaps, list(named))
    study = fingerprint(
        {
            "settings": asdict(settings),
            "batches": _digest(batches),
            "loss_fn": getattr(loss_fn, "__qualname__", type(loss_fn).__name__),
            "in_memory": True,
        }
    )
    records = (
        None if out is None else RecordFile(Path(out) / "population-records.jsonl", resume=resume)
    )
    done = (
        {} if records is None else {r["checkpoint"]: r for r in records.select(fingerprint=study)}
    )
    bar = progress_bar(total=len(named), desc="models", unit="model", show=progress)
    finished = []
    with bar:
        for name, source in named.items():
            model = source if isinstance(source, torch.nn.Module) else source()
            signature = _digest(dict(model.state_dict()))
            record = done.get(name)
            if record is None or record.get("signature") != signature:
                record = _measure(name, model, signature, loss_fn, batches, settings, probe_inputs)
                record["fingerprint"] = study
                if records is not None:
                    records.append(record)
            finished.append({**record, "gap": gap_of[name]})
            del model
            bar.update(1)
    document: Dict[str, Any] = {
        "settings": asdict(settings),
        "gap_source": "given",
        "models": finished,
        **study_summary(finished, settings, resamples),
        "timings": {"total": time.perf_counter() - start},
    }
    if out is not None:
        write_population_files(document, out, "population", label or f"{len(finished)} models")
    return document


def _measure(
    name: str,
    model: torch.nn.Module,
    signature: str,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Sequence[Any],
    settings: StudySettings,
    probe_inputs: Any,
) -> Dict[str, Any]:
    start = time.perf_counter()
    device = model_device(model)
    on_device = [to_device(b, device) for b in batches]
    try:
        measures = measure_model(model, loss_fn, on_device, settings, probe_inputs=probe_inputs)
    except Exception as error:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"while measuring model {name!r}")
        raise
    return {
        "checkpoint": name,
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "signature": signature,
        "plan": measures.pop("_plan", {}),
        "measures": measures,
        "seconds": time.perf_counter() - start,
    }


def _named_models(models: Any) -> Dict[str, ModelOrFactory]:
    if isinstance(models, Mapping):
        named = dict(models)
    else:
        named = {f"model_{i}": m for i, m in enumerate(models)}
    if len(named) < 3:
        raise ValueError(f"a population study needs at least 3 models, got {len(named)}")
    return named


def _named_gaps(gaps: Any, names: Sequence[str]) -> Dict[str, float]:
    if isinstance(gaps, Mapping):
        missing = [n for n in names if n not in gaps]
        if missing:
            raise ValueError(f"no gap for {', '.join(missing)}")
        values = {n: float(gaps[n]) for n in names}
    else:
        gaps = list(gaps)
        if len(gaps) != len(names):
            raise ValueError(f"{len(gaps)} gaps for {len(names)} models")
        values = {n: float(g) for n, g in zip(names, gaps)}
    bad = [n for n, g in values.items() if not torch.isfinite(torch.tensor(g))]
    if bad:
        raise ValueError(f"the gaps of {', '.join(bad)} are not finite")
    return values


def _digest(value: Any) -> str:
    """SHA-256 (16 hex digits) of the tensors in ``value`` (nested in mappings, lists,
    tuples; their keys, shapes, dtypes and bytes) and of the other leaves' ``repr``."""
    digest = hashlib.sha256()
    _update(digest, value)
    return digest.hexdigest()[:16]


def _update(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{tuple(value.shape)}{value.dtype}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in value:
            digest.update(repr(key).encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _update(digest, item)
    else:
        digest.update(repr(value).encode())
