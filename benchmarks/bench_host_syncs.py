"""Host synchronisations per Auto-PGD iteration on CUDA, by measure and path.

A synchronisation makes the CPU wait for the GPU (``.item()``, ``.tolist()``, a
device-to-host copy, ``nonzero``...); then the GPU idles while the CPU queues the next
kernels. Counted with ``torch.cuda.set_sync_debug_mode`` (see
:func:`geoopt_quotient.testing.count_host_syncs`) for runs of two iteration counts; their
difference over the difference of the counts is the number per iteration, without what a
run does once. The loss's own synchronisations (a plain forward and backward pass of the
same loss) are counted alike and reported beside them: the engine's share is the
difference.

    python benchmarks/bench_host_syncs.py --json benchmarks/results/gpu/host_syncs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from bench_sharpness_iteration import build_model, make_batch

import geoopt_quotient as gq
from geoopt_quotient.testing import host_syncs_per_iteration

PATHS = ("second_order", "exact", "straight")


def tiny_bert(device: torch.device):
    """A tiny Hugging Face BERT classifier on 8 sequences of 16 tokens."""
    model, config = build_model(True, str(device), torch.float32)
    batch = make_batch(config, 8, 16, str(device))

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(input_ids=batch[0]).logits, batch[1])

    return model, [batch], loss_fn


def encoder(device: torch.device):
    """Two ``nn.TransformerEncoderLayer`` blocks and a linear head (no Hugging Face)."""
    torch.manual_seed(0)
    layers = [
        torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True) for _ in range(2)
    ]
    model = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(6 * 16, 3))
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, 16, generator=g).to(device)
    labels = torch.randint(0, 3, (8,), generator=g).to(device)

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m(batch[0]), batch[1])

    return model, [(x, labels)], loss_fn


MODELS = {"encoder": encoder, "tiny-bert": tiny_bert}


def count(model, batches, loss_fn, iters) -> dict:
    def plain(n: int) -> None:
        for _ in range(n):
            loss_fn(model, batches[0]).backward()
        model.zero_grad(set_to_none=True)

    runs = {"loss_forward_backward": plain}
    runs["adaptive"] = lambda n: gq.adaptive_sharpness(model, loss_fn, batches, rho=0.05, iters=n)
    for metric in ("inv", "mix"):
        plan = gq.find_symmetries(model, metric=metric).bind(model)
        for path in PATHS:
            runs[f"geodesic-{metric}-{path}"] = lambda n, path=path, plan=plan: (
                gq.geodesic_sharpness(
                    model, loss_fn, batches, rho=0.05, iters=n, symmetries=plan, path=path
                )
            )
    out = {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        out[name] = host_syncs_per_iteration(run, iters)
        print(f"    {name:28s} {out[name]:6.2f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the counts to this file")
    parser.add_argument(
        "--iters", type=int, nargs=2, default=(2, 4), help="the two iteration counts compared"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return {}
    device = torch.device("cuda")
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "iters": args.iters,
        "per_iteration": {},
    }
    print("host synchronisations per Auto-PGD iteration (the loss's own shown first)")
    for name, build in MODELS.items():
        print(f"  {name}", flush=True)
        report["per_iteration"][name] = count(*build(device), iters=tuple(args.iters))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
