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


def why_not(row: Dict[str, Any]) -> str:
    """Why the attention of ``row`` is not (fully) quotiented: the first note of its plan
    about attention, without the module paths, or the reason it was not built."""
    if not row.get("built"):
        return "not built tiny: " + _shorten(row.get("reason", ""))
    kinds = {g["kind"] for g in row.get("groups", [])}
    if {"query-key", "value-output"} <= kinds:
        return ""
    notes = row.get("notes", [])
    keys = ("Q/K", "V/O", "attention-like", "clip_qkv", "output projection", "rotary")
    specific = [n for n in notes if any(k in n for k in keys)]
    general = [n for n in notes if n.startswith("attention not quotiented")]
    chosen = (specific or general or [""])[0]
    message = chosen.split("): ", 1)[-1] if chosen.startswith(("model", "transformer")) else chosen
    return _shorten(message.split(": ", 1)[-1] if ": " in message[:60] else message)


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
