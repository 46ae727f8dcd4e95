"""Batches over the ranks of a process group (``process_group=``) give the one-process
result on every rank, and a rank that raises makes every rank raise.

Two gloo ranks are spawned once for the module (:mod:`ranks_harness`); each runs every
check on its share of the batches and sends back plain values.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_llama_causal_lm  # noqa: E402
from ranks_harness import run_on_ranks  # noqa: E402

from geoopt_quotient import (  # noqa: E402
    adaptive_sharpness,
    calibrate_rho,
    geodesic_sharpness,
    hessian_top_eigenvalue,
    hessian_trace,
)
from geoopt_quotient.sharpness.ranks import (  # noqa: E402
    RankFailedError,
    global_index,
    share_sizes,
    weighted_mean_over_ranks,
)

BATCHES = 5  # shares of 3 and 2 batches on 2 ranks
RTOL = 1e-10


def problem():
    """The tiny float64 Llama and five batches of token ids."""
    model = tiny_llama_causal_lm().eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2 * BATCHES, 8), generator=generator)
    return model, [ids[i : i + 2] for i in range(0, 2 * BATCHES, 2)]


def lm_loss(model, ids):
    """Next-token cross-entropy in float64 (the model's own loss is float32)."""
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def poisoned_loss(model, ids):
    """:func:`lm_loss`, raising on a batch with negative token ids."""
    if (ids < 0).any():
        raise ValueError("a poisoned batch")
    return lm_loss(model, ids)


SHARPNESS = {
    "adaptive": lambda m, b, **kw: adaptive_sharpness(m, lm_loss, b, rho=0.1, iters=3, **kw),
    "adaptive_average": lambda m, b, **kw: adaptive_sharpness(
        m, lm_loss, b, rho=0.1, iters=3, kind="average", seed=7, **kw
    ),
    "inv": lambda m, b, **kw: geodesic_sharpness(m, lm_loss, b, metric="inv", iters=3, **kw),
    "mix": lambda m, b, **kw: geodesic_sharpness(m, lm_loss, b, metric="mix", iters=3, **kw),
}
HESSIAN = {
    "trace": lambda m, b, **kw: hessian_trace(m, lm_loss, b, probes=2, seed=3, **kw),
    "top": lambda m, b, **kw: hessian_top_eigenvalue(m, lm_loss, b, iters=3, seed=3, **kw),
}
GRID = [0.05, 0.1]
CALIBRATION = dict(target=0.05, measure="adaptive", iters=2, rtol=0.2, max_evals=8)


def summary(result):
    """The values that must agree, as plain Python values."""
    return dict(
        value=result.value,
        per_batch=result.per_batch,
        clean=result.clean_losses,
        perturbed=result.perturbed_losses,
        histories=result.histories,
        seconds=result.seconds,
    )


def outcome(call):
    """``("ok", value)`` or ``(exception type name, message)``."""
    try:
        return "ok", call()
    except Exception as error:
        return type(error).__name__, str(error)


def checks(rank: int, world: int) -> dict:
    """Every check on this rank's share (``batches[rank::world]``)."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    group = dist.group.WORLD
    model, batches = problem()
    share = batches[rank::world]
    before = [p.detach().clone() for p in model.parameters()]
    out = {name: summary(f(model, share, process_group=group)) for name, f in SHARPNESS.items()}
    for name, f in HESSIAN.items():
        result = f(model, share, process_group=group)
        out[name] = dict(value=result.value, per_batch=result.per_batch, samples=result.samples)
    rho, history = calibrate_rho(
        model, lm_loss, share, process_group=group, return_history=True, **CALIBRATION
    )
    out["calibrate"] = dict(rho=rho, history=[(h.rho, h.value, h.clean_loss) for h in history])
    grid = adaptive_sharpness(model, lm_loss, share, rho=GRID, iters=2, process_group=group)
    out["grid"] = [summary(r) for r in grid]
    # no process group: this rank's share alone, with no communication (population's case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["local"] = SHARPNESS["adaptive"](model, share, distributed=False).value
    out["local_warnings"] = [w.category.__name__ for w in caught]
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the older mode on the same group: every rank passes all batches
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["older"] = {
            name: summary(SHARPNESS[name](model, batches)) for name in ("adaptive", "inv")
        }
    out["older_warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    # shares that are not a strided deal, and an empty share, are refused on every rank
    out["uneven"] = outcome(
        lambda: SHARPNESS["adaptive"](model, batches[: 1 + 2 * rank], process_group=group)
    )
    out["empty"] = outcome(lambda: SHARPNESS["adaptive"](model, share[:rank], process_group=group))
    # rank 1's loss raises on its second batch: rank 1 re-raises, rank 0 raises too
    poisoned = [b if (rank, i) != (1, 1) else -b for i, b in enumerate(share)]
    out["failure"] = outcome(
        lambda: adaptive_sharpness(
            model, poisoned_loss, poisoned, rho=0.1, iters=2, process_group=group
        )
    )
    out["failure_hessian"] = outcome(
        lambda: hessian_trace(model, poisoned_loss, poisoned, probes=1, process_group=group)
    )
    # rank 0 holds 3 batches of mean 1, rank 1 two of mean 2: the mean of all five
    mine = torch.full((2, 3), float(rank + 1), dtype=torch.float64)
    (mean,) = weighted_mean_over_ranks([mine], len(share), group)
    out["weighted_mean"] = (mean.tolist(), mine.tolist())
    # the group still works afterwards
    out["after"] = SHARPNESS["adaptive"](model, share, process_group=group).value
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every check's results on each of the two ranks."""
    return run_on_ranks(checks, tmp_path_factory.mktemp("process_group"))


@pytest.fixture(scope="module")
def single():
    """The same measurements in this process, on all batches."""
    warnings.simplefilter("ignore")
    model, batches = problem()
    out = {name: summary(f(model, batches)) for name, f in SHARPNESS.items()}
    for name, f in HESSIAN.items():
        result = f(model, batches)
        out[name] = dict(value=result.value, per_batch=result.per_batch, samples=result.samples)
    rho, history = calibrate_rho(model, lm_loss, batches, return_history=True, **CALIBRATION)
    grid = adaptive_sharpness(model, lm_loss, batches, rho=GRID, iters=2)
    out["grid"] = [summary(r) for r in grid]
    out["local"] = [SHARPNESS["adaptive"](model, batches[r::2]).value for r in (0, 1)]
    out["calibrate"] = dict(rho=rho, history=[(h.rho, h.value, h.clean_loss) for h in history])
    return out


def close(a, b):
    return a == pytest.approx(b, rel=RTOL, abs=0)


@pytest.mark.parametrize("name", sorted(SHARPNESS))
def test_sharpness_over_ranks_is_the_single_process_value(ranks, single, name):
    one = single[name]
    for rank in (0, 1):
        got = ranks[rank][name]
        assert close(got["value"], one["value"])
        assert close(got["per_batch"], one["per_batch"])  # gathered in global order
        assert close(got["clean"], one["clean"])
        assert close(got["perturbed"], one["perturbed"])
        for mine, theirs in zip(got["histories"], one["histories"]):
            assert close(mine, theirs)
    assert ranks[0][name] == ranks[1][name]  # identical, seconds included


def test_a_grid_of_radii_over_ranks_is_the_single_process_grid(ranks, single):
    for rank in (0, 1):
        for got, one in zip(ranks[rank]["grid"], single["grid"], strict=True):
            assert close(got["per_batch"], one["per_batch"])
            assert close(got["value"], one["value"])
    assert ranks[0]["grid"] == ranks[1]["grid"]


def test_without_a_process_group_each_rank_measures_its_own_batches(ranks, single):
    # population shards models over ranks this way: no communication at all
    for rank in (0, 1):
        assert close(ranks[rank]["local"], single["local"][rank])
    assert not close(single["local"][0], single["local"][1])


def test_per_batch_is_in_global_order_not_in_rank_order(ranks, single):
    per_batch = single["adaptive"]["per_batch"]
    rank_order = per_batch[0::2] + per_batch[1::2]
    assert rank_order != per_batch  # the test can tell the two orders apart
    assert close(ranks[0]["adaptive"]["per_batch"], per_batch)


def test_average_case_is_seeded_by_the_global_index(ranks, single):
    # seeding by the local index would repeat batch 0's samples on rank 1's first batch
    assert close(ranks[1]["adaptive_average"]["value"], single["adaptive_average"]["value"])


@pytest.mark.parametrize("name", sorted(HESSIAN))
def test_hessian_over_ranks_is_the_single_process_value(ranks, single, name):
    one = single[name]
    for rank in (0, 1):
        got = ranks[rank][name]
        assert close(got["value"], one["value"])
        assert close(got["per_batch"], one["per_batch"])
        for mine, theirs in zip(got["samples"], one["samples"]):
            assert close(mine, theirs)
    assert ranks[0][name] == ranks[1][name]


def test_calibration_over_ranks_makes_the_same_decisions(ranks, single):
    one = single["calibrate"]
    for rank in (0, 1):
        got = ranks[rank]["calibrate"]
        assert [h[0] for h in got["history"]] == pytest.approx([h[0] for h in one["history"]])
        assert close([h[1] for h in got["history"]], [h[1] for h in one["history"]])
        assert close(got["rho"], one["rho"])
    assert ranks[0]["calibrate"] == ranks[1]["calibrate"]


def test_the_model_is_unchanged(ranks):
    assert ranks[0]["unchanged"] and ranks[1]["unchanged"]


@pytest.mark.parametrize("name", ["adaptive", "inv"])
def test_the_older_mode_with_all_batches_on_every_rank_still_works(ranks, single, name):
    # distributed=None under an initialised group: batch i on rank i % 2, gathered
    for rank in (0, 1):
        got = ranks[rank]["older"][name]
        assert close(got["value"], single[name]["value"])
        assert close(got["per_batch"], single[name]["per_batch"])


def test_the_older_mode_warns_that_it_is_deprecated_and_says_what_to_pass(ranks):
    for rank in (0, 1):
        older = [
            m for c, m in ranks[rank]["older_warnings"] if c == "DistributedModeDeprecationWarning"
        ]
        assert len(older) == 2  # one per call
        assert "process_group=" in older[0] and "batches[rank::world_size]" in older[0]
        # distributed=False, no communication: nothing deprecated
        assert "DistributedModeDeprecationWarning" not in ranks[rank]["local_warnings"]


def test_shares_that_are_not_a_strided_deal_are_refused_on_every_rank(ranks):
    for rank in (0, 1):
        kind, message = ranks[rank]["uneven"]
        assert kind == "ValueError" and "[1, 3]" in message and "[2, 2]" in message
        kind, message = ranks[rank]["empty"]
        assert kind == "ValueError" and "rank 0 of 2 has no batches" in message


@pytest.mark.parametrize("check", ["failure", "failure_hessian"])
def test_a_rank_that_raises_makes_every_rank_raise(ranks, check):
    kind, message = ranks[1][check]
    assert (kind, message) == ("ValueError", "a poisoned batch")
    kind, message = ranks[0][check]
    assert kind == RankFailedError.__name__
    assert "rank 1 raised ValueError: a poisoned batch" in message
    assert "traceback printed by rank 1" in message
    assert ranks[0]["after"] == ranks[1]["after"]  # the group is usable afterwards


def test_weighted_mean_over_ranks_weights_by_batch_count(ranks):
    for rank in (0, 1):
        mean, mine = ranks[rank]["weighted_mean"]
        assert [x for row in mean for x in row] == pytest.approx([(3 + 2 * 2) / 5] * 6, rel=1e-15)
        assert mine == [[float(rank + 1)] * 3] * 2  # the input is not modified


def test_process_group_none_changes_nothing():
    model, batches = problem()
    for f in (SHARPNESS["adaptive"], SHARPNESS["mix"], HESSIAN["trace"]):
        default, explicit = f(model, batches[:2]), f(model, batches[:2], process_group=None)
        if hasattr(default, "seconds"):
            default.seconds = explicit.seconds = 0.0
            default.seconds_per_batch = explicit.seconds_per_batch = []
        assert default == explicit


def test_process_group_with_distributed_true_is_refused():
    model, batches = problem()
    with pytest.raises(ValueError, match="not both"):
        adaptive_sharpness(model, lm_loss, batches[:1], distributed=True, process_group=object())


def test_global_index_inverts_the_strided_deal():
    for total in range(1, 8):
        for world in (1, 2, 3):
            sizes = share_sizes(total, world)
            assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
            indices = sorted(
                global_index(i, r, world) for r in range(world) for i in range(sizes[r])
            )
            assert indices == list(range(total))
            dealt = [list(range(total))[r::world] for r in range(world)]
            assert [len(d) for d in dealt] == sizes
            assert all(
                dealt[r][i] == global_index(i, r, world)
                for r in range(world)
                for i in range(sizes[r])
            )
