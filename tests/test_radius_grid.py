"""Sharpness over a grid of radii: monotone by construction, single radii unchanged."""

import itertools
import math

import pytest
import torch
from conftest import tiny_bert_classifier, tiny_llama_causal_lm

from geoopt_quotient import (
    AdaptiveEuclidean,
    adaptive_sharpness,
    geodesic_sharpness,
    maximize_in_ball,
)
from geoopt_quotient.sharpness import DEFAULT_RADII, ResultList

SCALES = [0.25, 0.5, 1.0]  # of the default radius: the exact paths integrate up to it


def llama_case():
    ids = torch.randint(0, 50, (2, 2, 6), generator=torch.Generator().manual_seed(1))

    def loss_fn(model, batch):
        return model(input_ids=batch, labels=batch).loss

    pytest.importorskip("transformers")
    return tiny_llama_causal_lm().eval(), loss_fn, list(ids)


def bert_case():
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 30, (2, 3, 6), generator=g)
    labels = torch.randint(0, 3, (2, 3), generator=g)

    def loss_fn(model, batch):
        ids, y = batch
        return model(input_ids=ids, labels=y).loss

    return tiny_bert_classifier(), loss_fn, list(zip(tokens, labels))


CASES = {"bert": bert_case, "llama": llama_case}
MEASURES = [
    ("adaptive", "straight"),
    ("inv", "second_order"),
    ("inv", "exact"),
    ("mix", "second_order"),
    ("mix", "exact"),
]


def sharpness(model, loss_fn, batches, measure, path, rho, iters=3):
    if measure == "adaptive":
        return adaptive_sharpness(model, loss_fn, batches, rho=rho, iters=iters)
    return geodesic_sharpness(
        model, loss_fn, batches, rho=rho, metric=measure, path=path, iters=iters
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("measure, path", MEASURES)
def test_values_over_a_grid_never_decrease(case, measure, path):
    model, loss_fn, batches = CASES[case]()
    radii = [scale * DEFAULT_RADII[measure] for scale in SCALES]
    grid = sharpness(model, loss_fn, batches, measure, path, radii)
    assert [r.settings["rho"] for r in grid] == radii
    for smaller, larger in itertools.pairwise(grid):
        assert all(b >= a for a, b in zip(smaller.per_batch, larger.per_batch))
        assert larger.value >= smaller.value
        assert larger.clean_losses == smaller.clean_losses
    assert grid[-1].value > grid[0].value > 0  # the radius matters on these models
    cold = sharpness(model, loss_fn, batches, measure, path, radii[-1])
    assert grid[-1].value >= cold.value
    assert all(b >= a for a, b in zip(cold.per_batch, grid[-1].per_batch))
    # the smallest radius has no previous maximiser: it is the single-radius run
    first = sharpness(model, loss_fn, batches, measure, path, radii[0])
    assert first.per_batch == grid[0].per_batch


def test_warm_start_can_beat_the_cold_search():
    """The negative: cold searches alone are not monotone in the radius on the tiny Llama
    (mix, 3 iterations), the grid is."""
    model, loss_fn, batches = llama_case()
    radii = [0.05, 0.2, 1.0]
    cold = [sharpness(model, loss_fn, batches, "mix", "second_order", r).value for r in radii]
    grid = [r.value for r in sharpness(model, loss_fn, batches, "mix", "second_order", radii)]
    assert any(b < a for a, b in itertools.pairwise(cold)), cold
    assert all(b >= a for a, b in itertools.pairwise(grid)), grid
    assert all(g >= c for g, c in zip(grid, cold))


def test_grid_keeps_the_given_order_and_measures_each_radius_once():
    model, loss_fn, batches = bert_case()
    grid = adaptive_sharpness(model, loss_fn, batches[:1], rho=(0.3, 0.02, 0.3), iters=2)
    assert [r.settings["rho"] for r in grid] == [0.3, 0.02, 0.3]
    assert grid[0] is grid[2]
    assert grid[0].value >= grid[1].value


def test_a_grid_is_a_list_that_writes_one_table(tmp_path):
    import csv

    model, loss_fn, batches = bert_case()
    grid = adaptive_sharpness(model, loss_fn, batches, rho=[0.02, 0.08], iters=2)
    assert isinstance(grid, list) and isinstance(grid, ResultList)
    assert grid == [grid[0], grid[1]] and len(grid) == 2
    rows = grid.rows()
    assert [(row["rho"], row["batch"]) for row in rows] == [
        (0.02, 0),
        (0.02, 1),
        (0.08, 0),
        (0.08, 1),
    ]
    assert [row["sharpness"] for row in rows] == grid[0].per_batch + grid[1].per_batch
    with open(grid.to_csv(str(tmp_path / "grid.csv")), newline="") as file:
        written = list(csv.DictReader(file))
    assert [float(row["sharpness"]) for row in written] == [row["sharpness"] for row in rows]
    pytest.importorskip("pandas")
    frame = grid.to_frame()
    assert frame.shape[0] == 4 and list(frame["rho"]) == [0.02, 0.02, 0.08, 0.08]
    single = adaptive_sharpness(model, loss_fn, batches, rho=0.02, iters=2)
    assert not isinstance(single, list)  # one radius: one result, as before
    assert single.per_batch == grid[0].per_batch


def test_single_radius_value_is_unchanged():
    """A value computed before radius grids existed (relative tolerance for the BLAS)."""
    torch.manual_seed(0)
    model = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    xs = [torch.randn(4, 5, 8, dtype=torch.float64) for _ in range(2)]

    def loss_fn(model, x):
        out, _ = model(x, x, x)
        return out.pow(2).mean()

    result = geodesic_sharpness(model, loss_fn, xs, rho=0.1, iters=5)
    assert isinstance(result.value, float)
    assert math.isclose(result.value, float.fromhex("0x1.ab9c2493fe2fap-6"), rel_tol=1e-10)


def test_average_case_grid_equals_separate_calls():
    model, loss_fn, batches = bert_case()
    grid = adaptive_sharpness(model, loss_fn, batches, rho=[0.02, 0.08], iters=2, kind="average")
    for rho, result in zip([0.02, 0.08], grid):
        alone = adaptive_sharpness(model, loss_fn, batches, rho=rho, iters=2, kind="average")
        assert result.per_batch == alone.per_batch


@pytest.mark.parametrize("rho", [[], [0.1, -0.1], [0.1, float("nan")]])
def test_bad_grids_are_refused(rho):
    model, loss_fn, batches = bert_case()
    with pytest.raises(ValueError, match="rho"):
        adaptive_sharpness(model, loss_fn, batches, rho=rho, iters=2)


def test_maximize_in_ball_starts_at_a_given_vector_projected_into_the_ball():
    w = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    g = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    groups = [(w, AdaptiveEuclidean(ndim=1))]

    def objective(points):
        return (points[0] * g).sum() - 0.1 * points[0].pow(2).sum()

    small = maximize_in_ball(groups, objective, rho=0.1, iters=5, path="straight")
    start = [v.clone() for v in small.xi]
    warm = maximize_in_ball(groups, objective, rho=0.5, iters=1, path="straight", init=start)
    assert warm.initial_value == small.value  # inside the larger ball: not moved
    assert torch.equal(start[0], small.xi[0])  # the given vector is not written to
    far = [100 * w]  # |xi|_w = 100 * sqrt(3): projected onto the sphere of radius 0.5
    outside = maximize_in_ball(groups, objective, rho=0.5, iters=1, path="straight", init=far)
    assert outside.initial_value == pytest.approx(float(objective([w + w * 0.5 / 3**0.5])))
    with pytest.raises(ValueError, match="init"):
        maximize_in_ball(groups, objective, rho=0.5, iters=1, init=[torch.zeros(2)])
