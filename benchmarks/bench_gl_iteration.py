"""The GL(h) quotient's geometry per Auto-PGD iteration on a stack of BERT-base's size.

BERT-base's query-key and value-output groups, stacked over its 12 layers and 12 heads
by the sharpness ball's layout, are one batch of 288 points of two ``769 x 64`` factors
(about 28M entries, 113 MB per vector in float32). On such a synthetic stack this times
what the batched tangent space (``geoopt_quotient.manifolds._gl_tangent``) does in one
Auto-PGD iteration: the second-order retraction, its pullback, the Riemannian gradient
with the Gram entries (the whole matrix every other iteration, the gradient's column
otherwise) and the update's combination (``apgd.combine_``, with the products with the
point derived). Per iteration and metric it reports the process time, the minor page
faults (``resource.getrusage``) and the slices of the vectors' size that operators
allocate (results with blocks of the factors' rows, a ``TorchDispatchMode``), both as
on the CPU (slices of ``CHUNK_BYTES``) and with the slices capped (the whole batch at
once, as on an accelerator).

``--baseline DIR`` loads ``geoopt_quotient/manifolds/_gl_tangent.py`` of another
checkout beside this one's and runs both on the same point and vectors, interleaved,
after checking that they give the same perturbed point and gradient (bit for bit where
the two compute alike). With the CPU's slices, it also times the path gap's retraction
of one vector (``retraction``), the tangent space's against the reference formulas.

``--slices KIB,...`` times this checkout's tangent space instead with the CPU's slices
of each size (``_gl_tangent.CHUNK_BYTES``, in KiB), interleaved, after checking that
every size gives the same perturbed point and gradient (the slices only group the
batch's independent products); caches differ between CPUs, so that the size can be
checked on each.

    python benchmarks/bench_gl_iteration.py --baseline ../main --repeats 8 \\
        --json benchmarks/results/cpu/gl_iteration.json
    python benchmarks/bench_gl_iteration.py --slices 512,1024,2048,4096,8192 --repeats 12 \\
        --metrics inv --json benchmarks/results/cpu/gl_slices.json
    python benchmarks/bench_gl_iteration.py --quick            # seconds, for CI

Linux and macOS only (``resource``).
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from bench_iteration_overhead import write_document
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import geoopt_quotient as gq
from geoopt_quotient.manifolds import _gl_tangent, _linalg
from geoopt_quotient.manifolds.gl_quotient import PointState
from geoopt_quotient.manifolds.tangent import CachedTangentSpace
from geoopt_quotient.sharpness import apgd

#: BERT-base's stacked groups: points, rows per factor, rank.
BERT_BASE = (288, 769, 64)
QUICK = (6, 40, 8)


class Allocations(TorchDispatchMode):
    """The results with blocks of at least ``rows`` rows (slices of the vectors, not the
    ``h x h`` matrices) that operators write into new memory."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows, self.count, self.bytes = rows, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        operands = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in operands:
                if t.dim() >= 2 and t.shape[-2] >= self.rows:
                    self.count += 1
                    self.bytes += t.untyped_storage().nbytes()
        return out


def baseline_module(checkout: str):
    """The ``_gl_tangent`` module of another checkout, loaded under a name of its own in
    this package (its relative imports are this checkout's modules)."""
    path = Path(checkout) / "geoopt_quotient" / "manifolds" / "_gl_tangent.py"
    name = "geoopt_quotient.manifolds._gl_tangent_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Loop:
    """Auto-PGD's iterations with one tangent space on fixed vectors, as the ball runs
    them: the iterate retracted into the perturbed point's buffer, the loss's gradient
    (a fixed cotangent) pulled back, made Riemannian with its Gram entries, and the next
    iterate combined into the oldest buffer."""

    def __init__(self, space, x, xi, previous, cotangent):
        self.space, self.cotangent = space, cotangent
        self.xi, self.previous, self.out = xi.clone(), previous.clone(), torch.empty_like(x)
        self.perturbed, self.grad = torch.empty_like(x), torch.empty_like(x)
        self.weights = tuple(torch.tensor(w, dtype=x.dtype) for w in (0.9, 0.2, -0.1))

    def step(self, column: bool) -> None:
        space, xi, previous = self.space, self.xi, self.previous
        space.retr_vjp(xi, self.perturbed)[1](self.grad.copy_(self.cotangent))
        vectors = (xi, self.grad, previous)
        if column:
            space.egrad2rgrad_column_(vectors, 1)
        else:
            space.egrad2rgrad_gram_(vectors, 1)
        written = space.combination(vectors, self.weights) if column else None
        apgd.combine_(self.out, vectors, self.weights)
        if written is not None:
            written(self.out)
        self.xi, self.previous, self.out = self.out, xi, previous


class SlicedLoop(Loop):
    """A :class:`Loop` of this checkout's tangent space in slices of ``chunk`` bytes
    (``_gl_tangent.CHUNK_BYTES`` while it steps)."""

    def __init__(self, chunk: int, *args):
        super().__init__(*args)
        self.chunk = chunk

    def step(self, column: bool) -> None:
        before, _gl_tangent.CHUNK_BYTES = _gl_tangent.CHUNK_BYTES, self.chunk
        try:
            super().step(column)
        finally:
            _gl_tangent.CHUNK_BYTES = before


def measure(
    args, shape, metric: str, capped: bool, modules: Dict[str, Any], slices: List[int] = ()
) -> Dict[str, Any]:
    """Per iteration: median process seconds and minor faults, allocations of slices of
    the vectors, for each module's tangent space (or this checkout's with each size of
    ``slices``, in KiB); whether their results agree."""
    _linalg.CAP_ON_CPU = capped
    points, rows, rank = shape
    generator = torch.Generator().manual_seed(0)
    x = 0.05 * torch.randn(points, 2 * rows, rank, generator=generator)
    manifold = gq.GLQuotient(rows, rows, metric=metric)
    noise = [1e-3 * torch.randn(x.shape, generator=generator) for _ in range(3)]
    xi = manifold.proju(x, noise[0])

    def space(module):
        return module.GLTangentSpace(manifold, x, PointState(manifold, x))

    if slices:
        loops = {
            f"{kib} KiB": SlicedLoop(kib * 1024, space(_gl_tangent), x, xi, *noise[1:])
            for kib in slices
        }
    else:
        loops = {label: Loop(space(module), x, xi, *noise[1:]) for label, module in modules.items()}
    for loop in loops.values():  # warm-up: the kernels, the workspace
        loop.step(False)
        loop.step(True)
    row: Dict[str, Any] = {}
    for label, loop in loops.items():
        counts = []
        for column in (False, True):
            with Allocations(rows) as counter:
                loop.step(column)
            counts.append({"count": counter.count, "mib": counter.bytes / 2**20})
        row[label] = {"allocations_gram": counts[0], "allocations_column": counts[1]}
    labels = list(loops)
    samples: Dict[str, List[tuple]] = {label: [] for label in labels}
    for repeat in range(args.repeats):
        for label in labels if repeat % 2 == 0 else labels[::-1]:
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            loops[label].step(column=repeat % 4 != 0)
            seconds = time.process_time() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before.ru_minflt
            samples[label].append((seconds, faults))
    for label in labels:
        row[label]["seconds"] = statistics.median(s for s, _ in samples[label])
        row[label]["minor_page_faults"] = statistics.median(f for _, f in samples[label])
    if len(labels) >= 2:
        first, others = loops[labels[0]], [loops[label] for label in labels[1:]]
        same = all(torch.equal(first.perturbed, other.perturbed) for other in others)
        differences = [float((first.grad - other.grad).abs().max()) for other in others]
        row["same_perturbed_point"], row["max_gradient_difference"] = same, max(differences)
    if slices:
        default = row.get(f"{_gl_tangent.CHUNK_BYTES // 1024} KiB", row[labels[0]])["seconds"]
        row["ratio_to_default"] = {label: row[label]["seconds"] / default for label in labels}
    elif len(labels) == 2:
        row["ratio"] = row[labels[1]]["seconds"] / row[labels[0]]["seconds"]
    return row


def retraction(args, shape, metric: str) -> Dict[str, Any]:
    """The path gap's retraction of one vector (``TangentSpace.retr``): this checkout's
    tangent space against the reference formulas, interleaved; median process seconds
    and minor faults per call, and the largest difference of the points."""
    points, rows, rank = shape
    generator = torch.Generator().manual_seed(1)
    x = 0.05 * torch.randn(points, 2 * rows, rank, generator=generator)
    manifold = gq.GLQuotient(rows, rows, metric=metric)
    spaces = {
        "reference": CachedTangentSpace(manifold, x, PointState(manifold, x)),
        "this": manifold.tangent_space(x),
    }
    u = manifold.proju(x, 1e-3 * torch.randn(x.shape, generator=generator))
    samples: Dict[str, List[tuple]] = {label: [] for label in spaces}
    for repeat in range(max(args.repeats // 2, 1)):
        for label in list(spaces)[:: 1 if repeat % 2 == 0 else -1]:
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
            spaces[label].retr(u)
            seconds = time.process_time() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before.ru_minflt
            samples[label].append((seconds, faults))
    row: Dict[str, Any] = {
        label: {
            "seconds": statistics.median(s for s, _ in samples[label]),
            "minor_page_faults": statistics.median(f for _, f in samples[label]),
        }
        for label in spaces
    }
    difference = spaces["this"].retr(u) - spaces["reference"].retr(u)
    row["max_difference"] = float(difference.abs().max())
    return row


def main(argv=None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", default="inv,mix")
    parser.add_argument("--modes", default="sliced,capped", help="sliced (CPU), capped")
    parser.add_argument("--baseline", help="another checkout, run beside this one")
    parser.add_argument("--slices", help="this checkout with these slice sizes (KiB, CPU)")
    parser.add_argument("--repeats", type=int, default=8, help="iterations timed per space")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    modules = {"this": _gl_tangent}
    if args.baseline:
        modules = {"baseline": baseline_module(args.baseline), "this": _gl_tangent}
    slices = [int(kib) for kib in args.slices.split(",")] if args.slices else []
    if slices:  # the slices of the CPU only
        args.modes = "sliced"
    modes = args.modes.split(",")
    labels = [f"{kib} KiB" for kib in slices] or list(modules)
    shape = QUICK if args.quick else BERT_BASE
    rows: Dict[str, Any] = {}
    capped_before = _linalg.CAP_ON_CPU
    try:
        for metric in args.metrics.split(","):
            for mode in modes:
                row = measure(args, shape, metric, mode == "capped", modules, slices)
                if mode == "sliced" and not slices:
                    row["retraction"] = retraction(args, shape, metric)
                rows[f"{metric}-{mode}"] = row
                print(f"{metric} {mode}: " + format_row(row, labels))
    finally:
        _linalg.CAP_ON_CPU = capped_before
    settings = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "baseline"})
    settings.stack = dict(zip(("points", "rows", "rank"), shape))
    document = write_document("bench_gl_iteration", settings, rows)
    return document


def format_row(row: Dict[str, Any], labels: List[str]) -> str:
    parts = []
    for label in labels:
        r = row[label]
        parts.append(
            f"{label} {r['seconds'] * 1e3:.1f} ms, {r['minor_page_faults']:.0f} faults, "
            f"{r['allocations_gram']['count']}/{r['allocations_column']['count']} allocations"
        )
    if "retraction" in row:
        r = row["retraction"]
        parts.append(
            f"retraction {r['reference']['seconds'] * 1e3:.0f} -> {r['this']['seconds'] * 1e3:.0f}"
            f" ms, {r['reference']['minor_page_faults']:.0f} -> "
            f"{r['this']['minor_page_faults']:.0f} faults"
        )
    if "ratio" in row:
        parts.append(f"ratio {row['ratio']:.3f}, same point {row['same_perturbed_point']}")
    if "ratio_to_default" in row:
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in row["ratio_to_default"].items())
        parts.append(f"ratios {ratios}; same point {row['same_perturbed_point']}")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
