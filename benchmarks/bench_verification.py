"""What proving the symmetry plan costs, beside the sharpness call it serves (CPU).

``find_symmetries`` proves every group on the model by default: the rotary probe's recorded
forward pass, which is also the proof's reference pass (with a backward pass for the
controls), and one pass with every group acted on. This benchmark times, interleaved, on a
tiny Llama and on a randomly initialised model of SmolLM2-135M's shape (30 layers, hidden
576, 9 query and 3 key/value heads, 135M parameters):

- ``structure``: ``find_symmetries(model, verify=False)``, module structure alone (with
  the rotary probe, and the V/O pairs replayed on their modules);
- ``proven``: ``find_symmetries(model)``, the default (structure, probe and proof; the
  replays only where the proof fails);
- ``call``: a default ``geodesic_sharpness`` call (20 Auto-PGD iterations, default radius,
  the path report) on one batch of next-token prediction, with the plan given;

and counts the model's forward passes during default discovery. Each discovery runs on a
fresh copy of the model (nothing cached from an earlier call), timed as process time (CPU
seconds of this process) with the garbage collector run before and paused during each
timed function (as :mod:`timeit` does), 1 thread by default, medians of ``--repeats``
interleaved rounds.
The figure asked for is ``proven / call`` (at most 0.10), with ``(proven - structure) /
call`` beside it (less than the proof's own cost, as ``structure`` runs the replays).

    python benchmarks/bench_verification.py --json benchmarks/results/cpu/verification.json
    python benchmarks/bench_verification.py --quick      # seconds, for CI
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import transformers
from bench_iteration_overhead import write_document

import geoopt_quotient as gq

SHAPES = {
    "tiny-llama": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "smollm2-135m-shape": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
}


def build(name: str, quick: bool) -> torch.nn.Module:
    shape = dict(SHAPES[name])
    if quick and name != "tiny-llama":
        shape.update(num_hidden_layers=2, vocab_size=1000)
    config = transformers.LlamaConfig(**shape, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def process_seconds(fns: Dict[str, Callable[[], Any]], repeats: int) -> Dict[str, List[float]]:
    """Process time of each function, ``repeats`` rounds in turn (after one warm-up call
    of ``call``): the CPU time of this process, which other work on the machine does not
    inflate. As :mod:`timeit` does, the garbage collector runs before each function and
    not during it: a collection of the whole interpreter (torch and transformers loaded)
    costs tens of milliseconds, falls in whichever call allocates at that moment, and
    would otherwise decide a median of a few rounds."""
    fns["call"]()
    seconds: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                start = time.process_time()
                fn()
                seconds[name].append(time.process_time() - start)
            finally:
                gc.enable()
    return seconds


class ForwardCount:
    """Counts the model's forward calls (a pre-hook on the top module)."""

    def __init__(self, model: torch.nn.Module):
        self.calls = 0
        model.register_forward_pre_hook(self.count)

    def count(self, module, args) -> None:
        self.calls += 1


def measure(name: str, args) -> Dict[str, Any]:
    model = build(name, args.quick)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.tokens), generator=torch.Generator())
    counter = ForwardCount(model)
    plan = gq.find_symmetries(model)
    forwards = counter.calls
    iters = 2 if args.quick else 20

    def call():
        gq.geodesic_sharpness(
            model, next_token_loss, [batch], symmetries=plan, iters=iters, progress=False
        )

    small = not args.quick and sum(p.numel() for p in model.parameters()) < 1_000_000
    repeats = max(args.repeats, args.small_repeats) if small else args.repeats
    fresh = [copy.deepcopy(model) for _ in range(2 * repeats)]  # nothing cached
    seconds = process_seconds(
        {
            "structure": lambda: gq.find_symmetries(fresh.pop(), verify=False),
            "proven": lambda: gq.find_symmetries(fresh.pop()),
            "call": call,
        },
        repeats,
    )
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": [args.batch, args.tokens],
        "iters": iters,
        "forward_passes_of_default_discovery": forwards,
        "seconds": seconds,
        "median_seconds": med,
        "proven_over_call": med["proven"] / med["call"],
        "proof_over_call": (med["proven"] - med["structure"]) / med["call"],
        "groups": [g.kind for g in plan.groups],
    }


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (4)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence (64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument(
        "--small-repeats",
        type=int,
        default=15,
        help="interleaved rounds for a model under 1M parameters, whose call takes a "
        "fraction of a second (15)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 iterations")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    for name in args.models.split(","):
        rows[name] = measure(name, args)
        row = rows[name]
        print(
            f"{name}: {row['parameters'] / 1e6:.1f}M parameters, default discovery "
            f"{row['forward_passes_of_default_discovery']} forward passes; proven / call "
            f"{row['proven_over_call']:.3f}, proof / call {row['proof_over_call']:.3f}",
            flush=True,
        )
    return write_document("verification", args, rows)


if __name__ == "__main__":
    main()
