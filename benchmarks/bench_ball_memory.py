"""The Auto-PGD ball's memory per model parameter, by part, for each measure.

Builds the worst case's flat layout (``geoopt_quotient.sharpness.layout.BallLayout``) for a
BERT-base-size classifier (random weights from its config; nothing is downloaded) and
reports :meth:`~geoopt_quotient.sharpness.layout.BallLayout.bytes_per_parameter`: the base
points beside the model's own parameters, the perturbed parameters' flat buffers, the three
iterates, the gradients (the best iterate's kept or not), the unfused groups' staging
buffers and index maps, in bytes per trainable parameter, the kept gradient's size
against ``KEEP_GRADIENT_MAX_BYTES``, and (``shared_not_kept``) the same with the base point
in the model's own storage (``share_storage=True``; the best gradient not kept). No
timing: the figures are exact. The float32 model's rows are under ``measures``; the same
model cast to bfloat16 under ``dtypes.bfloat16`` (its base point and perturbed parameters
in bfloat16; the iterates and gradients in float32, the precision Auto-PGD computes in for
a half-precision model), and (``shared_not_kept_bfloat16_state``) with those stored in
bfloat16 too (``state_dtype=torch.bfloat16``).

    python benchmarks/bench_ball_memory.py --json benchmarks/results/cpu/ball_memory.json
    python benchmarks/bench_ball_memory.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any, Dict

import torch
from bench_sharpness_iteration import build_model

from geoopt_quotient.sharpness.apgd import KEEP_GRADIENT_MAX_BYTES
from geoopt_quotient.sharpness.ball import ball_groups
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.layout import BallLayout
from geoopt_quotient.sharpness.measure import resolve_plan
from geoopt_quotient.symmetry.plan import SymmetryPlan

MEASURES = ("adaptive", "inv", "mix")


def layout_for(model: torch.nn.Module, measure: str, share: bool = False) -> BallLayout:
    """The worst case's layout, as ``adaptive_sharpness`` / ``geodesic_sharpness`` build it
    (with ``share``: as with ``share_storage=True``, the parameters moved into it)."""
    if measure == "adaptive":
        plan = SymmetryPlan().bind(model)
    else:
        plan = resolve_plan(model, None, measure)
    base = trainable_parameters(model)
    points = [p.detach() for p in plan.gather(base)]
    groups = ball_groups(plan.groups, points, "second_order", True)
    if share:
        return BallLayout(plan, base, groups, parameters=dict(model.named_parameters()))
    return BallLayout(plan, base, groups)


def measure_rows(model: torch.nn.Module, dtype: str) -> Dict[str, Any]:
    """Per measure, the ball's bytes per parameter of ``model`` (in its dtype)."""
    rows = {}
    for measure in MEASURES:
        layout = layout_for(model, measure)
        rows[measure] = {
            "kept": layout.bytes_per_parameter(keep_best_gradient=True),
            "not_kept": layout.bytes_per_parameter(keep_best_gradient=False),
            "vector_mib": layout.vector_bytes() / 2**20,
            "gradient_kept_by_default": layout.vector_bytes() <= KEEP_GRADIENT_MAX_BYTES,
            "shared_not_kept": layout_for(model, measure, share=True).bytes_per_parameter(
                keep_best_gradient=False
            ),
        }
        if dtype == "bfloat16":  # its iterates and gradients in bfloat16 (state_dtype)
            shared = layout_for(model, measure, share=True)
            rows[measure]["shared_not_kept_bfloat16_state"] = shared.bytes_per_parameter(
                keep_best_gradient=False, state_dtype=torch.bfloat16
            )
        kept = rows[measure]["kept"]
        print(
            f"{dtype:8s} {measure:9s} bytes/parameter: "
            + ", ".join(f"{k} {v:.2f}" for k, v in kept.items())
            + f" (best gradient kept; one vector {rows[measure]['vector_mib']:.0f} MiB)"
        )
    return rows


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny BERT (CI)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    model, _ = build_model(args.quick, "cpu", torch.float32)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = measure_rows(model, "float32")
    low = {"bfloat16": measure_rows(model.to(torch.bfloat16), "bfloat16")}
    document = {
        "benchmark": "ball_memory",
        "model": "tiny BERT" if args.quick else "BERT-base (random weights)",
        "parameters": parameters,
        "keep_gradient_max_mib": KEEP_GRADIENT_MAX_BYTES / 2**20,
        "measures": rows,
        "dtypes": low,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
    return document


if __name__ == "__main__":
    main()
