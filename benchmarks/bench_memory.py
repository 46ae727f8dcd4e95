"""Peak memory of a sharpness run relative to the model's own training step.

Each measurement runs in a fresh subprocess that builds the same BERT-size classifier
(random weights from its config) and one batch, then does one thing: a training step
(forward, backward, SGD step), or adaptive / geodesic (inv, mix) sharpness with a few
Auto-PGD iterations. Its peak resident set size (``ru_maxrss``) is compared, in total and
above the process's footprint once model and batch exist; the excess over the training
step is also given in copies of the parameters (model-sized buffers). Peak RSS includes
the allocator's free but unreturned memory, so it varies by a few percent between runs:
``--repeats`` reports the median of several processes per mode.

    python benchmarks/bench_memory.py --json benchmarks/results/cpu/memory.json
    python benchmarks/bench_memory.py --quick

``--dtype bfloat16`` casts the model to bfloat16 (the training step too), and
``--state-dtype bfloat16`` stores Auto-PGD's iterates and gradients in bfloat16
(``state_dtype=torch.bfloat16``; by default float32). glibc keeps freed memory for
reuse, which peak RSS counts; ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (passed
on to the processes, recorded in the file) returns every freed block of 128 KiB or more,
so that the peak is that of the memory in use.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

MODES = ("train", "adaptive", "geodesic-inv", "geodesic-mix")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


KEEP = {"auto": None, "yes": True, "no": False}


def child(
    mode: str,
    quick: bool,
    batch_size: int,
    seq_len: int,
    iters: int,
    keep: str = "auto",
    share: bool = False,
    dtype: str = "float32",
    state_dtype: str | None = None,
) -> dict:
    import torch
    from bench_precision import loss_fn  # in float32 at least
    from bench_sharpness_iteration import build_model, make_batch

    import geoopt_quotient as gq

    # made in its dtype (no float32 model first, whose peak would hide the training step's)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model, config = build_model(quick, "cpu", getattr(torch, dtype))
    finally:
        torch.set_default_dtype(default)
    batch = make_batch(config, batch_size, seq_len, "cpu")
    parameters = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    count = sum(p.numel() for p in model.parameters())
    state = None if state_dtype is None else getattr(torch, state_dtype)
    baseline = peak_mib()
    if mode == "train":
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss_fn(model, batch).backward()
        optimizer.step()
    elif mode == "adaptive":
        gq.adaptive_sharpness(
            model,
            loss_fn,
            [batch],
            rho=0.01,
            iters=iters,
            progress=False,
            keep_best_gradient=KEEP[keep],
            share_storage=share,
            state_dtype=state,
        )
    else:
        metric = mode.split("-")[1]
        gq.geodesic_sharpness(
            model,
            loss_fn,
            [batch],
            rho=0.01,
            iters=iters,
            metric=metric,
            progress=False,
            keep_best_gradient=KEEP[keep],
            share_storage=share,
            state_dtype=state,
        )
    return {
        "baseline_mib": baseline,
        "peak_mib": peak_mib(),
        "parameters_mib": parameters,
        "parameters": count,
    }


def measure(mode: str, args: argparse.Namespace) -> dict:
    """One mode in a fresh process: the median run by peak, with every run's peak."""
    command = [sys.executable, __file__, "--child", mode, "--iters", str(args.iters)]
    command += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    command += ["--keep-best-gradient", args.keep_best_gradient]
    command += ["--share-storage"] if args.share_storage else []
    command += ["--dtype", args.dtype]
    command += ["--state-dtype", args.state_dtype] if args.state_dtype else []
    command += ["--quick"] if args.quick else []
    runs = []
    for _ in range(args.repeats):
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    runs.sort(key=lambda r: r["peak_mib"])
    return dict(runs[len(runs) // 2], peaks_mib=[r["peak_mib"] for r in runs])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (for CI)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="processes per mode (median)")
    parser.add_argument(
        "--keep-best-gradient",
        choices=tuple(KEEP),
        default="auto",
        help="keep Auto-PGD's best gradient (auto: up to 1 GiB, BERT-base included)",
    )
    parser.add_argument(
        "--share-storage",
        action="store_true",
        help="the ball's base point shares the model's storage (share_storage=True)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype"
    )
    parser.add_argument(
        "--state-dtype",
        choices=("bfloat16",),
        help="Auto-PGD's iterates and gradients in this dtype (default: float32)",
    )
    parser.add_argument("--json", help="write the measurements to this file")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len = min(args.batch_size, 4), min(args.seq_len, 16)
    if args.child:
        sizes = (args.batch_size, args.seq_len, args.iters, args.keep_best_gradient)
        options = dict(share=args.share_storage, dtype=args.dtype, state_dtype=args.state_dtype)
        print(json.dumps(child(args.child, args.quick, *sizes, **options)))
        return {}
    runs = {mode: measure(mode, args) for mode in MODES}
    report = summarize(runs, args)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def summarize(runs: dict, args: argparse.Namespace) -> dict:
    train = runs["train"]
    train_increment = train["peak_mib"] - train["baseline_mib"]
    parameters = train["parameters_mib"]
    return {
        "model": "tiny BERT" if args.quick else "BERT-base (random weights)",
        "batch": [args.batch_size, args.seq_len],
        "iters": args.iters,
        "repeats": args.repeats,
        "keep_best_gradient": args.keep_best_gradient,
        "share_storage": args.share_storage,
        # glibc returns freed blocks above this size to the system (None: its default)
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "dtype": args.dtype,
        "state_dtype": args.state_dtype or "float32",
        "parameters_mib": parameters,
        "runs": runs,
        "peak_ratio_to_training_step": {
            m: r["peak_mib"] / train["peak_mib"] for m, r in runs.items()
        },
        # undefined (None) when the training step did not raise the process's peak
        "increment_ratio_to_training_step": {
            m: (r["peak_mib"] - r["baseline_mib"]) / train_increment
            if train_increment > 0
            else None
            for m, r in runs.items()
        },
        "excess_over_training_step_in_parameter_copies": {
            m: (r["peak_mib"] - train["peak_mib"]) / parameters for m, r in runs.items()
        },
        "excess_over_training_step_bytes_per_parameter": {
            m: (r["peak_mib"] - train["peak_mib"]) * 2**20 / train["parameters"]
            for m, r in runs.items()
        },
    }


def print_report(report: dict) -> None:
    batch_size, seq_len = report["batch"]
    print(
        f"{report['model']}, batch {batch_size}x{seq_len}, {report['iters']} Auto-PGD "
        f"iterations, best gradient kept: {report.get('keep_best_gradient', 'auto')}, "
        f"storage shared: {report.get('share_storage', False)}, "
        f"parameters {report['parameters_mib']:.1f} MiB: peak resident memory"
        + (f" (median of {report['repeats']} processes)" if report["repeats"] > 1 else "")
    )
    for mode, r in report["runs"].items():
        increment = report["increment_ratio_to_training_step"][mode]
        copies = report["excess_over_training_step_in_parameter_copies"][mode]
        print(
            f"  {mode:13s} {r['peak_mib']:8.0f} MiB  ratio to training step "
            f"{report['peak_ratio_to_training_step'][mode]:.2f} (above model and batch: "
            f"{float('nan') if increment is None else increment:.2f}; "
            f"{copies:+.2f} parameter copies)"
        )


if __name__ == "__main__":
    main()
