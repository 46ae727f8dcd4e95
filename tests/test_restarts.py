"""Auto-PGD restarts from random points of the ball: never worse, deterministic."""

import pytest
from test_radius_grid import llama_case

from geoopt_quotient import adaptive_sharpness, geodesic_sharpness


def measure(name, model, loss_fn, batches, **options):
    if name == "adaptive":
        return adaptive_sharpness(model, loss_fn, batches, iters=4, **options)
    return geodesic_sharpness(model, loss_fn, batches, metric=name, iters=4, **options)


@pytest.mark.parametrize("name", ["adaptive", "inv", "mix"])
def test_restarts_never_lose_and_are_deterministic(name):
    model, loss_fn, batches = llama_case()
    plain = measure(name, model, loss_fn, batches, seed=3)
    restarted = measure(name, model, loss_fn, batches, seed=3, restarts=2)
    again = measure(name, model, loss_fn, batches, seed=3, restarts=2)
    assert all(b >= a for a, b in zip(plain.per_batch, restarted.per_batch))
    assert restarted.value >= plain.value
    assert restarted.per_batch == again.per_batch
    assert restarted.perturbed_losses == again.perturbed_losses
    assert restarted.clean_losses == plain.clean_losses
    # each restart is one more search of iters + 1 evaluations and iters gradients
    extra = [b - a for a, b in zip(plain.backward_passes, restarted.backward_passes)]
    assert all(e >= 2 * 4 for e in extra)
    other_seed = measure(name, model, loss_fn, batches, seed=4, restarts=2)
    assert other_seed.per_batch != restarted.per_batch or plain.per_batch == restarted.per_batch


def test_restarts_on_a_grid_and_checks():
    model, loss_fn, batches = llama_case()
    grid = measure("inv", model, loss_fn, batches, rho=[0.02, 0.05], restarts=1)
    assert grid[1].value >= grid[0].value
    with pytest.raises(ValueError, match="restarts"):
        measure("inv", model, loss_fn, batches, restarts=-1)
    with pytest.raises(TypeError, match="restarts"):
        measure("inv", model, loss_fn, batches, restarts=1.5)
    with pytest.raises(ValueError, match="worst"):
        measure("inv", model, loss_fn, batches, restarts=1, kind="average")
