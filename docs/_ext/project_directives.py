"""Directives whose content comes from the package itself, at build time.

* ``.. command-help:: [SUBCOMMAND ...]``: the ``--help`` text of ``geoopt-quotient``
  or of one of its subcommands, as the installed parser prints it (80 columns);
* ``.. moved-modules::``: the table of deprecated module paths and the modules that
  replaced them, and the names that moved between modules
  (:data:`geoopt_quotient._moved.MOVED_MODULES`, ``MOVED_NAMES``).
"""

from __future__ import annotations

import argparse
import os
from typing import List

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

HELP_COLUMNS = "80"


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise KeyError(name)


def help_text(words: List[str]) -> str:
    """``geoopt-quotient WORDS --help``, without running the command."""
    from geoopt_quotient.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS  # argparse wraps to the terminal's width
    try:
        parser = build_parser()
        for word in words:
            parser = subparser(parser, word)
        return parser.format_help().rstrip()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


class CommandHelpDirective(SphinxDirective):
    optional_arguments = 4
    has_content = False

    def run(self) -> List[nodes.Node]:
        try:
            text = help_text(list(self.arguments))
        except KeyError as error:
            raise self.error(f"geoopt-quotient has no subcommand {error}") from None
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


class MovedModulesDirective(SphinxDirective):
    has_content = False

    def run(self) -> List[nodes.Node]:
        from geoopt_quotient._moved import MOVED_MODULES, MOVED_NAMES

        moves = dict(MOVED_MODULES)
        for module, names in MOVED_NAMES.items():
            moves.update({f"{module}.{name}": f"{target}.{name}" for name, target in names.items()})

        table = nodes.table()
        group = nodes.tgroup(cols=2)
        table += group
        group.extend(nodes.colspec(colwidth=1) for _ in range(2))

        def row(old: str, new: str, header: bool = False) -> nodes.row:
            out = nodes.row()
            for text in (old, new):
                entry = nodes.entry()
                para = nodes.paragraph()
                para += nodes.Text(text) if header else nodes.literal(text=text)
                entry += para
                out += entry
            return out

        head = nodes.thead()
        head += row("deprecated path", "import instead", header=True)
        body = nodes.tbody()
        body.extend(row(old, new) for old, new in sorted(moves.items()))
        group += head
        group += body
        return [table]


def setup(app):
    app.add_directive("command-help", CommandHelpDirective)
    app.add_directive("moved-modules", MovedModulesDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
