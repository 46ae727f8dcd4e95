"""``geoopt-quotient reproduce diagonal``: Table 1 / Figure 3 of the paper (diagonal networks)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

import torch

from ..._checks import GEODESIC_PATHS as PATHS
from ...experiments.diagonal.experiment import (
    DEFAULT_ITERS,
    DEFAULT_RHO,
    PAPER_TAU,
    PATH_SUFFIX,
    SETUPS,
    format_table,
    run_diagonal,
    summarize_runs,
)
from ...experiments.diagonal.train import DEFAULT_MAX_STEPS
from ...experiments.figures import sharpness_scatter
from ...experiments.population.rho_grid import (
    format_tau_by_rho,
    parse_rho_scales,
    tau_by_rho_figure,
)
from ...experiments.population.study import few_models_warning
from ...experiments.records import RecordFile
from .._runtime import add_output_arguments, add_threads_argument
from .._types import int_at_least, positive_float

__all__ = ["parse_paths", "register", "run"]

DESCRIPTION = """\
Train a population of diagonal linear networks y = x^T (u * v) on sparse regression
data (d features, 90%-sparse unit-norm ground truth), measure adaptive and geodesic
(inv, mix) worst-case sharpness of every model on its training set, and report Kendall's
tau between each and the test loss, beside the paper's Table 1 (-0.68, -0.83, -0.86).

setups (--setup):
  phase-transition  (default) n at the l1 recovery threshold (66 for d = 200), label
                    noise 0.1; full-batch GD from u0 = alpha * 1, v0 = 0 with alpha
                    log-uniform on [0.01, 1]: generalization is set by alpha
  step-size         after the public diagonal-network notebook of Andriushchenko et al.
                    (2023), github.com/tml-epfl/sgd-sparse-features: n = 0.4 d (80 for
                    d = 200), non-negative beta*, no noise, u0 = 0.1 * 1, v0 = 0; even
                    models full-batch GD (step log-uniform on [0.01, 2.72]), odd models
                    SGD with batch size 1 (step on [0.01, 0.25]), step / 4.8 after 10^4
                    steps: generalization is set by the training dynamics
  Both train every model to training loss <= 1e-5.

run times (--threads 1, 2 CPU cores shared with other jobs, 50 models, both paths):
  reproduce diagonal                                         about 70 s
  reproduce diagonal --setup step-size                       about 1 min
  ... --rho-scales 0.25,0.5,1,2,4 (five radii)               275 s (phase-transition),
                                                             168 s (step-size)
"""

EPILOG = """\
output:
  stdout   the tau table (mean ± std and per seed with --seeds K > 1) and the files
           written; nothing with --quiet; only the JSON document with --json -
  stderr   progress: bars for training and sharpness on a terminal, else a line every
           10% of the sharpness; not with --quiet or --json -; errors always
  files    OUT/diagonal-records.jsonl (one line per finished model and scale,
           written as it finishes; --resume continues from it after an interruption),
           OUT/diagonal.json (settings, per-model values, tau table, timings,
           versions) and OUT/diagonal.png (sharpness vs test loss, one panel per
           measure and path, first seed; the title gives the radii); with --seeds K > 1 also
           OUT/diagonal-seed<S>.png for every seed; --json FILE writes the same JSON
           to FILE as well. With --rho-scales also the table of tau against the
           radius on stdout and OUT/diagonal-tau-by-rho.png (tau and its 95%
           bootstrap band against the scale, one curve per measure and path).
  JSON     'runs' (one per seed: per-model values, 'tau' at the default radii,
           'by_scale' with every scale's values and tau, 'tau_by_rho'); with
           --rho-scales the top-level 'tau_by_rho' (first seed): records {"scale",
           "rho", "measure", "path", "tau", "ci": [low, high]}, path "straight" for
           adaptive, ci the 95% bootstrap interval over models (2000 resamples)
  With fewer than 8 models tau is coarse: a warning under the table, in the JSON
  ('warning') and in the figures' titles.

examples:
  geoopt-quotient reproduce diagonal
  geoopt-quotient reproduce diagonal --setup step-size --out runs/step-size
  geoopt-quotient reproduce diagonal --rho-scales 0.25,0.5,1,2,4 --paths exact
  geoopt-quotient reproduce diagonal --seeds 5 --out runs/diag
  geoopt-quotient reproduce diagonal --json result.json --quiet   # prints nothing
"""


def parse_paths(text: str) -> Tuple[str, ...]:
    """The ``--paths`` argument type: ``"exact,second_order"`` -> ``("exact", "second_order")``."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in PATHS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated paths among {', '.join(PATHS)}, got {text!r}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a path is repeated in {text!r}")
    return tuple(p for p in PATHS if p in names)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``diagonal`` to ``reproduce``'s targets."""
    parser = subparsers.add_parser(
        "diagonal",
        help="diagonal linear networks on sparse regression (Table 1, Figure 3)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_population_arguments(parser)
    _add_measure_arguments(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="(default cpu)")
    add_threads_argument(parser)
    add_output_arguments(
        parser,
        "diagonal-out",
        "diagonal",
        " (models are retrained, deterministically; only sharpness already measured is skipped)",
    )
    parser.set_defaults(handler=run, parser=parser, needs=("matplotlib",))


def _add_population_arguments(parser: argparse.ArgumentParser) -> None:
    """The populations trained: setup, size, dimension, seeds."""
    parser.add_argument(
        "--setup",
        choices=SETUPS,
        default=SETUPS[0],
        help=f"the population (above; default {SETUPS[0]})",
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


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """The balls and their maximiser (radii, paths, scales, iterations) and the training
    budget."""
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
        "--paths",
        type=parse_paths,
        default=PATHS,
        metavar="P1,P2",
        help="paths of the geodesic measures (inv, mix), comma-separated: exact (the "
        "exact geodesic) and second_order (the second-order retraction of the paper's "
        "Algorithm 1); every one is reported side by side (default exact,second_order)",
    )
    parser.add_argument(
        "--rho-scales",
        type=parse_rho_scales,
        default=None,
        metavar="S1,S2,...",
        help="also compute every measure at these multiples of its radius, on the same "
        "models and data (1 is always included): a table and a figure of tau against the "
        "radius, 'tau_by_rho' in the JSON; each scale costs about one default run's "
        "sharpness time (e.g. 0.25,0.5,1,2,4)",
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


def figure_title(settings: Dict[str, Any]) -> str:
    """What a run's figure shows: the population, the radius of every measure, a warning."""
    rho, rho_mix = settings["rho"], settings["rho_mix"]
    lines = [
        f"diagonal networks ({settings['setup']}): d = {settings['dim']}, "
        f"{settings['models']} models, seed {settings['seed']}",
        f"radii ρ: adaptive {rho:g}, inv {rho:g}, mix {rho_mix:g}; worst case, "
        f"{settings['iters']} Auto-PGD iterations",
    ]
    warning = few_models_warning(settings["models"], interval=False)
    if warning:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _figure(run: Dict[str, Any], path: str) -> str:
    """Sharpness against test loss: adaptive, then inv and mix along every path."""
    per_model = run["per_model"]
    panels = {"adaptive": per_model["sharpness_adaptive"]}
    for measure in ("inv", "mix"):
        for route in run["settings"]["paths"]:
            label = measure if route == "exact" else f"{measure} (second order)"
            panels[label] = per_model[f"sharpness_{measure}{PATH_SUFFIX[route]}"]
    title = figure_title(run["settings"])
    return sharpness_scatter(panels, per_model["test_loss"], path, ylabel="test loss", title=title)


def _rho_figure(run: Dict[str, Any], path: str) -> str:
    """Tau against the radius of the first seed."""
    settings = run["settings"]
    title = (
        f"diagonal networks ({settings['setup']}): d = {settings['dim']}, "
        f"{settings['models']} models, seed {settings['seed']}; tau against test loss"
    )
    warning = few_models_warning(settings["models"], interval=False)
    if warning:
        title += f"\nwarning: {warning}"
    return tau_by_rho_figure(run["tau_by_rho"], path, title=title, reference=PAPER_TAU)


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
            setup=args.setup,
            paths=args.paths,
            rho_scales=args.rho_scales,
            max_steps=args.max_steps,
            records=records,
        )
        for seed in seeds
    ]
    by_rho = args.rho_scales is not None
    summary = summarize_runs(runs)
    os.makedirs(args.out, exist_ok=True)
    figures = [_figure(runs[0], os.path.join(args.out, "diagonal.png"))]
    if len(runs) > 1:
        figures += [
            _figure(r, os.path.join(args.out, f"diagonal-seed{r['settings']['seed']}.png"))
            for r in runs
        ]
    if by_rho:
        figures.append(_rho_figure(runs[0], os.path.join(args.out, "diagonal-tau-by-rho.png")))
    document = {
        "command": "reproduce diagonal",
        "arguments": {k: v for k, v in vars(args).items() if k not in ("handler", "parser")},
        "summary": summary,
        "warning": few_models_warning(args.models, interval=False),
        **({"tau_by_rho": runs[0]["tau_by_rho"]} if by_rho else {}),
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
            f"Kendall tau between sharpness and test loss ({args.setup}): {args.models} "
            f"models, d = {args.dim}, seed{'s' if len(seeds) > 1 else ''} "
            f"{', '.join(map(str, seeds))}"
        )
        print(format_table(summary))
        if by_rho:
            for r in runs:
                print(f"\ntau against the radius, seed {r['settings']['seed']}:")
                print(format_tau_by_rho(r["tau_by_rho"], reference=PAPER_TAU))
        if document["warning"]:
            print(f"warning: {document['warning']}")
        written = [json_path, *figures] + ([args.json] if args.json else [])
        print(f"wrote {', '.join(written)} in {document['timings']['total']:.1f} s")
    return 0
