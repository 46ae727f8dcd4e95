"""The flat ball on a GPU: an Auto-PGD iteration against a training step, in time and kernels.

For BERT-base (batches of 32 x 128 tokens) and ViT-B/32 (batches of 64 images of
224 x 224), random weights from their configs (nothing is downloaded), in float32 and under
bfloat16 autocast, this measures, for adaptive sharpness and geodesic sharpness (inv, mix):

- seconds per Auto-PGD iteration: the median run time with ``2N`` iterations minus that
  with ``N``, over ``N`` (fixed work, such as the clean loss, the path gap's exact geodesic
  and the last forward pass, cancels); the reference is a training step without the
  optimizer (forward, backward, gradients set to None), timed the same way with ``N`` and
  ``2N`` passes. Interleaved repeats, a warm-up first, ``torch.cuda.synchronize()`` around
  every timed call. Ratios: each measure over the step (target <= 1.2), geodesic over
  adaptive (target <= 1.10);
- kernel launches per iteration (``torch.profiler``: ``cudaLaunchKernel`` and the like),
  likewise the launches of a run of ``2N`` iterations minus those of ``N``, over ``N``,
  against the step's; the fixed launches of one call apart (``fixed_launches``);
- forward and backward passes per iteration (from the results' pass counts, by the same
  difference), the operators dispatched per iteration (a ``TorchDispatchMode`` counter)
  and the most frequent operators and kernels of an iteration, to tell which operators
  expand into many kernels on the device.

One JSON is written to the path given, rewritten after every unit (a killed run keeps what
it had); a summary is printed. A unit (one model in one precision) takes about 1.5 minutes
on an H100, so a run of at most three units stays under 5 minutes: split the four with
``--models`` and ``--dtypes``.

    python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball_bert.json \
        --models bert-base --dtypes float32,bfloat16
    python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball_vit.json \
        --models vit-b32 --dtypes float32,bfloat16
    python benchmarks/bench_flat_ball_gpu.py out.json --dry-run   # CPU, tiny models, seconds
    python benchmarks/bench_flat_ball_gpu.py out.json --device cpu --dry-run --models vit-b32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import statistics
import time
from typing import Any, Callable, Dict

import torch
from bench_cuda import bert_loss, build_vit, vit_loss
from bench_sharpness_iteration import build_model as build_bert
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

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
) -> tuple[Dict[str, float], Dict[str, list]]:
    """Seconds per iteration by difference of the medians of runs of ``2n`` and ``n``
    iterations, and the same difference within each round (its spread tells how much
    the call's fixed work, such as the path gap's many launches, varied between runs)."""
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
    medians = {
        name: (statistics.median(t[2 * n]) - statistics.median(t[n])) / n
        for name, t in times.items()
    }
    rounds = {name: [(b - a) / n for a, b in zip(t[n], t[2 * n])] for name, t in times.items()}
    return medians, rounds


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


class OperatorCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted_run(run: Callable[[int], Any], n: int, device: str) -> Dict[str, Any]:
    """One run of ``n`` iterations: its result and operators by name, and on CUDA its
    kernel launches and kernels by name (``torch.profiler``)."""
    profiling = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    synchronize(device)
    with profile(activities=activities) if profiling else contextlib.nullcontext() as prof:
        with OperatorCounter() as counter:
            result = run(n)
        synchronize(device)
    counted = {"result": result, "operators": dict(counter.counts)}
    if profiling:
        events = prof.key_averages()
        counted["launches"] = sum(e.count for e in events if e.key.startswith(LAUNCHES))
        counted["kernels"] = {e.key: e.count for e in events if e.device_type == DeviceType.CUDA}
    return counted


def per_iteration(counts_n: Dict[str, int], counts_2n: Dict[str, int], n: int, top: int):
    """The ``top`` most frequent names of ``(counts(2N) - counts(N)) / N``."""
    names = set(counts_n) | set(counts_2n)
    diff = {k: (counts_2n.get(k, 0) - counts_n.get(k, 0)) / n for k in names}
    ranked = sorted(diff.items(), key=lambda item: -item[1])[:top]
    return {k: v for k, v in ranked if v > 0}


def passes(result: Any) -> tuple[int, int]:
    """(forward, backward) passes of a result; a training step's run returns ``None``."""
    if result is None:
        return 0, 0
    return sum(result.forward_passes), sum(result.backward_passes)


def counts_per_iteration(run: Callable[[int], Any], n: int, device: str) -> Dict[str, Any]:
    """Launches, operators, kernels and passes per iteration of ``run``, by difference."""
    short, long = counted_run(run, n, device), counted_run(run, 2 * n, device)
    ops_n, ops_2n = short["operators"], long["operators"]
    row: Dict[str, Any] = {
        "operators": (sum(ops_2n.values()) - sum(ops_n.values())) / n,
        "top_operators": per_iteration(ops_n, ops_2n, n, top=12),
    }
    if short["result"] is not None:
        (fwd_n, bwd_n), (fwd_2n, bwd_2n) = passes(short["result"]), passes(long["result"])
        row["forward_passes"] = (fwd_2n - fwd_n) / n
        row["backward_passes"] = (bwd_2n - bwd_n) / n
    if "launches" in short:
        row["launches"] = (long["launches"] - short["launches"]) / n
        row["fixed_launches"] = short["launches"] - n * row["launches"]
        row["top_kernels"] = per_iteration(short["kernels"], long["kernels"], n, top=12)
    return row


def unit(name: str, precision: str, args, device: str) -> Dict[str, Any]:
    model, batch, loss = build(name, args.dry_run, device)
    runs = runners(model, batch, loss)
    autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    with autocast if precision == "bf16-autocast" else contextlib.nullcontext():
        seconds, rounds = seconds_per_iteration(runs, args.iters, args.repeats, device)
        counts = {k: counts_per_iteration(run, args.iters, device) for k, run in runs.items()}
    launches = {k: c.get("launches") for k, c in counts.items()}
    step = seconds["step"]
    row: Dict[str, Any] = {
        "seconds_per_iteration": seconds,
        "seconds_per_iteration_by_round": rounds,
        "launches_per_iteration": launches,
        "counts_per_iteration": counts,
    }
    if args.engine:
        row["engine"] = args.engine
    row["ratio_to_step"] = {k: seconds[k] / step for k in MEASURES} if step > 0 else {}
    if seconds["adaptive"] > 0:
        row["geodesic_over_adaptive"] = {
            k: seconds[k] / seconds["adaptive"] for k in ("inv", "mix")
        }
    if launches["step"]:
        row["launches_ratio_to_step"] = {k: launches[k] / launches["step"] for k in MEASURES}
    row["operators_ratio_to_step"] = {
        k: counts[k]["operators"] / counts["step"]["operators"] for k in MEASURES
    }
    del model, runs
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="write the measurements to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    parser.add_argument(
        "--iters", type=int, default=5, help="N: runs of N and 2N iterations (default 5)"
    )
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
    parser.add_argument(
        "--engine",
        default=None,
        help="a label of the code measured (e.g. its commit), stored in every unit",
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
    operators = " ".join(f"{k} {v:.2f}x" for k, v in row["operators_ratio_to_step"].items())
    launches = row.get("launches_ratio_to_step")
    extra = (
        " launches " + " ".join(f"{k} {v:.2f}x" for k, v in launches.items()) if launches else ""
    )
    step = row["seconds_per_iteration"]["step"] * 1e3
    return (
        f"{key:24s} step {step:.1f} ms; per iteration / step: {ratios}; "
        f"operators {operators}{extra}"
    )


if __name__ == "__main__":
    main()
