"""Cost of a GeodesicSAM step versus a SAM, an ASAM and a plain SGD step.

Two models, random weights from their configs (nothing is downloaded): the digits ViT of
``examples/sam_digits.py`` (8x8 images, 2x2 patches, width 32, 2 layers, 4 heads; batch
32) and a small ``BertForSequenceClassification`` (width 128, 4 layers, 4 heads, MLP 512,
3 labels; batch 32 x 32 tokens). Every method steps its own copy of the same model with
``torch.optim.SGD`` (momentum 0.9) as base optimizer; SAM, ASAM and GeodesicSAM are
``geoopt_quotient.optim.GeodesicSAM`` with ``ball="euclidean"``, ``"adaptive"`` (eps
0.01) and ``"geodesic"`` (mix and inv metric). Timing is interleaved: each repeat times
``--steps`` steps of every method in turn (the order rotates between repeats), so that all
see the same machine load; the medians over repeats are compared, as ratios to SAM. A
SAM-type step is two forward and backward passes around ``first_step`` (the ascent: the
gradient's norm in the ball's metric, the move, a copy of the parameters) and
``second_step`` (restore, base step); ``first_step`` is also timed on its own.

    python benchmarks/bench_sam.py --out benchmarks/results/sam  # writes bench_sam.json there
    python benchmarks/bench_sam.py --profile                  # and where the time goes
    python benchmarks/bench_sam.py --quick --json /tmp/b.json # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import platform
import pstats
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from geoopt_quotient.optim import GeodesicSAM

METHODS = ("sgd", "sam", "asam", "geodesic-mix", "geodesic-inv")
SAM_KWARGS = {
    "sam": dict(ball="euclidean"),
    "asam": dict(ball="adaptive", eps=0.01),
    "geodesic-mix": dict(ball="geodesic", metric="mix"),
    "geodesic-inv": dict(ball="geodesic", metric="inv"),
}


def build_vit(quick: bool) -> Tuple[torch.nn.Module, Tuple[torch.Tensor, torch.Tensor], str]:
    from transformers import ViTConfig, ViTForImageClassification

    hidden = 16 if quick else 32
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=hidden,
        num_hidden_layers=1 if quick else 2,
        num_attention_heads=2 if quick else 4,
        intermediate_size=2 * hidden,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=10,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = ViTForImageClassification(config)
    g = torch.Generator().manual_seed(1)
    batch = 4 if quick else 32
    images = torch.randn(batch, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    name = f"digits ViT (width {hidden}, {config.num_hidden_layers} layers), batch {batch}"
    return model, (images, labels), name


def build_bert(quick: bool) -> Tuple[torch.nn.Module, Tuple[torch.Tensor, torch.Tensor], str]:
    from transformers import BertConfig, BertForSequenceClassification

    hidden, layers, heads = (32, 1, 2) if quick else (128, 4, 4)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    batch, seq = (4, 8) if quick else (32, 32)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, 3, (batch,), generator=g)
    name = f"BERT (width {hidden}, {layers} layers, {heads} heads), batch {batch}x{seq}"
    return model, (ids, labels), name


MODELS: Dict[str, Callable[[bool], Tuple[torch.nn.Module, Any, str]]] = {
    "vit": build_vit,
    "bert": build_bert,
}


def loss_of(model: torch.nn.Module, batch) -> torch.Tensor:
    inputs, labels = batch
    if inputs.dtype == torch.long:
        logits = model(input_ids=inputs).logits
    else:
        logits = model(pixel_values=inputs).logits
    return torch.nn.functional.cross_entropy(logits, labels)


class Stepper:
    """One method on its own copy of the model; :meth:`run` times ``n`` steps."""

    def __init__(self, method: str, model: torch.nn.Module, batch):
        self.method, self.model, self.batch = method, copy.deepcopy(model).train(), batch
        base = dict(lr=1e-3, momentum=0.9)
        if method == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), **base)
        else:
            self.opt = GeodesicSAM(
                self.model, torch.optim.SGD, rho=0.05, **SAM_KWARGS[method], **base
            )

    def closure(self) -> torch.Tensor:
        loss = loss_of(self.model, self.batch)
        loss.backward()
        return loss

    def run(self, n: int) -> Tuple[float, float]:
        """Seconds per step and seconds of ``first_step`` per step (0 for SGD)."""
        ascent = 0.0
        start = time.perf_counter()
        for _ in range(n):
            self.opt.zero_grad(set_to_none=True)
            self.closure()
            if self.method == "sgd":
                self.opt.step()
                continue
            t0 = time.perf_counter()
            self.opt.first_step(zero_grad=True)
            ascent += time.perf_counter() - t0
            self.closure()
            self.opt.second_step()
        return (time.perf_counter() - start) / n, ascent / n


def profile(stepper: Stepper, steps: int, top: int) -> Dict[str, Any]:
    """cProfile of ``steps`` steps: the functions with the largest own and cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    stepper.run(steps)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt

    def rows(key: str) -> List[Dict[str, Any]]:
        stream = io.StringIO()
        ordered = pstats.Stats(profiler, stream=stream).sort_stats(key)
        out = []
        for func in ordered.fcn_list[:top]:
            _, nc, tt, ct, _ = ordered.stats[func]
            filename, line, name = func
            where = f"{Path(filename).name}:{line}({name})" if line else name
            out.append({"function": where, "calls": nc, "own_s": tt / steps, "cum_s": ct / steps})
        return out

    return {
        "seconds_per_step": total / steps,
        "by_own_time": rows("tottime"),
        "by_cumulative_time": rows("cumulative"),
    }


def bench_model(name: str, args: argparse.Namespace) -> Dict[str, Any]:
    model, batch, description = MODELS[name](args.quick)
    methods = list(args.methods)
    steppers = {m: Stepper(m, model, batch) for m in methods}
    for stepper in steppers.values():
        stepper.run(args.warmup)
    seconds: Dict[str, List[float]] = {m: [] for m in methods}
    ascent: Dict[str, List[float]] = {m: [] for m in methods}
    for rep in range(args.repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            step, up = steppers[method].run(args.steps)
            seconds[method].append(step)
            ascent[method].append(up)
    median = {m: statistics.median(v) for m, v in seconds.items()}
    median_ascent = {m: statistics.median(v) for m, v in ascent.items()}
    report: Dict[str, Any] = {
        "model": description,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds_per_step": seconds,
        "ascent_seconds_per_step": ascent,
        "median_seconds_per_step": median,
        "median_ascent_seconds_per_step": median_ascent,
    }
    if "sam" in median:
        report["ratio_to_sam"] = {m: median[m] / median["sam"] for m in methods}
        report["ascent_minus_sam_share_of_sam_step"] = {
            m: (median_ascent[m] - median_ascent["sam"]) / median["sam"]
            for m in methods
            if m != "sgd"
        }
    if "sgd" in median:
        report["ratio_to_sgd"] = {m: median[m] / median["sgd"] for m in methods}
    geodesic = [m for m in methods if m.startswith("geodesic")]
    if geodesic:
        report["plan"] = str(steppers[geodesic[0]].opt.plan).splitlines()[-1]
    if args.profile:
        report["profile"] = {
            m: profile(steppers[m], args.profile_steps, args.profile_top)
            for m in methods
            if m in ("sam", "geodesic-mix")
        }
    return report


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 repeat (for CI)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats (default 15)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timing (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile SAM and GeodesicSAM (mix) steps"
    )
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write bench_sam.json into this directory")
    parser.add_argument("--json", type=Path, help="write the measurements to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 1, 1
        args.profile_steps, args.profile_top = 1, 5
    for name in ("repeats", "steps", "profile_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    report: Dict[str, Any] = {
        "benchmark": "bench_sam",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(),
        },
        "models": {},
    }
    print(
        f"CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}; medians of "
        f"{args.repeats} interleaved repeats of {args.steps} steps"
    )
    for name in args.models:
        result = bench_model(name, args)
        report["models"][name] = result
        print(f"{result['model']}, {result['parameters']:,} parameters")
        for method, seconds in result["median_seconds_per_step"].items():
            ratio = result.get("ratio_to_sam", {}).get(method)
            line = f"  {method:13s} {1e3 * seconds:8.2f} ms/step"
            if method != "sgd":
                up = result["median_ascent_seconds_per_step"][method]
                line += f"  (first_step {1e3 * up:6.2f} ms)"
            else:
                line += " " * 24
            if ratio is not None:
                line += f"  ratio to SAM {ratio:.3f}"
            print(line)
        for method, prof in result.get("profile", {}).items():
            print(f"  cProfile, {method}: {1e3 * prof['seconds_per_step']:.2f} ms/step; own time:")
            for row in prof["by_own_time"][:12]:
                print(
                    f"    {1e3 * row['own_s']:7.3f} ms  {row['calls'] / args.profile_steps:6.1f}"
                    f" calls/step  {row['function']}"
                )
    paths = [args.json] if args.json else []
    if args.out:
        paths.append(args.out / "bench_sam.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
