"""Where an Auto-PGD iteration's time goes on the CPU: operators, system time, page faults.

For one model of ``bench_iteration_overhead`` and each measure asked for, after a
warm-up, this runs a sharpness run of ``--iters`` iterations and as many plain forward
and backward passes of the same loss, and reports per iteration (per pass for the plain
one):

- wall, user and system time and minor page faults (``resource.getrusage``): memory
  that a pass writes into fresh allocations is faulted in from the kernel page by page,
  which shows as system time;
- with ``--operators N``, the number of operator calls (views included; on small
  models each costs about a microsecond of dispatch whatever its size) and the ``N``
  operators with the most self CPU time in ``torch.profiler`` (in a second, profiled
  run), so that an operator slower in the sharpness run than in the plain pass stands
  out;
- with ``--phases``, the process CPU time of each phase of the Auto-PGD loop per
  iteration, in a third run (the loop's phases summed over the run, over its
  iterations): the loss's forward pass, the rest of the evaluation (backward pass and the
  layout's copies), the quotients' retraction and its pullback, the Riemannian gradient
  with its Gram entries, the update. Their sum is the loop's cost without the run's fixed
  work, measured directly instead of by a difference of two runs, so that two measures
  compare phase by phase.

    python benchmarks/profile_cpu_iteration.py --models bert-base --measures adaptive,inv
    python benchmarks/profile_cpu_iteration.py --models bert-base --measures inv,mix \\
        --batch-size 4 --iters 8 --operators 0 --phases
    python benchmarks/profile_cpu_iteration.py --quick            # seconds, for CI

Linux and macOS only (``resource``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import resource
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

import torch
from bench_iteration_overhead import (
    KEEP,
    MEASURES,
    bert_setup,
    plain_pass,
    sharpness_run,
    vit_setup,
    write_document,
)
from torch.profiler import ProfilerActivity, profile

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent
from geoopt_quotient.sharpness import apgd, layout

MODELS = ("tiny-vit", "bert-11m", "bert-base")


def usage(fn: Callable[[], Any], count: int) -> Dict[str, float]:
    """Per-call wall, user and system seconds and minor page faults of ``fn``."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": wall / count,
        "user_s": (after.ru_utime - before.ru_utime) / count,
        "system_s": (after.ru_stime - before.ru_stime) / count,
        "minor_page_faults": (after.ru_minflt - before.ru_minflt) / count,
    }


def top_operators(
    fn: Callable[[], Any], count: int, rows: int
) -> Tuple[float, List[Dict[str, Any]]]:
    """The number of operator calls (every operator the profiler records, views
    included) and the ``rows`` operators with the most self CPU time, per ``count``-th
    of a call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    calls = sum(e.count for e in events) / count
    return calls, [
        {
            "name": e.key,
            "self_ms": e.self_cpu_time_total / 1e3 / count,
            "calls": e.count / count,
        }
        for e in events[:rows]
    ]


#: The phases of :func:`phase_times`: (label, module, attribute) of what each times.
PHASES = (
    ("update", apgd, "_apgd_update"),
    ("riemannian gradient", apgd._Ball, "riemannian_gradient_gram_"),
    ("evaluation", layout._LayoutObjective, "evaluate_ball"),
    ("retraction", _gl_tangent.GLTangentSpace, "retr_vjp"),
)


@contextlib.contextmanager
def phase_clock(seconds: Dict[str, float], active: List[str]):
    """Adds the process time of each of :data:`PHASES` (and of the pullbacks that the
    retractions return) to ``seconds`` while active, the phases running kept in
    ``active``; restores the originals after."""

    def timed(label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.process_time()
            active.append(label)
            try:
                out = fn(*args, **kwargs)
            finally:
                active.pop()
                seconds[label] = seconds.get(label, 0.0) + time.process_time() - start
            if label == "retraction" and out is not None:
                return out[0], timed("pullback", out[1])
            return out

        return wrapper

    originals = [(owner, attr, getattr(owner, attr)) for _, owner, attr in PHASES]
    for (label, owner, attr), (_, _, fn) in zip(PHASES, originals):
        setattr(owner, attr, timed(label, fn))
    try:
        yield
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def phase_times(
    run: Callable[[], Any], loss_seconds: Dict[str, float], active: List[str], iters: int
):
    """Per iteration, the process seconds of each phase of ``run``'s Auto-PGD loop
    (:func:`phase_clock`; ``loss_seconds["forward"]``: the loss's within the evaluations,
    :func:`timed_loss`), the evaluation without its forward pass, retraction and
    pullback, and their sum."""
    seconds: Dict[str, float] = {}
    loss_seconds.clear()
    with phase_clock(seconds, active):
        run()
    seconds["forward"] = loss_seconds.get("forward", 0.0)
    nested = sum(seconds.get(k, 0.0) for k in ("forward", "retraction", "pullback"))
    seconds["evaluation"] = seconds.get("evaluation", 0.0) - nested
    order = ("forward", "evaluation", "retraction", "pullback", "riemannian gradient", "update")
    phases = {k: seconds.get(k, 0.0) / iters for k in order}
    return {**phases, "loop": sum(phases.values())}


def timed_loss(loss_fn: Callable, seconds: Dict[str, float], active: List[str]) -> Callable:
    """``loss_fn``, its process time added to ``seconds["forward"]`` where it runs in an
    evaluation of the loop (``active``, :func:`phase_clock`), not in the run's fixed work
    (the clean loss, the path gap's)."""

    def loss(model, batch):
        if "evaluation" not in active:
            return loss_fn(model, batch)
        start = time.process_time()
        try:
            return loss_fn(model, batch)
        finally:
            seconds["forward"] = seconds.get("forward", 0.0) + time.process_time() - start

    return loss


def profile_model(name: str, args) -> Dict[str, Any]:
    if name == "tiny-vit":
        model, batches, loss_fn = vit_setup(args.quick, 128, 512)
    else:
        model, batches, loss_fn = bert_setup(name, args.quick, args.batch_size, 128, 1)
    measures = [m for m in args.measures.split(",") if m]
    plans = {m: gq.find_symmetries(model, metric=m).bind(model) for m in ("inv", "mix")}
    options = SimpleNamespace(
        rho=args.rho, iters=args.iters, keep_best_gradient=args.keep_best_gradient
    )
    runs: Dict[str, Callable[[], Any]] = {
        "plain": lambda: [plain_pass(model, batches, loss_fn) for _ in range(args.iters)]
    }
    for measure in measures:
        runs[measure] = lambda m=measure: sharpness_run(model, batches, loss_fn, m, plans, options)
    plain_pass(model, batches, loss_fn)  # warm-up
    for measure in measures:
        sharpness_run(model, batches, loss_fn, measure, plans, options, iters=2)
    count = args.iters * len(batches)
    row: Dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    for key, run in runs.items():
        row[key] = usage(run, count)
        if args.operators:
            calls, operators = top_operators(run, count, args.operators)
            row[key]["operator_calls"], row[key]["operators"] = calls, operators
    if args.phases:
        loss_seconds: Dict[str, float] = {}
        active: List[str] = []
        loss = timed_loss(loss_fn, loss_seconds, active)
        for measure in measures:
            run = functools.partial(sharpness_run, model, batches, loss, measure, plans, options)
            row[measure]["phases_s"] = phase_times(run, loss_seconds, active, count)
    return row


def format_rows(rows: Dict[str, Dict[str, Any]], threads: int) -> str:
    lines = [f"per iteration (plain: per pass), {threads} thread(s)"]
    for name, row in rows.items():
        lines.append(f"{name} ({row['parameters']:,} parameters)")
        for key, cell in row.items():
            if not isinstance(cell, dict):
                continue
            lines.append(
                f"  {key:<9} wall {1e3 * cell['wall_s']:8.1f} ms  user "
                f"{1e3 * cell['user_s']:8.1f} ms  system {1e3 * cell['system_s']:7.1f} ms  "
                f"minor page faults {cell['minor_page_faults']:9,.0f}"
            )
            if "operator_calls" in cell:
                lines.append(
                    f"      {cell['operator_calls']:,.0f} operator calls, the most costly:"
                )
            if "phases_s" in cell:
                lines.append(
                    "      loop phases per iteration: "
                    + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in cell["phases_s"].items())
                )
            for op in cell.get("operators", []):
                lines.append(
                    f"      {op['name'][:48]:<48} {op['self_ms']:9.2f} ms {op['calls']:8.1f} calls"
                )
    return "\n".join(lines)


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="bert-base", help="comma-separated, of " + ", ".join(MODELS)
    )
    parser.add_argument(
        "--measures", default=",".join(MEASURES), help="comma-separated, of " + ", ".join(MEASURES)
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=20,
        help="Auto-PGD iterations (default 20; the run's setup is spread over them)",
    )
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (default 0.1)")
    parser.add_argument("--batch-size", type=int, default=8, help="BERT batch size (default 8)")
    parser.add_argument(
        "--keep-best-gradient", choices=tuple(KEEP), default="yes", help="default yes"
    )
    parser.add_argument(
        "--operators", type=int, default=12, help="operators listed per run (0: no profiler)"
    )
    parser.add_argument(
        "--phases", action="store_true", help="also time the loop's phases (process time)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS)) + sorted(
        set(args.measures.split(",")) - set(MEASURES) - {""}
    )
    if unknown:
        parser.error(f"unknown models or measures {unknown}")
    if args.quick:
        args.iters, args.operators, args.phases = 2, 3, True
        names = ["tiny-vit"]
    torch.set_num_threads(args.threads)
    rows = {name: profile_model(name, args) for name in names}
    print(format_rows(rows, args.threads))
    return write_document("profile_cpu_iteration", args, rows)


if __name__ == "__main__":
    main()
