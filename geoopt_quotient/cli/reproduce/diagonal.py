"""``geoopt-quotient reproduce diagonal``: Table 1 / Figure 3 of the paper (diagonal networks)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch

from ...diagonal.experiment import (
    DEFAULT_ITERS,
    DEFAULT_RHO,
    MEASURES,
    format_table,
    run_diagonal,
    summarize_runs,
)
from ...diagonal.train import DEFAULT_MAX_STEPS
from ...population.study import few_models_warning
from ...records import RecordFile
from ...sharpness.stats import sharpness_scatter
from .._runtime import add_output_arguments, add_threads_argument
from .._types import int_at_least, positive_float

__all__ = ["register", "run"]

DESCRIPTION = """\
Train a population of diagonal linear networks y = x^T (u * v) on sparse regression
data (d features, 90%-sparse unit-norm ground truth, n at the l1 recovery threshold),
measure adaptive and geodesic (inv, mix) worst-case sharpness of every model on its
training set, and report Kendall's tau between each and the test loss, beside the
paper's Table 1 (-0.68, -0.83, -0.86).
"""

EPILOG = """\
output:
  stdout   the tau table (mean ± std and per seed with --seeds K > 1) and the files
           written; nothing with --quiet; only the JSON document with --json -
  stderr   tqdm progress bars for training and sharpness, only on a terminal and
           not with --quiet or --json -; errors always
  files    OUT/diagonal-records.jsonl (one line per finished model, written as it
           finishes; --resume continues from it after an interruption),
           OUT/diagonal.json (settings, per-model values, tau table, timings,
           versions) and OUT/diagonal.png (sharpness vs test loss, one panel per
           measure, first seed; the title gives the radii); with --seeds K > 1 also
           OUT/diagonal-seed<S>.png for every seed; --json FILE writes the same JSON
           to FILE as well
  With fewer than 8 models tau is coarse: a warning under the table, in the JSON
  ('warning') and in the figures' titles.

examples:
  geoopt-quotient reproduce diagonal
  geoopt-quotient reproduce diagonal --seeds 5 --out runs/diag
  geoopt-quotient reproduce diagonal --json result.json --quiet   # prints nothing
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``diagonal`` to ``reproduce``'s targets."""
    parser = subparsers.add_parser(
        "diagonal",
        help="diagonal linear networks on sparse regression (Table 1, Figure 3)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models", type=int_at_least(2), default=50, help="models per population (default 50)"
    )
    parser.add_argument(
        "--dim", type=int_at_least(2), default=200, help="number of features d (default 200)"
    )
    parser.add_argument(
        "--seed", type=int_at_least(0), default=0, help="first population seed (default 0)"
    )
    parser.add_argument(
        "--seeds",
        type=int_at_least(1),
        default=1,
        metavar="K",
        help="number of populations, seeds SEED..SEED+K-1 (default 1)",
    )
    parser.add_argument(
        "--rho",
        type=positive_float,
        default=DEFAULT_RHO,
        help=f"radius of the adaptive and inv balls (default {DEFAULT_RHO})",
    )
    parser.add_argument(
        "--rho-mix",
        type=positive_float,
        default=None,
        help="radius of the mix ball, in units of |beta*| = 1 (default: --rho)",
    )
    parser.add_argument(
        "--iters",
        type=int_at_least(1),
        default=DEFAULT_ITERS,
        help=f"Auto-PGD iterations per ball (default {DEFAULT_ITERS})",
    )
    parser.add_argument(
        "--max-steps",
        type=int_at_least(1),
        default=DEFAULT_MAX_STEPS,
        help=f"gradient-descent step budget per model (default {DEFAULT_MAX_STEPS})",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default cpu)")
    add_threads_argument(parser)
    add_output_arguments(
        parser,
        "diagonal-out",
        "diagonal",
        " (models are retrained, deterministically; only sharpness already measured is skipped)",
    )
    parser.set_defaults(handler=run, parser=parser)


def figure_title(settings: Dict[str, Any]) -> str:
    """What a run's figure shows: the population, the radius of every measure, a warning."""
    rho, rho_mix = settings["rho"], settings["rho_mix"]
    lines = [
        f"diagonal networks: d = {settings['dim']}, {settings['models']} models, "
        f"seed {settings['seed']}",
        f"radii ρ: adaptive {rho:g}, inv {rho:g}, mix {rho_mix:g}; worst case, "
        f"{settings['iters']} Auto-PGD iterations",
    ]
    warning = few_models_warning(settings["models"], interval=False)
    if warning:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _figure(run: Dict[str, Any], path: str) -> str:
    per_model = run["per_model"]
    panels = {name: per_model[f"sharpness_{name}"] for name in MEASURES}
    title = figure_title(run["settings"])
    return sharpness_scatter(panels, per_model["test_loss"], path, ylabel="test loss", title=title)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``reproduce diagonal``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: CUDA is not available here (torch.cuda.is_available() is False)"
        )
    to_stdout = args.json == "-"
    silent = args.quiet or to_stdout
    start = time.perf_counter()
    seeds: List[int] = [args.seed + k for k in range(args.seeds)]
    records = RecordFile(os.path.join(args.out, "diagonal-records.jsonl"), resume=args.resume)
    runs = [
        run_diagonal(
            models=args.models,
            dim=args.dim,
            seed=seed,
            rho=args.rho,
            rho_mix=args.rho_mix,
            iters=args.iters,
            device=args.device,
            progress=not silent,
            max_steps=args.max_steps,
            records=records,
        )
        for seed in seeds
    ]
    summary = summarize_runs(runs)
    os.makedirs(args.out, exist_ok=True)
    figures = [_figure(runs[0], os.path.join(args.out, "diagonal.png"))]
    if len(runs) > 1:
        figures += [
            _figure(r, os.path.join(args.out, f"diagonal-seed{r['settings']['seed']}.png"))
            for r in runs
        ]
    document = {
        "command": "reproduce diagonal",
        "arguments": {k: v for k, v in vars(args).items() if k not in ("handler", "parser")},
        "summary": summary,
        "warning": few_models_warning(args.models, interval=False),
        "runs": runs,
        "figures": figures,
        "timings": {
            "total": time.perf_counter() - start,
            "per_seed": [r["timings"]["total"] for r in runs],
        },
        "versions": runs[0]["versions"],
    }
    text = json.dumps(document, indent=1)
    json_path = os.path.join(args.out, "diagonal.json")
    with open(json_path, "w") as handle:
        handle.write(text + "\n")
    if args.json and not to_stdout:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    if to_stdout:
        sys.stdout.write(text + "\n")
    elif not args.quiet:
        print(
            f"Kendall tau between sharpness and test loss: {args.models} models, d = {args.dim}, "
            f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
        )
        print(format_table(summary))
        if document["warning"]:
            print(f"warning: {document['warning']}")
        written = [json_path, *figures] + ([args.json] if args.json else [])
        print(f"wrote {', '.join(written)} in {document['timings']['total']:.1f} s")
    return 0
