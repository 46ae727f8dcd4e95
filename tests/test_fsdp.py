"""Sharpness of an FSDP2-sharded model (``fully_shard``) on two gloo ranks.

Each rank passes its rows of every batch; the value must be the single-process value on
the concatenated batches, the same on both ranks, with the model bitwise unchanged, and
the ball's memory per rank about half of one process's. One spawn runs every check; the
tests below read its results.
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

import torch.multiprocessing as mp  # noqa: E402

from geoopt_quotient import (  # noqa: E402
    adaptive_sharpness,
    find_symmetries,
    geodesic_sharpness,
    hessian_trace,
)
from geoopt_quotient.sharpness.ball import ball_groups  # noqa: E402
from geoopt_quotient.sharpness.functional import trainable_parameters  # noqa: E402
from geoopt_quotient.sharpness.layout import BallLayout  # noqa: E402

WORLD = 2
ROWS = 2  # per rank and batch
MEASURES = ("adaptive", "inv", "mix")
RHO = {"adaptive": 0.05, "inv": 0.05, "mix": 0.05}
ITERS = 5


def build_llama(heads: int = 4, kv_heads: int = 4, vocab: int = 50) -> torch.nn.Module:
    """A tiny float64 Llama: 2 layers, ``heads`` query and ``kv_heads`` key/value heads of
    4, seeded."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=4 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=24,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


#: 3 query heads sharing 1 key/value head, 51 tokens, on 2 ranks: the middle query head's
#: rows of W_Q and the key/value head's rows of W_K, W_V are split over the ranks, each
#: layer's group block (3 query heads on 1 key/value head) is owned by one rank, and the
#: embedding's rows are split unevenly (26 and 25).
SPLIT_HEADS = dict(heads=3, kv_heads=1, vocab=51)


def loss_fn(model, ids):
    """Next-token cross-entropy in float64, a mean over the rank's rows."""
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def global_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (WORLD * ROWS, 6), generator=g) for _ in range(2)]


def measure(model, batches, which):
    if which == "adaptive":
        return adaptive_sharpness(model, loss_fn, batches, rho=RHO[which], iters=ITERS).value
    kw = dict(rho=RHO[which], iters=ITERS, metric=which)
    return geodesic_sharpness(model, loss_fn, batches, **kw).value


def shard(model, mesh, **options):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def ball_memory(model) -> tuple:
    """Bytes per parameter of this rank's worst-case mix ball (best gradient kept), and
    the number of boxes of each of its exchange's maps (None: an index per entry)."""
    from geoopt_quotient.sharpness.sharded import sharded_ball

    plan = find_symmetries(model, metric="mix").bind(model)

    ball = sharded_ball(model, plan, loss_fn)
    maps = (ball.exchange.local, ball.exchange.sent, ball.exchange.received)
    boxes = [m.boxes.boxes if m.index is None else None for m in maps]
    return ball.bytes_per_parameter(keep_best_gradient=True), boxes


def _pairs(transfer) -> torch.Tensor:
    """A map's (source, target) position pairs, sorted: the map whatever its boxes."""
    rows = [transfer.boxes.positions()]
    if transfer.index is not None:
        rows.append(torch.stack([t.long() for t in transfer.index.index], 1))
    pairs = torch.cat(rows)
    key = pairs[:, 0] * (int(pairs[:, 1].max()) + 1 if len(pairs) else 1) + pairs[:, 1]
    return pairs[key.argsort()]


def largest_integer_tensor(fn):
    """``(fn(), the most entries of an integer or boolean tensor an operation made)``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Watch(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex()):
                    Watch.largest = max(Watch.largest, t.numel())
            return out

    with Watch():
        result = fn()
    return result, Watch.largest


def chunked_layout(model, chunk_entries: int) -> dict:
    """This rank's sharded mix ball built chunk by chunk of ``chunk_entries`` entries:
    its pieces, base point and maps, and the largest integer tensor made meanwhile."""
    from geoopt_quotient.sharpness import sharded

    plan = find_symmetries(model, metric="mix").bind(model)
    default, sharded.CHUNK_ENTRIES = sharded.CHUNK_ENTRIES, chunk_entries
    try:
        ball, largest = largest_integer_tensor(lambda: sharded.sharded_ball(model, plan, loss_fn))
    finally:
        sharded.CHUNK_ENTRIES = default
    ex = ball.exchange
    ball.restore()
    return {
        "pieces": [(p.start, tuple(p.shape)) for p in ball.pieces],
        "base": ball.base,
        "sizes": (ex.send_sizes, ex.recv_sizes),
        "maps": [_pairs(m) for m in (sharded._Transfer(ex.whole), ex.local, ex.sent, ex.received)],
        "boxes": [m.boxes.boxes for m in (ex.local, ex.sent, ex.received)],
        "largest": largest,
        "group_entries": max(g.shape.numel() for g in plan.groups if not g.is_whole_parameter),
        "index_built": any("_index" in vars(g) for g in plan.groups),
    }


def layouts_derived(model, local) -> int:
    """How many times two sharpness calls with one plan derive this rank's layout."""
    from geoopt_quotient.sharpness import sharded

    plan = find_symmetries(model, metric="mix")
    calls, original = [], sharded.ShardedBall._layout
    sharded.ShardedBall._layout = lambda self, plan: calls.append(1) or original(self, plan)
    try:
        for _ in range(2):
            geodesic_sharpness(model, loss_fn, local, rho=0.05, iters=1, symmetries=plan)
    finally:
        sharded.ShardedBall._layout = original
    return len(calls)


def fresh_buffers(model, local, iters: int) -> tuple:
    """A call of ``iters`` iterations: how many vectors of the ball it makes (flat buffers
    and Auto-PGD's iterates), and how many distinct buffers its writes and gradients pass
    through in the shards' layout."""
    from geoopt_quotient.sharpness import buffers, sharded

    plan = find_symmetries(model, metric="mix")
    made, seen = [], set()
    ball_flat, model_buffer = sharded.ShardedBall._ball_flat, sharded.ShardedBall._model_buffer
    joint = buffers.joint_buffer

    def counted_model_buffer(self):
        buffer = model_buffer(self)
        seen.add(buffer.data_ptr())
        return buffer

    sharded.ShardedBall._ball_flat = lambda self: made.append(1) or ball_flat(self)
    sharded.ShardedBall._model_buffer = counted_model_buffer
    buffers.joint_buffer = lambda *a, **k: made.append(1) or joint(*a, **k)
    try:
        geodesic_sharpness(model, loss_fn, local[:1], rho=0.05, iters=iters, symmetries=plan)
    finally:
        sharded.ShardedBall._ball_flat, sharded.ShardedBall._model_buffer = ball_flat, model_buffer
        buffers.joint_buffer = joint
    return len(made), len(seen)


def worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from geoopt_quotient.sharpness.sharded import ShardingError

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model = shard(build_llama(), mesh)
        local = [b[rank * ROWS : (rank + 1) * ROWS] for b in global_batches()]
        before = [p.to_local().clone() for p in model.parameters()]
        first = next(model.parameters())
        first.grad = kept = torch.zeros_like(first)  # a caller's gradient, left alone
        results = {"values": {which: measure(model, local, which) for which in MEASURES}}
        after = list(model.parameters())
        try:
            adaptive_sharpness(model, loss_fn, local, rho=0.05, iters=2, kind="average")
            results["average"] = None
        except ValueError as error:
            results["average"] = str(error)
        try:
            adaptive_sharpness(model, loss_fn, local, process_group=dist.group.WORLD)
            results["process_group"] = None
        except ValueError as error:
            results["process_group"] = str(error)
        try:
            hessian_trace(model, loss_fn, local[:1], probes=1)
            results["hessian"] = None
        except ShardingError as error:
            results["hessian"] = str(error)
        results["unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(before, after))
        results["still_sharded"] = all(type(p).__name__ == "DTensor" for p in after)
        results["no_grads"] = all(p.grad is None for p in after[1:])
        results["grad_kept"] = after[0].grad is kept and not kept.to_local().any()
        results["memory"], results["boxes"] = ball_memory(model)
        results["layouts_derived"] = layouts_derived(model, local)
        results["fresh"] = fresh_buffers(model, local, 30)
        split = shard(build_llama(**SPLIT_HEADS), mesh)
        results["chunks"] = {
            name: [chunked_layout(m, size) for size in (1 << 30, 64)]
            for name, m in (("even", model), ("split", split))
        }
        results["split_heads"] = measure(split, local, "inv")
        if rank == 1:  # a NaN on one rank only: every rank must refuse, none wait
            with torch.no_grad():
                next(split.parameters()).to_local().view(-1)[0] = math.nan
        try:
            measure(split, local, "inv")
            results["nan"] = None
        except ValueError as error:
            results["nan"] = str(error)
        by_columns = shard(
            build_llama(), mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None
        )
        try:
            measure(by_columns, local, "mix")
            results["refusal"] = None
        except ShardingError as error:
            results["refusal"] = str(error)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(
        worker,
        args=(str(directory / "init"), str(directory)),
        nprocs=WORLD,
        join=True,
        start_method="spawn",
    )
    return [torch.load(directory / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process():
    torch.set_num_threads(1)
    model = build_llama()
    values = {which: measure(model, global_batches(), which) for which in MEASURES}
    values["split_heads"] = measure(build_llama(**SPLIT_HEADS), global_batches(), "inv")
    return values


@pytest.mark.parametrize("which", MEASURES)
def test_fsdp_value_is_the_single_process_value(fsdp_run, single_process, which):
    expected = single_process[which]
    values = [run["values"][which] for run in fsdp_run]
    assert values[0] == values[1]  # every rank returns the same value
    assert math.isclose(values[0], expected, rel_tol=1e-8), (values, expected)


def test_heads_split_over_ranks_and_uneven_rows_give_the_single_process_value(
    fsdp_run, single_process
):
    values = [run["split_heads"] for run in fsdp_run]
    assert values[0] == values[1]
    assert math.isclose(values[0], single_process["split_heads"], rel_tol=1e-8)


def test_a_nan_on_one_rank_is_refused_on_every_rank(fsdp_run):
    for run in fsdp_run:
        assert run["nan"] is not None and "NaN/Inf" in run["nan"]


def test_one_ranks_rows_alone_give_another_value(single_process):
    """The negative: the comparison above can fail; half of each batch is another problem."""
    half = [b[:ROWS] for b in global_batches()]
    value = measure(build_llama(), half, "mix")
    assert not math.isclose(value, single_process["mix"], rel_tol=1e-6)


def test_fsdp_model_is_left_as_it_was(fsdp_run):
    for run in fsdp_run:
        assert run["unchanged"] and run["still_sharded"]
        assert run["no_grads"] and run["grad_kept"]


def test_unsupported_placement_is_refused_with_how_to_shard(fsdp_run):
    for run in fsdp_run:
        assert run["refusal"] is not None
        assert "Shard(dim=1)" in run["refusal"] and "shard_placement_fn" in run["refusal"]


def test_average_case_hessian_and_process_group_are_refused(fsdp_run):
    for run in fsdp_run:
        assert run["average"] is not None and "kind='worst'" in run["average"]
        assert run["hessian"] is not None and "unsharded copy" in run["hessian"]
        assert run["process_group"] is not None and "process_group=None" in run["process_group"]


def test_ball_memory_per_rank_falls_with_the_ranks(fsdp_run):
    model = build_llama()
    plan = find_symmetries(model, metric="mix").bind(model)
    base = trainable_parameters(model)
    points = [p.detach() for p in plan.gather(base)]
    layout = BallLayout(plan, base, ball_groups(plan.groups, points, "second_order", True))
    single = layout.bytes_per_parameter(keep_best_gradient=True)["total"]
    per_rank = [run["memory"]["total"] for run in fsdp_run]
    assert max(per_rank) <= 0.6 * single, (per_rank, single)
    assert min(per_rank) >= 0.4 * single  # the pieces are balanced: about half each


def test_exchange_maps_are_boxes_not_an_index_per_entry(fsdp_run):
    """The heads' entries move between shards and ball pieces by strided boxes: a few
    per parameter kind (2 layers alike), a small fraction of a byte per parameter."""
    for run in fsdp_run:
        assert None not in run["boxes"], run["boxes"]
        assert max(run["boxes"]) <= 16, run["boxes"]
        assert run["memory"]["index"] < 0.25, run["memory"]


def test_the_exchange_is_built_chunk_by_chunk_without_an_index_of_a_whole_group(fsdp_run):
    """Built from chunks of 64 entries (a block or two), the ball and its maps are those
    built from whole groups, the largest integer tensor made meanwhile is a chunk's, not
    a group's, and no group's index map is built (``group.index``)."""
    for run in fsdp_run:
        for name, (whole, chunked) in run["chunks"].items():
            assert whole["pieces"] == chunked["pieces"] and whole["sizes"] == chunked["sizes"]
            assert torch.equal(whole["base"], chunked["base"])
            for a, b in zip(whole["maps"], chunked["maps"]):
                assert torch.equal(a, b), name
            assert max(chunked["boxes"]) <= 16, chunked["boxes"]  # alike chunks joined
            assert not whole["index_built"] and not chunked["index_built"]
            assert whole["largest"] >= whole["group_entries"]  # the negative: one chunk
            assert chunked["largest"] <= 256 < chunked["group_entries"], (name, chunked)


def test_a_later_call_on_the_same_plan_reuses_the_exchange(fsdp_run):
    for run in fsdp_run:
        assert run["layouts_derived"] == 1


@pytest.mark.parametrize("regular", [True, False], ids=["boxes", "irregular"])
def test_only_an_exchange_of_boxes_is_kept_for_the_next_call(regular, monkeypatch):
    """An exchange with an index per entry (an irregular layout) is derived again at every
    call rather than kept, as large as its groups, between calls."""
    from types import SimpleNamespace

    from geoopt_quotient.sharpness import sharded

    derived = []

    def layout(self, plan):
        derived.append(1)
        self.ball_size = 7
        return ["pieces"], SimpleNamespace(regular=regular, group=self.process_group)

    monkeypatch.setattr(sharded.ShardedBall, "_layout", layout)

    class Plan:  # a bound plan: any object the cache can hold weakly
        pass

    plan = Plan()
    for group in ("first", "second"):
        ball = sharded.ShardedBall.__new__(sharded.ShardedBall)
        ball.world, ball.rank, ball.device, ball.shards = 2, 0, "cpu", []
        ball.process_group = group
        pieces, exchange = ball._cached_layout(plan)
        assert pieces == ["pieces"] and ball.ball_size == 7 and exchange.group == group
    assert len(derived) == (1 if regular else 2)


def test_evaluations_reuse_the_sharded_balls_buffers(fsdp_run):
    """Over 30 iterations the ball's vectors are made only while Auto-PGD holds more of them
    than ever before (its base point, perturbed point, three iterates and two gradients, as
    in one process): each gradient goes into a vector the loop has freed, not a new one per
    evaluation; and every write and gradient passes through one buffer of the local shards'
    size."""
    for run in fsdp_run:
        made, seen = run["fresh"]
        assert made <= 2 + 5 and seen == 1, run["fresh"]
