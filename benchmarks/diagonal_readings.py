"""Which reading of the paper's diagonal-network setup gives its sign for mix sharpness?

Trains the populations of ``geoopt-quotient reproduce diagonal`` (both ``--setup``
choices, the same seeded data and models) and correlates with the test loss, by
Kendall's tau, every plausible reading of "geodesic mix sharpness at radius rho":

- the ball: the quotient's (exact geodesic stopped at beta_i = 0), the geodesic continued
  through 0 (the Euclidean ball of radius sqrt(2) rho in beta, solved exactly by
  ``mix_ball_worst_case``), or the paper's second-order retraction (Auto-PGD, and the
  one-coordinate value ``mix_retraction_one_coordinate`` that explains it);
- the radius: the same rho for every model, or rho |beta0| (relative, as for adaptive);
- worst case (Auto-PGD, 100 iterations) or average case (mean over 1000 horizontal
  Gaussian directions with E|eta|^2 = rho^2, the same draws for every model);
- the value: the loss increase, or the increase relative to the clean loss.

A loss scaled by a constant (sum instead of mean, 1/n instead of 1/(2n)) scales every
model's value alike and leaves tau unchanged; it is not a reading to test. The inv and
adaptive measures are recomputed beside them for reference. Also recorded: the exact
Euclidean-ball worst case against Auto-PGD on the same ball (a check of the solver and of
the claim that this ball's maximum hardly depends on the model), and the second-order
Auto-PGD value against the one-coordinate value.

    python benchmarks/diagonal_readings.py \\
        --json benchmarks/results/reproductions/diagonal_readings.json   # a few minutes
    python benchmarks/diagonal_readings.py --quick --json /tmp/r.json   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from geoopt_quotient.experiments.diagonal import analytic
from geoopt_quotient.experiments.diagonal.data import DEFAULT_SPARSITY, SparseRegression
from geoopt_quotient.experiments.diagonal.experiment import (
    DEFAULT_ITERS,
    DEFAULT_RHO,
    PAPER_TAU,
    SETUPS,
    measure_population,
    train_setup,
)
from geoopt_quotient.experiments.diagonal.train import (
    DEFAULT_INIT_RANGE,
    DEFAULT_MAX_STEPS,
    DEFAULT_STEP_FACTOR_RANGE,
    DEFAULT_TARGET_LOSS,
)
from geoopt_quotient.sharpness import NonFiniteError
from geoopt_quotient.sharpness.stats import kendall_tau

SAMPLES = 1000
#: (name, description) of every reading, in the order of the table.
READINGS = {
    "adaptive": "adaptive, worst case (reference)",
    "inv": "inv, exact geodesic, worst case (reference)",
    "mix": "mix, exact geodesic stopped at beta_i = 0 (the quotient's ball), worst case",
    "mix_euclidean_exact": "mix, geodesic continued through 0 (Euclidean ball in beta), "
    "worst case solved exactly",
    "mix_second_order": "mix, second-order retraction, worst case",
    "mix_second_order_one_coordinate": "mix, second-order retraction, whole budget on the "
    "best single coordinate",
    "mix_relative_radius": "mix, exact geodesic stopped at 0, radius rho |beta0|, worst case",
    "mix_second_order_relative_radius": "mix, second-order retraction, radius rho |beta0|, "
    "worst case",
    "mix_average": "mix, exact geodesic stopped at 0, average over Gaussian directions",
    "mix_second_order_average": "mix, second-order retraction, average over Gaussian directions",
    "mix_over_clean_loss": "mix, exact geodesic stopped at 0, worst case / clean loss",
    "mix_second_order_over_clean_loss": "mix, second-order retraction, worst case / clean loss",
}


def _options() -> Dict[str, Any]:
    return dict(
        n_train=None,
        noise_std=None,
        sparsity=DEFAULT_SPARSITY,
        init_range=DEFAULT_INIT_RANGE,
        step_factor_range=DEFAULT_STEP_FACTOR_RANGE,
        target_loss=DEFAULT_TARGET_LOSS,
        max_steps=DEFAULT_MAX_STEPS,
    )


def average_case(
    data: SparseRegression, beta0: torch.Tensor, rho: float, path: str, samples: int
) -> List[float]:
    r"""Mean loss increase over horizontal Gaussian :math:`\eta` with
    :math:`E|\eta|^2_{\text{mix}} = \rho^2`: :math:`\delta = 2B\beta_0 \sim N(0, 2\rho^2/d)`
    per coordinate (isotropic in :math:`\beta`), the same draws for every model."""
    generator = torch.Generator().manual_seed(0)
    d = beta0.shape[-1]
    delta = torch.randn(samples, d, generator=generator, dtype=beta0.dtype)
    delta = delta * (2.0 * rho**2 / d) ** 0.5
    values = []
    for b0 in beta0:
        rate = delta / (2 * b0)
        if path == "exact":
            beta = b0 * (1 + 2 * rate).clamp_min(0)
        else:
            beta = b0 * (1 + rate - rate.pow(2) / 2).pow(2)
        values.append(float((data.train_loss(beta) - data.train_loss(b0)).mean()))
    return values


def worst_case(
    data: SparseRegression,
    points: torch.Tensor,
    names: Sequence[str],
    radii: Sequence[float],
    iters: int,
) -> Dict[str, List[float]]:
    """Auto-PGD worst cases of ``names`` for every model, the mix radius per model."""
    out: Dict[str, List[float]] = {name: [] for name in names}
    for point, radius in zip(points, radii):
        for name in names:
            try:
                values, _ = measure_population(
                    data, point[None], rho=DEFAULT_RHO, rho_mix=radius, iters=iters, measures=[name]
                )
                out[name].append(values[1.0][name][0])
            except NonFiniteError:  # the loss overflows float64 inside the ball
                out[name].append(math.inf)
    return out


def one_setup(setup: str, models: int, dim: int, seed: int, iters: int) -> Dict[str, Any]:
    start = time.perf_counter()
    data, population, _ = train_setup(
        setup, models, dim, seed, torch.device("cpu"), False, _options()
    )
    points, beta0 = population.points, population.beta
    rho = DEFAULT_RHO
    scale = 1.0 / (2 * data.n_train)
    x, y = data.x_train.numpy(), data.y_train.numpy()
    clean = [float(v) for v in data.train_loss(beta0)]
    test_loss = [float(v) for v in data.test_loss(beta0)]
    columns = worst_case(
        data,
        points,
        ("adaptive", "inv", "mix", "mix_second_order", "mix_unclamped"),
        [rho] * models,
        iters,
    )
    relative = worst_case(
        data, points, ("mix", "mix_second_order"), [rho * float(b.norm()) for b in beta0], iters
    )
    columns["mix_relative_radius"] = relative["mix"]
    columns["mix_second_order_relative_radius"] = relative["mix_second_order"]
    exact = [analytic.mix_ball_worst_case(b.numpy(), x, y, rho, scale=scale) for b in beta0]
    columns["mix_euclidean_exact"] = [w.value for w in exact]
    columns["mix_second_order_one_coordinate"] = [
        analytic.mix_retraction_one_coordinate(b.numpy(), x, y, rho, scale=scale).value
        for b in beta0
    ]
    columns["mix_average"] = average_case(data, beta0, rho, "exact", SAMPLES)
    columns["mix_second_order_average"] = average_case(data, beta0, rho, "second_order", SAMPLES)
    for name in ("mix", "mix_second_order"):
        columns[f"{name}_over_clean_loss"] = [s / c for s, c in zip(columns[name], clean)]
    taus = {name: kendall_tau(columns[name], test_loss)[0] for name in READINGS}
    euclid = columns["mix_euclidean_exact"]
    top = float(np.linalg.eigvalsh(scale * x.T @ x)[-1])
    apgd_ratio = [a / e for a, e in zip(columns["mix_unclamped"], euclid)]
    second_ratio = [
        a / o
        for a, o in zip(columns["mix_second_order"], columns["mix_second_order_one_coordinate"])
    ]
    min_beta = [float(b.abs().min()) for b in beta0]
    return {
        "setup": setup,
        "seed": seed,
        "models": models,
        "dim": dim,
        "n_train": data.n_train,
        "rho": rho,
        "iters": iters,
        "tau": taus,
        "checks": {
            "euclidean_floor_2rho2_lambda_max": 2 * rho**2 * top,
            "euclidean_exact_min": min(euclid),
            "euclidean_exact_max": max(euclid),
            "euclidean_exact_relative_spread": (max(euclid) - min(euclid))
            / statistics.median(euclid),
            "apgd_over_exact_euclidean_min": min(apgd_ratio),
            "apgd_over_exact_euclidean_max": max(apgd_ratio),
            "second_order_apgd_over_one_coordinate_min": min(second_ratio),
            "second_order_apgd_over_one_coordinate_max": max(second_ratio),
            "second_order_range": [
                min(columns["mix_second_order"]),
                max(columns["mix_second_order"]),
            ],
            "tau_second_order_vs_one_coordinate": kendall_tau(
                columns["mix_second_order"], columns["mix_second_order_one_coordinate"]
            )[0],
            "tau_inverse_min_abs_beta_vs_test_loss": kendall_tau(
                [1 / m for m in min_beta], test_loss
            )[0],
            "tau_beta_norm_vs_test_loss": kendall_tau([float(b.norm()) for b in beta0], test_loss)[
                0
            ],
            "clean_loss_range": [min(clean), max(clean)],
            "overflows": {k: sum(1 for v in c if v == math.inf) for k, c in columns.items()},
        },
        "per_model": {"test_loss": test_loss, "clean_loss": clean, "min_abs_beta": min_beta}
        | columns,
        "seconds": time.perf_counter() - start,
    }


def main(argv: Sequence[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0])
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--dim", type=int, default=200)
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="8 models, d = 40, 20 iterations")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.dim, args.iters = 8, 40, 20
    torch.set_num_threads(args.threads)
    runs: List[Dict[str, Any]] = []
    doc = {
        "experiment": "diagonal_readings",
        "settings": {
            "threads": args.threads,
            "seeds": args.seeds,
            "models": args.models,
            "dim": args.dim,
            "iters": args.iters,
            "average_case_samples": SAMPLES,
            "quick": args.quick,
        },
        "environment": {
            "torch": torch.__version__,
            "machine": platform.machine(),
            "python": sys.version.split()[0],
        },
        "readings": READINGS,
        "paper_tau": dict(PAPER_TAU),
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for setup in SETUPS:
        for seed in args.seeds:
            runs.append(one_setup(setup, args.models, args.dim, seed, args.iters))
            print(f"{setup} seed {seed}: {runs[-1]['seconds']:.0f} s", file=sys.stderr)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")  # after every run
    print(format_rows(doc))
    return doc


def format_rows(doc: Dict[str, Any]) -> str:
    """One line per reading: tau per (setup, seed)."""
    lines = []
    for name in doc["readings"]:
        cells = [f"{run['setup']}/{run['seed']}: {run['tau'][name]:+.3f}" for run in doc["runs"]]
        lines.append(f"{name:<36}" + "  ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
