"""Fuzzing the manifolds with bad shapes and values: documented errors only, no silent NaN.

Every method (``inner``, ``norm``, ``proju``, ``egrad2rgrad``, ``retr``, ``expmap``,
``transp``, ``random_tangent``, ``check_point_on_manifold``) of :class:`GLQuotient` (both
metrics, ``eps = 0`` and ``eps > 0``), :class:`DiagonalQuotient` and
:class:`AdaptiveEuclidean` is called on random shapes (``h = 1``, ``h = min(n, m)``, zero
to two batch dimensions, batch dimensions of size 0, ``d = 0``) and random values: plain
Gaussians, huge and tiny scales, different scales for the two factors, exact zeros,
rank-deficient and ill-conditioned factors, NaN/Inf entries, and extreme magnitudes
(1e±300 in float64, 1e±35 in float32).

The contract checked here (the documented behaviour this file proposes):

* **Valid inputs** (finite entries, ``check_point_on_manifold`` true, magnitudes in the
  dtype's working range 10^±30 (float64) or 10^±4 (float32), so that Gram matrices and
  metric weights are representable): no exception at all, every output finite with the
  expected shape and dtype; ``expmap`` of a *short* horizontal vector (relative size
  <= 1/4, see :func:`gl_relative_size`) is finite too. ``expmap`` of a long vector may
  raise :class:`GeodesicDomainError` (the geodesic leaves the manifold, or the RK4
  integration of :class:`GLQuotient` runs through a rank collapse), and may overflow to
  ±Inf, but never returns NaN.
* **Invalid inputs** (NaN/Inf entries, rank-deficient factors with ``eps = 0``, zero
  coordinates of the diagonal quotient, extreme magnitudes): the methods do not
  validate their arguments (Geoopt's convention: validation is
  ``check_point_on_manifold``'s job), so outputs are unconstrained, but the only
  exceptions are ``ValueError`` (including :class:`GeodesicDomainError`),
  ``TypeError`` and ``torch.linalg.LinAlgError`` (the Cholesky factorisation of a
  singular Gram matrix). ``check_point_on_manifold`` never raises and returns false
  for non-finite points, rank-deficient factors with ``eps = 0`` and zero diagonal
  coordinates.

Regression tests at the end of this file pin bugs this fuzzing found and that are fixed:
an empty batch in ``GLQuotient(eps=0).check_point_on_manifold``; NaN/Inf points accepted
with ``eps > 0``; float32 Gram matrices factorised in float32 (now float64); and
``GLQuotient.expmap`` returning a meaningless point past the end of a geodesic or NaN
for steps too long for the vector (now :class:`GeodesicDomainError`, detected by the
loss of metric speed). The "valid" set below still excludes Gram condition numbers above
``1e-2 / unit`` of the compute dtype, where no factorisation is reliable.

``GEOOPT_QUOTIENT_FUZZ_EXAMPLES`` scales the number of examples (default 1; e.g. 20
for a nightly run).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geoopt_quotient import AdaptiveEuclidean, DiagonalQuotient, GeodesicDomainError, GLQuotient
from geoopt_quotient.manifolds._linalg import compute_dtype

F64, F32 = torch.float64, torch.float32
LinAlgError = torch.linalg.LinAlgError
DOCUMENTED = (ValueError, TypeError, LinAlgError)  # GeodesicDomainError is a ValueError
SEEDS = st.integers(0, 2**32 - 1)
DTYPES = (F64, F32)
#: decades of the working range: squares and fourth powers stay representable
WORKING_DECADES = {F64: 30, F32: 4}
#: decades of the extreme values, for which only the exception types are checked
EXTREME_DECADES = {F64: 300, F32: 35}
KINDS = (
    "normal",
    "huge",
    "tiny",
    "mixed",
    "zeros",
    "rank_deficient",
    "ill_conditioned",
    "nonfinite",
    "nonfinite_vector",
    "extreme",
)
SCALE_EXAMPLES = max(1, int(os.environ.get("GEOOPT_QUOTIENT_FUZZ_EXAMPLES", "1")))


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    """A manifold, a point ``x`` and two vectors ``u``, ``v`` of the kind ``kind``."""

    manifold: object
    x: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor
    kind: str
    short: float  # relative size wanted for the "short" horizontal vector given to expmap


def _magnitude(draw, kind: str, dtype: torch.dtype) -> Tuple[float, float]:
    """Scales of the two factors (rows u, v of the diagonal quotient; all entries else)."""
    decades = WORKING_DECADES[dtype]
    if kind == "huge":
        return 10.0**decades, 10.0**decades
    if kind == "tiny":
        return 10.0**-decades, 10.0**-decades
    if kind == "mixed":
        a, b = (draw(st.integers(-decades, decades)) for _ in range(2))
        return 10.0**a, 10.0**b
    if kind == "extreme":
        big = EXTREME_DECADES[dtype]
        return tuple(10.0 ** draw(st.sampled_from([-big, big])) for _ in range(2))
    return 1.0, 1.0


def _poison(draw, t: torch.Tensor) -> torch.Tensor:
    """``t`` with one entry replaced by NaN, +Inf or -Inf (unchanged when empty)."""
    if t.numel():
        t = t.clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf])
        )
    return t


def _vectors(draw, gen, shape, scale_rows: Callable[[torch.Tensor], torch.Tensor]):
    """Two Gaussian vectors with the point's row scales; ``u`` of random relative size."""
    size = 10.0 ** draw(st.integers(-6, 1))
    u = scale_rows(torch.randn(shape, generator=gen, dtype=F64)) * size
    v = scale_rows(torch.randn(shape, generator=gen, dtype=F64))
    return u, v


@st.composite
def batch_shapes(draw) -> Tuple[int, ...]:
    """Zero to two batch dimensions of sizes 0 to 3."""
    return tuple(draw(st.lists(st.integers(0, 3), max_size=2)))


@st.composite
def gl_cases(draw) -> Case:
    n, m = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    h = draw(st.sampled_from([1, min(n, m), draw(st.integers(1, min(n, m)))]))
    eps = draw(st.sampled_from([0.0, 0.0, 1e-6, 1e-2, 1.0]))
    manifold = GLQuotient(
        n,
        m,
        draw(st.sampled_from(["mix", "inv"])),
        eps,
        retraction=draw(st.sampled_from(["second_order", "first_order"])),
        expmap_steps=draw(st.sampled_from([4, 16])),
    )
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(draw(SEEDS))
    shape = (*draw(batch_shapes()), n + m, h)
    s_g, s_h = _magnitude(draw, kind, dtype)

    def scale_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[..., :n, :] * s_g, t[..., n:, :] * s_h), dim=-2)

    x = scale_rows(torch.randn(shape, generator=gen, dtype=F64))
    rows = draw(st.sampled_from([slice(0, n), slice(n, n + m)]))
    if kind == "zeros":
        x = torch.where(torch.rand(shape, generator=gen) < 0.3, 0.0, x)
    elif kind == "rank_deficient":
        if h == 1:
            x[..., rows, 0] = 0.0
        else:
            x[..., rows, h - 1] = x[..., rows, 0] * -2.0
    elif kind == "ill_conditioned" and x.numel():
        factor = x[..., rows, :]
        left, svals, right = torch.linalg.svd(factor, full_matrices=False)
        condition = 10.0 ** draw(st.floats(1.0, 8.0))
        spread = torch.logspace(0, -math.log10(condition), svals.shape[-1], dtype=F64)
        x[..., rows, :] = (left * (svals[..., :1] * spread).unsqueeze(-2)) @ right
    elif kind == "nonfinite":
        x = _poison(draw, x)
    u, v = _vectors(draw, gen, shape, scale_rows)
    if kind == "nonfinite_vector":
        u = _poison(draw, u)
    short = draw(st.floats(0.0, 0.25))
    return Case(manifold, x.to(dtype), u.to(dtype), v.to(dtype), kind, short)


@st.composite
def diagonal_cases(draw) -> Case:
    manifold = DiagonalQuotient(
        draw(st.sampled_from(["mix", "inv"])),
        retraction=draw(st.sampled_from(["second_order", "first_order"])),
    )
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(draw(SEEDS))
    shape = (*draw(batch_shapes()), 2, draw(st.integers(0, 4)))
    s_u, s_v = _magnitude(draw, kind, dtype)

    def scale_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.stack((t[..., 0, :] * s_u, t[..., 1, :] * s_v), dim=-2)

    x = scale_rows(torch.randn(shape, generator=gen, dtype=F64))
    if kind in ("zeros", "rank_deficient") and x.numel():  # a zero u_i or v_i
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = 0.0
    elif kind == "nonfinite":
        x = _poison(draw, x)
    u, v = _vectors(draw, gen, shape, scale_rows)
    if kind == "nonfinite_vector":
        u = _poison(draw, u)
    short = draw(st.floats(0.0, 0.25))
    return Case(manifold, x.to(dtype), u.to(dtype), v.to(dtype), kind, short)


@st.composite
def adaptive_cases(draw) -> Case:
    dims = draw(st.lists(st.integers(0, 3), max_size=3))
    manifold = AdaptiveEuclidean(
        eps=draw(st.sampled_from([0.0, 1e-8, 1e-3, 1.0])),
        ndim=draw(st.integers(0, len(dims))),
    )
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    gen = torch.Generator().manual_seed(draw(SEEDS))
    shape = tuple(dims)
    if kind == "mixed":  # entry-wise scales spread over the whole working range
        decades = WORKING_DECADES[dtype]
        exponents = torch.randint(-decades, decades + 1, shape, generator=gen).to(F64)
        scales = 10.0**exponents
    else:
        scales = torch.full(shape, _magnitude(draw, kind, dtype)[0], dtype=F64)

    def scale_rows(t: torch.Tensor) -> torch.Tensor:
        return t * scales

    x = scale_rows(torch.randn(shape, generator=gen, dtype=F64))
    if kind in ("zeros", "rank_deficient"):  # zero weights: frozen when eps = 0
        x = torch.where(torch.rand(shape, generator=gen) < 0.4, 0.0, x)
    elif kind == "nonfinite":
        x = _poison(draw, x)
    u, v = _vectors(draw, gen, shape, scale_rows)
    if kind == "nonfinite_vector":
        u = _poison(draw, u)
    short = draw(st.floats(0.0, 0.25))
    return Case(manifold, x.to(dtype), u.to(dtype), v.to(dtype), kind, short)


# ----------------------------------------------------------------------------- validity
def gl_gram_condition_ok(manifold: GLQuotient, x: torch.Tensor) -> bool:
    """The relaxed Gram matrices are numerically non-singular in the compute dtype:
    condition number below ``1e-2 / unit`` (see the module docstring)."""
    if x.numel() == 0:
        return True
    limit = 1e-2 / torch.finfo(compute_dtype(x.dtype)).eps
    g, h = manifold.factors(x.double())
    for factor in (g, h):
        svals = torch.linalg.svdvals(factor)
        lam = svals.pow(2)  # h <= min(n, m): one value per column
        condition = (lam[..., 0] + manifold.eps) / (lam[..., -1] + manifold.eps)
        if not bool((condition <= limit).all()):
            return False
    return True


def gl_relative_size(manifold: GLQuotient, x: torch.Tensor, u: torch.Tensor) -> float:
    r"""``max |u_F|_2 / sqrt(lambda_min(S_F))`` over both factors and the batch.

    Below 1/4 the straight segment ``F + t u_F`` stays far from rank deficiency (of the
    relaxed Gram matrix) and RK4 with a few steps follows the geodesic closely."""
    if x.numel() == 0:
        return 0.0
    s_g, s_h = manifold.grams(x.double())
    u_g, u_h = manifold.factors(u.double())
    size = 0.0
    for s, f in ((s_g, u_g), (s_h, u_h)):
        floor = torch.linalg.eigvalsh(s)[..., 0].clamp_min(1e-300).sqrt()
        size = max(size, (torch.linalg.matrix_norm(f, ord=2) / floor).max().item())
    return size


def in_working_range(case: Case) -> bool:
    return case.kind != "extreme"


def is_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def check_point(case: Case) -> bool | None:
    """``check_point_on_manifold`` (it must not raise); ``None`` where a known bug is
    carved out."""
    manifold, x = case.manifold, case.x
    if isinstance(manifold, GLQuotient) and manifold.eps == 0 and x.numel() == 0:
        return None  # test_gl_check_point_on_manifold_accepts_empty_batches
    ok, reason = manifold.check_point_on_manifold(x, explain=True)
    assert isinstance(ok, bool) and (ok or isinstance(reason, str)), (ok, reason)
    if not is_finite(x):
        relaxed_gl = isinstance(manifold, GLQuotient) and manifold.eps > 0
        if not relaxed_gl:  # test_gl_relaxed_check_point_on_manifold_rejects_non_finite_points
            assert not ok, "a point with NaN/Inf entries passes check_point_on_manifold"
    return ok


def call(name: str, fn: Callable[[], torch.Tensor], valid: bool) -> torch.Tensor | None:
    """``fn()``; on invalid input only the documented exceptions are allowed."""
    if valid:
        return fn()
    try:
        return fn()
    except DOCUMENTED:
        return None
    except Exception as error:  # anything else is undocumented
        raise AssertionError(f"{name} raised an undocumented {type(error).__name__}") from error


def assert_output(name: str, out: torch.Tensor, shape, dtype, valid: bool) -> None:
    assert out.shape == torch.Size(shape), f"{name}: shape {tuple(out.shape)} != {shape}"
    assert out.dtype == dtype, f"{name}: dtype {out.dtype} != {dtype}"
    if valid:
        assert is_finite(out), f"{name}: non-finite output for finite, valid input"


def exercise(case: Case, valid: bool, short_vector: Callable[[torch.Tensor], torch.Tensor]):
    """Call every method; ``short_vector(horizontal)`` rescales a horizontal vector to
    relative size ``case.short``."""
    manifold, x, u, v = case.manifold, case.x, case.u, case.v
    reduced = 2 if isinstance(manifold, (GLQuotient, DiagonalQuotient)) else manifold.ndim
    inner_shape = x.shape[: x.dim() - reduced]
    outputs: Dict[str, torch.Tensor | None] = {
        "inner": call("inner", lambda: manifold.inner(x, u, v), valid),
        "norm": call("norm", lambda: manifold.norm(x, u), valid),
        "egrad2rgrad": call("egrad2rgrad", lambda: manifold.egrad2rgrad(x, u), valid),
        "random_tangent": call(
            "random_tangent",
            lambda: manifold.random_tangent(x, generator=torch.Generator().manual_seed(0)),
            valid,
        ),
    }
    horizontal = call("proju", lambda: manifold.proju(x, u), valid)
    outputs["proju"] = horizontal
    if horizontal is not None:
        outputs["retr"] = call("retr", lambda: manifold.retr(x, horizontal), valid)
    for name, out in outputs.items():
        if out is not None:
            shape = inner_shape if name in ("inner", "norm") else x.shape
            assert_output(name, out, shape, x.dtype, valid)
    if horizontal is None:
        return
    # expmap of a short horizontal vector: finite; of a long one: documented errors, no NaN
    short = short_vector(horizontal) if valid else horizontal
    end = call("expmap", lambda: manifold.expmap(x, short), valid)
    if end is not None:
        assert_output("expmap", end, x.shape, x.dtype, valid)
    try:
        far = manifold.expmap(x, horizontal)
    except DOCUMENTED:
        pass
    else:
        if valid:
            assert not bool(far.isnan().any()), "expmap of a long vector returned NaN"
    # transport to the end of the short step, when that is a valid point
    if end is not None:
        lands = valid and is_finite(end) and check_point(Case(manifold, end, u, v, "", 0.0))
        if isinstance(manifold, GLQuotient):
            lands = lands and gl_gram_condition_ok(manifold, end)
        moved = call("transp", lambda: manifold.transp(x, end, v), bool(lands))
        if moved is not None:
            assert_output("transp", moved, x.shape, x.dtype, bool(lands))


# ----------------------------------------------------------------------------- the fuzzing
@fuzz_settings(250)
@given(case=gl_cases())
def test_gl_quotient_fuzz(case: Case):
    manifold, x = case.manifold, case.x
    ok = check_point(case)
    if case.kind == "rank_deficient" and manifold.eps == 0 and x.numel():
        assert ok is False, "an exactly rank-deficient factor passes with eps = 0"
    if case.kind == "rank_deficient" and manifold.eps > 0 and x.numel():
        assert ok is True, "eps > 0 must accept rank-deficient factors"
    valid = bool(
        ok is not False
        and is_finite(x, case.u, case.v)
        and in_working_range(case)
        and gl_gram_condition_ok(manifold, x)
    )

    def short_vector(horizontal: torch.Tensor) -> torch.Tensor:
        size = gl_relative_size(manifold, x, horizontal)
        return horizontal * (case.short / size) if size > 0 else horizontal

    exercise(case, valid, short_vector)


@fuzz_settings(150)
@given(case=diagonal_cases())
def test_diagonal_quotient_fuzz(case: Case):
    manifold, x = case.manifold, case.x
    ok = check_point(case)
    if case.kind in ("zeros", "rank_deficient") and x.numel():
        assert ok is False, "a zero coordinate passes check_point_on_manifold"
    valid = bool(ok and is_finite(x, case.u, case.v) and in_working_range(case))

    def short_vector(horizontal: torch.Tensor) -> torch.Tensor:
        rate = manifold.horizontal_rate(x.double(), horizontal.double())
        size = rate.abs().max().item() if rate.numel() else 0.0
        return horizontal * (case.short / size) if size > 0 else horizontal

    exercise(case, valid, short_vector)
    if valid and manifold.metric == "mix" and x.numel():
        # the documented domain: GeodesicDomainError exactly when 1 + 2B <= 0 somewhere
        horizontal = manifold.proju(x, case.u)
        rate = manifold.horizontal_rate(x.double(), horizontal.double())
        if float((1 + 2 * rate).min()) > 1e-3:
            manifold.expmap(x, horizontal)
        elif float((1 + 2 * rate).min()) < -1e-3:
            with pytest.raises(GeodesicDomainError, match=r"1 \+ 2 B <= 0.*rho"):
                manifold.expmap(x, horizontal)


@fuzz_settings(150)
@given(case=adaptive_cases())
def test_adaptive_euclidean_fuzz(case: Case):
    manifold, x = case.manifold, case.x
    ok = check_point(case)
    if case.kind in ("zeros", "rank_deficient"):
        assert ok is True, "zero weights are valid (frozen) points"
    valid = bool(ok and is_finite(x, case.u, case.v) and in_working_range(case))

    def short_vector(horizontal: torch.Tensor) -> torch.Tensor:
        scale = manifold.scale(x.double())
        ratio = torch.where(scale > 0, horizontal.double() / scale.clamp_min(1e-300), 0.0)
        size = ratio.abs().max().item() if ratio.numel() else 0.0
        return horizontal * (case.short / size) if size > 0 else horizontal

    exercise(case, valid, short_vector)
    if valid:  # frozen entries (zero weight, eps = 0) stay exactly zero in every vector
        frozen = manifold.scale(x) == 0
        for vector in (manifold.proju(x, case.u), manifold.egrad2rgrad(x, case.u)):
            assert bool((vector[frozen] == 0).all())


# ----------------------------------------------------------------------------- known bugs
@pytest.mark.parametrize("shape", [(0, 6, 2), (2, 0, 6, 1)])
def test_gl_check_point_on_manifold_accepts_empty_batches(shape):
    manifold = GLQuotient(3, 3)
    assert manifold.check_point_on_manifold(torch.zeros(shape, dtype=F64))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_gl_relaxed_check_point_on_manifold_rejects_non_finite_points(bad):
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    x[0, 0] = bad
    ok, reason = GLQuotient(3, 3, eps=1e-3).check_point_on_manifold(x, explain=True)
    assert not ok and "non-finite" in reason


def test_gl_non_finite_point_message_does_not_suggest_eps():
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    x[0, 0] = math.nan
    ok, reason = GLQuotient(3, 3).check_point_on_manifold(x, explain=True)
    assert not ok and "non-finite" in reason
    assert "eps" not in reason


def _factor_with_condition(rows, cols, condition, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=F64))
    right, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=F64))
    svals = torch.logspace(0, -math.log10(condition), cols, dtype=F64)
    return ((left * svals) @ right.mT).to(dtype)


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_gl_float32_ill_conditioned_point_accepted_by_the_check_is_usable(metric):
    manifold = GLQuotient(6, 6, metric)
    failures = 0
    for seed in range(10):
        g = _factor_with_condition(6, 3, 3e4, seed, F32)
        h = _factor_with_condition(6, 3, 3e4, seed + 100, F32)
        x = torch.cat((g, h))
        assert manifold.check_point_on_manifold(x)
        u = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        for out in (manifold.proju(x, u), manifold.egrad2rgrad(x, u), manifold.random_tangent(x)):
            failures += not is_finite(out)
    assert failures == 0


def test_gl_float32_relaxed_rank_deficient_point_is_usable():
    manifold = GLQuotient(16, 16, "mix", eps=1e-6)
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(32, 4, generator=gen, dtype=F64)
        x[:16, 3] = x[:16, 0] - x[:16, 1]  # G has rank 3; entries ~ N(0, 1)
        x = x.to(F32)
        assert manifold.check_point_on_manifold(x)
        u = torch.randn(x.shape, generator=gen)
        for out in (manifold.proju(x, u), manifold.egrad2rgrad(x, u), manifold.random_tangent(x)):
            assert is_finite(out)


EXPMAP_GARBAGE = {
    # horizontal, B = -1: the geodesic reaches u = v = 0 at t = 1/2 (1 + 2Bt = 0);
    # DiagonalQuotient('mix') raises GeodesicDomainError, GLQuotient returns ~1.6e27
    "past-the-domain": (0.0, 16, [[1.0], [1.0]], [[-1.0], [-1.0]]),
    # a long vector (B ~ 11) and 4 RK4 steps: the integration diverges to [inf, nan]
    "diverging-rk4": (
        0.01,
        4,
        [[0.6613521715704522], [0.2669240982925188]],
        [[0.6167725823734831], [6.213173286854215]],
    ),
}


@pytest.mark.parametrize("case", sorted(EXPMAP_GARBAGE))
def test_gl_expmap_never_returns_garbage(case):
    """A finite end point with the speed of the start, or a documented error."""
    eps, steps, point, vector = EXPMAP_GARBAGE[case]
    manifold = GLQuotient(1, 1, "mix", eps=eps, expmap_steps=steps)
    x = torch.tensor(point, dtype=F64)
    xi = manifold.proju(x, torch.tensor(vector, dtype=F64))
    if case == "past-the-domain":
        with pytest.raises(GeodesicDomainError):
            DiagonalQuotient("mix").expmap(x, xi)  # (2, 1): u = 1, v = 1
    try:
        end, velocity = manifold.geodesic(x, xi, 1.0)
    except ValueError:  # GeodesicDomainError included
        return
    assert is_finite(end, velocity)
    speed = manifold.norm(end, velocity) / manifold.norm(x, xi)
    assert abs(speed.item() - 1) < 1e-2, f"geodesic speed changed by a factor {speed.item():.3g}"
