"""Figures derived from measured result files, written beside those files.

The documentation's tables (``.. results-table::``) only format what a result file holds.
Where a table shows a figure computed from several measured ones (a median over seeds, a
sum over operators) or a summary (the zoo sweep's one-line notes), this script computes
it from the file and writes it to ``NAME.derived.json`` beside the file ``NAME.json``
(with the machine and settings that file records); it measures nothing and changes no
measured file. Run it after a benchmark writes one of the files it knows::

    python benchmarks/derive_results.py [--results benchmarks/results] [--check]

``--check`` writes nothing and fails if a derived file is not what its measured file
gives (the test suite runs it). ``gpu/precision.txt`` (the rows that
``bench_precision.py`` printed) becomes ``gpu/precision.json``, in the layout of that
script's ``--json`` file, unless that script wrote the file itself.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List

RESULTS = Path(__file__).resolve().parent / "results"
PRECISION_LINE = re.compile(
    r"^\s+(?P<measure>\S+)\s+rho (?P<rho>\S+)\s+(?P<mode>\S+)\s+value (?P<value>\S+)"
    r"\s+rel\.err (?P<rel>\S+)"
)


def spread(values: List[float]) -> Dict[str, float]:
    """Median, least and greatest of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def iteration_bytes(doc: Dict) -> Dict:
    """Per call site of an adaptive iteration, its passes read and written together."""
    sites = []
    for model, row in doc.get("models", {}).items():
        for site in row["adaptive"]["bytes_by_site"]["sites"]:
            memory = site["memory_read"] + site["memory_written"]
            sites.append({"model": model, **site, "memory": memory})
    return {"sites": sites}


def path_gap_operators(doc: Dict) -> Dict:
    """Per model and metric, the counts measured and the matrices of QR and of
    ``cholesky_inverse`` factorisations among them."""
    rows = []
    for model, metrics in doc.get("models", {}).items():
        for metric, row in metrics.items():
            matrices = row.get("linalg_matrices", {})
            counted = {k: v for k, v in row.items() if k != "linalg_matrices"}
            sums = {
                f"{kind}_matrices": sum(n for name, n in matrices.items() if kind in name)
                for kind in ("qr", "cholesky_inverse")
            }
            rows.append({"model": model, "metric": metric, **counted, **sums})
    return {"rows": rows}


def transformers_seeds(doc: Dict) -> Dict:
    """Median, least and greatest tau over the population seeds, per measure."""
    runs = doc.get("runs", [])
    measures = runs[0]["tau"] if runs else {}
    return {"tau_over_seeds": {m: spread([r["tau"][m]["tau"] for r in runs]) for m in measures}}


def diagonal_readings(doc: Dict) -> Dict:
    """Per reading and setup, tau's spread over seeds; per setup, the checks' ranges."""
    by_setup: Dict[str, List[Dict]] = {}
    for run in doc.get("runs", []):
        by_setup.setdefault(run["setup"], []).append(run)
    paper = doc.get("paper_tau", {})
    readings = {
        name: {
            "description": description,
            "paper_tau": paper.get(name.split("_")[0]),
            **{setup: spread([r["tau"][name] for r in runs]) for setup, runs in by_setup.items()},
        }
        for name, description in doc.get("readings", {}).items()
    }
    checks = {}
    for setup, runs in by_setup.items():
        values: Dict[str, List[float]] = {}
        for run in runs:
            for key, value in run["checks"].items():
                if isinstance(value, list):
                    values.setdefault(f"{key}_low", []).append(value[0])
                    values.setdefault(f"{key}_high", []).append(value[1])
                elif isinstance(value, (int, float)):
                    values.setdefault(key, []).append(value)
        checks[setup] = {key: spread(v) for key, v in values.items()}
    seeds = sorted({run["seed"] for run in doc.get("runs", [])})
    return {"tau_over_seeds": readings, "checks_over_seeds": checks, "seeds": seeds}


def rotary(doc: Dict) -> Dict:
    """Per threshold: its models' test accuracy, and each block's mean share of the
    maximiser's squared norm per measure with the share's tau against the gap."""
    populations, shares = {}, []
    for name, result in doc.get("thresholds", {}).items():
        mine = [m for m in doc.get("models", []) if m["threshold"] == result["threshold"]]
        accuracy = spread([m["test_accuracy"] for m in mine])
        populations[name] = {
            "threshold": result["threshold"],
            "models": len(mine),
            "test_accuracy": accuracy,
            "radii": (result.get("calibration") or {}).get("radii", {}),
            "reference_models": result.get("reference_models", []),
        }
        taus = {(r["measure"], r["block"], r["kind"]): r for r in result.get("share_tau", [])}
        for measure in doc.get("measures", []):
            parts: Dict[tuple, List[float]] = {}
            for model in mine:
                for share in model["measures"][measure].get("shares", []):
                    parts.setdefault((share["block"], share["kind"]), []).append(
                        share["norm_share"]
                    )
            for (block, kind), values in parts.items():
                tau = taus.get((measure, block, kind), {})
                shares.append(
                    {
                        "threshold": result["threshold"],
                        "measure": measure,
                        "block": block,
                        "kind": kind,
                        "mean_share": statistics.mean(values),
                        **{k: tau.get(k) for k in ("tau", "ci_low", "ci_high")},
                    }
                )
    return {"populations": populations, "shares": shares}


def precision_from_text(text: str) -> Dict[str, Any]:
    """The rows ``bench_precision.py`` printed, in the layout of its ``--json`` file."""
    models: Dict[str, List[Dict]] = {}
    model = None
    for line in text.splitlines():
        if line.startswith("BERT-"):
            model = "bert-" + line[len("BERT-") :].strip()
        elif (match := PRECISION_LINE.match(line)) and model:
            models.setdefault(model, []).append(
                {
                    "measure": match["measure"],
                    "rho": float(match["rho"]),
                    "mode": match["mode"],
                    "value": float(match["value"]),
                    "rel_error": float(match["rel"]),
                }
            )
    return {"source": PRECISION_TEXT, "models": models}


def precision(doc: Dict) -> Dict:
    """Per model and precision, the relative error's spread over measures and radii."""
    return {
        "rel_error_range": {
            model: {
                mode: spread([r["rel_error"] for r in rows if r["mode"] == mode])
                for mode in dict.fromkeys(r["mode"] for r in rows)
            }
            for model, rows in doc.get("models", {}).items()
        }
    }


DASH = "—"
#: Longest "why not" text of a zoo family, in characters (the full note is in the sweep).
REASON_CHARS = 220
#: (pattern of a plan's note, its one-line summary; ``{0}`` is what the note names before
#: the pattern, e.g. the norms).
SUMMARIES = (
    (r"(\S.*?) normalise the queries and keys",
     "{0} normalise the queries and keys: only sign flips survive on Q/K (a finite group)"),
    (r"(\S.*?) act on the values or the attention output",
     "{0} act on the values or the attention output: V/O keeps diagonal scalings at most "
     "(not quotiented)"),
    (r"clamped elementwise .*\(clip_qkv\)",
     "q, k, v clamped (clip_qkv): only signed permutations survive (a finite group)"),
    (r"query projection also gates",
     "the query projection also gates the output: V/O keeps diagonal scalings at most"),
    (r"multi-head latent attention:",
     "latent attention: the rotary part (one key shared by all heads) is left adaptive"),
    (r"the model has no attention", "no attention (state-space, recurrent or convolutional)"),
    (r"q_proj has twice the rows o_proj reads",
     "q_proj packs an output gate with the queries: not recognised (V/O keeps diagonal "
     "scalings at most)"),
    (r"(do not match a known layout|match no known layout|the detector does not know|"
     r"do not fit|shapes do not fit)",
     "not recognised: declare its heads by hand (SymmetryGroup.from_layout)"),
)  # fmt: skip


def shorten(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= REASON_CHARS:
        return text
    return text[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."


def note_summary(note: str) -> str:
    """A plan's note about attention in one line (:data:`SUMMARIES`, else shortened)."""
    for pattern, summary in SUMMARIES:
        match = re.search(pattern, note)
        if match:
            names = match.group(1) if match.groups() and "{0}" in summary else ""
            return summary.format(names.split(": ")[-1])
    return shorten(note.split("): ", 1)[-1])


def why_not(row: Dict[str, Any]) -> str:
    """Why the attention of a zoo family is not (fully) quotiented, in one line: a summary
    of the first note of its plan about attention, or the reason it was not built."""
    if not row.get("built"):
        return "not built tiny: " + shorten(row.get("reason", ""))
    kinds = {g["kind"] for g in row.get("groups", [])}
    if {"query-key", "value-output"} <= kinds:
        return ""
    keys = ("Q/K", "V/O", "attention-like", "clip_qkv", "attention output", "latent", "rotary")
    notes = row.get("notes", [])
    specific = [n for n in notes if any(k in n for k in keys)]
    general = [n for n in notes if n.startswith("attention not quotiented")]
    return note_summary((specific or general or [""])[0])


def zoo_sweep(doc: Dict) -> Dict:
    """Per causal-LM family of the sweep: its attention groups, its other groups counted
    by kind, whether every claimed group was exact, and why attention is not quotiented."""
    families = []
    for row in doc.get("families", []):
        groups = row.get("groups", [])
        labels = {
            kind: ", ".join(sorted({g["label"] for g in groups if g["kind"] == kind})) or DASH
            for kind in ("query-key", "value-output")
        }
        other = Counter(g["kind"] for g in groups if g["kind"] not in labels)
        families.append(
            {
                "family": row["family"],
                **labels,
                "other": ", ".join(f"{k} ({n})" for k, n in sorted(other.items())) or DASH,
                "exact": "yes" if row.get("exact") else ("no" if row.get("built") else DASH),
                "why_not": why_not(row) or DASH,
            }
        )
    context = {k: doc.get(k) for k in ("transformers", "torch")}
    return {"summary": doc.get("summary", {}), **context, "families": families}


#: What a derived file copies of its measured file: the machine, software and settings.
CONTEXT = ("environment", "settings", "machine", "device", "gpu", "threads", "torch")

DERIVED: Dict[str, Callable[[Dict], Dict]] = {
    "cpu/iteration_bytes.json": iteration_bytes,
    "cpu/path_gap_operators.json": path_gap_operators,
    "reproductions/transformers_seeds.json": transformers_seeds,
    "reproductions/diagonal_readings.json": diagonal_readings,
    "reproductions/rotary.json": rotary,
    "gpu/precision.json": precision,
    "zoo/causal_lm_sweep.json": zoo_sweep,
}
#: The rows ``bench_precision.py`` printed, kept where no ``--json`` file was written.
PRECISION_TEXT = "gpu/precision.txt"


def indentation(text: str) -> int:
    """The indentation of a JSON file's second line (2 for a new file)."""
    lines = text.splitlines()
    return len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 2


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--check", action="store_true", help="write nothing; fail if stale")
    args = parser.parse_args(argv)
    stale = []
    outputs = {}
    text, converted = args.results / PRECISION_TEXT, args.results / "gpu/precision.json"
    if text.is_file() and (
        not converted.is_file() or json.loads(converted.read_text()).get("source") == PRECISION_TEXT
    ):
        outputs[converted] = precision_from_text(text.read_text())
    for path, derive in DERIVED.items():
        file = args.results / path
        doc = outputs.get(file) or (json.loads(file.read_text()) if file.is_file() else None)
        if doc is not None:
            context = {key: doc[key] for key in CONTEXT if key in doc}
            derived = {"derived_from": file.name, **context, "derived": derive(doc)}
            outputs[file.with_suffix(".derived.json")] = derived
    for file, doc in outputs.items():
        old = file.read_text() if file.is_file() else ""
        indent = indentation(old)
        new = json.dumps(doc, indent=indent) + "\n"
        old = json.dumps(json.loads(old), indent=indent) + "\n" if old else ""
        if old != new:
            stale.append(str(file.relative_to(args.results)))
            if not args.check:
                file.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python benchmarks/derive_results.py")
        return 1
    print(f"{'stale' if stale else 'up to date'}: {', '.join(stale) or 'every file'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
