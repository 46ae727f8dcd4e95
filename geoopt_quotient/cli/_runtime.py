"""Devices, process groups and quiet Hugging Face loading, shared by the subcommands."""

from __future__ import annotations

import argparse
import os
from typing import Tuple

import torch

__all__ = [
    "add_output_arguments",
    "end_distributed",
    "local_device",
    "parse_device",
    "quiet_transformers",
    "start_distributed",
]


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
    nccl on CUDA and gloo on CPU.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def end_distributed() -> None:
    """Leave the process group, if one was joined.

    A gloo process that exits with its group still alive can abort in the group's
    destructor ("terminate called without an active exception") and fail the launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device: torch.device, rank: int, world: int) -> torch.device:
    """One GPU per process under torchrun (``LOCAL_RANK``); CPU devices are shared."""
    if world > 1 and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def quiet_transformers() -> None:
    """Silence transformers' own per-checkpoint progress bars (ours show the work)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


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
