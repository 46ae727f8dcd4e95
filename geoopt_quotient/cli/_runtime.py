"""What the subcommands share: devices, process groups, threads, quiet Hugging Face
loading, and the arguments that mean the same in every command (``--threads``, the ball
radii, the outputs)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from ..experiments.classifiers import ARRAY_SUFFIXES, DTYPES, InputError, text_lines
from ._types import int_at_least, positive_float

__all__ = [
    "DEFAULT_THREADS",
    "DTYPE_HELP",
    "THREADS_HELP",
    "add_dtype_argument",
    "add_output_arguments",
    "add_radius_arguments",
    "add_threads_argument",
    "check_data_file",
    "end_distributed",
    "exit_if_distributed",
    "local_device",
    "parse_device",
    "quiet_transformers",
    "radii_from_args",
    "start_distributed",
    "torch_threads",
]

#: ``--threads`` default of every command that computes.
DEFAULT_THREADS = 1
THREADS_HELP = (
    f"torch intra-op threads for this run, restored afterwards (default {DEFAULT_THREADS}). "
    "The models of the reproductions are small, and on cores shared with other work every "
    "operation waits for the slowest thread: 'reproduce diagonal' took 207 s with 2 "
    "threads and 45 s with 1 on 2 busy cores. Give more for large models on idle cores"
)


DTYPE_HELP = (
    "dtype of the loaded weights (default auto: the checkpoint's own). Give float32 for a "
    "bfloat16 or float16 checkpoint: a perturbation written into a half-precision weight "
    "is rounded to 2^-8 (bfloat16) or 2^-11 (float16) of it, which can change a sharpness "
    "value by tens of percent or make it exactly 0 (a warning says so)"
)


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype {auto,float32,float64,bfloat16,float16}`` (:data:`DTYPE_HELP`)."""
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)


def parse_device(text: str, parser: argparse.ArgumentParser) -> torch.device:
    """``--device`` as a :class:`torch.device`; an argument error if it cannot be used here."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as error:
        parser.error(f"--device {text}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {text}: CUDA is not available here")
    return device


def start_distributed(device: torch.device) -> Tuple[int, int]:
    """Join the process group when launched by ``torchrun`` with several processes.

    Returns ``(rank, world_size)``; ``(0, 1)`` for a plain single process. The backend is
    nccl on CUDA and gloo on CPU; on CUDA each process first makes its own GPU
    (``LOCAL_RANK``, :func:`local_device`) the current one, which nccl's collectives use.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if device.type == "cuda":
            rank = int(os.environ.get("RANK", "0"))
            torch.cuda.set_device(local_device(device, rank, world))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _JOINED.append(True)
    return dist.get_rank(), dist.get_world_size()


#: Whether :func:`start_distributed` joined a process group in this process.
_JOINED: list = []


def exit_if_distributed(status: int) -> None:
    """End a process that :func:`start_distributed` joined to a group, with ``status``,
    once the command has finished and left the group (:func:`end_distributed`): its
    output flushed, then :func:`os._exit`, skipping the interpreter's finalization.

    A gloo process's native worker threads can still be running when the interpreter
    tears down, even after :func:`torch.distributed.destroy_process_group`: about one
    two-rank run in 25 on two busy cores had a rank abort there (``terminate called
    without an active exception``, SIGABRT, no Python frame left), and torchrun failed a
    finished run.
    A process that joined no group returns as usual."""
    if not _JOINED:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(status)


def end_distributed(synchronize: bool = False) -> None:
    """Leave the process group, if one was joined.

    A gloo process that exits with its group still alive can abort in the group's
    destructor ("terminate called without an active exception") and fail the launch; so
    can one whose peer tears the group down while it still receives. With
    ``synchronize`` (a command that finished on this rank, so every rank ran the same
    collectives), a barrier first lets every rank finish its communication.

    Parameters
    ----------
    synchronize : bool
        Wait for every rank at a barrier before leaving (default ``False``: leave at
        once, as after an error, where the other ranks may never reach the barrier).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def local_device(device: torch.device, rank: int, world: int) -> torch.device:
    """One GPU per process under torchrun (``LOCAL_RANK``); CPU devices are shared."""
    if world > 1 and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


@contextlib.contextmanager
def quiet_transformers(silent: bool = False) -> Iterator[None]:
    """A block without transformers' own progress bars (ours show the work).

    Loading a checkpoint draws a "Loading weights" bar on stderr; it is switched off for
    the block. With ``silent`` (``--quiet``, ``--json -``) transformers' log messages
    below errors are silenced too. Both settings are restored on exit.
    """
    from transformers.utils import logging

    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    if silent:
        logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def check_data_file(
    flag: str, path: str, *, arrays: bool = True, expected: Optional[str] = None
) -> None:
    """Raise :class:`~geoopt_quotient.experiments.classifiers.InputError` unless ``path`` is a file,
    and, unless it is an ``.npz`` archive (``arrays``), UTF-8 text throughout.

    Run before any model is loaded, so that a wrong file fails at once, with the option
    (``flag``), the file and the line in the message; ``expected`` says what the file
    should hold (default JSON lines, or an ``.npz`` archive with ``arrays``).
    """
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: no such file")
    if arrays and path.lower().endswith(ARRAY_SUFFIXES):
        return  # classifiers.load_arrays reports a bad archive
    if expected is None:
        expected = "JSON lines" + (" or an .npz archive" if arrays else "")
    for _ in text_lines(path, f"{flag} {path}", expected):
        pass


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` (:data:`THREADS_HELP`); :func:`geoopt_quotient.cli.main` applies it."""
    parser.add_argument(
        "--threads",
        type=int_at_least(1),
        default=DEFAULT_THREADS,
        metavar="N",
        help=THREADS_HELP,
    )


@contextlib.contextmanager
def torch_threads(count: Optional[int]) -> Iterator[None]:
    """A block run with ``count`` torch intra-op threads (``None``: unchanged).

    The previous count is restored on exit, also after an exception.
    """
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count is not None:
            torch.set_num_threads(previous)


RADII = (("adaptive", "adaptive"), ("inv", "geodesic inv"), ("mix", "geodesic mix"))


def add_radius_arguments(parser: Any, defaults: Any) -> None:
    """``--rho R`` for every ball, and ``--rho-adaptive``, ``--rho-inv``, ``--rho-mix``.

    ``parser`` is a parser or an argument group; ``defaults`` has ``rho_adaptive``,
    ``rho_inv`` and ``rho_mix`` attributes (e.g. a
    :class:`~geoopt_quotient.experiments.population.StudySettings`), shown in --help. A radius given
    by name wins over ``--rho``, which wins over the default (:func:`radii_from_args`).
    """
    parser.add_argument(
        "--rho",
        type=positive_float,
        default=None,
        metavar="R",
        help="one radius for every ball (overridden by the three below)",
    )
    for name, what in RADII:
        parser.add_argument(
            f"--rho-{name}",
            type=positive_float,
            default=None,
            metavar="R",
            help=f"radius of the {what} ball (default {getattr(defaults, f'rho_{name}')})",
        )


def radii_from_args(args: argparse.Namespace, defaults: Any) -> Dict[str, float]:
    """``{"rho_adaptive", "rho_inv", "rho_mix"}`` from :func:`add_radius_arguments`."""
    radii = {}
    for name, _ in RADII:
        given = getattr(args, f"rho_{name}")
        fallback = args.rho if args.rho is not None else getattr(defaults, f"rho_{name}")
        radii[f"rho_{name}"] = given if given is not None else fallback
    return radii


def add_output_arguments(
    parser: argparse.ArgumentParser, default_out: str, stem: str, resume_extra: str = ""
) -> None:
    """``--out DIR``, ``--json FILE``, ``--resume`` (``OUT/STEM-records.jsonl``), ``--quiet``."""
    parser.add_argument(
        "--out",
        default=default_out,
        metavar="DIR",
        help=f"output directory (default ./{default_out})",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write the JSON document to FILE ('-': to stdout, and print nothing else)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"reuse the models already measured in OUT/{stem}-records.jsonl with the same "
        f"settings{resume_extra}",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
