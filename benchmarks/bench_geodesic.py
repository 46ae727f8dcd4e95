"""The GL(h) exponential map of a sharpness ball (the path gap's): the reference's RK4 on
the point against the same RK4 in the span of the geodesic's start.

For batches of float64 points shaped as the sharpness engine stacks them (both factors
padded to equal rows), a horizontal vector of metric norm ``--norm`` per point, both
metrics: the reference (:meth:`geoopt_quotient.GLQuotient.expmap`, through the default
tangent space) and the tangent space of :meth:`geoopt_quotient.GLQuotient.tangent_space`
(``geoopt_quotient.manifolds._gl_geodesic``), timed interleaved, ``--repeats`` rounds,
medians, with the largest difference of their end points relative to the step's size.
Shapes: the tiny ViT's groups (8 points of 33 + 33 rows, h = 8), the 11M BERT's (32 of
257 + 257, h = 64) and one of the path gap's 4M-entry slices of BERT-base's (42 of
769 + 769, h = 64).

    python benchmarks/bench_geodesic.py --json benchmarks/results/cpu/geodesic.json
    python benchmarks/bench_geodesic.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from _timing import interleaved, medians

from geoopt_quotient import GLQuotient
from geoopt_quotient.manifolds.tangent import TangentSpace

SHAPES = {  # name: (points, rows per factor, h)
    "tiny ViT": (8, 33, 8),
    "11M BERT": (32, 257, 64),
    "BERT-base slice": (42, 769, 64),
}


def compare(points: int, rows: int, rank: int, metric: str, norm: float, repeats: int) -> dict:
    """Median seconds of both exponential maps at one random point, and their difference."""
    manifold = GLQuotient(rows, rows, metric)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(points, 2 * rows, rank, generator=generator, dtype=torch.float64)
    x /= rows**0.5
    u = manifold.proju(x, torch.randn(x.shape, generator=generator, dtype=torch.float64))
    u *= norm / manifold.norm(x, u, keepdim=True)
    reference, span = TangentSpace(manifold, x), manifold.tangent_space(x)
    times = interleaved(
        {"reference": lambda: reference.expmap(u), "span": lambda: span.expmap(u)}, repeats
    )
    expected = reference.expmap(u)
    step = float((expected - x).abs().max())
    difference = float((span.expmap(u) - expected).abs().max())
    seconds = medians(times)
    return {
        "seconds": seconds,
        "speedup": seconds["reference"] / seconds["span"],
        "max_difference_relative_to_step": difference / step,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--norm", type=float, default=0.1, help="metric norm of the vectors")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes (for CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = {"quick": (2, 12, 4)} if args.quick else SHAPES
    repeats = 1 if args.quick else args.repeats
    rows = {}
    for name, (points, size, rank) in shapes.items():
        for metric in ("inv", "mix"):
            row = compare(points, size, rank, metric, args.norm, repeats)
            rows[f"{name} {metric}"] = {"points": points, "rows": size, "h": rank} | row
            print(
                f"{name:<16} {metric}: reference {row['seconds']['reference']:.3f} s, span "
                f"{row['seconds']['span']:.3f} s, {row['speedup']:.1f}x (difference "
                f"{row['max_difference_relative_to_step']:.1e} of the step)"
            )
    report = {
        "benchmark": "geodesic",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": repeats,
        "shapes": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
