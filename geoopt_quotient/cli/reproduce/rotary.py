"""``geoopt-quotient reproduce rotary``: sharpness vs generalization in rotary transformers."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace

import torch

from ...experiments.population.modular import OPERATIONS, ModularTask, PopulationSpec
from ...experiments.population.rotary import (
    ROTARY_MEASURES,
    RotaryStudySettings,
    format_rotary_tau,
    run_rotary_study,
    write_rotary_files,
)
from .._runtime import add_output_arguments, add_threads_argument, quiet_transformers
from .._types import int_at_least, positive_float
from ..population import package_versions

__all__ = ["QUICK_SETTINGS", "QUICK_SPEC", "register", "run"]

#: ``--quick``: a small task, narrow models, 2 seeds x 4 runs, few iterations (a check).
QUICK_SPEC = PopulationSpec(
    task=ModularTask(p=23),
    widths=(16, 32),
    fractions=(0.3, 0.8),
    learning_rates=(2e-3, 5e-3),
    thresholds=(0.1, 0.03),
    max_steps=600,
)
QUICK_SETTINGS = RotaryStudySettings(
    iters=3,
    batch_size=64,
    max_examples=128,
    reference_models=1,
    rtol=0.2,
    max_evals=12,
    resamples=200,
)
QUICK_RUNS, QUICK_SEEDS = 4, (0, 1)
DEFAULT_RUNS, DEFAULT_SEEDS = 14, (0, 1, 2)

DESCRIPTION = """\
Train a population of small Llama-style transformers (rotary attention, grouped-query
attention with 4 query and 2 key-value heads, gated MLP) on modular arithmetic
(a + b mod p), each run saved the first time its training loss reaches each threshold,
so that the models of one threshold have the same training loss and differ in test
accuracy; recipes (width, training fraction, weight decay, learning rate, seed) drawn
per run and population seed. Then, per threshold: radii calibrated so that each
measure's worst-case sharpness is --target times the clean loss (median over reference
models), adaptive sharpness, geodesic inv and mix (attention symmetries) and geodesic
inv with every symmetry (kinds="all": also the MLP's GL(1)) for every model, and
Kendall's tau of each against the generalization gap with bootstrap intervals, the
partial tau given the training loss, and the same for sharpness / clean loss.
Runs on CPU; nothing is downloaded.
"""

EPILOG = f"""\
output:
  stdout   the tau tables; nothing with --quiet; only the JSON document with --json -
  stderr   progress of training and sharpness: bars on a terminal, else a line every 10%
  files    OUT/checkpoints/seed-S/model-XX/ (run.json, and per threshold loss-T/: a
           Hugging Face checkpoint with training.json), OUT/rotary-records.jsonl,
           OUT/rotary.json (models: recipe, train/test loss and accuracy, gaps, every
           measure's value, radius and plan; per threshold: calibration and tau table),
           OUT/rotary.csv, OUT/rotary-tau.csv, OUT/rotary-loss-T.png per threshold.
  --resume continues interrupted training runs from their last state and reuses the
  calibrations and models measured with the same settings.

defaults: {len(DEFAULT_SEEDS)} population seeds x {DEFAULT_RUNS} runs, p = 59, thresholds
0.03 and 0.01, target {RotaryStudySettings.target}, {RotaryStudySettings.iters} Auto-PGD \
iterations on {RotaryStudySettings.max_examples} training pairs.
--quick: p = 23, {len(QUICK_SEEDS)} seeds x {QUICK_RUNS} runs, {QUICK_SETTINGS.iters} \
iterations (a check of the pipeline, not a result).

examples:
  geoopt-quotient reproduce rotary --out rotary-out
  geoopt-quotient reproduce rotary --resume --out rotary-out   # after an interruption
  geoopt-quotient reproduce rotary --quick --json - > quick.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``rotary`` to ``reproduce``'s targets."""
    parser = subparsers.add_parser(
        "rotary",
        help="a population of rotary transformers on modular arithmetic: sharpness vs gap",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--runs",
        type=int_at_least(1),
        default=None,
        metavar="M",
        help=f"runs per population seed (default {DEFAULT_RUNS}; {QUICK_RUNS} with --quick)",
    )
    parser.add_argument(
        "--population-seeds",
        type=_seeds,
        default=None,
        metavar="S,S,...",
        help="seeds of the order of the pairs and of the recipes (default "
        f"{','.join(map(str, DEFAULT_SEEDS))})",
    )
    parser.add_argument("--p", type=int_at_least(3), default=None, help="the modulus (59)")
    parser.add_argument(
        "--operation", choices=tuple(OPERATIONS), default=None, help="a o b mod p (add)"
    )
    parser.add_argument(
        "--target",
        type=positive_float,
        default=RotaryStudySettings.target,
        help="calibration: sharpness = TARGET x clean loss (default %(default)s)",
    )
    parser.add_argument("--iters", type=int_at_least(1), default=None, help="Auto-PGD iterations")
    parser.add_argument(
        "--bootstrap",
        type=int_at_least(10),
        default=None,
        metavar="N",
        help="bootstrap resamples of the intervals (default 2000)",
    )
    parser.add_argument("--quick", action="store_true", help="a small check of the pipeline")
    add_threads_argument(parser)
    add_output_arguments(parser, "rotary-out", "rotary", " (and continue the training runs)")
    parser.set_defaults(handler=run, parser=parser, needs=("matplotlib",))


def _seeds(text: str):
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seeds as 0,1,2") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct seeds >= 0")
    return seeds


def _configuration(args: argparse.Namespace):
    """(spec, settings, seeds, runs) from the arguments, --quick's where not given."""
    spec = QUICK_SPEC if args.quick else PopulationSpec()
    settings = QUICK_SETTINGS if args.quick else RotaryStudySettings()
    task = replace(
        spec.task,
        **{k: v for k, v in (("p", args.p), ("operation", args.operation)) if v is not None},
    )
    spec = replace(spec, task=task)
    changes = {"target": args.target}
    if args.iters is not None:
        changes["iters"] = args.iters
    if args.bootstrap is not None:
        changes["resamples"] = args.bootstrap
    settings = replace(settings, **changes)
    seeds = args.population_seeds or (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    runs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    return spec, settings, seeds, runs


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``reproduce rotary`` (``main`` applies ``--threads``)."""
    silent = args.quiet or args.json == "-"
    spec, settings, seeds, runs = _configuration(args)
    with quiet_transformers(silent=True):
        try:
            document = run_rotary_study(
                args.out,
                spec,
                seeds,
                runs,
                settings,
                resume=args.resume,
                progress=not silent,
                measures=tuple(ROTARY_MEASURES),
            )
        except ValueError as error:
            parser.error(str(error))
    document["command"] = "reproduce rotary" + (" --quick" if args.quick else "")
    document["environment"] = {
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        **package_versions(),
    }
    label = "--quick run (a check, not a result): " if args.quick else ""
    written = write_rotary_files(document, args.out, label)
    text = json.dumps(document, indent=1, default=float)
    if args.json == "-":
        sys.stdout.write(text + "\n")
        return 0
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    if not args.quiet:
        print(format_rotary_tau(document))
        print("wrote " + ", ".join([written[-1], *written[:-1]]))
    return 0
