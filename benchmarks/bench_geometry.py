"""Cost of the quotient geometry: batched versus a SciPy loop, and how it scales.

1. The inv-metric horizontal projection of 144 pairs (12 layers x 12 heads, n = m = 769,
   h = 64: BERT-base Q/K pairs with biases) batched on the tensor's device, versus a
   per-pair loop that forms the same matrices and calls ``scipy.linalg.solve_sylvester``,
   both on inputs of ``--dtype`` (float64 by default; with float32 the batched version
   still does its h x h algebra in float64, the SciPy loop all of it in float32).
2. How proju, egrad2rgrad and the second-order retraction scale with the number of
   heads and with h, for both metrics.

Ratios are measured side by side in one run (interleaved repetitions, medians, a short
pause before each timed call of part 1: see ``--settle``).

    python benchmarks/bench_geometry.py --json benchmarks/results/cpu/geometry.json
    python benchmarks/bench_geometry.py --device cuda --json benchmarks/results/gpu/geometry.json
    python benchmarks/bench_geometry.py --dtype float32
    python benchmarks/bench_geometry.py --quick
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from typing import List

import numpy as np
import scipy.linalg
import torch
from _timing import interleaved, medians

from geoopt_quotient import GLQuotient


def scipy_loop_projection(x: np.ndarray, u: np.ndarray, n: int) -> np.ndarray:
    """Reference: the inv projection pair by pair with scipy.linalg.solve_sylvester."""
    out = np.empty_like(u)
    for i in range(x.shape[0]):
        g, h, ug, uh = x[i, :n], x[i, n:], u[i, :n], u[i, n:]
        s_g, s_h = g.T @ g, h.T @ h
        a = s_g @ s_h
        omega = scipy.linalg.solve_sylvester(a, a, s_g @ (h.T @ uh) - (ug.T @ g) @ s_h).T
        out[i, :n] = ug + g @ omega
        out[i, n:] = uh - h @ omega.T
    return out


def projection_vs_scipy(
    pairs: int,
    n: int,
    h: int,
    repeats: int,
    device: str,
    dtype: torch.dtype = torch.float64,
    settle: float = 0.0,
) -> dict:
    """Batched inv projection versus :func:`scipy_loop_projection` on inputs of ``dtype``.

    ``max_abs_difference`` compares the two on the same inputs; for a dtype other than
    float64, ``max_abs_difference_float64`` compares the batched result with the SciPy
    loop run in float64 on the same (rounded) inputs.
    """
    torch.manual_seed(0)
    manifold = GLQuotient(n, n, "inv")
    x = torch.randn(pairs, 2 * n, h, dtype=torch.float64).to(dtype)
    u = torch.randn(pairs, 2 * n, h, dtype=torch.float64).to(dtype)
    xd, ud = x.to(device), u.to(device)
    xn, un = x.numpy(), u.numpy()
    batched = manifold.proju(xd, ud).cpu().double().numpy()
    error = float(np.abs(batched - scipy_loop_projection(xn, un, n)).max())
    extra = {}
    if dtype != torch.float64:
        exact = scipy_loop_projection(x.double().numpy(), u.double().numpy(), n)
        extra["max_abs_difference_float64"] = float(np.abs(batched - exact).max())
    times = interleaved(
        {
            "batched": lambda: manifold.proju(xd, ud),
            "scipy_loop": lambda: scipy_loop_projection(xn, un, n),
        },
        repeats,
        device=device,
        settle=settle,
    )
    med = medians(times)
    return {
        "pairs": pairs,
        "n": n,
        "m": n,
        "h": h,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "seconds": times,
        "median_seconds": med,
        "settle_seconds": settle,
        "speedup": med["scipy_loop"] / med["batched"],
        "max_abs_difference": error,
    } | extra


def scaling(heads_list: List[int], h_list: List[int], n: int, repeats: int, device: str) -> list:
    rows = []
    for metric in ("inv", "mix"):
        manifold = GLQuotient(n, n, metric)
        for heads in heads_list:
            for h in h_list:
                torch.manual_seed(0)
                x = torch.randn(heads, 2 * n, h, device=device)
                u = torch.randn(heads, 2 * n, h, device=device)
                times = interleaved(
                    {
                        name: functools.partial(getattr(manifold, name), x, u)
                        for name in ("proju", "egrad2rgrad", "retr")
                    },
                    repeats,
                    device=device,
                )
                rows.append({"metric": metric, "heads": heads, "h": h, "n": n} | medians(times))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (for CI)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="dtype of the projection comparison (part 1)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.25,
        metavar="SECONDS",
        help="pause before each timed call of part 1, so that the idle worker threads of "
        "the library timed before (torch or NumPy) stop spinning (default 0.25; 0: none)",
    )
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        proj = projection_vs_scipy(8, 33, 8, 2, args.device, dtype, 0.0)
        rows = scaling([2, 4], [4, 8], 33, 2, args.device)
    else:
        proj = projection_vs_scipy(144, 769, 64, args.repeats, args.device, dtype, args.settle)
        rows = scaling([12, 48, 144], [16, 32, 64, 128], 769, args.repeats, args.device)
    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "projection": proj,
        "scaling": rows,
    }
    print(
        f"inv projection, {proj['pairs']} pairs, n = m = {proj['n']}, h = {proj['h']} "
        f"({proj['dtype']}, {proj['device']}, {report['threads']} threads, "
        f"{proj['settle_seconds']:g} s settle): "
        f"batched {proj['median_seconds']['batched']:.3f} s, "
        f"SciPy loop {proj['median_seconds']['scipy_loop']:.3f} s, speed-up "
        f"{proj['speedup']:.1f}x (max |difference| {proj['max_abs_difference']:.1e}"
        + (
            f"; to the float64 SciPy loop {proj['max_abs_difference_float64']:.1e})"
            if "max_abs_difference_float64" in proj
            else ")"
        )
    )
    print(f"{'metric':6s} {'heads':>5s} {'h':>4s} {'proju':>9s} {'egrad2rgrad':>12s} {'retr':>9s}")
    for r in rows:
        print(
            f"{r['metric']:6s} {r['heads']:5d} {r['h']:4d} {r['proju'] * 1e3:8.2f}ms "
            f"{r['egrad2rgrad'] * 1e3:10.2f}ms {r['retr'] * 1e3:8.2f}ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
