"""Counting the host synchronisations of CUDA code (``torch.cuda.set_sync_debug_mode``)."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Tuple

import torch

__all__ = ["SyncCount", "count_host_syncs", "host_syncs_per_iteration"]

#: What torch's sync debug mode says for each synchronising operation.
SYNC_MESSAGE = "called a synchronizing CUDA operation"


@dataclass
class SyncCount:
    """The number of synchronising CUDA operations counted, set when the block ends."""

    value: int = 0


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count the operations in the block that make the host wait for the GPU.

    ``.item()``, ``.tolist()``, ``bool(tensor)``, device-to-host copies, ``nonzero`` and
    boolean-mask indexing, ``torch.linalg`` calls that check their result on the host...:
    each makes the CPU wait until the GPU has caught up, so the GPU then idles while the
    CPU queues the next kernels. Uses ``torch.cuda.set_sync_debug_mode("warn")``, which
    warns on each; other warnings raised in the block are passed on.

    Examples
    --------
    >>> with count_host_syncs() as syncs:  # doctest: +SKIP
    ...     loss = model(x).sum().item()
    >>> syncs.value  # doctest: +SKIP
    1
    """
    count = SyncCount()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
    count.value = len(syncs)
    for w in caught:
        if SYNC_MESSAGE not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def host_syncs_per_iteration(
    run: Callable[[int], object], iters: Tuple[int, int] = (4, 8)
) -> float:
    """Synchronisations per iteration of ``run(n)``, an iterative computation of ``n`` steps:
    the difference of the counts for two step numbers over the difference of the numbers,
    which leaves out what the computation does once (set-up, checks, the final read).

    Parameters
    ----------
    run : callable
        ``run(n)`` performs ``n`` iterations on the GPU (its result is ignored).
    iters : (int, int)
        The two step numbers ``(low, high)``, ``low < high`` (default ``(4, 8)``).

    Returns
    -------
    float
        :math:`(c_{high} - c_{low}) / (high - low)` with :math:`c_n` the host
        synchronisations counted by :func:`count_host_syncs` during ``run(n)``.
    """
    low, high = iters
    counts = []
    for n in (low, high):
        torch.cuda.synchronize()
        with count_host_syncs() as syncs:
            run(n)
        counts.append(syncs.value)
    return (counts[1] - counts[0]) / (high - low)
