"""Cost of an Auto-PGD iteration relative to a plain forward and backward pass.

The physical limit of worst-case sharpness is one forward and backward pass of the model
per iteration. For each model this times, interleaved and repeated so that all see the
same machine load:

- ``plain``: forward and backward over the batches, parameter gradients (a training
  step without the optimizer), ``--plain-passes`` times over (default: ``--iters``, so
  that it runs about as long as a sharpness run and sees the same machine state);
- ``adaptive``, ``inv``, ``mix``: a worst-case sharpness run of ``--iters`` Auto-PGD
  iterations over the same batches.

It reports, as ratios to ``plain`` (medians over ``--repeats``):

- ``marginal_ratio``: what one more Auto-PGD iteration costs, from runs of ``--iters`` and
  ``--iters / 2`` iterations: (t(iters) - t(iters / 2)) / ((iters - iters / 2) x
  batches). The target of at most 1.15 is on this figure; ``marginal_ratios`` (JSON): the
  same from each repeat's pair of runs, whose spread is the figure's noise (a difference
  of two runs that both hold the fixed work, several passes on BERT-base);
- ``fixed_passes``: the work of a run that does not grow with the iterations (clean loss,
  base-point geometry, the path gap's exact geodesic on ``path="second_order"``, the last
  forward pass), per batch, in plain passes;
- ``ratio``: the whole run of ``--iters`` iterations per iteration (run time / (iters x
  batches)), both together;

and the passes each run made per batch, and the run time per backward pass made relative
to ``plain`` (``per_pass_ratio`` in the JSON), so that the overhead splits into extra
passes and the rest (geometry, parameter swapping).

Models: ``tiny-vit`` (the 18k-parameter ViT of ``reproduce transformers`` on 8x8 digits,
512 images in batches of 128), ``bert-11m`` (BERT with hidden size 256 and 4 layers,
random tokens) and ``bert-base`` (BERT-base sizes, random weights from its config);
nothing is downloaded.

    python benchmarks/bench_iteration_overhead.py \\
        --json benchmarks/results/cpu/iteration_overhead.json
    python benchmarks/bench_iteration_overhead.py --models tiny-vit --repeats 7
    python benchmarks/bench_iteration_overhead.py --quick      # seconds, for CI
    python benchmarks/bench_iteration_overhead.py --malloc retain \\
        --json benchmarks/results/cpu/iteration_overhead_retain.json

``--malloc retain`` keeps freed memory in the process (glibc's ``mallopt``, see
``_malloc.py``), for the plain passes and the sharpness runs alike: without it a
temporary above glibc's mmap threshold (at most 32 MiB) is faulted in page by page at
each allocation, which on BERT-base shows as seconds of system time per run.

``--breakdown`` also times, on vectors as large as each model, the element-wise work of
one adaptive iteration outside the pass (see ``update_breakdown``), next to a copy of
such a vector (the memory bandwidth's yardstick), interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
from _malloc import add_malloc_option, configure_malloc
from bench_sharpness_iteration import build_model

import geoopt_quotient as gq

MODELS = ("tiny-vit", "bert-11m", "bert-base")
MEASURES = ("adaptive", "inv", "mix")


def vit_setup(quick: bool, batch_size: int, examples: int):
    from geoopt_quotient.experiments.population.digits import (
        Hyperparameters,
        build_vit,
        load_digits_split,
    )

    hp = Hyperparameters(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        dropout=0.0,
        learning_rate=1e-3,
        weight_decay=0.0,
        batch_size=batch_size,
        epochs=1,
        label_smoothing=0.0,
        seed=0,
    )
    model = build_vit(hp).eval()
    split = load_digits_split()
    examples = 32 if quick else examples
    images = torch.from_numpy(split.train_images[:examples])
    labels = torch.from_numpy(split.train_labels[:examples])
    size = min(batch_size, examples)
    batches = [(images[i : i + size], labels[i : i + size]) for i in range(0, examples, size)]

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(pixel_values=batch[0]).logits, batch[1])

    return model, batches, loss_fn


def bert_setup(name: str, quick: bool, batch_size: int, seq_len: int, n_batches: int):
    from transformers import BertConfig, BertForSequenceClassification

    if quick:
        model, config = build_model(True, "cpu", torch.float32)
        batch_size, seq_len, n_batches = 4, 16, 1
    elif name == "bert-11m":
        config = BertConfig(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
        )
        config.num_labels = 3
        torch.manual_seed(0)
        model = BertForSequenceClassification(config).eval()
    else:  # BERT-base sizes
        model, config = build_model(False, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator),
            torch.randint(0, config.num_labels, (batch_size,), generator=generator),
        )
        for _ in range(n_batches)
    ]

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(input_ids=batch[0]).logits, batch[1])

    return model, batches, loss_fn


def plain_pass(model, batches, loss_fn, passes: int = 1) -> None:
    for _ in range(passes):
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)


KEEP = {"auto": None, "yes": True, "no": False}


def sharpness_run(
    model, batches, loss_fn, measure: str, plans, args, iters: int | None = None
) -> gq.SharpnessResult:
    common = dict(
        rho=args.rho,
        iters=iters or args.iters,
        progress=False,
        keep_best_gradient=KEEP[args.keep_best_gradient],
        share_storage=getattr(args, "share_storage", False),
    )
    if measure == "adaptive":
        return gq.adaptive_sharpness(model, loss_fn, batches, **common)
    return gq.geodesic_sharpness(
        model, loss_fn, batches, metric=measure, symmetries=plans[measure], **common
    )


#: The clocks of :func:`timed` (``--clock``): wall time, or this process's CPU time,
#: which other jobs on a shared machine disturb far less (with one thread, the two agree
#: on an idle machine).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_clock = CLOCKS["wall"]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = _clock()
    out = fn()
    return _clock() - start, out


def bench_model(name: str, args) -> Dict[str, Any]:
    if name == "tiny-vit":
        model, batches, loss_fn = vit_setup(args.quick, args.vit_batch_size, args.vit_examples)
    else:
        model, batches, loss_fn = bert_setup(
            name, args.quick, args.bert_batch_size, args.seq_len, args.bert_batches
        )
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}
    plain_passes = args.plain_passes or args.iters
    runs = {"plain": lambda: plain_pass(model, batches, loss_fn, plain_passes)}
    half = max(args.iters // 2, 1)
    for measure in MEASURES:
        runs[measure] = lambda m=measure: sharpness_run(model, batches, loss_fn, m, plans, args)
        runs[f"{measure} half"] = lambda m=measure: sharpness_run(
            model, batches, loss_fn, m, plans, args, iters=half
        )
    plain_pass(model, batches, loss_fn)  # warm-up: allocator, one-time initialisation
    for measure in MEASURES:
        sharpness_run(model, batches, loss_fn, measure, plans, args, iters=2)
    seconds: Dict[str, List[float]] = {k: [] for k in runs}
    results: Dict[str, gq.SharpnessResult] = {}
    order = list(runs)
    for repeat in range(args.repeats):
        for key in order[repeat % len(order) :] + order[: repeat % len(order)]:
            elapsed, out = timed(runs[key])
            seconds[key].append(elapsed)
            if key in MEASURES:
                results[key] = out
    per_iteration = len(batches) * args.iters
    plain = statistics.median(seconds["plain"]) / (len(batches) * plain_passes)
    row: Dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "batches": len(batches),
        "batch_shape": list(batches[0][0].shape),
        "plain_ms": 1e3 * plain,
        "plain_seconds": seconds["plain"],
        "plain_passes": plain_passes,
        "iters": args.iters,
        "repeats": args.repeats,
    }
    for measure in MEASURES:
        whole, part = (
            statistics.median(seconds[measure]),
            statistics.median(seconds[f"{measure} half"]),
        )
        iteration = whole / per_iteration
        result = results[measure]
        row[measure] = {
            "iteration_ms": 1e3 * iteration,
            "ratio": iteration / plain,
            **marginal_cost(whole, part, args.iters, half, len(batches), plain),
            "marginal_ratios": [
                marginal_cost(w, p, args.iters, half, len(batches), plain)["marginal_ratio"]
                for w, p in zip(seconds[measure], seconds[f"{measure} half"])
            ],
            "half_iters": half,
            "half_seconds": seconds[f"{measure} half"],
            "forward_passes_per_batch": statistics.mean(result.forward_passes),
            "backward_passes_per_batch": statistics.mean(result.backward_passes),
            "per_pass_ratio": statistics.median(seconds[measure])
            / (len(batches) * statistics.mean(result.backward_passes))
            / plain,
            "value": result.value,
            "seconds": seconds[measure],
        }
    return row


def marginal_cost(
    whole: float, part: float, iters: int, half: int, batches: int, plain: float
) -> Dict[str, float | None]:
    """One more iteration's seconds (``(whole - part) / ((iters - half) x batches)``) and
    the fixed seconds of a run per batch, in ms and over a plain pass; ``None`` where the
    two runs have the same length (``iters`` 1)."""
    if iters <= half:
        return dict.fromkeys(
            ("marginal_ms", "marginal_ratio", "fixed_ms_per_batch", "fixed_passes")
        )
    marginal = (whole - part) / ((iters - half) * batches)
    fixed = part / batches - half * marginal
    return {
        "marginal_ms": 1e3 * marginal,
        "marginal_ratio": marginal / plain,
        "fixed_ms_per_batch": 1e3 * fixed,
        "fixed_passes": fixed / plain,
    }


def flat_points(model: torch.nn.Module) -> List[torch.Tensor]:
    """The model's parameters as the ball's points of an adaptive measure: one flat,
    aligned buffer (the sharpness engine's layout)."""
    from geoopt_quotient.sharpness.layout import FlatBuffer

    params = [p.detach() for p in model.parameters()]
    names = [str(i) for i in range(len(params))]
    flat = FlatBuffer(names, [p.shape for p in params], params[0].dtype, params[0].device)
    return [flat.filled(params)]


def update_breakdown(model, repeats: int) -> Dict[str, float]:
    """Median seconds of the adaptive update's element-wise steps on the model's size,
    with its parameters in one flat group as in the engine's ball.

    As the engine runs them on the CPU: ``riemannian gradient and gram``: c² ⊙ g written
    into g and the 3 × 3 Gram matrix of (ξ, g, ξ_prev), in one sweep (at a point of ones,
    where repeated calls keep the values; the work is the same at any point), as after a
    restart or every ``MAX_DERIVED_RUN`` iterations; ``riemannian gradient and gram
    column``: the same with only the gradient's column of the Gram matrix summed (the
    iterates' entries derived from the previous update's), as in the other iterations;
    ``combination and perturbed point``: ξ_next = w₁ξ + w₂g + w₃ξ_prev into ξ_prev's
    buffer and θ + ξ_next into the perturbed point's buffer, in one sweep; ``copy``: one
    vector copied, the yardstick.
    """
    from geoopt_quotient.sharpness import apgd

    manifold = gq.AdaptiveEuclidean()
    points = flat_points(model)  # as the engine's ball
    ball, _ = apgd.prepare_ball([(p, manifold) for p in points], 0.1, "straight")
    unit, _ = apgd.prepare_ball([(torch.ones_like(p), manifold) for p in points], 0.1, "straight")
    generator = torch.Generator().manual_seed(0)
    xi, xi_prev, grads = (ball.clip(ball.random(generator, 1.0)) for _ in range(3))
    weights = torch.tensor([0.5, 0.25, -0.25]).unbind()
    copies = [torch.empty_like(p) for p in points]
    steps: Dict[str, Callable[[], Any]] = {
        "riemannian gradient and gram": lambda: unit.riemannian_gradient_gram_(grads, xi, xi_prev),
        "riemannian gradient and gram column": lambda: [
            space.egrad2rgrad_column_((a, g, p), 1)
            for space, a, g, p in zip(unit.spaces, xi, grads, xi_prev)
        ],
        "combination and perturbed point": lambda: [
            apgd.combine_(p, (a, g, p), weights, (x, ball.perturbed_buffer(i)))
            for i, (x, a, g, p) in enumerate(zip(points, xi, grads, xi_prev))
        ],
        "copy": lambda: torch._foreach_copy_(copies, xi),
    }
    seconds: Dict[str, List[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            seconds[key].append(timed(step)[0])
    return {k: statistics.median(v) for k, v in seconds.items()}


def format_breakdown(rows: Dict[str, Dict[str, Any]]) -> str:
    lines = ["element-wise work of one adaptive iteration outside the pass (medians)"]
    for name, row in rows.items():
        plain = row["plain_ms"] / 1e3
        cells = ", ".join(
            f"{k} {1e3 * v:.1f} ms ({100 * v / plain:.1f}%)" for k, v in row["breakdown"].items()
        )
        lines.append(f"{name}: {cells} of a {row['plain_ms']:.0f} ms pass")
    return "\n".join(lines)


def format_rows(rows: Dict[str, Dict[str, Any]], threads: int) -> str:
    lines = [
        f"per-iteration cost relative to a plain forward+backward ({threads} thread(s), "
        "medians of interleaved repeats)",
        "(one more iteration; fixed work per batch in passes; the whole run per iteration)",
        f"{'model':<10}{'params':>12}{'plain':>11}  "
        + "".join(f"{m + ' (iteration, fixed, run, passes)':>42}" for m in MEASURES),
    ]
    for name, row in rows.items():
        cells = "".join(
            f"{_ratio(row[m]['marginal_ratio']):>9} {_ratio(row[m]['fixed_passes'], ''):>6}p "
            f"{row[m]['iteration_ms']:>8.1f} ms {row[m]['ratio']:>5.2f}x "
            f"{row[m]['forward_passes_per_batch']:>4.0f}f/{row[m]['backward_passes_per_batch']:.0f}b"
            for m in MEASURES
        )
        lines.append(f"{name:<10}{row['parameters']:>12,}{row['plain_ms']:>8.1f} ms  {cells}")
    return "\n".join(lines)


def _ratio(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Per iteration: (t(iters) - t(iters/2)) / ((iters - iters/2) x batches) over "
        "a plain pass; the whole run's ratio is (run time / (iters x batches)) / "
        "(plain time / (plain passes x batches)).",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS)
    )
    parser.add_argument("--iters", type=int, default=20, help="Auto-PGD iterations (default 20)")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (default 0.1)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    parser.add_argument(
        "--plain-passes",
        type=int,
        default=0,
        help="forward and backward passes per timing of the plain reference (default: --iters)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--vit-examples", type=int, default=512)
    parser.add_argument("--vit-batch-size", type=int, default=128)
    parser.add_argument("--bert-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bert-batches", type=int, default=1)
    parser.add_argument(
        "--keep-best-gradient",
        choices=tuple(KEEP),
        default="auto",
        help="keep the best iterate's gradient (auto: up to 1 GiB; default auto)",
    )
    parser.add_argument(
        "--share-storage",
        action="store_true",
        help="share_storage=True: the base point in the model's storage, the symmetry "
        "groups perturbed there and restored after each pass",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the adaptive update's element-wise steps on each model's size",
    )
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall time, or the process's CPU time (for a shared machine; default wall)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the models of an existing --json file that this run does not measure "
        "(each model's row records its own iterations, repeats and batch shape), e.g. "
        "BERT-base at a smaller batch beside the other models",
    )
    add_malloc_option(parser)
    args = parser.parse_args(argv)
    malloc = configure_malloc(args.malloc)  # before the models are built
    global _clock
    _clock = CLOCKS[args.clock]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    if args.quick:
        args.iters, args.repeats = 2, 1
        names = [n for n in names if n != "bert-base"]
    torch.set_num_threads(args.threads)
    rows = {name: bench_model(name, args) for name in names}
    print(format_rows(rows, args.threads))
    if args.breakdown:
        for name, row in rows.items():
            model = vit_setup(True, 1, 1)[0] if name == "tiny-vit" else None
            if model is None:
                model = bert_setup(name, args.quick, 1, 1, 1)[0]
            row["breakdown"] = update_breakdown(model, max(args.repeats, 3))
        print(format_breakdown(rows))
    if args.merge and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            kept = json.load(f)
        kept_malloc = (kept.get("malloc") or {}).get("malloc", "default")
        if kept_malloc != args.malloc:
            parser.error(f"--merge: {args.json} was measured with --malloc {kept_malloc}")
        rows = {**kept.get("models", {}), **rows}
    return write_document("iteration_overhead", args, rows, malloc)


def write_document(
    benchmark: str,
    args,
    rows: Dict[str, Any],
    malloc: Dict[str, Any] | None = None,
    **extra: Any,
) -> Dict[str, Any]:
    """The benchmark's JSON document (settings, ``extra``, rows, threads, versions, and the
    malloc setting of :func:`~_malloc.configure_malloc` where given), written to
    ``args.json`` when given."""
    document = {
        "benchmark": benchmark,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "merge")},
        **extra,
        "models": rows,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    if malloc is not None:
        document["malloc"] = malloc
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    return document


if __name__ == "__main__":
    main()
