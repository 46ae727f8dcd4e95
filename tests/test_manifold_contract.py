"""Every manifold of the package against Geoopt's ``Manifold`` contract.

Modelled on what Geoopt's own generic tests check of its manifolds (projections onto the
manifold and the tangent space, retractions and transports, broadcasting over a batch,
``retr_transp``, reversibility, the metric's shapes, ``random`` and ``origin``), plus
what a Riemannian optimizer relies on: the retraction's first order, the Riemannian
gradient's defining identity, and a metric differentiable in the point.

Points are drawn well conditioned (GL factors with orthonormal columns scaled by
:math:`e^{\\pm 1/2}`, other entries of modulus in :math:`[1/2, 2]`), so that float64
rounding stays far below :data:`TOL` and any error of a formula far above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import geoopt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geoopt_quotient import (
    AdaptiveEuclidean,
    DiagonalQuotient,
    GLQuotient,
    PositiveScalingQuotient,
    RotaryGLQuotient,
)

F64 = torch.float64
#: Relative tolerance of float64 comparisons (2^-30: about 10^7 roundings of 2^-53).
TOL = 2.0**-30
SEEDS = st.integers(0, 2**32 - 1)
BATCH = 4

pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


def gl_point(n: int, m: int, h: int) -> Callable:
    def draw(gen: torch.Generator, batch: Tuple[int, ...]) -> torch.Tensor:
        def factor(rows):
            q, _ = torch.linalg.qr(torch.randn(*batch, rows, h, generator=gen, dtype=F64))
            scales = torch.empty(*batch, 1, h, dtype=F64).uniform_(-0.5, 0.5, generator=gen)
            return q * scales.exp()

        return torch.cat((factor(n), factor(m)), dim=-2)

    return draw


def signed_entries(gen: torch.Generator, size: Tuple[int, ...]) -> torch.Tensor:
    """Entries of random sign and of modulus in :math:`[1/2, 2]`."""
    sign = torch.randint(0, 2, size, generator=gen).to(F64).mul_(2).sub_(1)
    return sign * torch.empty(size, dtype=F64).uniform_(-0.7, 0.7, generator=gen).exp()


def diagonal_point(d: int) -> Callable:
    return lambda gen, batch: signed_entries(gen, (*batch, 2, d))


def euclidean_point(*shape: int, frozen: bool = False) -> Callable:
    def draw(gen: torch.Generator, batch: Tuple[int, ...]) -> torch.Tensor:
        x = signed_entries(gen, (*batch, *shape))
        if frozen:  # zero weights with eps=0 admit no perturbation
            x.view(-1, shape[-1])[:, 0] = 0
        return x

    return draw


@dataclass
class Case:
    manifold: geoopt.Manifold
    shape: Tuple[int, ...]
    draw: Callable[[torch.Generator, Tuple[int, ...]], torch.Tensor]
    #: whether every vector is tangent (no group, nothing frozen)
    flat: bool = False
    #: whether the points have frozen entries (zero weights of AdaptiveEuclidean, eps=0)
    frozen: bool = False

    def __repr__(self) -> str:
        return repr(self.manifold)


CASES = [
    Case(GLQuotient(4, 3, "mix"), (7, 2), gl_point(4, 3, 2)),
    Case(GLQuotient(4, 3, "inv"), (7, 2), gl_point(4, 3, 2)),
    Case(GLQuotient(3, 4, "inv", 0.1, retraction="first_order"), (7, 2), gl_point(3, 4, 2)),
    Case(RotaryGLQuotient(4, 5, rotary_dim=2, metric="mix"), (9, 3), gl_point(4, 5, 3)),
    Case(
        RotaryGLQuotient(5, 4, rotary_dim=2, pairing="interleaved", metric="inv"),
        (9, 4),
        gl_point(5, 4, 4),
    ),
    Case(PositiveScalingQuotient(3, 2, "inv"), (5, 1), gl_point(3, 2, 1)),
    Case(DiagonalQuotient("mix"), (2, 5), diagonal_point(5)),
    Case(DiagonalQuotient("inv", retraction="first_order"), (2, 5), diagonal_point(5)),
    Case(AdaptiveEuclidean(eps=0.1, ndim=1), (6,), euclidean_point(6), flat=True),
    Case(AdaptiveEuclidean(ndim=2), (3, 4), euclidean_point(3, 4, frozen=True), frozen=True),
    Case(AdaptiveEuclidean(), (5,), euclidean_point(5), flat=True),
]

cases = pytest.mark.parametrize("case", CASES, ids=repr)
examples = settings(max_examples=6, deadline=None)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None):
    """Equal to :data:`TOL` relative to the larger of ``scale`` (default: ``expected``'s
    largest entry) and 1."""
    actual, expected = torch.broadcast_tensors(actual, expected)
    bound = float(expected.abs().max()) if scale is None else scale
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= TOL * max(bound, 1.0), f"off by {error:.3g} (scale {bound:.3g})"


def setup(case: Case, seed: int, batch: Tuple[int, ...] = ()):
    """A point, two tangent vectors there and an ambient vector, of batch shape ``batch``."""
    gen = torch.Generator().manual_seed(seed)
    x = case.draw(gen, batch)
    ambient = torch.randn(x.shape, generator=gen, dtype=F64)
    u = case.manifold.proju(x, torch.randn(x.shape, generator=gen, dtype=F64))
    v = case.manifold.proju(x, torch.randn(x.shape, generator=gen, dtype=F64))
    return x, u, v, ambient


def manifold_sum(case: Case, value: torch.Tensor) -> torch.Tensor:
    """Sum over the manifold's own (trailing) dimensions."""
    dims = tuple(range(-case.manifold.ndim, 0))
    return value.sum(dims) if dims else value


def batch_shape(case: Case, x: torch.Tensor) -> Tuple[int, ...]:
    return tuple(x.shape[: x.dim() - case.manifold.ndim])


# ------------------------------------------------------------------------ projections
@cases
@examples
@given(seed=SEEDS)
def test_points_are_on_the_manifold_and_projx_keeps_them(case, seed):
    x, *_ = setup(case, seed, (BATCH,))
    case.manifold.assert_check_point_on_manifold(x)
    assert torch.equal(case.manifold.projx(x), x)
    for point in x:
        case.manifold.assert_check_point_on_manifold(point)


@cases
@examples
@given(seed=SEEDS)
def test_proju_is_the_orthogonal_projection_onto_the_tangent_space(case, seed):
    manifold = case.manifold
    x, _, v, ambient = setup(case, seed)
    projected = manifold.proju(x, ambient)
    manifold.assert_check_vector_on_tangent(x, projected)
    assert_close(manifold.proju(x, projected), projected)  # idempotent
    # the removed part is orthogonal to the tangent space in the metric
    residual = manifold.inner(x, ambient - projected, v)
    assert_close(residual, torch.zeros_like(residual), scale=float(manifold.norm(x, v).max()))
    if case.flat:
        assert torch.equal(projected, ambient)
    else:  # the check tells an ambient vector from a tangent one
        assert not manifold.check_vector_on_tangent(x, ambient)


# ------------------------------------------------------------------------ retraction, transport
@cases
@examples
@given(seed=SEEDS)
def test_retraction_is_a_first_order_map_onto_the_manifold(case, seed):
    manifold = case.manifold
    x, u, *_ = setup(case, seed)
    y = manifold.retr(x, 0.1 * u)
    manifold.assert_check_point_on_manifold(y)
    assert torch.equal(manifold.retr(x, torch.zeros_like(u)), x)
    assert_close(manifold.expmap(x, torch.zeros_like(u)), x)
    # d/dt retr(x, t u) at t = 0 is u (central difference: error O(t^2) + rounding / t)
    t = 2.0**-14
    slope = (manifold.retr(x, t * u) - manifold.retr(x, -t * u)) / (2 * t)
    error = float((slope - u).abs().max())
    assert error <= 64 * t**2 * max(1.0, float(u.abs().max()) ** 3), error


@cases
@examples
@given(seed=SEEDS)
def test_transports_land_in_the_tangent_space_and_agree(case, seed):
    manifold = case.manifold
    x, u, v, _ = setup(case, seed)
    u = 0.1 * u
    y = manifold.retr(x, u)
    moved = manifold.transp(x, y, v)
    manifold.assert_check_vector_on_tangent(y, moved)
    y2, moved2 = manifold.retr_transp(x, u, v)
    assert torch.equal(y2, y) and torch.equal(moved2, moved)
    assert torch.equal(manifold.transp_follow_retr(x, u, v), moved)
    z, carried = manifold.expmap_transp(x, u, v)
    assert torch.equal(z, manifold.expmap(x, u))
    assert torch.equal(carried, manifold.transp(x, z, v))
    assert torch.equal(manifold.transp_follow_expmap(x, u, v), carried)
    manifold.assert_check_vector_on_tangent(z, carried)


@cases
@examples
@given(seed=SEEDS)
def test_retr_transp_is_reversible_where_the_manifold_says_so(case, seed):
    manifold = case.manifold
    if not manifold.reversible:
        return
    x, u, *_ = setup(case, seed, (BATCH,))
    z, q = manifold.retr_transp(x, u / 3, u / 3)
    back, q_back = manifold.retr_transp(z, -q, q)
    assert_close(back, x)
    assert_close(q_back, u / 3)


@cases
@examples
@given(seed=SEEDS)
def test_batched_calls_match_one_point_at_a_time(case, seed):
    manifold = case.manifold
    x, u, v, ambient = setup(case, seed, (BATCH,))
    u = 0.1 * u
    batched = {
        "projx": manifold.projx(x),
        "proju": manifold.proju(x, ambient),
        "egrad2rgrad": manifold.egrad2rgrad(x, ambient),
        "retr": manifold.retr(x, u),
        "expmap": manifold.expmap(x, u),
        "transp_follow_retr": manifold.transp_follow_retr(x, u, v),
        "inner": manifold.inner(x, u, v),
        "norm": manifold.norm(x, u),
    }
    for i in range(BATCH):
        single = {
            "projx": manifold.projx(x[i]),
            "proju": manifold.proju(x[i], ambient[i]),
            "egrad2rgrad": manifold.egrad2rgrad(x[i], ambient[i]),
            "retr": manifold.retr(x[i], u[i]),
            "expmap": manifold.expmap(x[i], u[i]),
            "transp_follow_retr": manifold.transp_follow_retr(x[i], u[i], v[i]),
            "inner": manifold.inner(x[i], u[i], v[i]),
            "norm": manifold.norm(x[i], u[i]),
        }
        for name, value in single.items():
            assert batched[name][i].shape == value.shape, name
            assert_close(batched[name][i], value)
    manifold.assert_check_point_on_manifold(batched["retr"])
    manifold.assert_check_vector_on_tangent(batched["retr"], batched["transp_follow_retr"])


# ------------------------------------------------------------------------ metric
@cases
@examples
@given(seed=SEEDS)
def test_inner_and_norm_have_geoopts_shapes_and_are_a_metric(case, seed):
    manifold = case.manifold
    x, u, v, _ = setup(case, seed, (BATCH,))
    batch = batch_shape(case, x)
    inner = manifold.inner(x, u, v)
    assert inner.shape == batch
    assert manifold.inner(x, u, v, keepdim=True).shape == (*batch, *(1,) * manifold.ndim)
    assert manifold.norm(x, u).shape == batch
    assert manifold.norm(x, u, keepdim=True).shape == (*batch, *(1,) * manifold.ndim)
    component = manifold.component_inner(x, u, v)
    assert torch.broadcast_shapes(component.shape, x.shape) == x.shape
    assert_close(manifold_sum(case, component), inner)
    assert_close(manifold.inner(x, v, u), inner)  # symmetric
    assert_close(manifold.inner(x, u), manifold.inner(x, u, u))
    assert_close(manifold.norm(x, u) ** 2, manifold.inner(x, u))
    assert bool((manifold.inner(x, u) > 0).all())  # positive on nonzero tangent vectors
    combined = manifold.inner(x, 2.0 * u - 3.0 * v, v)
    assert_close(combined, 2.0 * inner - 3.0 * manifold.inner(x, v))  # bilinear


@cases
@examples
@given(seed=SEEDS)
def test_egrad2rgrad_is_the_riemannian_gradient(case, seed):
    r""":math:`\langle \operatorname{grad} f, w \rangle_x = Df(x)[w]` for tangent :math:`w`."""
    manifold = case.manifold
    x, _, w, euclidean_gradient = setup(case, seed)
    gradient = manifold.egrad2rgrad(x, euclidean_gradient)
    manifold.assert_check_vector_on_tangent(x, gradient)
    directional = manifold_sum(case, euclidean_gradient * w)
    assert_close(manifold.inner(x, gradient, w), directional)


@cases
def test_the_metric_is_differentiable_in_the_point(case):
    manifold = case.manifold
    x, u, v, _ = setup(case, 0)
    if case.frozen:  # the metric jumps at a frozen entry: no derivative there to check
        x = x.masked_fill(x == 0, 0.5)
        u, v = manifold.proju(x, u), manifold.proju(x, v)

    def metric(point):
        return (
            manifold.inner(point, u, v),
            manifold.norm(point, u),
            manifold.component_inner(point, u, v),
        )

    assert torch.autograd.gradcheck(metric, (x.clone().requires_grad_(),))


def test_frozen_entries_get_a_zero_derivative_of_the_metric():
    manifold = AdaptiveEuclidean(ndim=1)
    x = torch.tensor([2.0, -0.5, 0.0], dtype=F64, requires_grad=True)
    u = manifold.proju(x.detach(), torch.ones(3, dtype=F64))
    manifold.inner(x, u).backward()
    # d/dw (1 / w^2) = -2 / w^3 on the others
    assert torch.equal(x.grad, torch.tensor([-0.25, 16.0, 0.0], dtype=F64))
    with torch.no_grad():  # the fast path gives the same value
        assert torch.equal(manifold.inner(x, u), manifold.inner(x.detach(), u))


# ------------------------------------------------------------------------ random, origin
@cases
def test_random_and_origin_are_points_of_the_asked_shape(case):
    manifold = case.manifold
    for make in (manifold.random, manifold.origin):
        point = make(3, *case.shape, dtype=F64)
        assert point.shape == (3, *case.shape) and point.dtype == F64
        assert isinstance(point, geoopt.ManifoldTensor) and point.manifold is manifold
        manifold.assert_check_point_on_manifold(point)
        assert make(case.shape).shape == case.shape  # a shape as one tuple, too


@cases
def test_random_and_origin_reject_shapes_with_too_few_dimensions(case):
    manifold = case.manifold
    if manifold.ndim == 0:
        assert manifold.random(()).shape == manifold.origin(()).shape == ()
        return
    for make in (manifold.random, manifold.origin):
        with pytest.raises(ValueError, match="requires more than"):
            make(case.shape[1:])


@cases
def test_logmap_and_dist_are_not_implemented(case):
    """The limits page says so; a manifold that gains them needs the page updated."""
    x, u, *_ = setup(case, 0)
    y = case.manifold.retr(x, 0.1 * u)
    with pytest.raises(NotImplementedError):
        case.manifold.logmap(x, y)
    with pytest.raises(NotImplementedError):
        case.manifold.dist(x, y)
