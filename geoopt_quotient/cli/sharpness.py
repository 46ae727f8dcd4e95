"""``geoopt-quotient sharpness``: adaptive and geodesic sharpness of a local classifier or
causal language model."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..experiments.causal_lm import load_causal_lm, load_text_batches, next_token_loss
from ..experiments.classifiers import (
    Batch,
    InputError,
    classification_loss,
    is_regression,
    load_checkpoint,
    load_examples,
    make_batches,
)
from ..experiments.population.study import StudySettings
from ..measures import Measure
from ._fsdp import (
    all_agree,
    fsdp_info,
    join_alone,
    probe_rows,
    rows_of_batches,
    shard_model,
)
from ._runtime import (
    add_dtype_argument,
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

__all__ = ["register", "run"]

DESCRIPTION = """\
Measure the adaptive and the geodesic worst-case sharpness of a local Hugging Face
checkpoint: a sequence classifier on a JSONL data set (--data: cross-entropy of the
labels), or a causal language model on a text file (--text: next-token cross-entropy
on blocks of --block-size tokens). The checkpoint directory must hold config.json,
safetensors weights (model.safetensors or a sharded index; pickled pytorch_model.bin
files are never loaded) and a tokenizer; nothing is downloaded. A checkpoint that
lacks weights of the model it is loaded as (a classifier's head, a language-model
head) is refused, never completed with random weights. The symmetries are discovered
from the model's structure, checked on the first batch (a random group element must
leave the logits unchanged) and printed as a table.

Each ball has its radius: --rho-adaptive, --rho-inv, --rho-mix, or --rho for all three;
the defaults are those of 'geoopt-quotient population'. The balls live on different
scales (the adaptive ball measures relative changes of every weight, the mix ball
absolute changes of the products W_q W_k^T and W_v W_o^T), so one radius rarely suits
all three.
"""

EPILOG = """\
--data FILE (sequence classifiers; JSONL, one object per line; blank lines skipped):
  {"text": "a sentence", "label": 1}
  {"text": "premise", "text_pair": "hypothesis", "label": "entailment"}
  labels: integers in [0, num_labels) or names from the config's label2id;
  numbers for regression models (num_labels = 1)

--text FILE (causal language models: config.json's architectures name a
  ...ForCausalLM or ...LMHeadModel class): any UTF-8 text. It is tokenised as one
  document with the checkpoint's tokenizer and cut into blocks of --block-size
  tokens (the remainder is dropped); --max-examples K blocks (default all) are drawn
  at random with --data-seed and put in batches of --batch-size blocks. The loss is
  the mean next-token cross-entropy over the positions of each block, computed in
  float32 or better. The same file and seeds give the same batches on every run.
  Released LLMs are mostly saved in bfloat16: give --dtype float32 (see --dtype).

output:
  stdout   the symmetry plan, then one line per measure; only the JSON document
           with --json -; nothing with --quiet
  stderr   progress bars (on a terminal, not with --quiet or --json -); errors.
           A data error (missing or malformed --data or --text, a --model
           directory that is not a checkpoint or lacks weights, e.g. a causal LM
           given --data) is one line 'geoopt-quotient sharpness: error: ...' and
           exit status 2; a failed symmetry check is exit status 1
  --json FILE   settings, plan (table, groups, notes), per measure the value,
           per-batch values, clean and perturbed losses and timings, versions

examples:
  geoopt-quotient sharpness --model ./my-bert --data dev.jsonl
  geoopt-quotient sharpness --model ./my-llama --text valid.txt --dtype float32 \\
      --block-size 256 --batch-size 8 --max-examples 64 --metric both
  geoopt-quotient sharpness --model ./my-bert --data dev.jsonl --metric both \\
      --rho-adaptive 0.2 --rho-inv 0.05 --rho-mix 0.01 --iters 20 \\
      --batch-size 32 --max-examples 512 --json result.json
  torchrun --nproc_per_node 4 -m geoopt_quotient sharpness --model ./my-bert \\
      --data dev.jsonl      # batches over 4 processes, same result

several processes (torchrun --nproc_per_node N): every process loads the model and
  the data; process r measures the batches r, r + N, r + 2N, ... (its share), the
  processes exchange their per-batch results, and process 0 prints and writes the
  result, the value of one process on all batches. With --device cuda each process
  uses the GPU of its LOCAL_RANK (cuda:0 on process 0, cuda:1 on process 1, ...) and
  the processes talk over nccl; on CPU, over gloo. A process that fails makes every
  process stop with an error that names it.

--fsdp (one checkpoint too large for one device, sharded over the processes):
  every process loads the checkpoint into CPU memory, the symmetries are found and
  checked there (on process 0's rows of the first batch; every process must pass),
  then each transformer block (the classes the model's _no_split_modules names, e.g.
  LlamaDecoderLayer) and the root are wrapped with FSDP2's fully_shard on a mesh of
  all processes, which moves each process's rows of every weight to its device. Each
  process passes its rows of every batch (rows [r B/N, (r+1) B/N) of a batch of B
  rows): one ball per batch, sharded like the model; the value is that of one
  process on the whole batches. Every batch must split evenly over the N processes
  (the mean of the processes' mean losses is the batch's mean loss only then):
  otherwise every process stops with a data error (exit status 2) that names a
  --batch-size, or a --max-examples, that works. Without torchrun, --fsdp runs in a
  mesh of one process (the same code path, nothing sharded). A 7B causal LM on one
  node of 8 GPUs, one block of 2048 tokens per GPU and batch:
  torchrun --nproc_per_node 8 -m geoopt_quotient sharpness --model ./llama-7b \\
      --text valid.txt --dtype float32 --block-size 2048 --batch-size 8 \\
      --max-examples 64 --metric mix --device cuda --fsdp --json llama-7b.json
"""


#: The command's line in ``geoopt-quotient --help`` (read from this source, unimported).
HELP = "adaptive and geodesic sharpness of a local sequence classifier or causal LM"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sharpness`` subcommand."""
    parser = subparsers.add_parser(
        "sharpness",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(parser)
    _add_measure_arguments(parser)
    _add_batch_arguments(parser)
    _add_run_arguments(parser)
    parser.set_defaults(handler=run, parser=parser)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and its data (``--data`` or ``--text``)."""
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument(
        "--data", metavar="FILE", help="JSONL examples of a sequence classifier, see below"
    )
    data.add_argument(
        "--text", metavar="FILE", help="UTF-8 text for a causal language model, see below"
    )


def _add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """The balls (metric, radii) and the maximiser's iterations."""
    parser.add_argument(
        "--metric",
        choices=("mix", "inv", "both"),
        default="mix",
        help="metric of the symmetry quotients (default mix)",
    )
    add_radius_arguments(parser, StudySettings())
    parser.add_argument(
        "--iters", type=int_at_least(1), default=20, help="Auto-PGD iterations per batch (20)"
    )


def _add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """How the data are cut into batches, and the seeds."""
    parser.add_argument(
        "--batch-size",
        type=int_at_least(1),
        default=16,
        metavar="B",
        help="examples (--data) or blocks (--text) per batch (default 16)",
    )
    parser.add_argument(
        "--max-examples",
        type=int_at_least(1),
        default=None,
        metavar="K",
        help="use the first K examples of --data, or K blocks of --text drawn at random "
        "(default all)",
    )
    parser.add_argument(
        "--max-length",
        type=int_at_least(1),
        default=None,
        metavar="L",
        help="--data: truncate to L tokens (default 128)",
    )
    parser.add_argument(
        "--block-size",
        type=int_at_least(2),
        default=None,
        metavar="T",
        help="--text: tokens per block, at most the model's positions (default 128)",
    )
    parser.add_argument(
        "--data-seed",
        type=int,
        default=None,
        metavar="S",
        help="--text: seed of the draw of blocks into batches (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="maximiser seed (default 0)")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the command runs, and what it writes."""
    parser.add_argument(
        "--path-report",
        action="store_true",
        help="also integrate the exact geodesic to each batch's maximiser and evaluate the "
        "loss there (path_gaps, exact_losses in the JSON; one more forward pass per batch). "
        "Default: only the estimated path gaps, which still warn (PathGapWarning)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device, e.g. cpu, cuda:0; under torchrun, cuda is each process's own GPU "
        "(LOCAL_RANK)",
    )
    add_dtype_argument(parser)
    parser.add_argument(
        "--state-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of Auto-PGD's iterates and gradients (default float32; float64 for a "
        "float64 model). bfloat16 halves "
        "their memory for a bfloat16 model (--dtype bfloat16 or auto on a bfloat16 "
        "checkpoint); they are still computed in float32, and the ball shrinks by up to "
        "2^-8 of its radius to leave room for the rounding. No effect on other dtypes",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model over the processes of torchrun with FSDP2 (each transformer "
        "block, then the root) and give each process its rows of every batch: for a "
        "checkpoint too large for one device. Every batch must split evenly over the "
        "processes. Without torchrun: one process in a mesh of one (the same code path)",
    )
    parser.add_argument(
        "--json",
        metavar="OUT",
        default=None,
        help="write the JSON document to OUT ('-': to stdout, and print nothing else)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking the discovered symmetries on the first batch (done by default)",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    add_threads_argument(parser)


# ---------------------------------------------------------------- the command
def _radius_key(measure: str) -> str:
    """The key of ``measure``'s radius in
    :func:`~geoopt_quotient.cli._runtime.radii_from_args`: ``rho_`` and its ball."""
    return f"rho_{Measure.parse(measure).ball}"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Handler of ``sharpness``.

    Data errors raise :class:`~geoopt_quotient.experiments.classifiers.InputError` (one line, exit
    status 2, printed by :func:`geoopt_quotient.cli.main`).
    """
    device = parse_device(args.device, parser)
    _fill_mode_options(args, parser)
    if args.text is not None:
        check_data_file("--text", args.text, arrays=False, expected="UTF-8 text")
    else:
        check_data_file("--data", args.data, arrays=False)
    rank, world = start_distributed(device)
    device = local_device(device, rank, world)
    if args.fsdp and world == 1:
        join_alone(device)
    with quiet_transformers(silent=args.quiet or args.json == "-" or rank > 0):
        return _run(args, parser, device, rank, world)


#: The options of one data mode only, with their defaults: (--data, --text).
_MODE_OPTIONS = {"max_length": (128, None), "block_size": (None, 128), "data_seed": (None, 0)}


def _fill_mode_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The defaults of the options of the data mode given; an argument error for an
    option of the other mode (it would be ignored)."""
    mode = 1 if args.text is not None else 0
    for name, defaults in _MODE_OPTIONS.items():
        if defaults[mode] is None and getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            parser.error(
                f"{flag} is for {('--text', '--data')[mode]}, not {('--data', '--text')[mode]}"
            )
        if getattr(args, name) is None:
            setattr(args, name, defaults[mode])


@dataclass
class _Loaded:
    """A model, its batches and loss, and what the output says about them."""

    model: torch.nn.Module
    batches: List[Batch]
    loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor]
    model_info: Dict[str, Any]
    data_info: Dict[str, Any]
    described: str


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _model_info(model: torch.nn.Module, task: str) -> Dict[str, Any]:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return {
        "class": type(model).__name__,
        "task": task,
        "parameters": _parameters(model),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _model_device(args: argparse.Namespace, device: torch.device) -> torch.device:
    """Where a model is loaded: on the CPU with ``--fsdp`` (``fully_shard`` moves each
    process's rows to ``device``), on ``device`` otherwise."""
    return torch.device("cpu") if args.fsdp else device


def _load_classifier(args: argparse.Namespace, device: torch.device) -> _Loaded:
    """A sequence classifier and its JSONL examples (``--data``)."""
    where = f"--model {args.model}"
    model, tokenizer = load_checkpoint(
        args.model, _model_device(args, device), where=where, dtype=args.dtype
    )
    if tokenizer is None:
        raise InputError(f"{where}: not a sequence classifier")
    examples = load_examples(
        args.data, model.config, args.max_examples, where=f"--data {args.data}"
    )
    regression = is_regression(model.config)
    batches = make_batches(
        examples, tokenizer, args.batch_size, args.max_length, device, regression
    )
    info = _model_info(model, "sequence-classification")
    info.update(num_labels=int(model.config.num_labels), regression=regression)
    return _Loaded(
        model,
        batches,
        classification_loss(regression),
        info,
        {"examples": len(examples), "batches": len(batches)},
        f"{len(examples)} examples in {len(batches)} batches",
    )


def _load_causal_lm(args: argparse.Namespace, device: torch.device) -> _Loaded:
    """A causal language model and blocks of its tokenised ``--text``."""
    model, tokenizer = load_causal_lm(
        args.model, _model_device(args, device), dtype=args.dtype, where=f"--model {args.model}"
    )
    batches = load_text_batches(
        args.text,
        model,
        tokenizer,
        block_size=args.block_size,
        batch_size=args.batch_size,
        max_blocks=args.max_examples,
        seed=args.data_seed,
        device=device,
        where=f"--text {args.text}",
    )
    blocks = sum(int(ids.shape[0]) for _, ids in batches)
    data = {"blocks": blocks, "block_size": args.block_size, "batches": len(batches)}
    described = f"{blocks} blocks of {args.block_size} tokens in {len(batches)} batches"
    return _Loaded(
        model, batches, next_token_loss, _model_info(model, "causal-lm"), data, described
    )


def share_batches(batches: List[Batch], rank: int, world: int) -> Tuple[List[Batch], Any]:
    """This process's batches (every ``world``-th from ``rank``) and the process group
    over which the sharpness functions gather the results; all batches and ``None`` for
    one process."""
    if world == 1:
        return batches, None
    if len(batches) < world:  # every process has all batches: all of them stop here
        raise InputError(
            f"{len(batches)} batches for {world} processes: each process needs at least one "
            "batch (lower --batch-size or the number of processes)"
        )
    import torch.distributed as dist

    return batches[rank::world], dist.group.WORLD


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    device: torch.device,
    rank: int,
    world: int,
) -> int:
    """The command on one process: load, find the symmetries, measure, report."""
    to_stdout = args.json == "-"
    silent = args.quiet or to_stdout or rank > 0
    start = time.perf_counter()
    loaded = (_load_causal_lm if args.text is not None else _load_classifier)(args, device)
    model, batches = loaded.model, loaded.batches
    if args.fsdp:  # checked on every process before any communication
        batches = rows_of_batches(batches, rank, world, args.batch_size)
    metrics = ("mix", "inv") if args.metric == "both" else (args.metric,)
    plan = _checked_plan(args, parser, loaded, batches, metrics[0], device)
    if plan is None:
        return 1
    if args.fsdp:
        model = shard_model(model, device)
    bound = plan.bind(model)
    if not silent:
        print(
            f"{loaded.model_info['class']} from {args.model}: {_parameters(model)} "
            f"{loaded.model_info['dtype']} parameters; {loaded.described}"
        )
        print(bound.summary())
        print()
    radii = radii_from_args(args, StudySettings())
    common = dict(iters=args.iters, seed=args.seed, progress=False if silent else None)
    if args.state_dtype != "float32":
        common["state_dtype"] = args.state_dtype
    if args.fsdp:
        share, common["process_group"] = batches, None
    else:
        share, common["process_group"] = share_batches(batches, rank, world)
    results = _measure(
        model, loaded.loss_fn, share, plan, bound, metrics, radii, common, args.path_report
    )
    document = _document(args, loaded, radii, bound, results, start)
    document["processes"] = world
    if args.fsdp:
        document["fsdp"] = fsdp_info(model, batches, world)
    if rank == 0:
        _report(args, document, results, radii, silent)
    return 0


def _checked_plan(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    loaded: _Loaded,
    batches: List[Batch],
    metric: str,
    device: torch.device,
) -> Any:
    """The symmetry plan of the model in ``metric`` (found and, unless ``--no-verify``,
    checked on the first batch), or ``None`` after printing why the check failed.

    With ``--fsdp`` the symmetries are found and checked on the model before it is sharded,
    on rows that every process has (rank 0's), and the processes agree on the verdict.
    """
    from ..symmetry import SymmetryVerificationError, find_symmetries

    model = loaded.model
    probe = probe_rows(loaded.batches[0][0], model) if args.fsdp else batches[0][0]
    plan, failure = None, None
    try:
        plan = find_symmetries(model, metric=metric, verify=args.verify, probe_inputs=probe)
    except SymmetryVerificationError as error:
        failure = error
    if failure is not None:
        print(f"{parser.prog}: error: symmetry check failed: {failure}", file=sys.stderr)
    if (failure is not None) if not args.fsdp else not all_agree(failure is None, device):
        return None
    return plan


def _measure(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor],
    share: List[Batch],
    plan: Any,
    bound: Any,
    metrics: Tuple[str, ...],
    radii: Dict[str, float],
    common: Dict[str, Any],
    path_report: bool,
) -> Dict[str, Any]:
    """Adaptive sharpness, then geodesic sharpness in each of ``metrics`` (``bound`` is
    ``plan`` bound in the first one, ``path_report`` as ``--path-report``), by measure
    name."""
    from ..sharpness import adaptive_sharpness, geodesic_sharpness

    results: Dict[str, Any] = {}
    adaptive = Measure()
    results[adaptive.name] = adaptive_sharpness(
        model, loss_fn, share, rho=radii[_radius_key(adaptive.name)], **common
    )
    for metric in metrics:
        # one discovery (and proof, on the unsharded model) for every metric
        symmetries = bound if metric == metrics[0] else plan.with_metric(metric).bind(model)
        geodesic = Measure(metric)
        results[geodesic.name] = geodesic_sharpness(
            model,
            loss_fn,
            share,
            rho=radii[_radius_key(geodesic.name)],
            metric=metric,
            symmetries=symmetries,
            path_report=path_report,
            **common,
        )
    return results


def _document(
    args: argparse.Namespace,
    loaded: _Loaded,
    radii: Dict[str, float],
    bound: Any,
    results: Dict[str, Any],
    start: float,
) -> Dict[str, Any]:
    """The JSON document of a run (``--json``), without the processes' entries."""
    import transformers

    from .. import __version__

    return {
        "command": "sharpness",
        "arguments": {k: v for k, v in vars(args).items() if k not in ("handler", "parser")},
        "model": loaded.model_info,
        "data": loaded.data_info,
        "radii": radii,
        "plan": {
            "table": bound.summary(),
            "groups": [
                {"kind": g.kind, "name": g.name, "shape": list(g.shape), "count": g.count}
                for g in bound.symmetric_groups
            ],
            "notes": list(bound.notes),
        },
        "results": {
            name: {k: v for k, v in r.to_dict().items() if k != "plan"}
            for name, r in results.items()
        },
        "timings": {"total": time.perf_counter() - start},
        "versions": {
            "geoopt_quotient": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def _report(
    args: argparse.Namespace,
    document: Dict[str, Any],
    results: Dict[str, Any],
    radii: Dict[str, float],
    silent: bool,
) -> None:
    """Write the document (``--json``) and print one line per measure (process 0)."""
    text = json.dumps(document, indent=1)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    elif args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    if not silent:
        width = max(len(n) for n in results)
        for name, r in results.items():
            clean = sum(r.clean_losses) / len(r.clean_losses)
            print(
                f"{name.ljust(width)}  sharpness {r.value:.6g}  "
                f"(rho {radii[_radius_key(name)]:g}, clean loss {clean:.6g}, {r.seconds:.1f} s)"
            )
        if args.json:
            print(f"wrote {args.json}")
