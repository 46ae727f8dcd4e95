"""The table of causal-LM families and their symmetries, generated from the zoo sweep.

``.. zoo-table::`` renders ``benchmarks/results/zoo/causal_lm_sweep.json`` (written by
``benchmarks/sweep_zoo.py``): one row per family, with the group found on its query/key
and value/output pairs (or a dash), the other groups (MLP units, experts), whether every
claimed group was exact, and, where attention is not (fully) quotiented, the plan's own
note that says why. Nothing is written by hand: a rerun of the sweep changes the table.

The file is the configuration value ``zoo_sweep_file``; :func:`table_lines` is the rst
source of the table (a ``list-table``), usable without Sphinx.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

from sphinx.util.docutils import SphinxDirective

DASH = "—"
#: Longest "why not" text in a cell, in characters (the full note is in the JSON).
REASON_CHARS = 220


def _groups(row: Dict[str, Any], kind: str) -> str:
    labels = sorted({g["label"] for g in row.get("groups", []) if g["kind"] == kind})
    return ", ".join(labels) or DASH


def _other(row: Dict[str, Any]) -> str:
    counts: Dict[str, int] = {}
    for g in row.get("groups", []):
        if g["kind"] not in ("query-key", "value-output"):
            counts[g["kind"]] = counts.get(g["kind"], 0) + 1
    return ", ".join(f"{k} ({n})" for k, n in sorted(counts.items())) or DASH


def _shorten(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= REASON_CHARS:
        return text
    return text[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."


#: (pattern of a plan's note, its one-line summary in the table; ``{0}`` is what the note
#: names before the pattern, e.g. the norms).
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


def _summary(note: str) -> str:
    for pattern, summary in SUMMARIES:
        match = re.search(pattern, note)
        if match:
            names = match.group(1) if match.groups() and "{0}" in summary else ""
            return summary.format(names.split(": ")[-1])
    return _shorten(note.split("): ", 1)[-1])


def why_not(row: Dict[str, Any]) -> str:
    """Why the attention of ``row`` is not (fully) quotiented, in one line: a summary of
    the first note of its plan about attention, or the reason it was not built."""
    if not row.get("built"):
        return "not built tiny: " + _shorten(row.get("reason", ""))
    kinds = {g["kind"] for g in row.get("groups", [])}
    if {"query-key", "value-output"} <= kinds:
        return ""
    keys = ("Q/K", "V/O", "attention-like", "clip_qkv", "attention output", "latent", "rotary")
    notes = row.get("notes", [])
    specific = [n for n in notes if any(k in n for k in keys)]
    general = [n for n in notes if n.startswith("attention not quotiented")]
    return _summary((specific or general or [""])[0])


def _cell(text: str) -> str:
    return text.replace("*", r"\*").replace("|", r"\|").replace("`", "'") or DASH


def table_lines(document: Dict[str, Any]) -> List[str]:
    """The rst ``list-table`` of a sweep document."""
    summary = document["summary"]
    lines = [
        f"{summary['attention_quotiented']} of {summary['built']} families built tiny "
        f"({summary['families']} in all) have attention quotiented; transformers "
        f"{document['transformers']}, torch {document['torch']}.",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 14 12 12 12 8 42",
        "",
        "   * - family",
        "     - Q/K",
        "     - V/O",
        "     - other groups",
        "     - exact",
        "     - why not",
    ]
    for row in document["families"]:
        exact = "yes" if row.get("exact") else ("no" if row.get("built") else DASH)
        cells = [
            row["family"],
            _groups(row, "query-key"),
            _groups(row, "value-output"),
            _other(row),
            exact,
            why_not(row),
        ]
        lines.append(f"   * - {_cell(cells[0])}")
        lines.extend(f"     - {_cell(c)}" for c in cells[1:])
    return lines


class ZooTable(SphinxDirective):
    """``.. zoo-table::``: the families of the sweep file (``zoo_sweep_file``)."""

    has_content = False

    def run(self):
        path = Path(self.config.zoo_sweep_file)
        self.env.note_dependency(str(path))
        if not path.is_file():
            lines = [f"*not measured: {path.name} does not exist (run benchmarks/sweep_zoo.py)*"]
        else:
            lines = table_lines(json.loads(path.read_text()))
        self.state_machine.insert_input(lines, str(path))
        return []


def setup(app):
    app.add_config_value("zoo_sweep_file", "", "env")
    app.add_directive("zoo-table", ZooTable)
    return {"version": "1", "parallel_read_safe": True}
