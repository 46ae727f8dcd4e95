"""One more Auto-PGD iteration on the CPU with the update's blocks of several sizes.

On the CPU, the adaptive metric's sweeps (the Gram matrices of the gradient and the
iterates, :data:`geoopt_quotient.manifolds.adaptive.GRAM_BLOCK`) and the update's
combination (:data:`geoopt_quotient.sharpness.apgd.COMBINE_BLOCK`) go over the ball's
flat vectors block by block, so that a block of each operand stays in a core's cache
across the block's operations. This measures what the block size does to one more
iteration, in one process: for each round, each size in turn (rotated order) sets both
constants and times runs of ``--iters`` and ``--iters / 2`` iterations of ``adaptive``
and ``inv`` on the 11M BERT of ``bench_iteration_overhead.py`` (hidden size 256, 4
layers, 8 x 128 random tokens), in this process's CPU time; a plain forward and backward
pass is timed in every round too. Reported: the median over rounds of (t(iters) -
t(iters / 2)) / (iters - iters / 2) over the median pass, per size and measure; the
JSON also holds every round's figure, each value after ``--iters`` iterations, and
the cache sizes of CPU 0 as Linux gives them.

The values do not depend on COMBINE_BLOCK (entry by entry); GRAM_BLOCK moves float32
Gram entries by rounding and sets the ball's rounding margin
(:class:`~geoopt_quotient.sharpness.apgd.NormError`), which follows it here.

    python benchmarks/bench_block_sizes.py --malloc retain \\
        --json benchmarks/results/cpu/block_sizes.json
    python benchmarks/bench_block_sizes.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from _malloc import add_malloc_option, configure_malloc
from bench_iteration_overhead import bert_setup, plain_pass, sharpness_run, write_document

import geoopt_quotient as gq
from geoopt_quotient.manifolds import adaptive
from geoopt_quotient.sharpness import apgd

MEASURES = ("adaptive", "inv")


def cache_sizes() -> Dict[str, str]:
    """The caches of CPU 0 (level and type: size), as Linux's sysfs gives them."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = {}
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            sizes[f"L{level} {kind}"] = (index / "size").read_text().strip()
        except OSError:
            continue
    return sizes


def set_blocks(log2: int) -> None:
    """Both CPU block sizes to ``2**log2`` entries (read at each call)."""
    adaptive.GRAM_BLOCK = apgd.GRAM_BLOCK = apgd.COMBINE_BLOCK = 1 << log2


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Both constants are set together; the package's defaults are "
        f"GRAM_BLOCK = 2**{adaptive.GRAM_BLOCK.bit_length() - 1} and COMBINE_BLOCK = "
        f"2**{apgd.COMBINE_BLOCK.bit_length() - 1} entries.",
    )
    parser.add_argument(
        "--blocks",
        default="18,17,16",
        help="block sizes to compare, as powers of two (default 18,17,16: 256k, 128k, 64k)",
    )
    parser.add_argument("--iters", type=int, default=6, help="Auto-PGD iterations (default 6)")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (default 0.1)")
    parser.set_defaults(keep_best_gradient="auto")  # sharpness_run's, the package's default
    parser.add_argument("--rounds", type=int, default=8, help="rounds (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    add_malloc_option(parser)
    parser.add_argument("--quick", action="store_true", help="a tiny BERT, 2 rounds (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    malloc = configure_malloc(args.malloc)
    sizes = [int(b) for b in args.blocks.split(",") if b.strip()]
    if not sizes or any(not 4 <= b <= 30 for b in sizes):
        parser.error("--blocks: powers of two between 4 and 30, comma-separated")
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    model, batches, loss_fn = bert_setup("bert-11m", args.quick, 8, 128, 1)
    plans = {"inv": gq.find_symmetries(model, metric="inv").bind(model)}

    def run(measure: str, iters: int) -> float:
        return sharpness_run(model, batches, loss_fn, measure, plans, args, iters).value

    def seconds(fn, *a) -> tuple[float, Any]:
        start = time.process_time()
        out = fn(*a)
        return time.process_time() - start, out

    defaults = (adaptive.GRAM_BLOCK, apgd.GRAM_BLOCK, apgd.COMBINE_BLOCK)
    half = max(args.iters // 2, 1)
    passes: List[float] = []
    marginal = {b: {m: [] for m in MEASURES} for b in sizes}
    values = {b: {} for b in sizes}
    try:
        plain_pass(model, batches, loss_fn)
        for measure in MEASURES:  # warm-up: one-time initialisation
            run(measure, 2)
        for r in range(rounds):
            passes.append(seconds(plain_pass, model, batches, loss_fn)[0])
            for b in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
                set_blocks(b)
                for measure in MEASURES:
                    full, values[b][measure] = seconds(run, measure, args.iters)
                    short, _ = seconds(run, measure, half)
                    marginal[b][measure].append((full - short) / (args.iters - half))
            print(f"round {r + 1} of {rounds}", flush=True)
    finally:
        adaptive.GRAM_BLOCK, apgd.GRAM_BLOCK, apgd.COMBINE_BLOCK = defaults
    plain_s = statistics.median(passes)
    rows = {
        f"2^{b}": {
            "entries": 1 << b,
            **{
                m: {
                    "marginal_ratio": statistics.median(marginal[b][m]) / plain_s,
                    "marginal_ratios": [t / plain_s for t in marginal[b][m]],
                    "value": values[b][m],
                }
                for m in MEASURES
            },
        }
        for b in sizes
    }
    print(f"one more iteration in passes of {plain_s:.3f} s ({args.threads} thread(s)):")
    for name, row in rows.items():
        cells = " / ".join(f"{row[m]['marginal_ratio']:.3f}" for m in MEASURES)
        print(f"  blocks of {name:>5} entries: {cells}  ({' / '.join(MEASURES)})")
    return write_document(
        "block_sizes",
        args,
        rows,
        malloc,
        package_blocks={"GRAM_BLOCK": defaults[0], "COMBINE_BLOCK": defaults[2]},
        plain_s=plain_s,
        caches=cache_sizes(),
    )


if __name__ == "__main__":
    main()
