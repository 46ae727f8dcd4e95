r"""Batches over the ranks of a ``torch.distributed`` process group.

With ``process_group=`` the sharpness and Hessian functions get, on each rank, that
rank's share of the batches, as :class:`torch.utils.data.DistributedSampler` (with
``shuffle=False``) deals them out: of :math:`B` global batches and :math:`W` ranks,
rank :math:`r` holds the global batches :math:`r, r + W, r + 2W, \dots`, so its local
batch :math:`i` is the global batch

.. math::

    g(r, i) = i\,W + r, \qquad B_r = \lceil (B - r) / W \rceil \text{ batches on rank } r,

and the shares differ in length by one at most. Everything a batch's value depends on (a
seed, a probe drawn from a shared generator) is indexed by :math:`g`, and the per-batch
records are gathered and put in global order, so every rank returns what one process
returns on the concatenated batches.

No rank may wait for one that failed: the ranks measure in rounds (round :math:`i` is
the global batches :math:`iW, \dots, iW + W - 1`) and after each round every rank says
whether it failed (:func:`exchange`). A rank that failed re-raises its own exception;
the others raise :class:`RankFailedError` naming it. The module knows nothing of models:
the FSDP2 path and the Hessian estimators use the same helpers.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterable, Iterator, List, Sequence, Tuple

import torch

from ..errors import GeooptQuotientError
from .functional import add_note

__all__ = [
    "BatchShare",
    "RankFailedError",
    "exchange",
    "global_index",
    "share_sizes",
    "weighted_mean_over_ranks",
]


class RankFailedError(GeooptQuotientError, RuntimeError):
    """Another rank of the process group raised; its own traceback says why."""


def group_size_and_rank(group: Any) -> Tuple[int, int]:
    """``(world size, rank)`` of this process in ``group``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "`process_group` needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def global_index(local: int, rank: int, world: int) -> int:
    r"""The global index :math:`g = i W + r` of rank ``rank``'s local batch ``local``.

    Parameters
    ----------
    local : int
        Index :math:`i` of the batch in the rank's share, from 0.
    rank, world : int
        The rank :math:`r` and the number of ranks :math:`W`.

    Returns
    -------
    int
        The batch's index among all batches, as one process would count it.

    Examples
    --------
    >>> [global_index(i, 1, 3) for i in range(3)]
    [1, 4, 7]
    """
    return local * world + rank


def share_sizes(total: int, world: int) -> List[int]:
    r"""Number of batches :math:`\lceil (B - r) / W \rceil` of each rank :math:`r`.

    Parameters
    ----------
    total : int
        Number :math:`B` of global batches.
    world : int
        Number :math:`W` of ranks.

    Returns
    -------
    list of int
        The share sizes, rank 0 first: :math:`B` dealt out in strides of :math:`W`.

    Examples
    --------
    >>> share_sizes(5, 2)
    [3, 2]
    """
    return [len(range(rank, total, world)) for rank in range(world)]


def _describe(error: BaseException) -> str:
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0]}" if first else type(error).__name__


def exchange(payload: Any, group: Any, error: BaseException | None = None) -> List[Any]:
    """Every rank's ``payload`` (rank order), after every rank said whether it failed.

    A collective of ``group`` (:func:`torch.distributed.all_gather_object`): every rank
    must call it, also one that failed (with ``error``), so that none waits for ever.

    Parameters
    ----------
    payload : object
        What this rank contributes (picklable).
    group : ProcessGroup
        The process group.
    error : BaseException or None
        The exception this rank caught, which it re-raises after the call.

    Returns
    -------
    list
        The payloads, rank 0 first.

    Raises
    ------
    RankFailedError
        On a rank without ``error`` when another rank had one.
    """
    import torch.distributed as dist

    world, rank = group_size_and_rank(group)
    status = None if error is None else _describe(error)
    shards: List[Any] = [None] * world
    dist.all_gather_object(shards, (status, payload), group=group)
    failed = [(r, s) for r, (s, _) in enumerate(shards) if s is not None]
    if failed and error is None:
        which = "; ".join(f"rank {r} raised {s}" for r, s in failed)
        ranks = ", ".join(str(r) for r, _ in failed)
        raise RankFailedError(
            f"{which}: rank {rank} stops too (see the traceback printed by rank {ranks} "
            "for the cause)"
        )
    return [p for _, p in shards]


@contextlib.contextmanager
def all_or_none(group: Any) -> Iterator[None]:
    """A block after which every rank of ``group`` has succeeded, or every rank raises.

    The block must not itself run collectives that a failed rank would skip.
    """
    try:
        yield
    except BaseException as error:
        exchange(None, group, error)
        raise
    exchange(None, group)


class BatchShare:
    r"""This rank's share of the batches, its place among all ranks', and the rounds.

    Construction is a collective of ``group``: the ranks exchange how many batches they
    hold and check that the counts are those of a strided share
    (:func:`share_sizes`) with at least one batch per rank; otherwise every rank raises
    the same ``ValueError``.

    Parameters
    ----------
    batches : iterable
        This rank's batches; an iterable without ``len`` is listed first.
    group : ProcessGroup
        The process group (e.g. ``torch.distributed.group.WORLD``).

    Attributes
    ----------
    world, rank : int
        Number of ranks and this process's rank in ``group``.
    counts : list of int
        Every rank's number of batches, rank 0 first.
    total : int
        Number of global batches.
    local : sized iterable
        This rank's batches.
    """

    def __init__(self, batches: Iterable[Any], group: Any):
        self.group = group
        self.world, self.rank = group_size_and_rank(group)
        try:
            self.local = batches if hasattr(batches, "__len__") else list(batches)
            count = len(self.local)  # type: ignore[arg-type]
        except BaseException as error:
            exchange(None, group, error)
            raise
        self.counts: List[int] = exchange(count, group)
        self.total = sum(self.counts)
        _check_counts(self.counts)

    def run(
        self,
        measure: Callable[[int, Any], None],
        items: Iterable[Any] | None = None,
        skip: Callable[[int], None] | None = None,
    ) -> None:
        """``measure(global_index, item)`` for each local item, in rounds, every rank in step.

        Parameters
        ----------
        measure : callable
            Called for each of this rank's items with its global index.
        items : iterable or None
            The local items, one per local batch (default: :attr:`local`).
        skip : callable or None
            ``skip(global_index)`` for each batch of another rank, in global order
            between the calls of ``measure`` (to advance a random generator shared by
            all batches, for instance).

        Raises
        ------
        RankFailedError
            When another rank raised in the same round.
        """
        iterator = iter(self.local if items is None else items)
        for round_index in range(max(self.counts)):
            with all_or_none(self.group):
                for owner in range(self.world):
                    index = global_index(round_index, owner, self.world)
                    if index >= self.total:
                        break
                    if owner == self.rank:
                        with _noting(index, round_index, self.rank):
                            measure(index, next(iterator))
                    elif skip is not None:
                        skip(index)

    def gather(
        self, records: List[Any], key: Callable[[Any], int] = operator.itemgetter("index")
    ) -> List[Any]:
        """Every rank's records, in global order (``key`` of a record: its global index;
        default, a dict's ``"index"``), on every rank."""
        shards = exchange(records, self.group)
        return sorted((r for shard in shards for r in shard), key=key)

    def maximum(self, value: float) -> float:
        """The largest of every rank's ``value`` (e.g. the slowest rank's wall time)."""
        return max(exchange(value, self.group))


@contextlib.contextmanager
def _noting(index: int, local: int, rank: int) -> Iterator[None]:
    try:
        yield
    except Exception as error:
        add_note(
            error,
            f"(while measuring global batch {index}, batch {local} of rank {rank}'s "
            "`batches`, counted from 0)",
        )
        raise


def _check_counts(counts: Sequence[int]) -> None:
    """The same error on every rank unless ``counts`` are a strided share of their sum."""
    total, world = sum(counts), len(counts)
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(
            f"rank {', '.join(map(str, empty))} of {world} has no batches (the ranks hold "
            f"{list(counts)}): with `process_group`, give every rank at least one batch, "
            f"so at least {world} batches in all"
        )
    expected = share_sizes(total, world)
    if list(counts) != expected:
        raise ValueError(
            f"the ranks hold {list(counts)} batches, but {total} batches dealt out as "
            f"DistributedSampler(shuffle=False) does (rank r gets global batches r, r + "
            f"{world}, ...) give {expected}: pass batches[rank::world_size] on each rank"
        )


def weighted_mean_over_ranks(
    tensors: Sequence[torch.Tensor], weight: float, group: Any
) -> List[torch.Tensor]:
    r"""The mean :math:`\sum_r w_r t_r / \sum_r w_r` of every rank's tensors.

    For instance the Hessian-vector product of the mean loss over all global batches,
    from each rank's mean over its own :math:`w_r` batches. An all-reduce (sum) of
    ``group``; the inputs are not modified.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        This rank's tensors :math:`t_r` (the same shapes and dtypes on every rank).
    weight : float
        This rank's weight :math:`w_r \ge 0` (e.g. its number of batches); the weights
        of all ranks must not sum to 0.
    group : ProcessGroup
        The process group.

    Returns
    -------
    list of torch.Tensor
        The weighted means, the same on every rank.
    """
    import torch.distributed as dist

    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.tensor([float(weight)], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=group)
    means = []
    for tensor in tensors:
        summed = tensor * weight
        dist.all_reduce(summed, group=group)
        means.append(summed / total.to(summed.dtype))
    return means
