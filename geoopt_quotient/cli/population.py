"""``geoopt-quotient population``: sharpness versus generalization over many checkpoints."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from ..experiments.classifiers import ARRAY_SUFFIXES, TEXT_SUFFIXES
from ..experiments.population.report import REFERENCE, figure_title, write_population_files
from ..experiments.population.rho_grid import format_tau_by_rho, parse_rho_scales
from ..experiments.population.study import (
    FORMATS,
    PAPER_TAU,
    PROTOCOLS,
    JointModels,
    StudySettings,
    find_checkpoints,
    format_tau_table,
    read_gaps,
    run_population,
)
from ..experiments.records import RecordFile
from ._fsdp import join_alone, shard_for_study
from ._runtime import (
    add_dtype_argument,
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
    "format_sharpness_to_clean_loss",
    "package_versions",
    "register",
    "report",
    "run",
    "settings_from_args",
]

DESCRIPTION = """\
For a directory of classifier checkpoints (Hugging Face directories, or the model-soups
release's CLIP state dicts with --format model-soups), measure adaptive sharpness and
geodesic sharpness in the inv and mix metrics of every model, on the same training
examples in the same batches for all, and report Kendall's tau between each measure and
the generalization gap (test error - train error) with a bootstrap confidence interval
over models, beside the paper's Table 1. The gaps come from a CSV (--gaps), or are
measured here on --train and --test data (--train-images and --test-images for
model-soups). The symmetries of each model are discovered from its structure (the Q/K
and V/O groups of every attention block) and checked on its first batch. --protocol
sets the paper's evaluation protocol. Causal language models are measured by their
next-token loss on plain text, their gaps by next-token errors (see --data).
"""

EPILOG = """\
inputs:
  --checkpoints DIR   --format hf (default): one sub-directory per model, each with
                      config.json and model.safetensors (pickled weights are never
                      loaded) and, for text models, a tokenizer; sub-directories without
                      config.json are ignored. A checkpoint that lacks weights of its
                      model (e.g. a classifier saved without its head) is refused,
                      never completed with random weights. --dtype float32 loads
                      bfloat16 checkpoints in float32, which sharpness needs.
                      --format model-soups: one FILE.pt per model, the state dict of
                      model-soups' CLIP wrapper (OpenAI CLIP ViT keys under 'model.',
                      'classification_head.'), read with torch.load(weights_only=True):
                      a pickle that would run code is refused. The architecture (width,
                      layers, heads = width / 64, patch and image size, embedding size,
                      classes) is read off the shapes; forward: image features,
                      L2-normalised, then the classification head
  --data FILE         the sharpness examples: .jsonl text ({"text", "label"},
                      optional "text_pair") for sequence classifiers, .npz arrays
                      ("labels" plus model inputs such as "pixel_values"), or plain
                      UTF-8 text (e.g. .txt) for causal LMs (config.json's
                      architectures name a ...ForCausalLM or ...LMHeadModel): the
                      loss is the next-token cross-entropy on --max-examples blocks
                      of --max-length tokens drawn with a fixed seed, and the error
                      of --train and --test the next-token error over all blocks
  --train-images DIR, --test-images DIR
                      (model-soups) ImageFolder trees: DIR/CLASS/IMAGE, the sorted class
                      directories are the labels 0, 1, ... (ImageNet synsets sort into
                      the usual class order; every class needs its directory), CLIP's
                      preprocessing. Sharpness: --max-examples images of --train-images
                      drawn with a fixed seed, the same for every model. Gaps: error on
                      every image of --test-images minus that of --train-images
  --gaps FILE.csv     header 'checkpoint,gap' (or 'checkpoint,train_error,test_error');
                      'checkpoint' is the sub-directory's (or .pt file's) name

protocols (explicit --max-examples, --batch-size, --iters override them):
  --protocol imagenet  2048 training images in batches of 256, 20 Auto-PGD iterations
  --protocol mnli      1024 training examples in batches of 128, 20 iterations
  without --protocol   1024 examples in batches of 128, 20 iterations

output:
  stdout   the tau table; nothing with --quiet; only the JSON document with --json -
  stderr   progress over models: a bar on a terminal, else a line every 10% (not with
           --quiet or --json -); errors. A data error (a missing or malformed data
           file, a --checkpoints directory without 3 checkpoints, a gaps CSV that does
           not match them, a checkpoint that cannot be loaded) is one line
           'geoopt-quotient population: error: ...' and exit status 2
  files    OUT/population-records.jsonl (one line per finished model; --resume
           continues from it), OUT/population.json (settings, per-model values and
           gaps, tau with CI, timings, versions), OUT/population.png (sharpness vs
           gap, one panel per measure; the title gives the radii)
  with --rho-scales also: the table of tau against the radius and that of mean
  sharpness / mean clean loss per scale (stdout), OUT/population-tau-by-rho.png (tau
  with its 95% bootstrap band against the scale, one curve per measure and path,
  ImageNet's Table 1 values as thin lines), and in the JSON 'rho_scales', per model
  'by_scale', 'sharpness_to_clean_loss' and the top-level 'tau_by_rho': records
  {"scale", "rho", "measure", "path", "tau", "ci": [low, high]}, one per (scale,
  measure, path); the path of adaptive sharpness (and of the no-curvature ablations)
  is "straight", that of the geodesic measures --path. Each (model, scale) is one line
  of the records file: --resume recomputes no finished scale. Each scale costs about
  the sharpness time of a run without --rho-scales.
  With fewer than 8 models, tau is coarse and its bootstrap interval unreliable
  (it can collapse to a single value): the table marks tau with '!', the JSON has
  a 'warning', and the figure's title says so.

examples:
  geoopt-quotient population --checkpoints runs/ --data train.jsonl --gaps gaps.csv
  geoopt-quotient population --checkpoints runs/ --train train.npz --test test.npz \\
      --rho-adaptive 0.2 --rho-inv 0.05 --rho-mix 0.01 --ablations --out study/
  geoopt-quotient population --checkpoints runs/ --data train.jsonl --gaps gaps.csv \\
      --rho-scales 0.3,1,3,10    # tau against the radius: 4 scales of every radius
  torchrun --nproc_per_node 4 -m geoopt_quotient population --checkpoints runs/ \\
      --data train.jsonl --gaps gaps.csv    # models shared out over 4 processes
  torchrun --nproc_per_node 8 -m geoopt_quotient population --checkpoints llamas/ \\
      --data train.txt --gaps gaps.csv --dtype float32 --max-length 2048 \\
      --batch-size 8 --max-examples 64 --device cuda --fsdp   # each model over 8 GPUs
  geoopt-quotient population --checkpoints soups/ --format model-soups \\
      --train-images imagenet-train-subset/ --test-images imagenet-val/ \\
      --protocol imagenet --device cuda --workers 8

--fsdp (checkpoints too large for one device; --format hf): every process measures
  every model, one after the other, instead of each process its own models. Each
  process loads the checkpoint into CPU memory; the symmetries of each metric are
  found there and the first checked on process 0's rows of the first batch (every
  process must pass); then each transformer block and the root are wrapped with
  FSDP2's fully_shard on a mesh of all processes, as by 'sharpness --fsdp'. Each
  process passes its rows of every sharpness batch (one ball per batch, sharded like
  the model), so every batch must split evenly over the processes: otherwise a data
  error (exit status 2) names a --batch-size or --max-examples that works. Measured
  gaps (--train, --test) are the sharded model's errors on whole batches, every
  process passing all of them. Process 0 writes the files. Without torchrun: one
  process in a mesh of one (the same code path).
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
        "--rho-scales",
        type=parse_rho_scales,
        default=None,
        metavar="S1,S2,...",
        help="also measure every model at these multiples of every radius, on the same "
        "batches (1 is always included): tau against the radius as a table, a figure and "
        "'tau_by_rho' in the JSON; each scale costs about the sharpness time of a run "
        "without it (e.g. 0.3,1,3,10)",
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
        dtype=getattr(args, "dtype", defaults.dtype),
    )


#: The command's line in ``geoopt-quotient --help`` (read from this source, unimported).
HELP = "sharpness vs generalization gap over a directory of checkpoints (Kendall tau)"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``population`` subcommand."""
    parser = subparsers.add_parser(
        "population",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoints", required=True, metavar="DIR", help="see 'inputs'")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="hf",
        help="hf: Hugging Face checkpoint directories (default); model-soups: CLIP "
        "state dicts (*.pt) of the model-soups release, with image folders",
    )
    parser.add_argument(
        "--protocol",
        choices=tuple(PROTOCOLS),
        help="the paper's evaluation protocol, see 'protocols' (explicit flags override it)",
    )
    parser.add_argument("--data", metavar="FILE", help="sharpness examples (default: --train)")
    gaps = parser.add_argument_group(
        "generalization gaps (--gaps, or --train and --test; model-soups: --train-images "
        "and --test-images)"
    )
    gaps.add_argument("--gaps", metavar="FILE.csv", help="measured gaps, see 'inputs'")
    gaps.add_argument("--train", metavar="FILE", help="training data, to measure the gaps")
    gaps.add_argument("--test", metavar="FILE", help="test data, to measure the gaps")
    gaps.add_argument(
        "--train-images",
        metavar="DIR",
        help="(model-soups) training images, ImageFolder layout: the sharpness examples, "
        "and the training error",
    )
    gaps.add_argument(
        "--test-images", metavar="DIR", help="(model-soups) test images, for the test error"
    )
    parser.add_argument(
        "--workers",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="(model-soups) processes decoding images (default 0: the main process)",
    )
    parser.add_argument(
        "--max-length",
        type=int_at_least(1),
        default=128,
        metavar="L",
        help="truncate text to L tokens; causal LMs: blocks of L tokens (default 128)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking each model's discovered symmetries on its first batch",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device, e.g. cpu, cuda:0; under torchrun, cuda is each process's own GPU "
        "(LOCAL_RANK)",
    )
    add_dtype_argument(parser)
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="measure each model with all processes of torchrun together, sharded over them "
        "with FSDP2, each process passing its rows of every batch (instead of sharing the "
        "models out over the processes): for checkpoints too large for one device; see "
        "'--fsdp' below",
    )
    add_threads_argument(parser)
    add_study_arguments(parser, StudySettings())
    # None: not given; filled from --protocol or the defaults by apply_protocol
    parser.set_defaults(**dict.fromkeys(PROTOCOL_FLAGS))
    add_output_arguments(parser, "population-out", "population", ", data and weights")
    parser.set_defaults(handler=run, parser=parser, needs=("matplotlib",))


def package_versions() -> Dict[str, str]:
    """The versions of this package, geoopt, torch and transformers, by name."""
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


def report(document: Dict[str, Any], args: argparse.Namespace, stem: str, label: str) -> None:
    """Write OUT/STEM.json, OUT/STEM.png and the tables OUT/STEM.csv, OUT/STEM-tau.csv
    (and --json), print the tau table.

    The files are :func:`~geoopt_quotient.experiments.population.report.write_population_files`'s;
    the figure's title is :func:`figure_title` of ``label``; the JSON document keeps it
    as ``figure_title``, and the torch threads of the run as ``threads``.
    """
    import torch

    document["threads"] = torch.get_num_threads()
    document["versions"] = package_versions()
    written = write_population_files(document, args.out, stem, label)
    text = Path(written[-1]).read_text().rstrip("\n")
    if args.json == "-":
        sys.stdout.write(text + "\n")
        return
    if args.json:
        Path(args.json).write_text(text + "\n")
    if not args.quiet:
        models = len(document["models"])
        print(f"Kendall tau between sharpness and generalization gap, {models} models:")
        print(format_tau_table(document["tau"]))
        if "tau_by_rho" in document:
            _print_by_rho(document)
        written = [written[-1], *written[:-1]] + ([args.json] if args.json else [])
        print("wrote " + ", ".join(written))


def format_sharpness_to_clean_loss(rows: Sequence[Mapping[str, Any]]) -> str:
    """One row per measure, one column per scale: mean sharpness / mean clean loss."""
    scales = sorted({r["scale"] for r in rows})
    measures = list(dict.fromkeys(r["measure"] for r in rows))
    ratio = {(r["measure"], r["scale"]): r["ratio"] for r in rows}
    width = max(len("measure"), *map(len, measures)) + 2
    head = f"{'measure':<{width}}" + "".join(f"{f'scale {s:g}':>12}" for s in scales)
    lines = [head, "-" * len(head)]
    for measure in measures:
        cells = "".join(f"{ratio[measure, s]:>12.3g}" for s in scales)
        lines.append(f"{measure:<{width}}{cells}")
    return "\n".join(lines)


def _print_by_rho(document: Dict[str, Any]) -> None:
    print("\nKendall tau against the radius (radius = scale x the radius of each measure):")
    print(format_tau_by_rho(document["tau_by_rho"], reference=PAPER_TAU[REFERENCE]))
    mnli = ", ".join(f"{k} {v:+.2f}" for k, v in PAPER_TAU["MNLI, 35 BERT-base"].items())
    print(f"reference: {REFERENCE} (Table 1); MNLI, 35 BERT-base: {mnli}")
    print("\nmean sharpness / mean clean loss (which regime each scale is in):")
    print(format_sharpness_to_clean_loss(document["sharpness_to_clean_loss"]))


#: The options a --protocol sets (argparse destinations), unless given explicitly.
PROTOCOL_FLAGS = ("max_examples", "batch_size", "iters")


def apply_protocol(args: argparse.Namespace, defaults: StudySettings) -> None:
    """Fill the protocol options not given on the command line: from ``--protocol``, else
    from ``defaults``."""
    protocol = PROTOCOLS.get(args.protocol or "", {})
    for name in PROTOCOL_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, protocol.get(name, getattr(defaults, name)))


def _image_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """Check the model-soups inputs; return the sharpness image folder."""
    if args.dtype != "auto":
        parser.error("--dtype is for --format hf; model-soups checkpoints load as saved")
    if args.fsdp:
        parser.error(
            "--fsdp is for --format hf: model-soups CLIP models declare no transformer "
            "blocks to shard"
        )
    for flag in ("data", "train", "test"):
        if getattr(args, flag):
            parser.error(
                f"--{flag} is for --format hf; with --format model-soups give "
                "--train-images DIR (and --test-images DIR, or --gaps FILE.csv)"
            )
    if not args.train_images:
        parser.error("--format model-soups needs --train-images DIR (the sharpness examples)")
    if args.gaps and args.test_images:
        parser.error("give either --gaps or --test-images, not both")
    if not args.gaps and not args.test_images:
        parser.error(
            "the gaps are needed: --gaps FILE.csv, or --test-images DIR (with --train-images)"
        )
    return args.train_images


def _gap_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Optional[str]:
    """Check the gap options; return the sharpness data file (image folder for model-soups)."""
    if args.format == "model-soups":
        return _image_inputs(args, parser)
    if args.train_images or args.test_images:
        parser.error("--train-images and --test-images need --format model-soups")
    if args.gaps and (args.train or args.test):
        parser.error("give either --gaps or --train and --test, not both")
    if not args.gaps and not (args.train and args.test):
        parser.error("the gaps are needed: --gaps FILE.csv, or --train FILE and --test FILE")
    data = args.data or args.train
    if data is None:
        parser.error("--data is required with --gaps")
    return data


def _check_data(args: argparse.Namespace, data: str) -> None:
    """Fail at once, before any model is loaded, on a data file or folder that cannot serve."""
    if args.format == "model-soups":
        from ..experiments.images import read_image_folder

        for flag, root in (("--train-images", data), ("--test-images", args.test_images)):
            if root is not None:
                read_image_folder(root, where=f"{flag} {root}")
        return
    for flag, path in (("--data", data), ("--train", args.train), ("--test", args.test)):
        if path is not None:
            plain = not path.lower().endswith(TEXT_SUFFIXES + ARRAY_SUFFIXES)
            check_data_file(flag, path, expected="UTF-8 text" if plain else None)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``population``.

    Options that do not fit together are argument errors (usage and message); data
    errors raise :class:`~geoopt_quotient.experiments.classifiers.InputError` (one line, printed by
    :func:`geoopt_quotient.cli.main`), also from inside a model's measurement.
    """
    data = _gap_inputs(args, parser)
    device = parse_device(args.device, parser)
    apply_protocol(args, StudySettings())
    try:
        settings = settings_from_args(args, StudySettings())
    except ValueError as error:
        parser.error(str(error))
    checkpoints = find_checkpoints(args.checkpoints, args.format)
    names = [os.path.basename(c) for c in checkpoints]
    gaps = read_gaps(args.gaps, names) if args.gaps else None
    _check_data(args, data)
    images = args.format == "model-soups"
    train, test = (args.train_images, args.test_images) if images else (args.train, args.test)
    if gaps is not None:
        train = test = None
    rank, world = start_distributed(device)
    device = local_device(device, rank, world)
    joint = None
    if args.fsdp:
        if world == 1:
            join_alone(device)
        joint = JointModels(functools.partial(shard_for_study, device=device))
    silent = args.quiet or args.json == "-" or rank > 0
    records = RecordFile(Path(args.out) / "population-records.jsonl", resume=args.resume)
    with quiet_transformers(silent=silent):
        document = run_population(
            checkpoints,
            data,
            settings,
            gaps=gaps,
            train_data=train,
            test_data=test,
            records=records,
            device=device,
            progress=not silent,
            resamples=args.bootstrap,
            format=args.format,
            workers=args.workers,
            rho_scales=args.rho_scales,
            joint=joint,
        )
    if rank > 0:
        return 0
    document = {"command": "population", "checkpoints": args.checkpoints, **document}
    document["fsdp"] = args.fsdp
    where = os.path.basename(os.path.normpath(args.checkpoints)) or args.checkpoints
    report(document, args, "population", f"{len(checkpoints)} checkpoints in {where}/")
    return 0
