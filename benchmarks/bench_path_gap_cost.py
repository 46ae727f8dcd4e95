"""Cost of the second-order path's report (the path gap) in forward and backward passes.

A worst-case ``geodesic_sharpness`` call on ``path="second_order"`` with
``path_report=True`` ends each batch with
:func:`geoopt_quotient.sharpness.path_gap.path_gap`: the exact geodesic at the maximiser
and the loss there (every call ends with the estimate,
:func:`~geoopt_quotient.sharpness.path_gap.estimated_path_gap`). This times that call
alone (this process's CPU time, one thread by default), interleaved with a plain forward
and backward pass over the same batch, and reports per model and metric the medians over
``--repeats`` and their ratio
(``passes``), with the reported gap and exact loss of the last run.

    python benchmarks/bench_path_gap_cost.py --models bert-11m --repeats 3
    python benchmarks/bench_path_gap_cost.py --json benchmarks/results/cpu/path_gap_cost.json

Models: the tiny ViT, the 11M BERT (8 x 128 tokens) and BERT-base (4 x 128), those of
``bench_iteration_overhead.py``.
    python benchmarks/bench_path_gap_cost.py --quick      # seconds, for CI

``--operators`` counts instead of timing: the operators one call's path gap dispatches
(a ``TorchDispatchMode`` counter, on the CPU, blocks capped as on an accelerator, as
``tests/test_operator_count.py`` does), those that are not views, its host
synchronisations (``.item()`` and the like) and, per linear-algebra operator, the
matrices it factorises: on a GPU several of them loop over their batch, one cuSOLVER
call (a few kernels) per matrix. Counts do not depend on the machine's load. Models:
the 4-layer BERT of width 256 of the operator-count tests and a BERT-base-shaped one
(12 layers, width 768, 12 heads), random weights, a batch of 2 x 8 tokens, ``rho=0.01``.

    python benchmarks/bench_path_gap_cost.py --operators \\
        --json benchmarks/results/cpu/path_gap_operators.json

``--calls`` times whole calls instead (wall and process time, interleaved repeats after
one warm-up call of one iteration each, medians; 2 threads unless ``--threads`` says
otherwise): adaptive sharpness, geodesic sharpness (mix, the
default metric) by default (the estimate only) and with ``path_report=True``, and
reports the ratios of the whole calls, the report's share of a default call (the
difference of the medians, and the report's own time inside the calls) and the
estimate's. Models: a 4-layer BERT (width 256, 4 heads) at 8 x 64 tokens and 6
iterations (``ratio_model``), and for the default call of 20 iterations a tiny Llama
(2 layers of width 128, 8 x 64 tokens) and BERT-base (random weights, 4 x 128 tokens;
``--base-repeats`` rounds, fewer than the others: a call takes a minute or more on 2
threads).

    python benchmarks/bench_path_gap_cost.py --calls \\
        --json benchmarks/results/cpu/path_report_calls.json

``--calls --split`` times the default calls (adaptive and geodesic sharpness, the bound
plan passed in; on the model compared with adaptive sharpness) also at a third of the
iterations (2 of 6), interleaved, and splits each into its fixed work (the checks, the
layout, the factorisations at the base point, the final evaluation and the estimate:
what a short call, e.g. a training callback's, pays in full) and one iteration,
``(t(n) - t(n/3)) / (2n/3)``; ``fixed_over_adaptive`` and ``iteration_over_adaptive``
compare them.

With ``--split`` it also counts the matrix products of the same calls
(``arithmetic_floor``, after the timings): the ratios they give, of the whole calls, of
the fixed work and of one iteration, are what the timed ratios cannot go below
(element-wise work and factorisations come on top).

    python benchmarks/bench_path_gap_cost.py --calls --split --models bert-4x256 \\
        --repeats 7 --json benchmarks/results/cpu/geodesic_call_split.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List

import torch
from _flops import counter
from bench_iteration_overhead import bert_setup, plain_pass, vit_setup
from bench_sharpness_iteration import build_model
from torch.utils._python_dispatch import TorchDispatchMode

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _linalg
from geoopt_quotient.sharpness import engine

MODELS = ("tiny-vit", "bert-11m", "bert-base")
#: Sequences per batch (of 128 tokens), those of ``bench_iteration_overhead.py``'s rows.
BERT_BATCH_SIZES = {"bert-11m": 8, "bert-base": 4}
METRICS = ("inv", "mix")


class PathGapWrapper:
    """Wraps the engine's path gap while active, recording each call's result and the
    object that ``probe()`` (a context manager around the call) gives."""

    def __init__(self, probe: Callable[[], Any]):
        self.probe = probe
        self.records: List[Any] = []
        self.reports: List[Any] = []
        self.original = engine.path_gap

    def __call__(self, *args):
        with self.probe() as record:
            out = self.original(*args)
        self.records.append(record)
        self.reports.append(out)
        return out

    def __enter__(self):
        engine.path_gap = self
        return self

    def __exit__(self, *exc):
        engine.path_gap = self.original


class ProcessTime:
    """The process's CPU time of a ``with`` block (``seconds``)."""

    def __enter__(self):
        self.start = time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.process_time() - self.start


def bench_model(name: str, args) -> Dict[str, Any]:
    if name == "tiny-vit":
        model, batches, loss_fn = vit_setup(args.quick, 128, 128)
    else:
        model, batches, loss_fn = bert_setup(name, args.quick, BERT_BATCH_SIZES[name], 128, 1)
    batches = batches[:1]
    row: Dict[str, Any] = {}
    plain_pass(model, batches, loss_fn)  # warm-up
    for metric in METRICS:
        plan = gq.find_symmetries(model, metric=metric).bind(model)
        plain, gap = [], []
        with PathGapWrapper(ProcessTime) as timer:
            for _ in range(args.repeats):
                start = time.process_time()
                plain_pass(model, batches, loss_fn)
                plain.append(time.process_time() - start)
                timer.records.clear()
                gq.geodesic_sharpness(
                    model,
                    loss_fn,
                    batches,
                    metric=metric,
                    symmetries=plan,
                    rho=args.rho,
                    iters=args.iters,
                    progress=False,
                    path_report=True,
                )
                gap.extend(record.seconds for record in timer.records)
        path_gap, exact_loss = timer.reports[-1]
        row[metric] = {
            "plain_seconds": statistics.median(plain),
            "path_gap_seconds": statistics.median(gap),
            "passes": statistics.median(gap) / statistics.median(plain),
            "path_gap": path_gap,
            "exact_loss": exact_loss,
        }
    return row


#: Operators that only make views (no kernel on a GPU).
VIEWS = frozenset(
    "view _unsafe_view slice select transpose t expand split split_with_sizes unbind "
    "unsqueeze squeeze alias diagonal permute as_strided detach narrow unflatten".split()
)
#: Linear-algebra operators, counted by the matrices they factorise.
LINALG = frozenset(
    "linalg_qr linalg_eigh _linalg_eigh linalg_cholesky_ex cholesky_inverse cholesky_solve "
    "linalg_solve_triangular _linalg_solve_ex linalg_lu_factor_ex linalg_inv_ex geqrf "
    "linalg_householder_product _linalg_svd".split()
)
#: ``(layers, width, heads)`` of the counted models.
COUNTED = {"bert-4x256": (4, 256, 4), "bert-base-shaped": (12, 768, 12)}


class OperatorCount(TorchDispatchMode):
    """Counts the operators dispatched while active: all, those that are not views,
    host synchronisations, and the matrices of each linear-algebra operator."""

    def __init__(self):
        super().__init__()
        self.operators = self.kernels = self.host_syncs = 0
        self.matrices: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.operators += 1
        self.kernels += name not in VIEWS
        self.host_syncs += name == "_local_scalar_dense"
        if name in LINALG:
            shape = args[0].shape
            key = f"{name} {'x'.join(map(str, shape[-2:]))} {str(args[0].dtype)[6:]}"
            self.matrices[key] += math.prod(shape[:-2])
        return func(*args, **(kwargs or {}))

    def report(self) -> Dict[str, Any]:
        return {
            "operators": self.operators,
            "non_view_operators": self.kernels,
            "host_syncs": self.host_syncs,
            "linalg_matrices": dict(sorted(self.matrices.items())),
        }


def random_bert(layers: int, width: int, heads: int, *, vocab: int, positions: int):
    """A BERT classifier (3 labels) of random weights, seeded, and its config."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=positions,
        num_labels=3,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).eval(), config


def bert_loss(model, batch):
    """Cross-entropy of a BERT classifier on ``(input_ids, labels)``."""
    return torch.nn.functional.cross_entropy(model(input_ids=batch[0]).logits, batch[1])


def counted_bert(layers: int, width: int, heads: int):
    """A BERT classifier of random weights, a batch of 2 x 8 tokens and its loss."""
    model, _ = random_bert(layers, width, heads, vocab=100, positions=32)
    batch = (torch.randint(0, 100, (2, 8)), torch.randint(0, 3, (2,)))
    return model, batch, bert_loss


def path_gap_operators(model, batch, loss_fn, metric: str, rho: float) -> Dict[str, Any]:
    """The counts of one ``geodesic_sharpness`` call's path gap (3 iterations)."""
    with PathGapWrapper(OperatorCount) as counter:
        gq.geodesic_sharpness(
            model,
            loss_fn,
            [batch],
            metric=metric,
            rho=rho,
            iters=3,
            progress=False,
            path_report=True,
        )
    (count,), ((gap, exact_loss),) = counter.records, counter.reports
    return {**count.report(), "path_gap": gap, "exact_loss": exact_loss}


def count_operators(args) -> Dict[str, Any]:
    capped, _linalg.CAP_ON_CPU = _linalg.CAP_ON_CPU, True
    try:
        models = {}
        for name in args.models.split(","):
            model, batch, loss_fn = counted_bert(*COUNTED[name])
            models[name] = {
                m: path_gap_operators(model, batch, loss_fn, m, args.rho) for m in METRICS
            }
        return models
    finally:
        _linalg.CAP_ON_CPU = capped


class CallTimer:
    """Wraps the engine's function ``name`` while active, adding the seconds of its
    calls to ``seconds`` (wall time) and ``cpu`` (this process's CPU time)."""

    def __init__(self, name: str):
        self.name, self.seconds, self.cpu = name, 0.0, 0.0
        self.original = getattr(engine, name)

    def __call__(self, *args):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return self.original(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.cpu += time.process_time() - cpu

    def __enter__(self):
        setattr(engine, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(engine, self.name, self.original)


#: ``name -> (iters, measures)`` of ``--calls``: the ratio's model at 6 iterations with
#: adaptive sharpness, the default call's models at 20 without it.
CALL_MODELS = {
    "bert-4x256": (6, ("adaptive", "geodesic", "geodesic_report")),
    "tiny-llama": (20, ("geodesic", "geodesic_report")),
    "bert-base": (20, ("geodesic", "geodesic_report")),
}


def call_setup(name: str, quick: bool):
    """The model, its batches and loss of ``--calls`` (random weights, one batch)."""
    import transformers

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if name == "tiny-llama":
        config = transformers.LlamaConfig(
            vocab_size=1000,
            hidden_size=32 if quick else 128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64 if quick else 256,
            max_position_embeddings=128,
        )
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 1000, (2, 8) if quick else (8, 64), generator=generator)
        return model, [ids], lambda m, b: m(input_ids=b, labels=b).loss
    if name == "bert-4x256":
        size = (2, 32, 4) if quick else (4, 256, 4)
        model, config = random_bert(*size, vocab=1000, positions=128)
        shape = (2, 8) if quick else (8, 64)
    else:
        model, config = build_model(quick, "cpu", torch.float32)
        shape = (2, 8) if quick else (4, 128)
    ids = torch.randint(0, config.vocab_size, shape, generator=generator)
    labels = torch.randint(0, config.num_labels, shape[:1], generator=generator)
    return model, [(ids, labels)], bert_loss


def time_calls(name: str, args) -> Dict[str, Any]:
    """Whole calls of ``name``'s measures, interleaved, and the report's share."""
    model, batches, loss_fn = call_setup(name, args.quick)
    iters, measures = CALL_MODELS[name]
    iters = 2 if args.quick else iters
    split = args.split and "adaptive" in measures  # the models compared with adaptive
    if split:
        measures = (*measures, *SHORT)
    plan = gq.find_symmetries(model, metric="mix").bind(model)
    results: Dict[str, Any] = {}

    def call(measure: str, iterations: int) -> Dict[str, float]:
        """One call; its wall and process time and the report's and estimate's own."""
        kept = results  # the results of the full calls are the ones reported
        if measure in SHORT:
            kept, measure, iterations = {}, SHORT[measure], max(1, iterations // 3)
        common = dict(iters=iterations, progress=False)
        wall, cpu = time.perf_counter(), time.process_time()
        with CallTimer("path_gap") as exact, CallTimer("estimated_path_gap") as estimate:
            if measure == "adaptive":
                gq.adaptive_sharpness(model, loss_fn, batches, **common)
            else:
                kept[measure] = gq.geodesic_sharpness(
                    model,
                    loss_fn,
                    batches,
                    symmetries=plan,
                    path_report=measure == "geodesic_report",
                    **common,
                )
        return {
            "wall": time.perf_counter() - wall,
            "cpu": time.process_time() - cpu,
            "path_gap": exact.seconds,
            "estimated_path_gap": estimate.seconds,
            "path_gap_cpu": exact.cpu,
            "estimated_path_gap_cpu": estimate.cpu,
        }

    repeats = 1 if args.quick else args.base_repeats if name == "bert-base" else args.repeats
    samples: Dict[str, List[Dict[str, float]]] = {m: [] for m in measures}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gq.PathGapWarning)
        for measure in measures:  # warm-up: one short call each
            call(measure, 1)
        for _ in range(repeats):
            for measure in measures:
                samples[measure].append(call(measure, iters))
    median = {
        m: {k: statistics.median(s[k] for s in rows) for k in rows[0]}
        for m, rows in samples.items()
    }
    default, reported = median["geodesic"], median["geodesic_report"]
    row: Dict[str, Any] = {
        "iters": iters,
        "repeats": repeats,
        "batch": list(_batch_shape(batches[0])),
        "samples": samples,
        "medians": median,
        "report_share_of_default_call": {
            clock: (reported[clock] - default[clock]) / default[clock] for clock in CLOCKS
        },
        "report_own_share_of_default_call": {
            "wall": reported["path_gap"] / default["wall"],
            "cpu": reported["path_gap_cpu"] / default["cpu"],
        },
        "estimate_share_of_default_call": {
            "wall": default["estimated_path_gap"] / default["wall"],
            "cpu": default["estimated_path_gap_cpu"] / default["cpu"],
        },
        "path_gaps": results["geodesic_report"].path_gaps,
        "estimated_path_gaps": results["geodesic"].estimated_path_gaps,
        "rho": results["geodesic"].settings["rho"],
    }
    if split:
        row["arithmetic_floor"] = _arithmetic_floor(call, iters)
    return {**row, **_comparisons(median, iters, split)}


def _arithmetic_floor(call: Callable[[str, int], Any], iters: int) -> Dict[str, Any]:
    """The matrix products of ``--split``'s calls, in GFLOP (``FlopCounterMode``, as
    ``_flops.counter`` counts them: element-wise work and factorisations are
    not counted), and the ratios they floor: the geodesic call over the adaptive call,
    its fixed work and one iteration over theirs (:func:`_split`'s arithmetic)."""
    short = max(1, iters // 3)
    gflop: Dict[str, Dict[int, float]] = {}
    for measure in ("adaptive", "geodesic"):
        gflop[measure] = {}
        for count in (iters, short):
            with counter() as products:
                call(measure, count)
            gflop[measure][count] = products.get_total_flops() / 1e9
    parts = {}
    for measure, by_count in gflop.items():
        per = (by_count[iters] - by_count[short]) / (iters - short)
        parts[measure] = {"fixed": by_count[short] - short * per, "iteration": per}
    return {
        "gflop": {m: {str(n): f for n, f in by_count.items()} for m, by_count in gflop.items()},
        "geodesic_over_adaptive": gflop["geodesic"][iters] / gflop["adaptive"][iters],
        **{
            f"{key}_over_adaptive": parts["geodesic"][key] / parts["adaptive"][key]
            for key in ("fixed", "iteration")
        },
    }


def _comparisons(median: Dict[str, Dict[str, float]], iters: int, split: bool) -> Dict[str, Any]:
    """The geodesic calls' times over the adaptive call's, and with ``split`` the
    fixed work and one iteration of each (:func:`_split`)."""
    out: Dict[str, Any] = {"split": _split(median, iters)} if split else {}
    if "adaptive" in median:
        for key, measure in (("geodesic", "geodesic"), ("geodesic_with_report", "geodesic_report")):
            out[f"{key}_over_adaptive"] = {
                clock: median[measure][clock] / median["adaptive"][clock] for clock in CLOCKS
            }
    return out


#: The clocks of ``--calls``: wall time and this process's CPU time.
CLOCKS = ("wall", "cpu")
#: ``--split``'s short calls (a third of the iterations) and the measure each times.
SHORT = {"adaptive_short": "adaptive", "geodesic_short": "geodesic"}


def _split(median: Dict[str, Dict[str, float]], iters: int) -> Dict[str, Any]:
    """Per measure of :data:`SHORT` and clock, the seconds of the fixed work and of one
    iteration, from the medians of calls of ``iters`` and ``iters // 3`` iterations, and
    the geodesic's over the adaptive's."""
    short = max(1, iters // 3)
    out: Dict[str, Any] = {"short_iters": short}
    for name, measure in SHORT.items():
        out[measure] = {}
        for clock in CLOCKS:
            full, part = median[measure][clock], median[name][clock]
            per = (full - part) / (iters - short)
            out[measure][clock] = {"fixed": part - short * per, "iteration": per}
    for key in ("fixed", "iteration"):
        out[f"{key}_over_adaptive"] = {
            clock: out["geodesic"][clock][key] / out["adaptive"][clock][key] for clock in CLOCKS
        }
    return out


def _batch_shape(batch) -> tuple:
    ids = batch[0] if isinstance(batch, tuple) else batch
    return tuple(ids.shape)


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=10, help="Auto-PGD iterations (default 10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (CI)")
    parser.add_argument(
        "--operators", action="store_true", help="count operators instead (module docstring)"
    )
    parser.add_argument(
        "--calls", action="store_true", help="time whole calls instead (module docstring)"
    )
    parser.add_argument(
        "--base-repeats", type=int, default=2, help="--calls: rounds of BERT-base (2)"
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="--calls: also a third of the iterations, and the fixed work apart",
    )
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    if args.calls:
        _calls_defaults(args, parser)
    elif args.operators:
        if args.models == parser.get_default("models"):
            args.models = ",".join(COUNTED)
        if args.rho == parser.get_default("rho"):
            args.rho = 0.01
    if args.quick and not args.calls:
        args.models, args.repeats, args.iters = "tiny-vit", 1, 2
        if args.operators:
            args.models = "bert-4x256"
    torch.set_num_threads(args.threads)
    kind = "path_report_calls" if args.calls else "path_gap_operators" if args.operators else ""
    report = {
        "benchmark": kind or "path_gap_cost",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if args.calls:
        report["models"] = {name: time_calls(name, args) for name in args.models.split(",")}
    elif args.operators:
        report["models"] = count_operators(args)
    else:
        report["models"] = {name: bench_model(name, args) for name in args.models.split(",")}
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


def _calls_defaults(args, parser) -> None:
    """``--calls``' own defaults: 2 threads, its models, 5 repeats (1 with ``--quick``)."""
    if args.threads == parser.get_default("threads"):
        args.threads = 2
    if args.models == parser.get_default("models"):
        args.models = ",".join(CALL_MODELS)
    if args.repeats == parser.get_default("repeats"):
        args.repeats = 5
    if args.quick:
        args.models, args.repeats, args.base_repeats = "bert-4x256,tiny-llama", 1, 1


if __name__ == "__main__":
    main()
