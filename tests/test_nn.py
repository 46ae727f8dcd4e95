"""Layers of geoopt_quotient.nn: shapes, conversions, invariance, optimisers, state dicts."""

from __future__ import annotations

import math

import geoopt
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from geoopt_quotient import DiagonalQuotient, GLQuotient
from geoopt_quotient.nn import (
    DiagonalLinear,
    FactorizedLinear,
    LoRALinear,
    QuotientMultiheadAttention,
    balance,
    balanced_factors,
    wrap_linear_layers,
)
from geoopt_quotient.optim import RiemannianAdam, RiemannianSGD
from geoopt_quotient.testing.models import (
    act_on_module,
    attention_blocks,
    group_elements_for,
    quotient_parameters,
    random_group_elements,
)

DT = torch.float64


pytestmark = [pytest.mark.on_device, pytest.mark.usefixtures("single_thread")]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=gen(seed), dtype=DT)


# ---------------------------------------------------------------- helpers
def test_balance_keeps_product_and_balances():
    g, h = randn(7, 3, seed=1), randn(5, 3, seed=2)
    bg, bh = balance(g, h)
    torch.testing.assert_close(bg @ bh.mT, g @ h.mT, rtol=0, atol=1e-12)
    torch.testing.assert_close(bg.mT @ bg, bh.mT @ bh, rtol=0, atol=1e-12)
    # same orbit: (bg, bh) = (g A^{-1}, h A^T) with A = pinv(bg) g
    a = torch.linalg.pinv(bg) @ g
    torch.testing.assert_close(GLQuotient(7, 5).act(torch.cat((g, h)), a), torch.cat((bg, bh)))


def test_balanced_factors_is_eckart_young():
    w = randn(6, 4, seed=3)
    g, h = balanced_factors(w, 2)
    u, s, vh = torch.linalg.svd(w)
    torch.testing.assert_close(g @ h.mT, (u[:, :2] * s[:2]) @ vh[:2], rtol=0, atol=1e-12)
    torch.testing.assert_close(g.mT @ g, torch.diag(s[:2]), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- FactorizedLinear
def test_factorized_linear_forward_and_layout():
    layer = FactorizedLinear(6, 4, 3, dtype=DT, generator=gen(0))
    assert layer.factors.shape == (4 + 6, 3)
    assert isinstance(layer.factors, geoopt.ManifoldParameter)
    assert isinstance(layer.factors.manifold, GLQuotient)
    g, h = layer.factor_pair()
    assert g.shape == (4, 3) and h.shape == (6, 3)
    torch.testing.assert_close(layer.weight, g @ h.mT)
    x = randn(5, 2, 6, seed=1)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert FactorizedLinear(6, 4, 3, bias=False, dtype=DT)(x).shape == (5, 2, 4)


def test_factorized_linear_init_scale_matches_nn_linear():
    # Var W_ij = 1 / (3 in): the variance of nn.Linear's U(-1/sqrt(in), 1/sqrt(in))
    layer = FactorizedLinear(400, 300, 20, dtype=DT, generator=gen(0))
    assert layer.weight.var().item() == pytest.approx(1 / 1200, rel=0.1)
    g, h = layer.factor_pair()
    torch.testing.assert_close(g.mT @ g, h.mT @ h, rtol=0, atol=1e-10)  # balanced
    bound = 1 / math.sqrt(400)
    assert layer.bias.abs().max() <= bound


def test_factorized_linear_from_linear():
    linear = nn.Linear(6, 5, dtype=DT)
    full = FactorizedLinear.from_linear(linear, 5)
    x = randn(3, 6, seed=4)
    torch.testing.assert_close(full(x), linear(x), rtol=0, atol=1e-12)
    low = FactorizedLinear.from_linear(linear, 2, metric="inv")
    assert low.manifold.metric == "inv"
    u, s, vh = torch.linalg.svd(linear.weight.detach())
    torch.testing.assert_close(low.weight, (u[:, :2] * s[:2]) @ vh[:2], rtol=0, atol=1e-12)
    g, h = low.factor_pair()
    torch.testing.assert_close(g.mT @ g, h.mT @ h, rtol=0, atol=1e-12)

    deficient = nn.Linear(4, 4, bias=False, dtype=DT)
    with torch.no_grad():
        deficient.weight.copy_(randn(4, 1, seed=5) @ randn(1, 4, seed=6))
    with pytest.raises(ValueError, match="rank-deficient"):
        FactorizedLinear.from_linear(deficient, 2)


def test_factorized_linear_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        FactorizedLinear(3, 5, 4)
    with pytest.raises(TypeError):
        FactorizedLinear(3, 5, 1.5)


# ---------------------------------------------------------------- LoRALinear
def test_lora_linear_starts_at_base_function():
    base = nn.Linear(8, 6, dtype=DT)
    lora = LoRALinear(base, rank=3, alpha=6.0, generator=gen(0))
    x = randn(4, 8, seed=1)
    torch.testing.assert_close(lora(x), base(x), rtol=0, atol=1e-14)
    assert not any(p.requires_grad for p in base.parameters())
    assert [n for n, p in lora.named_parameters() if p.requires_grad] == ["factors"]
    assert lora.scaling == 2.0
    # a well-conditioned full-rank point: s B0 A0^T has all singular values init_scale
    svals = torch.linalg.svdvals(lora.scaling * lora.manifold.product(lora.factors))
    torch.testing.assert_close(svals[:3], torch.full((3,), lora.init_scale, dtype=DT))
    assert lora.init_scale == 1.0
    assert lora.manifold.check_point_on_manifold(lora.factors)
    b, a = lora.manifold.factors(lora.factors)
    torch.testing.assert_close(b.mT @ b, a.mT @ a)  # balanced


def test_lora_linear_merged_weight_and_gradients():
    base = nn.Linear(8, 6, dtype=DT)
    lora = LoRALinear(base, rank=2, alpha=4.0, init_scale=0.5, generator=gen(1))
    with torch.no_grad():
        lora.factors.add_(0.1 * randn(14, 2, seed=2))
    x = randn(5, 8, seed=3)
    torch.testing.assert_close(lora(x), F.linear(x, lora.merged_weight(), base.bias))
    assert torch.linalg.matrix_rank(lora.delta_weight()) <= 4
    lora(x).square().sum().backward()
    assert lora.factors.grad is not None and base.weight.grad is None

    plain = LoRALinear(base, rank=2, alpha=2.0, cancel_init=False, init_scale=1e-2)
    assert plain.init_factors is None
    torch.testing.assert_close(
        torch.linalg.svdvals(plain.delta_weight())[:2], 1e-2 * torch.ones(2, dtype=DT)
    )
    torch.testing.assert_close(plain(x), F.linear(x, plain.merged_weight(), base.bias))


def test_lora_linear_rejects_bad_arguments():
    with pytest.raises(TypeError):
        LoRALinear(nn.Conv1d(2, 2, 1), 1, 1.0)
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(nn.Linear(3, 2), 3, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        LoRALinear(nn.Linear(3, 2), 1, 0.0)


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
        initializer_range=0.5,  # large enough for the adapters to move the logits visibly
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).eval()


def test_wrap_linear_layers_on_tiny_bert():
    model = _tiny_bert()
    ids = torch.randint(0, 50, (2, 7), generator=gen(0))
    before = model(input_ids=ids).logits
    paths = wrap_linear_layers(model, ["query", "value"], rank=2, alpha=4.0)
    assert paths == [
        f"bert.encoder.layer.{i}.attention.self.{n}" for i in range(2) for n in ("query", "value")
    ]
    for path in paths:
        assert isinstance(model.get_submodule(path), LoRALinear)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{p}.factors" for p in paths]
    # the adapter adds s(B Aᵀ - B₀A₀ᵀ) = 0 up to rounding: a few float32 ulps of the logits
    assert_close(model(input_ids=ids).logits, before, rtol=64 * torch.finfo(torch.float32).eps)

    # a second call with a predicate wraps the keys and never an adapter's base layer
    more = wrap_linear_layers(model, lambda path, m: path.endswith(("key", "base")), 1, 1.0)
    assert more == [f"bert.encoder.layer.{i}.attention.self.key" for i in range(2)]
    with pytest.raises(ValueError, match=r"no torch\.nn\.Linear"):
        wrap_linear_layers(model, "nonexistent", 1, 1.0)

    # geoopt's RiemannianAdam trains the adapters; the frozen weights stay put
    frozen = model.bert.embeddings.word_embeddings.weight.clone()
    opt = geoopt.optim.RiemannianAdam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    labels = torch.tensor([0, 2])
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight, frozen)


# ---------------------------------------------------------------- DiagonalLinear
def test_diagonal_linear():
    layer = DiagonalLinear(5, metric="inv", init_scale=0.5, dtype=DT)
    assert isinstance(layer.uv.manifold, DiagonalQuotient)
    torch.testing.assert_close(layer.beta, torch.full((5,), 0.25, dtype=DT))
    x = randn(3, 4, 5, seed=0)
    torch.testing.assert_close(layer(x), x @ layer.beta)
    assert layer(x).shape == (3, 4)
    with pytest.raises(ValueError, match="non-zero"):
        DiagonalLinear(3, init_scale=0.0)


# ---------------------------------------------------------------- attention
def _mha(embed: int = 12, heads: int = 3, bias: bool = True, batch_first: bool = True):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(embed, heads, bias=bias, batch_first=batch_first, dtype=DT)
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0, 0.5)
    return mha.eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_matches_torch(bias, batch_first):
    mha = _mha(bias=bias, batch_first=batch_first)
    quo = QuotientMultiheadAttention.from_torch(mha).eval()
    n = 13 if bias else 12
    assert quo.qk.shape == (3, 2 * n, 4) and quo.vo.shape == (3, n + 12, 4)
    assert quo.batch_first == batch_first
    x = randn(2, 5, 12, seed=1)
    if not batch_first:
        x = x.transpose(0, 1)
    ref, ref_w = mha(x, x, x)
    out, w = quo(x, need_weights=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    assert quo(x)[1] is None


def test_attention_masks_and_signature_match_torch():
    mha = _mha()
    quo = QuotientMultiheadAttention.from_torch(mha).eval()
    x, y = randn(2, 5, 12, seed=1), randn(2, 6, 12, seed=2)
    z = randn(2, 6, 12, seed=3)
    padding = torch.tensor([[False] * 5 + [True], [False] * 6])
    bool_mask = torch.rand(5, 6, generator=gen(4)) < 0.3
    bool_mask[:, 0] = False
    float_mask = randn(2 * 3, 5, 6, seed=5)
    cases = [
        {"key_padding_mask": padding},
        {"attn_mask": bool_mask},
        {"attn_mask": float_mask},
        {"attn_mask": bool_mask, "key_padding_mask": padding},
        {"average_attn_weights": False},
    ]
    for kwargs in cases:
        ref, ref_w = mha(x, y, z, need_weights=True, **kwargs)
        out, w = quo(x, y, z, need_weights=True, **kwargs)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(w, ref_w, rtol=0, atol=1e-12)
    # causal hint, unbatched input, value defaults to key
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref, _ = mha(x, x, x, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(quo(x, is_causal=True)[0], ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(quo(x[0], y[0])[0], mha(x[0], y[0], y[0])[0], rtol=0, atol=1e-12)


def test_attention_round_trip_and_default_init():
    quo = QuotientMultiheadAttention(8, 2, dtype=DT, generator=gen(0))
    back = quo.to_torch().eval()
    x = randn(3, 4, 8, seed=1)
    torch.testing.assert_close(back(x, x, x)[0], quo(x)[0], rtol=0, atol=1e-12)
    again = QuotientMultiheadAttention.from_torch(back)
    torch.testing.assert_close(again.qk, quo.qk, rtol=0, atol=0)
    torch.testing.assert_close(again.vo, quo.vo, rtol=0, atol=0)
    for p in (quo.qk, quo.vo):
        assert p.manifold.check_point_on_manifold(p)
    with pytest.raises(ValueError, match="divide"):
        QuotientMultiheadAttention(10, 3)


def test_attention_is_a_drop_in_for_transformer_encoder_layer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=DT)
    x = randn(3, 5, 8, seed=1)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, -2:] = True
    ref = layer.eval()(x, src_key_padding_mask=padding)
    layer.self_attn = QuotientMultiheadAttention.from_torch(layer.self_attn)
    for mode in (True, False):
        layer.train(mode)
        torch.testing.assert_close(layer(x, src_key_padding_mask=padding), ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # the fused fast path would run here for nn.MultiheadAttention
        torch.testing.assert_close(layer.eval()(x), layer.train()(x), rtol=0, atol=1e-12)
        with pytest.warns(UserWarning, match="use_nested_tensor is False"):
            encoder = nn.TransformerEncoder(layer, 2).eval()  # layers are deep copies
        assert not encoder.use_nested_tensor
        twice = layer.eval()(layer(x, src_key_padding_mask=padding), src_key_padding_mask=padding)
        out = encoder(x, src_key_padding_mask=padding)
        torch.testing.assert_close(out[~padding], twice[~padding], rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_attention_invariant_under_per_head_group_action(data):
    block = data.draw(attention_blocks(kinds=("quotient",), num_heads=st.integers(1, 3)))
    elements = data.draw(group_elements_for(block, min_condition=2.0, max_condition=100.0))
    assert set(elements) == {"qk", "vo"}
    heads, width = block.num_heads, block.head_dim
    assert elements["qk"].shape == elements["vo"].shape == (heads, width, width)
    moved = act_on_module(block, elements)
    assert (moved.qk - block.qk).abs().max() > 1e-3  # the factors really changed
    x = torch.randn(2, 4, block.embed_dim, generator=gen(data.draw(st.integers(0, 99))), dtype=DT)
    out, w = block(x, need_weights=True)
    moved_out, moved_w = moved(x, need_weights=True)
    scale = 1 + out.abs().max().item()
    assert (moved_out - out).abs().max().item() <= 1e-10 * scale
    assert (moved_w - w).abs().max().item() <= 1e-10


@settings(max_examples=10, deadline=None)
@given(block=attention_blocks(kinds=("torch",)))
def test_attention_blocks_torch_kind_matches_quotient(block):
    assert isinstance(block, nn.MultiheadAttention)
    quo = QuotientMultiheadAttention.from_torch(block)
    x = torch.randn(2, 3, block.embed_dim, generator=gen(0), dtype=DT)
    torch.testing.assert_close(quo(x)[0], block(x, x, x)[0], rtol=0, atol=1e-12)


def test_random_group_elements():
    a = random_group_elements((4,), 3, condition=50.0, generator=gen(0))
    torch.testing.assert_close(torch.linalg.cond(a), torch.full((4,), 50.0, dtype=DT))
    assert (torch.linalg.det(a) < 0).any() and (torch.linalg.det(a) > 0).any()
    with pytest.raises(ValueError, match="no parameter"):
        group_elements_for(nn.Linear(2, 2))


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_group_elements_for_diagonal_linear(data):
    layer = DiagonalLinear(6, dtype=DT)
    assert [n for n, _ in quotient_parameters(layer)] == ["uv"]
    elements = data.draw(group_elements_for(layer, min_condition=10.0, max_condition=10.0))
    alpha = elements["uv"]
    assert alpha.shape == (6,)
    assert (alpha.abs().max() / alpha.abs().min()).item() == pytest.approx(10.0)
    moved = act_on_module(layer, elements)
    torch.testing.assert_close(moved.beta, layer.beta)
    assert not torch.equal(moved.uv, layer.uv)


# ---------------------------------------------------------------- optimisers and state dicts
def _modules():
    torch.manual_seed(0)
    return {
        "factorized": (FactorizedLinear(6, 5, 2, dtype=DT), (4, 6)),
        "lora": (LoRALinear(nn.Linear(6, 5, dtype=DT), 2, 4.0), (4, 6)),
        "diagonal": (DiagonalLinear(6, dtype=DT), (4, 6)),
        "attention": (QuotientMultiheadAttention(6, 2, dtype=DT), (2, 3, 6)),
    }


def _output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _train(module, optimizer, x, steps):
    target = torch.sin(3 * x.sum(-1))
    loss = None
    for _ in range(steps):
        optimizer.zero_grad()
        out = _output(module, x)
        loss = (out - (target if out.dim() == target.dim() else target[..., None])).square().mean()
        loss.backward()
        optimizer.step()
    return loss.item()


OPTIMIZERS = {
    "geoopt-adam": lambda p: geoopt.optim.RiemannianAdam(p, lr=1e-2),
    "adam": lambda p: RiemannianAdam(p, lr=1e-2),
    "sgd-momentum": lambda p: RiemannianSGD(p, lr=1e-2, momentum=0.9),
    "geoopt-sgd": lambda p: geoopt.optim.RiemannianSGD(p, lr=1e-2),
}


@pytest.mark.parametrize("name", ["factorized", "lora", "diagonal", "attention"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_modules_train_with_geoopt_optimizers(name, opt_name):
    module, shape = _modules()[name]
    x = 0.3 * randn(*shape, seed=1)
    opt = OPTIMIZERS[opt_name]([p for p in module.parameters() if p.requires_grad])
    first = _train(module, opt, x, 1)
    last = _train(module, opt, x, 20)
    assert last < first
    for _, p in quotient_parameters(module):
        assert p.manifold.check_point_on_manifold(p)


FRESH = {
    "factorized": lambda: FactorizedLinear(6, 5, 2, dtype=DT),
    "lora": lambda: LoRALinear(nn.Linear(6, 5, dtype=DT), 2, 4.0),
    "diagonal": lambda: DiagonalLinear(6, init_scale=2.0, dtype=DT),
    "attention": lambda: QuotientMultiheadAttention(6, 2, dtype=DT),
}
RESUMABLE = {
    "adam": lambda p: RiemannianAdam(p, lr=1e-2),
    "sgd-momentum": lambda p: RiemannianSGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(FRESH))
@pytest.mark.parametrize("opt_name", list(RESUMABLE))
def test_state_dict_round_trip_weights_only(name, opt_name, tmp_path):
    """Module and optimizer state survive torch.save / torch.load(weights_only=True)
    into fresh objects, and training resumes bit for bit."""
    module, shape = _modules()[name]
    x = randn(*shape, seed=1)
    make = RESUMABLE[opt_name]
    opt = make(list(module.parameters()))
    _train(module, opt, x, 3)
    torch.save({"model": module.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")

    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    torch.manual_seed(123)  # the fresh module starts elsewhere
    fresh = FRESH[name]()
    assert not torch.equal(_output(fresh, x), _output(module, x))
    fresh.load_state_dict(loaded["model"])
    torch.testing.assert_close(_output(fresh, x), _output(module, x), rtol=0, atol=0)
    for (_, p), (_, q) in zip(quotient_parameters(fresh), quotient_parameters(module)):
        assert isinstance(p, geoopt.ManifoldParameter)
        assert repr(p.manifold) == repr(q.manifold)

    fresh_opt = make(list(fresh.parameters()))
    fresh_opt.load_state_dict(loaded["opt"])
    _train(module, opt, x, 3)
    _train(fresh, fresh_opt, x, 3)
    torch.testing.assert_close(_output(fresh, x), _output(module, x), rtol=0, atol=0)


def test_geoopt_adam_resumes_inexactly_and_ours_exactly(tmp_path):
    """geoopt's RiemannianAdam after load_state_dict computes its bias corrections from
    a float32 step tensor (torch.optim.Adam.__setstate__ converts the int); ours keeps
    the int. Documents why geoopt_quotient.optim.RiemannianAdam exists."""
    x = randn(16, 6, seed=2)
    gaps = {}
    for label, cls in (("geoopt", geoopt.optim.RiemannianAdam), ("ours", RiemannianAdam)):
        torch.manual_seed(0)
        reference = FactorizedLinear(6, 5, 2, dtype=DT)
        resumed = FactorizedLinear(6, 5, 2, dtype=DT)
        resumed.load_state_dict(reference.state_dict())
        opt_ref, opt_res = cls(reference.parameters(), lr=1e-2), cls(resumed.parameters(), lr=1e-2)
        _train(reference, opt_ref, x, 5)
        _train(resumed, opt_res, x, 5)
        torch.save(opt_res.state_dict(), tmp_path / f"{label}.pt")
        opt_res = cls(resumed.parameters(), lr=1e-2)
        opt_res.load_state_dict(torch.load(tmp_path / f"{label}.pt", weights_only=True))
        _train(reference, opt_ref, x, 20)
        _train(resumed, opt_res, x, 20)
        gaps[label] = (_output(reference, x) - _output(resumed, x)).abs().max().item()
    assert gaps["ours"] == 0.0
    assert gaps["geoopt"] > 1e-8, gaps  # ~3e-6: float32 bias corrections


def test_riemannian_adam_rejects_ignored_options():
    params = [nn.Parameter(torch.zeros(2))]
    for flag in ("maximize", "decoupled_weight_decay"):
        with pytest.raises(ValueError, match=flag):
            RiemannianAdam(params, lr=1e-2, **{flag: True})
