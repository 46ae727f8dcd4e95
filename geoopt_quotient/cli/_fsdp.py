r"""``--fsdp``: one model sharded over the processes of ``torchrun`` with FSDP2.

Every process loads the checkpoint, wraps each transformer block and then the root with
:func:`torch.distributed.fsdp.fully_shard` on a 1-D device mesh of all processes (each
keeps its rows of every parameter) and passes its rows of every batch: batch :math:`b`
of :math:`B` rows gives process :math:`r` of :math:`R` the rows
:math:`[rB/R, (r+1)B/R)`. The sharpness functions measure the sharded model with one
ball per global batch (:mod:`geoopt_quotient.sharpness.sharded`); their value is the mean
of the processes' mean losses, which is the batch's mean loss only when :math:`R`
divides :math:`B` for every batch, so an uneven batch is refused.

Without ``torchrun`` (or with one process) the mesh has one rank, in a process group of
one process kept in memory: the same code path, no communication.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..experiments.classifiers import Batch, InputError
from ..experiments.population import StudySettings
from ..measures import Measure

__all__ = [
    "all_agree",
    "fsdp_info",
    "join_alone",
    "probe_rows",
    "rows_of_batches",
    "shard_for_study",
    "shard_model",
    "transformer_blocks",
    "working_sizes",
]


def join_alone(device: torch.device, timeout_s: float = 600.0) -> None:
    """A process group of this process alone (rank 0 of 1) in an in-memory store: gloo on
    CPU, nccl on CUDA (``device`` made the current GPU first).

    For ``--fsdp`` without ``torchrun``: FSDP2 needs a process group, and one of one
    process needs no rendezvous (no port, no file). Nothing happens if a group exists.

    Parameters
    ----------
    device : torch.device
        The device of the run (its type picks the backend).
    timeout_s : float
        The group's timeout in seconds (default 600).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def transformer_blocks(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules that ``fully_shard`` wraps one by one: the transformer blocks.

    Every Hugging Face model names the classes that must not be split over devices in
    ``_no_split_modules`` (``LlamaDecoderLayer``, ``BertLayer``, ...): its decoder or
    encoder layers. The outermost modules of those classes are returned, in order (the
    root excluded).

    Parameters
    ----------
    model : torch.nn.Module
        A Hugging Face model (unsharded: ``fully_shard`` renames the classes).

    Returns
    -------
    list of torch.nn.Module
        Its transformer blocks.

    Raises
    ------
    InputError
        If the model names no such class, or none of its modules is one.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: List[torch.nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if module is model or id(module) in inside:
            continue
        if type(module).__name__ in names:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    if not blocks:
        raise InputError(
            f"--fsdp: {type(model).__name__} declares no transformer blocks to shard "
            f"(_no_split_modules: {sorted(names) or 'none'})"
        )
    return blocks


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Wrap each of :func:`transformer_blocks` and then ``model`` with ``fully_shard`` on a
    1-D mesh of every process (``device``'s type: ``cpu`` with gloo, ``cuda`` with nccl),
    FSDP2's default placement (rows); the parameters move to the mesh's device.

    Parameters
    ----------
    model : torch.nn.Module
        An unsharded Hugging Face model (:func:`transformer_blocks`), sharded in place.
    device : torch.device
        The device of this process (a CUDA device must be the current one).

    Returns
    -------
    torch.nn.Module
        ``model``, now sharded (its trainable parameters are DTensors).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def working_sizes(rows: Sequence[int], world: int, batch_size: int) -> List[int]:
    """``--batch-size`` values near ``batch_size`` whose batches all split evenly over
    ``world`` processes, for the same examples (``sum(rows)`` of them).

    Batches are consecutive: ``size`` rows each and the remainder last, so ``size``
    works when ``world`` divides ``size`` and ``sum(rows) mod size``.

    Parameters
    ----------
    rows : sequence of int
        The rows of each batch now.
    world : int
        The number of processes.
    batch_size : int
        The ``--batch-size`` given.

    Returns
    -------
    list of int
        Up to three working sizes nearest ``batch_size``, ascending; empty when
        ``world`` does not divide ``sum(rows)``.
    """
    total = sum(rows)
    found = []
    for size in range(world, max(total, world) + 1, world):
        if (total % size) % world == 0:
            found.append(size)
    found.sort(key=lambda size: (abs(size - batch_size), size))
    return sorted(found[:3])


def rows_of_batches(
    batches: Sequence[Batch], rank: int, world: int, batch_size: int
) -> List[Batch]:
    """This process's rows of every batch: rows ``[rank B/world, (rank+1) B/world)`` of
    each tensor in the inputs and of the targets.

    Parameters
    ----------
    batches : sequence of (dict, torch.Tensor)
        The batches, the same on every process: inputs and targets.
    rank, world : int
        This process and the number of processes.
    batch_size : int
        The ``--batch-size`` given (for the message).

    Returns
    -------
    list of (dict, torch.Tensor)
        This process's rows of every batch.

    Raises
    ------
    InputError
        If a batch's rows do not split evenly over the processes; the message says which
        ``--batch-size`` would work, or, where none does for these examples, which
        ``--max-examples`` and ``--batch-size`` together do.
    """
    rows = [int(targets.shape[0]) for _, targets in batches]
    for index, count in enumerate(rows):
        if count % world:
            raise InputError(_uneven(rows, index, world, batch_size))
    return [_rows(batch, rank, count // world) for batch, count in zip(batches, rows)]


def _rows(batch: Batch, rank: int, per_rank: int) -> Batch:
    inputs, targets = batch
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return {k: v[part] for k, v in inputs.items()}, targets[part]


def _uneven(rows: Sequence[int], index: int, world: int, batch_size: int) -> str:
    total = sum(rows)
    message = (
        f"--fsdp: batch {index} has {rows[index]} rows, which do not split evenly over "
        f"{world} processes (every process needs the same number of rows of each batch)"
    )
    if total % world:  # no batch size splits these examples: fewer, and a size for them
        usable = total - total % world
        sizes = working_sizes([usable], world, batch_size)
        if batch_size in sizes:
            return f"{message}: give --max-examples {usable}"
        return f"{message}: give --max-examples {usable} --batch-size {_choices(sizes)}"
    sizes = working_sizes(rows, world, batch_size)
    return f"{message}: give --batch-size {_choices(sizes)}"


def _choices(sizes: Sequence[int]) -> str:
    """``"2"``, ``"2 (or 4)"``, ``"2 (or 4, 6)"``."""
    rest = ", ".join(str(s) for s in sizes[1:])
    return f"{sizes[0]} (or {rest})" if rest else str(sizes[0])


def probe_rows(inputs: Dict[str, torch.Tensor], model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Rank 0's rows of a batch's ``inputs`` (this process's own rows on rank 0, the same
    tensors on every process), on the device of the unsharded ``model``, for the
    symmetry check before sharding.

    Parameters
    ----------
    inputs : dict of str to torch.Tensor
        A whole batch's inputs (rows first).
    model : torch.nn.Module
        The model, not yet sharded.

    Returns
    -------
    dict of str to torch.Tensor
        The first ``B / world_size`` rows of each input, on the model's device.
    """
    import torch.distributed as dist

    where = next(model.parameters()).device
    count = next(iter(inputs.values())).shape[0] // dist.get_world_size()
    return {k: v[:count].to(where) for k, v in inputs.items()}


def all_agree(verdict: bool, device: torch.device) -> bool:
    """Whether ``verdict`` holds on every process (an all-reduce of its minimum).

    Parameters
    ----------
    verdict : bool
        This process's verdict.
    device : torch.device
        Where the flag is reduced (a CUDA device for nccl).

    Returns
    -------
    bool
        The verdict of all processes, the same on each.
    """
    import torch.distributed as dist

    flag = torch.tensor([int(verdict)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def fsdp_info(
    model: torch.nn.Module, local_batches: Sequence[Batch], world: int
) -> Dict[str, object]:
    """What the JSON document says of a sharded run: the processes, each process's rows of
    every batch, and the parameter entries rank 0 holds (of the whole model's).

    Parameters
    ----------
    model : torch.nn.Module
        The sharded model.
    local_batches : sequence of (dict, torch.Tensor)
        This process's rows of every batch.
    world : int
        The number of processes.

    Returns
    -------
    dict
        ``processes``, ``rows_per_process`` (per batch), ``fsdp_modules`` (the wrapped
        blocks and the root) and ``parameters_on_rank_0`` (this process's entries,
        written by rank 0).
    """
    from torch.distributed.fsdp import FSDPModule

    held = sum(_local(p).numel() for p in model.parameters())
    return {
        "processes": world,
        "rows_per_process": [int(targets.shape[0]) for _, targets in local_batches],
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "parameters_on_rank_0": held,
    }


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """A DTensor's local block; a plain tensor itself."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def shard_for_study(
    model: torch.nn.Module, batches: List[Batch], settings: StudySettings, device: torch.device
) -> Tuple[List[Batch], Dict[str, Any]]:
    """``population --fsdp``'s preparation of one model (a
    :class:`~geoopt_quotient.experiments.population.JointModels` ``prepare``): this
    process's rows of every batch, the symmetries of each metric of ``settings.measures``
    found on the unsharded model (the first metric's checked on :func:`probe_rows` when
    ``settings.verify``, the verdict agreed by all processes), then the model sharded in
    place (:func:`shard_model`) and the plans bound to it.

    Parameters
    ----------
    model : torch.nn.Module
        An unsharded Hugging Face model, sharded in place.
    batches : list of (dict, torch.Tensor)
        The whole sharpness batches, the same on every process.
    settings : StudySettings
        The study's measures, ``eps``, ``verify`` and ``batch_size`` (for the message of an
        uneven batch).
    device : torch.device
        The device of this process.

    Returns
    -------
    rows : list of (dict, torch.Tensor)
        This process's rows of every batch (:func:`rows_of_batches`).
    plans : dict of str to BoundPlan
        The bound plan of each metric, in the order of the measures.

    Raises
    ------
    InputError
        If a batch does not split evenly over the processes (on every process, before any
        communication).
    SymmetryVerificationError
        On every process, if the check failed on any.
    """
    import torch.distributed as dist

    from ..symmetry import SymmetryVerificationError, find_symmetries

    rows = rows_of_batches(batches, dist.get_rank(), dist.get_world_size(), settings.batch_size)
    metrics = dict.fromkeys(Measure.parse(m).metric for m in settings.measures)
    metrics.pop(None, None)
    probe = probe_rows(batches[0][0], model)
    plans, failure = {}, None
    try:  # one discovery (and proof, on the unsharded model) serves every metric
        found = None
        for metric in metrics:
            if found is None:
                found = find_symmetries(
                    model,
                    metric=metric,
                    eps=settings.eps,
                    verify=settings.verify,
                    probe_inputs=probe,
                )
            plans[metric] = found.with_metric(metric, settings.eps)
    except SymmetryVerificationError as error:
        failure = error
    if not all_agree(failure is None, device):
        raise failure or SymmetryVerificationError("the symmetry check failed on another process")
    shard_model(model, device)
    return rows, {metric: plan.bind(model) for metric, plan in plans.items()}
