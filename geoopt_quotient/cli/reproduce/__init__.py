"""``geoopt-quotient reproduce TARGET``: reproduce an experiment of the paper.

Targets are discovered like the top-level commands: every public module here that
defines ``register(subparsers)`` adds one (``diagonal``, ``transformers``).
"""

from __future__ import annotations

import argparse
import sys

from .. import discover

__all__ = ["register"]


#: The command's line in ``geoopt-quotient --help`` (read from this source, unimported).
HELP = "reproduce an experiment of the paper"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``reproduce`` and its targets."""
    parser = subparsers.add_parser(
        "reproduce",
        help=HELP,
        description="Reproduce an experiment of 'Hide & Seek' (da Silva, Dangel & Oore, 2025).",
    )
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    for module in discover(sys.modules[__name__]):
        module.register(targets)
