"""Where an Auto-PGD iteration's time goes on a GPU: kernels, launches, host time.

Profiles (``torch.profiler``) a sharpness run of ``--iters`` iterations of each measure
and as many plain forward+backward passes of the same loss, on BERT-base (batch
``--batch-size`` x 128 tokens), in float32 and under bfloat16 autocast, after a warm-up.
Reported per iteration (per pass for the plain one): wall time, the GPU's busy time (sum
of kernel times), the number of kernel launches and of operators dispatched on the
host; the operators with the most host time and the kernels with the most GPU time. A
wall time far above the busy time with many launches means the host's Python
and dispatch, not the GPU, set the pace.

    python benchmarks/profile_cuda_iteration.py --json benchmarks/results/gpu/profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from bench_sharpness_iteration import build_model, loss_fn, make_batch
from torch.profiler import ProfilerActivity, profile

import geoopt_quotient as gq


def measures(model, batch, iters: int):
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}

    def plain():
        for _ in range(iters):
            loss_fn(model, batch).backward()
        model.zero_grad(set_to_none=True)

    def geodesic(metric):
        return lambda: gq.geodesic_sharpness(
            model, loss_fn, [batch], rho=0.01, iters=iters, symmetries=plans[metric]
        )

    return {
        "forward-backward": plain,
        "adaptive": lambda: gq.adaptive_sharpness(model, loss_fn, [batch], rho=0.01, iters=iters),
        "geodesic-inv": geodesic("inv"),
        "geodesic-mix": geodesic("mix"),
    }


def profiled(fn, iters: int) -> dict:
    fn()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
    operators = sum(e.count for e in events if e.key.startswith("aten::"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    device_events = [e for e in events if e.device_type.name == "CUDA"]
    busiest = sorted(device_events, key=lambda e: e.device_time_total, reverse=True)[:12]
    return {
        "wall_seconds_per_iteration": wall / iters,
        "gpu_busy_seconds_per_iteration": kernels / 1e6 / iters,
        "kernel_launches_per_iteration": launches / iters,
        "aten_operators_per_iteration": operators / iters,
        "top_host_operators": [
            {"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
            for e in top
        ],
        "top_kernels": [
            {"name": e.key[:120], "count": e.count, "gpu_ms": e.device_time_total / 1e3}
            for e in busiest
        ],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--json", help="write the profile summary to this file")
    args = parser.parse_args(argv)
    model, config = build_model(False, "cuda", torch.float32)
    batch = make_batch(config, args.batch_size, 128, "cuda")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": {}}
    for precision in ("float32", "bf16-autocast"):
        for name, fn in measures(model, batch, args.iters).items():
            autocast = torch.autocast("cuda", dtype=torch.bfloat16)
            with autocast if precision != "float32" else contextlib.nullcontext():
                summary = profiled(fn, args.iters)
            report["runs"][f"{precision} {name}"] = summary
            print(
                f"{precision:14s} {name:17s} wall {summary['wall_seconds_per_iteration']:.4f} s"
                f"  GPU busy {summary['gpu_busy_seconds_per_iteration']:.4f} s"
                f"  launches {summary['kernel_launches_per_iteration']:7.0f}"
                f"  aten ops {summary['aten_operators_per_iteration']:7.0f}",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
