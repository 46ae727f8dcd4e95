"""A step too large for the curvature: an error of the package naming the learning rate."""

from __future__ import annotations

import geoopt
import pytest
import torch

from geoopt_quotient import GeooptQuotientError, GLQuotient
from geoopt_quotient.optim import RiemannianAdam, RiemannianSGD, StepSizeError

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("single_thread")


def train(optimizer_cls, lr: float, steps: int = 20, **kwargs) -> torch.Tensor:
    """Fit ``G H^T`` to a random target on the inv quotient; the final point."""
    gen = torch.Generator().manual_seed(0)
    manifold = GLQuotient(5, 4, "inv")
    start = torch.randn(9, 2, generator=gen, dtype=F64)
    target = torch.randn(5, 4, generator=gen, dtype=F64)
    point = geoopt.ManifoldParameter(start, manifold=manifold)
    optimizer = optimizer_cls([point], lr=lr, **kwargs)
    for _ in range(steps):
        optimizer.zero_grad()
        ((manifold.product(point) - target) ** 2).sum().backward()
        optimizer.step()
    return point.detach()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_too_large_sgd_step_names_the_learning_rate(momentum):
    with pytest.raises(StepSizeError, match=r"RiemannianSGD \(lr=10\).*lower the learning rate"):
        train(RiemannianSGD, lr=10.0, momentum=momentum)


def test_the_error_is_the_packages_and_still_a_linalg_error():
    with pytest.raises(StepSizeError) as caught:
        train(RiemannianSGD, lr=10.0)
    assert isinstance(caught.value, GeooptQuotientError)
    assert isinstance(caught.value, torch.linalg.LinAlgError)  # what was raised before
    assert isinstance(caught.value.__cause__, torch.linalg.LinAlgError)
    assert "off the manifold: parameter 0 of group 0 on GLQuotient" in str(caught.value)


def test_a_rank_deficient_start_is_reported_too():
    manifold = GLQuotient(3, 3, "inv")
    point = geoopt.ManifoldParameter(torch.zeros(6, 2, dtype=F64), manifold=manifold)
    point.grad = torch.ones_like(point)
    with pytest.raises(StepSizeError, match=r"rank-deficient.*starting point"):
        RiemannianAdam([point], lr=0.1).step()


def test_a_stable_learning_rate_raises_nothing():
    point = train(RiemannianSGD, lr=0.01)
    assert GLQuotient(5, 4, "inv").check_point_on_manifold(point)
