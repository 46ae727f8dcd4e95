"""Cost of the second-order path's report (the path gap) in forward and backward passes.

Every worst-case ``geodesic_sharpness`` call on ``path="second_order"`` ends each batch
with :func:`geoopt_quotient.sharpness.path_gap.path_gap`: the exact geodesic at the
maximiser and the loss there. This times that call alone (this process's CPU time, one
thread by default), interleaved with a plain forward and backward pass over the same
batch, and reports per model and metric the medians over ``--repeats`` and their ratio
(``passes``), with the reported gap and exact loss of the last run.

    python benchmarks/bench_path_gap_cost.py --models bert-11m --repeats 3
    python benchmarks/bench_path_gap_cost.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict, List

import torch
from bench_iteration_overhead import bert_setup, plain_pass, vit_setup

import geoopt_quotient as gq
from geoopt_quotient.sharpness import measure

MODELS = ("tiny-vit", "bert-11m")
METRICS = ("inv", "mix")


class PathGapTimer:
    """Wraps the engine's path gap, recording each call's CPU time and result."""

    def __init__(self):
        self.seconds: List[float] = []
        self.reports: List[Any] = []
        self.original = measure.path_gap

    def __call__(self, *args):
        start = time.process_time()
        out = self.original(*args)
        self.seconds.append(time.process_time() - start)
        self.reports.append(out)
        return out

    def __enter__(self):
        measure.path_gap = self
        return self

    def __exit__(self, *exc):
        measure.path_gap = self.original


def bench_model(name: str, args) -> Dict[str, Any]:
    if name == "tiny-vit":
        model, batches, loss_fn = vit_setup(args.quick, 128, 128)
    else:
        model, batches, loss_fn = bert_setup(name, args.quick, 8, 128, 1)
    batches = batches[:1]
    row: Dict[str, Any] = {}
    plain_pass(model, batches, loss_fn)  # warm-up
    for metric in METRICS:
        plan = gq.find_symmetries(model, metric=metric).bind(model)
        plain, gap = [], []
        with PathGapTimer() as timer:
            for _ in range(args.repeats):
                start = time.process_time()
                plain_pass(model, batches, loss_fn)
                plain.append(time.process_time() - start)
                timer.seconds.clear()
                gq.geodesic_sharpness(
                    model,
                    loss_fn,
                    batches,
                    metric=metric,
                    symmetries=plan,
                    rho=args.rho,
                    iters=args.iters,
                    progress=False,
                )
                gap.extend(timer.seconds)
        path_gap, exact_loss = timer.reports[-1]
        row[metric] = {
            "plain_seconds": statistics.median(plain),
            "path_gap_seconds": statistics.median(gap),
            "passes": statistics.median(gap) / statistics.median(plain),
            "path_gap": path_gap,
            "exact_loss": exact_loss,
        }
    return row


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=10, help="Auto-PGD iterations (default 10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.repeats, args.iters = "tiny-vit", 1, 2
    torch.set_num_threads(args.threads)
    report = {
        "benchmark": "path_gap_cost",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "models": {name: bench_model(name, args) for name in args.models.split(",")},
    }
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
