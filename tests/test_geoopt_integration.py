"""The manifolds inside Geoopt: ``geoopt.Scaled``, ``ManifoldParameter`` and the optimizers.

The key property: Riemannian SGD (and Riemannian Adam) on the quotient are
GL(h)-equivariant, so trajectories started from ``X`` and from ``act(X, A)`` describe the
same sequence of products :math:`G H^\\top`; plain Euclidean SGD is not.
"""

from __future__ import annotations

import geoopt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import AdaptiveEuclidean, DiagonalQuotient, GLQuotient
from geoopt_quotient.testing import gl_elements

F64 = torch.float64
METRICS = ("inv", "mix")
SEEDS = st.integers(0, 2**32 - 1)
# learning rates that are stable for the problems below (targets with O(1) factors):
# the inv-metric gradient scales like |X|^3, the mix one like |X|^-1
SGD_LR = {"mix": 0.1, "inv": 0.01}
ADAM_LR = 0.1


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def problem(seed, n=5, m=4, h=2, noise=0.3):
    """A rank-h target M = G* H*^T and a start X = [G*; H*] + noise.

    The factors have orthogonal columns of lengths in [e^-0.3, e^0.3], so that one
    learning rate per metric is stable for every seed (checked on 150 seeds: the loss
    decreases over 20 steps for every optimizer and metric).
    """
    gen = torch.Generator().manual_seed(seed)

    def factor(rows):
        q, _ = torch.linalg.qr(torch.randn(rows, h, generator=gen, dtype=F64))
        return q * torch.exp(torch.empty(h, dtype=F64).uniform_(-0.3, 0.3, generator=gen))

    g_star, h_star = factor(n), factor(m)
    x0 = torch.cat((g_star, h_star)) + noise * torch.randn(n + m, h, generator=gen, dtype=F64)
    return g_star @ h_star.mT, x0


def loss_fn(manifold, x, target):
    return ((manifold.product(x) - target) ** 2).sum()


def run_optimizer(manifold, x0, target, make_optimizer, steps):
    """Run ``steps`` steps; return the final point and the losses (before each step)."""
    param = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
    optimizer = make_optimizer([param])
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(manifold, param, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        assert torch.isfinite(param).all()
    return param.detach().clone(), losses


def make_sgd(metric):
    return lambda params: geoopt.optim.RiemannianSGD(params, lr=SGD_LR[metric])


def make_adam(metric):
    return lambda params: geoopt.optim.RiemannianAdam(params, lr=ADAM_LR, weight_decay=0.0)


# ----------------------------------------------------------------------------- Scaled
def _points(base):
    gen = torch.Generator().manual_seed(0)
    shape = {GLQuotient: (3, 7, 2), DiagonalQuotient: (3, 2, 4), AdaptiveEuclidean: (3, 5)}
    x = torch.randn(shape[type(base)], generator=gen, dtype=F64)
    u = base.proju(x, torch.randn(x.shape, generator=gen, dtype=F64))
    v = base.proju(x, torch.randn(x.shape, generator=gen, dtype=F64))
    return x, u, v


@pytest.mark.parametrize(
    "base",
    [
        GLQuotient(4, 3, "mix"),
        GLQuotient(4, 3, "inv", retraction="first_order"),
        DiagonalQuotient("inv"),
        DiagonalQuotient("mix"),
        AdaptiveEuclidean(eps=0.1, ndim=1),
    ],
    ids=repr,
)
def test_scaled_wrapper_follows_geoopt_conventions(base):
    """``geoopt.Scaled(m, s)`` (geoopt 0.5.1) scales *distances* by s. Its convention:
    the metric methods (``inner``, ``norm``, ``proju``, ``egrad2rgrad``, ``transp``) are
    forwarded unchanged, and the maps that move points take the vector divided by s
    (``retr(x, u) = base.retr(x, u / s)``, likewise ``expmap``, ``retr_transp``). In
    particular ``inner`` is *not* multiplied by s**2. Everything is called by keyword."""
    scaled = geoopt.Scaled(base, 2.0)
    x, u, v = _points(base)
    xi = 0.1 * u
    assert scaled.check_point_on_manifold(x) and scaled.ndim == base.ndim
    assert torch.equal(scaled.inner(x=x, u=u, v=v), base.inner(x, u, v))
    assert torch.equal(scaled.norm(x=x, u=u), base.norm(x, u))
    assert torch.equal(scaled.component_inner(x, u), base.component_inner(x, u))
    assert torch.equal(scaled.proju(x=x, u=u), base.proju(x, u))
    assert torch.equal(scaled.egrad2rgrad(x=x, u=u), base.egrad2rgrad(x, u))
    assert torch.allclose(scaled.retr(x=x, u=xi), base.retr(x, xi / 2), rtol=1e-14, atol=0)
    assert torch.allclose(scaled.expmap(x=x, u=xi), base.expmap(x, xi / 2), rtol=1e-14, atol=0)
    y = scaled.retr(x=x, u=xi)
    assert torch.equal(scaled.transp(x=x, y=y, v=v), base.transp(x, y, v))
    y2, w = scaled.retr_transp(x=x, u=xi, v=v)
    assert torch.allclose(y2, y, rtol=1e-14, atol=0)
    assert torch.equal(w, base.transp(x, y2, v))
    if isinstance(base, GLQuotient):
        # keyword-only extras of the base signature pass through the rescaling wrapper
        expected = base.expmap(x, xi / 2, steps=3)
        assert torch.allclose(scaled.expmap(x=x, u=xi, steps=3), expected, rtol=1e-14, atol=0)
    # the random helpers are forwarded
    assert scaled.random(*x.shape, dtype=F64).shape == x.shape
    assert scaled.random_tangent(x).shape == x.shape


def test_scaled_manifold_parameter_is_optimised():
    base = GLQuotient(5, 4, "mix")
    manifold = geoopt.Scaled(base, 2.0)
    target, x0 = problem(0)
    param = geoopt.ManifoldParameter(x0.clone(), manifold=manifold)
    optimizer = geoopt.optim.RiemannianSGD([param], lr=2 * SGD_LR["mix"])
    first = None
    for _ in range(100):
        optimizer.zero_grad()
        loss = loss_fn(base, param, target)
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    assert loss.item() < 1e-8 * first
    assert manifold.check_point_on_manifold(param)


# ----------------------------------------------------------------------------- optimizers
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("metric", METRICS)
def test_riemannian_optimizers_minimise_an_invariant_loss(metric, optimizer, seed):
    """|G H^T - M|^2 with M of rank h, from a perturbation of a factorisation of M.
    Measured over these seeds, final/initial loss after 300 steps: <= 3e-5 for
    inv + SGD (the slowest: the inv gradient is not preconditioned), <= 1e-13 otherwise;
    the bound 1e-3 leaves margin."""
    manifold = GLQuotient(5, 4, metric)
    target, x0 = problem(seed)
    make = make_sgd(metric) if optimizer == "sgd" else make_adam(metric)
    x, losses = run_optimizer(manifold, x0, target, make, steps=300)
    final = loss_fn(manifold, x, target).item()
    assert final < 1e-3 * losses[0], (losses[0], final)
    assert manifold.check_point_on_manifold(x)
    manifold.assert_check_point_on_manifold(x)


def test_riemannian_sgd_on_the_diagonal_and_adaptive_manifolds():
    gen = torch.Generator().manual_seed(5)
    beta = torch.randn(6, generator=gen, dtype=F64)
    diag = DiagonalQuotient("mix")
    start = diag.from_factors(beta.sign() * beta.abs().sqrt(), beta.abs().sqrt())
    start = start * torch.exp(0.3 * torch.randn(start.shape, generator=gen, dtype=F64))
    param = geoopt.ManifoldParameter(start.clone(), manifold=diag)
    optimizer = geoopt.optim.RiemannianSGD([param], lr=0.1)
    for _ in range(100):
        optimizer.zero_grad()
        loss = ((diag.product(param) - beta) ** 2).sum()
        loss.backward()
        optimizer.step()
    assert ((diag.product(param) - beta) ** 2).sum().item() < 1e-12
    assert diag.check_point_on_manifold(param)

    # AdaptiveEuclidean with eps = 0: zero weights are frozen under optimisation
    adaptive = AdaptiveEuclidean(eps=0.0)
    w0 = torch.tensor([0.5, 0.0, 2.0, 1.0], dtype=F64)
    param = geoopt.ManifoldParameter(w0.clone(), manifold=adaptive)
    optimizer = geoopt.optim.RiemannianAdam([param], lr=0.05)
    for _ in range(50):
        optimizer.zero_grad()
        ((param - 3.0) ** 2).sum().backward()
        optimizer.step()
    assert param[1].item() == 0.0
    assert torch.isfinite(param).all()
    assert (param - 3.0).abs()[[0, 2, 3]].max() < (w0 - 3.0).abs()[[0, 2, 3]].min()


# ----------------------------------------------------------------------------- equivariance
def plain_sgd(manifold, x0, target, lr, steps):
    x = x0.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([x], lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(manifold, x, target).backward()
        optimizer.step()
    return x.detach()


@settings(max_examples=10, deadline=None)
@given(
    metric=st.sampled_from(METRICS),
    seed=SEEDS,
    a=gl_elements(2, max_condition=1e3, min_condition=10.0),
)
def test_riemannian_trajectories_are_equivariant_and_euclidean_ones_are_not(metric, seed, a):
    """20 steps from X and from act(X, A), cond(A) in [10, 1e3]. The Riemannian runs
    give the same products G H^T to 1e-8 (relative); the Euclidean runs do not (> 1e-3),
    although both stay finite (their step is 0.2 / (a bound of the loss' curvature))."""
    manifold = GLQuotient(5, 4, metric)
    target, x0 = problem(seed % 1000)
    x0a = manifold.act(x0, a)
    steps = 20
    for make in (make_sgd(metric), make_adam(metric)):
        x, losses = run_optimizer(manifold, x0, target, make, steps)
        xa, losses_a = run_optimizer(manifold, x0a, target, make, steps)
        assert rel_diff(manifold.product(xa), manifold.product(x)) < 1e-8
        assert abs(losses_a[-1] - losses[-1]) <= 1e-8 * losses[0]
        # the trajectory did go somewhere: not a vacuous comparison
        assert rel_diff(manifold.product(x), manifold.product(x0)) > 1e-2
        assert losses[-1] < losses[0]

    def curvature_bound(x):
        g, h = manifold.factors(x)
        residual = (manifold.product(x) - target).norm()
        return (
            2 * (torch.linalg.matrix_norm(g, 2) ** 2 + torch.linalg.matrix_norm(h, 2) ** 2)
            + 2 * residual
        )

    lr = 0.2 / max(curvature_bound(x0).item(), curvature_bound(x0a).item())
    y = plain_sgd(manifold, x0, target, lr, steps)
    ya = plain_sgd(manifold, x0a, target, lr, steps)
    assert torch.isfinite(y).all() and torch.isfinite(ya).all()
    assert rel_diff(manifold.product(ya), manifold.product(y)) > 1e-3
