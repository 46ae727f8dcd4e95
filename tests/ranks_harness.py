"""Run a function on several gloo ranks spawned by torch.multiprocessing, without ports.

The ranks meet through a file in the test's temporary directory (``file://``), their
process group has a timeout, and the parent waits a bounded time for their results, so
no test can hang or depend on a free port.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds a collective may wait for a peer before it raises.
GROUP_TIMEOUT = 60
#: Seconds the parent waits for all ranks' results.
RESULTS_TIMEOUT = 240


class RankError(AssertionError):
    """A rank's function raised; the message holds its traceback."""


def _entry(
    rank: int, world: int, rendezvous: str, timeout: float, fn: Callable, args: tuple, queue
) -> None:
    # a rank that dies of a signal (an abort in native code) prints its threads' Python
    # stacks to stderr, which the test's report shows
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
    )
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # the reply sent, the process ends without the interpreter's teardown, where gloo's
    # native threads can abort it (as the command line's ranks do: exit_if_distributed)
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(
    fn: Callable,
    tmp_path,
    *args: Any,
    world: int = 2,
    group_timeout: float = GROUP_TIMEOUT,
    results_timeout: float = RESULTS_TIMEOUT,
) -> Dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; their results by rank.

    ``fn`` must be a module-level function (the ranks import it). A rank whose ``fn``
    raised makes this raise :class:`RankError` with its traceback. ``group_timeout`` and
    ``results_timeout`` (seconds) replace :data:`GROUP_TIMEOUT` and
    :data:`RESULTS_TIMEOUT` for work that takes longer (a real model loaded on each rank).
    """
    queue = mp.get_context("spawn").Queue()
    rendezvous = str(tmp_path / "rendezvous")
    context = mp.start_processes(
        _entry,
        args=(world, rendezvous, group_timeout, fn, args, queue),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + results_timeout
    try:
        replies = [queue.get(timeout=results_timeout) for _ in range(world)]
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() > deadline:
                raise RankError(f"the ranks did not exit within {results_timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    failures = [f"rank {rank}:\n{value}" for rank, ok, value in replies if not ok]
    if failures:
        raise RankError("\n".join(failures))
    return {rank: value for rank, _, value in replies}
