"""The rotary population study: modular-arithmetic data, resumable training to loss
thresholds, partial Kendall tau, the maximiser's per-block shares (sums, first order,
invariance under the group), and ``reproduce rotary --quick`` end to end (slow)."""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from geoopt_quotient import adaptive_sharpness, find_symmetries, geodesic_sharpness
from geoopt_quotient.cli import main
from geoopt_quotient.experiments.population import modular
from geoopt_quotient.experiments.population.modular import (
    ModularTask,
    PopulationSpec,
    RotaryRecipe,
    answer_loss,
    build_rotary_model,
    modular_pairs,
    sharpness_batches,
    train_run,
)
from geoopt_quotient.sharpness.apgd import BallGroup
from geoopt_quotient.sharpness.functional import trainable_parameters
from geoopt_quotient.sharpness.layout import BallLayout
from geoopt_quotient.sharpness.shares import block_of
from geoopt_quotient.sharpness.stats import (
    partial_kendall_tau,
    partial_kendall_tau_bootstrap,
)
from geoopt_quotient.testing.models import random_group_elements

TINY = ModularTask(p=11)
F64_EPS = torch.finfo(torch.float64).eps


# ----------------------------------------------------------------------------- data
def test_pairs_are_deterministic_nested_and_correct():
    inputs, answers = modular_pairs(TINY, 3)
    again, same = modular_pairs(TINY, 3)
    other, _ = modular_pairs(TINY, 4)
    assert torch.equal(inputs, again) and torch.equal(answers, same)
    assert not torch.equal(inputs, other)
    assert sorted(map(tuple, inputs[:, :2].tolist())) == list(
        itertools.product(range(11), repeat=2)
    )
    assert torch.equal(answers, (inputs[:, 0] + inputs[:, 1]) % 11)
    assert (inputs[:, 2] == 11).all()
    squares = modular_pairs(ModularTask(11, "square_sum"), 3)[1]
    a, b = inputs[:, 0], inputs[:, 1]
    assert torch.equal(squares, (a * a + a * b + b * b) % 11)
    # the sharpness examples are the first pairs: training examples of every model
    (batch,) = sharpness_batches(TINY, 3, 20, 32)
    assert torch.equal(batch[0]["input_ids"], inputs[:20])


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="decreasing"):
        PopulationSpec(thresholds=(0.01, 0.1))
    with pytest.raises(ValueError, match="multiple of 8"):
        PopulationSpec(widths=(12,))
    with pytest.raises(ValueError, match="unknown operation"):
        ModularTask(11, "div")


# ----------------------------------------------------------------------------- training
SPEC = PopulationSpec(task=TINY, widths=(16,), thresholds=(0.5, 0.1), max_steps=400)
RECIPE = RotaryRecipe(16, 1, 0.6, 0.1, 5e-3, seed=7)


class _Killed(RuntimeError):
    pass


def test_training_stops_at_each_threshold_and_resumes_to_the_same_weights(tmp_path, monkeypatch):
    whole = train_run(RECIPE, SPEC, 0, str(tmp_path / "whole"), save_every=10)
    assert [r["threshold"] for r in whole] == [0.5, 0.1]
    for record in whole:
        assert record["train_loss"] <= record["threshold"]
        assert 0 <= record["test_accuracy"] <= 1
        assert record["gap"] == pytest.approx(record["test_error"] - record["train_error"])
    assert whole[0]["step"] < whole[1]["step"]
    # killed after the third save: resumed from it, it ends where the uninterrupted run did
    saves = []
    original = modular.save_run_state

    def save_then_kill(*args):
        original(*args)
        saves.append(1)
        if len(saves) == 3:
            raise _Killed

    monkeypatch.setattr(modular, "save_run_state", save_then_kill)
    with pytest.raises(_Killed):
        train_run(RECIPE, SPEC, 0, str(tmp_path / "cut"), save_every=10)
    monkeypatch.setattr(modular, "save_run_state", original)
    assert (tmp_path / "cut" / "state.pt").is_file()
    resumed = train_run(RECIPE, SPEC, 0, str(tmp_path / "cut"), resume=True, save_every=10)
    for a, b in zip(whole, resumed):
        assert (a["step"], a["threshold"]) == (b["step"], b["threshold"])
        assert a["train_loss"] == b["train_loss"] and a["test_loss"] == b["test_loss"]
    weights = [
        (path / "loss-0.1" / "model.safetensors").read_bytes()
        for path in (tmp_path / "whole", tmp_path / "cut")
    ]
    assert weights[0] == weights[1]
    # a finished run is returned as it is; another recipe in its directory starts afresh
    assert train_run(RECIPE, SPEC, 0, str(tmp_path / "whole"), resume=True) == whole
    other = replace(RECIPE, seed=8)
    assert train_run(other, SPEC, 0, str(tmp_path / "whole"), resume=True) != whole


# ----------------------------------------------------------------------------- partial tau
def test_partial_tau_matches_its_formula_and_its_limits():
    rng = np.random.default_rng(0)
    z = rng.normal(size=40)
    x = z + 0.3 * rng.normal(size=40)
    y = z + 0.3 * rng.normal(size=40)

    def tau(a, b):
        return stats.kendalltau(a, b).statistic

    expected = (tau(x, y) - tau(x, z) * tau(y, z)) / math.sqrt(
        (1 - tau(x, z) ** 2) * (1 - tau(y, z) ** 2)
    )
    assert partial_kendall_tau(x, y, z) == pytest.approx(expected, abs=1e-12)
    assert partial_kendall_tau(y, x, z) == pytest.approx(expected, abs=1e-12)
    # ranks only: any increasing transform of a column leaves it unchanged
    assert partial_kendall_tau(np.exp(x), y**3, z) == pytest.approx(expected, abs=1e-12)
    # x and y related through z only: the plain tau is large, the partial one is not
    assert tau(x, y) > 0.6 and abs(expected) < tau(x, y) / 3
    assert math.isnan(partial_kendall_tau(x, y, 2 * x))  # the control ranks as x does
    tau_, low, high = partial_kendall_tau_bootstrap(x, y, z, resamples=300)
    assert tau_ == pytest.approx(expected) and low < tau_ < high
    with pytest.raises(ValueError, match="control"):
        partial_kendall_tau(x, y, z[:-1])


# ----------------------------------------------------------------------------- shares
def _tiny_llama(layers: int = 2) -> torch.nn.Module:
    recipe = RotaryRecipe(16, layers, 0.6, 0.1, 1e-3, seed=3)
    return build_rotary_model(recipe, TINY).double()


def _batches():
    return sharpness_batches(TINY, 0, 48, 24)


def _totals(shares):
    return sum(r["norm_sq"] for r in shares), sum(r["first_order"] for r in shares)


@pytest.mark.parametrize("metric,kinds", [("inv", "default"), ("mix", "all"), (None, None)])
def test_shares_sum_to_the_totals_and_give_the_first_order_increase(metric, kinds):
    model, rho = _tiny_llama(), 1e-3
    options = dict(rho=rho, iters=8, shares=True, progress=False)
    if metric is None:
        result = adaptive_sharpness(model, answer_loss, _batches(), **options)
    else:
        plan = find_symmetries(model, metric=metric, kinds=kinds).bind(model)
        result = geodesic_sharpness(
            model, answer_loss, _batches(), metric=metric, symmetries=plan, **options
        )
    assert len(result.shares_per_batch) == 2
    for shares, sharpness in zip(result.shares_per_batch, result.per_batch):
        norm, first = _totals(shares)
        # Auto-PGD's maximiser of a loss increasing to first order lies on the sphere
        assert norm == pytest.approx(rho**2, rel=100 * F64_EPS)
        # L(w + xi) - L(w) = <grad L, xi> + O(rho^2): the pairing of gradient and maximiser
        assert first == pytest.approx(sharpness, rel=0.05)
        assert first > 0
        blocks = {r["block"] for r in shares}
        assert {"model.layers.0", "model.layers.1", "lm_head"} <= blocks
    kinds_found = {r["kind"] for r in result.shares}
    expected = {"adaptive"} if metric is None else {"query-key", "value-output", "adaptive"}
    assert expected <= kinds_found and ("mlp" in kinds_found) == (kinds == "all")
    rows = result.share_rows()
    assert sum(r["norm_share"] for r in rows) == pytest.approx(1.0, abs=1e-12)
    assert sum(r["first_order_share"] for r in rows) == pytest.approx(1.0, abs=1e-12)
    mean = np.mean([_totals(s) for s in result.shares_per_batch], axis=0)
    assert _totals(result.shares) == pytest.approx(tuple(mean), rel=1e-12)


def _moved(model, plan, seed=0):
    """A copy moved by random elements of each symmetric group (rotary-commuting on the
    rotary query-key groups)."""
    generator = torch.Generator().manual_seed(seed)
    elements = []
    for group in plan.symmetric_groups:
        shape, manifold = tuple(group.shape), group.manifold
        if hasattr(manifold, "random_element"):
            a = manifold.random_element(shape[:-2], h=shape[-1], generator=generator)
        else:
            a = random_group_elements(shape[:-2], shape[-1], condition=4.0, generator=generator)
        elements.append(a)
    params = {n: p.detach() for n, p in model.named_parameters()}
    moved = plan.act(params, elements)
    other = build_rotary_model(RotaryRecipe(16, 2, 0.6, 0.1, 1e-3, seed=3), TINY).double()
    with torch.no_grad():
        for name, value in moved.items():
            other.get_parameter(name).copy_(value)
    return other


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_shares_are_invariant_under_the_group(metric):
    model = _tiny_llama()
    plan = find_symmetries(model, metric=metric, kinds="all").bind(model)
    other = _moved(model, plan)
    (batch,) = sharpness_batches(TINY, 0, 24, 24)
    torch.testing.assert_close(answer_loss(other, batch), answer_loss(model, batch))
    assert not torch.allclose(
        other.model.layers[0].self_attn.v_proj.weight, model.model.layers[0].self_attn.v_proj.weight
    )
    results = []
    for m in (model, other):
        bound = find_symmetries(m, metric=metric, kinds="all").bind(m)
        results.append(
            geodesic_sharpness(
                m,
                answer_loss,
                [batch],
                rho=0.003,
                iters=4,
                metric=metric,
                symmetries=bound,
                shares=True,
                progress=False,
            )
        )
    first, second = ({(r["block"], r["kind"]): r for r in res.shares} for res in results)
    assert first.keys() == second.keys()
    for key, row in first.items():
        for field in ("norm_sq", "first_order"):
            assert second[key][field] == pytest.approx(row[field], rel=1e-5, abs=1e-12), key
    # adaptive sharpness is not invariant: its shares move
    adaptive = [
        adaptive_sharpness(m, answer_loss, [batch], rho=0.01, iters=4, shares=True, progress=False)
        for m in (model, other)
    ]
    moved = {(r["block"], r["kind"]): r["norm_sq"] for r in adaptive[1].shares}
    assert any(
        abs(moved[k] - v) > 1e-3 * v
        for k, v in (((r["block"], r["kind"]), r["norm_sq"]) for r in adaptive[0].shares)
    )


def test_plan_vectors_undo_the_layouts_stacking_and_fusing():
    pytest.importorskip("transformers")
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    model = ViTForImageClassification(config).double()
    plan = find_symmetries(model).bind(model)
    base = trainable_parameters(model)
    points = [p.detach() for p in plan.gather(base)]
    groups = [BallGroup(p, g.manifold) for p, g in zip(points, plan.groups)]
    layout = BallLayout(plan, base, groups)
    assert len(layout.groups) < len(plan.groups)  # something was stacked or fused
    back = layout.plan_vectors([g.point for g in layout.groups])
    for original, recovered in zip(points, back):
        assert torch.equal(original, recovered)


def test_block_of():
    assert block_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert block_of("vit.encoder.layer.0.output.dense.bias") == "vit.encoder.layer.0"
    assert block_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert block_of("bias") == "bias"


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_reproduce_rotary_quick_end_to_end(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(["reproduce", "rotary", "--quick", "--out", str(out), "--quiet"]) == 0
    document = json.loads((out / "rotary.json").read_text())
    measures = ["adaptive", "geodesic_inv", "geodesic_mix", "geodesic_inv_all"]
    assert document["measures"] == measures
    assert set(document["thresholds"]) == {"loss-0.1", "loss-0.03"}
    for result in document["thresholds"].values():
        threshold = result["threshold"]
        models = [m for m in document["models"] if m["threshold"] == threshold]
        assert len(models) == 8  # 2 seeds x 4 runs, every one reached both thresholds
        assert all(m["train_loss"] <= threshold for m in models)
        radii = result["calibration"]["radii"]
        assert set(radii) == set(measures) and all(r > 0 for r in radii.values())
        for m in models:
            for measure in measures:
                entry = m["measures"][measure]
                assert entry["rho"] == radii[measure] and entry["value"] >= 0
                assert entry["relative"] == pytest.approx(entry["value"] / entry["clean_loss"])
                assert sum(s["norm_share"] for s in entry["shares"]) == pytest.approx(1.0)
            assert "rotary" in m["plan"]["geodesic_inv"]
            assert "mlp" in m["plan"]["geodesic_inv_all"]
        rows = result["tau"]
        assert len(rows) == 2 * (1 + 2 * len(measures))  # 2 gaps x (control + 2 x measures)
        for row in rows:
            assert -1 <= row["tau"] <= 1 and row["models"] == 8
            assert row["ci_low"] <= row["ci_high"]
            if row["measure"] != "train_loss":
                assert -1 <= row["partial_tau"] <= 1 or math.isnan(row["partial_tau"])
        assert result["share_tau"]
    for path in ("rotary.csv", "rotary-tau.csv", "rotary-shares.csv", "rotary-loss-0.1.png"):
        assert (out / path).is_file()
    with open(out / "rotary.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 16 * len(measures)
    assert any(k.startswith("norm_share/model.layers.0/") for k in table[0])
    # resumed: nothing retrained or remeasured, the same document
    records = (out / "rotary-records.jsonl").read_text()
    assert main(["reproduce", "rotary", "--quick", "--out", str(out), "--resume", "--quiet"]) == 0
    assert (out / "rotary-records.jsonl").read_text() == records
    again = json.loads((out / "rotary.json").read_text())
    assert again["models"] == document["models"]
    assert capsys.readouterr().out == ""
