"""The Auto-PGD ball's memory per rank for an FSDP2-sharded model, by part.

Builds a small Llama (float32, random weights from a config; nothing downloaded), wraps
each decoder layer and the root with ``fully_shard`` on ``R`` gloo ranks of this machine,
and reports, per rank, :meth:`~geoopt_quotient.sharpness.sharded.ShardedBall.bytes_per_parameter`
(bytes per parameter of the whole model held by that rank's ball: base point, the entries
sent away, perturbed point, three iterates, gradients, index maps) next to one process's
:meth:`~geoopt_quotient.sharpness.layout.BallLayout.bytes_per_parameter`, for the best
iterate's gradient kept and not (models above 16M float32 parameters do not keep it by
default). These figures are exact.

While the ball is built (``construction``, per rank, the largest over the ranks): the
peak of the tensors made meanwhile (``tensor_peak``) and of them what is gone when it
returns (``transient``), NumPy's peak (``numpy_peak``, ``tracemalloc``), all in bytes per
parameter, and the most entries of an integer tensor (``largest_integer``); these are
exact too. Then one timing, on one thread: the process time of building it again with
its exchange derived anew (``seconds``, ``ns_per_entry`` per entry of the symmetry
groups) and reused from the first call on the plan (``seconds_reused``).

    python benchmarks/bench_sharded_ball_memory.py \\
        --json benchmarks/results/cpu/sharded_ball_memory.json
    python benchmarks/bench_sharded_ball_memory.py --chunk-entries 65536 \\
        --json benchmarks/results/cpu/sharded_ball_memory_chunks.json
    python benchmarks/bench_sharded_ball_memory.py --ranks 2 --config \\
        '{"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 2048}' \\
        --json benchmarks/results/cpu/sharded_ball_build.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _live_bytes import transient

from geoopt_quotient.sharpness.ball import ball_groups
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.layout import BallLayout
from geoopt_quotient.sharpness.measure import resolve_plan
from geoopt_quotient.sharpness.sharded import CHUNK_ENTRIES
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


def build_model(config: Dict[str, Any] | None = None) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(config or CONFIG))).float()


def plan_for(model: torch.nn.Module, measure: str):
    if measure == "adaptive":
        return SymmetryPlan().bind(model)
    return resolve_plan(model, None, measure)


def single_process(config: Dict[str, Any]) -> Dict[str, Any]:
    model = build_model(config)
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


def worker(
    rank: int, world: int, init_file: str, out: str, chunk_entries: int | None, config: Dict
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from geoopt_quotient.sharpness import sharded
    from geoopt_quotient.sharpness.sharded import sharded_ball

    if chunk_entries:
        sharded.CHUNK_ENTRIES = chunk_entries

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
        model = build_model(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        rows = {}
        for measure in MEASURES:
            plan = plan_for(model, measure)

            ball, held = transient(lambda plan=plan: sharded_ball(model, plan, None))
            ball.restore()
            parameters = ball.parameters
            seconds = []
            for derive in (True, False):  # the exchange derived anew, then reused
                if derive:
                    sharded._LAYOUTS.pop(plan, None)
                start = time.process_time()
                ball = sharded_ball(model, plan, None)
                seconds.append(time.process_time() - start)
                ball.restore()
            entries = sum(g.shape.numel() for g in plan.groups if not g.is_whole_parameter)
            rows[measure] = {
                "kept": ball.bytes_per_parameter(keep_best_gradient=True),
                "not_kept": ball.bytes_per_parameter(keep_best_gradient=False),
                "construction": {
                    "tensor_peak": held["tensor_peak"] / parameters,
                    "transient": (held["tensor_peak"] - held["tensor_kept"]) / parameters,
                    "numpy_peak": held["numpy_peak"] / parameters,
                    "largest_integer": held["largest_integer"],
                    "group_entries": entries,
                    "seconds": seconds[0],
                    "seconds_reused": seconds[1],
                    "ns_per_entry": 1e9 * seconds[0] / entries if entries else None,
                },
            }
        torch.save(rows, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def sharded(
    world: int, chunk_entries: int | None = None, config: Dict | None = None
) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(
            worker,
            args=(world, os.path.join(directory, "init"), directory, chunk_entries, config),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [torch.load(os.path.join(directory, f"rank{r}.pt")) for r in range(world)]


def _largest(values) -> float | None:
    """The largest of ``values`` that are not ``None`` (``None`` if none is)."""
    return max((v for v in values if v is not None), default=None)


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--chunk-entries",
        type=int,
        help="entries of a group's point whose exchange maps are derived at once while the "
        "ball is built (default: the package's CHUNK_ENTRIES); smaller stands for a larger "
        "model",
    )
    parser.add_argument(
        "--config",
        default="{}",
        help="JSON of LlamaConfig fields that replace the small Llama's (CONFIG), e.g. "
        '\'{"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, '
        '"num_key_value_heads": 16}\'',
    )
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    config = {**CONFIG, **json.loads(args.config)}
    single = single_process(config)
    worlds = {}
    for world in args.ranks:
        per_rank = sharded(world, args.chunk_entries, config)
        worlds[str(world)] = {
            measure: {
                "per_rank_total_kept": [r[measure]["kept"]["total"] for r in per_rank],
                "max_rank_kept": max(per_rank, key=lambda r: r[measure]["kept"]["total"])[measure][
                    "kept"
                ],
                "max_rank_not_kept": max(per_rank, key=lambda r: r[measure]["not_kept"]["total"])[
                    measure
                ]["not_kept"],
                "construction": {
                    key: _largest(r[measure]["construction"][key] for r in per_rank)
                    for key in per_rank[0][measure]["construction"]
                },
            }
            for measure in MEASURES
        }
        for measure in MEASURES:
            top = worlds[str(world)][measure]["max_rank_not_kept"]["total"]
            ratio = top / single[measure]["not_kept"]["total"]
            built = worlds[str(world)][measure]["construction"]
            print(
                f"{world} ranks {measure:9s} {top:.2f} B/parameter/rank ({ratio:.2f}x one "
                f"process); while built: {built['transient']:.2f} B/parameter of tensors, "
                f"{built['numpy_peak']:.2f} of NumPy, an integer tensor of "
                f"{built['largest_integer']:,} entries at most"
            )
    document = {
        "benchmark": "sharded_ball_memory",
        "model": "Llama, {num_hidden_layers} layers, d={hidden_size}, {num_attention_heads} "
        "heads, MLP {intermediate_size}, vocabulary {vocab_size} (random weights)".format(**config),
        "config": config,
        "parameters": sum(p.numel() for p in build_model(config).parameters()),
        "threads": 1,
        "chunk_entries": args.chunk_entries or CHUNK_ENTRIES,
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
