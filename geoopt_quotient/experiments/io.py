"""Loading weights without running code: safetensors, or ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Dict, Union

import torch

from ..errors import GeooptQuotientError

__all__ = ["UnsafeCheckpointError", "find_weights", "load_state_dict"]

PathLike = Union[str, os.PathLike]
SAFETENSORS = (".safetensors",)
PICKLED = (".pt", ".pth", ".bin", ".ckpt")


class UnsafeCheckpointError(GeooptQuotientError, ValueError):
    """A checkpoint would need arbitrary code (a pickle beyond plain tensors) to load."""


def load_state_dict(path: PathLike, *, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or, with ``weights_only=True``, a torch pickle.

    Never unpickles arbitrary objects: a pickle that references anything but tensors and
    plain containers is refused with :class:`UnsafeCheckpointError`, and nothing in it runs.

    Parameters
    ----------
    path : str or os.PathLike
        The weights file: ``.safetensors``, or a torch pickle (``.pt``, ``.bin``, ...).
        A pickle holding ``{"state_dict": {...}, ...}`` gives its ``state_dict``.
    device : str
        Where to load the tensors (default ``"cpu"``).

    Returns
    -------
    dict of str to torch.Tensor
        The state dict.

    Raises
    ------
    FileNotFoundError
        If there is no file at ``path``.
    UnsafeCheckpointError
        For a pickle that is not a plain-tensor checkpoint.
    ValueError
        For a file that does not hold a state dict of tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    if path.suffix in SAFETENSORS:
        from safetensors.torch import load_file

        return load_file(str(path), device=device)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"refused to load {path}: it is not a plain-tensor checkpoint and loading it "
            "would run code it contains. Convert it to safetensors with a trusted tool, or "
            f"load it yourself if you trust its origin. ({str(error).splitlines()[0]})"
        ) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return state


def find_weights(directory: PathLike) -> Path:
    """The weights file of a checkpoint directory, safetensors preferred.

    Parameters
    ----------
    directory : str or os.PathLike
        The checkpoint directory.

    Returns
    -------
    pathlib.Path
        The first ``*.safetensors`` file by name, else the first ``*.pt``, ``*.pth``,
        ``*.bin`` or ``*.ckpt`` file, in that order of preference.

    Raises
    ------
    FileNotFoundError
        If the directory does not exist or has no weights file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    for pattern in ("*.safetensors", *(f"*{s}" for s in PICKLED)):
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"checkpoint directory {directory} has no weights (*.safetensors, *.pt, *.bin); "
        "save the model with save_pretrained(..., safe_serialization=True)"
    )
