"""Symmetry discovery on real sizes: ``find_symmetries`` + ``bind`` on ``meta`` models (CPU).

Each model is built under ``torch.device("meta")`` (shapes, no weights): a Llama-7B-shaped
causal LM (hidden 4096, 32 layers, 32 heads, MLP 11008, vocabulary 32000), the same with
grouped-query attention (8 key/value heads, Mistral-7B's shape), ViT-B/32 and BERT-base.
Timed with the default kinds (the attention pairs) and ``kinds="all"`` (gated or ReLU
MLP units as well), 1 thread, interleaved, medians of ``--repeats``:

- ``structured``: the groups as boxes of strided parameter views
  (:mod:`geoopt_quotient.symmetry.structured`), the library's way;
- ``index_map``: the same plans with the probes switched off, so that every group holds
  an integer index per covered entry, as before structured layouts. On the 7B shapes it
  is timed on a slice of ``--slice-layers`` layers (tens of seconds and gigabytes per
  32 layers), beside the structured path on the same slice; the per-layer figures of the
  two are comparable, the full-model figure is the structured path's alone.

    python benchmarks/bench_discovery.py --json benchmarks/results/cpu/discovery.json
    python benchmarks/bench_discovery.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from typing import Any, Callable, Dict, List

import torch
import transformers
from _timing import interleaved, medians
from bench_iteration_overhead import write_document

import geoopt_quotient as gq
from geoopt_quotient.symmetry import structured

KINDS = ("default", "all")


def llama(layers: int, kv_heads: int, quick: bool) -> torch.nn.Module:
    width, heads, mlp, vocab = (256, 8, 688, 1000) if quick else (4096, 32, 11008, 32000)
    config = transformers.LlamaConfig(
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads if not quick else heads // (32 // kv_heads),
        intermediate_size=mlp,
        vocab_size=vocab,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def vit_b32(quick: bool) -> torch.nn.Module:
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4) if quick else {}
    config = transformers.ViTConfig(image_size=224, patch_size=32, **size)
    with torch.device("meta"):
        return transformers.ViTForImageClassification(config)


def bert_base(quick: bool) -> torch.nn.Module:
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4) if quick else {}
    config = transformers.BertConfig(**size)
    with torch.device("meta"):
        return transformers.BertForSequenceClassification(config)


@contextmanager
def index_maps():
    """Discovery without the probes: every layout applied to integer index tensors."""
    saved = structured.trace
    structured.trace = lambda layout, shapes: None
    try:
        yield
    finally:
        structured.trace = saved


def discover(model: torch.nn.Module, kinds: str, index_map: bool) -> Callable[[], Any]:
    def run():
        if index_map:
            with index_maps():
                return gq.find_symmetries(model, kinds=kinds).bind(model)
        return gq.find_symmetries(model, kinds=kinds).bind(model)

    return run


def describe(model: torch.nn.Module, kinds: str) -> Dict[str, Any]:
    bound = gq.find_symmetries(model, kinds=kinds).bind(model)
    boxes = sum(len(g.structure.blocks) for g in bound.groups if hasattr(g, "structure"))
    covered = sum(g.shape.numel() for g in bound.symmetric_groups)
    return {
        "symmetric_groups": len(bound.symmetric_groups),
        "covered_entries": covered,
        "boxes": boxes,
        "index_map_bytes": 4 * covered,  # int32 per covered entry, as the index map held
    }


def row(
    build: Callable[[int], torch.nn.Module],
    layers: int,
    slice_layers: int | None,
    repeats: int,
    index_repeats: int,
) -> Dict[str, Any]:
    """Seconds of discovery + bind per kind: structured on the full model; both ways on
    the full model, or, with ``slice_layers``, on a slice of that many layers."""
    model = build(layers)
    out: Dict[str, Any] = {"layers": layers}
    for kinds in KINDS:
        full = medians(interleaved({"structured": discover(model, kinds, False)}, repeats))
        entry: Dict[str, Any] = {"structured_s": full["structured"], **describe(model, kinds)}
        part = model if slice_layers is None else build(slice_layers)
        fns = {
            "structured": discover(part, kinds, False),
            "index_map": discover(part, kinds, True),
        }
        side = medians(interleaved(fns, index_repeats))
        entry["side_by_side"] = {
            "layers": layers if slice_layers is None else slice_layers,
            "structured_s": side["structured"],
            "index_map_s": side["index_map"],
            "speedup": side["index_map"] / side["structured"],
        }
        out[kinds] = entry
    return out


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds), for CI")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--index-repeats", type=int, default=3)
    parser.add_argument("--slice-layers", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    quick = args.quick
    layers = 2 if quick else 32
    repeats, index_repeats = (1, 1) if quick else (args.repeats, args.index_repeats)
    rows = {
        "llama-7b": row(
            lambda n: llama(n, 32, quick), layers, args.slice_layers, repeats, index_repeats
        ),
        "mistral-7b": row(
            lambda n: llama(n, 8, quick), layers, args.slice_layers, repeats, index_repeats
        ),
        "vit-b32": row(lambda n: vit_b32(quick), 2 if quick else 12, None, repeats, index_repeats),
        "bert-base": row(
            lambda n: bert_base(quick), 2 if quick else 12, None, repeats, index_repeats
        ),
    }
    document = write_document("discovery", argparse.Namespace(**{**vars(args), "json": None}), rows)
    document["transformers"] = transformers.__version__
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
    for name, result in rows.items():
        for kinds in KINDS:
            r = result[kinds]
            side = r["side_by_side"]
            print(
                f"{name:11s} {kinds:7s} structured {r['structured_s']:.3f} s "
                f"({result['layers']} layers, {r['boxes']} boxes); on {side['layers']} layers: "
                f"structured {side['structured_s']:.3f} s, index map {side['index_map_s']:.2f} s "
                f"({side['speedup']:.0f}x)"
            )
    return document


if __name__ == "__main__":
    main()
