"""``.. results-table::``: a table rendered from result files, by a declarative spec.

The directive's arguments name result files (or glob patterns), relative to the
configuration value ``benchmark_results_dir``; its options say which part of each file
holds the rows, and its content gives one column per line, ``header | template``::

    .. results-table:: cpu/geodesic.json
       :rows: shapes.{shape}
       :command: python benchmarks/bench_geodesic.py --json benchmarks/results/cpu/geodesic.json

       groups, metric | {shape}
       reference      | {seconds[reference]:.3g} s
       speed-up       | {speedup:.1f}x

``:rows:`` is a dotted path into the file's JSON (or several, separated by spaces); a
segment ``{name}`` walks every entry of a mapping (or list) there, binding its key (or
index) to ``name``, and ``*`` walks them without a name. Each entry reached is a row: its
fields, the names bound on the way, ``_up`` (the mapping the entry sits in), ``_doc`` (the
whole file), ``_file`` (the file's name) and ``_rows`` (the path). ``:where: key=value,
key, ...`` keeps the rows whose fields equal the values, and have the fields named alone.
In a template, ``{a[b]}`` and ``{a.b}`` read key ``b`` of ``a``, ``{a[$name]}`` the key
bound to ``name`` (``{_doc[models][$model][plain_ms]}``), ``{a[-1]}`` a list's last item.

A template is a :meth:`str.format` string over the row. A format spec may start with
transforms separated by ``:``: a unit (``ms``, ``us``, ``%``, ``M``, ``GiB``, ``MiB``: the
value scaled to it), ``join`` (a list's items, or a mapping's ``key: value``, joined by
" / "), ``shape`` (a list's items joined by " × "), ``range`` (a list's least and
greatest) and ``opt`` ("–" for ``None``: nothing to measure).
A cell whose field is missing, ``None`` or not finite reads "not measured": the tables
show what the files hold, and nothing else; a column that no row fills is a warning.

Under the table: the caption (``:caption:``, reStructuredText, formatted over the first
file's document as ``_doc``: literal braces doubled), the files with the device, threads
and software each records, and the command that writes them (``:command:``).
"""

from __future__ import annotations

import _string
import json
import math
import string
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Tuple

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOGGER = logging.getLogger(__name__)

NOT_MEASURED = "not measured"
UNITS = {"ms": 1e3, "us": 1e6, "%": 100.0, "M": 1e-6, "GiB": 2.0**-30, "MiB": 2.0**-20}
TRANSFORMS = ("opt", "join", "shape", "range")
ENVIRONMENT_KEYS = ("gpu", "device", "machine", "threads", "cpu_threads", "torch", "cuda")


class Missing(Exception):
    """A field that a cell asks for is not in the row, or holds no measurement."""


class CellFormatter(string.Formatter):
    """:class:`string.Formatter` with the transforms of the module's docstring."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Tuple[Any, str]:
        first, rest = _string.formatter_field_name_split(field_name)
        try:
            value = kwargs[first]
            for _, key in rest:  # ``a.b`` and ``a[b]`` alike: a key of a mapping
                key = kwargs[key[1:]] if str(key).startswith("$") else key
                value = value[int(key) if isinstance(value, list) else str(key)]
        except (KeyError, IndexError, TypeError, ValueError) as missing:
            raise Missing(field_name) from missing
        return value, first

    def format_field(self, value: Any, spec: str) -> str:
        *transforms, spec = spec.split(":")
        if spec in TRANSFORMS or spec in UNITS:
            transforms, spec = [*transforms, spec], ""
        for transform in transforms:
            if transform == "opt" and value is None:
                return "–"
            if transform == "join" and isinstance(value, dict):
                return " / ".join(f"{k}: {self.format_field(v, spec)}" for k, v in value.items())
            if transform in ("join", "shape"):
                return (" / " if transform == "join" else " × ").join(
                    self.format_field(v, spec) for v in value
                )
            if transform == "range":
                return (
                    f"{self.format_field(min(value), spec)}–{self.format_field(max(value), spec)}"
                )
            if transform in UNITS and value is not None:
                value = value * UNITS[transform]
            elif transform not in (*UNITS, "opt"):
                raise ValueError(f"unknown transform {transform!r}: {(*UNITS, *TRANSFORMS)}")
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            raise Missing(spec)
        return format(value, spec)


FORMATTER = CellFormatter()


def cell(template: str, row: Dict[str, Any]) -> str:
    """``template`` formatted over ``row``; "not measured" where a field is missing."""
    try:
        return FORMATTER.vformat(template, (), row)
    except Missing:
        return NOT_MEASURED


def walk(node: Any, segments: List[str], bound: Dict[str, Any], up: Any) -> Iterator[Dict]:
    """The rows under ``node`` along the path ``segments`` (see the module's docstring)."""
    if not segments:
        row = dict(node) if isinstance(node, dict) else {"value": node}
        yield {**row, **bound, "_up": up}
        return
    head, rest = segments[0], segments[1:]
    if head == "*" or (head.startswith("{") and head.endswith("}")):
        if not isinstance(node, (dict, list)):
            return
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            names = {} if head == "*" else {head[1:-1]: key}
            yield from walk(child, rest, {**bound, **names}, node)
    elif isinstance(node, dict) and head in node:
        yield from walk(node[head], rest, bound, node)


def matches(row: Dict[str, Any], where: Dict[str, Any]) -> bool:
    """Whether ``row`` has every field of ``where`` (``None``: any value) equal to it."""
    return all(
        row.get(key) is not None if value is None else str(row.get(key)) == value
        for key, value in where.items()
    )


def environment(doc: Any) -> str:
    """Device, threads, software and run status that a result file records, in words."""
    if not isinstance(doc, dict):
        return "nothing recorded of the machine"
    found: Dict[str, Any] = {}
    for section in (doc, doc.get("environment"), doc.get("settings")):
        if isinstance(section, dict):
            for key in (*ENVIRONMENT_KEYS, "transformers", "clock"):
                if section.get(key) is not None and not isinstance(section[key], (dict, list)):
                    found.setdefault(key, section[key])
    parts = [f"{key} {value}" for key, value in found.items()]
    if not any(key in found for key in ENVIRONMENT_KEYS[:5]):
        parts.append("device and threads not recorded")
    malloc = doc.get("malloc")
    if isinstance(malloc, dict):
        applied = "" if malloc.get("applied", False) else " (not applied)"
        parts.append(f"malloc {malloc.get('malloc')}{applied}")
    if doc.get("status") not in (None, "complete"):
        parts.append(f"run status {doc['status']!r}: the run stopped before its end")
    if isinstance(doc.get("settings"), dict) and doc["settings"].get("quick"):
        parts.append("a --quick run (reduced sizes, not a measurement)")
    return ", ".join(parts)


def table_node(header: List[str], rows: List[List[str]]) -> nodes.table:
    table = nodes.table(classes=["benchmark-table"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)
    head, body = nodes.thead(), nodes.tbody()
    for part, lines in ((head, [header]), (body, rows)):
        for cells in lines:
            row = nodes.row()
            for text in cells:
                entry = nodes.entry()
                entry += nodes.paragraph(text=text)
                row += entry
            part += row
    group += head
    group += body
    return table


def where_option(text: str) -> Dict[str, Any]:
    pairs = [(*part.split("=", 1), None)[:2] for part in text.split(",") if part.strip()]
    return {key.strip(): value if value is None else value.strip() for key, value in pairs}


class ResultsTable(SphinxDirective):
    """``.. results-table:: FILE [FILE ...]`` (see the module's docstring)."""

    required_arguments = 1
    optional_arguments = 8
    has_content = True
    option_spec: ClassVar[Dict[str, Any]] = {
        "rows": directives.unchanged_required,
        "where": where_option,
        "caption": directives.unchanged,
        "command": directives.unchanged_required,
    }

    def files(self) -> List[Path]:
        root = Path(self.config.benchmark_results_dir)
        found: List[Path] = []
        for pattern in self.arguments:
            matched = sorted(root.glob(pattern)) if any(c in pattern for c in "*?[") else []
            found.extend(matched or [root / pattern])
        return list(dict.fromkeys(found))

    def columns(self) -> List[Tuple[str, str]]:
        columns = [line.split("|", 1) for line in self.content if line.strip()]
        if not columns or any(len(column) != 2 for column in columns):
            raise self.error("give one column per line of the content: 'header | template'")
        return [(header.strip(), template.strip()) for header, template in columns]

    def cells(self, columns: List[Tuple[str, str]], row: Dict[str, Any]) -> List[str]:
        try:
            return [cell(template, row) for _, template in columns]
        except (ValueError, KeyError, IndexError) as error:  # a template the data can't fill
            raise self.error(f"results-table: {error} (columns {columns})") from error

    def run(self) -> List[nodes.Node]:
        columns, where = self.columns(), self.options.get("where", {})
        paths = self.options.get("rows", "").split() or [""]
        rows, sources = [], []
        for file in self.files():
            self.env.note_dependency(str(file))
            doc = json.loads(file.read_text()) if file.is_file() else None
            sources.append((file, doc))
            if doc is None:
                continue
            for path in paths:
                base = {"_doc": doc, "_file": file.name, "_rows": path}
                for row in walk(doc, [s for s in path.split(".") if s], base, doc):
                    if matches(row, where):
                        rows.append(self.cells(columns, row))
        for index, (header, _) in enumerate(columns):  # a misspelt field reads "not measured"
            if not any(row[index] != NOT_MEASURED for row in rows):
                LOGGER.warning(
                    f"results-table: no row has column {header!r}", location=self.get_location()
                )
        if not rows:
            rows = [[NOT_MEASURED] * len(columns)]
        out: List[nodes.Node] = [table_node([header for header, _ in columns], rows)]
        caption = self.options.get("caption")
        if caption:
            text = cell(caption, {"_doc": sources[0][1]})
            if text == NOT_MEASURED:
                LOGGER.warning(
                    "results-table: a field of the caption is missing", location=self.get_location()
                )
            out.extend(self.parse_text_to_nodes(text))
        out.append(self.provenance(sources))
        return out

    def provenance(self, sources: List[Tuple[Path, Any]]) -> nodes.container:
        root = Path(self.config.benchmark_results_dir)
        listing = nodes.bullet_list(classes=["benchmark-sources"])
        for file, doc in sources:
            para = nodes.paragraph()
            para += nodes.literal(text=f"benchmarks/results/{file.relative_to(root)}")
            para += nodes.Text(f": {environment(doc)}" if doc is not None else ": no such file")
            item = nodes.list_item()
            item += para
            listing += item
        container = nodes.container(classes=["benchmark-provenance"])
        container += nodes.paragraph(text="From:")
        container += listing
        if self.options.get("command"):
            command = nodes.paragraph(text="Written by: ")
            command += nodes.literal(text=self.options["command"])
            container += command
        return container


def setup(app):
    app.add_config_value("benchmark_results_dir", "", "env", [str])
    app.add_directive("results-table", ResultsTable)
    return {"version": "2", "parallel_read_safe": True, "parallel_write_safe": True}
