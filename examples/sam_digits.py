"""
SGD, SAM, ASAM and GeodesicSAM on the 8x8 digits
================================================

A Hugging Face ``ViTForImageClassification`` (2x2 patches, 16 patch tokens and a class
token, ``--layers`` layers of ``--heads`` heads, width ``--hidden``; random weights,
nothing is downloaded) is trained from scratch on scikit-learn's digits (800 training
and 997 test images, the split of ``geoopt_quotient.experiments.population.digits``) with four
optimizers that share everything but the ascent step:

* ``sgd``: ``torch.optim.SGD`` with momentum (the base optimizer of the three others);
* ``sam``: ``GeodesicSAM(..., ball="euclidean")``, SAM (Foret et al. 2021);
* ``asam``: ``GeodesicSAM(..., ball="adaptive", eps=--asam-eps)``, ASAM (Kwon et al. 2021);
* ``geodesic``: ``GeodesicSAM(..., ball="geodesic", metric=--metric)``, the ascent on the
  quotient of the attention symmetries.

Same initialisation and batch order per seed for every method, same learning-rate
schedule (linear warm-up, cosine decay), same base optimizer. Each ball has its own
metric and so its own scale of ``rho``; the default grids were chosen with
``--calibrate``, which trains one pilot model with plain SGD (a seed outside the
experiment) and prints how much one ascent step of each ball raises its training loss,
per ``rho``: the three grids raise the pilot's loss by the same amounts (about +0.005,
+0.02 and +0.065 nats at the end of training, +0.04, +0.12 and +0.27 at a third of it).

For every (method, rho, seed) the trained model gets its test accuracy and loss, its
training accuracy and loss, and two sharpness measures on a fixed set of training
batches: geodesic sharpness (``geoopt_quotient.geodesic_sharpness``, ``--metric``
ball) and adaptive sharpness (``geoopt_quotient.adaptive_sharpness``), worst case,
Auto-PGD, fixed radii. Writes ``sam_digits.json`` (every run, the per-setting means and
standard deviations over seeds, the settings and the environment) and
``sam_digits.png`` (test accuracy and both sharpness measures versus rho) into
``--out``, and prints a table. ``--quick`` is a smoke test of a few seconds. The full
grid takes 10-15 minutes on CPU, so the documentation shows this script without running
it; its recorded results are in ``benchmarks/results/sam/``::

    python examples/sam_digits.py --out benchmarks/results/sam              # the full grid
    python examples/sam_digits.py --calibrate --out benchmarks/results/sam  # the grids' choice
    python examples/sam_digits.py --replot benchmarks/results/sam/sam_digits.json --out docs/sam
    python examples/sam_digits.py --quick --out /tmp/sam                    # seconds

The third line redraws the documentation's figure from the recorded JSON.
"""

# sphinx_gallery_thumbnail_path = "sam/sam_digits.png"

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm import tqdm
from transformers import ViTConfig, ViTForImageClassification
from transformers.utils import logging as hf_logging

import geoopt_quotient as gq
from geoopt_quotient.experiments.population.digits import (
    IMAGE_SIZE,
    NUM_CLASSES,
    PATCH_SIZE,
    DigitsSplit,
    load_digits_split,
)
from geoopt_quotient.optim import GeodesicSAM

METHODS = ("sgd", "sam", "asam", "geodesic")
BALL = {"sam": "euclidean", "asam": "adaptive", "geodesic": "geodesic"}
LABEL = {
    "sgd": "SGD (momentum)",
    "sam": "SAM",
    "asam": "ASAM",
    "geodesic": "GeodesicSAM",
}
COLOUR = {"sgd": "black", "sam": "tab:orange", "asam": "tab:green", "geodesic": "tab:blue"}
METRICS = (
    "test_accuracy",
    "test_loss",
    "train_accuracy",
    "train_loss",
    "geodesic_sharpness",
    "adaptive_sharpness",
    "train_seconds",
)
# one ascent step of each ball raised the pilot model's training loss by about
# +0.005, +0.02 and +0.065 at these radii (``--calibrate``)
DEFAULT_RHO = {"sam": [0.02, 0.05, 0.1], "asam": [0.1, 0.25, 0.5], "geodesic": [0.02, 0.05, 0.1]}
CALIBRATION_RHO = {
    "sam": [0.01, 0.02, 0.05, 0.1, 0.2, 0.5],
    "asam": [0.05, 0.1, 0.25, 0.5, 1.0, 2.0],
    "geodesic": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2],
}


# ----------------------------------------------------------------------------- model, data


def build_model(args: argparse.Namespace, seed: int) -> ViTForImageClassification:
    """The ViT of ``population.digits.build_vit`` with its initial weights' std set.

    With Hugging Face's default (std 0.02) plain SGD hardly moves the attention (its
    logits are products of two small factors): 21-32% test accuracy after 30 epochs at
    learning rates 0.02-0.3 in pilot runs; with std 0.1 it trains to about 94-96%.
    """
    config = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=1,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=NUM_CLASSES,
        initializer_range=args.init_std,
    )
    torch.manual_seed(seed)
    return ViTForImageClassification(config)


Tensors = Tuple[torch.Tensor, torch.Tensor]


def tensors(split: DigitsSplit) -> Dict[str, Tensors]:
    return {
        "train": (torch.from_numpy(split.train_images), torch.from_numpy(split.train_labels)),
        "test": (torch.from_numpy(split.test_images), torch.from_numpy(split.test_labels)),
    }


def loss_fn(model: torch.nn.Module, batch: Tensors) -> torch.Tensor:
    images, labels = batch
    return torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor
) -> Dict[str, float]:
    model.eval()
    logits = model(pixel_values=images).logits
    return {
        "accuracy": float((logits.argmax(-1) == labels).float().mean()),
        "loss": float(torch.nn.functional.cross_entropy(logits, labels)),
    }


# ----------------------------------------------------------------------------- training


def make_optimizer(
    method: str, rho: Optional[float], model: torch.nn.Module, args: argparse.Namespace
) -> Tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """The optimizer and the base optimizer it steps with (the same object for SGD)."""
    base = dict(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if method == "sgd":
        opt = torch.optim.SGD(model.parameters(), **base)
        return opt, opt
    opt = sam_optimizer(model, method, rho, args, **base)
    return opt, opt.base_optimizer


def sam_optimizer(
    model: torch.nn.Module, method: str, rho: float, args: argparse.Namespace, **base: Any
) -> GeodesicSAM:
    """``method``'s ball (SAM, ASAM or GeodesicSAM) around ``torch.optim.SGD(**base)``."""
    return GeodesicSAM(
        model,
        torch.optim.SGD,
        rho=rho,
        ball=BALL[method],
        metric=args.metric,
        eps=args.asam_eps if method == "asam" else 0.0,
        **base,
    )


def schedule(args: argparse.Namespace, steps_per_epoch: int):
    """Learning-rate factor per step: linear warm-up, then cosine decay to 0."""
    total, warm = args.epochs * steps_per_epoch, max(1, args.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        return (
            min(1.0, (step + 1) / warm) * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
        )

    return factor


def train(
    method: str,
    rho: Optional[float],
    seed: int,
    data: Dict[str, Tensors],
    args: argparse.Namespace,
    on_epoch=None,
    model: Optional[torch.nn.Module] = None,
) -> Tuple[torch.nn.Module, List[float], float]:
    """Train one model (``model``, else a new one); returns it, its mean training loss per
    epoch and the seconds taken. ``on_epoch(epoch)`` is called after each epoch."""
    model = build_model(args, seed) if model is None else model
    opt, base = make_optimizer(method, rho, model, args)
    images, labels = data["train"]
    steps_per_epoch = math.ceil(len(labels) / args.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(base, schedule(args, steps_per_epoch))
    order = torch.Generator().manual_seed(10_000 + seed)  # the same batches for every method
    losses: List[float] = []
    start = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        total = 0.0
        for rows in torch.randperm(len(labels), generator=order).split(args.batch_size):
            batch = (images[rows], labels[rows])

            def closure(batch=batch):
                loss = loss_fn(model, batch)
                loss.backward()
                return loss

            opt.zero_grad(set_to_none=True)
            if method == "sgd":
                loss = closure()
                opt.step()
            else:
                loss = opt.step(closure)
            scheduler.step()
            total += loss.item()
        losses.append(total / steps_per_epoch)
        if not math.isfinite(losses[-1]):
            break
        if on_epoch is not None:
            on_epoch(epoch)
    model.eval()
    return model, losses, time.perf_counter() - start


def measurement_batches(data: Dict[str, Tensors], args: argparse.Namespace) -> List[Tensors]:
    """The first ``--measure-examples`` training images in batches of ``--measure-batch``."""
    images, labels = data["train"]
    rows = torch.arange(min(args.measure_examples, len(labels))).split(args.measure_batch)
    return [(images[r], labels[r]) for r in rows]


def measure(model: torch.nn.Module, batches: List[Tensors], args: argparse.Namespace):
    start = time.perf_counter()
    geo = gq.geodesic_sharpness(
        model,
        loss_fn,
        batches,
        rho=args.measure_rho_geodesic,
        metric=args.metric,
        iters=args.measure_iters,
        progress=False,
    )
    ada = gq.adaptive_sharpness(
        model,
        loss_fn,
        batches,
        rho=args.measure_rho_adaptive,
        iters=args.measure_iters,
        progress=False,
    )
    return {
        "geodesic_sharpness": geo.value,
        "adaptive_sharpness": ada.value,
        "measure_seconds": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- the grid


def settings_grid(args: argparse.Namespace) -> List[Tuple[str, Optional[float]]]:
    grid: List[Tuple[str, Optional[float]]] = []
    for method in args.methods:
        if method == "sgd":
            grid.append(("sgd", None))
        else:
            grid.extend((method, rho) for rho in getattr(args, f"rho_{method}"))
    return grid


def run_grid(args: argparse.Namespace, data: Dict[str, Tensors]) -> List[Dict[str, Any]]:
    batches = measurement_batches(data, args)
    grid = [(m, r, s) for m, r in settings_grid(args) for s in args.seeds]
    runs = []
    bar = tqdm(total=len(grid) * args.epochs, unit="epoch", disable=args.no_progress)
    for method, rho, seed in grid:
        bar.set_description(f"{method} rho={rho} seed={seed}")
        model, losses, seconds = train(method, rho, seed, data, args, lambda _: bar.update())
        bar.update(args.epochs - len(losses))
        test, trained = evaluate(model, *data["test"]), evaluate(model, *data["train"])
        record: Dict[str, Any] = {
            "method": method,
            "rho": rho,
            "seed": seed,
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "train_accuracy": trained["accuracy"],
            "train_loss": trained["loss"],
            "epoch_losses": losses,
            "train_seconds": seconds,
        }
        if all(math.isfinite(v) for v in (test["loss"], trained["loss"])):
            record.update(measure(model, batches, args))
        else:  # diverged: nothing to measure
            record.update(geodesic_sharpness=math.nan, adaptive_sharpness=math.nan)
        bar.set_postfix(acc=f"{record['test_accuracy']:.3f}")
        runs.append(record)
    bar.close()
    return runs


def mean_std(values: Sequence[float]) -> Dict[str, float]:
    values = [float(v) for v in values]
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def summarize(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Mean and standard deviation over seeds per (method, rho), and the paired difference
    of test accuracy to SGD with the same seed (where SGD was run)."""
    sgd = {r["seed"]: r["test_accuracy"] for r in runs if r["method"] == "sgd"}
    keys = list(dict.fromkeys((r["method"], r["rho"]) for r in runs))
    summary = []
    for method, rho in keys:
        group = [r for r in runs if r["method"] == method and r["rho"] == rho]
        row: Dict[str, Any] = {"method": method, "rho": rho, "seeds": [r["seed"] for r in group]}
        for key in METRICS:
            row[key] = mean_std([r[key] for r in group])
        if method != "sgd" and sgd and all(r["seed"] in sgd for r in group):
            row["test_accuracy_minus_sgd"] = mean_std(
                [r["test_accuracy"] - sgd[r["seed"]] for r in group]
            )
        summary.append(row)
    return summary


def table(summary: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    def cell(stat: Dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
        return f"{stat['mean'] * scale:.{digits}f} ± {stat['std'] * scale:.{digits}f}"

    head = (
        f"{'method':<12} {'rho':>6}  {'test acc %':>13}  {'vs SGD (pp)':>13}  "
        f"{'test loss':>13}  {'train acc %':>13}  "
        f"{'geo sharp':>15}  {'ada sharp':>15}  {'s/run':>5}"
    )
    lines = [
        f"mean ± std over seeds {args.seeds}; geodesic sharpness: {args.metric} ball, "
        f"rho {args.measure_rho_geodesic}; adaptive sharpness: rho {args.measure_rho_adaptive}; "
        f"{args.measure_iters} Auto-PGD iterations on {args.measure_examples} training images",
        head,
        "-" * len(head),
    ]
    for row in summary:
        delta = row.get("test_accuracy_minus_sgd")
        lines.append(
            f"{LABEL[row['method']]:<12} {'-' if row['rho'] is None else row['rho']:>6}  "
            f"{cell(row['test_accuracy'], 100, 2):>13}  "
            f"{cell(delta, 100, 2) if delta else '-':>13}  "
            f"{cell(row['test_loss']):>13}  {cell(row['train_accuracy'], 100, 2):>13}  "
            f"{cell(row['geodesic_sharpness'], 1, 4):>15}  "
            f"{cell(row['adaptive_sharpness'], 1, 4):>15}  "
            f"{row['train_seconds']['mean']:5.1f}"
        )
    return "\n".join(lines)


def plot(summary: List[Dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    """Test accuracy and both sharpness measures versus the training rho, per method."""
    panels = (
        ("test_accuracy", 100.0, "test accuracy (%)"),
        (
            "geodesic_sharpness",
            1.0,
            f"geodesic sharpness ({args.metric}, ρ={args.measure_rho_geodesic})",
        ),
        ("adaptive_sharpness", 1.0, f"adaptive sharpness (ρ={args.measure_rho_adaptive})"),
    )
    shift = {"sam": 0.96, "asam": 1.0, "geodesic": 1.04}  # SAM and GeodesicSAM share radii
    rhos = sorted({r["rho"] for r in summary if r["rho"] is not None})
    fig = Figure(figsize=(15, 4.6))  # not owned by pyplot: no backend, nothing global
    axes = fig.subplots(1, len(panels))
    for ax, (key, scale, ylabel) in zip(axes, panels):
        for method in args.methods:
            rows = [r for r in summary if r["method"] == method]
            if not rows:
                continue
            if method == "sgd":
                mean, std = rows[0][key]["mean"] * scale, rows[0][key]["std"] * scale
                ax.axhline(mean, color=COLOUR[method], ls="--", lw=1, label=LABEL[method])
                ax.axhspan(mean - std, mean + std, color=COLOUR[method], alpha=0.08)
                continue
            ax.errorbar(
                [r["rho"] * shift[method] for r in rows],
                [r[key]["mean"] * scale for r in rows],
                yerr=[r[key]["std"] * scale for r in rows],
                marker="o",
                capsize=3,
                color=COLOUR[method],
                label=LABEL[method],
            )
        ax.set(xscale="log", xlabel="training ρ (each ball in its own metric)", ylabel=ylabel)
        if rhos:
            ax.set_xticks(rhos, [f"{r:g}" for r in rhos])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    quick = " (--quick)" if args.quick else ""
    fig.suptitle(
        f"ViT ({args.layers} layers, {args.heads} heads, width {args.hidden}) on 8x8 digits, "
        f"{args.epochs} epochs, SGD momentum {args.momentum} base, mean ± std over "
        f"{len(args.seeds)} seed(s){quick}"
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def replot(path: Path, out: Path) -> Dict[str, Any]:
    """Redraw the figure of a ``sam_digits.json`` into ``out`` (no training)."""
    report = json.loads(path.read_text())
    settings = argparse.Namespace(**report["settings"])
    png = out / report.get("figure", "sam_digits.png")
    plot(report["summary"], png, settings)
    print(table(report["summary"], settings))
    print(f"{png}")
    return report


# ----------------------------------------------------------------------------- calibration


@torch.no_grad()
def ascent_increase(
    model: torch.nn.Module, method: str, rho: float, batches: List[Tensors], args
) -> float:
    """Mean over ``batches`` of L(w') - L(w), w' the ascent point of ``method``'s ball."""
    probe = sam_optimizer(model, method, rho, args, lr=0.0)  # second_step: w, a zero step
    increases = []
    for batch in batches:
        probe.zero_grad(set_to_none=True)
        with torch.enable_grad():
            clean = loss_fn(model, batch)
            clean.backward()
        probe.first_step(zero_grad=True)
        increases.append(float(loss_fn(model, batch) - clean))
        probe.second_step(zero_grad=True)
    return statistics.fmean(increases)


def calibrate(args: argparse.Namespace, data: Dict[str, Tensors]) -> Dict[str, Any]:
    """Train a pilot with SGD; at a few epochs, the loss increase of one ascent step per rho."""
    images, labels = data["train"]
    batches = [(images[r], labels[r]) for r in torch.arange(len(labels)).split(100)]
    checkpoints = sorted({max(1, args.epochs // 10), args.epochs // 3, args.epochs} - {0})
    results: List[Dict[str, Any]] = []

    def probe(epoch: int) -> None:
        model.eval()
        clean = statistics.fmean(float(loss_fn(model, b).detach()) for b in batches)
        for method in ("sam", "asam", "geodesic"):
            for rho in CALIBRATION_RHO[method]:
                results.append(
                    {
                        "epoch": epoch,
                        "clean_loss": clean,
                        "method": method,
                        "rho": rho,
                        "loss_increase": ascent_increase(model, method, rho, batches, args),
                    }
                )
        model.train()

    def on_epoch(epoch: int) -> None:
        if epoch + 1 in checkpoints:
            probe(epoch + 1)

    model = build_model(args, args.calibration_seed)
    train("sgd", None, args.calibration_seed, data, args, on_epoch, model=model)
    lines = [f"pilot: plain SGD, seed {args.calibration_seed}; L(w') - L(w) of one ascent step"]
    for epoch in checkpoints:
        rows = [r for r in results if r["epoch"] == epoch]
        lines.append(f"epoch {epoch} (training loss {rows[0]['clean_loss']:.4f}):")
        for method in ("sam", "asam", "geodesic"):
            cells = "  ".join(
                f"{r['rho']:g}: {r['loss_increase']:+.4f}" for r in rows if r["method"] == method
            )
            lines.append(f"  {LABEL[method]:<12} {cells}")
    text = "\n".join(lines)
    return {"results": results, "checkpoints": checkpoints, "text": text}


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        epilog=__doc__.strip().split("\n\n", 1)[1],
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100),
    )
    add = parser.add_argument
    add("--out", type=Path, default=Path("sam-digits-out"), help="output directory")
    add("--quick", action="store_true", help="tiny model, 2 epochs, 1 seed, 1 rho (smoke test)")
    add(
        "--calibrate",
        action="store_true",
        help="print how one ascent step of each ball "
        "raises a pilot model's loss per rho (how the default grids were chosen), write "
        "calibration.json, and stop",
    )
    add(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the figure and reprint the "
        "table of an earlier run's sam_digits.json into --out",
    )
    add("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all")
    add(
        "--seeds",
        nargs="+",
        type=int,
        default=[0, 1, 2],
        help="model initialisation and batch order (default: 0 1 2)",
    )
    add(
        "--rho-sam",
        nargs="+",
        type=float,
        default=DEFAULT_RHO["sam"],
        help="SAM radii, Euclidean norm (default: %(default)s)",
    )
    add(
        "--rho-asam",
        nargs="+",
        type=float,
        default=DEFAULT_RHO["asam"],
        help="ASAM radii, norm of delta / (|w| + eps) (default: %(default)s)",
    )
    add(
        "--rho-geodesic",
        nargs="+",
        type=float,
        default=DEFAULT_RHO["geodesic"],
        help="GeodesicSAM radii, quotient metric norm (default: %(default)s)",
    )
    add("--asam-eps", type=float, default=0.01, help="ASAM's eta (default: %(default)s)")
    add(
        "--metric",
        choices=("mix", "inv"),
        default="mix",
        help="quotient metric of GeodesicSAM and of geodesic sharpness (default: %(default)s)",
    )
    add("--epochs", type=int, default=30, help="epochs per model (default: %(default)s)")
    add("--batch-size", type=int, default=32, help="training batch (default: %(default)s)")
    add("--lr", type=float, default=0.02, help="peak learning rate (default: %(default)s)")
    add("--momentum", type=float, default=0.9, help="SGD's (default: %(default)s)")
    add("--weight-decay", type=float, default=5e-4, help="SGD's (default: %(default)s)")
    add(
        "--warmup-epochs",
        type=int,
        default=2,
        help="linear warm-up, then cosine decay (default: %(default)s)",
    )
    add("--hidden", type=int, default=32, help="ViT width (default: %(default)s)")
    add("--layers", type=int, default=2, help="transformer layers (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add(
        "--init-std",
        type=float,
        default=0.1,
        help="std of the initial weights "
        "(default: %(default)s; Hugging Face's 0.02 leaves SGD stuck)",
    )
    add(
        "--measure-rho-geodesic",
        type=float,
        default=0.01,
        help="radius of measured geodesic sharpness (default: %(default)s)",
    )
    add(
        "--measure-rho-adaptive",
        type=float,
        default=0.2,
        help="radius of measured adaptive sharpness (default: %(default)s)",
    )
    add("--measure-iters", type=int, default=20, help="Auto-PGD iterations (default: %(default)s)")
    add(
        "--measure-examples",
        type=int,
        default=512,
        help="first N training images (default: %(default)s)",
    )
    add(
        "--measure-batch",
        type=int,
        default=128,
        help="batch of the sharpness measures (default: %(default)s)",
    )
    add(
        "--calibration-seed",
        type=int,
        default=100,
        help="seed of the pilot of --calibrate (default: %(default)s)",
    )
    add(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, 0: torch's default "
        "(default: %(default)s; the models are tiny, and on busy cores more threads are slower)",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.heads = 16, 1, 2
        args.epochs, args.warmup_epochs = min(args.epochs, 2), 1
        args.seeds = args.seeds[:1]
        for method in ("sam", "asam", "geodesic"):
            name = f"rho_{method}"
            setattr(args, name, [getattr(args, name)[len(getattr(args, name)) // 2]])
        args.measure_iters, args.measure_examples, args.measure_batch = 2, 64, 32
    for name in (
        "epochs",
        "batch_size",
        "hidden",
        "layers",
        "heads",
        "measure_iters",
        "measure_examples",
        "measure_batch",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    return args


def environment(args: argparse.Namespace) -> Dict[str, Any]:
    import transformers

    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the comparison (or the calibration); returns what is written as JSON."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`main` after argument parsing."""
    hf_logging.set_verbosity_error()
    if args.replot:
        args.out.mkdir(parents=True, exist_ok=True)
        return replot(args.replot, args.out)
    start = time.perf_counter()
    data = tensors(load_digits_split())
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    command = (
        "python examples/sam_digits.py " + " ".join(sys.argv[1:])
        if __name__ == "__main__"
        else None
    )
    if args.calibrate:
        result = calibrate(args, data)
        print(result["text"])
        report = {
            "settings": settings,
            "environment": environment(args),
            "calibration": result["results"],
            "seconds": time.perf_counter() - start,
        }
        path = args.out / "calibration.json"
    else:
        runs = run_grid(args, data)
        summary = summarize(runs)
        png = args.out / "sam_digits.png"
        plot(summary, png, args)
        print(table(summary, args))
        report = {
            "settings": settings,
            "environment": environment(args),
            "summary": summary,
            "runs": runs,
            "figure": png.name,
            "seconds": time.perf_counter() - start,
        }
        path = args.out / "sam_digits.json"
    if command:
        report["command"] = command
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{path} ({report['seconds']:.0f} s, {torch.get_num_threads()} thread(s))")
    return report


if __name__ == "__main__":
    main()
