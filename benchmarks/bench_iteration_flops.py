"""The arithmetic an Auto-PGD iteration does beyond a forward and backward pass.

Time is the figure that matters, but it moves with the machine's load; the floating-point
operations of the matrix products (``torch.utils.flop_counter.FlopCounterMode``: matrix
products, batched products, attention, convolutions; element-wise work is not counted)
do not. For each model and measure this counts them for a plain forward and backward
pass and, from runs of ``--iters`` and ``--iters / 2`` iterations, for one more
Auto-PGD iteration, as :mod:`bench_iteration_overhead` times them. It reports:

The counter (``FlopCounterMode``) is told the products it misses by itself
(``_flops.PRODUCTS``: in-place forms, the CPU's attention); factorisations (eigh,
Cholesky) and element-wise work stay uncounted.

- ``plain_gflop``: one forward and backward pass per batch; ``forward_gflop``: a
  forward pass alone;
- ``marginal_gflop`` and ``marginal_ratio``: one more iteration, and over a pass: the
  iteration's cost on a machine whose products all run as fast as the model's, the
  lower bound of :mod:`bench_iteration_overhead`'s ``marginal_ratio`` where the
  products set the pace;
- ``geometry_gflop``: one more iteration less the passes it makes (forward passes at
  ``forward_gflop``, backward at the rest of a pass): the sharpness ball's own products,
  the quotient groups' geometry (batched products with the factors' ``h x h``
  matrices), which do not depend on the batch;
- ``floor_at_batch``: ``marginal_ratio`` at 1, 2, 4, 8 and 16 times the batch (keyed by
  its examples), the passes' arithmetic scaling with the examples and the geometry's
  not;
- ``fixed_gflop``: the work of a run that does not grow with its iterations, per batch,
  without the path gap's report; ``path_gap_gflop``: the report's, per batch, in the
  runs of ``--iters / 2`` and ``--iters`` iterations (its error control takes as many
  RK4 steps as each maximiser needs; counted apart, so that the iterations' count is
  not the difference of two runs' reports).

The counts do not depend on the threads, the load or the allocator. Models and batches
are those of :mod:`bench_iteration_overhead` (the same options).

    python benchmarks/bench_iteration_flops.py \\
        --json benchmarks/results/cpu/iteration_flops.json
    python benchmarks/bench_iteration_flops.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Dict, List

import torch
from _flops import counter
from bench_iteration_overhead import (
    KEEP,
    MEASURES,
    MODELS,
    bert_setup,
    plain_pass,
    sharpness_run,
    vit_setup,
    write_document,
)
from bench_path_gap_cost import PathGapWrapper

import geoopt_quotient as gq

#: The BERTs' batch sizes of the timed table (``bench_iteration_overhead.py``'s default
#: and the ``--bert-batch-size`` its BERT-base row was run with).
BERT_BATCH_SIZES = {"bert-11m": 8, "bert-base": 4}
#: Multiples of the measured batch at which ``floor_at_batch`` states the ratio.
FLOOR_MULTIPLES = (1, 2, 4, 8, 16)


def counted(fn) -> tuple[float, float, Any]:
    """``(GFLOP, of which the path gap's, result)`` of ``fn()``: the path gap's report
    counted apart (nested counters: its products are counted by both), since its error
    control takes as many RK4 steps as each maximiser needs, which differ between two
    runs and would be counted in the difference of their counts."""
    with counter() as counter_mode, PathGapWrapper(counter) as gap:
        out = fn()
    gap_gflop = sum(record.get_total_flops() for record in gap.records) / 1e9
    return counter_mode.get_total_flops() / 1e9, gap_gflop, out


def count_model(name: str, args) -> Dict[str, Any]:
    if name == "tiny-vit":
        model, batches, loss_fn = vit_setup(args.quick, args.vit_batch_size, args.vit_examples)
    else:
        size = args.bert_batch_size or BERT_BATCH_SIZES[name]
        model, batches, loss_fn = bert_setup(
            name, args.quick, size, args.seq_len, args.bert_batches
        )
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}
    count = len(batches)
    plain = counted(lambda: plain_pass(model, batches, loss_fn))[0] / count
    with torch.no_grad():
        forward = counted(lambda: [loss_fn(model, b) for b in batches])[0] / count
    examples = batches[0][0].shape[0]
    row: Dict[str, Any] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "batches": count,
        "batch_shape": list(batches[0][0].shape),
        "plain_gflop": plain,
        "forward_gflop": forward,
    }
    half = max(args.iters // 2, 1)
    for measure in MEASURES:
        whole, whole_gap, full = counted(
            lambda m=measure: sharpness_run(model, batches, loss_fn, m, plans, args)
        )
        part, part_gap, short = counted(
            lambda m=measure: sharpness_run(model, batches, loss_fn, m, plans, args, iters=half)
        )
        steps = (args.iters - half) * count
        marginal = ((whole - whole_gap) - (part - part_gap)) / steps
        forwards = (sum(full.forward_passes) - sum(short.forward_passes)) / steps
        backwards = (sum(full.backward_passes) - sum(short.backward_passes)) / steps
        geometry = marginal - forwards * forward - backwards * (plain - forward)
        row[measure] = {
            "marginal_gflop": marginal,
            "marginal_ratio": marginal / plain,
            "forward_passes_per_iteration": forwards,
            "backward_passes_per_iteration": backwards,
            "geometry_gflop": geometry,
            "floor_at_batch": floors(plain, marginal, geometry, examples),
            "fixed_gflop": (part - part_gap) / count - half * marginal,
            "path_gap_gflop": [part_gap / count, whole_gap / count],
        }
    return row


def floors(plain: float, marginal: float, geometry: float, examples: int) -> Dict[str, float]:
    """One more iteration over a pass at :data:`FLOOR_MULTIPLES` of the batch of
    ``examples``, keyed by the batch size: the passes' products scale with the examples,
    the geometry's do not."""
    return {
        str(k * examples): (marginal - geometry) / plain + geometry / (k * plain)
        for k in FLOOR_MULTIPLES
    }


def format_rows(rows: Dict[str, Dict[str, Any]]) -> str:
    lines = [
        f"{'model':10} {'measure':9} {'pass':>9} {'iteration':>10} {'ratio':>6} "
        f"{'geometry':>9} {'fixed':>9} {'path gap':>9}   ratio at batch "
        + ", ".join(f"{k}x" for k in FLOOR_MULTIPLES)
    ]
    for name, row in rows.items():
        for measure in MEASURES:
            cell = row[measure]
            floors = ", ".join(f"{v:.3f}" for v in cell["floor_at_batch"].values())
            lines.append(
                f"{name:10} {measure:9} {row['plain_gflop']:8.2f}G "
                f"{cell['marginal_gflop']:9.2f}G {cell['marginal_ratio']:6.3f} "
                f"{cell['geometry_gflop']:8.3f}G {cell['fixed_gflop']:8.2f}G "
                f"{cell['path_gap_gflop'][1]:8.2f}G   {floors}"
            )
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--iters", type=int, default=8, help="Auto-PGD iterations (default 8)")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (default 0.1)")
    parser.add_argument("--vit-examples", type=int, default=512)
    parser.add_argument("--vit-batch-size", type=int, default=128)
    parser.add_argument(
        "--bert-batch-size",
        type=int,
        help="sequences per batch (default: 8 for bert-11m, 4 for bert-base, as timed)",
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bert-batches", type=int, default=1)
    parser.add_argument("--keep-best-gradient", choices=sorted(KEEP), default="auto")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations (CI)")
    parser.add_argument("--json", help="write the counts to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.vit_examples = 2, 32
    torch.manual_seed(0)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    rows = {}
    for name in models:
        rows[name] = count_model(name, args)
        print(format_rows({name: rows[name]}), flush=True)
    document = write_document("iteration_flops", args, rows)
    ratios = [rows[m][k]["marginal_ratio"] for m in rows for k in MEASURES]
    print(f"one more iteration: {statistics.median(ratios):.3f} passes' GFLOP (median)")
    return document


if __name__ == "__main__":
    main()
