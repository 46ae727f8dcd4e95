"""Reliability catalogue: every bad input gets a clear error, and nothing is mutated.

One test (or parametrized case) per kind of bad input, in one place, even where another
test file covers the same input in passing. Each asserts the *exact* exception type
(``ValueError``/``TypeError`` or the project's :class:`PlanError`,
:class:`NonFiniteError`, :class:`GeodesicDomainError`,
:class:`SymmetryVerificationError`, :class:`UnsafeCheckpointError`) and that the
message names the argument (or parameter, group, line) and says what to do.
Gaps are pinned by ``xfail(strict=True)`` tests whose ``reason`` says what is wrong.

Then: a failing sharpness or Hessian call (an exception in ``loss_fn``,
``KeyboardInterrupt``, a NaN) leaves the model bitwise identical, with its train/eval
modes, ``requires_grad`` flags and the global RNG state restored; and the same seed
gives bitwise identical results in two separate processes.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import geoopt
import pytest
import torch
from conftest import (
    TINY_BERT_WORDS,
    TinyTransformer,
    cross_entropy_loss,
    save_tiny_bert_classifier,
    tiny_bert_classifier,
)

from geoopt_quotient import (
    AdaptiveEuclidean,
    DiagonalQuotient,
    GeodesicDomainError,
    GLQuotient,
    NonFiniteError,
    PlanError,
    SymmetryGroup,
    SymmetryPlan,
    SymmetryVerificationError,
    adaptive_sharpness,
    average_in_ball,
    calibrate_rho,
    geodesic_sharpness,
    hessian_top_eigenvalue,
    hessian_trace,
    maximize_in_ball,
)
from geoopt_quotient.experiments.io import UnsafeCheckpointError, find_weights, load_state_dict
from geoopt_quotient.symmetry import verify_plan

pytestmark = pytest.mark.on_device

F64 = torch.float64
TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def raises(error_type: type, *needles: str):
    """Expect exactly ``error_type`` (not a subclass) with every needle in its message."""
    with pytest.raises(error_type) as info:
        yield info
    assert type(info.value) is error_type, (
        f"expected {error_type.__name__}, got {type(info.value).__name__}: {info.value}"
    )
    message = str(info.value)
    missing = [needle for needle in needles if needle not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def token_data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 11, (16, 6), generator=g)
    labels = torch.randint(0, 2, (16,), generator=g)
    return [(tokens[:8], labels[:8]), (tokens[8:], labels[8:])]


def fresh_transformer(dtype=F64) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer().to(dtype)


def make_rank_deficient(model: TinyTransformer) -> None:
    """Head 0 of layer 0 gets a rank-one query projection and no query bias."""
    with torch.no_grad():
        w = model.layers[0].self_attn.in_proj_weight
        w[:4] = torch.outer(torch.ones(4, dtype=w.dtype), w[0])
        model.layers[0].self_attn.in_proj_bias[:4] = 0


def calls_failing_at(k: int, failure, loss=cross_entropy_loss):
    """A loss_fn that behaves until its ``k``-th call, then fails (raises, or returns
    ``failure(value)`` when ``failure`` is not an exception type or instance)."""
    calls = 0

    def loss_fn(model, batch):
        nonlocal calls
        calls += 1
        value = loss(model, batch)
        if calls == k:
            if isinstance(failure, BaseException) or (
                isinstance(failure, type) and issubclass(failure, BaseException)
            ):
                raise failure
            return failure(value)
        return value

    return loss_fn


class Diagonal(torch.nn.Module):
    """A diagonal linear network y = x.(u * v) with (u, v) a DiagonalQuotient parameter."""

    def __init__(self, point: torch.Tensor, metric: str = "mix"):
        super().__init__()
        self.uv = geoopt.ManifoldParameter(point, manifold=DiagonalQuotient(metric))

    def forward(self, x):
        return x @ (self.uv[0] * self.uv[1])


class LinearAttention(torch.nn.Module):
    """A custom single-head attention layer built from nn.Linear modules."""

    def __init__(self, dim: int = 6, head: int = 3):
        super().__init__()
        self.q = torch.nn.Linear(dim, head)
        self.k = torch.nn.Linear(dim, head)
        self.out = torch.nn.Linear(dim, 1)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).mT
        return self.out(scores.softmax(-1) @ x).squeeze(-1).mean(-1)


QK_SHAPES = {"q.weight": (3, 6), "q.bias": (3,), "k.weight": (3, 6), "k.bias": (3,)}


def qk_layout(wq, bq, wk, bk):
    g = torch.cat([wq.mT, bq[None]], dim=0)
    h = torch.cat([wk.mT, bk[None]], dim=0)
    return torch.cat([g, h], dim=0)


# ============================================================================ catalogue
# ---------------------------------------------------------------- rank-deficient factors
@pytest.mark.parametrize("metric", ["mix", "inv"])
@pytest.mark.parametrize("factor", ["G", "H"])
def test_rank_deficient_point_is_rejected_with_an_eps_hint(metric, factor):
    manifold = GLQuotient(3, 3, metric)
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    rows = slice(0, 3) if factor == "G" else slice(3, 6)
    x[rows, 1] = 2 * x[rows, 0]
    with raises(ValueError, "`x`", f"factor {factor} is rank-deficient", "pass eps > 0"):
        manifold.assert_check_point_on_manifold(x)
    GLQuotient(3, 3, metric, eps=1e-3).assert_check_point_on_manifold(x)  # the hint works


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_rank_deficient_head_in_geodesic_sharpness_suggests_eps(metric):
    model = fresh_transformer()
    make_rank_deficient(model)
    needles = ("symmetry group", "[query-key]", "rank-deficient", "pass eps > 0", "eps=1e-6")
    with raises(ValueError, *needles):
        geodesic_sharpness(model, cross_entropy_loss, token_data(), rho=0.1, metric=metric)


@pytest.mark.parametrize("function", [hessian_trace, hessian_top_eigenvalue])
def test_rank_deficient_head_in_hessian_is_reported_with_an_eps_hint(function):
    model = fresh_transformer()
    make_rank_deficient(model)
    with raises(ValueError, "rank-deficient", "eps"):
        function(model, cross_entropy_loss, token_data()[:1])


def test_ill_conditioned_float32_head_is_measured_or_reported_with_an_eps_hint():
    model = fresh_transformer(torch.float32)
    with torch.no_grad():  # head 0 of layer 0: query projection with condition ~3e4
        w = model.layers[0].self_attn.in_proj_weight
        u, s, vt = torch.linalg.svd(w[:4].double(), full_matrices=False)
        s = torch.tensor([1.0, 0.3, 0.1, 3e-5], dtype=F64) * s[0]
        w[:4] = ((u * s) @ vt).float()
        model.layers[0].self_attn.in_proj_bias[:4] = 0
    try:
        result = geodesic_sharpness(model, cross_entropy_loss, token_data()[:1], rho=0.05, iters=3)
    except ValueError as error:
        assert "eps" in str(error)
    else:
        assert math.isfinite(result.value)


# ---------------------------------------------------------------- NaN/Inf in the weights
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("measure", [geodesic_sharpness, adaptive_sharpness])
def test_non_finite_weight_is_named(bad, measure):
    model = fresh_transformer()
    with torch.no_grad():
        model.layers[0].self_attn.in_proj_weight[0, 0] = bad
    needles = ("parameter 'layers.0.self_attn.in_proj_weight'", "NaN/Inf", "check the checkpoint")
    with raises(ValueError, *needles):
        measure(model, cross_entropy_loss, token_data(), rho=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [1, 7, 64, 1000, 4099])
def test_the_finiteness_check_of_the_weights_is_isfinite_all(dtype, size):
    """``check_parameters`` reads a parameter's minimum and maximum: the same answer as
    ``isfinite(t).all()`` for a NaN or an infinity anywhere (the vectorised body and the
    tail), and for an empty tensor."""
    from geoopt_quotient.manifolds._validation import is_finite

    generator = torch.Generator().manual_seed(size)
    t = torch.randn(size, generator=generator).to(dtype)
    assert bool(is_finite(t)) and bool(is_finite(t[:0]))
    for position in {0, size // 2, size - 1}:
        for bad in (math.nan, math.inf, -math.inf):
            spoiled = t.clone()
            spoiled[position] = bad
            assert not bool(is_finite(spoiled)), (position, bad)
            assert not bool(is_finite(spoiled.view(1, -1).expand(2, -1).mT))  # strided


def test_the_finiteness_check_of_the_weights_reads_them_in_one_call_and_names_the_culprit():
    """``check_parameters`` reads all parameters of a dtype at once (their Euclidean
    norms): a finite parameter whose norm overflows (float32 entries whose squares
    overflow, entries near the largest float, a float16 sum of squares above 65504)
    passes, and the non-finite one among many is named."""
    from geoopt_quotient.sharpness.ball import check_parameters

    params = {
        "huge": torch.full((8,), 3e38),
        "squares": torch.full((4,), 1e20),
        "half": torch.full((4096,), 60.0, dtype=torch.float16),
        "empty": torch.zeros(0),
        **{f"w{i}": torch.randn(3, 3, dtype=F64) for i in range(5)},
    }
    check_parameters(params)
    params["w3"] = params["w3"].clone()
    params["w3"][1, 1] = math.inf
    with raises(ValueError, "parameter 'w3'", "NaN/Inf"):
        check_parameters(params)


@pytest.mark.parametrize(
    "manifold",
    [GLQuotient(3, 3), DiagonalQuotient(), AdaptiveEuclidean()],
    ids=["gl-eps0", "diagonal", "adaptive"],
)
def test_non_finite_point_is_rejected_by_the_manifold(manifold):
    """(GLQuotient with eps > 0 accepts it: see test_fuzz_manifolds.py::
    test_gl_relaxed_check_point_on_manifold_rejects_non_finite_points.)"""
    shape = (6, 2) if isinstance(manifold, GLQuotient) else (2, 3)
    x = torch.ones(shape, dtype=F64) + torch.eye(*shape, dtype=F64)
    x[0, 0] = math.nan
    with raises(ValueError, "`x`", "non-finite"):
        manifold.assert_check_point_on_manifold(x)


@pytest.mark.parametrize("where", ["layers.0.self_attn.in_proj_weight", "head.bias"])
def test_non_finite_weight_is_named_by_the_hessian(where):
    model = fresh_transformer()
    with torch.no_grad():
        model.get_parameter(where).view(-1)[0] = math.nan
    with raises(ValueError, f"parameter {where!r}", "NaN/Inf"):
        hessian_trace(model, cross_entropy_loss, token_data()[:1], probes=1)


# ---------------------------------------------------------------- NaN/Inf in the loss
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("kind", ["worst", "average"])
def test_non_finite_loss_on_the_third_call_is_reported(bad, kind):
    """Worst case: calls 1, 2, 3 are the start (iteration 0's gradient), iterations 0 and 1;
    average: the clean loss, samples 0 and 1. The error names the iteration and ``rho``."""
    loss_fn = calls_failing_at(3, lambda value: value * bad)
    with raises(NonFiniteError, f"the objective is {bad}", "iteration 1", "`rho`"):
        geodesic_sharpness(fresh_transformer(), loss_fn, token_data(), rho=0.05, kind=kind)


def test_non_finite_clean_loss_is_reported_in_the_worst_case():
    loss_fn = calls_failing_at(1, lambda value: value * math.nan)
    with raises(NonFiniteError, "iteration 0", "loss on unperturbed parameters"):
        geodesic_sharpness(fresh_transformer(), loss_fn, token_data(), rho=0.05)


def test_non_finite_clean_loss_is_reported_in_the_average_case():
    loss_fn = calls_failing_at(1, lambda value: value * math.nan)
    with raises(NonFiniteError, "loss on unperturbed parameters"):
        geodesic_sharpness(fresh_transformer(), loss_fn, token_data(), rho=0.05, kind="average")


@pytest.mark.parametrize("measure", [geodesic_sharpness, adaptive_sharpness])
def test_overflowing_gradient_is_reported(measure):
    """A finite loss (at most 1e200) whose gradient at the unperturbed weights is 1e400."""
    model = torch.nn.Linear(3, 1, bias=False).double()
    x = torch.ones(1, 3, dtype=F64)
    clean = model(x).detach()

    def loss_fn(m, batch):
        return 1e200 * torch.tanh(1e200 * (m(batch) - clean)).sum()

    with raises(NonFiniteError, "gradient has NaN/Inf entries", "iteration 0", "`rho`"):
        measure(model, loss_fn, [x], rho=0.1, iters=3)


@pytest.mark.parametrize("function", [hessian_trace, hessian_top_eigenvalue])
def test_non_finite_loss_is_reported_by_the_hessian(function):
    def loss_fn(model, batch):
        return cross_entropy_loss(model, batch) * math.nan

    with raises(NonFiniteError, "loss"):
        function(fresh_transformer(), loss_fn, token_data()[:1])


# ---------------------------------------------------------------- rho
RHO_CALLS = {
    "geodesic": lambda rho: geodesic_sharpness(
        fresh_transformer(), cross_entropy_loss, token_data(), rho=rho
    ),
    "adaptive": lambda rho: adaptive_sharpness(
        fresh_transformer(), cross_entropy_loss, token_data(), rho=rho
    ),
    "maximize_in_ball": lambda rho: maximize_in_ball(
        [(torch.ones(3, dtype=F64), AdaptiveEuclidean())], lambda p: p[0].sum(), rho=rho
    ),
    "average_in_ball": lambda rho: average_in_ball(
        [(torch.ones(3, dtype=F64), AdaptiveEuclidean())], lambda p: p[0].sum(), rho=rho
    ),
}


@pytest.mark.parametrize("rho", [0.0, -0.1, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("function", sorted(RHO_CALLS))
def test_bad_rho_is_rejected(function, rho):
    with raises(ValueError, "`rho`", "got") as info:
        RHO_CALLS[function](rho)
    assert "> 0" in str(info.value) or "positive" in str(info.value)


@pytest.mark.parametrize("rho", ["0.1", ["0.1"], True])  # None: the default radius
@pytest.mark.parametrize("function", ["geodesic", "adaptive"])
def test_non_numeric_rho_is_a_type_error(function, rho):
    with raises(TypeError, "`rho`", "real number"):
        RHO_CALLS[function](rho)


@pytest.mark.parametrize("function", ["maximize_in_ball", "average_in_ball"])
def test_non_numeric_rho_is_a_type_error_in_the_ball_maximiser(function):
    with raises(TypeError, "`rho`"):
        RHO_CALLS[function]("0.1")


# ---------------------------------------------------------------- iterations
ITER_CALLS = {
    "geodesic-iters": lambda n: geodesic_sharpness(
        fresh_transformer(), cross_entropy_loss, token_data(), rho=0.1, iters=n
    ),
    "average-iters": lambda n: geodesic_sharpness(
        fresh_transformer(), cross_entropy_loss, token_data(), rho=0.1, iters=n, kind="average"
    ),
    "adaptive-iters": lambda n: adaptive_sharpness(
        fresh_transformer(), cross_entropy_loss, token_data(), rho=0.1, iters=n
    ),
    "maximize_in_ball-iters": lambda n: maximize_in_ball(
        [(torch.ones(3, dtype=F64), AdaptiveEuclidean())], lambda p: p[0].sum(), rho=1, iters=n
    ),
    "average_in_ball-samples": lambda n: average_in_ball(
        [(torch.ones(3, dtype=F64), AdaptiveEuclidean())], lambda p: p[0].sum(), rho=1, samples=n
    ),
    "hessian_trace-probes": lambda n: hessian_trace(
        fresh_transformer(), cross_entropy_loss, token_data(), probes=n
    ),
    "hessian_top_eigenvalue-iters": lambda n: hessian_top_eigenvalue(
        fresh_transformer(), cross_entropy_loss, token_data(), iters=n
    ),
}


@pytest.mark.parametrize("count", [0, -3])
@pytest.mark.parametrize("call", sorted(ITER_CALLS))
def test_fewer_than_one_iteration_is_rejected(call, count):
    argument = call.rsplit("-", 1)[1]
    with raises(ValueError, f"`{argument}`", ">= 1", f"got {count}"):
        ITER_CALLS[call](count)


@pytest.mark.parametrize("call", ["geodesic-iters", "hessian_trace-probes"])
def test_non_integer_iterations_are_a_type_error(call):
    argument = call.rsplit("-", 1)[1]
    with raises(TypeError, f"`{argument}`", "must be an int", "2.5"):
        ITER_CALLS[call](2.5)


# ---------------------------------------------------------------- empty batches
@pytest.mark.parametrize("batches", [list, lambda: iter(())], ids=["list", "iterator"])
@pytest.mark.parametrize("kind", ["worst", "average", "adaptive"])
def test_empty_batches_are_rejected(kind, batches):
    model = fresh_transformer()
    with raises(ValueError, "`batches` is empty", "give at least one batch"):
        if kind == "adaptive":
            adaptive_sharpness(model, cross_entropy_loss, batches(), rho=0.1)
        else:
            geodesic_sharpness(model, cross_entropy_loss, batches(), rho=0.1, kind=kind)


@pytest.mark.parametrize("function", [hessian_trace, hessian_top_eigenvalue])
def test_empty_batches_are_rejected_by_the_hessian(function):
    with raises(ValueError, "`batches` is empty"):
        function(fresh_transformer(), cross_entropy_loss, [])


def test_empty_groups_are_rejected_by_the_ball_maximiser():
    with raises(ValueError, "`groups` is empty", "nothing to perturb"):
        maximize_in_ball([], lambda points: points[0].sum(), rho=0.1)


# ---------------------------------------------------------------- loss_fn
NOT_SCALARS = {
    "logits": lambda model, batch: model(batch[0]),
    "float": lambda model, batch: 1.0,
    "none": lambda model, batch: None,
}


@pytest.mark.parametrize("returned", sorted(NOT_SCALARS))
@pytest.mark.parametrize("measure", ["geodesic", "adaptive"])
def test_loss_fn_that_does_not_return_a_scalar_is_reported(measure, returned):
    function = geodesic_sharpness if measure == "geodesic" else adaptive_sharpness
    with raises(TypeError, "(loss_fn) must return a scalar tensor", "got"):
        function(fresh_transformer(), NOT_SCALARS[returned], token_data(), rho=0.1, iters=2)


@pytest.mark.parametrize("returned", ["logits", "none"])
def test_loss_fn_that_does_not_return_a_scalar_is_reported_in_the_average_case(returned):
    with raises(TypeError, "(loss_fn) must return a scalar tensor"):
        geodesic_sharpness(
            fresh_transformer(), NOT_SCALARS[returned], token_data(), rho=0.1, kind="average"
        )


@pytest.mark.parametrize("function", [hessian_trace, hessian_top_eigenvalue])
def test_loss_fn_that_does_not_return_a_scalar_is_reported_by_the_hessian(function):
    with raises(TypeError, "loss_fn", "scalar"):
        function(fresh_transformer(), NOT_SCALARS["logits"], token_data()[:1])


def test_loss_fn_that_is_not_callable_is_reported():
    with raises(TypeError, "`loss_fn` must be callable", "loss_fn(model, batch)"):
        geodesic_sharpness(fresh_transformer(), "cross_entropy", token_data(), rho=0.1)


# ---------------------------------------------------------------- hand-written plans
def bad_plan_group(problem: str) -> SymmetryGroup:
    shapes = dict(QK_SHAPES)
    layout, manifold = qk_layout, GLQuotient(7, 7)
    if problem == "parameter shape":
        shapes["q.weight"] = (6, 3)

        def layout(wq, bq, wk, bk):
            return torch.cat([torch.cat([wq, bq[None]]), torch.cat([wk.mT, bk[None]])])

    elif problem == "point rows":
        manifold = GLQuotient(6, 6)
    elif problem == "rank":
        manifold = GLQuotient(12, 2)
    elif problem == "missing parameter":
        shapes = {"nope": (4, 1)}
        layout, manifold = (lambda t: t), GLQuotient(2, 2)
    return SymmetryGroup.from_layout("custom q/k", manifold, shapes, layout, kind="query-key")


@pytest.mark.parametrize(
    ("problem", "needles"),
    [
        ("parameter shape", ("'custom q/k'", "'q.weight'", "(6, 3)", "(3, 6)")),
        ("point rows", ("'custom q/k'", "(..., n + m, h) = (..., 12, h)", "(14, 3)")),
        ("rank", ("'custom q/k'", "rank h = 3", "min(n, m) = 2")),
        ("missing parameter", ("'custom q/k'", "'nope'", "the model does not have")),
    ],
)
def test_hand_written_plan_that_does_not_fit_the_model_is_reported(problem, needles):
    with raises(PlanError, *needles):
        SymmetryPlan([bad_plan_group(problem)]).bind(LinearAttention().double())


def test_hand_written_plan_with_overlapping_groups_is_reported():
    groups = [
        SymmetryGroup.from_layout(name, GLQuotient(7, 7), QK_SHAPES, qk_layout)
        for name in ("first", "second")
    ]
    with raises(PlanError, "'q.weight'", "covered by two groups", "'second'"):
        SymmetryPlan(groups).bind(LinearAttention().double())


@pytest.mark.parametrize(
    ("layout", "needles"),
    [
        (lambda b: b[[0, 0]], ("'bad'", "uses some parameter entry twice")),
        (lambda b: b.double() * 2, ("'bad'", "must return a tensor built from its inputs")),
    ],
    ids=["entry-twice", "arithmetic"],
)
def test_hand_written_layout_that_is_not_an_index_map_is_reported(layout, needles):
    with raises(PlanError, *needles):
        SymmetryGroup.from_layout("bad", GLQuotient(2, 2), {"q.bias": (3,)}, layout)


def test_wrong_number_of_group_elements_is_reported():
    model = LinearAttention().double()
    bound = SymmetryPlan(
        [SymmetryGroup.from_layout("qk", GLQuotient(7, 7), QK_SHAPES, qk_layout)]
    ).bind(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    with raises(PlanError, "expected 1 group elements, got 2"):
        bound.act(params, [torch.eye(3, dtype=F64), None])


# ---------------------------------------------------------------- integer tensors
@pytest.mark.parametrize("function", [maximize_in_ball, average_in_ball])
def test_integer_base_point_is_a_type_error(function):
    point = torch.ones(3, dtype=torch.long)
    with raises(TypeError, "base points must be floating-point", "torch.int64", ".float()"):
        function([(point, AdaptiveEuclidean())], lambda p: p[0].sum(), rho=0.1)


class ComplexScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.complex64))

    def forward(self, x):
        return (self.w * x).abs().sum()


def test_non_float_trainable_parameter_is_a_type_error():
    """Integer parameters cannot require grad (torch refuses), so the reachable non-float
    trainable parameter is a complex one."""
    with pytest.raises(RuntimeError, match="floating point"):
        torch.nn.Parameter(torch.ones(3, dtype=torch.long))
    with raises(TypeError, "parameter 'w'", "torch.complex64", "sharpness needs floats"):
        adaptive_sharpness(ComplexScale(), lambda m, b: m(b), [torch.ones(3)], rho=0.1)


# ---------------------------------------------------------------- no trainable parameters
class IntegerOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.long), requires_grad=False)

    def forward(self, x):
        return (self.w * x).sum()


NO_TRAINABLE = {
    "geodesic": lambda m: geodesic_sharpness(m, lambda m, b: m(b).sum(), [torch.ones(2)], rho=0.1),
    "adaptive": lambda m: adaptive_sharpness(m, lambda m, b: m(b).sum(), [torch.ones(2)], rho=0.1),
    "hessian_trace": lambda m: hessian_trace(m, lambda m, b: m(b).sum(), [torch.ones(2)]),
}


@pytest.mark.parametrize("model", ["frozen", "integer-only"])
@pytest.mark.parametrize("call", sorted(NO_TRAINABLE))
def test_model_without_trainable_parameters_is_reported(call, model):
    module = torch.nn.Linear(2, 2).requires_grad_(False) if model == "frozen" else IntegerOnly()
    with raises(PlanError, "the model has no trainable parameters"):
        NO_TRAINABLE[call](module)


def test_model_without_trainable_parameters_message_says_what_to_do():
    with raises(PlanError, "requires_grad"):
        NO_TRAINABLE["adaptive"](torch.nn.Linear(2, 2).requires_grad_(False))


# ---------------------------------------------------------------- diagonal zero coordinate
@pytest.mark.parametrize("row", [0, 1], ids=["u=0", "v=0"])
def test_zero_diagonal_coordinate_is_rejected_by_the_manifold(row):
    x = torch.ones(2, 4, dtype=F64)
    x[row, 2] = 0.0
    with raises(ValueError, "`x`", "1 zero entries in u or v", "u_i != 0 and v_i != 0"):
        DiagonalQuotient().assert_check_point_on_manifold(x)


@pytest.mark.parametrize("row", [0, 1], ids=["u=0", "v=0"])
def test_zero_diagonal_coordinate_in_geodesic_sharpness_is_named(row):
    point = torch.ones(2, 4, dtype=F64)
    point[row, 2] = 0.0
    x = torch.randn(5, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    with raises(ValueError, "symmetry group 'uv", "zero entries in u or v", "u_i != 0"):
        geodesic_sharpness(Diagonal(point), lambda m, b: m(b).pow(2).mean(), [x], rho=0.1)


# ---------------------------------------------------------------- mix geodesic domain
def test_mix_geodesic_leaving_its_domain_raises():
    x = torch.ones(2, 3, dtype=F64)
    xi = torch.full((2, 3), -0.6, dtype=F64)  # horizontal, B = -0.6: 1 + 2B < 0
    with raises(GeodesicDomainError, "mix geodesic leaves the manifold", "1 + 2 B <= 0", "rho"):
        DiagonalQuotient("mix").expmap(x, xi)
    assert torch.isfinite(DiagonalQuotient("mix").expmap(x, xi / 2)).all()


@pytest.mark.parametrize("kind", ["worst", "average"])
def test_mix_geodesic_leaving_its_domain_in_geodesic_sharpness_suggests_a_smaller_rho(kind):
    model = Diagonal(torch.ones(2, 4, dtype=F64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.ones(5, 4, dtype=F64)
    with raises(GeodesicDomainError, "1 + 2 B <= 0", "smaller rho"):
        geodesic_sharpness(
            model, lambda m, b: -m(b).mean(), [x], rho=5.0, path="exact", kind=kind, iters=5
        )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    small = geodesic_sharpness(model, lambda m, b: -m(b).mean(), [x], rho=0.1, path="exact")
    assert math.isfinite(small.value)


# ---------------------------------------------------------------- unknown choices
@pytest.mark.parametrize(
    ("argument", "value", "choices"),
    [
        ("metric", "euclid", "['mix', 'inv']"),
        ("path", "geodesic", "['exact', 'second_order', 'straight']"),
        ("kind", "best", "['worst', 'average']"),
    ],
)
def test_unknown_choice_is_named_with_the_alternatives(argument, value, choices):
    with raises(ValueError, f"unknown `{argument}` {value!r}", f"expected one of {choices}"):
        geodesic_sharpness(
            fresh_transformer(), cross_entropy_loss, token_data(), rho=0.1, **{argument: value}
        )


# ---------------------------------------------------------------- checkpoints and data (CLI)
WORDS = TINY_BERT_WORDS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny BertForSequenceClassification + tokenizer saved with safetensors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    return save_tiny_bert_classifier(tmp_path_factory.mktemp("tiny-bert"), layers=1)


def cli_error(argv, capsys) -> str:
    """Run the CLI, expect an argument error (exit status 2), return stderr."""
    from geoopt_quotient.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def write_lines(path: Path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


GOOD = {"text": "the cat sat", "label": 0}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"label": 1}, "line 3: missing field(s) 'text'"),
        ({"text": "the cat"}, "line 3: missing field(s) 'label'"),
        ({"text": "a dog"}, "line 3: missing field(s) 'label'"),
        ({"text": "the cat", "label": 2}, "line 3: label 2 is outside [0, 2)"),
        ({"text": "the cat", "label": -1}, "line 3: label -1 is outside [0, 2)"),
        (
            {"text": "the cat", "label": "neutral"},
            "line 3: unknown label 'neutral' (label names: negative, positive)",
        ),
        ({"text": "the cat", "label": 0.5}, "line 3: label must be an integer or a label name"),
        ({"text": "the cat", "label": True}, "line 3: label must be an integer or a label name"),
        ({"text": "the cat", "label": None}, "line 3: label must be an integer or a label name"),
        ({"text": ["the", "cat"], "label": 0}, "line 3: 'text' must be a string"),
        ({"text": "a", "text_pair": 3, "label": 0}, "line 3: 'text_pair' must be a string"),
        ("{not json", "line 3: not valid JSON"),
        ("[1, 2]", "line 3: expected a JSON object, got list"),
    ],
)
def test_bad_data_line_is_reported_with_its_number(checkpoint, tmp_path, capsys, line, message):
    data = write_lines(tmp_path / "bad.jsonl", [GOOD, "", line, GOOD])
    err = cli_error(["sharpness", "--model", str(checkpoint), "--data", data], capsys)
    assert f"{data}, {message}" in err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "no examples"),
        (["", "   "], "no examples"),
        (
            [GOOD, {"text": "a", "text_pair": "b", "label": 1}],
            "'text_pair' must be given on every line or on none",
        ),
    ],
    ids=["empty", "blank", "mixed-pairs"],
)
def test_data_file_without_usable_examples_is_reported(
    checkpoint, tmp_path, capsys, lines, message
):
    data = write_lines(tmp_path / "data.jsonl", lines)
    err = cli_error(["sharpness", "--model", str(checkpoint), "--data", data], capsys)
    assert f"--data {data}: {message}" in err


def copy_without_weights(checkpoint: Path, target: Path, *extra: str) -> Path:
    target.mkdir()
    for name in os.listdir(checkpoint):
        if name != "model.safetensors":
            shutil.copy(checkpoint / name, target / name)
    for name in extra:
        (target / name).write_bytes(b"never unpickled")
    return target


def test_checkpoint_directory_with_only_pickled_weights_is_refused(checkpoint, tmp_path, capsys):
    bare = copy_without_weights(checkpoint, tmp_path / "bare", "pytorch_model.bin")
    data = write_lines(tmp_path / "d.jsonl", [GOOD])
    err = cli_error(["sharpness", "--model", str(bare), "--data", data], capsys)
    assert f"--model {bare}: no model.safetensors weights" in err
    assert "pickled weights are never loaded" in err
    assert "save_pretrained(dir, safe_serialization=True)" in err


def test_checkpoint_directory_without_weights_says_what_to_do(checkpoint, tmp_path, capsys):
    bare = copy_without_weights(checkpoint, tmp_path / "bare")
    data = write_lines(tmp_path / "d.jsonl", [GOOD])
    err = cli_error(["sharpness", "--model", str(bare), "--data", data], capsys)
    assert f"--model {bare}: no model.safetensors weights" in err
    assert "save_pretrained" in err


def test_checkpoint_directory_without_weights_is_reported_by_the_loader(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with raises(FileNotFoundError, str(tmp_path), "has no weights", "save_pretrained("):
        find_weights(tmp_path)
    with raises(FileNotFoundError, "no checkpoint file at", "missing.pt"):
        load_state_dict(tmp_path / "missing.pt")


class Opaque:
    """A harmless class: a pickle that references it needs code to load."""

    def __init__(self):
        self.value = 1


def test_checkpoint_that_needs_code_to_load_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump({"weight": torch.ones(2), "extra": Opaque()}, f, protocol=2)
    with raises(UnsafeCheckpointError, f"refused to load {path}", "Convert it to safetensors"):
        load_state_dict(path)


# ---------------------------------------------------------------- symmetry verification
def test_declared_group_that_is_not_a_symmetry_is_named():
    """Pairing the query with the *output* projection is no symmetry of the model."""
    torch.manual_seed(0)
    model = LinearAttention().double()
    shapes = {"q.weight": (3, 6), "q.bias": (3,), "out.weight": (1, 6), "out.bias": (1,)}

    def index_layout(wq, bq, wo, bo):  # G: (7, 1) from q's first row; H: (7, 1) from out
        g = torch.cat([wq[:1].mT, bq[:1][None]])
        h = torch.cat([wo.mT, bo[None]])
        return torch.cat([g, h])

    group = SymmetryGroup.from_layout("q/out", GLQuotient(7, 7), shapes, index_layout)
    probe = torch.randn(4, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(1))
    needles = ("group 'q/out' is not a symmetry of LinearAttention", "drop the group")
    with raises(SymmetryVerificationError, *needles):
        verify_plan(model, SymmetryPlan([group]), probe)


# ============================================================================ no mutation
def bits(model: torch.nn.Module):
    return {
        k: v.detach().contiguous().view(torch.uint8).clone() for k, v in model.state_dict().items()
    }


def model_state(model: torch.nn.Module):
    return (
        bits(model),
        [(name, m.training) for name, m in model.named_modules()],
        [(name, p.requires_grad) for name, p in model.named_parameters()],
    )


def hessian_trace_euclidean(model, loss_fn, batches):
    return hessian_trace(model, loss_fn, batches, riemannian=False, probes=4)


MEASUREMENTS = {
    "geodesic-worst": lambda m, f, b: geodesic_sharpness(m, f, b, rho=0.05, iters=4),
    "geodesic-average": lambda m, f, b: geodesic_sharpness(m, f, b, rho=0.05, kind="average"),
    "geodesic-exact-inv": lambda m, f, b: geodesic_sharpness(
        m, f, b, rho=0.05, iters=3, path="exact", metric="inv"
    ),
    "adaptive": lambda m, f, b: adaptive_sharpness(m, f, b, rho=0.05, iters=4),
    "hessian_trace": lambda m, f, b: hessian_trace(m, f, b, probes=4),
    "hessian_trace-euclidean": hessian_trace_euclidean,
    "hessian_top_eigenvalue": lambda m, f, b: hessian_top_eigenvalue(m, f, b, iters=4),
}


class Boom(RuntimeError):
    """An error inside the user's loss_fn."""


FAILURES = {
    "raises": (Boom, Boom),
    "interrupt": (KeyboardInterrupt, KeyboardInterrupt),
    "nan": (lambda value: value * math.nan, NonFiniteError),
}


@pytest.mark.parametrize(
    ("measurement", "failure"),
    [
        (measurement, failure)
        for measurement in sorted(MEASUREMENTS)
        for failure in sorted(FAILURES)
        # the Hessian does not check the loss: test_non_finite_loss_is_reported_by_the_hessian
        if not (failure == "nan" and measurement.startswith("hessian"))
    ],
)
def test_failed_call_leaves_the_model_untouched(measurement, failure):
    """The loss fails on its 3rd call (mid-way: after the clean loss and at least one
    perturbed one) and draws from the global RNG on every call, with the model in mixed
    train/eval modes and one parameter frozen."""
    bad, expected = FAILURES[failure]
    model = fresh_transformer()
    model.train()
    model.layers[1].eval()
    model.embed.weight.requires_grad_(False)
    before = model_state(model)
    torch.manual_seed(1234)
    rng = torch.random.get_rng_state()

    def consuming(m, batch):
        torch.rand(3)  # the loss may draw random numbers (dropout-like)
        return cross_entropy_loss(m, batch)

    with pytest.raises(expected):
        MEASUREMENTS[measurement](model, calls_failing_at(3, bad, consuming), token_data())
    after = model_state(model)
    assert before[1] == after[1], "train/eval modes changed"
    assert before[2] == after[2], "requires_grad flags changed"
    assert before[0].keys() == after[0].keys()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]), "weights changed"
    assert torch.equal(torch.random.get_rng_state(), rng), "global RNG state changed"
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "problem", ["rank-deficient", "nan-weight", "bad-rho", "empty-batches", "not-a-scalar"]
)
def test_rejected_call_leaves_the_model_untouched(problem):
    """Validation failures too (they happen inside the preserved state, after eval())."""
    model = fresh_transformer()
    model.train()
    model.layers[0].eval()
    if problem == "rank-deficient":
        make_rank_deficient(model)
    elif problem == "nan-weight":
        with torch.no_grad():
            model.head.bias[0] = math.nan
    before = model_state(model)
    rng = torch.random.get_rng_state()
    kwargs = dict(rho=0.1, iters=2)
    batches, loss_fn = token_data(), cross_entropy_loss
    if problem == "bad-rho":
        kwargs["rho"] = -1.0
    elif problem == "empty-batches":
        batches = []
    elif problem == "not-a-scalar":
        loss_fn = NOT_SCALARS["logits"]
    with pytest.raises((ValueError, TypeError)):
        geodesic_sharpness(model, loss_fn, batches, **kwargs)
    after = model_state(model)
    assert before[1:] == after[1:]
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert torch.equal(torch.random.get_rng_state(), rng)


# ============================================================================ determinism
DETERMINISM_SCRIPT = """
import sys
import torch
sys.path.insert(0, {tests!r})
from conftest import TinyTransformer, cross_entropy_loss
from geoopt_quotient import geodesic_sharpness
torch.manual_seed(0)
model = TinyTransformer().double()
g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, 11, (16, 6), generator=g)
labels = torch.randint(0, 2, (16,), generator=g)
batches = [(tokens[:8], labels[:8]), (tokens[8:], labels[8:])]
r = geodesic_sharpness(
    model, cross_entropy_loss, batches, rho=0.05, iters=5, seed=7, kind={kind!r},
    progress=False,
)
print(repr((r.value, r.per_batch, r.clean_losses, r.perturbed_losses, r.histories)))
"""


@pytest.mark.parametrize("kind", ["worst", "average"])
def test_same_seed_is_bitwise_identical_in_separate_processes(kind):
    """``repr`` of a float round-trips exactly, so equal text means equal bits. The two
    processes differ in their hash seed (set and dict orders)."""
    script = DETERMINISM_SCRIPT.format(tests=str(TESTS), kind=kind)
    outputs = []
    for hash_seed in ("0", "12345"):
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    assert outputs[0] == outputs[1]
    value, per_batch, *_ = ast.literal_eval(outputs[0])
    assert math.isfinite(value) and value > 0 and len(per_batch) == 2


# ---------------------------------------------------------------- common mistakes
def hf_classifier_and_batch():
    g = torch.Generator().manual_seed(3)
    batch = {
        "input_ids": torch.randint(0, 30, (4, 6), generator=g),
        "labels": torch.randint(0, 3, (4,), generator=g),
    }
    return tiny_bert_classifier(), batch


@pytest.mark.parametrize(
    ("loss_fn", "hint"),
    [
        (lambda m, b: m(**b), "return the model output's loss (m(**b).loss)"),
        (lambda m, b: m(input_ids=b["input_ids"]), "with no loss: pass the labels in the batch"),
        (lambda m, b: None, "got None: it returned nothing (a missing `return`?)"),
        (lambda m, b: m(**b).logits, "got a tensor of shape (4, 3): reduce it"),
    ],
)
def test_a_loss_fn_returning_the_wrong_thing_is_told_what_to_return(loss_fn, hint):
    model, batch = hf_classifier_and_batch()
    with raises(TypeError, "(loss_fn) must return a scalar tensor", hint):
        geodesic_sharpness(model, loss_fn, [batch], rho=0.05, iters=2)


@pytest.mark.parametrize("function", ["geodesic", "adaptive", "hessian_trace", "calibrate_rho"])
def test_a_single_dict_for_batches_is_refused(function):
    model, batch = hf_classifier_and_batch()

    def loss_fn(m, b):
        return m(**b).loss

    calls = {
        "geodesic": lambda: geodesic_sharpness(model, loss_fn, batch, rho=0.05, iters=2),
        "adaptive": lambda: adaptive_sharpness(model, loss_fn, batch, rho=0.05, iters=2),
        "hessian_trace": lambda: hessian_trace(model, loss_fn, batch, probes=1),
        "calibrate_rho": lambda: calibrate_rho(
            model, loss_fn, batch, target=0.1, measure="adaptive", iters=2
        ),
    }
    with raises(TypeError, "`batches` is a single batch (a dict", "[batch] or a DataLoader"):
        calls[function]()


def test_float32_inputs_to_a_float64_model_are_named():
    model = torch.nn.Linear(3, 1).double()
    batch = torch.randn(2, 3)  # float32
    with pytest.raises(RuntimeError) as info:
        adaptive_sharpness(model, lambda m, b: m(b).sum(), [batch], rho=0.05, iters=2)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "the batch holds float32 tensors but the model's parameters are float64" in notes
