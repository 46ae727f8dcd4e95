"""Low-precision models: rank judged at the dtype's resolution, rounding warned or refused."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import TinyTransformer, cross_entropy_loss

import geoopt_quotient as gq

pytestmark = pytest.mark.on_device

LOW = [torch.bfloat16, torch.float16]


def factor_with_singular_values(rows: int, values, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(len(values), len(values), generator=g, dtype=torch.float64))
    return (u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T).to(dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_well_conditioned_low_precision_factor_is_full_rank(dtype):
    """sigma_min / sigma_max = 0.33 is far above bfloat16's resolution (about 0.01 here)."""
    h, rows = 8, 64
    values = torch.linspace(1.0, 0.33, h).tolist()
    manifold = gq.GLQuotient(rows, rows)
    point = torch.cat(
        [factor_with_singular_values(rows, values, dtype)] * 2, dim=-2
    )  # (G; H) stacked
    ok, reason = manifold.check_point_on_manifold(point, explain=True)
    assert ok, reason


@pytest.mark.parametrize("dtype", LOW)
def test_factor_below_the_dtype_resolution_is_rank_deficient(dtype):
    h, rows = 8, 64
    resolution = math.sqrt(h) * torch.finfo(dtype).eps / 2
    values = [1.0] * (h - 1) + [resolution / 4]
    manifold = gq.GLQuotient(rows, rows)
    good = factor_with_singular_values(rows, [1.0] * h, dtype)
    point = torch.cat([factor_with_singular_values(rows, values, dtype), good], dim=-2)
    ok, reason = manifold.check_point_on_manifold(point, explain=True)
    assert not ok and "G is rank-deficient" in reason


def tiny(dtype):
    torch.manual_seed(0)
    return TinyTransformer().to(dtype)


def token_batch():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (8, 6), generator=g), torch.randint(0, 2, (8,), generator=g))]


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_loss_warns_with_the_remedy(dtype):
    name = str(dtype).split(".")[-1]
    with pytest.warns(UserWarning, match=rf"{name} \(resolution .*\) parameters"):  # the model's
        with pytest.warns(UserWarning, match=rf"{name} loss.*logits.float\(\)"):
            gq.adaptive_sharpness(tiny(dtype), cross_entropy_loss, token_batch(), rho=0.05, iters=2)


def test_float32_loss_of_a_low_precision_model_does_not_warn_about_the_loss():
    def float_loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]).float(), b[1])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gq.adaptive_sharpness(tiny(torch.bfloat16), float_loss, token_batch(), rho=0.05, iters=2)
    messages = [str(w.message) for w in caught]
    assert not any("loss_fn returns" in m for m in messages), messages
    assert any("bfloat16 (resolution" in m for m in messages), "the weights' warning is gone"


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: gq.hessian_trace(m, cross_entropy_loss, b, probes=1),
        lambda m, b: gq.hessian_trace(m, cross_entropy_loss, b, probes=1, riemannian=False),
        lambda m, b: gq.hessian_top_eigenvalue(m, cross_entropy_loss, b, iters=2),
    ],
    ids=["trace", "euclidean-trace", "top-eigenvalue"],
)
def test_hessian_refuses_low_precision_models(dtype, call):
    with pytest.raises(TypeError, match=r"model\.float\(\)"):
        call(tiny(dtype), token_batch())


def test_hessian_of_a_float32_model_under_autocast_runs():
    model = tiny(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = gq.hessian_trace(model, cross_entropy_loss, token_batch(), probes=2)
    assert math.isfinite(result.value)
