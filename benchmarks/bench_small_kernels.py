"""Where the quotient groups' small operations cost more than their arithmetic (CPU).

The thresholds that choose between two ways of doing the same thing are measured here,
each pair timed interleaved, medians of ``--repeats``:

- ``products``: ``out.baddbmm_(a, b)`` against ``out.add_(torch.bmm(a, b))`` for
  :math:`n \\times h` by :math:`h \\times h` products of several heads, on strided views
  as the factors of a point are (:func:`geoopt_quotient.manifolds._linalg.add_product`
  takes the second up to ``SMALL_PRODUCT_FLOPS`` multiply-adds per head);
- ``write_back``: a plan's write-back of its points into the parameters and its
  backward, with strided copies against the index map, on the models of
  ``bench_iteration_overhead`` (``BoundPlan.scatter`` takes strided copies from
  ``strided.MIN_ENTRIES_PER_PIECE`` entries per piece);
- ``geometry``: one call of each fused GL(h) operation of an Auto-PGD evaluation at the
  tiny ViT's base point (retraction, its pullback, the Riemannian gradient in place,
  the 3 x 3 Gram matrix), per group, and on the two groups stacked into one batch as
  the sharpness engine's layout does (``geoopt_quotient.sharpness.layout``: one batch,
  both factors padded to equal rows).

    python benchmarks/bench_small_kernels.py --json benchmarks/results/cpu/small_kernels.json
    python benchmarks/bench_small_kernels.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
from _timing import interleaved, medians
from bench_iteration_overhead import bert_setup, vit_setup, write_document

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _linalg
from geoopt_quotient.sharpness import layout
from geoopt_quotient.sharpness.apgd import BallGroup
from geoopt_quotient.symmetry import strided

PRODUCT_SIZES = ((8, 33, 8), (12, 65, 16), (144, 65, 16), (8, 129, 32), (16, 257, 64), (4, 769, 64))


def product_row(heads: int, n: int, h: int, repeats: int) -> Dict[str, Any]:
    x = torch.randn(heads, 2 * n, h)
    a = torch.randn(heads, 2 * n, h)[:, :n]
    b = torch.randn(heads, h, h)
    out = x[:, :n]
    flops = n * h * h
    times = medians(
        interleaved(
            {
                "baddbmm": lambda: out.baddbmm_(a, b, alpha=-0.5),
                "bmm_then_add": lambda: out.add_(torch.bmm(a, b), alpha=-0.5),
            },
            repeats,
            number=max(5, int(4e6 // (heads * flops + 10_000))),
        )
    )
    small = flops <= _linalg.SMALL_PRODUCT_FLOPS
    return {
        "heads": heads,
        "n": n,
        "h": h,
        "flops_per_head": flops,
        "add_product_takes": "bmm_then_add" if small else "baddbmm",
        "us": {k: 1e6 * v for k, v in times.items()},
    }


def model_setup(name: str, quick: bool):
    if name == "tiny-vit":
        return vit_setup(quick, 128, 512)
    return bert_setup(name, quick, 8, 128, 1)


def write_back(name: str, repeats: int, quick: bool) -> Dict[str, Any]:
    model, _, _ = model_setup(name, quick)
    plan = gq.find_symmetries(model, metric="inv").bind(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    leaves = [g.gather(params).detach().requires_grad_() for g in plan.groups]
    names = [n for g in plan.symmetric_groups for n in g.param_names]
    cotangents = [torch.randn_like(params[n]) for n in names]
    layout = plan._strided

    def run(use_strided: bool) -> None:
        plan.__dict__["_strided"] = layout if use_strided else None
        saved, strided.MIN_ENTRIES_PER_PIECE = strided.MIN_ENTRIES_PER_PIECE, 0
        try:
            out = plan.scatter(leaves, params)
        finally:
            strided.MIN_ENTRIES_PER_PIECE = saved
        torch.autograd.backward([out[n] for n in names], cotangents, inputs=leaves)

    number = 50 if name == "tiny-vit" else 3
    times = medians(
        interleaved(
            {"strided": lambda: run(True), "index_map": lambda: run(False)}, repeats, number=number
        )
    )
    plan.__dict__["_strided"] = layout
    per_piece = layout.entries_per_piece if layout is not None else None
    return {
        "entries_per_piece": per_piece,
        "scatter_takes": "strided"
        if per_piece is not None and per_piece >= strided.MIN_ENTRIES_PER_PIECE
        else "index_map",
        "us": {k: 1e6 * v for k, v in times.items()},
    }


def group_row(space, repeats: int, generator: torch.Generator) -> Dict[str, float]:
    x = space.x
    u, v = (s * space.proju(torch.randn(x.shape, generator=generator)) for s in (0.01, 1.0))
    cotangent, out = torch.randn_like(x), torch.empty_like(x)
    _, pullback = space.retr_vjp(u, out)
    buffer = cotangent.clone()
    times = medians(
        interleaved(
            {
                "retraction": lambda: space.retr_vjp(u, out),
                "pullback": lambda: pullback(buffer),
                "riemannian_gradient": lambda: space.egrad2rgrad_(buffer),
                "gram_3x3": lambda: space.gram([u, v, cotangent]),
            },
            repeats,
            number=100,
        )
    )
    return {k: 1e6 * t for k, t in times.items()}


def geometry(repeats: int, quick: bool) -> Dict[str, Dict[str, float]]:
    model, _, _ = model_setup("tiny-vit", quick)
    plan = gq.find_symmetries(model, metric="inv").bind(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    rows, groups = {}, []
    for group in plan.symmetric_groups:
        x = group.gather(params).detach().clone()
        space = group.manifold.tangent_space(x)
        rows[f"{group.kind} {tuple(x.shape)}"] = group_row(space, repeats, generator)
        groups.append(BallGroup(x, group.manifold))
    for stack in layout.group_stacks(groups, list(range(len(groups)))):
        if not stack.padded:
            continue
        stacked = stack.group(groups)
        space = stacked.manifold.tangent_space(stacked.point)
        rows[f"stacked {tuple(stacked.point.shape)}"] = group_row(space, repeats, generator)
    return rows


def geometry_totals(rows: Dict[str, Dict[str, float]]) -> str:
    separate = sum(sum(r.values()) for k, r in rows.items() if not k.startswith("stacked"))
    stacked = sum(sum(r.values()) for k, r in rows.items() if k.startswith("stacked"))
    line = f"  per evaluation, the four operations: groups one by one {separate:.0f}"
    return line + (f", stacked {stacked:.0f}" if stacked else "")


def product_line(row: Dict[str, Any]) -> str:
    us = row["us"]
    return (
        f"  {row['heads']:4d} heads  n={row['n']:4d}  h={row['h']:3d}  "
        f"{us['baddbmm']:9.1f} | {us['bmm_then_add']:9.1f} | {row['add_product_takes']}"
    )


def write_back_line(name: str, row: Dict[str, Any]) -> str:
    us, per_piece = row["us"], row["entries_per_piece"] or 0
    return (
        f"  {name:<9} {per_piece:9.0f} entries a piece  "
        f"{us['strided']:9.0f} | {us['index_map']:9.0f} | {row['scatter_takes']}"
    )


def format_report(report: Dict[str, Any]) -> str:
    rows = report["models"]
    return "\n".join(
        [
            f"{report['threads']} thread(s), medians of interleaved repeats, microseconds",
            "n x h by h x h products, per call: baddbmm_ | bmm then add_ | add_product takes",
            *(product_line(row) for row in rows["products"]),
            "write-back and its backward: strided | index map | scatter takes",
            *(write_back_line(name, row) for name, row in rows["write_back"].items()),
            "fused GL(h) operations at the tiny ViT's base point, per call",
            *(
                f"  {group}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items())
                for group, row in rows["geometry"].items()
            ),
            geometry_totals(rows["geometry"]),
        ]
    )


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(
        description="Small CPU operations of the quotient groups: the measurements behind "
        "the thresholds add_product and the write-back choose by."
    )
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats
    models = ("tiny-vit",) if args.quick else ("tiny-vit", "bert-11m")
    sizes = PRODUCT_SIZES[:2] if args.quick else PRODUCT_SIZES
    rows = {
        "products": [product_row(*size, repeats) for size in sizes],
        "write_back": {m: write_back(m, repeats, args.quick) for m in models},
        "geometry": geometry(repeats, args.quick),
    }
    report = write_document("small_kernels", args, rows)
    print(format_report(report))
    return report


if __name__ == "__main__":
    main()
