"""The Auto-PGD ball's memory per rank for an FSDP2-sharded model, by part.

Builds a small Llama (float32, random weights from a config; nothing downloaded), wraps
each decoder layer and the root with ``fully_shard`` on ``R`` gloo ranks of this machine,
and reports, per rank, :meth:`~geoopt_quotient.sharpness.sharded.ShardedBall.bytes_per_parameter`
(bytes per parameter of the whole model held by that rank's ball: base point, the entries
sent away, perturbed point, three iterates, gradients, index maps) next to one process's
:meth:`~geoopt_quotient.sharpness.layout.BallLayout.bytes_per_parameter`, for the best
iterate's gradient kept and not (models above 16M float32 parameters do not keep it by
default). No timing: the figures are exact.

    python benchmarks/bench_sharded_ball_memory.py \\
        --json benchmarks/results/cpu/sharded_ball_memory.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geoopt_quotient.sharpness.ball import ball_groups
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.layout import BallLayout
from geoopt_quotient.sharpness.measure import resolve_plan
from geoopt_quotient.symmetry.plan import SymmetryPlan

MEASURES = ("adaptive", "inv", "mix")
#: A small Llama: 4 layers of 8 heads of 32, MLP 688, vocabulary 1000 (about 3.3M parameters).
CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=688,
    max_position_embeddings=64,
)


def build_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()


def plan_for(model: torch.nn.Module, measure: str):
    if measure == "adaptive":
        return SymmetryPlan().bind(model)
    return resolve_plan(model, None, measure)


def single_process() -> Dict[str, Any]:
    model = build_model()
    rows = {}
    for measure in MEASURES:
        plan = plan_for(model, measure)
        base = trainable_parameters(model)
        points = [p.detach() for p in plan.gather(base)]
        layout = BallLayout(plan, base, ball_groups(plan.groups, points, "second_order", True))
        rows[measure] = {
            "kept": layout.bytes_per_parameter(keep_best_gradient=True),
            "not_kept": layout.bytes_per_parameter(keep_best_gradient=False),
        }
    return rows


def worker(rank: int, world: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geoopt_quotient.sharpness.sharded import sharded_ball

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = build_model()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = {}
        for measure in MEASURES:
            plan = plan_for(model, measure)

            ball = sharded_ball(model, plan, None)
            rows[measure] = {
                "kept": ball.bytes_per_parameter(keep_best_gradient=True),
                "not_kept": ball.bytes_per_parameter(keep_best_gradient=False),
            }
            ball.restore()
        torch.save(rows, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def sharded(world: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(
            worker,
            args=(world, os.path.join(directory, "init"), directory),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [torch.load(os.path.join(directory, f"rank{r}.pt")) for r in range(world)]


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    single = single_process()
    worlds = {}
    for world in args.ranks:
        per_rank = sharded(world)
        worlds[str(world)] = {
            measure: {
                "per_rank_total_kept": [r[measure]["kept"]["total"] for r in per_rank],
                "max_rank_kept": max(per_rank, key=lambda r: r[measure]["kept"]["total"])[measure][
                    "kept"
                ],
                "max_rank_not_kept": max(per_rank, key=lambda r: r[measure]["not_kept"]["total"])[
                    measure
                ]["not_kept"],
            }
            for measure in MEASURES
        }
        for measure in MEASURES:
            top = worlds[str(world)][measure]["max_rank_not_kept"]["total"]
            ratio = top / single[measure]["not_kept"]["total"]
            print(
                f"{world} ranks {measure:9s} {top:.2f} B/parameter/rank ({ratio:.2f}x one process)"
            )
    document = {
        "benchmark": "sharded_ball_memory",
        "model": "Llama, 4 layers, d=256, 8 heads, MLP 688, vocabulary 1000 (random weights)",
        "parameters": sum(p.numel() for p in build_model().parameters()),
        "single_process": single,
        "ranks": worlds,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
    return document


if __name__ == "__main__":
    main()
