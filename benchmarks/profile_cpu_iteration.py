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
  compare phase by phase;
- with ``--marginal``, the same usage for one more iteration: a run of ``--iters / 2``
  iterations too, and the difference per iteration, so that a run's fixed work (the
  ball's vectors, the layout, the clean loss, the path gap: each faulted in once per
  run) is told apart from what every iteration costs;
- with ``--by-operator N``, the ``N`` operator call sites with the most minor page
  faults per iteration (per iteration more with ``--marginal``), in a further pair of
  runs under a ``TorchDispatchMode`` that reads ``getrusage`` around each operator: a
  fresh allocation is faulted in by the operator that first writes it;
- with ``--bytes N``, the ``N`` operator call sites that move the most bytes per
  iteration (per iteration more with ``--marginal``), in passes over the model's
  parameters, under a ``TorchDispatchMode`` (:class:`BytesBySite`) that counts what each
  operator reads and writes of the tensors in storages of at least 4 MiB (the ball's
  vectors, the flat buffers, the model's large weights and gradients), through a model
  of a least-recently-used cache of ``--cache-mib`` MiB (default 8): a block that a
  sweep reads again while in cache moves nothing, a written block is counted once until
  it leaves the cache. Deterministic, whatever the machine's load; the totals split the
  passes into the model's (its forward and backward pass) and the ball's (the rest);
- ``--malloc retain`` sets glibc's malloc to keep freed memory (``_malloc.py``) before
  the model is built, for the plain passes and the runs alike; the result JSON records it.

    python benchmarks/profile_cpu_iteration.py --models bert-base --measures adaptive,inv
    python benchmarks/profile_cpu_iteration.py --models bert-base --measures inv,mix \\
        --batch-size 4 --iters 8 --operators 0 --phases
    python benchmarks/profile_cpu_iteration.py --models bert-base --measures adaptive,inv \\
        --batch-size 2 --iters 8 --operators 0 --marginal --by-operator 12 --malloc retain
    python benchmarks/profile_cpu_iteration.py --models bert-11m --measures adaptive \
        --batch-size 8 --operators 0 --marginal --bytes 12 \
        --json benchmarks/results/cpu/iteration_bytes.json
    python benchmarks/profile_cpu_iteration.py --quick            # seconds, for CI

Linux and macOS only (``resource``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import resource
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Tuple

import torch
from _malloc import add_malloc_option, configure_malloc
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
from torch.utils._python_dispatch import TorchDispatchMode

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


def marginal_usage(
    run: Callable[[int], Any], iters: int, half: int, batches: int
) -> Dict[str, float]:
    """Per iteration, what one more iteration of ``run(iters)`` costs: the
    :func:`usage` of a run of ``iters`` iterations minus that of a run of ``half``, over
    ``(iters - half) x batches``; the work of a run that does not grow with its
    iterations (set-up, the clean loss, the ball's first vectors) cancels."""
    whole, part = usage(lambda: run(iters), 1), usage(lambda: run(half), 1)
    return {k: (whole[k] - part[k]) / ((iters - half) * batches) for k in whole}


class FaultsByOperator(TorchDispatchMode):
    """Counts the minor page faults of each operator call (``getrusage`` before and
    after), by ``(pass, operator, call site)``: the pass is ``backward`` inside autograd's
    backward, else ``forward``; the call site is the innermost frame of this package
    (``module:function``), else the innermost frame outside torch (the model's code).

    A fresh allocation is faulted in where it is first written, so the faults of an
    allocated buffer land on the operator that fills it, not on ``empty``."""

    def __init__(self):
        super().__init__()
        self.faults: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = func(*args, **(kwargs or {}))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        if faults:
            backward = torch._C._current_graph_task_id() != -1
            key = ("backward" if backward else "forward", str(func.overloadpacket), _site())
            self.faults[key] += faults
            self.calls[key] += 1
        return out


def _site() -> str:
    """The call site of :class:`FaultsByOperator`: ``module:function``."""
    frame, outside_torch = sys._getframe(2), None
    while frame is not None:
        path = frame.f_code.co_filename
        if f"geoopt_quotient{os.sep}" in path:
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        if outside_torch is None and f"{os.sep}torch{os.sep}" not in path:
            outside_torch = f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return outside_torch or "?"


def faults_by_operator(
    run: Callable[[int], Any], iters: int, half: int | None, batches: int, rows: int
) -> List[Dict[str, Any]]:
    """The ``rows`` call sites (:class:`FaultsByOperator`) with the most minor page faults
    per iteration of ``run(iters)``; with ``half``, per iteration more (the faults of
    ``run(iters)`` minus those of ``run(half)``, as :func:`marginal_usage`), so that
    the run's fixed work cancels. ``outside operators``: the rest of the run's faults
    (the interpreter, autograd's bookkeeping)."""

    def counted(n: int) -> collections.Counter:
        mode = FaultsByOperator()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with mode:
            run(n)
        total = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        mode.faults[("-", "outside operators", "-")] = total - sum(mode.faults.values())
        return mode.faults

    faults = counted(iters)
    count = iters * batches
    if half is not None:
        faults.subtract(counted(half))
        count = (iters - half) * batches
    top = sorted(faults.items(), key=lambda item: -abs(item[1]))[:rows]
    return [
        {"pass": p, "operator": op, "site": site, "minor_page_faults": n / count}
        for (p, op, site), n in top
    ]


#: Tensors in storages of at least this many bytes are counted by :class:`BytesBySite`.
LARGE_STORAGE = 4 << 20


class _LruCache:
    """Byte ranges of storages, least recently used first, at most ``capacity`` bytes:
    :meth:`access` says what a read or a write of a range moves from or to memory."""

    def __init__(self, capacity: int):
        self.capacity, self.size = capacity, 0
        self.ranges: collections.OrderedDict = collections.OrderedDict()  # -> dirty

    def access(self, storage: int, start: int, end: int, write: bool) -> Tuple[int, int]:
        """``(bytes read from memory, bytes newly dirtied)`` by an access to ``[start,
        end)`` of ``storage``: a read of what is not cached; a write of what is not
        cached dirty (each written byte reaches memory once, when it leaves the cache)."""
        cached = dirty = 0
        for key in [k for k in self.ranges if k[0] == storage and k[1] < end and start < k[2]]:
            was_dirty = self.ranges.pop(key)
            _, lo, hi = key
            overlap = min(hi, end) - max(lo, start)
            cached, dirty = cached + overlap, dirty + overlap * was_dirty
            self.size -= hi - lo
            for a, b in ((lo, start), (end, hi)):  # the parts outside stay, as old
                if b > a:
                    self.ranges[(storage, a, b)] = was_dirty
                    self.ranges.move_to_end((storage, a, b), last=False)
                    self.size += b - a
        self.ranges[(storage, start, end)] = write or dirty > 0
        self.size += end - start
        while self.size > self.capacity:
            (_, lo, hi), _ = self.ranges.popitem(last=False)
            self.size -= hi - lo
        return (0 if write else end - start - cached), (end - start - dirty if write else 0)


class BytesBySite(TorchDispatchMode):
    """Bytes that each operator call reads and writes of tensors in storages of at least
    :data:`LARGE_STORAGE` bytes, by ``(pass, operator, call site)``, through an
    :class:`_LruCache` of ``cache_bytes``: ``read`` and ``written`` (what the operators
    touch) and ``memory_read`` and ``memory_written`` (what reaches memory).

    An operator reads its tensor arguments and writes its outputs; an in-place or ``out=``
    argument is written, and read too unless the operator only writes it (``copy_``,
    ``fill_``, ``zero_``, ``out=``). The call site is ``"model"`` for the model's own
    operators (the innermost frame outside torch is not this package's, or, in the
    backward pass, is the one that called autograd), else the innermost two frames of
    this package (``module:function < module:function``)."""

    def __init__(self, cache_bytes: int):
        super().__init__()
        self.cache = _LruCache(cache_bytes)
        self.counts: Dict[Tuple[str, str, str], collections.Counter] = collections.defaultdict(
            collections.Counter
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "alias", "lift_fresh", "empty", "empty_strided"):
            return out
        backward = torch._C._current_graph_task_id() != -1
        counts = self.counts[("backward" if backward else "forward", name, _bytes_site())]
        counts["calls"] += 1
        writes_only = name.rstrip("_") in ("copy", "fill", "zero", "_foreach_copy", "_foreach_zero")
        written = []
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            mutated = argument.alias_info is not None and argument.alias_info.is_write
            for tensor in _tensors(value):
                if not mutated or not (argument.kwarg_only or writes_only):
                    self._touch(tensor, False, counts)
                if mutated:
                    written.append(tensor)
        if not written:
            written = list(_tensors(out))
        for tensor in written:
            self._touch(tensor, True, counts)
        return out

    def _touch(self, tensor: torch.Tensor, write: bool, counts: collections.Counter) -> None:
        storage = tensor.untyped_storage()
        size = tensor.numel() * tensor.element_size()
        if size == 0 or storage.nbytes() < LARGE_STORAGE:
            return
        start = tensor.storage_offset() * tensor.element_size()
        span = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride())) + 1
        end = start + span * tensor.element_size()
        read, dirtied = self.cache.access(storage.data_ptr(), start, end, write)
        counts["written" if write else "read"] += size
        counts["memory_read"] += read
        counts["memory_written"] += dirtied


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


#: Functions of this package that call autograd: the backward pass's operators below
#: them are the model's.
AUTOGRAD_CALLERS = ("evaluate_ball", "evaluate_in_ball")


def _bytes_site() -> str:
    """The call site of :class:`BytesBySite` (see there)."""
    frame, sites = sys._getframe(2), []
    backward = torch._C._current_graph_task_id() != -1
    while frame is not None and len(sites) < 2:
        path = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path:
            ours = f"geoopt_quotient{os.sep}" in path
            if not sites and (not ours or (backward and frame.f_code.co_name in AUTOGRAD_CALLERS)):
                return "model"
            if ours:
                sites.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(sites)


def bytes_by_site(
    run: Callable[[int], Any],
    iters: int,
    half: int | None,
    batches: int,
    rows: int,
    vector_bytes: int,
    cache_bytes: int,
) -> Dict[str, Any]:
    """Per iteration of ``run(iters)`` (per iteration more with ``half``, as
    :func:`faults_by_operator`), in passes over ``vector_bytes``: the totals of the
    model's operators and of the rest (``ball``), and the ``rows`` call sites
    (:class:`BytesBySite`) that move the most bytes to and from memory."""

    def counted(n: int) -> Dict[Tuple[str, str, str], collections.Counter]:
        mode = BytesBySite(cache_bytes)
        with mode:
            run(n)
        return mode.counts

    counts = counted(iters)
    count = iters * batches
    if half is not None:
        for key, value in counted(half).items():
            counts[key].subtract(value)
        count = (iters - half) * batches
    fields = ("read", "written", "memory_read", "memory_written")
    totals = {part: dict.fromkeys(fields, 0.0) for part in ("model", "ball")}
    sites = []
    for (pass_, operator, site), value in counts.items():
        cell = {f: value[f] / vector_bytes / count for f in fields}
        part = totals["model" if site == "model" else "ball"]
        for f in fields:
            part[f] += cell[f]
        cell.update(pass_=pass_, operator=operator, site=site, calls=value["calls"] / count)
        sites.append(cell)
    for part in totals.values():
        part["memory"] = part["memory_read"] + part["memory_written"]
    sites.sort(key=lambda c: -(c["memory_read"] + c["memory_written"]))
    top = [{("pass" if k == "pass_" else k): v for k, v in c.items()} for c in sites[:rows]]
    return {"passes": totals, "sites": top}


#: The phases of :func:`phase_times`: (label, module, attribute) of what each times.
PHASES = (
    ("update", apgd, "apgd_update"),
    ("riemannian gradient", apgd.TangentBall, "riemannian_gradient_gram_"),
    ("evaluation", layout.LayoutObjective, "evaluate_ball"),
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
    # each run as a function of its iterations (plain: as many passes)
    runs: Dict[str, Callable[[int], Any]] = {
        "plain": lambda n: plain_pass(model, batches, loss_fn, n)
    }
    for measure in measures:
        runs[measure] = lambda n, m=measure: sharpness_run(
            model, batches, loss_fn, m, plans, options, iters=n
        )
    plain_pass(model, batches, loss_fn)  # warm-up
    for measure in measures:
        sharpness_run(model, batches, loss_fn, measure, plans, options, iters=2)
    count = args.iters * len(batches)
    half = max(args.iters // 2, 1) if args.marginal else None
    row: Dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    vector = sum(p.numel() * p.element_size() for p in model.parameters())
    for key, run in runs.items():
        row[key] = usage(functools.partial(run, args.iters), count)
        if half is not None and half < args.iters:
            row[key]["marginal"] = marginal_usage(run, args.iters, half, len(batches))
        if args.by_operator:
            row[key]["faults_by_operator"] = faults_by_operator(
                run, args.iters, half, len(batches), args.by_operator
            )
        if args.bytes:
            row[key]["bytes_by_site"] = bytes_by_site(
                run, args.iters, half, len(batches), args.bytes, vector, args.cache_mib << 20
            )
        if args.operators:
            calls, operators = top_operators(
                functools.partial(run, args.iters), count, args.operators
            )
            row[key]["operator_calls"], row[key]["operators"] = calls, operators
    if args.phases:
        loss_seconds: Dict[str, float] = {}
        active: List[str] = []
        loss = timed_loss(loss_fn, loss_seconds, active)
        for measure in measures:
            run = functools.partial(sharpness_run, model, batches, loss, measure, plans, options)
            row[measure]["phases_s"] = phase_times(run, loss_seconds, active, count)
    # the process's peak resident memory so far (KiB on Linux): what --malloc retain holds
    row["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def _usage_line(cell: Dict[str, float]) -> str:
    return (
        f"wall {1e3 * cell['wall_s']:8.1f} ms  user {1e3 * cell['user_s']:8.1f} ms  "
        f"system {1e3 * cell['system_s']:7.1f} ms  "
        f"minor page faults {cell['minor_page_faults']:9,.0f}"
    )


def _bytes_lines(report: Dict[str, Any]) -> List[str]:
    totals = ", ".join(
        f"{part} {cell['memory']:.2f} ({cell['memory_read']:.2f} read, "
        f"{cell['memory_written']:.2f} written; operators {cell['read'] + cell['written']:.2f})"
        for part, cell in report["passes"].items()
    )
    lines = [f"      passes over the parameters to and from memory: {totals}; by call site:"]
    for site in report["sites"]:
        lines.append(
            f"      {site['memory_read']:5.2f} read {site['memory_written']:5.2f} written "
            f"{site['calls']:7.1f} calls  {site['pass']:<8} {site['operator'][:24]:<24} "
            f"{site['site']}"
        )
    return lines


def format_rows(rows: Dict[str, Dict[str, Any]], threads: int, malloc: str) -> str:
    lines = [f"per iteration (plain: per pass), {threads} thread(s), malloc {malloc}"]
    for name, row in rows.items():
        lines.append(
            f"{name} ({row['parameters']:,} parameters; the process's peak resident memory "
            f"{row['max_rss_mib']:,.0f} MiB)"
        )
        for key, cell in row.items():
            if not isinstance(cell, dict):
                continue
            lines.append(f"  {key:<9} " + _usage_line(cell))
            if "marginal" in cell:
                lines.append(f"  {'  one more':<9} " + _usage_line(cell["marginal"]))
            if "faults_by_operator" in cell:
                lines.append("      minor page faults per iteration, by operator and call site:")
            for op in cell.get("faults_by_operator", []):
                lines.append(
                    f"      {op['minor_page_faults']:9,.0f}  {op['pass']:<8} "
                    f"{op['operator'][:32]:<32} {op['site']}"
                )
            if "bytes_by_site" in cell:
                lines += _bytes_lines(cell["bytes_by_site"])
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
    parser.add_argument(
        "--marginal",
        action="store_true",
        help="also run --iters / 2 iterations and report one more iteration's cost "
        "(the difference), without the run's fixed work",
    )
    parser.add_argument(
        "--by-operator",
        type=int,
        default=0,
        help="list this many operator call sites by minor page faults per iteration "
        "(per iteration more with --marginal; 0: none)",
    )
    parser.add_argument(
        "--bytes",
        type=int,
        default=0,
        help="list this many operator call sites by bytes moved per iteration, in passes "
        "over the parameters (per iteration more with --marginal; 0: none)",
    )
    parser.add_argument(
        "--cache-mib",
        type=int,
        default=8,
        help="the cache that --bytes models, in MiB (default 8)",
    )
    add_malloc_option(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    malloc = configure_malloc(args.malloc)  # before the models are built
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS)) + sorted(
        set(args.measures.split(",")) - set(MEASURES) - {""}
    )
    if unknown:
        parser.error(f"unknown models or measures {unknown}")
    if args.quick:
        args.iters, args.operators, args.phases = 2, 3, True
        args.marginal, args.by_operator, args.bytes = True, 3, 3
        names = ["tiny-vit"]
    torch.set_num_threads(args.threads)
    rows = {name: profile_model(name, args) for name in names}
    print(format_rows(rows, args.threads, args.malloc))
    return write_document("profile_cpu_iteration", args, rows, malloc)


if __name__ == "__main__":
    main()
