"""A population of small vision transformers on scikit-learn's 8x8 digits, trained on CPU.

The data ship with scikit-learn (1797 grey-scale 8x8 images, 10 classes): nothing is
downloaded. A seeded split gives a fixed training set and a test set. Every model is a
Hugging Face ``ViTForImageClassification`` (2x2 patches, so 16 patch tokens and a class
token) with hyper-parameters drawn at random (width, dropout, learning rate, weight
decay, batch size, epochs, label smoothing), trained with AdamW, and saved
as a safetensors checkpoint, so that the generic population study
(:func:`geoopt_quotient.experiments.population.run_population`) measures it like any other
checkpoint.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..._extras import require
from ..records import fingerprint

__all__ = [
    "DigitsSplit",
    "Hyperparameters",
    "load_digits_split",
    "sample_hyperparameters",
    "train_population",
    "train_vit",
    "write_gaps",
    "write_split",
]

TRAIN_SIZE = 800
IMAGE_SIZE = 8
PATCH_SIZE = 2
NUM_CLASSES = 10
NUM_LAYERS = 2
NUM_HEADS = 4


@dataclass(frozen=True)
class DigitsSplit:
    """Standardised images ``(N, 1, 8, 8)`` and labels, split into train and test."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def load_digits_split(seed: int = 0, train_size: int = TRAIN_SIZE) -> DigitsSplit:
    """scikit-learn's digits, shuffled with ``seed``: ``train_size`` for training, the rest test.

    Pixels (0..16) are scaled by the training set's mean and standard deviation.
    """
    datasets = require("sklearn.datasets", "the digits data set")
    digits = datasets.load_digits()
    images = digits.images.astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    if not 0 < train_size < len(labels):
        raise ValueError(f"`train_size` must be in (0, {len(labels)}), got {train_size}")
    order = np.random.default_rng(seed).permutation(len(labels))
    train, test = order[:train_size], order[train_size:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return DigitsSplit(images[train], labels[train], images[test], labels[test])


def write_split(split: DigitsSplit, directory: str) -> Tuple[str, str]:
    """``train.npz`` and ``test.npz`` (``pixel_values``, ``labels``) for the population study."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, images, labels in (
        ("train", split.train_images, split.train_labels),
        ("test", split.test_images, split.test_labels),
    ):
        path = root / f"{name}.npz"
        np.savez(path, pixel_values=images, labels=labels)
        paths.append(str(path))
    return paths[0], paths[1]


@dataclass(frozen=True)
class Hyperparameters:
    """One model's architecture and training recipe."""

    hidden_size: int
    num_layers: int
    num_heads: int
    dropout: float
    learning_rate: float
    weight_decay: float
    batch_size: int
    epochs: int
    label_smoothing: float
    seed: int


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def sample_hyperparameters(seed: int, index: int, quick: bool = False) -> Hyperparameters:
    """Model ``index``'s hyper-parameters, drawn from a generator seeded by ``(seed, index)``.

    Width 32/48/64 (2 layers, 4 heads, as one architecture family), dropout 0 or 0.1,
    learning rate log-uniform in [3e-4, 3e-3], weight decay log-uniform in [1e-4, 0.1],
    batch size 16-128, 10-60 epochs (2-4 with ``quick``), label smoothing uniform in
    [0, 0.2].
    """
    rng = np.random.default_rng([seed, index])
    epochs = int(rng.integers(2, 5)) if quick else int(rng.integers(10, 61))
    return Hyperparameters(
        hidden_size=int(rng.choice([32, 48, 64])),
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        dropout=float(rng.choice([0.0, 0.1])),
        learning_rate=_log_uniform(rng, 3e-4, 3e-3),
        weight_decay=_log_uniform(rng, 1e-4, 0.1),
        batch_size=int(rng.choice([16, 32, 64, 128])),
        epochs=epochs,
        label_smoothing=float(rng.uniform(0.0, 0.2)),
        seed=int(rng.integers(2**31)),
    )


def build_vit(hp: Hyperparameters) -> torch.nn.Module:
    """A randomly initialised ``ViTForImageClassification`` for 8x8 one-channel images."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=1,
        hidden_size=hp.hidden_size,
        num_hidden_layers=hp.num_layers,
        num_attention_heads=hp.num_heads,
        intermediate_size=2 * hp.hidden_size,
        hidden_dropout_prob=hp.dropout,
        attention_probs_dropout_prob=hp.dropout,
        num_labels=NUM_CLASSES,
    )
    torch.manual_seed(hp.seed)
    return ViTForImageClassification(config)


def _error(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(pixel_values=images).logits.argmax(-1) != labels).float().mean())


def train_vit(hp: Hyperparameters, split: DigitsSplit) -> Tuple[torch.nn.Module, Dict[str, float]]:
    """Train one model with AdamW (cross-entropy with label smoothing); return it in eval mode.

    Also returns its train and test error (eval mode, argmax) and the training time.
    """
    start = time.perf_counter()
    model = build_vit(hp)
    images, labels = torch.from_numpy(split.train_images), torch.from_numpy(split.train_labels)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay
    )
    generator = torch.Generator().manual_seed(hp.seed)
    model.train()
    for _ in range(hp.epochs):
        order = torch.randperm(len(labels), generator=generator)
        for rows in order.split(hp.batch_size):
            logits = model(pixel_values=images[rows]).logits
            loss = torch.nn.functional.cross_entropy(
                logits, labels[rows], label_smoothing=hp.label_smoothing
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    metrics = {
        "train_error": _error(model, images, labels),
        "test_error": _error(
            model, torch.from_numpy(split.test_images), torch.from_numpy(split.test_labels)
        ),
        "train_seconds": time.perf_counter() - start,
    }
    metrics["gap"] = metrics["test_error"] - metrics["train_error"]
    return model, metrics


def _split_digest(split: DigitsSplit) -> str:
    digest = hashlib.sha256()
    for array in asdict(split).values():
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def _trained(directory: Path, key: str) -> Optional[Dict[str, Any]]:
    """The training record of a finished checkpoint with the same recipe, else None."""
    info = directory / "training.json"
    if not info.is_file() or not (directory / "model.safetensors").is_file():
        return None
    try:
        record = json.loads(info.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("fingerprint") == key else None


def train_population(
    count: int,
    directory: str,
    split: DigitsSplit,
    *,
    seed: int = 0,
    quick: bool = False,
    resume: bool = False,
    on_model: Optional[Callable[[int, Dict[str, Any]], None]] = None,
) -> List[Dict[str, Any]]:
    """Train ``count`` models into ``directory/model-XX`` and write ``directory/../gaps.csv``.

    Each checkpoint directory gets ``config.json``, ``model.safetensors`` and
    ``training.json`` (hyper-parameters, errors, gap), the last written when the rest
    is on disk; with ``resume`` a checkpoint whose ``training.json`` matches its recipe
    is kept instead of retrained. Returns the training records in model order.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    data_key = _split_digest(split)
    records = []
    for index in range(count):
        hp = sample_hyperparameters(seed, index, quick)
        key = fingerprint({"hyperparameters": asdict(hp), "data": data_key})
        target = root / f"model-{index:02d}"
        record = _trained(target, key) if resume else None
        if record is None:
            model, metrics = train_vit(hp, split)
            model.save_pretrained(target, safe_serialization=True)
            record = {"checkpoint": target.name, "hyperparameters": asdict(hp), **metrics}
            record["fingerprint"] = key
            (target / "training.json").write_text(json.dumps(record, indent=1) + "\n")
        records.append(record)
        if on_model is not None:
            on_model(index, record)
    return records


def write_gaps(records: Sequence[Dict[str, Any]], path: str) -> str:
    """``checkpoint,train_error,test_error,gap`` rows, the CSV that ``population --gaps`` reads."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["checkpoint", "train_error", "test_error", "gap"])
        for r in records:
            writer.writerow([r["checkpoint"], r["train_error"], r["test_error"], r["gap"]])
    return path
