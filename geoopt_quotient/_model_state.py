"""A model's mutable state (train/eval flags, ``requires_grad``, RNG), restored on exit."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["preserved_model_state"]


@contextlib.contextmanager
def preserved_model_state(model: torch.nn.Module, *, eval_mode: bool = True) -> Iterator[None]:
    """Restore train/eval flags, ``requires_grad`` flags and the global RNG state on exit.

    Exit also happens on exceptions and ``KeyboardInterrupt``. With ``eval_mode`` the
    model runs in eval mode inside (dropout off), as sharpness is usually measured.
    """
    modes = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        if eval_mode and any(training for _, training in modes):
            model.eval()
        yield
    finally:
        for module, training in modes:
            if module.training != training:  # (setting it goes through Module.__setattr__)
                module.training = training
        for param, flag in flags:
            if param.requires_grad != flag:
                param.requires_grad_(flag)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
