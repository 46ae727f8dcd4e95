"""Cost of one Auto-PGD iteration: geodesic (inv, mix) versus adaptive sharpness.

Builds a BERT-base-size classifier from its config (random weights, nothing
downloaded), and times whole sharpness runs of ``--iters`` iterations for each measure,
interleaved and repeated so that all three see the same machine load; the ratios of the
medians are reported. Every run is ``iters`` forward+backward passes plus one forward,
for each measure alike, so the ratio of run times is the ratio of iteration costs (plus
one forward+backward per restart of Auto-PGD from an earlier best iterate, whose gradient
is recomputed; there is none while the loss rises at every step).

    python benchmarks/bench_sharpness_iteration.py \\
        --json benchmarks/results/cpu/sharpness_iteration.json
    python benchmarks/bench_sharpness_iteration.py --quick       # tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import geoopt_quotient as gq


def build_model(quick: bool, device: str, dtype: torch.dtype):
    from transformers import BertConfig, BertForSequenceClassification

    if quick:
        config = BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
        )
    else:  # BERT-base sizes
        config = BertConfig(num_labels=3)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).to(device=device, dtype=dtype).eval()
    return model, config


def make_batch(config, batch_size: int, seq_len: int, device: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=g)
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=g)
    return ids.to(device), labels.to(device)


def loss_fn(model, batch):
    ids, labels = batch
    return torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (for CI)")
    parser.add_argument("--iters", type=int, default=3, help="Auto-PGD iterations per run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.seq_len = min(args.batch_size, 4), min(args.seq_len, 16)

    model, config = build_model(args.quick, args.device, torch.float32)
    batch = make_batch(config, args.batch_size, args.seq_len, args.device)
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}
    runs = {
        "adaptive": lambda: gq.adaptive_sharpness(
            model, loss_fn, [batch], rho=0.01, iters=args.iters, progress=False
        ),
        "geodesic-inv": lambda: gq.geodesic_sharpness(
            model,
            loss_fn,
            [batch],
            rho=0.01,
            iters=args.iters,
            symmetries=plans["inv"],
            progress=False,
        ),
        "geodesic-mix": lambda: gq.geodesic_sharpness(
            model,
            loss_fn,
            [batch],
            rho=0.01,
            iters=args.iters,
            symmetries=plans["mix"],
            progress=False,
        ),
    }
    runs["adaptive"]()  # warm-up
    seconds = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.repeats):
        for name in names[rep % 3 :] + names[: rep % 3]:  # rotate the order
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs[name]()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    report = {
        "model": "tiny BERT" if args.quick else "BERT-base (random weights)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": [args.batch_size, args.seq_len],
        "iters": args.iters,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "seconds": seconds,
        "seconds_per_iteration": {k: v / args.iters for k, v in median.items()},
        "ratio_to_adaptive": {k: median[k] / median["adaptive"] for k in median},
        "plan": str(plans["mix"]).splitlines()[-1],
    }
    print(
        f"{report['model']}, {report['parameters']:,} parameters, batch "
        f"{args.batch_size}x{args.seq_len}, {args.iters} iterations x {args.repeats} repeats"
    )
    for name in runs:
        print(
            f"  {name:13s} {report['seconds_per_iteration'][name]:8.3f} s/iteration   "
            f"ratio to adaptive {report['ratio_to_adaptive'][name]:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
