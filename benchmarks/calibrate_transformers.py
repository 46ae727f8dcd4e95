"""What the radii of ``reproduce transformers`` mean, in terms of ``calibrate_rho``.

Trains a few digits ViTs exactly as ``geoopt-quotient reproduce transformers`` does
(``geoopt_quotient.experiments.population.digits``: the same seeded split and hyper-parameter draws,
models 0, 1, 2, ... of the population) and, on the study's sharpness batches (the first
``--max-examples`` training images in batches of ``--batch-size``, ``--iters`` Auto-PGD
iterations, seed 0, second-order path), measures per model and measure:

- the ratio (worst-case sharpness at the study's default radius) / (mean clean loss);
- the radius that ``geoopt_quotient.calibrate_rho`` returns for each of ``--targets``
  (worst-case sharpness = target x mean clean loss), started at the default radius.

The symmetries of each model are discovered once per metric and reused. The JSON report
has every model's numbers, the evaluations of each calibration, and per measure the
median over models.

    python benchmarks/calibrate_transformers.py \\
        --json benchmarks/results/cpu/calibrate_transformers.json  # ~minutes
    python benchmarks/calibrate_transformers.py --quick --json /tmp/c.json      # seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from geoopt_quotient import adaptive_sharpness, calibrate_rho, find_symmetries, geodesic_sharpness
from geoopt_quotient.cli.reproduce.transformers import DEFAULTS
from geoopt_quotient.experiments.classifiers import classification_loss
from geoopt_quotient.experiments.population.digits import (
    DigitsSplit,
    load_digits_split,
    sample_hyperparameters,
    train_vit,
)

MEASURES = ("adaptive", "inv", "mix")
DEFAULT_RADII = {
    "adaptive": DEFAULTS.rho_adaptive,
    "inv": DEFAULTS.rho_inv,
    "mix": DEFAULTS.rho_mix,
}
#: calibrate_rho's default relative tolerance on the sharpness.
RTOL = 0.01
Batch = Tuple[Dict[str, torch.Tensor], torch.Tensor]


def sharpness_batches(split: DigitsSplit, max_examples: int, batch_size: int) -> List[Batch]:
    """The study's batches: the first ``max_examples`` training images, in order."""
    images = torch.from_numpy(split.train_images[:max_examples])
    labels = torch.from_numpy(split.train_labels[:max_examples])
    return [
        ({"pixel_values": images[i : i + batch_size]}, labels[i : i + batch_size])
        for i in range(0, len(labels), batch_size)
    ]


def ratio_at(model, loss_fn, batches, measure: str, rho: float, options: Dict[str, Any]):
    """(sharpness, mean clean loss) of ``measure`` at ``rho``."""
    if measure == "adaptive":
        result = adaptive_sharpness(model, loss_fn, batches, rho=rho, **options)
    else:
        result = geodesic_sharpness(model, loss_fn, batches, rho=rho, metric=measure, **options)
    clean = statistics.fmean(result.clean_losses)
    return result.value, clean


def measure_one(
    model: torch.nn.Module, batches: List[Batch], args: argparse.Namespace
) -> Dict[str, Any]:
    """Per measure: the ratio at the default radius and the calibrated radii."""
    loss_fn = classification_loss(regression=False)
    common = dict(iters=args.iters, seed=DEFAULTS.seed, eps=DEFAULTS.eps)
    out: Dict[str, Any] = {}
    for measure in MEASURES:
        options = dict(common, progress=False)
        if measure != "adaptive":
            plan = find_symmetries(model, metric=measure, eps=DEFAULTS.eps).bind(model)
            options.update(symmetries=plan, path=DEFAULTS.path)
        start = time.perf_counter()
        value, clean = ratio_at(model, loss_fn, batches, measure, DEFAULT_RADII[measure], options)
        row: Dict[str, Any] = {
            "default_rho": DEFAULT_RADII[measure],
            "sharpness_at_default": value,
            "clean_loss": clean,
            "ratio_at_default": value / clean,
            "seconds_at_default": time.perf_counter() - start,
            "calibrated": {},
        }
        options.pop("progress")
        for target in args.targets:
            start = time.perf_counter()
            rho, history = calibrate_rho(
                model,
                loss_fn,
                batches,
                target=target,
                measure=measure,
                rho_start=DEFAULT_RADII[measure],
                rtol=RTOL,
                progress=args.progress,
                return_history=True,
                **options,
            )
            row["calibrated"][f"{target:g}"] = {
                "rho": rho,
                "ratio": (ratio := next(h.ratio for h in history if h.rho == rho)),
                "within_rtol": abs(ratio / target - 1) <= RTOL,
                "evaluations": [(h.rho, h.ratio) for h in history],
                "seconds": time.perf_counter() - start,
            }
        out[measure] = row
        print(_row_text(measure, row), file=sys.stderr, flush=True)
    return out


def _row_text(measure: str, row: Dict[str, Any]) -> str:
    radii = ", ".join(f"t={t}: rho {c['rho']:.4g}" for t, c in row["calibrated"].items())
    return (
        f"  {measure:8s} ratio at rho={row['default_rho']:g}: {row['ratio_at_default']:.3g}; "
        f"{radii}"
    )


def summarise(models: List[Dict[str, Any]], targets: Sequence[float]) -> Dict[str, Any]:
    """Per measure: median (and range) over models of every figure."""
    summary: Dict[str, Any] = {}
    for measure in MEASURES:
        rows = [m["measures"][measure] for m in models]
        ratios = [r["ratio_at_default"] for r in rows]
        entry: Dict[str, Any] = {
            "default_rho": DEFAULT_RADII[measure],
            "ratio_at_default": _spread(ratios),
            "rho_for_target": {},
        }
        for target in targets:
            key = f"{target:g}"
            entry["rho_for_target"][key] = _spread([r["calibrated"][key]["rho"] for r in rows])
        summary[measure] = entry
    return summary


def _spread(values: Sequence[float]) -> Dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="calibrate_transformers.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--json", type=Path, required=True, help="write the report to this file ('-': stdout)"
    )
    parser.add_argument("--models", type=int, default=3, help="models 0..N-1 (default 3)")
    parser.add_argument(
        "--population-seed",
        type=int,
        default=0,
        help="seed of the split and of the hyper-parameter draws (default 0, the study's)",
    )
    parser.add_argument(
        "--targets",
        type=float,
        nargs="+",
        default=[0.1, 1.0, 10.0],
        help="sharpness / clean-loss targets to calibrate for (default 0.1 1 10)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=DEFAULTS.iters,
        help=f"Auto-PGD iterations (default {DEFAULTS.iters}, the study's)",
    )
    parser.add_argument(
        "--max-examples",
        type=int,
        default=DEFAULTS.max_examples,
        help=f"training images measured (default {DEFAULTS.max_examples}, the study's)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULTS.batch_size,
        help=f"sharpness batch size (default {DEFAULTS.batch_size}, the study's)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2-4 training epochs, 2 iterations, 64 images in batches of 32, 1 model, "
        "target 0.1 (checks that it runs; not a measurement)",
    )
    parser.add_argument(
        "--progress", action="store_true", help="progress bars over the calibrations"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.iters, args.max_examples, args.batch_size = 1, 2, 64, 32
        args.targets = [0.1]
    if args.models < 1 or args.iters < 1 or args.max_examples < 1 or args.batch_size < 1:
        parser.error("--models, --iters, --max-examples and --batch-size must be >= 1")
    if any(t <= 0 for t in args.targets):
        parser.error("--targets must be > 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = run(args)
    finally:
        torch.set_num_threads(threads)
    text = json.dumps(report, indent=2) + "\n"
    if str(args.json) == "-":
        sys.stdout.write(text)
    else:
        args.json.write_text(text)
    return report


def run(args: argparse.Namespace) -> Dict[str, Any]:
    start = time.perf_counter()
    split = load_digits_split(args.population_seed)
    batches = sharpness_batches(split, args.max_examples, args.batch_size)
    models = []
    for index in range(args.models):
        hp = sample_hyperparameters(args.population_seed, index, quick=args.quick)
        model, metrics = train_vit(hp, split)
        print(
            f"model {index}: width {hp.hidden_size}, {hp.epochs} epochs, "
            f"train error {metrics['train_error']:.3f}, test error {metrics['test_error']:.3f}",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        measures = measure_one(model, batches, args)
        models.append(
            {
                "index": index,
                "hyperparameters": asdict(hp),
                **metrics,
                "measures": measures,
                "sharpness_seconds": time.perf_counter() - t0,
            }
        )
    return {
        "benchmark": "calibrate_transformers",
        "settings": {
            "models": args.models,
            "population_seed": args.population_seed,
            "targets": args.targets,
            "iters": args.iters,
            "max_examples": args.max_examples,
            "batch_size": args.batch_size,
            "seed": DEFAULTS.seed,
            "path": DEFAULTS.path,
            "quick": args.quick,
            "default_radii": DEFAULT_RADII,
        },
        "summary": summarise(models, args.targets),
        "models": models,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": args.threads,
            "processor": platform.processor() or platform.machine(),
        },
        "seconds": time.perf_counter() - start,
    }


if __name__ == "__main__":
    main()
