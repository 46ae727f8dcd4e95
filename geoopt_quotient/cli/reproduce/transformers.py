"""``geoopt-quotient reproduce transformers``: Table 1's transformer rows, at laptop scale."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Dict

from ..._progress import progress_bar
from ...experiments.population.digits import (
    load_digits_split,
    train_population,
    write_gaps,
    write_split,
)
from ...experiments.population.study import MIN_MODELS, StudySettings, run_population
from ...experiments.records import RecordFile
from .._runtime import add_output_arguments, add_threads_argument, quiet_transformers
from .._types import int_at_least
from ..population import add_study_arguments, report, settings_from_args

__all__ = ["DEFAULTS", "QUICK", "register", "run"]

#: The study's settings, fixed before any tau was computed. The radii are round values,
#: chosen on a pilot model trained outside the population. In the terms of
#: :func:`geoopt_quotient.calibrate_rho` (the radius at which worst-case sharpness is
#: ``target`` x the mean clean loss) they correspond to about target 0.3, with a wide
#: spread: on 3 population models (``python benchmarks/calibrate_transformers.py``, 1
#: thread) sharpness / clean loss at these radii was 0.14 / 0.26 / 0.37 for adaptive,
#: 0.07 / 0.48 / 0.29 for inv and 0.32 / 0.11 / 0.50 for mix (medians 0.26, 0.29, 0.32).
#: The radii that calibrate_rho returns there (median of the 3) for target 0.1 / 1 / 10
#: are adaptive 0.082 / 0.52 / 1.6, inv 0.033 / 0.077 / 0.25, mix 0.0067 / 0.016 / 0.022:
#: a local measure at the defaults, a loss increase well above the clean loss from about
#: 5 times them (adaptive, inv) and 2 times (mix), which ``--rho-scales`` reaches.
DEFAULTS = StudySettings(
    rho_adaptive=0.2,
    rho_inv=0.05,
    rho_mix=0.01,
    iters=20,
    batch_size=128,
    max_examples=512,
)
#: ``--quick``: a handful of models, a few epochs, one small batch (checks that it runs).
QUICK = dict(models=6, iters=3, max_examples=64, batch_size=64)
DEFAULT_MODELS = 48

DESCRIPTION = """\
Train a population of small vision transformers (Hugging Face ViT, 2x2 patches) on the
8x8 digits that ship with scikit-learn, with hyper-parameters drawn at random (width,
dropout, learning rate, weight decay, batch size, epochs, label smoothing)
so that their generalization gaps differ; then run the population study on them:
adaptive and geodesic (inv, mix) sharpness on the same 512 training images for every
model, and Kendall's tau with the generalization gap (test error - train error),
beside the paper's Table 1 (ImageNet: -0.41 / -0.71 / -0.70; MNLI: 0.06 / 0.28 / 0.38).
Runs on CPU; nothing is downloaded.
"""

EPILOG = f"""\
output:
  stdout   the tau table; nothing with --quiet; only the JSON document with --json -
  stderr   progress of training and sharpness: bars on a terminal, else a line every
           10% (not with --quiet or --json -)
  files    OUT/data/{{train,test}}.npz, OUT/checkpoints/model-XX/ (safetensors and
           training.json: hyper-parameters, errors), OUT/gaps.csv,
           OUT/transformers-records.jsonl, OUT/transformers.json, OUT/transformers.png
           (its title gives the radii, and marks --quick runs); with --rho-scales
           also OUT/transformers-tau-by-rho.png (tau against the radius, 95% bands),
           two more tables on stdout and 'tau_by_rho' in the JSON (see 'population
           --help')
  With fewer than {MIN_MODELS} models (--quick has {QUICK["models"]}), tau is coarse and \
its bootstrap interval
  unreliable: the table marks tau with '!', the JSON has a 'warning', and the
  figure's title says so.
  The checkpoints are ordinary: the same study runs with
    geoopt-quotient population --checkpoints OUT/checkpoints --data OUT/data/train.npz \\
        --gaps OUT/gaps.csv

defaults: {DEFAULT_MODELS} models; radii adaptive {DEFAULTS.rho_adaptive}, inv \
{DEFAULTS.rho_inv}, mix {DEFAULTS.rho_mix}, fixed for this
study (the balls live on different scales; 'population' defaults to 0.05 for all).
In calibrate_rho's terms (sharpness = target x mean clean loss) they are about target
0.3, spread 0.07-0.5 over models and measures (python benchmarks/calibrate_transformers.py):
a local measure. Target 10 is about 5 times them for adaptive and inv, 2 times for mix;
{DEFAULTS.iters} Auto-PGD iterations; {DEFAULTS.max_examples} training images in batches \
of {DEFAULTS.batch_size}. About 13-18 minutes on
2 CPU cores with --threads 1 (the default), half training, half sharpness; --ablations
makes the sharpness part about 2.5 times longer. --rho-scales adds one sharpness part
per scale other than 1 (about 4 minutes each): '--rho-scales 0.3,1,3,10,30' took 29
minutes (9 training, 19 sharpness; the grid of the docs' reproduction page).
--quick: {QUICK["models"]} models trained for 2-4 epochs, {QUICK["iters"]} iterations on \
{QUICK["max_examples"]} images (about 30 s; for tests).

examples:
  geoopt-quotient reproduce transformers
  geoopt-quotient reproduce transformers --models 32 --ablations --out runs/vit
  geoopt-quotient reproduce transformers --quick --json - > quick.json
  geoopt-quotient reproduce transformers --rho-scales 0.3,1,3,10,30 \\
      --out transformers-grid-out    # tau against the radius (about 30 minutes)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``transformers`` to ``reproduce``'s targets."""
    parser = subparsers.add_parser(
        "transformers",
        help="a population of small ViTs on 8x8 digits: sharpness vs generalization gap",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models",
        type=int_at_least(3),
        default=None,
        metavar="M",
        help=f"population size (default {DEFAULT_MODELS}; {QUICK['models']} with --quick)",
    )
    parser.add_argument(
        "--population-seed",
        type=int_at_least(0),
        default=0,
        metavar="S",
        help="seed of the data split and the hyper-parameters (default 0)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a few short-trained models, few iterations"
    )
    add_threads_argument(parser)
    add_study_arguments(parser, DEFAULTS)
    add_output_arguments(
        parser,
        "transformers-out",
        "transformers",
        ", data and weights; trained checkpoints whose training.json matches their recipe are kept",
    )
    parser.set_defaults(handler=run, parser=parser, needs=("matplotlib", "sklearn"))


def _apply_quick(args: argparse.Namespace, argv_defaults: Dict[str, Any]) -> None:
    """--quick shrinks what the user did not set explicitly."""
    if args.models is None:
        args.models = QUICK["models"] if args.quick else DEFAULT_MODELS
    if not args.quick:
        return
    for name in ("iters", "max_examples", "batch_size"):
        if getattr(args, name) == argv_defaults[name]:
            setattr(args, name, QUICK[name])


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``reproduce transformers`` (``main`` applies ``--threads``)."""
    with quiet_transformers(silent=args.quiet or args.json == "-"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    _apply_quick(
        args,
        {
            "iters": DEFAULTS.iters,
            "max_examples": DEFAULTS.max_examples,
            "batch_size": DEFAULTS.batch_size,
        },
    )
    settings = settings_from_args(args, DEFAULTS)
    silent = args.quiet or args.json == "-"
    progress = not silent
    out = Path(args.out)
    split = load_digits_split(args.population_seed)
    train_file, _ = write_split(split, str(out / "data"))
    bar = progress_bar(total=args.models, desc="training", unit="model", show=progress)
    with bar:
        trained = train_population(
            args.models,
            str(out / "checkpoints"),
            split,
            seed=args.population_seed,
            quick=args.quick,
            resume=args.resume,
            on_model=lambda i, r: bar.update(1),
        )
    gaps_file = write_gaps(trained, str(out / "gaps.csv"))
    train_seconds = time.perf_counter() - start
    checkpoints = [str(out / "checkpoints" / r["checkpoint"]) for r in trained]
    document = run_population(
        checkpoints,
        train_file,
        settings,
        gaps={r["checkpoint"]: r["gap"] for r in trained},
        records=RecordFile(out / "transformers-records.jsonl", resume=args.resume),
        progress=progress,
        resamples=args.bootstrap,
        rho_scales=args.rho_scales,
    )
    for model, record in zip(document["models"], trained):
        model.update(
            hyperparameters=record["hyperparameters"],
            train_error=record["train_error"],
            test_error=record["test_error"],
            train_seconds=record["train_seconds"],
        )
    document = {
        "command": "reproduce transformers",
        "population": {
            "models": args.models,
            "seed": args.population_seed,
            "quick": args.quick,
            "data": "scikit-learn digits (8x8), "
            f"{len(split.train_labels)} train / {len(split.test_labels)} test",
            "gaps_csv": gaps_file,
        },
        **document,
    }
    document["timings"] = {
        "training": train_seconds,
        "sharpness": document["timings"]["total"],
        "total": time.perf_counter() - start,
    }
    label = f"{args.models} ViTs on 8x8 digits"
    if args.quick:
        label += " (--quick run: short training, few iterations; a check, not a result)"
    report(document, args, "transformers", label)
    return 0
