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
status. A command that needs optional dependencies names their modules in the
``needs`` default (``parser.set_defaults(..., needs=("matplotlib",))``); :func:`main`
imports them before the handler runs. Three kinds of errors exit with status 2:

* argument errors found late (options that do not fit together): the handler calls
  ``parser.error(...)``, which prints the usage block and the message;
* data errors (a missing or malformed data file, a directory that is not a checkpoint,
  a gaps CSV that does not match the checkpoints): the handler, or the library code it
  calls, raises :class:`~geoopt_quotient.experiments.classifiers.InputError`, and :func:`main`
  prints one line, ``geoopt-quotient COMMAND: error: MESSAGE``, without the usage (the
  arguments were well formed; the files were not). Notes added to the exception on its
  way up (``while measuring model 'x'``) are appended to the line;
* a missing optional dependency (:class:`~geoopt_quotient._extras.MissingExtraError`):
  one line that names the extra that installs it.

A command that computes registers ``--threads`` with
:func:`~geoopt_quotient.cli._runtime.add_threads_argument`; :func:`main` runs the
handler with that many torch threads and restores the previous count afterwards.
:mod:`geoopt_quotient.cli.reproduce` discovers its targets (``reproduce diagonal``,
...) the same way as the commands.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Sequence

__all__ = ["build_parser", "command_summaries", "discover", "error_line", "main"]

PROG = "geoopt-quotient"


def discover(package: ModuleType) -> List[ModuleType]:
    """The public submodules of ``package`` that define ``register``, sorted by name.

    Each such module is a subcommand: ``register(subparsers)`` adds its parser.

    Parameters
    ----------
    package : module
        A package (it has ``__path__``); its modules whose names start with ``_`` are
        skipped.

    Returns
    -------
    list of module
        The imported submodules with a callable ``register``.
    """
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if callable(getattr(module, "register", None)):
            found.append(module)
    return found


def command_summaries(package: ModuleType) -> Dict[str, str]:
    """The subcommands of ``package`` and their one-line help, read from the sources of
    its public submodules without importing them.

    A subcommand's module sets ``HELP = "..."`` (a string literal, which its ``register``
    passes as ``help=``); importing the modules would import what the commands compute
    with (torch, transformers), seconds for a ``--help``.

    Parameters
    ----------
    package : module
        A package of subcommands (:mod:`geoopt_quotient.cli`).

    Returns
    -------
    dict
        ``name -> help`` of every public submodule that sets ``HELP``, sorted by name.
    """
    found = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        spec = importlib.util.find_spec(f"{package.__name__}.{info.name}")
        if spec is None or spec.origin is None:
            continue
        for node in ast.parse(Path(spec.origin).read_text()).body:
            targets = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
            if isinstance(node, ast.Assign) and "HELP" in targets:
                found[info.name] = ast.literal_eval(node.value)
    return found


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every discovered subcommand.

    Parameters
    ----------
    command : str or None
        Only this subcommand, in full (its module imported); or, for a name that is no
        subcommand, every subcommand as a name and its help only (no module imported:
        enough for ``--help``, ``--version`` and the error for an unknown command).
        Default ``None``: every subcommand in full.
    """
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
    package = sys.modules[__name__]
    if command is None:
        modules = discover(package)
    else:
        summaries = command_summaries(package)
        if command not in summaries:
            for name, summary in summaries.items():
                subparsers.add_parser(name, help=summary)
            return parser
        modules = [importlib.import_module(f"{__name__}.{command}")]
    for module in modules:
        module.register(subparsers)
    return parser


def error_line(error: BaseException) -> str:
    """The message of ``error`` and its notes (``add_note``) on one line.

    Parameters
    ----------
    error : BaseException
        The exception.

    Returns
    -------
    str
        Its message, then each note in parentheses, the lines stripped and joined by
        spaces.
    """
    parts = [str(error), *(f"({note})" for note in getattr(error, "__notes__", ()))]
    return " ".join(line.strip() for part in parts for line in part.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Argument errors, data errors
    (:class:`~geoopt_quotient.experiments.classifiers.InputError`) and missing optional
    dependencies exit with status 2 (``SystemExit``); the last two print one line to stderr.

    Parameters
    ----------
    argv : sequence of str or None
        The arguments after the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status of the subcommand (0 on success). A ``torchrun`` process that
        joined a process group here ends with it instead of returning, once it has
        left the group (:func:`~geoopt_quotient.cli._runtime.exit_if_distributed`).

    Raises
    ------
    SystemExit
        With status 2 on an argument error, a data error or a missing optional
        dependency (and with status 0 after ``--help`` or ``--version``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    args = build_parser(command).parse_args(argv)  # only the command given is imported

    from .._extras import MissingExtraError, require_all
    from ..experiments.classifiers import InputError
    from ._runtime import end_distributed, exit_if_distributed, torch_threads

    finished = False
    try:
        require_all(getattr(args, "needs", ()), f"{args.parser.prog}")
        with torch_threads(getattr(args, "threads", None)):
            status = int(args.handler(args, args.parser) or 0)
        finished = True
    except (InputError, MissingExtraError) as error:
        args.parser.exit(2, f"{args.parser.prog}: error: {error_line(error)}\n")
    finally:
        end_distributed(synchronize=finished)
    exit_if_distributed(status)  # a finished torchrun rank: no interpreter teardown
    return status
