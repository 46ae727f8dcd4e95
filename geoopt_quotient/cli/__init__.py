"""The ``geoopt-quotient`` command line (also ``python -m geoopt_quotient``).

Subcommands are discovered: every public module (or package) directly under
:mod:`geoopt_quotient.cli` that defines ``register(subparsers)`` adds one subcommand,
so adding a command means adding one file, e.g. ``cli/sharpness.py``::

    def register(subparsers):
        parser = subparsers.add_parser("sharpness", help="...", description="...")
        parser.add_argument(...)
        parser.set_defaults(handler=run, parser=parser)

    def run(args, parser) -> int:
        ...
        return 0

``handler(args, parser)`` (``parser``: the subcommand's own parser) returns the exit
status; it may call ``parser.error(...)`` for argument errors found late (exit status
2). :mod:`geoopt_quotient.cli.reproduce` discovers its targets (``reproduce diagonal``,
...) the same way.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType
from typing import List, Sequence

from ._runtime import end_distributed

__all__ = ["build_parser", "discover", "main"]

PROG = "geoopt-quotient"


def discover(package: ModuleType) -> List[ModuleType]:
    """The public submodules of ``package`` that define ``register``, sorted by name."""
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if callable(getattr(module, "register", None)):
            found.append(module)
    return found


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Geoopt manifolds for neural-network symmetry quotients, and geodesic sharpness "
            "that symmetries cannot fool."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in discover(sys.modules[__name__]):
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argument errors exit with 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args, args.parser) or 0)
    finally:
        end_distributed()
