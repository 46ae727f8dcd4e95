"""The benchmarks' one timer: calls timed in turn (interleaved), so all see the same load."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(
    fns: Dict[str, Callable[[], Any]],
    repeats: int,
    *,
    number: int = 1,
    device: str = "cpu",
    settle: float = 0.0,
) -> Dict[str, List[float]]:
    """Seconds per call of each of ``fns``, ``repeats`` rounds in turn, after one warm-up call.

    Each round times ``number`` calls of a function and records their mean. ``settle``
    seconds of pause precede every timed round: torch (OpenMP) and NumPy (OpenBLAS) keep
    their idle worker threads spinning on the cores for a while after a call, and without
    the pause each side is timed while the other's threads still compete for the same
    cores (on 2 cores this slowed the batched projection by ~25%).
    """
    for fn in fns.values():
        fn()
    seconds: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(settle)
            sync(device)
            start = time.perf_counter()
            for _ in range(number):
                fn()
            sync(device)
            seconds[name].append((time.perf_counter() - start) / number)
    return seconds


def medians(seconds: Dict[str, List[float]]) -> Dict[str, float]:
    """The median of each entry of :func:`interleaved`'s result."""
    return {k: statistics.median(v) for k, v in seconds.items()}
