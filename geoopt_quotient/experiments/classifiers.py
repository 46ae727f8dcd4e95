"""Local Hugging Face classifier checkpoints and their data: safe loading, batches, loss, error.

A checkpoint is a directory with ``config.json``, safetensors weights (pickled
``pytorch_model.bin`` files are never loaded) and, for text models, a tokenizer. Nothing
is downloaded. Two data formats:

* ``.jsonl`` text, one ``{"text", optional "text_pair", "label"}`` object per line, for
  ``...ForSequenceClassification`` models (tokenised by each model's own tokenizer);
* ``.npz`` arrays (read with ``allow_pickle=False``): ``labels`` plus the model's input
  tensors by keyword, e.g. ``pixel_values`` for ``...ForImageClassification`` models.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import GeooptQuotientError
from ._architectures import is_causal_lm

__all__ = [
    "Batch",
    "InputError",
    "check_checkpoint",
    "classification_loss",
    "error_rate",
    "is_regression",
    "load_arrays",
    "load_batches",
    "load_checkpoint",
    "load_examples",
    "load_pretrained",
    "load_tokenizer",
    "make_batches",
    "read_config",
    "text_lines",
    "torch_dtype",
]

Batch = Tuple[Dict[str, torch.Tensor], torch.Tensor]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
TEXT_SUFFIXES = (".jsonl", ".json")
#: The ``dtype`` choices of the loaders (``--dtype`` of the commands): ``"auto"`` keeps
#: the checkpoint's own dtype (``config.json``'s ``dtype``).
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
ARRAY_SUFFIXES = (".npz",)


class InputError(GeooptQuotientError, ValueError):
    """A problem with a checkpoint directory or a data file; the message says which and why."""


# ---------------------------------------------------------------- checkpoints
def _is_image_classifier(config: Any) -> bool:
    return any(a.endswith("ForImageClassification") for a in config.architectures or ())


def check_checkpoint(directory: str, *, where: Optional[str] = None) -> None:
    """Raise :class:`InputError` unless ``directory`` has a config and safetensors weights.

    Parameters
    ----------
    directory : str
        The checkpoint directory.
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).

    Raises
    ------
    InputError
        If ``directory`` is not a directory, has no ``config.json``, or no
        ``model.safetensors`` weights (pickled weights are named, never loaded).
    """
    where = where or f"checkpoint {directory}"
    if not os.path.isdir(directory):
        raise InputError(f"{where}: not a directory")
    files = set(os.listdir(directory))
    if "config.json" not in files:
        raise InputError(f"{where}: no config.json (not a Hugging Face checkpoint)")
    if not files & set(WEIGHT_FILES):
        pickles = sorted(files & set(PICKLE_FILES))
        extra = (
            f" (found {', '.join(pickles)}: pickled weights are never loaded; re-save with "
            "save_pretrained(dir, safe_serialization=True))"
            if pickles
            else "; save the model with save_pretrained(dir, safe_serialization=True)"
        )
        raise InputError(f"{where}: no model.safetensors weights{extra}")


def _check_tokenizer(directory: str, where: str) -> None:
    if not set(os.listdir(directory)) & set(TOKENIZER_FILES):
        raise InputError(
            f"{where}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)}); "
            "save one with tokenizer.save_pretrained(dir)"
        )


def torch_dtype(name: str | torch.dtype) -> str | torch.dtype:
    """A load dtype: one of ``DTYPES`` (or a ``torch.dtype``) as ``from_pretrained``
    takes it.

    Parameters
    ----------
    name : str or torch.dtype
        ``"auto"`` (the checkpoint's own dtype), ``"float32"``, ``"float64"``,
        ``"bfloat16"`` or ``"float16"``, or a floating-point ``torch.dtype``.

    Returns
    -------
    str or torch.dtype
        ``"auto"``, or the ``torch.dtype``.

    Raises
    ------
    ValueError
        For any other name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return name if name == "auto" else getattr(torch, name)


def _missing_weights_advice(model: torch.nn.Module, config: Any) -> str:
    """What to do about a checkpoint without some weights of ``model``'s class."""
    saved = [a for a in config.architectures or () if a != type(model).__name__]
    if saved:
        what = "a causal LM" if is_causal_lm(config) else "a different model"
        hint = (
            "measure its next-token loss on a text file instead ('geoopt-quotient "
            "sharpness --text FILE', or geoopt_quotient.experiments.causal_lm in Python)"
            if is_causal_lm(config)
            else f"load it as a {saved[0]}"
        )
        return f"the checkpoint is {what} ({', '.join(saved)}): {hint}"
    return (
        "save the trained model with all its weights (model.save_pretrained(dir)) and measure that"
    )


#: transformers' loggers that report on a load: the "LOAD REPORT" table of missing and
#: unused weights, and (when that logger is quieted) the tensor-parallel plan check.
LOAD_LOGGERS = ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")


@contextlib.contextmanager
def _without_load_report() -> Iterator[None]:
    """A block in which transformers logs no report on a load (:data:`LOAD_LOGGERS`):
    :func:`load_pretrained` reads the same information and refuses what matters, in one
    line."""
    loggers = [logging.getLogger(name) for name in LOAD_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def load_pretrained(
    auto_class: Any,
    directory: str,
    *,
    dtype: str | torch.dtype = "auto",
    where: Optional[str] = None,
) -> torch.nn.Module:
    """``auto_class.from_pretrained(directory)`` (safetensors, offline); refused when the
    checkpoint lacks weights that loading would initialise at random.

    ``from_pretrained`` fills the weights missing from a checkpoint (e.g. the ``score``
    head of a sequence classifier built from a causal LM) with fresh random values and
    succeeds; every sharpness of such a model would measure that noise, differently on
    every run. Weights tied to saved ones (a language-model head tied to the input
    embedding) are not missing.

    Parameters
    ----------
    auto_class : type
        A transformers auto class, e.g. ``AutoModelForSequenceClassification``.
    directory : str
        The checkpoint directory.
    dtype : str or torch.dtype
        The dtype of the loaded weights (:func:`torch_dtype`; default ``"auto"``, the
        checkpoint's own).
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).

    Returns
    -------
    torch.nn.Module
        The model (on the CPU, in the mode ``from_pretrained`` leaves it).

    Raises
    ------
    InputError
        If the model cannot be loaded, or the checkpoint has no weights for some of its
        parameters (named in the message, with what to do).
    """
    where = where or f"checkpoint {directory}"
    try:
        with _without_load_report():
            model, info = auto_class.from_pretrained(
                directory,
                use_safetensors=True,
                local_files_only=True,
                output_loading_info=True,
                dtype=torch_dtype(dtype),
            )
    except Exception as error:
        raise InputError(f"{where}: cannot load the model: {error}") from error
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        raise InputError(
            f"{where}: no weights for {shown} in the checkpoint; {type(model).__name__} would "
            "initialise them at random and measure noise (a different value on every run); "
            + _missing_weights_advice(model, model.config)
        )
    return model


def load_checkpoint(
    directory: str,
    device: torch.device | str = "cpu",
    *,
    where: Optional[str] = None,
    dtype: str | torch.dtype = "auto",
) -> Tuple[torch.nn.Module, Any]:
    """The classifier in eval mode (safetensors only, offline) and its tokenizer.

    Image classifiers (``config.architectures`` naming ``...ForImageClassification``)
    are loaded with ``AutoModelForImageClassification`` and need no tokenizer (``None``
    is returned); every other checkpoint is a sequence classifier with a tokenizer. A
    checkpoint without the classifier's head (e.g. a causal LM) is refused
    (:func:`load_pretrained`), never given a random one.

    Parameters
    ----------
    directory : str
        The checkpoint directory (:func:`check_checkpoint`).
    device : torch.device or str
        Where to put the model (default ``"cpu"``).
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).
    dtype : str or torch.dtype
        The dtype of the weights (:func:`torch_dtype`; default ``"auto"``, the
        checkpoint's own). Sharpness needs ``"float32"`` or better: a perturbation of a
        bfloat16 weight is rounded to 2^-8 of it.

    Returns
    -------
    model : torch.nn.Module
        The classifier, in eval mode on ``device``.
    tokenizer : object or None
        Its tokenizer, or ``None`` for an image classifier.

    Raises
    ------
    InputError
        If the checkpoint is incomplete or its config, tokenizer or weights cannot be
        loaded, or it lacks weights of the classifier.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    where = where or f"checkpoint {directory}"
    config = read_config(directory, where=where)
    image = _is_image_classifier(config)
    tokenizer = None if image else load_tokenizer(directory, where=where)
    auto = AutoModelForImageClassification if image else AutoModelForSequenceClassification
    model = load_pretrained(auto, directory, dtype=dtype, where=where)
    return model.to(device).eval(), tokenizer


def read_config(directory: str, *, where: Optional[str] = None) -> Any:
    """The ``config.json`` of a checkpoint directory (:func:`check_checkpoint` first).

    Parameters
    ----------
    directory : str
        The checkpoint directory.
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).

    Returns
    -------
    transformers.PretrainedConfig
        The config.

    Raises
    ------
    InputError
        If the directory is not a checkpoint or its config cannot be read.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    where = where or f"checkpoint {directory}"
    check_checkpoint(directory, where=where)
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as error:
        raise InputError(f"{where}: cannot read config.json: {error}") from error


def load_tokenizer(directory: str, *, where: Optional[str] = None) -> Any:
    """The tokenizer saved in a checkpoint directory (offline).

    Parameters
    ----------
    directory : str
        The checkpoint directory.
    where : str or None
        Prefix of the error messages (default ``"checkpoint DIR"``).

    Returns
    -------
    object
        The tokenizer (``AutoTokenizer``).

    Raises
    ------
    InputError
        If the directory has no tokenizer files or the tokenizer cannot be loaded.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    where = where or f"checkpoint {directory}"
    _check_tokenizer(directory, where)
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as error:
        raise InputError(f"{where}: cannot load the tokenizer: {error}") from error


def is_regression(config: Any) -> bool:
    """A one-output or ``problem_type="regression"`` model: mean squared error, no error rate.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (``num_labels``, ``problem_type``).

    Returns
    -------
    bool
        Whether the model is a regression model.
    """
    return int(config.num_labels) == 1 or config.problem_type == "regression"


# ---------------------------------------------------------------- text data (JSONL)
def _label(value: Any, config: Any, regression: bool, where: str) -> float | int:
    if regression:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{where}: regression label must be a number, got {value!r}")
        return float(value)
    num_labels = int(config.num_labels)
    if isinstance(value, str):
        label2id = {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
        if value in label2id:
            return label2id[value]
        if value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            names = ", ".join(sorted(label2id)) or "none"
            raise InputError(f"{where}: unknown label {value!r} (label names: {names})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: label must be an integer or a label name, got {value!r}")
    if not 0 <= value < num_labels:
        raise InputError(f"{where}: label {value} is outside [0, {num_labels})")
    return value


def _open(path: str, where: str):
    try:
        return open(path, "rb")
    except OSError as error:
        raise InputError(f"{where}: {error.strerror or error}") from error


def text_lines(path: str, where: str, expected: str = "JSON lines") -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file; an :class:`InputError` naming the
    line (as ``"WHERE, line N"``) at the first line that is not UTF-8.

    Parameters
    ----------
    path : str
        The file.
    where : str
        Prefix of the error messages.
    expected : str
        What the file should hold, for the messages (default ``"JSON lines"``).

    Yields
    ------
    number : int
        The line number, from 1.
    line : str
        The line, with its line ending.

    Raises
    ------
    InputError
        If the file cannot be opened, or at the first line that is not UTF-8.
    """
    with _open(path, where) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InputError(
                    f"{where}, line {number}: not UTF-8 text ({error.reason}); expected {expected}"
                ) from None


def _example(record: Any, config: Any, regression: bool, where: str) -> Dict[str, Any]:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("text", "label") if k not in record]
    if missing:
        raise InputError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    if not isinstance(record["text"], str):
        raise InputError(f"{where}: 'text' must be a string")
    pair = record.get("text_pair")
    if pair is not None and not isinstance(pair, str):
        raise InputError(f"{where}: 'text_pair' must be a string")
    label = _label(record["label"], config, regression, where)
    return {"text": record["text"], "text_pair": pair, "label": label}


def load_examples(
    path: str, config: Any, max_examples: Optional[int] = None, *, where: Optional[str] = None
) -> List[Dict[str, Any]]:
    """Read ``{"text", optional "text_pair", "label"}`` lines; errors name the line.

    Parameters
    ----------
    path : str
        The ``.jsonl`` file; blank lines are skipped.
    config : transformers.PretrainedConfig
        The model's config: labels may be label names (``label2id``) or class indices
        below ``num_labels``, or numbers for a regression model (:func:`is_regression`).
    max_examples : int or None
        Read at most this many examples (default all).
    where : str or None
        Prefix of the error messages (default ``"data PATH"``).

    Returns
    -------
    list of dict
        ``{"text", "text_pair", "label"}`` per example (``text_pair`` ``None`` when
        absent), labels as class indices or floats.

    Raises
    ------
    InputError
        For a line that is not JSON or lacks a field, an unknown or out-of-range
        label, ``text_pair`` on some lines only, or no examples.
    """
    where = where or f"data {path}"
    regression = is_regression(config)
    examples: List[Dict[str, Any]] = []
    for number, line in text_lines(path, path):
        if max_examples is not None and len(examples) >= max_examples:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}, line {number}: not valid JSON ({error.msg})") from error
        examples.append(_example(record, config, regression, f"{path}, line {number}"))
    if not examples:
        raise InputError(f"{where}: no examples")
    if len({e["text_pair"] is None for e in examples}) > 1:
        raise InputError(f"{where}: 'text_pair' must be given on every line or on none")
    return examples


def make_batches(
    examples: Sequence[Dict[str, Any]],
    tokenizer: Any,
    batch_size: int,
    max_length: int,
    device: torch.device | str,
    regression: bool,
) -> List[Batch]:
    """Tokenised ``(inputs, labels)`` batches of consecutive examples.

    Parameters
    ----------
    examples : sequence of dict
        The examples of :func:`load_examples`.
    tokenizer : callable
        A Hugging Face tokenizer; each batch is padded to its longest sequence.
    batch_size : int
        Examples per batch (the last batch may be smaller).
    max_length : int
        Sequences are truncated to this many tokens.
    device : torch.device or str
        Where to put the tensors.
    regression : bool
        Float labels (in the default dtype) instead of class indices.

    Returns
    -------
    list of (dict, torch.Tensor)
        The model's keyword inputs and the labels of each batch.
    """
    batches = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        texts = [e["text"] for e in chunk]
        pairs = [e["text_pair"] for e in chunk] if chunk[0]["text_pair"] is not None else None
        encoded = tokenizer(
            texts, pairs, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        dtype = torch.get_default_dtype() if regression else torch.long
        labels = torch.tensor([e["label"] for e in chunk], dtype=dtype, device=device)
        batches.append(({k: v.to(device) for k, v in encoded.items()}, labels))
    return batches


# ---------------------------------------------------------------- array data (NPZ)
def load_arrays(
    path: str, max_examples: Optional[int] = None, *, where: Optional[str] = None
) -> Dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file: ``labels`` and model inputs, one row per example.

    Parameters
    ----------
    path : str
        The ``.npz`` file (read without unpickling).
    max_examples : int or None
        Keep the first rows only (default all).
    where : str or None
        Prefix of the error messages (default ``"data PATH"``).

    Returns
    -------
    dict of str to numpy.ndarray
        ``labels`` and the input arrays, with equal numbers of rows.

    Raises
    ------
    InputError
        For a missing or unreadable file, no ``labels`` or no input array, arrays with
        different numbers of rows or a non-numeric dtype, or no examples.
    """
    where = where or f"data {path}"
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except FileNotFoundError as error:
        raise InputError(f"{where}: no such file") from error
    except (OSError, ValueError) as error:
        raise InputError(f"{where}: not a readable .npz archive of arrays ({error})") from error
    if "labels" not in arrays:
        raise InputError(f"{where}: no 'labels' array (found {', '.join(arrays) or 'none'})")
    if len(arrays) < 2:
        raise InputError(f"{where}: no input arrays besides 'labels' (e.g. 'pixel_values')")
    counts = {name: a.shape[0] if a.ndim else None for name, a in arrays.items()}
    if len(set(counts.values())) != 1 or None in counts.values():
        raise InputError(f"{where}: arrays differ in their number of rows: {counts}")
    for name, a in arrays.items():
        if a.dtype.kind not in "biuf":
            raise InputError(f"{where}: array {name!r} has non-numeric dtype {a.dtype}")
    if counts["labels"] == 0:
        raise InputError(f"{where}: no examples")
    return {name: a[:max_examples] for name, a in arrays.items()}


def _array_batches(
    arrays: Dict[str, np.ndarray], batch_size: int, device: torch.device | str, regression: bool
) -> List[Batch]:
    label_dtype = torch.get_default_dtype() if regression else torch.long
    tensors = {}
    for name, a in arrays.items():
        tensor = torch.from_numpy(np.ascontiguousarray(a))
        if name == "labels":
            tensor = tensor.to(label_dtype)
        elif tensor.is_floating_point():
            tensor = tensor.to(torch.get_default_dtype())
        tensors[name] = tensor.to(device)
    labels = tensors.pop("labels")
    return [
        (
            {k: v[start : start + batch_size] for k, v in tensors.items()},
            labels[start : start + batch_size],
        )
        for start in range(0, labels.shape[0], batch_size)
    ]


def load_batches(
    path: str,
    model: torch.nn.Module,
    tokenizer: Any = None,
    *,
    batch_size: int,
    max_examples: Optional[int] = None,
    max_length: int = 128,
    device: torch.device | str = "cpu",
    where: Optional[str] = None,
) -> List[Batch]:
    """``(inputs, labels)`` batches of the first ``max_examples`` examples of a data file.

    ``.jsonl``/``.json`` files are text, tokenised with ``tokenizer``; ``.npz`` files hold
    arrays passed to the model by keyword. The same file gives every model the same
    examples in the same batches.

    Parameters
    ----------
    path : str
        The data file (``.jsonl``, ``.json`` or ``.npz``).
    model : torch.nn.Module
        A Hugging Face classifier (its ``config`` gives the labels).
    tokenizer : object or None
        The model's tokenizer; needed for text data.
    batch_size : int
        Examples per batch.
    max_examples : int or None
        Use the first examples only (default all).
    max_length : int
        Token sequences are truncated to this length (default 128).
    device : torch.device or str
        Where to put the tensors (default ``"cpu"``).
    where : str or None
        Prefix of the error messages (default ``"data PATH"``).

    Returns
    -------
    list of (dict, torch.Tensor)
        The model's keyword inputs and the labels of each batch.

    Raises
    ------
    InputError
        For an unknown format, text data without a tokenizer, or a problem in the file
        (:func:`load_examples`, :func:`load_arrays`).
    """
    where = where or f"data {path}"
    regression = is_regression(model.config)
    suffix = Path(path).suffix.lower()
    if suffix in ARRAY_SUFFIXES:
        arrays = load_arrays(path, max_examples, where=where)
        return _array_batches(arrays, batch_size, device, regression)
    if suffix in TEXT_SUFFIXES:
        if tokenizer is None:
            raise InputError(f"{where}: text data needs a model with a tokenizer")
        examples = load_examples(path, model.config, max_examples, where=where)
        return make_batches(examples, tokenizer, batch_size, max_length, device, regression)
    raise InputError(
        f"{where}: unknown data format {suffix or '(no suffix)'!r}; expected "
        f"{', '.join(TEXT_SUFFIXES + ARRAY_SUFFIXES)} (plain text is for causal LMs)"
    )


# ---------------------------------------------------------------- loss and error
def classification_loss(regression: bool):
    """``loss_fn(model, (inputs, labels))``: cross-entropy, or mean squared error.

    Parameters
    ----------
    regression : bool
        Mean squared error of the single output instead of cross-entropy of the logits.

    Returns
    -------
    callable
        ``loss_fn(model, batch) -> scalar tensor`` on ``model(**inputs).logits``, for
        :func:`~geoopt_quotient.geodesic_sharpness`.
    """

    def loss_fn(model: Any, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        logits = model(**inputs).logits
        if regression:
            return torch.nn.functional.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
        return torch.nn.functional.cross_entropy(logits, labels)

    return loss_fn


@torch.no_grad()
def error_rate(model: torch.nn.Module, batches: Sequence[Batch]) -> float:
    """Fraction of misclassified examples (argmax of the logits), model in eval mode.

    Runs without gradients; the model is used in the mode it is in (put it in eval mode
    first, as :func:`load_checkpoint` does).

    Parameters
    ----------
    model : torch.nn.Module
        A classifier whose output has ``logits``.
    batches : sequence of (dict, torch.Tensor)
        Keyword inputs and labels.

    Returns
    -------
    float
        Misclassified examples over all examples, in [0, 1].

    Raises
    ------
    ValueError
        For no examples.
    """
    wrong = total = 0
    for inputs, labels in batches:
        predictions = model(**inputs).logits.argmax(-1)
        wrong += int((predictions != labels).sum())
        total += labels.numel()
    if total == 0:
        raise ValueError("error_rate needs at least one example")
    return wrong / total
