"""How far low precision moves sharpness values: float32, TF32, bf16/fp16 autocast and
bf16/fp16 models against a float64 reference.

For each model, measure (adaptive, geodesic inv, geodesic mix) and radius, the same
worst-case sharpness run (same batch, seed and iterations) is made in every precision.
Reported: the value, its error against float64, and that error in units of the
precision's resolution of the loss, ``eps × clean loss`` (eps = 2⁻⁸ for bfloat16, 2⁻¹¹
for float16, 2⁻¹¹ for TF32's 10-bit mantissa, 2⁻²⁴ for float32): a sharpness value is a
difference of two losses, so its absolute error is set by how finely the loss is
resolved, whatever the value. In every mode the geometry (ball, paths, iterates) runs in
float32 or better; only the model's arithmetic changes, except in ``bf16-model-bf16-state``:
the bfloat16 model's Auto-PGD iterates and gradients are stored in bfloat16
(``state_dtype=torch.bfloat16``; still computed in float32), which shrinks the ball by up
to 2⁻⁸ of its radius. Its cost in accuracy is its error beside ``bf16-model``'s.

    python benchmarks/bench_precision.py --device cpu --models tiny --iters 10 \
        --modes float64,float32,bf16-model,bf16-model-bf16-state \
        --json benchmarks/results/cpu/precision_state.json

    python benchmarks/bench_precision.py --json benchmarks/results/gpu/precision.json  # on a GPU
    python benchmarks/bench_precision.py --quick --device cpu               # tiny, for CI

Measured on an H100 (the printed rows: benchmarks/results/gpu/precision.txt); the
documentation's performance page renders them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Callable, Dict, Iterator

import torch
from bench_sharpness_iteration import build_model, make_batch

import geoopt_quotient as gq

EPS = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "bf16-autocast": 2.0**-8,
    "fp16-autocast": 2.0**-11,
    "bf16-model": 2.0**-8,
    "bf16-model-bf16-state": 2.0**-8,
    "fp16-model": 2.0**-11,
}
RADII = {"adaptive": (0.02, 0.2), "inv": (0.1, 1.0), "mix": (0.02, 0.2)}


def bert(size: str, device: torch.device):
    """BERT-tiny on 16 x 16 tokens, or BERT-base on 32 x 128 (random weights, 3 labels)."""
    model, config = build_model(size == "tiny", str(device), torch.float32)
    batch, length = (16, 16) if size == "tiny" else (32, 128)
    return model, [make_batch(config, batch, length, str(device))]


def loss_fn(model, batch):
    """Cross-entropy in float32 at least (float64 for the float64 reference)."""
    ids, labels = batch
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits.to(torch.promote_types(logits.dtype, torch.float32)), labels
    )


@contextlib.contextmanager
def precision(mode: str, model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """The model and the ambient settings of ``mode``; the model back in float32 after."""
    dtypes = {"float64": torch.float64, "fp16-model": torch.float16}
    model.to(torch.bfloat16 if mode.startswith("bf16-model") else dtypes.get(mode, torch.float32))
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with contextlib.ExitStack() as stack:
        if mode == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        if mode.endswith("autocast"):
            dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float16
            stack.enter_context(torch.autocast(device.type, dtype=dtype))
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
            model.float()


def measure(name: str, model, batches, rho: float, iters: int, mode: str) -> gq.SharpnessResult:
    state = torch.bfloat16 if mode.endswith("bf16-state") else None
    options = dict(rho=rho, iters=iters, progress=False, state_dtype=state)
    if name == "adaptive":
        return gq.adaptive_sharpness(model, loss_fn, batches, **options)
    return gq.geodesic_sharpness(model, loss_fn, batches, metric=name, **options)


def study(model, batches, measures, modes, iters: int, device: torch.device, log: Callable) -> list:
    rows = []
    for name in measures:
        radii = RADII[name]
        for rho in radii:
            reference = None
            for mode in modes:
                t0 = time.perf_counter()
                try:
                    with precision(mode, model, device):
                        result = measure(name, model, batches, rho, iters, mode)
                except Exception as error:
                    rows.append(dict(measure=name, rho=rho, mode=mode, error=repr(error)))
                    continue
                reference = result if mode == "float64" else reference
                clean = result.clean_losses[0]
                row = dict(measure=name, rho=rho, mode=mode, value=result.value, clean_loss=clean)
                row["seconds"] = time.perf_counter() - t0
                if reference is not None:
                    error = abs(result.value - reference.value)
                    row["abs_error"] = error
                    row["rel_error"] = error / abs(reference.value) if reference.value else None
                    row["loss_ulps"] = error / (EPS[mode] * abs(reference.clean_losses[0]))
                rows.append(row)
                log(row)
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="tiny,base", help="BERT sizes: tiny, base")
    parser.add_argument("--iters", type=int, default=10, help="Auto-PGD iterations per run")
    parser.add_argument("--measures", default="adaptive,inv,mix")
    parser.add_argument("--modes", default=",".join(EPS), help="precisions; float64 first")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 iterations (CI)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    radii = dict(RADII)
    if args.quick:
        args.models, args.iters = "tiny", 2
        args.modes = "float64,float32,bf16-autocast"
        radii = {name: values[-1:] for name, values in RADII.items()}
    modes = args.modes.split(",")
    if device.type != "cuda" and "tf32" in modes:
        modes.remove("tf32")
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "iters": args.iters,
        "eps": EPS,
        "models": {},
    }

    def log(row: Dict) -> None:
        ulps = row.get("loss_ulps")
        print(
            f"  {row['measure']:8s} rho {row['rho']:<5g} {row['mode']:14s} "
            f"value {row['value']:.6g}  rel.err {row.get('rel_error') or 0:.2e}  "
            f"err/(eps*loss) {'' if ulps is None else f'{ulps:.2f}'}",
            file=sys.stderr,
            flush=True,
        )

    for size in args.models.split(","):
        model, batches = bert(size, device)
        print(f"BERT-{size}", file=sys.stderr, flush=True)
        measures = {name: radii[name] for name in args.measures.split(",")}
        rows = study(model, batches, measures, modes, args.iters, device, log)
        report["models"][f"bert-{size}"] = rows
        del model, batches
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
