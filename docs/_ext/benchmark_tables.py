"""Tables of benchmark results, generated at build time from ``benchmarks/results/``.

``.. benchmark-table:: NAME`` renders the table ``NAME`` of :data:`TABLES` from the
result files that the benchmark scripts write (``--json``, or the printed rows for
``precision.txt``), followed by the files each figure comes from, with the device,
threads and software that each file records, and the command that writes the file.
A row whose file does not exist, or whose file holds no result for it, says
"not measured": nothing is omitted and nothing is filled in by hand.

The directory is the configuration value ``benchmark_results_dir``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

NOT_MEASURED = "not measured"

#: Rendered row labels of the models and precisions that the GPU benchmark knows.
MODELS = {"bert-base": "BERT-base", "vit-b32": "ViT-B/32"}
PRECISIONS = {"float32": "float32", "bf16-autocast": "bf16 autocast"}
GEODESIC = {"geodesic-inv": "geodesic inv", "geodesic-mix": "geodesic mix"}


# ------------------------------------------------------------------------------ files


@dataclass
class Source:
    """One result file: where it is, what it holds (``None``: no such file)."""

    path: str  # relative to the results directory
    data: Any = None
    text: Optional[str] = None

    @property
    def exists(self) -> bool:
        return self.data is not None or self.text is not None


class Results:
    """The results directory, read lazily; remembers every file a table asked for."""

    def __init__(self, root: Path):
        self.root = root
        self.asked: List[Source] = []

    def json(self, path: str) -> Source:
        file = self.root / path
        data = json.loads(file.read_text()) if file.is_file() else None
        source = Source(path, data)
        self.asked.append(source)
        return source

    def text(self, path: str) -> Source:
        file = self.root / path
        source = Source(path, text=file.read_text() if file.is_file() else None)
        self.asked.append(source)
        return source

    def glob(self, pattern: str) -> List[Source]:
        return [self.json(str(p.relative_to(self.root))) for p in sorted(self.root.glob(pattern))]


def environment(source: Source) -> str:
    """Device, threads and software recorded in a result file, in words."""
    doc = source.data
    if not isinstance(doc, dict):
        return "device and threads not recorded in the file"
    env = dict(doc.get("environment") or {})
    for key in ("gpu", "device", "threads", "torch", "cuda", "machine"):
        if key in doc and not isinstance(doc[key], (dict, list)):
            env.setdefault(key, doc[key])
    if isinstance(doc.get("projection"), dict):
        env.setdefault("device", doc["projection"].get("device"))
    settings = doc.get("settings") or {}
    if "threads" in settings:
        env.setdefault("threads", settings["threads"])
    parts = []
    named_device = env.get("device") not in (None, "cpu", "cuda")
    gpu = env.get("gpu") or (env["device"] if named_device else None)
    if gpu:
        parts.append(str(gpu))
    elif env.get("device") == "cuda":
        parts.append("a CUDA GPU")
    else:
        parts.append(f"CPU ({env['machine']})" if env.get("machine") else "CPU")
    threads = env.get("cpu_threads", env.get("threads"))
    parts.append(f"{threads} CPU thread(s)" if threads else "threads not recorded")
    if env.get("torch"):
        parts.append(f"torch {env['torch']}")
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    if env.get("transformers"):
        parts.append(f"transformers {env['transformers']}")
    if isinstance(doc.get("malloc"), dict):
        parts.append(f"malloc {malloc_setting(doc)} ({doc['malloc'].get('libc', 'libc unknown')})")
    status = doc.get("status")
    if status and status != "complete":
        parts.append(f"run status {status!r}: the run stopped before its end")
    if settings.get("quick"):
        parts.append("a --quick run (reduced sizes, not a measurement)")
    return ", ".join(parts)


# ------------------------------------------------------------------------------ tables


@dataclass
class Table:
    header: Sequence[str]
    rows: List[Sequence[str]]
    command: str
    notes: List[str] = field(default_factory=list)


def fmt(value: Any, spec: str = ".3g", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return NOT_MEASURED
    return f"{value:{spec}}{suffix}"


def dig(doc: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(doc, dict) and key in doc:
            doc = doc[key]
        elif isinstance(doc, list) and isinstance(key, int) and -len(doc) <= key < len(doc):
            doc = doc[key]
        else:
            return None
    return doc


def unit_state(unit: Any) -> Optional[str]:
    """``None`` for a unit with results; else what a row's cells say instead."""
    if not isinstance(unit, dict) or not unit:
        return NOT_MEASURED
    if "error" in unit:
        return "failed (the file has the error)"
    if "skipped" in unit:
        return NOT_MEASURED
    return None


def model_precision_rows(
    doc: Any, section: str, cells: Callable[[Dict], List[str]], width: int
) -> List[List[str]]:
    rows = []
    for model, model_label in MODELS.items():
        for precision, precision_label in PRECISIONS.items():
            unit = dig(doc, section, "results", model, precision)
            state = unit_state(unit)
            values = [state] * width if state else cells(unit)
            rows.append([f"{model_label}, {precision_label}", *values])
    return rows


def gpu_iteration(results: Results) -> Table:
    source = results.json("gpu/bench_cuda.json")

    def cells(unit: Dict) -> List[str]:
        seconds = unit.get("seconds_per_iteration", {})
        ratio = unit.get("ratio_to_adaptive", {})
        per_pass = unit.get("ratio_to_adaptive_per_pass", {})
        out = [fmt(seconds.get(k), ".3f") for k in ("forward-backward", "adaptive", *GEODESIC)]
        for key in GEODESIC:
            out.append(f"{fmt(ratio.get(key), '.2f')} ({fmt(per_pass.get(key), '.2f')})")
        return out

    return Table(
        [
            "model, precision",
            "forward+backward (s)",
            "adaptive (s)",
            "geodesic inv (s)",
            "geodesic mix (s)",
            "inv / adaptive (per pass)",
            "mix / adaptive (per pass)",
        ],
        model_precision_rows(source.data, "iteration", cells, 6),
        "python benchmarks/bench_cuda.py --sections iteration "
        "--json benchmarks/results/gpu/bench_cuda.json",
    )


def gpu_memory(results: Results) -> Table:
    source = results.json("gpu/bench_cuda.json")

    def cells(unit: Dict) -> List[str]:
        ratio = unit.get("peak_ratio_to_training_step", {})
        train = dig(unit, "runs", "train-step", "peak_bytes")
        return [
            fmt(train / 2**30 if train else None, ".2f", " GiB"),
            *(fmt(ratio.get(k), ".2f") for k in ("adaptive", *GEODESIC)),
        ]

    return Table(
        ["model, precision", "training step", "adaptive", "geodesic inv", "geodesic mix"],
        model_precision_rows(source.data, "memory", cells, 4),
        "python benchmarks/bench_cuda.py --sections memory "
        "--json benchmarks/results/gpu/bench_cuda.json",
        [
            "Peak memory (``torch.cuda.max_memory_allocated``) of each measure divided by "
            "that of a training step on the same batch."
        ],
    )


def gpu_protocol(results: Results) -> Table:
    sources = [results.json("gpu/bench_cuda.json"), *results.glob("gpu/protocol_*.json")]
    sources = list({s.path: s for s in sources}.values())
    rows = []
    for model, model_label in MODELS.items():
        for precision, precision_label in PRECISIONS.items():
            cells, used = [], []
            for measure in ("geodesic-mix", "adaptive"):
                found = NOT_MEASURED
                for source in sources:
                    entry = dig(source.data, "protocol", "results", model, precision, "measures")
                    entry = dig(entry, measure)
                    if isinstance(entry, dict) and "seconds" in entry:
                        passes = dig(entry, "passes", "forward_backward")
                        found = f"{entry['seconds']:.1f} s ({passes} passes)"
                        used.append(Path(source.path).name)
                        break
                cells.append(found)
            files = ", ".join(dict.fromkeys(used)) or "none"
            rows.append([model_label, precision_label, *cells, files])
    return Table(
        ["model", "precision", "geodesic mix", "adaptive", "from"],
        rows,
        "python benchmarks/bench_cuda.py --sections protocol --models MODEL "
        "--precisions PRECISION --json benchmarks/results/gpu/protocol_NAME.json",
        [
            "20 Auto-PGD iterations per batch; BERT-base: 1024 pairs in 8 batches of 128, "
            "ViT-B/32: 2048 images in 8 batches of 256. The passes are the forward+backward "
            "passes made (Auto-PGD's restarts add to the 8 x 20)."
        ],
    )


def gpu_host_syncs(results: Results) -> Table:
    doc = results.json("gpu/host_syncs.json").data
    columns = [
        ("loss_forward_backward", "the loss alone"),
        ("adaptive", "adaptive"),
        ("geodesic-inv-second_order", "inv, second order"),
        ("geodesic-inv-straight", "inv, straight"),
        ("geodesic-inv-exact", "inv, exact"),
        ("geodesic-mix-second_order", "mix, second order"),
        ("geodesic-mix-straight", "mix, straight"),
        ("geodesic-mix-exact", "mix, exact"),
    ]
    labels = {"encoder": "two nn.TransformerEncoderLayer", "tiny-bert": "tiny BERT"}
    rows = []
    for model, label in labels.items():
        counts = dig(doc, "per_iteration", model)
        rows.append([label, *(fmt(dig(counts, key), "g") for key, _ in columns)])
    return Table(
        ["model", *(label for _, label in columns)],
        rows,
        "python benchmarks/bench_host_syncs.py --json benchmarks/results/gpu/host_syncs.json",
        [
            "Host synchronisations per Auto-PGD iteration, counted with "
            "``torch.cuda.set_sync_debug_mode`` from runs of two iteration counts."
        ],
    )


def geometry_projection(results: Results) -> Table:
    rows = []
    for device, path in (("CPU", "cpu/geometry.json"), ("GPU", "gpu/geometry.json")):
        p = dig(results.json(path).data, "projection")
        if not isinstance(p, dict):
            rows.append([device, *[NOT_MEASURED] * 6])
            continue
        rows.append(
            [
                device,
                f"{p['pairs']} pairs, n = {p['n']}, h = {p['h']}, {p['dtype']}",
                fmt(dig(p, "median_seconds", "batched"), ".3f", " s"),
                fmt(dig(p, "median_seconds", "scipy_loop"), ".3f", " s"),
                fmt(p.get("speedup"), ".1f", "x"),
                fmt(p.get("max_abs_difference"), ".1e"),
                fmt(p.get("settle_seconds"), "g", " s"),
            ]
        )
    return Table(
        ["device", "problem", "batched", "SciPy loop", "speed-up", "max |difference|", "pause"],
        rows,
        "python benchmarks/bench_geometry.py [--device cuda] --repeats 5 "
        "--json benchmarks/results/{cpu,gpu}/geometry.json",
        [
            "The inv-metric horizontal projection batched on the device, against a per-pair "
            "``scipy.linalg.solve_sylvester`` loop on the CPU of the same machine."
        ],
    )


def geometry_scaling(results: Results) -> Table:
    rows = []
    for device, path in (("CPU", "cpu/geometry.json"), ("GPU", "gpu/geometry.json")):
        scaling = dig(results.json(path).data, "scaling")
        if not isinstance(scaling, list) or not scaling:
            rows.append([device, NOT_MEASURED, NOT_MEASURED, *[NOT_MEASURED] * 3])
            continue
        heads = max(r["heads"] for r in scaling)
        for r in scaling:
            if r["heads"] == heads:
                rows.append(
                    [
                        device,
                        r["metric"],
                        f"{r['heads']} heads, h = {r['h']}",
                        *(fmt(r[k] * 1e3, ".2f", " ms") for k in ("proju", "egrad2rgrad", "retr")),
                    ]
                )
    return Table(
        ["device", "metric", "points", "proju", "egrad2rgrad", "retr"],
        rows,
        "python benchmarks/bench_geometry.py [--device cuda] "
        "--json benchmarks/results/{cpu,gpu}/geometry.json",
        [
            "Median time of one call for the largest number of heads in the file (the file "
            "has the others)."
        ],
    )


def gpu_compile(results: Results) -> Table:
    doc = results.json("gpu/compile.json").data
    rows = []
    for metric in ("inv", "mix"):
        r = dig(doc, "compile", "results", metric, "symmetric")
        if not isinstance(r, dict) or "eager_ms" not in r:
            rows.append([metric, *[NOT_MEASURED] * 5])
            continue
        rows.append(
            [
                metric,
                f"{r['groups']} groups, {r['entries']:,} entries",
                fmt(r["eager_ms"], ".2f", " ms"),
                fmt(r["compiled_ms"], ".2f", " ms"),
                fmt(r["speedup"], ".2f", "x"),
                f"{fmt(r['compile_seconds'], '.1f', ' s')}, {r['graph_breaks']} graph breaks",
            ]
        )
    return Table(
        ["metric", "groups", "eager", "compiled", "speed-up", "compiling"],
        rows,
        "python benchmarks/bench_cuda.py --sections compile "
        "--json benchmarks/results/gpu/compile.json",
        [
            "``torch.compile`` of the geometry of one iteration (Riemannian gradient, metric, "
            "second-order retraction) for the two GL(h) groups of BERT-base."
        ],
    )


def gpu_profile(results: Results) -> Table:
    runs = dig(results.json("gpu/profile.json").data, "runs") or {}
    rows = []
    for name in ("float32 forward-backward", "float32 adaptive"):
        r = runs.get(name)
        if not isinstance(r, dict):
            rows.append([name, *[NOT_MEASURED] * 4])
            continue
        rows.append(
            [
                name,
                fmt(r.get("wall_seconds_per_iteration"), ".3f", " s"),
                fmt(r.get("gpu_busy_seconds_per_iteration"), ".3f", " s"),
                fmt(r.get("kernel_launches_per_iteration"), ",.0f"),
                fmt(r.get("aten_operators_per_iteration"), ",.0f"),
            ]
        )
    return Table(
        ["BERT-base, under the profiler", "wall", "GPU busy", "kernel launches", "operators"],
        rows,
        "python benchmarks/profile_cuda_iteration.py --json benchmarks/results/gpu/profile.json",
        ["Per iteration (per pass for the plain forward and backward pass)."],
    )


def gpu_profile_flat_ball(results: Results) -> Table:
    doc = results.json("gpu/profile_flat_ball.json").data
    runs, rows = dig(doc, "runs") or {}, []
    for precision in ("float32", "bf16-autocast"):
        for measure in ("forward-backward", "adaptive", "geodesic-inv", "geodesic-mix"):
            name = f"{precision} {measure}"
            r = runs.get(name)
            if not isinstance(r, dict):
                rows.append([name, *[NOT_MEASURED] * 5])
                continue
            kernels = r.get("top_kernels") or []
            top = "; ".join(
                f"{k['count']} {kernel_name(k['name'])} {k['gpu_ms']:.1f} ms" for k in kernels[:2]
            )
            rows.append(
                [
                    name,
                    fmt(1e3 * r["wall_seconds_per_iteration"], ".1f", " ms"),
                    fmt(1e3 * r["gpu_busy_seconds_per_iteration"], ".1f", " ms"),
                    fmt(r.get("kernel_launches_per_iteration"), ",.0f"),
                    fmt(r.get("aten_operators_per_iteration"), ",.0f"),
                    top or NOT_MEASURED,
                ]
            )
    device = dig(doc, "gpu")
    return Table(
        [
            f"BERT-base, 32 x 128 tokens ({device or 'GPU not named'})",
            "wall",
            "GPU busy",
            "kernel launches",
            "operators",
            "kernels with the most GPU time (whole run)",
        ],
        rows,
        "python benchmarks/profile_cuda_iteration.py --iters 8 --batch-size 32 "
        "--json benchmarks/results/gpu/profile_flat_ball.json",
        [
            "A whole call of 8 iterations under torch.profiler (its fixed work included: the "
            "clean loss, the base point's geometry, the path gap), over 8; the plain run makes 8 "
            "forward and backward passes. Wall time is inflated by the profiler's own host "
            "work. Measured on the engine of the commit in the JSON's 'engine' field; the bf16 "
            "geodesic rows were not reached within that call's time limit."
        ],
    )


PRECISION_LINE = re.compile(
    r"^\s+(?P<measure>\S+)\s+rho (?P<rho>\S+)\s+(?P<mode>\S+)\s+value (?P<value>\S+)"
    r"\s+rel\.err (?P<rel>\S+)"
)


def precision_rows(results: Results) -> Tuple[List[Dict[str, Any]], Source]:
    """The rows of ``bench_precision``: its JSON, else the rows it printed."""
    source = results.json("gpu/precision.json")
    if source.exists:
        rows = [
            {**row, "model": model}
            for model, model_rows in source.data.get("models", {}).items()
            for row in model_rows
        ]
        for row in rows:
            row.setdefault("rel_error", 0.0)
        return rows, source
    results.asked.pop()  # no JSON: the printed rows are the source
    source = results.text("gpu/precision.txt")
    rows, model = [], None
    for line in (source.text or "").splitlines():
        if line.startswith("BERT-"):
            model = "bert-" + line[len("BERT-") :].strip()
            continue
        match = PRECISION_LINE.match(line)
        if match and model:
            rows.append(
                {
                    "model": model,
                    "measure": match["measure"],
                    "rho": float(match["rho"]),
                    "mode": match["mode"],
                    "value": float(match["value"]),
                    "rel_error": float(match["rel"]),
                }
            )
    return rows, source


def precision(results: Results) -> Table:
    rows, _ = precision_rows(results)
    modes = [
        "float32",
        "tf32",
        "bf16-autocast",
        "fp16-autocast",
        "bf16-model",
        "fp16-model",
    ]
    base_keys = sorted({(r["measure"], r["rho"]) for r in rows if r["model"] == "bert-base"})
    reference = {
        (r["measure"], r["rho"]): r["value"]
        for r in rows
        if r["model"] == "bert-base" and r["mode"] == "float64"
    }
    header = ["precision"]
    for measure, rho in base_keys:
        header.append(f"BERT-base {measure}, ρ = {rho:g} (value {reference[measure, rho]:.2g})")
    header.append("tiny BERT, every measure and radius")
    table_rows = []
    for mode in modes:
        row = [mode]
        for key in base_keys:
            match = [
                r
                for r in rows
                if r["model"] == "bert-base"
                and r["mode"] == mode
                and (r["measure"], r["rho"]) == key
            ]
            row.append(fmt(match[0]["rel_error"] * 100, ".2g", "%") if match else NOT_MEASURED)
        tiny = [r["rel_error"] for r in rows if r["model"] == "bert-tiny" and r["mode"] == mode]
        row.append(f"{min(tiny) * 100:.2g}% to {max(tiny) * 100:.2g}%" if tiny else NOT_MEASURED)
        table_rows.append(row)
    if not rows:
        header = ["precision", "relative error against float64"]
        table_rows = [[mode, NOT_MEASURED] for mode in modes]
    return Table(
        header,
        table_rows,
        "python benchmarks/bench_precision.py --json benchmarks/results/gpu/precision.json",
        [
            "Relative error of the worst-case sharpness against the float64 value, same batch, "
            "seed and 10 Auto-PGD iterations."
        ],
    )


def sam_step_cost(results: Results) -> Table:
    doc = results.json("sam/bench_sam.json").data
    methods = ["sgd", "sam", "asam", "geodesic-mix", "geodesic-inv"]
    rows = []
    for model in ("vit", "bert"):
        m = dig(doc, "models", model)
        label = (m or {}).get("model", model)
        for method in methods:
            step = dig(m, "median_seconds_per_step", method)
            if step is None:
                rows.append([label, method, *[NOT_MEASURED] * 3])
                continue
            ascent = dig(m, "median_ascent_seconds_per_step", method)
            rows.append(
                [
                    label,
                    method,
                    fmt(step * 1e3, ".2f", " ms"),
                    fmt(ascent * 1e3, ".2f", " ms") if ascent else "–",
                    fmt(dig(m, "ratio_to_sam", method), ".3f"),
                ]
            )
    return Table(
        ["model, batch", "method", "step", "first_step (ascent)", "ratio to SAM"],
        rows,
        "python benchmarks/bench_sam.py --profile --out benchmarks/results/sam",
        [
            "Medians of interleaved repeats; every method steps its own copy of the model "
            "with ``torch.optim.SGD`` (momentum 0.9) as the base optimizer."
        ],
    )


SAM_LABEL = {"sgd": "SGD (momentum)", "sam": "SAM", "asam": "ASAM", "geodesic": "GeodesicSAM"}


def sam_digits(results: Results) -> Table:
    doc = results.json("sam/sam_digits.json").data
    summary = dig(doc, "summary") or []
    rows = []

    def pm(row: Dict, key: str, scale: float = 1.0, spec: str = ".2f") -> str:
        value = row.get(key)
        if not isinstance(value, dict):
            return "–"
        return f"{value['mean'] * scale:{spec}} ± {value['std'] * scale:{spec}}"

    for row in summary:
        rows.append(
            [
                SAM_LABEL.get(row["method"], row["method"]),
                "–" if row["rho"] is None else f"{row['rho']:g}",
                pm(row, "test_accuracy", 100),
                pm(row, "test_accuracy_minus_sgd", 100),
                pm(row, "test_loss", spec=".3f"),
                pm(row, "train_accuracy", 100),
                pm(row, "geodesic_sharpness", spec=".4f"),
                pm(row, "adaptive_sharpness", spec=".4f"),
                fmt(dig(row, "train_seconds", "mean"), ".1f"),
            ]
        )
    if not rows:
        rows = [[NOT_MEASURED] * 9]
    return Table(
        [
            "method",
            "ρ",
            "test acc. %",
            "vs SGD (points)",
            "test loss",
            "train acc. %",
            "geodesic sharpness",
            "adaptive sharpness",
            "s/run",
        ],
        rows,
        "python examples/sam_digits.py --out benchmarks/results/sam",
        [
            'Mean ± standard deviation over the seeds; "vs SGD" is the difference to SGD '
            "with the same seed; s/run is the training's wall time."
        ],
    )


def sam_calibration(results: Results) -> Table:
    doc = results.json("sam/calibration.json").data
    rows = []
    calibration = dig(doc, "calibration") or []
    epochs = sorted({r["epoch"] for r in calibration})
    for epoch in epochs:
        at = [r for r in calibration if r["epoch"] == epoch]
        for method in ("sam", "asam", "geodesic"):
            cells = [
                f"{r['rho']:g}: {r['loss_increase']:+.4f}" for r in at if r["method"] == method
            ]
            rows.append(
                [str(epoch), f"{at[0]['clean_loss']:.4f}", SAM_LABEL[method], "   ".join(cells)]
            )
    if not rows:
        rows = [[NOT_MEASURED] * 4]
    return Table(
        ["epoch", "training loss", "ball", "ρ: L(w') − L(w) of one ascent step"],
        rows,
        "python examples/sam_digits.py --calibrate --out benchmarks/results/sam",
        ["A pilot model trained with plain SGD (a seed outside the experiment)."],
    )


def _with_spread(median, values) -> str:
    """``median`` as a ratio, with the range of the per-repeat ``values`` where recorded."""
    cell = fmt(median, ".2f", "x")
    if median is None or not isinstance(values, list) or len(values) < 2:
        return cell
    return f"{cell} ({min(values):.2f}–{max(values):.2f})"


def malloc_setting(doc: Any) -> str:
    """The glibc malloc setting a result file records (``--malloc``); a file without the
    record was written before the option, with glibc's defaults."""
    record = dig(doc, "malloc")
    if not isinstance(record, dict):
        return "default"
    if not record.get("applied", False):
        return f"{record.get('malloc')} (not applied: {record.get('note', 'no reason recorded')})"
    return str(record.get("malloc"))


#: The files of :func:`cpu_iteration_overhead`: glibc's malloc as it is, and retaining
#: freed memory (``--malloc retain``).
ITERATION_OVERHEAD_FILES = ("cpu/iteration_overhead.json", "cpu/iteration_overhead_retain.json")
#: The same measurement at a larger batch (its models' rows only).
LARGE_BATCH_FILE = "cpu/iteration_overhead_large_batch.json"


def cpu_iteration_overhead(results: Results) -> Table:
    """The rows of glibc's default malloc, then those of ``--malloc retain``, then those
    at a larger batch."""
    default, retain, large = (
        results.json(path) for path in (*ITERATION_OVERHEAD_FILES, LARGE_BATCH_FILE)
    )
    rows = _iteration_overhead_rows(default.data, "default")
    rows += _iteration_overhead_rows(retain.data, "retain")
    rows += _iteration_overhead_rows(large.data, "default", measured_only=True)
    sources = (default, retain, large)
    clocks = {dig(s.data, "settings", "clock") for s in sources if s.exists}
    return _iteration_overhead_table(rows, clocks)


def _iteration_overhead_rows(doc: Any, malloc: str, measured_only: bool = False) -> List[List[str]]:
    """One row per model of a file written with ``--malloc malloc`` (``doc``: ``None``
    where there is no such file); only the models it holds if ``measured_only``."""
    rows = []
    labels = {"tiny-vit": "tiny ViT (digits)", "bert-11m": "BERT, 11M", "bert-base": "BERT-base"}
    measures = ("adaptive", "inv", "mix")
    malloc = malloc_setting(doc) if doc is not None else malloc
    for model, label in labels.items():
        m = dig(doc, "models", model)
        if not isinstance(m, dict) or "plain_ms" not in m:
            if not measured_only:
                rows.append([label, malloc, *[NOT_MEASURED] * 8])
            continue
        passes = sorted(
            {
                f"{m[k]['forward_passes_per_batch']} f / {m[k]['backward_passes_per_batch']} b"
                for k in measures
                if k in m
            }
        )
        marginal = {k: dig(m, k, "marginal_ratio") for k in measures}
        iters = m.get("iters") or dig(doc, "settings", "iters")
        half = dig(m, "adaptive", "half_iters")
        rows.append(
            [
                label,
                malloc,
                f"{iters} vs {half}, {m['batches']} × ({' × '.join(map(str, m['batch_shape']))})",
                fmt(m["plain_ms"], ".1f", " ms"),
                *(_with_spread(marginal[k], dig(m, k, "marginal_ratios")) for k in measures),
                " / ".join(
                    fmt(marginal[k] / marginal["adaptive"], ".2f")
                    if marginal[k] and marginal["adaptive"]
                    else NOT_MEASURED
                    for k in ("inv", "mix")
                ),
                " / ".join(fmt(dig(m, k, "fixed_passes"), ".1f") for k in measures),
                " / ".join(fmt(dig(m, k, "ratio"), ".2f", "x") for k in measures),
                ", ".join(passes),
            ]
        )
    return rows


def _iteration_overhead_table(rows: List[List[str]], clocks: set) -> Table:
    return Table(
        [
            "model",
            "glibc malloc",
            "iterations, batches",
            "plain forward+backward",
            "adaptive",
            "inv",
            "mix",
            "inv / mix over adaptive",
            "fixed work per batch, passes (adaptive / inv / mix)",
            "whole run per iteration (adaptive / inv / mix)",
            "passes per batch",
        ],
        rows,
        "python benchmarks/bench_iteration_overhead.py --models tiny-vit,bert-11m "
        "--repeats 3 --clock process --json benchmarks/results/cpu/iteration_overhead.json",
        [
            "BERT-base, added to the same file: python benchmarks/bench_iteration_overhead.py "
            "--models bert-base --bert-batch-size 4 --iters 8 --repeats 3 --clock process "
            "--merge --json benchmarks/results/cpu/iteration_overhead.json.",
            "The last rows, at a larger batch: python benchmarks/bench_iteration_overhead.py "
            "--models bert-11m --bert-batch-size 32 --repeats 3 --clock process "
            "--json benchmarks/results/cpu/iteration_overhead_large_batch.json.",
            "glibc malloc: default, glibc's own (a freed block above its mmap threshold, "
            "at most 32 MiB, goes back to the kernel and is faulted in again page by page "
            "at its next allocation); retain, freed memory kept in the process "
            "(--malloc retain: mallopt's mmap and trim thresholds at 2 GiB, for the plain "
            "passes and the runs alike), written by the same commands with --malloc retain "
            "--json benchmarks/results/cpu/iteration_overhead_retain.json.",
            "adaptive, inv, mix: what one more Auto-PGD iteration costs, over a plain "
            "forward and backward pass of the same loss: the time of a run of n iterations "
            "minus that of a run of n/2, over n/2 (iterations: n vs n/2; interleaved, "
            "medians; in brackets, where recorded, the range over the repeats' pairs of "
            "runs: the noise of a difference of two runs that both hold the fixed work); "
            "fixed work: what a run costs besides its iterations (clean loss, "
            "base-point geometry, the path gap's exact geodesic, the last forward pass), per "
            "batch, in plain passes; whole run: the n-iteration run's time per iteration, "
            "both together; "
            + (
                "the process's CPU time (--clock process: the machine was shared)."
                if clocks == {"process"}
                else "wall time."
            ),
        ],
    )


#: The files of :func:`cpu_iteration_bytes`: this engine's, and the engine before the
#: gradient was converted as it arrives (the same script, run on that engine).
ITERATION_BYTES_FILES = ("cpu/iteration_bytes.json", "cpu/iteration_bytes_before.json")


def cpu_iteration_bytes(results: Results) -> Table:
    """Passes over the parameters per adaptive iteration, by call site, and the totals of
    the model's operators and the ball's, with the engine's before where recorded."""
    now, before = (results.json(path) for path in ITERATION_BYTES_FILES)
    models = dig(now.data, "models") or {}
    model = next(iter(models), None)
    cell = dig(models, model, "adaptive", "bytes_by_site") or {}
    earlier = dig(before.data, "models", model, "adaptive", "bytes_by_site", "passes") or {}
    plain = dig(models, model, "plain", "bytes_by_site", "passes", "model") or {}
    rows = []
    for part, label in (("model", "the model's operators"), ("ball", "the ball's operators")):
        total = dig(cell, "passes", part) or {}
        rows.append(
            [
                f"total: {label}",
                "",
                fmt(total.get("memory_read"), ".2f"),
                fmt(total.get("memory_written"), ".2f"),
                fmt(dig(earlier, part, "memory"), ".2f"),
                fmt(total.get("memory"), ".2f"),
            ]
        )
    for site in cell.get("sites", []):
        rows.append(
            [
                site["site"],
                f"{site['operator']} ({site['pass']}, {site['calls']:.0f} calls)",
                fmt(site["memory_read"], ".2f"),
                fmt(site["memory_written"], ".2f"),
                "",
                fmt(site["memory_read"] + site["memory_written"], ".2f"),
            ]
        )
    label = model or NOT_MEASURED
    return Table(
        ["call site", "operator", "read", "written", "before", "passes"],
        rows,
        "python benchmarks/profile_cpu_iteration.py --models bert-11m --measures adaptive "
        "--batch-size 8 --operators 0 --marginal --bytes 14 "
        "--json benchmarks/results/cpu/iteration_bytes.json",
        [
            f"Model: {label}, one more adaptive iteration (runs of 20 and 10 iterations, "
            "kept best gradient), in passes over its float32 parameters; a plain forward "
            f"and backward pass moves {fmt(plain.get('memory'), '.2f')}. ``before``: the "
            "engine that copied the gradient into the flat buffer and swept it after the "
            "pass (``iteration_bytes_before.json``, the same command on it)."
        ],
    )


def cpu_path_gap_cost(results: Results) -> Table:
    doc = results.json("cpu/path_gap_cost.json").data
    labels = {
        "tiny-vit": "tiny ViT (digits)",
        "bert-11m": "BERT, 11M (8 × 128)",
        "bert-base": "BERT-base (4 × 128)",
    }
    rows = []
    for model, label in labels.items():
        for metric in ("inv", "mix"):
            row = dig(doc, "models", model, metric)
            rows.append(
                [
                    label,
                    metric,
                    fmt(dig(row, "path_gap_seconds"), ".3f", " s"),
                    fmt(dig(row, "passes"), ".2f"),
                    fmt(dig(row, "path_gap"), ".3g"),
                ]
            )
    return Table(
        ["model", "metric", "path gap per call", "in plain passes", "relative gap reported"],
        rows,
        "python benchmarks/bench_path_gap_cost.py --repeats 3 "
        "--json benchmarks/results/cpu/path_gap_cost.json",
        [
            f"rho={dig(doc, 'settings', 'rho')}, {dig(doc, 'settings', 'iters')} Auto-PGD "
            "iterations before the report; the process's CPU time of the report alone and of "
            "a plain forward and backward pass, interleaved, medians."
        ],
    )


def cpu_path_gap_operators(results: Results) -> Table:
    doc = results.json("cpu/path_gap_operators.json").data
    labels = {"bert-4x256": "BERT, 4 layers, width 256", "bert-base-shaped": "BERT-base shape"}
    rows = []
    for model, label in labels.items():
        for metric in ("inv", "mix"):
            row = dig(doc, "models", model, metric) or {}
            matrices = row.get("linalg_matrices", {})
            rows.append(
                [
                    label,
                    metric,
                    fmt(row.get("operators"), ",d"),
                    fmt(row.get("non_view_operators"), ",d"),
                    fmt(row.get("host_syncs"), "d"),
                    fmt(sum(v for k, v in matrices.items() if "qr" in k), ",d"),
                    fmt(sum(v for k, v in matrices.items() if "cholesky_inverse" in k), ",d"),
                ]
            )
    return Table(
        [
            "model",
            "metric",
            "operators",
            "not views",
            "host syncs",
            "QR matrices",
            "cholesky_inverse matrices",
        ],
        rows,
        "python benchmarks/bench_path_gap_cost.py --operators "
        "--json benchmarks/results/cpu/path_gap_operators.json",
        [
            "One geodesic_sharpness call's path gap (rho=0.01, 3 iterations, a batch of 2 x 8 "
            "tokens, random weights), counted on the CPU with blocks capped as on an "
            "accelerator. A batched QR of more than 256 rows and a batched cholesky_inverse "
            "loop over their matrices on a GPU (a few kernels each)."
        ],
    )


def cpu_sharpness_iteration(results: Results) -> Table:
    doc = results.json("cpu/sharpness_iteration.json").data
    rows = []
    for measure in ("adaptive", *GEODESIC):
        seconds = dig(doc, "seconds_per_iteration", measure)
        rows.append(
            [
                measure,
                fmt(seconds, ".3f", " s"),
                fmt(dig(doc, "ratio_to_adaptive", measure), ".3f"),
            ]
        )
    model = f"{doc['model']}, batch {'x'.join(map(str, doc['batch']))}" if doc else NOT_MEASURED
    return Table(
        ["measure", "seconds per iteration", "ratio to adaptive"],
        rows,
        "python benchmarks/bench_sharpness_iteration.py "
        "--json benchmarks/results/cpu/sharpness_iteration.json",
        [f"Model: {model}."],
    )


def cpu_memory(results: Results) -> Table:
    doc = results.json("cpu/memory.json").data
    repeats = dig(doc, "repeats") or 1
    processes = f" (median of {repeats} processes)" if repeats > 1 else ""
    rows = []
    for mode in ("train", "adaptive", *GEODESIC):
        peak = dig(doc, "runs", mode, "peak_mib")
        rows.append(
            [
                mode,
                fmt(peak, ",.0f", " MiB"),
                fmt(dig(doc, "peak_ratio_to_training_step", mode), ".2f"),
                fmt(dig(doc, "increment_ratio_to_training_step", mode), ".2f"),
                fmt(dig(doc, "excess_over_training_step_in_parameter_copies", mode), ".2f"),
            ]
        )
    return Table(
        ["run", "peak RSS", "ratio to training step", "above model and batch", "parameter copies"],
        rows,
        "python benchmarks/bench_memory.py --json benchmarks/results/cpu/memory.json",
        [f"Peak resident set size of a fresh process per run{processes}."],
    )


def cpu_ball_memory(results: Results) -> Table:
    doc = results.json("cpu/ball_memory.json").data
    rows = []
    parts = ("base", "perturbed", "iterates", "gradients", "total")
    for measure in ("adaptive", "inv", "mix"):
        kept = dig(doc, "measures", measure, "kept") or {}
        rows.append([measure, *(fmt(kept.get(part), ".1f", " B") for part in parts)])
    model = dig(doc, "model") or NOT_MEASURED
    return Table(
        ["measure", *parts],
        rows,
        "python benchmarks/bench_ball_memory.py --json benchmarks/results/cpu/ball_memory.json",
        [
            f"Model: {model}. Bytes per trainable parameter held by the worst case's ball "
            "(best gradient kept); the model's own parameters and the pass are not counted."
        ],
    )


def cpu_sharded_ball_memory(results: Results) -> Table:
    doc = results.json("cpu/sharded_ball_memory.json").data
    parts = ("base", "saved", "perturbed", "iterates", "gradients", "index", "total")
    rows = []
    for measure in ("adaptive", "inv", "mix"):
        single = dig(doc, "single_process", measure, "not_kept") or {}
        rows.append(
            [f"{measure}, 1 process", *(fmt(single.get(part, 0.0), ".2f", " B") for part in parts)]
        )
        for world, by_measure in sorted(
            (dig(doc, "ranks") or {}).items(), key=lambda kv: int(kv[0])
        ):
            top = dig(by_measure, measure, "max_rank_not_kept") or {}
            rows.append(
                [f"{measure}, {world} ranks", *(fmt(top.get(part), ".2f", " B") for part in parts)]
            )
    model = dig(doc, "model") or NOT_MEASURED
    return Table(
        ["measure, processes", *parts],
        rows,
        "python benchmarks/bench_sharded_ball_memory.py "
        "--json benchmarks/results/cpu/sharded_ball_memory.json",
        [
            f"Model: {model}, float32, each decoder layer and the root wrapped with "
            "fully_shard on gloo ranks. Bytes per parameter of the whole model held by the "
            "worst case's ball on the rank holding the most (best gradient not kept); one "
            "process holds no saved entries and no index maps of its own."
        ],
    )


def gpu_flat_ball(results: Results) -> Table:
    measures = ("adaptive", "inv", "mix")
    rows = []
    engines = (
        ("kept best gradient", KEPT_GRADIENT_FILES, "units"),
        ("kept best gradient, earlier run", KEPT_GRADIENT_FILES, "earlier_units"),
        ("batched geometry", ("gpu/flat_ball_bert.json", "gpu/flat_ball_vit.json"), "units"),
        ("flat ball", ("gpu/flat_ball.json",), "units"),
        ("before", ("gpu/flat_ball_before.json",), "units"),
    )
    for engine, paths, section in engines:
        units, devices = {}, {}
        for path in paths:  # one file per model where the runs were split
            doc = results.json(path).data
            for key, unit in (dig(doc, section) or {}).items():
                units[key], devices[key] = unit, dig(doc, "device")
        for model, model_label in MODELS.items():
            for precision, precision_label in PRECISIONS.items():
                unit = units.get(f"{model} {precision}")
                if section != "units" and unit is None:
                    continue  # earlier runs: only the units measured twice
                device = devices.get(f"{model} {precision}")
                commit = unit.get("engine") if isinstance(unit, dict) else None
                where = ", ".join(w for w in (device, commit and f"engine {commit}") if w)
                where = f" ({where})" if where else ""
                label = f"{engine}{where}: {model_label}, {precision_label}"
                state = unit_state(unit)
                if state:
                    rows.append([label, *[state] * 8])
                    continue
                ratios, launches = unit["ratio_to_step"], unit["launches_per_iteration"]
                launch_ratios = unit.get("launches_ratio_to_step") or {}
                rows.append(
                    [
                        label,
                        fmt(1e3 * unit["seconds_per_iteration"]["step"], ".1f"),
                        *(fmt(ratios.get(m), ".2f") for m in measures),
                        fmt(launches.get("step"), ".0f"),
                        *(
                            f"{fmt(launches.get(m), '.0f')} ({fmt(launch_ratios.get(m), '.2f')})"
                            for m in measures
                        ),
                    ]
                )
    return Table(
        [
            "engine: model, precision",
            "step (ms)",
            "adaptive / step",
            "inv / step",
            "mix / step",
            "step launches",
            "adaptive launches (/ step)",
            "inv launches (/ step)",
            "mix launches (/ step)",
        ],
        rows,
        "python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball.json",
        [
            "Seconds and kernel launches per Auto-PGD iteration against a training step without "
            "the optimizer (forward and backward), 3 interleaved repeats. 'kept best gradient': "
            "the engine that keeps Auto-PGD's best gradient on these models (no pass per "
            "restart), runs of 5 and 10 iterations, seconds and launches by difference of the "
            "two, on the engine of the commit named where the unit records it; 'earlier run': "
            "a unit measured again later, its first run. The other rows: runs of 4 and 8 "
            "iterations, seconds by difference, launches of "
            "the run of 4 over 4 (the call's fixed work included), the best gradient recomputed "
            "at every restart. 'batched geometry': the engine with the quotient geometry as "
            "batched products, one run per model (--models bert-base or vit-b32, --dtypes "
            "float32,bfloat16, into flat_ball_bert.json and flat_ball_vit.json). 'flat ball' and "
            "'before': the same script on the engine before the batched geometry and before the "
            "flat ball, in the same call on the same GPU; that call reached its time limit: rows "
            "it did not reach say so."
        ],
    )


KEPT_GRADIENT_FILES = ("gpu/flat_ball_kept_bert.json", "gpu/flat_ball_kept_vit.json")


def gpu_iteration_counts(results: Results) -> Table:
    units, devices = {}, {}
    for path in KEPT_GRADIENT_FILES:
        doc = results.json(path).data
        for key, unit in (dig(doc, "units") or {}).items():
            units[key], devices[key] = unit, dig(doc, "device")
    rows = []
    for model, model_label in MODELS.items():
        for precision, precision_label in PRECISIONS.items():
            unit = units.get(f"{model} {precision}")
            state = unit_state(unit)
            device = devices.get(f"{model} {precision}")
            where = f" ({device})" if device else ""
            for measure in ("step", "adaptive", "inv", "mix"):
                label = f"{model_label}, {precision_label}{where}: {measure}"
                if state:
                    rows.append([label, *[state] * 6])
                    continue
                counts = unit["counts_per_iteration"][measure]
                step = unit["counts_per_iteration"]["step"]
                kernels = counts.get("top_kernels") or {}
                top = "; ".join(f"{n:.0f} {kernel_name(k)}" for k, n in list(kernels.items())[:3])
                rows.append(
                    [
                        label,
                        fmt(counts.get("forward_passes", 1.0), ".2f"),
                        fmt(counts.get("backward_passes", 1.0), ".2f"),
                        f"{fmt(counts['operators'], '.0f')} "
                        f"({fmt(counts['operators'] / step['operators'], '.2f')})",
                        f"{fmt(counts.get('launches'), '.0f')} ({fmt(ratio(counts, step), '.2f')})",
                        fmt(counts.get("fixed_launches"), ".0f"),
                        top or NOT_MEASURED,
                    ]
                )
    return Table(
        [
            "model, precision: run",
            "forward passes",
            "backward passes",
            "operators (/ step)",
            "launches (/ step)",
            "fixed launches per call",
            "most launched kernels per iteration",
        ],
        rows,
        "python benchmarks/bench_flat_ball_gpu.py benchmarks/results/gpu/flat_ball_kept_bert.json "
        "--models bert-base --dtypes float32,bfloat16",
        [
            "Per Auto-PGD iteration (a training step's pass for 'step'): the counts of a run "
            "of 10 iterations minus those of 5, over 5. Operators: ATen operators dispatched "
            "(a TorchDispatchMode counter); launches: CUDA kernel launches under "
            "torch.profiler; fixed launches: those of one call that do not grow with the "
            "iterations (clean loss, base-point geometry, the path gap's exact geodesic, "
            "the last forward pass)."
        ],
    )


def kernel_name(name: str) -> str:
    """A CUDA kernel's name without its template arguments, with the functor it applies."""
    name = name.removeprefix("void ").split("(")[0].strip()
    base = name.split("<")[0].split("::")[-1]
    functor = re.search(r"(CUDAFunctor_\w+|\w+_functor|\w+Functor\w*)", name)
    return f"{base} ({functor.group(1)})" if functor and base != functor.group(1) else base[:48]


def ratio(counts: Dict[str, Any], step: Dict[str, Any]) -> Optional[float]:
    if counts.get("launches") is None or not step.get("launches"):
        return None
    return counts["launches"] / step["launches"]


def cpu_compiled_update(results: Results) -> Table:
    doc = results.json("cpu/compiled_update.json").data
    models = dig(doc, "models") or {}
    rows = []
    steps = [
        "eager gram",
        "compiled gram",
        "eager combination + perturbed point",
        "compiled combination + perturbed point",
        "copy",
    ]
    for model in models or {"bert-base": None}:
        seconds = dig(models, model, "seconds") or {}
        ms = [fmt(seconds[s] * 1e3 if s in seconds else None, ".1f", " ms") for s in steps]
        rows.append([model, *ms])
    return Table(
        ["model", *steps],
        rows,
        "python benchmarks/bench_compiled_update.py --model bert-base "
        "--json benchmarks/results/cpu/compiled_update.json",
        [
            "The element-wise update of an adaptive Auto-PGD iteration, eager PyTorch against "
            "``torch.compile`` kernels."
        ],
    )


def cpu_small_kernels(results: Results) -> Table:
    doc = results.json("cpu/small_kernels.json").data
    geometry = dig(doc, "models", "geometry") or {}
    ops = ["retraction", "pullback", "riemannian_gradient", "gram_3x3"]
    rows = [[group, *(fmt(v.get(o), ".0f", " µs") for o in ops)] for group, v in geometry.items()]
    if not rows:
        rows = [["tiny ViT's GL(h) groups", *[NOT_MEASURED] * 4]]
    return Table(
        ["group (shape)", *ops],
        rows,
        "python benchmarks/bench_small_kernels.py --json benchmarks/results/cpu/small_kernels.json",
        [
            "One call of each fused GL(h) operation of an Auto-PGD evaluation at the tiny "
            "ViT's base point, per group and stacked."
        ],
    )


def cpu_geodesic(results: Results) -> Table:
    doc = results.json("cpu/geodesic.json").data
    rows = [
        [
            name,
            f"{row['points']} x ({row['rows']} + {row['rows']}) x {row['h']}",
            fmt(dig(row, "seconds", "reference"), ".3g", " s"),
            fmt(dig(row, "seconds", "span"), ".3g", " s"),
            fmt(row.get("speedup"), ".1f", "x"),
            fmt(row.get("max_difference_relative_to_step"), ".1e"),
        ]
        for name, row in (dig(doc, "shapes") or {}).items()
    ]
    if not rows:
        rows = [["11M BERT", NOT_MEASURED, *[NOT_MEASURED] * 4]]
    return Table(
        ["groups, metric", "points x rows x h", "reference", "span", "speed-up", "difference"],
        rows,
        "python benchmarks/bench_geodesic.py --json benchmarks/results/cpu/geodesic.json",
        [
            "The float64 exponential map of a sharpness ball's GL(h) groups (16 RK4 steps, "
            "the path gap's), the reference's integration on the point against the same "
            "integration in the span of the geodesic's start; the difference of the end "
            "points relative to the step's size."
        ],
    )


def _before_after(row: Dict, key: str, spec: str, suffix: str = "", scale: float = 1.0) -> str:
    """``key`` (dotted) of a row's ``baseline`` and ``this`` runs, as ``before / after``."""
    values = [dig(row, label, *key.split(".")) for label in ("baseline", "this")]
    return " / ".join(fmt(None if v is None else v * scale, spec, suffix) for v in values)


def cpu_gl_iteration(results: Results) -> Table:
    doc = results.json("cpu/gl_iteration.json").data
    stack = dig(doc, "settings", "stack") or {}
    rows = []
    for name, row in (dig(doc, "models") or {}).items():
        metric, mode = name.split("-", 1)
        rows.append(
            [
                f"{metric}, {'sliced (CPU)' if mode == 'sliced' else 'whole batch'}",
                _before_after(row, "seconds", ".0f", " ms", 1e3),
                fmt(row.get("ratio"), ".2f", "x"),
                _before_after(row, "minor_page_faults", ".0f"),
                _before_after(row, "allocations_column.count", ".0f"),
            ]
        )
    if not rows:
        rows = [["inv", *[NOT_MEASURED] * 4]]
    shape = f"{stack.get('points')} points of 2 x {stack.get('rows')} x {stack.get('rank')}"
    return Table(
        ["metric, slices", "time before / after", "ratio", "faults", "allocations"],
        rows,
        "python benchmarks/bench_gl_iteration.py --baseline CHECKOUT_BEFORE --repeats 8 "
        "--json benchmarks/results/cpu/gl_iteration.json",
        [
            f"The GL(h) geometry of one Auto-PGD iteration on a stack of BERT-base's size "
            f"({shape}, float32, 1 thread): retraction, pullback, Riemannian gradient with "
            "its Gram entries, combination; process time and minor page faults per "
            "iteration (medians), and the tensors shaped like slices of the vectors that an "
            "iteration with derived Gram entries allocates, before / after the kernels "
            "wrote into a workspace, both in one process, interleaved."
        ],
    )


ITERATION_MODELS = {"tiny-vit": "tiny ViT", "bert-11m": "11M BERT", "bert-base": "BERT-base"}


def cpu_iteration_flops(results: Results) -> Table:
    doc = results.json("cpu/iteration_flops.json").data
    rows = []
    for name, row in (dig(doc, "models") or {}).items():
        shape = " x ".join(str(n) for n in row.get("batch_shape", [])[:2])
        for measure in ("adaptive", "inv", "mix"):
            cell = row.get(measure) or {}
            floors = cell.get("floor_at_batch") or {}
            rows.append(
                [
                    f"{ITERATION_MODELS.get(name, name)} ({shape})",
                    measure,
                    fmt(row.get("plain_gflop"), ".3g"),
                    fmt(cell.get("marginal_gflop"), ".3g"),
                    fmt(cell.get("marginal_ratio"), ".3f"),
                    fmt(cell.get("geometry_gflop"), ".3g"),
                    " / ".join(fmt(v, ".2f") for v in floors.values()) or NOT_MEASURED,
                    fmt(dig(cell, "path_gap_gflop", -1), ".3g"),
                ]
            )
    if not rows:
        rows = [["BERT-base", "inv", *[NOT_MEASURED] * 6]]
    return Table(
        [
            "model (batch)",
            "measure",
            "pass GFLOP",
            "one more iteration GFLOP",
            "ratio",
            "geometry GFLOP",
            "ratio at 1 / 2 / 4 / 8 / 16 x the batch",
            "path gap GFLOP",
        ],
        rows,
        "python benchmarks/bench_iteration_flops.py "
        "--json benchmarks/results/cpu/iteration_flops.json",
        [
            "Floating-point operations of the matrix products (torch.utils.flop_counter: "
            "products, batched products, attention; element-wise work not counted) of a "
            "forward and backward pass and of one more Auto-PGD iteration (runs of 8 and 4 "
            "iterations, by difference); geometry: the iteration's less its passes, the "
            "quotient groups' batched products, which do not grow with the batch. The "
            "ratio at larger batches follows from the passes' products growing with the "
            "examples. The path gap's report per batch, counted apart. "
            "Counts, not times: they do not depend on the machine or its load."
        ],
    )


def _milliseconds(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1e3, ".0f", " ms")


def cpu_gl_slices(results: Results) -> Table:
    doc = results.json("cpu/gl_slices.json").data
    stack = dig(doc, "settings", "stack") or {}
    rows = []
    for name, row in (dig(doc, "models") or {}).items():
        for size, ratio in (row.get("ratio_to_default") or {}).items():
            rows.append(
                [
                    name.split("-", 1)[0],
                    size,
                    _milliseconds(dig(row, size, "seconds")),
                    fmt(ratio, ".3f", "x"),
                ]
            )
    if not rows:
        rows = [["inv", *[NOT_MEASURED] * 3]]
    shape = f"{stack.get('points')} points of 2 x {stack.get('rows')} x {stack.get('rank')}"
    return Table(
        ["metric", "slice", "time", "ratio to the default"],
        rows,
        "python benchmarks/bench_gl_iteration.py --slices 512,1024,2048,4096,8192 "
        "--repeats 12 --json benchmarks/results/cpu/gl_slices.json",
        [
            f"The GL(h) geometry of one Auto-PGD iteration on a stack of BERT-base's size "
            f"({shape}, float32, 1 thread) with the CPU's slices of each size (the bytes "
            "of one vector's slice, CHUNK_BYTES; the default 2 MiB): process time per "
            "iteration (medians, the sizes interleaved in one process). Every size gives "
            "the same perturbed point and gradient, bit for bit."
        ],
    )


def cpu_verification(results: Results) -> Table:
    doc = results.json("cpu/verification.json").data
    labels = {"tiny-llama": "tiny Llama", "smollm2-135m-shape": "SmolLM2-135M shape"}
    rows = []
    for model, label in labels.items():
        r = dig(doc, "models", model) or {}
        med = r.get("median_seconds") or {}
        rows.append(
            [
                label,
                fmt(r.get("parameters") and r["parameters"] / 1e6, ".1f", "M"),
                fmt(r.get("forward_passes_of_default_discovery"), "d"),
                fmt(med.get("structure"), ".3f", " s"),
                fmt(med.get("proven"), ".3f", " s"),
                fmt(med.get("call"), ".2f", " s"),
                fmt(r.get("proven_over_call"), ".3f"),
                fmt(r.get("proof_over_call"), ".3f"),
            ]
        )
    return Table(
        [
            "model",
            "parameters",
            "forward passes",
            "by structure",
            "proven (default)",
            "default call",
            "proven / call",
            "proof / call",
        ],
        rows,
        "python benchmarks/bench_verification.py --json benchmarks/results/cpu/verification.json",
        [
            "find_symmetries by structure alone (verify=False) and proven (the default), on "
            "a fresh copy of the model each time, against a default geodesic_sharpness call "
            "(20 iterations) on one batch of 4 x 64 tokens with the plan given; process time, "
            "1 thread, medians of interleaved rounds. By structure, the V/O pairs are "
            "replayed on their modules; proven, only where the proof fails.",
        ],
    )


def cpu_discovery(results: Results) -> Table:
    doc = results.json("cpu/discovery.json").data
    labels = {
        "llama-7b": "Llama-7B shape",
        "mistral-7b": "Mistral-7B shape (GQA, 8 KV heads)",
        "vit-b32": "ViT-B/32",
        "bert-base": "BERT-base",
    }
    rows = []
    for model, label in labels.items():
        for kinds in ("default", "all"):
            r = dig(doc, "models", model, kinds)
            side = dig(r, "side_by_side") or {}
            layers = dig(doc, "models", model, "layers")
            rows.append(
                [
                    label,
                    kinds,
                    fmt(layers, "d"),
                    fmt(dig(r, "structured_s"), ".3f", " s"),
                    fmt(dig(r, "boxes"), ",d"),
                    fmt(dig(r, "index_map_bytes") and r["index_map_bytes"] / 2**30, ".2f", " GiB"),
                    fmt(side.get("layers"), "d"),
                    fmt(side.get("index_map_s"), ".2f", " s"),
                    fmt(side.get("structured_s"), ".3f", " s"),
                    fmt(side.get("speedup"), ".0f", "x"),
                ]
            )
    return Table(
        [
            "model (meta)",
            "kinds",
            "layers",
            "find + bind",
            "boxes",
            "index map would hold",
            "side by side: layers",
            "index map",
            "structured",
            "speed-up",
        ],
        rows,
        "python benchmarks/bench_discovery.py --json benchmarks/results/cpu/discovery.json",
        [
            "find_symmetries + bind on models built on the meta device, 1 thread, medians. "
            "The index map (one int32 per covered entry, as before structured layouts) is "
            "timed side by side with the structured groups on the whole model, or on a "
            "slice of the 7B shapes' layers."
        ],
    )


def transformers_seeds(results: Results) -> Table:
    source = results.json("reproductions/transformers_seeds.json")
    runs = dig(source.data, "runs") or []
    measures = ("adaptive", "geodesic_inv", "geodesic_mix")

    def cell(run: Dict, measure: str) -> str:
        tau = dig(run, "tau", measure)
        if not isinstance(tau, dict):
            return NOT_MEASURED
        return f"{tau['tau']:+.3f} [{tau['ci_low']:+.2f}, {tau['ci_high']:+.2f}]"

    rows = [[str(run["population_seed"]), *(cell(run, m) for m in measures)] for run in runs]
    if not rows:
        rows = [["-", *[NOT_MEASURED] * 3]]
    else:
        spread = []
        for measure in measures:
            taus = [dig(run, "tau", measure, "tau") for run in runs]
            spread.append(f"{statistics.median(taus):+.3f} [{min(taus):+.2f}, {max(taus):+.2f}]")
        rows.append(["median [min, max] over seeds", *spread])
    return Table(
        ["population seed", "adaptive", "geodesic inv", "geodesic mix"],
        rows,
        "geoopt-quotient reproduce transformers --population-seed S --threads 1 (one run "
        "per seed; their taus gathered in reproductions/transformers_seeds.json)",
        [
            "Kendall's tau between sharpness and generalization gap over the 48 models of each "
            "population, with its 95% bootstrap interval over models. A seed draws the data "
            "split, the hyper-parameters and the training; the protocol and the radii are the "
            "same in every run."
        ],
    )


def _tau_cell(taus: List[float]) -> str:
    if not taus:
        return NOT_MEASURED
    if len(taus) == 1:
        return f"{taus[0]:+.2f}"
    return f"{statistics.median(taus):+.2f} [{min(taus):+.2f}, {max(taus):+.2f}]"


def _diagonal_runs(results: Results) -> Tuple[Source, Dict[str, List[Dict]]]:
    source = results.json("reproductions/diagonal_readings.json")
    by_setup: Dict[str, List[Dict]] = {}
    for run in dig(source.data, "runs") or []:
        by_setup.setdefault(run["setup"], []).append(run)
    return source, by_setup


DIAGONAL_COMMAND = (
    "python benchmarks/diagonal_readings.py --seeds 0,1,2 "
    "--json benchmarks/results/reproductions/diagonal_readings.json"
)


def diagonal_readings(results: Results) -> Table:
    source, by_setup = _diagonal_runs(results)
    readings = dig(source.data, "readings") or {}
    paper = dig(source.data, "paper_tau") or {}
    setups = ("phase-transition", "step-size")
    rows = []
    for name, description in readings.items():
        measure = name.split("_")[0]
        cells = [_tau_cell([r["tau"][name] for r in by_setup.get(s, [])]) for s in setups]
        reference = paper.get(measure)
        rows.append([description, *cells, "—" if reference is None else f"{reference:+.2f}"])
    if not rows:
        rows = [["-", NOT_MEASURED, NOT_MEASURED, "-"]]
    seeds = sorted({r["seed"] for runs in by_setup.values() for r in runs})
    return Table(
        ["reading of 'sharpness at radius rho'", *setups, "paper"],
        rows,
        DIAGONAL_COMMAND,
        [
            f"Kendall's tau with the test loss over the 50 models of each population, median "
            f"[min, max] over population seeds {', '.join(map(str, seeds)) or '-'}; "
            "rho = 0.1 for every ball (the norm of beta* is 1), 100 Auto-PGD iterations."
        ],
    )


def diagonal_checks(results: Results) -> Table:
    _, by_setup = _diagonal_runs(results)

    def span(runs: List[Dict], key: str, spec: str = ".3g") -> str:
        values = [dig(r, "checks", key) for r in runs]
        values = [v for v in values if isinstance(v, (int, float))]
        if not values:
            return NOT_MEASURED
        return f"{min(values):{spec}} to {max(values):{spec}}"

    def pair_span(runs: List[Dict], low: str, high: str, spec: str = ".3g") -> str:
        lows = [dig(r, "checks", low) for r in runs]
        highs = [dig(r, "checks", high) for r in runs]
        if not lows or None in lows or None in highs:
            return NOT_MEASURED
        return f"{min(lows):{spec}} to {max(highs):{spec}}"

    def second_order_range(runs: List[Dict]) -> str:
        ranges = [dig(r, "checks", "second_order_range") for r in runs]
        if not ranges or None in ranges:
            return NOT_MEASURED
        return f"{min(a for a, _ in ranges):.2g} to {max(b for _, b in ranges):.2g}"

    rows = []
    for setup, runs in by_setup.items():
        rows.append(
            [
                setup,
                span(runs, "euclidean_exact_relative_spread", ".2g"),
                pair_span(
                    runs, "apgd_over_exact_euclidean_min", "apgd_over_exact_euclidean_max", ".4f"
                ),
                second_order_range(runs),
                pair_span(
                    runs,
                    "second_order_apgd_over_one_coordinate_min",
                    "second_order_apgd_over_one_coordinate_max",
                    ".2g",
                ),
                span(runs, "tau_second_order_vs_one_coordinate", "+.2f"),
                span(runs, "tau_inverse_min_abs_beta_vs_test_loss", "+.2f"),
                span(runs, "tau_beta_norm_vs_test_loss", "+.2f"),
            ]
        )
    if not rows:
        rows = [["-", *[NOT_MEASURED] * 7]]
    return Table(
        [
            "setup",
            "Euclidean ball: (max - min) / median over models",
            "Auto-PGD / exact, Euclidean ball",
            "second-order worst case",
            "second-order Auto-PGD / one-coordinate value",
            "tau(second order, one-coordinate value)",
            "tau(1 / min |beta0_i|, test loss)",
            "tau(|beta0|, test loss)",
        ],
        rows,
        DIAGONAL_COMMAND,
        [
            "Ranges over the population seeds. The exact worst case over the Euclidean ball is "
            "mix_ball_worst_case; the one-coordinate value is mix_retraction_one_coordinate; "
            "inf: the loss overflows float64 inside the ball (one model)."
        ],
    )


def default_radii(results: Results) -> Table:
    source = results.json("cpu/default_radii.json")
    models = dig(source.data, "models") or {}
    target = dig(source.data, "settings", "target")
    labels = {"bert": "tiny BERT", "vit": "tiny ViT", "llama": "tiny Llama"}
    rows = []
    for name, model in models.items():
        calibrated = dig(model, "calibrated", "radii") or {}
        for key, row in model["at_default_radius"].items():
            measure, path = key.split("/")
            rows.append(
                [
                    labels.get(name, name),
                    measure,
                    path.replace("_", "-"),
                    fmt(row["rho"], "g"),
                    fmt(row["fraction"], ".3g"),
                    fmt(calibrated.get(measure), ".3g") if path != "exact" else "",
                ]
            )
        if dig(model, "calibrated", "error"):
            rows.append([labels.get(name, name), "all", "", "", "", "calibration failed"])
    if not rows:
        rows = [["-", "-", "-", "-", NOT_MEASURED, NOT_MEASURED]]
    return Table(
        [
            "model",
            "measure",
            "path",
            "default radius",
            "worst-case sharpness / clean loss",
            f"radius for {target if target is not None else '-'} x clean loss",
        ],
        rows,
        "python benchmarks/default_radii.py --json benchmarks/results/cpu/default_radii.json",
        [
            "Random float64 models built from Hugging Face configs (2 layers, width 32), "
            "random batches, 20 Auto-PGD iterations; the last column is calibrate_radii with "
            "the second-order path."
        ],
    )


def path_gap(results: Results) -> Table:
    source = results.json("cpu/path_gap.json")
    models = dig(source.data, "models") or {}
    rows = []
    for name, model in models.items():
        if "skipped" in model:
            rows.append([name, "-", "-", "-", "-", "-", model["skipped"]])
            continue
        for metric in ("inv", "mix"):
            entry = model.get(metric) or {}
            for row in entry.get("rows", []):
                failed = row.get("geodesic_failed_batches") or 0
                rows.append(
                    [
                        name,
                        metric,
                        fmt(row["rho"], "g"),
                        fmt(row["sharpness"], ".3g"),
                        fmt(row["path_gap_mean"], ".2g")
                        if row["path_gap_mean"] is not None
                        else "geodesic failed",
                        fmt(row["loss_gap_ratio"], ".2g")
                        if not failed
                        else f"geodesic failed on {failed} batch(es)",
                        "yes" if row["warned"] else "no",
                    ]
                )
    if not rows:
        rows = [["-", "-", "-", NOT_MEASURED, NOT_MEASURED, NOT_MEASURED, "-"]]
    return Table(
        [
            "model",
            "metric",
            "radius",
            "sharpness",
            "relative path gap",
            "mean |L(Exp) - L(R)| / sharpness",
            "PathGapWarning",
        ],
        rows,
        "python benchmarks/path_gap.py --json benchmarks/results/cpu/path_gap.json",
        [
            "Worst case, second-order path, 10 Auto-PGD iterations (3 on all-MiniLM-L6-v2), "
            "2 batches; the path gap is the mean over batches of ‖R − Exp‖ / ‖ξ‖ in the "
            "metric at the maximiser. The warning fires above 0.1 in the last numeric column."
        ],
    )


ROTARY_SOURCE = "reproductions/rotary.json"
ROTARY_COMMAND = (
    "geoopt-quotient reproduce rotary --threads 1 --out rotary-out "
    "(its rotary.json, the per-batch lists and plan tables dropped, copied to "
    "benchmarks/results/reproductions/rotary.json)"
)
ROTARY_LABELS = {
    "train_loss": "training loss (control)",
    "adaptive": "adaptive",
    "geodesic_inv": "geodesic inv",
    "geodesic_mix": "geodesic mix",
    "geodesic_inv_all": "geodesic inv, kinds=all",
}


def _interval(row: Dict, prefix: str = "") -> str:
    tau = row.get(f"{prefix}tau")
    if tau is None or (isinstance(tau, float) and not math.isfinite(tau)):
        return "-"
    low, high = row.get(f"{prefix}ci_low"), row.get(f"{prefix}ci_high")
    if low is None or not math.isfinite(low):
        return f"{tau:+.3f}"
    return f"{tau:+.3f} [{low:+.2f}, {high:+.2f}]"


def _rotary_tau(results: Results, target: str) -> Table:
    source = results.json(ROTARY_SOURCE)
    rows = []
    for result in (dig(source.data, "thresholds") or {}).values():
        for row in result.get("tau", []):
            if row["target"] != target:
                continue
            quantity = "S" if row["quantity"] == "value" else "S / L(w)"
            if row["measure"] == "train_loss":
                quantity = "L(w)"
            rows.append(
                [
                    f"{result['threshold']:g} ({row['models']})",
                    ROTARY_LABELS.get(row["measure"], row["measure"]),
                    quantity,
                    _interval(row),
                    fmt(row.get("p_value"), ".2g"),
                    _interval(row, "partial_"),
                ]
            )
    if not rows:
        rows = [["-", "-", "-", NOT_MEASURED, NOT_MEASURED, NOT_MEASURED]]
    what = "test - train error" if target == "gap" else "test - train loss"
    return Table(
        ["training loss (models)", "measure", "quantity", "tau [95% CI]", "p", "partial tau"],
        rows,
        ROTARY_COMMAND,
        [
            f"Kendall's tau against the generalization gap ({what}) over the models saved "
            "when their training loss first reached the threshold, with a percentile "
            "bootstrap interval over models (2000 resamples); partial tau given the "
            "training loss, with its own interval. S: sharpness; S / L(w): sharpness over "
            "the clean loss on the sharpness examples."
        ],
    )


def rotary_tau(results: Results) -> Table:
    return _rotary_tau(results, "gap")


def rotary_tau_loss(results: Results) -> Table:
    return _rotary_tau(results, "loss_gap")


def rotary_population(results: Results) -> Table:
    source = results.json(ROTARY_SOURCE)
    models = dig(source.data, "models") or []
    rows = []
    for result in (dig(source.data, "thresholds") or {}).values():
        mine = [m for m in models if m["threshold"] == result["threshold"]]
        accuracy = sorted(m["test_accuracy"] for m in mine)
        radii = dig(result, "calibration", "radii") or {}
        rows.append(
            [
                f"{result['threshold']:g}",
                str(len(mine)),
                f"{accuracy[0]:.3f} / {statistics.median(accuracy):.3f} / {accuracy[-1]:.3f}",
                ", ".join(f"{ROTARY_LABELS.get(k, k)} {v:.3g}" for k, v in radii.items()),
                ", ".join(result.get("reference_models", [])),
            ]
        )
    if not rows:
        rows = [["-", "-", NOT_MEASURED, NOT_MEASURED, "-"]]
    target = dig(source.data, "settings", "target")
    return Table(
        ["training loss", "models", "test accuracy min / median / max", "radii", "calibrated on"],
        rows,
        ROTARY_COMMAND,
        [
            "Radii: per measure, the median over the reference models of the radius at which "
            f"worst-case sharpness is {target if target is not None else '-'} x the clean loss "
            "(calibrate_rho); the reference models sit at quantiles of test accuracy."
        ],
    )


def _mean_shares(models: List[Dict], measure: str) -> Dict[Tuple[str, str], float]:
    parts: Dict[Tuple[str, str], List[float]] = {}
    for m in models:
        for share in m["measures"][measure].get("shares", []):
            parts.setdefault((share["block"], share["kind"]), []).append(share["norm_share"])
    return {key: statistics.mean(values) for key, values in parts.items()}


def rotary_shares(results: Results) -> Table:
    source = results.json(ROTARY_SOURCE)
    models = dig(source.data, "models") or []
    rows = []
    for result in (dig(source.data, "thresholds") or {}).values():
        mine = [m for m in models if m["threshold"] == result["threshold"]]
        taus = {
            (r["measure"], r["block"], r["kind"], r["share"]): r
            for r in result.get("share_tau", [])
        }
        for measure in dig(source.data, "measures") or []:
            for (block, kind), mean in _mean_shares(mine, measure).items():
                tau = taus.get((measure, block, kind, "norm_share"))
                rows.append(
                    [
                        f"{result['threshold']:g}",
                        ROTARY_LABELS.get(measure, measure),
                        f"{block} {kind}",
                        fmt(mean, ".3f"),
                        _interval(tau) if tau else "-",
                    ]
                )
    if not rows:
        rows = [["-", "-", "-", NOT_MEASURED, NOT_MEASURED]]
    return Table(
        ["training loss", "measure", "block, kind", "mean share of |xi*|^2", "tau vs gap"],
        rows,
        ROTARY_COMMAND,
        [
            "Each block's share of the maximiser's squared norm in the measure's metric "
            "(SharpnessResult.shares, mean over batches and models), and Kendall's tau of "
            "that share against the error gap over the models ('-': the share is the same "
            "for every model)."
        ],
    )


def real_radii(results: Results) -> Table:
    source = results.json("cpu/real_radii.json")
    models = dig(source.data, "models") or {}
    proposed = dig(source.data, "proposed_defaults") or {}
    current = dig(source.data, "settings", "current_defaults") or {}
    labels = {"smollm2": "SmolLM2-135M-Instruct", "minilm": "all-MiniLM-L6-v2", "vit": "tiny ViT"}
    rows = []
    for name, model in models.items():
        for measure in ("adaptive", "inv", "mix"):
            old = dig(model, "at_current_defaults", measure) or {}
            new = dig(model, "at_proposed_defaults", measure) or {}
            rows.append(
                [
                    labels.get(name, name),
                    measure,
                    fmt(dig(model, "calibrated", measure), ".3g"),
                    f"{fmt(current.get(measure), 'g')}: {fmt(old.get('fraction'), '.3g')}",
                    f"{fmt(proposed.get(measure), 'g')}: {fmt(new.get('fraction'), '.3g')}",
                ]
            )
    for name, reason in (dig(source.data, "skipped") or {}).items():
        rows.append([labels.get(name, name), "-", "skipped", reason, "-"])
    if not rows:
        rows = [["-", "-", NOT_MEASURED, NOT_MEASURED, NOT_MEASURED]]
    target = dig(source.data, "settings", "target")
    return Table(
        [
            "model",
            "measure",
            f"radius for {target if target is not None else '-'} x clean loss",
            "earlier default: sharpness / clean loss",
            "default: sharpness / clean loss",
        ],
        rows,
        "python benchmarks/real_radii.py --json benchmarks/results/cpu/real_radii.json",
        [
            "Worst-case sharpness (second-order path, 5 Auto-PGD iterations) over the mean "
            "clean loss on real pretrained weights; the defaults are the geometric means of "
            "the calibrated radii over the models, rounded to one significant digit."
        ],
    )


#: Every table a page can ask for.
TABLES: Dict[str, Callable[[Results], Table]] = {
    "gpu-iteration": gpu_iteration,
    "gpu-memory": gpu_memory,
    "gpu-protocol": gpu_protocol,
    "gpu-host-syncs": gpu_host_syncs,
    "gpu-compile": gpu_compile,
    "gpu-profile": gpu_profile,
    "gpu-profile-flat-ball": gpu_profile_flat_ball,
    "gpu-flat-ball": gpu_flat_ball,
    "gpu-iteration-counts": gpu_iteration_counts,
    "geometry-projection": geometry_projection,
    "geometry-scaling": geometry_scaling,
    "precision": precision,
    "sam-step-cost": sam_step_cost,
    "sam-digits": sam_digits,
    "sam-calibration": sam_calibration,
    "cpu-iteration-overhead": cpu_iteration_overhead,
    "cpu-sharpness-iteration": cpu_sharpness_iteration,
    "cpu-path-gap-cost": cpu_path_gap_cost,
    "cpu-path-gap-operators": cpu_path_gap_operators,
    "cpu-memory": cpu_memory,
    "cpu-ball-memory": cpu_ball_memory,
    "cpu-iteration-bytes": cpu_iteration_bytes,
    "cpu-sharded-ball-memory": cpu_sharded_ball_memory,
    "cpu-compiled-update": cpu_compiled_update,
    "cpu-small-kernels": cpu_small_kernels,
    "cpu-geodesic": cpu_geodesic,
    "cpu-gl-iteration": cpu_gl_iteration,
    "cpu-iteration-flops": cpu_iteration_flops,
    "cpu-gl-slices": cpu_gl_slices,
    "cpu-discovery": cpu_discovery,
    "cpu-verification": cpu_verification,
    "transformers-seeds": transformers_seeds,
    "diagonal-readings": diagonal_readings,
    "diagonal-checks": diagonal_checks,
    "default-radii": default_radii,
    "real-radii": real_radii,
    "rotary-tau": rotary_tau,
    "rotary-tau-loss": rotary_tau_loss,
    "rotary-population": rotary_population,
    "rotary-shares": rotary_shares,
    "path-gap": path_gap,
}


# ------------------------------------------------------------------------------ docutils


def table_node(header: Sequence[str], rows: Iterable[Sequence[str]]) -> nodes.table:
    table = nodes.table(classes=["benchmark-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)

    def row(cells: Sequence[str]) -> nodes.row:
        out = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=str(cell))
            out += entry
        return out

    head = nodes.thead()
    head += row(header)
    body = nodes.tbody()
    body.extend(row(r) for r in rows)
    group += head
    group += body
    return table


class BenchmarkTableDirective(SphinxDirective):
    """``.. benchmark-table:: NAME`` (one of :data:`TABLES`)."""

    required_arguments = 1
    has_content = False

    def run(self) -> List[nodes.Node]:
        name = self.arguments[0]
        if name not in TABLES:
            raise self.error(f"unknown benchmark table {name!r}; known: {', '.join(TABLES)}")
        root = Path(self.config.benchmark_results_dir)
        results = Results(root)
        table = TABLES[name](results)
        out: List[nodes.Node] = [table_node(table.header, table.rows)]
        for note in table.notes:
            out.extend(self.parse_text_to_nodes(note))
        sources = nodes.bullet_list(classes=["benchmark-sources"])
        for source in {s.path: s for s in results.asked}.values():
            self.env.note_dependency(str(root / source.path))
            item = nodes.list_item()
            para = nodes.paragraph()
            para += nodes.literal(text=f"benchmarks/results/{source.path}")
            if source.exists:
                para += nodes.Text(f": {environment(source)}")
            else:
                para += nodes.Text(f": no such file ({NOT_MEASURED})")
            item += para
            sources += item
        intro = nodes.paragraph(text="From:")
        command = nodes.paragraph()
        command += nodes.Text("Written by: ")
        command += nodes.literal(text=table.command)
        container = nodes.container(classes=["benchmark-provenance"])
        container.extend([intro, sources, command])
        out.append(container)
        return out


def setup(app):
    app.add_config_value("benchmark_results_dir", "", "env", [str])
    app.add_directive("benchmark-table", BenchmarkTableDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
