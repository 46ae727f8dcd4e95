"""Sharpness on a CUDA GPU: iteration cost, peak memory, the paper's protocol, torch.compile.

    python benchmarks/bench_cuda.py --json benchmarks/results/gpu/bench_cuda.json  # ~6 min (H100)
    python benchmarks/bench_cuda.py --sections iteration,memory --json part1.json
    python benchmarks/bench_cuda.py --sections protocol,compile --json part2.json
    python benchmarks/bench_cuda.py --models vit-b32 --precisions bf16-autocast
    python benchmarks/bench_cuda.py --quick --json quick.json   # CPU, tiny models (CI)

Models (random weights from their configs, nothing downloaded): ``bert-base``, a
BERT-base classifier (3 labels) on batches of 128 sequences x 128 tokens (the paper's
MNLI protocol), and ``vit-b32``, a ViT-B/32-size classifier (224 x 224 images, 1000
labels) on batches of 256 images (its ImageNet protocol); ``--quick``: hidden size 32,
2 layers, 4 heads, batches of 4 (16 tokens; 32 x 32 images, patch 8). The loss is the
cross-entropy of ``logits.float()``. Measures: adaptive sharpness, and geodesic
sharpness with the inv and mix plans of ``find_symmetries`` (bound once per model), all
at radius ``--rho`` (0.01) and otherwise the engine's defaults (worst case, Auto-PGD,
second-order retraction). Precisions: ``float32`` (TF32 and the float32 matmul precision
left at their defaults, which the JSON records) and ``bf16-autocast``: the same float32
model, each timed call wrapped whole (backward and optimizer step included) in
``torch.autocast(device_type, dtype=torch.bfloat16)``; if autocast fails on the device
(e.g. CPU), that precision is dropped and ``settings.precisions_skipped`` says why.

Sections (``--sections``, default all). Every unit (model x precision, or metric x scope)
catches its own exceptions and records ``{"error": ..., "traceback": ...}``; the JSON is
rewritten after every unit, so a killed run keeps what it had (``"status"`` stays
``"running"``).

1. ``iteration``: seconds per Auto-PGD iteration of each measure and of a plain forward
   and backward pass of the same loss (``loss.backward()`` on the model, grads set to
   None before each pass, eval mode like sharpness). A sharpness run of N iterations
   does N forward+backward passes, one forward pass, one more forward+backward per
   Auto-PGD restart from an earlier best iterate, and fixed work (checks, the plan's
   gather, the cached state of the tangent spaces at the base point). So each measure
   runs with N = ``--iters`` and 2N iterations (the plain pass: N and 2N passes), and
   the time per iteration is the difference of the two median run times over N: fixed
   work and the final forward pass cancel. ``--repeats`` rounds, interleaved (the order
   of the measures rotates every round, the two counts alternate), after one warm-up
   call of each; ``torch.cuda.synchronize()`` around every timed call. The loss counts
   its calls with and without grad, so the JSON has every run's passes: restarts show
   as ``extra_forward_backward_passes``, and the time per forward+backward pass
   (difference of times over difference of passes) is given next to the time per
   iteration. Ratios geodesic / adaptive (target <= 1.05), each measure / plain pass.
2. ``memory`` (CUDA only; skipped on CPU): peak allocated memory
   (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) of a training
   step (forward, backward, ``torch.optim.SGD(lr=1e-3).step()``; in eval mode like
   sharpness; the weights are restored afterwards) and of each measure with
   ``--memory-iters`` iterations, in total and above what was allocated before the call
   (model, batch, and each plan's index cache on the device, made by the warm-up).
   Garbage is collected, the cache emptied and the grads dropped before each
   measurement. Target: peak <= 1.3 x the training step's.
3. ``protocol``: the paper's protocol, per model: ``--protocol-batches`` (8) batches of
   ``--protocol-iters`` (20) Auto-PGD iterations (BERT: 1024 sequences, ViT: 2048
   images), one timed call each of geodesic-mix and adaptive after a 1-iteration
   warm-up, with values, per-batch values, losses and times.
4. ``compile``: on BERT-base, the geometry of one iteration at the base point, for every
   group of the inv and mix plans (``--compile-scopes all``; ``symmetric``: the GL(h)
   quotient groups only): ``egrad2rgrad`` of a random vector, the metric inner product
   of the result, and ``retr`` (second-order retraction) of a random tangent vector of
   norm ``--rho``, through the cached ``tangent_space`` as the engine uses it, without
   autograd. Eager versus ``torch.compile`` (``--compile-mode``): compile time (the
   first call), steady-state medians of ``--compile-repeats`` interleaved calls,
   speed-up, the compiled graphs and Dynamo's graph breaks, and the eager step's share
   of a forward+backward pass (from the iteration section, BERT-base float32). Skipped
   in ``--quick`` mode on CPU unless named in ``--sections`` (compiling on CPU needs a
   C++ compiler and minutes).

Work runs model by model so that one model's tensors are on the device at a time:
iteration and memory for each model, then the protocol for each model, then compile.
``--budget`` seconds (default 360) bound the run: a unit that would start after it is
recorded as skipped (a protocol run: that is estimated, from the iteration section, to
end after it; a compile: with less than 90 s left, 30 s for ``symmetric``), to be run
later with ``--sections``.

Estimated full run on one H100 SXM, from FLOPs: a BERT-base forward+backward pass on
128 x 128 tokens is ~9 TFLOP, ~0.2 s in float32 (no TF32, ~50 TFLOP/s) and ~0.05 s
under bfloat16 autocast; ViT-B/32 on 256 images ~7 TFLOP, ~0.15 s and ~0.04 s. The
iteration section is ~115 pass-equivalents per model and precision (~70 s in all),
memory ~10 s, the protocol 2 x 8 x 21 passes per model and precision (~165 s), model
building and symmetry plans ~40 s, compile ~60-100 s: about 6 to 6.5 minutes, so the
budget may skip the last compile unit; a PCIe H100 is ~25% slower in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Sequence, Tuple

import torch
from _timing import interleaved, sync
from bench_sharpness_iteration import build_model as build_bert

import geoopt_quotient as gq

SECTIONS = ("iteration", "memory", "protocol", "compile")
MODELS = ("bert-base", "vit-b32")
PRECISIONS = ("float32", "bf16-autocast")
MEASURES = ("adaptive", "geodesic-inv", "geodesic-mix")
PLAIN = "forward-backward"
PROTOCOL_MEASURES = ("geodesic-mix", "adaptive")
SCOPES = ("symmetric", "all")
ITERATION_TARGET = 1.05
MEMORY_TARGET = 1.3
#: Seconds that must be left to start a compile of each scope.
COMPILE_RESERVE = {"symmetric": 30.0, "all": 90.0}

# Full sizes, then --quick sizes.
BATCH_SIZE = {"bert-base": (128, 4), "vit-b32": (256, 4)}
SEQ_LEN = (128, 16)
IMAGE = (224, 32)  # image size (ViT patches: 32 full, 8 quick)
DEFAULTS = {  # option: (full, quick)
    "iters": (3, 1),
    "repeats": (3, 1),
    "memory_iters": (3, 1),
    "protocol_iters": (20, 1),
    "protocol_batches": (8, 2),
    "compile_repeats": (20, 3),
    "budget": (360.0, 120.0),
}


# ----------------------------------------------------------------------------- models


def bert_loss(model, batch) -> torch.Tensor:
    ids, labels = batch
    return torch.nn.functional.cross_entropy(model(input_ids=ids).logits.float(), labels)


def vit_loss(model, batch) -> torch.Tensor:
    pixels, labels = batch
    return torch.nn.functional.cross_entropy(model(pixel_values=pixels).logits.float(), labels)


def build_vit(quick: bool, device: str):
    from transformers import ViTConfig, ViTForImageClassification

    if quick:
        sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        config = ViTConfig(
            image_size=IMAGE[1], patch_size=8, intermediate_size=64, num_labels=10, **sizes
        )
    else:  # ViT-B/32 sizes
        sizes = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
        config = ViTConfig(
            image_size=IMAGE[0], patch_size=32, intermediate_size=3072, num_labels=1000, **sizes
        )
    torch.manual_seed(0)
    return ViTForImageClassification(config).to(device).eval(), config


def make_batches(name: str, config, quick: bool, count: int, device: str, seed: int) -> list:
    """``count`` random batches, the same for any ``count`` (batch i from seed + i)."""
    size = BATCH_SIZE[name][quick]
    batches = []
    for index in range(count):
        g = torch.Generator(device=device).manual_seed(seed + 1000 + index)
        labels = torch.randint(0, config.num_labels, (size,), generator=g, device=device)
        if name == "bert-base":
            shape = (size, SEQ_LEN[quick])
            inputs = torch.randint(0, config.vocab_size, shape, generator=g, device=device)
        else:
            shape = (size, 3, IMAGE[quick], IMAGE[quick])
            inputs = torch.randn(shape, generator=g, device=device)
        batches.append((inputs, labels))
    return batches


class CountingLoss:
    """A loss function that counts its calls with and without grad.

    The engine evaluates the loss with grad enabled exactly when it differentiates it,
    so the counts are the run's forward+backward and forward-only passes.
    """

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor]):
        self.fn = fn
        self.with_grad = self.without_grad = 0

    def __call__(self, model, batch) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.with_grad += 1
        else:
            self.without_grad += 1
        return self.fn(model, batch)

    def take(self) -> Dict[str, int]:
        """The counts since the last call, then reset."""
        counts = {"forward_backward": self.with_grad, "forward": self.without_grad}
        self.with_grad = self.without_grad = 0
        return counts


@dataclass
class Case:
    """One model on the device, its loss, batches and bound symmetry plans."""

    name: str
    model: torch.nn.Module
    loss: CountingLoss
    batches: list
    plans: Dict[str, Any]
    warm: set = field(default_factory=set)  # precisions warmed up


# ----------------------------------------------------------------------------- the run


class Budget:
    """Wall-clock seconds for the whole run (0: unlimited)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds <= 0 else self.seconds - self.elapsed()

    def skip(self, need: float = 0.0) -> Dict[str, str] | None:
        """``{"skipped": why}`` if fewer than ``need`` seconds are left, else None."""
        if self.left() > need:
            return None
        return {
            "skipped": f"time budget: {self.left():.0f} s left of --budget {self.seconds:g} s, "
            f"about {need:.0f} s needed; run this part with --sections"
        }


@dataclass
class Run:
    args: argparse.Namespace
    budget: Budget
    report: Dict[str, Any]
    symmetries: Dict[Tuple[str, str], Any] = field(default_factory=dict)  # unbound plans

    def log(self, message: str) -> None:
        print(f"[{self.budget.elapsed():7.1f} s] {message}", file=sys.stderr, flush=True)

    def write(self) -> None:
        self.report["elapsed_seconds"] = self.budget.elapsed()
        if self.args.json:  # atomically, so a killed run leaves a readable file
            tmp = f"{self.args.json}.tmp"
            with open(tmp, "w") as f:
                json.dump(finite(self.report), f, indent=2)
            os.replace(tmp, self.args.json)

    def guarded(self, what: str, fn: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        """``fn()``, or ``{"error": ...}`` if it raises; memory is collected either way."""
        try:
            out = fn()
        except Exception as exc:
            self.log(f"{what}: {type(exc).__name__}: {exc}")
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        release(self.args.device)
        return out


def finite(obj: Any) -> Any:
    """``obj`` with NaN/Inf floats replaced by None (the JSON stays standard)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def release(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def precision_context(precision: str, device: str) -> ContextManager:
    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def autocast_failure(device: str) -> str | None:
    """Why bfloat16 autocast does not work on ``device`` (None: it does)."""
    try:
        with precision_context("bf16-autocast", device):
            x = torch.randn(8, 8, device=device, requires_grad=True)
            (x @ x).float().sum().backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def build_case(run: Run, name: str, metrics: Sequence[str], batches: int) -> Case:
    """Model, batches and bound plans (symmetries found once per model and run)."""
    quick, device = run.args.quick, run.args.device
    run.log(f"{name}: building the model")
    if name == "bert-base":
        model, config = build_bert(quick, device, torch.float32)
        loss = CountingLoss(bert_loss)
    else:
        model, config = build_vit(quick, device)
        loss = CountingLoss(vit_loss)
    plans = {}
    for metric in metrics:
        key = (name, metric)
        if key not in run.symmetries:
            run.symmetries[key] = gq.find_symmetries(model, metric=metric)
        plans[metric] = run.symmetries[key].bind(model)
    data = make_batches(name, config, quick, batches, device, run.args.seed)
    info = run.report["models"].setdefault(name, {})
    info.update(
        parameters=sum(p.numel() for p in model.parameters()),
        attention=getattr(model.config, "_attn_implementation", None),
        config={k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers")},
    )
    if data:
        info["batch_shape"] = list(data[0][0].shape)
    for metric, plan in plans.items():
        info[f"plan_{metric}"] = next(
            (line for line in str(plan).splitlines() if "symmetric groups" in line), ""
        )
    return Case(name, model, loss, data, plans)


def sharpness(case: Case, measure: str, iters: int, batches: list, rho: float):
    if measure == "adaptive":
        return gq.adaptive_sharpness(
            case.model, case.loss, batches, rho=rho, iters=iters, progress=False
        )
    plan = case.plans[measure.split("-")[1]]
    return gq.geodesic_sharpness(
        case.model, case.loss, batches, rho=rho, iters=iters, symmetries=plan, progress=False
    )


def forward_backward(case: Case, passes: int, batch) -> None:
    """``passes`` plain forward+backward passes of the loss (grads set to None before each)."""
    for _ in range(passes):
        case.model.zero_grad(set_to_none=True)
        case.loss(case.model, batch).backward()
    case.model.zero_grad(set_to_none=True)


def call(case: Case, measure: str, iters: int, batches: list, rho: float) -> float | None:
    """Run ``measure`` with ``iters`` iterations (passes); its sharpness value, if any."""
    if measure == PLAIN:
        forward_backward(case, iters, batches[0])
        return None
    return sharpness(case, measure, iters, batches, rho).value


def timed(fn: Callable[[], Any], device: str) -> Tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def warm_up(run: Run, case: Case, precision: str, measures: Sequence[str]) -> None:
    """One 1-iteration call of each measure (kernels, cuBLAS, the plans' device caches)."""
    run.log(f"{case.name} {precision}: warm-up")
    with precision_context(precision, run.args.device):
        for measure in measures:
            call(case, measure, 1, case.batches[:1], run.args.rho)
    case.loss.take()
    case.warm.add(precision)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# ----------------------------------------------------------------------------- 1. iteration


def iteration_unit(run: Run, case: Case, precision: str) -> Dict[str, Any]:
    args = run.args
    counts = (args.iters, 2 * args.iters)
    names = (PLAIN, *MEASURES)
    warm_up(run, case, precision, names)
    samples: Dict[str, Dict[int, List[dict]]] = {m: {n: [] for n in counts} for m in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for measure in order:
            for n in counts if rep % 2 == 0 else counts[::-1]:
                with precision_context(precision, args.device):
                    seconds, value = timed(
                        functools.partial(call, case, measure, n, case.batches[:1], args.rho),
                        args.device,
                    )
                samples[measure][n].append(dict(seconds=seconds, value=value, **case.loss.take()))
                run.log(
                    f"{case.name} {precision}: {measure} x{n} round {rep + 1}/{args.repeats} "
                    f"{seconds:.3f} s"
                )
    measures = {m: summarize_runs(samples[m], counts) for m in names}
    per_iter = {m: measures[m]["seconds_per_iteration"] for m in names}
    per_pass = {m: measures[m]["seconds_per_forward_backward_pass"] for m in names}
    to_adaptive = {m: ratio(per_iter[m], per_iter["adaptive"]) for m in MEASURES[1:]}
    return {
        "iteration_counts": list(counts),
        "repeats": args.repeats,
        "seconds_per_iteration": per_iter,
        "ratio_to_adaptive": to_adaptive,
        "ratio_to_adaptive_per_pass": {
            m: ratio(per_pass[m], per_pass["adaptive"]) for m in MEASURES[1:]
        },
        "ratio_to_forward_backward": {m: ratio(per_iter[m], per_iter[PLAIN]) for m in MEASURES},
        "target": ITERATION_TARGET,
        "within_target": {
            m: None if r is None else r <= ITERATION_TARGET for m, r in to_adaptive.items()
        },
        "measures": measures,
    }


def summarize_runs(runs: Dict[int, List[dict]], counts: Tuple[int, int]) -> Dict[str, Any]:
    """Medians of whole runs at both counts, and the per-iteration difference."""
    short, long = counts
    med = {n: statistics.median(r["seconds"] for r in runs[n]) for n in counts}
    passes = {n: statistics.median(r["forward_backward"] for r in runs[n]) for n in counts}
    per_iteration = (med[long] - med[short]) / (long - short)
    values = [r["value"] for r in runs[long] if r["value"] is not None]
    return {
        "seconds": {str(n): [r["seconds"] for r in runs[n]] for n in counts},
        "median_seconds": {str(n): med[n] for n in counts},
        "passes": {
            str(n): {k: [r[k] for r in runs[n]] for k in ("forward_backward", "forward")}
            for n in counts
        },
        # forward+backward passes beyond one per iteration: Auto-PGD restarts
        "extra_forward_backward_passes": {str(n): passes[n] - n for n in counts},
        "seconds_per_iteration": per_iteration,
        "seconds_per_iteration_by_round": [
            (b["seconds"] - a["seconds"]) / (long - short) for a, b in zip(runs[short], runs[long])
        ],
        "seconds_per_forward_backward_pass": ratio(
            med[long] - med[short], passes[long] - passes[short]
        ),
        # set-up, the final forward pass and anything else not repeated per iteration
        "fixed_seconds": med[short] - short * per_iteration,
        "value": values[-1] if values else None,
    }


# ----------------------------------------------------------------------------- 2. memory


class CudaMemory:
    """The CUDA caching allocator's statistics (the memory section reads these only)."""

    @staticmethod
    def available(device: str) -> bool:
        return torch.device(device).type == "cuda"

    @staticmethod
    def allocated(device: str) -> int:
        return torch.cuda.memory_allocated(device)

    @staticmethod
    def reset_peak(device: str) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    @staticmethod
    def peak(device: str) -> int:
        return torch.cuda.max_memory_allocated(device)

    @staticmethod
    def peak_reserved(device: str) -> int:
        return torch.cuda.max_memory_reserved(device)


MEMORY = CudaMemory()


def peak_of(fn: Callable[[], Any], device: str) -> Dict[str, int]:
    release(device)
    baseline = MEMORY.allocated(device)
    MEMORY.reset_peak(device)
    fn()
    sync(device)
    peak = MEMORY.peak(device)
    return {
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "increment_bytes": peak - baseline,
        "peak_reserved_bytes": MEMORY.peak_reserved(device),
    }


def training_step(case: Case, batch) -> None:
    optimizer = torch.optim.SGD(case.model.parameters(), lr=1e-3)
    case.model.zero_grad(set_to_none=True)
    case.loss(case.model, batch).backward()
    optimizer.step()
    case.model.zero_grad(set_to_none=True)


def memory_unit(run: Run, case: Case, precision: str) -> Dict[str, Any]:
    args = run.args
    if precision not in case.warm:
        warm_up(run, case, precision, (PLAIN, *MEASURES))
    batch = case.batches[0]
    context = functools.partial(precision_context, precision, args.device)
    saved = {k: v.detach().to("cpu", copy=True) for k, v in case.model.state_dict().items()}

    def step() -> None:
        with context():
            training_step(case, batch)

    runs = {"train-step": peak_of(step, args.device)}
    case.model.load_state_dict(saved)  # undo the SGD step
    del saved
    runs["train-step"]["passes"] = case.loss.take()
    for measure in MEASURES:

        def measured(measure: str = measure) -> None:
            with context():
                sharpness(case, measure, args.memory_iters, [batch], args.rho)

        runs[measure] = peak_of(measured, args.device)
        runs[measure]["passes"] = case.loss.take()
        run.log(
            f"{case.name} {precision}: {measure} peak {runs[measure]['peak_bytes'] / 2**30:.2f} GiB"
        )
    train = runs["train-step"]
    peaks = {m: ratio(r["peak_bytes"], train["peak_bytes"]) for m, r in runs.items()}
    return {
        "iters": args.memory_iters,
        "model_bytes": sum(t.numel() * t.element_size() for t in case.model.state_dict().values()),
        "batch_bytes": sum(t.numel() * t.element_size() for t in batch),
        "runs": runs,
        "peak_ratio_to_training_step": peaks,
        "increment_ratio_to_training_step": {
            m: ratio(r["increment_bytes"], train["increment_bytes"]) for m, r in runs.items()
        },
        "target": MEMORY_TARGET,
        "within_target": {m: None if r is None else r <= MEMORY_TARGET for m, r in peaks.items()},
    }


# ----------------------------------------------------------------------------- 3. protocol


def protocol_unit(run: Run, case: Case, precision: str) -> Dict[str, Any]:
    args = run.args
    warm_up(run, case, precision, args.protocol_measures)
    out: Dict[str, Any] = {
        "batches": len(case.batches),
        "iters": args.protocol_iters,
        "examples": len(case.batches) * BATCH_SIZE[case.name][args.quick],
        "measures": {},
    }
    for measure in args.protocol_measures:
        timing = lookup(run.report, case.name, precision, measure)
        need = (
            (timing["seconds_per_iteration"] * args.protocol_iters + timing["fixed_seconds"])
            * len(case.batches)
            if timing
            else 0.0
        )
        skipped = run.budget.skip(need)
        if skipped:
            out["measures"][measure] = skipped
            run.log(f"{case.name} {precision}: protocol {measure} skipped (budget)")
            continue
        run.log(f"{case.name} {precision}: protocol {measure} (about {need:.0f} s)")
        with precision_context(precision, args.device):
            seconds, result = timed(
                lambda m=measure: sharpness(case, m, args.protocol_iters, case.batches, args.rho),
                args.device,
            )
        out["measures"][measure] = {
            "seconds": seconds,
            "estimated_seconds": need or None,
            "value": result.value,
            "per_batch": result.per_batch,
            "clean_losses": result.clean_losses,
            "perturbed_losses": result.perturbed_losses,
            "seconds_per_batch": result.seconds_per_batch,
            "passes": case.loss.take(),
        }
        run.log(f"{case.name} {precision}: protocol {measure} {seconds:.1f} s")
    times = {m: r.get("seconds") for m, r in out["measures"].items()}
    out["ratio_geodesic_mix_to_adaptive"] = ratio(times.get("geodesic-mix"), times.get("adaptive"))
    return out


def lookup(report: Dict[str, Any], model: str, precision: str, measure: str) -> dict | None:
    """A measure's summary in the iteration section (None if not measured)."""
    try:
        return report["iteration"]["results"][model][precision]["measures"][measure]
    except (KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- 4. compile


def geometry_step(spaces: Sequence[Any]) -> Callable:
    """The geometry of one iteration at the base point, for every tangent space."""

    def step(egrads: List[torch.Tensor], tangents: List[torch.Tensor]):
        rgrads = [space.egrad2rgrad(g) for space, g in zip(spaces, egrads)]
        inner = sum(space.inner(r, r) for space, r in zip(spaces, rgrads))
        moved = [space.retr(u) for space, u in zip(spaces, tangents)]
        return rgrads, inner, moved

    return step


def tensors(nested: Any) -> List[torch.Tensor]:
    """The tensors of nested lists and tuples, depth first."""
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for item in nested for t in tensors(item)]


def max_relative_difference(a: Any, b: Any) -> float:
    """Largest |a - b| / max |a| over the tensors of two nested outputs."""
    worst = 0.0
    for x, y in zip(tensors(a), tensors(b)):
        scale = float(x.abs().max()) if x.numel() else 0.0
        worst = max(worst, float((x - y).abs().max()) / scale if scale > 0 else 0.0)
    return worst


def compile_unit(run: Run, case: Case, metric: str, scope: str) -> Dict[str, Any]:
    from geoopt_quotient.manifolds.tangent import tangent_space
    from geoopt_quotient.sharpness.functional import trainable_parameters

    args = run.args
    plan = case.plans[metric]
    # the ball's points and spaces as geoopt_quotient.sharpness.ball builds them
    points = [p.detach() for p in plan.gather(trainable_parameters(case.model))]
    chosen = [i for i, g in enumerate(plan.groups) if scope == "all" or g.kind != "adaptive"]
    spaces = [tangent_space(plan.groups[i].manifold, points[i]) for i in chosen]
    g = torch.Generator(device=points[0].device).manual_seed(args.seed)
    with torch.no_grad():
        egrads = [
            torch.randn(points[i].shape, generator=g, device=points[i].device) for i in chosen
        ]
        tangents = [space.random(g) for space in spaces]
        norm = sum(space.inner(u, u) for space, u in zip(spaces, tangents)).sqrt()
        tangents = [u * (args.rho / norm) for u in tangents]
        step = geometry_step(spaces)
        expected = step(egrads, tangents)  # also builds the spaces' cached state
        torch._dynamo.reset()
        dynamo_counters().clear()
        compiled = torch.compile(step, mode=args.compile_mode)
        run.log(f"compile {metric} {scope}: compiling ({len(spaces)} groups)")
        compile_seconds, result = timed(lambda: compiled(egrads, tangents), args.device)
        graphs = graph_report()
        second_seconds, _ = timed(lambda: compiled(egrads, tangents), args.device)
        difference = max_relative_difference(expected, result)
        del expected, result
        times = interleaved(
            {
                "eager": lambda: step(egrads, tangents),
                "compiled": lambda: compiled(egrads, tangents),
            },
            args.compile_repeats,
            device=args.device,
        )
    eager, fast = (statistics.median(times[k]) for k in ("eager", "compiled"))
    plain = (lookup(run.report, "bert-base", "float32", PLAIN) or {}).get("seconds_per_iteration")
    run.log(f"compile {metric} {scope}: eager {eager * 1e3:.2f} ms, compiled {fast * 1e3:.2f} ms")
    return {
        "groups": len(spaces),
        "entries": sum(points[i].numel() for i in chosen),
        "compile_seconds": compile_seconds,
        "second_call_seconds": second_seconds,
        "eager_ms": eager * 1e3,
        "compiled_ms": fast * 1e3,
        "speedup": ratio(eager, fast),
        "eager_share_of_forward_backward": ratio(eager, plain),
        "compiled_share_of_forward_backward": ratio(fast, plain),
        "max_relative_difference": difference,
        **graphs,
        "seconds": times,
    }


def dynamo_counters() -> Dict[str, Any]:
    """torch._dynamo's event counters (an internal API: an empty dict if it moved)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return counters


def graph_report() -> Dict[str, Any]:
    """How many graphs the compile made, and why Dynamo broke the function's graph."""
    counters = dynamo_counters()
    reasons: Dict[str, int] = {}
    for reason, count in counters.get("graph_break", {}).items():
        line = str(reason).strip().splitlines()[0]
        reasons[line] = reasons.get(line, 0) + count
    return {
        "graphs": counters.get("stats", {}).get("unique_graphs"),
        "frames": counters.get("frames", {}).get("total"),
        "graph_breaks": sum(reasons.values()),
        "graph_break_reasons": reasons,
    }


# ----------------------------------------------------------------------------- driver


def environment(args: argparse.Namespace) -> Dict[str, Any]:
    import importlib.metadata

    device = torch.device(args.device)
    env: Dict[str, Any] = {
        "device": args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cpu_threads": torch.get_num_threads(),
        "cpu_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    for package in ("transformers", "geoopt", "triton"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    env["geoopt_quotient"] = getattr(gq, "__version__", None)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        env.update(
            gpu=torch.cuda.get_device_name(device),
            gpu_memory_bytes=properties.total_memory,
            gpu_capability=list(torch.cuda.get_device_capability(device)),
        )
    return env


def phase_iteration_memory(run: Run, precisions: Sequence[str]) -> None:
    sections = [s for s in ("iteration", "memory") if s in run.args.sections]
    if "memory" in sections and not MEMORY.available(run.args.device):
        run.report["memory"]["skipped"] = (
            f"no CUDA memory statistics on {run.args.device} (peak resident memory on CPU: "
            "benchmarks/bench_memory.py)"
        )
        sections.remove("memory")
    if not sections:
        return
    units = {"iteration": iteration_unit, "memory": memory_unit}
    for name in run.args.models:
        case = None
        try:
            case = build_case(run, name, ("inv", "mix"), 1)
        except Exception as exc:
            for section in sections:
                run.report[section]["results"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        for section in sections if case is not None else ():
            results = run.report[section]["results"].setdefault(name, {})
            for precision in precisions:
                results[precision] = run.budget.skip() or run.guarded(
                    f"{section} {name} {precision}",
                    functools.partial(units[section], run, case, precision),
                )
                run.write()
        del case
        release(run.args.device)
        run.write()


def phase_protocol(run: Run, precisions: Sequence[str]) -> None:
    if "protocol" not in run.args.sections:
        return
    for name in run.args.models:
        results = run.report["protocol"]["results"].setdefault(name, {})
        skipped = run.budget.skip()
        if skipped:
            results.update(skipped)
            continue
        case = None
        try:
            case = build_case(run, name, ("mix",), run.args.protocol_batches)
        except Exception as exc:
            results["error"] = f"{type(exc).__name__}: {exc}"
        for precision in precisions if case is not None else ():
            results[precision] = run.budget.skip() or run.guarded(
                f"protocol {name} {precision}",
                functools.partial(protocol_unit, run, case, precision),
            )
            run.write()
        del case
        release(run.args.device)
        run.write()


def phase_compile(run: Run) -> None:
    args = run.args
    if "compile" not in args.sections:
        return
    section = run.report["compile"]
    if args.quick and torch.device(args.device).type == "cpu" and not args.sections_named:
        section["skipped"] = (
            "--quick on CPU: torch.compile needs a C++ compiler and minutes there; "
            "name the section in --sections to run it"
        )
        return
    case = None
    try:
        case = build_case(run, "bert-base", ("inv", "mix"), 0)
    except Exception as exc:
        section["error"] = f"{type(exc).__name__}: {exc}"
    for scope in args.compile_scopes if case is not None else ():  # cheap scope first
        for metric in ("inv", "mix"):
            section["results"].setdefault(metric, {})[scope] = run.budget.skip(
                COMPILE_RESERVE[scope]
            ) or run.guarded(
                f"compile {metric} {scope}",
                functools.partial(compile_unit, run, case, metric, scope),
            )
            run.write()
    del case
    release(args.device)


def new_report(args: argparse.Namespace, precisions: Sequence[str]) -> Dict[str, Any]:
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "sections_named")} | {
        "precisions": list(precisions)
    }
    return {
        "benchmark": "bench_cuda",
        "status": "running",
        "settings": settings,
        "environment": {},
        "models": {},
        "iteration": {
            "method": f"(median time of {2 * args.iters} iterations - median of {args.iters}) "
            f"/ {args.iters}, {args.repeats} interleaved rounds; per pass: over the difference "
            "in forward+backward passes",
            "target_ratio": ITERATION_TARGET,
            "results": {},
        },
        "memory": {"target_ratio": MEMORY_TARGET, "results": {}},
        "protocol": {
            "iters": args.protocol_iters,
            "batches": args.protocol_batches,
            "results": {},
        },
        "compile": {"mode": args.compile_mode or "default", "results": {}},
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:7]),
    )
    parser.add_argument("--quick", action="store_true", help="tiny models on CPU, seconds (CI)")
    parser.add_argument("--device", help="torch device (default: cuda; --quick: cpu)")
    parser.add_argument(
        "--sections",
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="default: %(default)s")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="default: %(default)s")
    parser.add_argument("--rho", type=float, default=0.01, help="radius of every measure")
    for option, help_text in (
        ("iters", "iteration section: N, timed with N and 2N iterations"),
        ("repeats", "iteration section: interleaved rounds"),
        ("memory-iters", "memory section: Auto-PGD iterations"),
        ("protocol-iters", "protocol section: Auto-PGD iterations per batch"),
        ("protocol-batches", "protocol section: batches per model"),
        ("compile-repeats", "compile section: timed calls of each side"),
    ):
        full, quick = DEFAULTS[option.replace("-", "_")]
        parser.add_argument(
            f"--{option}", type=int, help=f"{help_text} (default {full}; --quick: {quick})"
        )
    parser.add_argument(
        "--protocol-measures",
        default=",".join(PROTOCOL_MEASURES),
        help="protocol section: the measures timed (default: %(default)s)",
    )
    parser.add_argument(
        "--compile-scopes",
        default="all",
        help="groups whose geometry is compiled: 'all' (every group of the plan) and/or "
        "'symmetric' (the GL(h) quotients only) (default: %(default)s)",
    )
    parser.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode (default: %(default)s, i.e. mode=None)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole run; what would start later is skipped and recorded "
        f"(default {DEFAULTS['budget'][0]:g}; --quick: {DEFAULTS['budget'][1]:g}; 0: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the batches and the compile section's random vectors (the models' "
        "weights always come from seed 0)",
    )
    parser.add_argument("--json", help="write the measurements to this file (after every unit)")
    args = parser.parse_args(argv)
    for key, (full, quick) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.sections_named = args.sections is not None
    args.sections = split_choices(
        parser, "--sections", args.sections or ",".join(SECTIONS), SECTIONS
    )
    args.models = split_choices(parser, "--models", args.models, MODELS)
    args.precisions = split_choices(parser, "--precisions", args.precisions, PRECISIONS)
    args.compile_scopes = split_choices(parser, "--compile-scopes", args.compile_scopes, SCOPES)
    args.protocol_measures = split_choices(
        parser, "--protocol-measures", args.protocol_measures, PROTOCOL_MEASURES
    )
    args.compile_mode = None if args.compile_mode == "default" else args.compile_mode
    for key in ("iters", "repeats", "memory_iters", "protocol_iters", "protocol_batches"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if not (math.isfinite(args.rho) and args.rho > 0):
        parser.error("--rho must be a positive number")
    args.device = args.device or ("cpu" if args.quick else "cuda")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --quick, or --device cpu")
    return args


def split_choices(
    parser: argparse.ArgumentParser, option: str, value: str, choices: Sequence[str]
) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if bad or not items:
        parser.error(f"{option}: expected a comma-separated subset of {','.join(choices)}")
    return [c for c in choices if c in items]  # canonical order


def main(argv: Sequence[str] | None = None) -> Dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    precisions = list(args.precisions)
    failure = autocast_failure(args.device) if "bf16-autocast" in precisions else None
    if failure:
        precisions.remove("bf16-autocast")
    run = Run(args, Budget(args.budget), new_report(args, precisions))
    if failure:
        run.report["settings"]["precisions_skipped"] = {"bf16-autocast": failure}
    run.report["environment"] = run.guarded("environment", functools.partial(environment, args))
    run.log(f"bench_cuda on {args.device}: sections {','.join(args.sections)}")
    run.write()
    try:
        phase_iteration_memory(run, precisions)
        phase_protocol(run, precisions)
        phase_compile(run)
    except BaseException:
        run.report["status"] = "interrupted"
        run.write()
        raise
    run.report["status"] = "complete"
    run.write()
    report = finite(run.report)
    print_summary(report)
    return report


# ----------------------------------------------------------------------------- table


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def unit_note(unit: Dict[str, Any]) -> str | None:
    for key in ("error", "skipped"):
        if key in unit:
            return f"{key}: {str(unit[key]).splitlines()[0][:120]}"
    return None


def print_summary(report: Dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"bench_cuda: {env.get('gpu') or env.get('device')}, torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, TF32 matmul {env.get('matmul_allow_tf32')}, "
        f"{report['elapsed_seconds']:.0f} s, {report['status']}"
    )
    print_iteration(report["iteration"])
    print_memory(report["memory"])
    print_protocol(report["protocol"])
    print_compile(report["compile"])


def rows(results: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any], str | None]]:
    """(label, unit, note) for each unit of a two-level result table (model, precision);
    ``note`` says why a unit, or a whole model, has no figures."""
    for outer, units in results.items():
        note = unit_note(units)
        if note:
            yield f"{outer:10s} {'':14s}", {}, note
            continue
        for inner, unit in units.items():
            yield f"{outer:10s} {inner:14s}", unit, unit_note(unit)


def print_iteration(section: Dict[str, Any]) -> None:
    if not section["results"]:
        return
    print(
        f"\nseconds per Auto-PGD iteration ({section['method']}); "
        f"ratios target <= {section['target_ratio']}"
    )
    print(
        f"{'model':10s} {'precision':14s} {'fwd+bwd':>8s} {'adaptive':>8s} {'geo-inv':>8s} "
        f"{'geo-mix':>8s}  {'inv/ada':>7s} {'mix/ada':>7s}  {'ada/fb':>6s} {'inv/fb':>6s} "
        f"{'mix/fb':>6s}"
    )
    for label, unit, note in rows(section["results"]):
        if note:
            print(f"{label} {note}")
            continue
        s, r, f = (
            unit["seconds_per_iteration"],
            unit["ratio_to_adaptive"],
            unit["ratio_to_forward_backward"],
        )
        print(
            f"{label} "
            + " ".join(fmt(s[m], "8.4f") for m in (PLAIN, *MEASURES))
            + "  "
            + " ".join(fmt(r[m], "7.3f") for m in MEASURES[1:])
            + "  "
            + " ".join(fmt(f[m], "6.3f") for m in MEASURES)
        )


def print_memory(section: Dict[str, Any]) -> None:
    if "skipped" in section:
        print(f"\nmemory: {section['skipped']}")
    if not section["results"]:
        return
    print(f"\npeak CUDA memory, GiB (ratio to the training step; target <= {MEMORY_TARGET})")
    for label, unit, note in rows(section["results"]):
        cells = [note] if note else []
        for m, r in unit.get("runs", {}).items():
            ratio_ = fmt(unit["peak_ratio_to_training_step"][m], ".2f")
            cells.append(f"{m} {r['peak_bytes'] / 2**30:6.2f} ({ratio_})")
        print(f"{label} " + "  ".join(cells))


def print_protocol(section: Dict[str, Any]) -> None:
    if not section["results"]:
        return
    print(f"\nprotocol: seconds for {section['batches']} batches x {section['iters']} iterations")
    for label, unit, note in rows(section["results"]):
        cells = [note] if note else []
        for m, r in unit.get("measures", {}).items():
            cells.append(f"{m} {unit_note(r) or format(r['seconds'], '.2f') + ' s'}")
        if not note:
            cells.append(f"mix/ada {fmt(unit['ratio_geodesic_mix_to_adaptive'], '.3f')}")
        print(f"{label} " + "  ".join(cells))


def print_compile(section: Dict[str, Any]) -> None:
    note = unit_note(section)
    if note:
        print(f"\ncompile: {note}")
    if not section["results"]:
        return
    print(f"\ngeometry step on BERT-base, eager vs torch.compile (mode {section['mode']})")
    for label, unit, note in rows(section["results"]):
        if note:
            print(f"{label} {note}")
            continue
        print(
            f"{label} eager {unit['eager_ms']:8.2f} ms  compiled {unit['compiled_ms']:8.2f} ms  "
            f"speed-up {fmt(unit['speedup'], '.2f')}  compile {unit['compile_seconds']:.1f} s "
            f"({fmt(unit['graphs'], 'd')} graphs, {unit['graph_breaks']} breaks)  share of "
            f"fwd+bwd {fmt(unit['eager_share_of_forward_backward'], '.3f')}"
        )


if __name__ == "__main__":
    main()
