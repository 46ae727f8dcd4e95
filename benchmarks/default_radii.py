"""What the default radii mean: sharpness at each measure's default radius / clean loss.

For a tiny BERT (sequence classification), a tiny ViT (image classification) and a tiny
Llama (causal language model), each built from its Hugging Face config with random
weights in float64 (nothing is downloaded or trained), on random batches: the worst-case
sharpness of every measure (adaptive, geodesic inv, geodesic mix) at its default radius
(``geoopt_quotient.sharpness.DEFAULT_RADII``) as a fraction of the mean clean loss, for
the second-order path (the default) and the exact one; and the radii that
``calibrate_radii`` returns for a common target fraction.

    python benchmarks/default_radii.py --json benchmarks/results/cpu/default_radii.json
    python benchmarks/default_radii.py --quick --json /tmp/d.json     # seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import transformers as T

from geoopt_quotient import adaptive_sharpness, calibrate_radii, geodesic_sharpness
from geoopt_quotient.sharpness import DEFAULT_RADII, CalibrationError

MEASURES = ("adaptive", "inv", "mix")
PATHS = ("second_order", "exact")
Model = Tuple[torch.nn.Module, Callable[[Any, Any], torch.Tensor], List[Any]]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_bert(batches: int, batch_size: int) -> Model:
    config = T.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = T.BertForSequenceClassification(config).double().eval()
    g = _generator(1)
    data = [
        (
            torch.randint(0, 100, (batch_size, 16), generator=g),
            torch.randint(0, 3, (batch_size,), generator=g),
        )
        for _ in range(batches)
    ]

    def loss_fn(model, batch):
        ids, labels = batch
        return model(input_ids=ids, labels=labels).loss

    return model, loss_fn, data


def tiny_vit(batches: int, batch_size: int) -> Model:
    config = T.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = T.ViTForImageClassification(config).double().eval()
    g = _generator(2)
    data = [
        (
            torch.randn(batch_size, 3, 16, 16, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (batch_size,), generator=g),
        )
        for _ in range(batches)
    ]

    def loss_fn(model, batch):
        images, labels = batch
        return model(pixel_values=images, labels=labels).loss

    return model, loss_fn, data


def tiny_llama(batches: int, batch_size: int) -> Model:
    config = T.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).double().eval()
    g = _generator(3)
    data = [torch.randint(0, 100, (batch_size, 16), generator=g) for _ in range(batches)]

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn, data


MODELS: Dict[str, Callable[[int, int], Model]] = {
    "bert": tiny_bert,
    "vit": tiny_vit,
    "llama": tiny_llama,
}


def fraction(model, loss_fn, batches, measure: str, path: str, iters: int) -> Dict[str, float]:
    """Worst-case sharpness at the default radius / mean clean loss."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if measure == "adaptive":
            result = adaptive_sharpness(model, loss_fn, batches, iters=iters, progress=False)
        else:
            result = geodesic_sharpness(
                model, loss_fn, batches, metric=measure, path=path, iters=iters, progress=False
            )
    clean = sum(result.clean_losses) / len(result.clean_losses)
    return {
        "rho": result.settings["rho"],
        "sharpness": result.value,
        "clean_loss": clean,
        "fraction": result.value / clean,
        "seconds": time.perf_counter() - start,
        "warnings": sorted(
            {type(w.message).__name__ for w in caught if w.category is not DeprecationWarning}
        ),
    }


def calibrated(model, loss_fn, batches, target: float, iters: int) -> Dict[str, Any]:
    try:
        radii, histories = calibrate_radii(
            model, loss_fn, batches, target=target, iters=iters, return_history=True, progress=False
        )
    except CalibrationError as error:
        return {"error": str(error)}
    return {
        "radii": radii,
        "evaluations": {m: len(h) for m, h in histories.items()},
    }


def main(argv: Sequence[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one batch of 2, 3 iterations")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.batches, args.batch_size = 3, 1, 2
    torch.set_num_threads(args.threads)
    doc: Dict[str, Any] = {
        "experiment": "default_radii",
        "settings": {
            "threads": args.threads,
            "iters": args.iters,
            "batches": args.batches,
            "batch_size": args.batch_size,
            "target": args.target,
            "kind": "worst",
            "default_radii": dict(DEFAULT_RADII),
            "models": "random weights from Hugging Face configs, float64, random batches",
            "quick": args.quick,
        },
        "environment": {
            "torch": torch.__version__,
            "transformers": T.__version__,
            "machine": platform.machine(),
            "python": sys.version.split()[0],
        },
        "models": {},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name, build in MODELS.items():
        model, loss_fn, batches = build(args.batches, args.batch_size)
        rows = {}
        for measure in MEASURES:
            for path in PATHS if measure != "adaptive" else ("straight",):
                rows[f"{measure}/{path}"] = fraction(
                    model, loss_fn, batches, measure, path, args.iters
                )
                print(
                    name,
                    measure,
                    path,
                    f"{rows[f'{measure}/{path}']['fraction']:.4g}",
                    file=sys.stderr,
                )
        doc["models"][name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "at_default_radius": rows,
            "calibrated": calibrated(model, loss_fn, batches, args.target, args.iters),
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
