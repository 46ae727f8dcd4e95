"""Float64 sharpness values of tiny BERT, ViT, Llama and GPT-NeoX models, as JSON.

A fixed record of what the library measures on models whose symmetry plans are exact, so
that a change that should not move any value (a refactoring, symmetry verification) can be
checked bit for bit: run it before and after, and compare the files.

    python benchmarks/value_snapshot.py --json benchmarks/results/values/float64_values.json
    python benchmarks/value_snapshot.py --compare benchmarks/results/values/float64_values.json

Each model is built from a tiny config (float64, seeded, eager attention) with two batches
of random tokens (or images); for each it records adaptive sharpness and geodesic
sharpness in the inv and mix metrics at fixed radii (:data:`RADII`), 5 Auto-PGD iterations, with
the plan that default discovery finds, and the plan's summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
import transformers

import geoopt_quotient as gq

ITERS = 5
#: Fixed radii (the defaults of release 0.2.0), so that the record does not move with the
#: defaults.
RADII = {"adaptive": 0.2, "inv": 0.05, "mix": 0.01}


def _text_batches(vocab: int, labels: int | None) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (2, 9), generator=gen)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        batch["labels"] = ids if labels is None else torch.randint(0, labels, (2,), generator=gen)
        batches.append(batch)
    return batches


def bert() -> Tuple[torch.nn.Module, List[Any]]:
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
        initializer_range=0.2,
    )
    return transformers.BertForSequenceClassification(config), _text_batches(50, 3)


def vit() -> Tuple[torch.nn.Module, List[Any]]:
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        num_labels=3,
        initializer_range=0.2,
    )
    gen = torch.Generator().manual_seed(1)
    batches = [
        {
            "pixel_values": torch.randn(2, 1, 8, 8, generator=gen, dtype=torch.float64),
            "labels": torch.randint(0, 3, (2,), generator=gen),
        }
        for _ in range(2)
    ]
    return transformers.ViTForImageClassification(config), batches


def llama() -> Tuple[torch.nn.Module, List[Any]]:
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        initializer_range=0.2,
    )
    return transformers.LlamaForCausalLM(config), _text_batches(50, None)


def neox() -> Tuple[torch.nn.Module, List[Any]]:
    config = transformers.GPTNeoXConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        rotary_pct=0.5,
        initializer_range=0.2,
    )
    return transformers.GPTNeoXForCausalLM(config), _text_batches(50, None)


MODELS: Dict[str, Callable[[], Tuple[torch.nn.Module, List[Any]]]] = {
    "bert": bert,
    "vit": vit,
    "llama": llama,
    "gpt-neox": neox,
}


def loss_fn(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def measure(name: str, **options: Any) -> Dict[str, Any]:
    torch.manual_seed(0)
    model, batches = MODELS[name]()
    model = model.to(torch.float64).eval()
    model.config._attn_implementation = "eager"
    row: Dict[str, Any] = {}
    ada = gq.adaptive_sharpness(
        model, loss_fn, batches, rho=RADII["adaptive"], iters=ITERS, progress=False, **options
    )
    row["adaptive"] = ada.value
    for metric in ("inv", "mix"):
        plan = gq.find_symmetries(model, metric=metric)
        geo = gq.geodesic_sharpness(
            model,
            loss_fn,
            batches,
            rho=RADII[metric],
            iters=ITERS,
            symmetries=plan,
            metric=metric,
            progress=False,
            **options,
        )
        row[metric] = geo.value
        row[f"{metric}_per_batch"] = list(geo.per_batch)
    row["plan"] = [line for line in plan.bind(model).summary().splitlines() if line.strip()]
    row["plan"] = [line for line in row["plan"] if not line.startswith("note:")]
    return row


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the values to this file")
    parser.add_argument("--compare", help="compare with this file; exit 1 if any value differs")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument(
        "--keep-best-gradient",
        choices=("auto", "yes", "no"),
        default="auto",
        help="keep Auto-PGD's best gradient (auto: the default, kept for these small models)",
    )
    parser.add_argument(
        "--share-storage", action="store_true", help="the base point in the model's storage"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    keep = {"auto": None, "yes": True, "no": False}[args.keep_best_gradient]
    options = dict(keep_best_gradient=keep, share_storage=args.share_storage)
    values = {}
    for name in args.models.split(","):
        values[name] = measure(name, **options)
        shown = ", ".join(f"{k} {values[name][k]!r}" for k in ("adaptive", "inv", "mix"))
        print(f"{name}: {shown}", flush=True)
    document = {"torch": torch.__version__, "transformers": transformers.__version__, **values}
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
    if args.compare:
        with open(args.compare) as handle:
            before = json.load(handle)
        differ = [
            (name, key)
            for name, row in values.items()
            for key in ("adaptive", "inv", "mix", "inv_per_batch", "mix_per_batch")
            if before[name][key] != row[key]
        ]
        print("identical" if not differ else f"values differ: {differ}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
