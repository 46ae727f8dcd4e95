"""The flat ball on a GPU: an Auto-PGD iteration against a training step, in time and kernels.

For BERT-base (batches of 32 x 128 tokens) and ViT-B/32 (batches of 64 images of
224 x 224), random weights from their configs (nothing is downloaded), in float32 and under
bfloat16 autocast, this measures, for adaptive sharpness and geodesic sharpness (inv, mix):

- seconds per Auto-PGD iteration: the median run time with ``2N`` iterations minus that
  with ``N``, over ``N`` (fixed work and the last forward pass cancel); the reference is a
  training step without the optimizer (forward, backward, gradients set to None), timed
  the same way with ``N`` and ``2N`` passes. Interleaved repeats, a warm-up first,
  ``torch.cuda.synchronize()`` around every timed call. Ratios: each measure over the
  step (target <= 1.2), geodesic over adaptive (target <= 1.10);
- kernel launches per iteration (``torch.profiler``: ``cudaLaunchKernel`` and the like),
  against the step's, from one profiled run of ``N`` iterations (``N`` passes).

One JSON is written to the path given, rewritten after every unit (a killed run keeps what
it had); a summary is printed. A unit (one model in one precision) takes about 1.5 minutes
on an H100 (BERT-base in both precisions took about 170 s), so a run of at most three units
stays under 5 minutes: split the four with ``--models`` and ``--dtypes``.

    python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball_bert.json \
        --models bert-base --dtypes float32,bfloat16
    python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball_vit.json \
        --models vit-b32 --dtypes float32,bfloat16
    python benchmarks/bench_flat_ball_gpu.py out.json --dry-run   # CPU, tiny models, seconds
    python benchmarks/bench_flat_ball_gpu.py out.json --device cpu --dry-run --models vit-b32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from typing import Any, Callable, Dict

import torch
from bench_cuda import bert_loss, build_vit, vit_loss
from bench_sharpness_iteration import build_model as build_bert

import geoopt_quotient as gq

MEASURES = ("adaptive", "inv", "mix")
PRECISIONS = ("float32", "bf16-autocast")
#: ``--dtypes`` names: the model's parameters stay float32; bfloat16 is autocast.
DTYPES = {"float32": "float32", "bfloat16": "bf16-autocast"}
BATCH = {"bert-base": (32, 2), "vit-b32": (64, 2)}  # full, dry run


def build(name: str, dry: bool, device: str):
    """(model, batch, loss) with random weights and inputs."""
    g = torch.Generator().manual_seed(1)
    size = BATCH[name][dry]
    if name == "bert-base":
        model, config = build_bert(dry, device, torch.float32)
        ids = torch.randint(0, config.vocab_size, (size, 16 if dry else 128), generator=g)
        labels = torch.randint(0, config.num_labels, (size,), generator=g)
        return model, (ids.to(device), labels.to(device)), bert_loss
    model, config = build_vit(dry, device)
    pixels = torch.randn(size, 3, config.image_size, config.image_size, generator=g)
    labels = torch.randint(0, config.num_labels, (size,), generator=g)
    return model, (pixels.to(device), labels.to(device)), vit_loss


def runners(model, batch, loss) -> Dict[str, Callable[[int], Any]]:
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}

    def step(passes: int) -> None:
        for _ in range(passes):
            loss(model, batch).backward()
            model.zero_grad(set_to_none=True)

    def measure(name: str) -> Callable[[int], Any]:
        options = dict(rho=0.01, progress=False)
        if name == "adaptive":
            return lambda n: gq.adaptive_sharpness(model, loss, [batch], iters=n, **options)
        return lambda n: gq.geodesic_sharpness(
            model, loss, [batch], iters=n, symmetries=plans[name], **options
        )

    return {"step": step, **{name: measure(name) for name in MEASURES}}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds_per_iteration(
    runs: Dict[str, Callable[[int], Any]], n: int, repeats: int, device: str
) -> Dict[str, float]:
    times: Dict[str, Dict[int, list]] = {k: {n: [], 2 * n: []} for k in runs}
    for run in runs.values():  # warm-up
        run(1)
    for round_ in range(repeats):
        names = list(runs)[round_ % len(runs) :] + list(runs)[: round_ % len(runs)]
        for name in names:
            for count in (n, 2 * n) if round_ % 2 == 0 else (2 * n, n):
                synchronize(device)
                start = time.perf_counter()
                runs[name](count)
                synchronize(device)
                times[name][count].append(time.perf_counter() - start)
    return {
        name: (statistics.median(t[2 * n]) - statistics.median(t[n])) / n
        for name, t in times.items()
    }


def launches_per_iteration(run: Callable[[int], Any], n: int, device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(n)
        synchronize(device)
    keys = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
    return sum(e.count for e in prof.key_averages() if e.key.startswith(keys)) / n


def unit(name: str, precision: str, args, device: str) -> Dict[str, Any]:
    model, batch, loss = build(name, args.dry_run, device)
    runs = runners(model, batch, loss)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    with autocast if precision == "bf16-autocast" else contextlib.nullcontext():
        seconds = seconds_per_iteration(runs, args.iters, args.repeats, device)
        launches = {k: launches_per_iteration(run, args.iters, device) for k, run in runs.items()}
    step = seconds["step"]
    row: Dict[str, Any] = {"seconds_per_iteration": seconds, "launches_per_iteration": launches}
    row["ratio_to_step"] = {k: seconds[k] / step for k in MEASURES} if step > 0 else {}
    if seconds["adaptive"] > 0:
        row["geodesic_over_adaptive"] = {
            k: seconds[k] / seconds["adaptive"] for k in ("inv", "mix")
        }
    if launches["step"]:
        row["launches_ratio_to_step"] = {k: launches[k] / launches["step"] for k in MEASURES}
    del model, runs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="write the measurements to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--iters", type=int, default=4, help="N (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--models",
        type=_names(BATCH),
        default=list(BATCH),
        help="comma-separated, of " + ", ".join(BATCH),
    )
    parser.add_argument(
        "--dtypes",
        type=_names(DTYPES),
        default=None,
        help="comma-separated, of float32, bfloat16 (autocast); default both on CUDA, "
        "float32 elsewhere",
    )
    parser.add_argument(
        "--device", default=None, help="default: cuda where available (cpu for --dry-run)"
    )
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if args.dry_run:
        args.iters, args.repeats = 1, 1
    report: Dict[str, Any] = {
        "benchmark": "flat_ball_gpu",
        "device": (
            torch.cuda.get_device_name(device)
            if device.startswith("cuda")
            else platform.processor()
        ),
        "torch": torch.__version__,
        "settings": vars(args),
        "units": {},
    }
    if args.dtypes is None:
        precisions = PRECISIONS if device.startswith("cuda") else ("float32",)
    else:
        precisions = tuple(DTYPES[d] for d in args.dtypes)
    for name in args.models:
        for precision in precisions:
            key = f"{name} {precision}"
            try:
                report["units"][key] = row = unit(name, precision, args, device)
            except Exception as error:  # one unit's failure keeps the others
                report["units"][key] = row = {"error": repr(error)}
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
            print(summary_line(key, row), flush=True)
    return report


def _names(allowed) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of names from ``allowed``."""

    def parse(text: str) -> list:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or 'empty list'}; choose from {', '.join(allowed)}"
            )
        return names

    return parse


def summary_line(key: str, row: Dict[str, Any]) -> str:
    if "error" in row:
        return f"{key:24s} error: {row['error']}"
    ratios = " ".join(f"{k} {v:.2f}x" for k, v in row["ratio_to_step"].items())
    launches = row.get("launches_ratio_to_step")
    extra = (
        " launches " + " ".join(f"{k} {v:.2f}x" for k, v in launches.items()) if launches else ""
    )
    step = row["seconds_per_iteration"]["step"] * 1e3
    return f"{key:24s} step {step:.1f} ms; per iteration / step: {ratios}{extra}"


if __name__ == "__main__":
    main()
