"""``geoopt-quotient population``: sharpness versus generalization over many checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from ..population.study import (
    MEASURES,
    StudySettings,
    find_checkpoints,
    format_tau_table,
    read_gaps,
    run_population,
    scatter_figure,
)
from ..records import RecordFile
from ._runtime import (
    add_output_arguments,
    add_radius_arguments,
    add_threads_argument,
    check_data_file,
    local_device,
    parse_device,
    quiet_transformers,
    radii_from_args,
    start_distributed,
)
from ._types import int_at_least

__all__ = [
    "add_study_arguments",
    "figure_title",
    "register",
    "report",
    "run",
    "settings_from_args",
]

DESCRIPTION = """\
For a directory of Hugging Face classifier checkpoints, measure adaptive sharpness and
geodesic sharpness in the inv and mix metrics of every model, on the same training
examples in the same batches for all, and report Kendall's tau between each measure and
the generalization gap (test error - train error) with a bootstrap confidence interval
over models, beside the paper's Table 1. The gaps come from a CSV (--gaps), or are
measured here on --train and --test data. The symmetries of each model are discovered
from its structure and checked on its first batch.
"""

EPILOG = """\
inputs:
  --checkpoints DIR   one sub-directory per model, each with config.json and
                      model.safetensors (pickled weights are never loaded) and, for
                      text models, a tokenizer; sub-directories without config.json
                      are ignored
  --data FILE         the sharpness examples: .jsonl text ({"text", "label"},
                      optional "text_pair") for sequence classifiers, or .npz arrays
                      ("labels" plus model inputs such as "pixel_values")
  --gaps FILE.csv     header 'checkpoint,gap' (or 'checkpoint,train_error,test_error');
                      'checkpoint' is the sub-directory's name

output:
  stdout   the tau table; nothing with --quiet; only the JSON document with --json -
  stderr   a progress bar over models (on a terminal; not with --quiet or --json -);
           errors. A data error (a missing or malformed data file, a --checkpoints
           directory without 3 checkpoints, a gaps CSV that does not match them, a
           checkpoint that cannot be loaded) is one line 'geoopt-quotient
           population: error: ...' and exit status 2
  files    OUT/population-records.jsonl (one line per finished model; --resume
           continues from it), OUT/population.json (settings, per-model values and
           gaps, tau with CI, timings, versions), OUT/population.png (sharpness vs
           gap, one panel per measure; the title gives the radii)
  With fewer than 8 models, tau is coarse and its bootstrap interval unreliable
  (it can collapse to a single value): the table marks tau with '!', the JSON has
  a 'warning', and the figure's title says so.

examples:
  geoopt-quotient population --checkpoints runs/ --data train.jsonl --gaps gaps.csv
  geoopt-quotient population --checkpoints runs/ --train train.npz --test test.npz \\
      --rho-adaptive 0.2 --rho-inv 0.05 --rho-mix 0.01 --ablations --out study/
  torchrun --nproc_per_node 4 -m geoopt_quotient population --checkpoints runs/ \\
      --data train.jsonl --gaps gaps.csv    # models sharded over 4 processes
"""


def add_study_arguments(parser: argparse.ArgumentParser, defaults: StudySettings) -> None:
    """The sharpness settings of a population study, with ``defaults`` shown in --help."""
    group = parser.add_argument_group("sharpness")
    add_radius_arguments(group, defaults)
    group.add_argument(
        "--iters",
        type=int_at_least(1),
        default=defaults.iters,
        metavar="N",
        help=f"Auto-PGD iterations per batch (default {defaults.iters})",
    )
    group.add_argument(
        "--kind", choices=("worst", "average"), default=defaults.kind, help="(default worst)"
    )
    group.add_argument(
        "--path",
        choices=("second_order", "exact"),
        default=defaults.path,
        help="geodesic: second-order retraction or exact exponential map (default "
        f"{defaults.path})",
    )
    group.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=defaults.batch_size,
        metavar="B",
        help=f"(default {defaults.batch_size})",
    )
    group.add_argument(
        "--max-examples",
        type=int_at_least(1),
        default=defaults.max_examples,
        metavar="K",
        help=f"sharpness on the first K examples of the data (default {defaults.max_examples})",
    )
    group.add_argument(
        "--ablations",
        action="store_true",
        help="also measure the paper's Appendix G ablations: geodesic sharpness with the "
        "quotient norm off (adaptive ball, geodesic path) and with the curvature off "
        "(quotient ball, straight path), per metric",
    )
    group.add_argument(
        "--seed", type=int, default=defaults.seed, help="maximiser seed, the same for all models"
    )
    group.add_argument(
        "--bootstrap",
        type=int_at_least(1),
        default=2000,
        metavar="N",
        help="bootstrap resamples of the tau confidence interval (default 2000)",
    )


def settings_from_args(args: argparse.Namespace, defaults: StudySettings) -> StudySettings:
    """The :class:`StudySettings` given on the command line."""
    return StudySettings(
        **radii_from_args(args, defaults),
        iters=args.iters,
        kind=args.kind,
        path=args.path,
        seed=args.seed,
        batch_size=args.batch_size,
        max_examples=args.max_examples,
        max_length=getattr(args, "max_length", defaults.max_length),
        ablations=args.ablations,
        verify=getattr(args, "verify", defaults.verify),
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``population`` subcommand."""
    parser = subparsers.add_parser(
        "population",
        help="sharpness vs generalization gap over a directory of checkpoints (Kendall tau)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoints", required=True, metavar="DIR", help="see 'inputs'")
    parser.add_argument("--data", metavar="FILE", help="sharpness examples (default: --train)")
    gaps = parser.add_argument_group("generalization gaps (--gaps, or --train and --test)")
    gaps.add_argument("--gaps", metavar="FILE.csv", help="measured gaps, see 'inputs'")
    gaps.add_argument("--train", metavar="FILE", help="training data, to measure the gaps")
    gaps.add_argument("--test", metavar="FILE", help="test data, to measure the gaps")
    parser.add_argument(
        "--max-length",
        type=int_at_least(1),
        default=128,
        metavar="L",
        help="truncate text to L tokens (default 128)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking each model's discovered symmetries on its first batch",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda:0")
    add_threads_argument(parser)
    add_study_arguments(parser, StudySettings())
    add_output_arguments(parser, "population-out", "population", ", data and weights")
    parser.set_defaults(handler=run, parser=parser)


def _versions() -> Dict[str, str]:
    import geoopt
    import torch
    import transformers

    from .. import __version__

    return {
        "geoopt_quotient": __version__,
        "geoopt": geoopt.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def figure_title(document: Dict[str, Any], label: str) -> str:
    """The scatter figure's title: ``label``, the radius of every measure, the warning.

    ``label`` says what the models are (e.g. ``"6 ViTs on 8x8 digits (--quick run)"``).
    """
    settings = document["settings"]
    radii = ", ".join(f"{name} {settings[f'rho_{name}']:g}" for name in ("adaptive", "inv", "mix"))
    steps = "Auto-PGD iterations" if settings["kind"] == "worst" else "samples"
    lines = [label, f"radii ρ: {radii}; {settings['kind']} case, {settings['iters']} {steps}"]
    if document.get("warning"):
        lines.append(f"warning: {document['warning']}")
    return "\n".join(lines)


def report(document: Dict[str, Any], args: argparse.Namespace, stem: str, label: str) -> None:
    """Write OUT/STEM.json and OUT/STEM.png (and --json), print the tau table.

    The figure's title is :func:`figure_title` of ``label``; the JSON document keeps it
    as ``figure_title``, and the torch threads of the run as ``threads``.
    """
    import torch

    document["threads"] = torch.get_num_threads()
    document["versions"] = _versions()
    out = Path(args.out)
    title = figure_title(document, label)
    figure = scatter_figure(document["models"], MEASURES, str(out / f"{stem}.png"), title)
    document["figure"] = figure
    document["figure_title"] = title
    text = json.dumps(document, indent=1, default=float)
    json_path = out / f"{stem}.json"
    json_path.write_text(text + "\n")
    if args.json == "-":
        sys.stdout.write(text + "\n")
        return
    if args.json:
        Path(args.json).write_text(text + "\n")
    if not args.quiet:
        models = len(document["models"])
        print(f"Kendall tau between sharpness and generalization gap, {models} models:")
        print(format_tau_table(document["tau"]))
        written = [str(json_path), figure] + ([args.json] if args.json else [])
        print("wrote " + ", ".join(written))


def _gap_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Optional[str]:
    """Check the gap options; return the sharpness data file."""
    if args.gaps and (args.train or args.test):
        parser.error("give either --gaps or --train and --test, not both")
    if not args.gaps and not (args.train and args.test):
        parser.error("the gaps are needed: --gaps FILE.csv, or --train FILE and --test FILE")
    data = args.data or args.train
    if data is None:
        parser.error("--data is required with --gaps")
    return data


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``population``.

    Options that do not fit together are argument errors (usage and message); data
    errors raise :class:`~geoopt_quotient.classifiers.InputError` (one line, printed by
    :func:`geoopt_quotient.cli.main`), also from inside a model's measurement.
    """
    data = _gap_inputs(args, parser)
    device = parse_device(args.device, parser)
    try:
        settings = settings_from_args(args, StudySettings())
    except ValueError as error:
        parser.error(str(error))
    checkpoints = find_checkpoints(args.checkpoints)
    names = [os.path.basename(c) for c in checkpoints]
    gaps = read_gaps(args.gaps, names) if args.gaps else None
    for flag, path in (("--data", data), ("--train", args.train), ("--test", args.test)):
        if path is not None:
            check_data_file(flag, path)
    rank, world = start_distributed(device)
    device = local_device(device, rank, world)
    silent = args.quiet or args.json == "-" or rank > 0
    records = RecordFile(Path(args.out) / "population-records.jsonl", resume=args.resume)
    with quiet_transformers(silent=silent):
        document = run_population(
            checkpoints,
            data,
            settings,
            gaps=gaps,
            train_data=args.train,
            test_data=args.test,
            records=records,
            device=device,
            progress=not silent and sys.stderr.isatty(),
            resamples=args.bootstrap,
        )
    if rank > 0:
        return 0
    document = {"command": "population", "checkpoints": args.checkpoints, **document}
    where = os.path.basename(os.path.normpath(args.checkpoints)) or args.checkpoints
    report(document, args, "population", f"{len(checkpoints)} checkpoints in {where}/")
    return 0
