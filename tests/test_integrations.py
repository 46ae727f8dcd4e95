"""Sharpness during training (monitor, Trainer callback) and GeodesicSAMTrainer."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import geoopt_quotient as gq  # noqa: E402
from geoopt_quotient.integrations import (  # noqa: E402
    ABLATIONS,
    NAMED_MEASURES,
    GeodesicSAMTrainer,
    SharpnessCallback,
    SharpnessMonitor,
    measure_during_training,
    measure_radii,
)
from geoopt_quotient.optim.sam import BALLS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    """A tiny BERT classifier in float32, dropout 0.1 (training mode)."""
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


def examples(count: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 30, (count, 8), generator=generator)
    labels = tokens[:, 0] % 3  # learnable: the label is the first token mod 3
    return [
        {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": y}
        for t, y in zip(tokens, labels)
    ]


def held_out():
    data = examples(8, seed=2)
    return [
        transformers.default_data_collator(data[:4]),
        transformers.default_data_collator(data[4:]),
    ]


def arguments(tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=100,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ the monitor
def test_measure_radii_per_measure_and_errors():
    assert measure_radii(["adaptive", "geodesic_mix"], 0.1) == {
        "adaptive": 0.1,
        "geodesic_mix": 0.1,
    }
    per = {"adaptive": 0.2, "geodesic_mix": 0.01}
    assert measure_radii(["geodesic_mix", "adaptive"], per) == {
        "geodesic_mix": 0.01,
        "adaptive": 0.2,
    }
    with pytest.raises(ValueError, match="missing \\['adaptive'\\]"):
        measure_radii(["adaptive"], {"geodesic_mix": 0.1})
    with pytest.raises(ValueError, match="unknown `measure`"):
        measure_radii(["sharp"], 0.1)
    with pytest.raises(ValueError, match="twice"):
        measure_radii(["adaptive", "adaptive"], 0.1)
    with pytest.raises(ValueError, match="rho"):
        measure_radii(["adaptive"], 0.0)


def test_default_radii_are_each_measures_default_as_in_the_api():
    """No rho: each measure's own default (DEFAULT_RADII), as the sharpness functions and
    the command line take it; the no-norm ablations measure the adaptive ball."""
    defaults = gq.sharpness.DEFAULT_RADII
    everything = NAMED_MEASURES + ABLATIONS
    radii = measure_radii(everything)
    assert radii == measure_radii(everything, None)
    for measure, radius in radii.items():
        ball = "adaptive" if measure == "adaptive" or measure.endswith("_no_norm") else None
        assert radius == defaults[ball or measure.split("_")[1]], measure
    assert radii["adaptive"] != radii["geodesic_mix"]  # not one radius for every ball
    monitor = SharpnessMonitor(held_out(), 1, NAMED_MEASURES, iters=1)
    assert monitor.rho == measure_radii(NAMED_MEASURES)
    callback = SharpnessCallback(held_out(), 1, NAMED_MEASURES, iters=1)
    assert callback.monitor.rho == monitor.rho
    model = tiny_bert().eval()
    batches = held_out()[:1]
    results = gq.integrations.measure_sharpness(
        model, lambda m, b: m(**b).loss, batches, ["adaptive", "geodesic_inv"], iters=1
    )
    direct = gq.adaptive_sharpness(model, lambda m, b: m(**b).loss, batches, iters=1)
    assert results["adaptive"].settings["rho"] == direct.settings["rho"] == defaults["adaptive"]
    assert results["adaptive"].value == direct.value
    assert results["geodesic_inv"].settings["rho"] == defaults["inv"]


@pytest.mark.on_device
def test_measuring_mid_step_leaves_weights_grads_modes_and_rng(device):
    """Between backward and optimizer.step: .grad, weights, train mode and the RNG
    streams (CPU, and CUDA on a CUDA run) are as they were, so the loop goes on as
    without the measurement; on the model's device (``--torch-device``)."""
    model = tiny_bert().train()
    assert next(model.parameters()).device.type == device.type
    batch = held_out()[0]
    model(**batch).loss.backward()
    before, grads = weights(model), {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    values = measure_during_training(
        model, None, held_out(), ["adaptive", "geodesic_mix"], 0.01, iters=2
    )
    assert set(values) == {"sharpness/adaptive", "sharpness/geodesic_mix"}
    assert all(v >= 0 for v in values.values())
    assert_same_weights(weights(model), before)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name]), name
    assert all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), rng)
    if cuda_rng:
        assert all(map(torch.equal, torch.cuda.get_rng_state_all(), cuda_rng))


def test_monitor_measures_every_ablation_in_eval_mode():
    """Dropout is off while measuring: two measurements of the same weights agree."""
    model = tiny_bert().train()
    monitor = SharpnessMonitor(held_out(), 1, NAMED_MEASURES + ABLATIONS, 0.01, iters=2)
    first = monitor.step(model, 1)
    second = monitor.measure(model)
    assert first == second
    assert list(first) == [f"sharpness/{m}" for m in NAMED_MEASURES + ABLATIONS]
    assert monitor.step(model, 1) is None  # measured already
    assert [h["step"] for h in monitor.history] == [1]


# ------------------------------------------------------------------ the callback
def test_monitor_discovers_the_symmetries_once_and_again_when_the_parameters_change(
    monkeypatch,
):
    from geoopt_quotient.integrations import measures as measures_module

    calls = []
    discover = measures_module.discover

    def counted(*args, **kwargs):
        calls.append(1)
        return discover(*args, **kwargs)

    monkeypatch.setattr(measures_module, "discover", counted)
    model = tiny_bert()
    monitor = SharpnessMonitor(held_out(), 1, ("geodesic_inv", "geodesic_mix"), 0.01, iters=1)
    first = monitor.measure(model)
    assert len(calls) == 1 and set(monitor.plans) == {"inv", "mix"}
    plans = dict(monitor.plans)
    assert monitor.measure(model) == first  # same weights, same plans: same values
    assert len(calls) == 1 and all(monitor.plans[m] is plans[m] for m in plans)
    model.classifier.weight.requires_grad_(False)  # the bound plans no longer fit
    monitor.measure(model)
    assert len(calls) == 2
    assert all("classifier.weight" not in p.param_names for p in monitor.plans.values())
    monitor.plans.clear()
    monitor.measure(model)
    assert len(calls) == 3


def logged_steps(trainer, key):
    return [entry["step"] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_callback_logs_every_measure_at_the_asked_optimizer_steps(tmp_path, accumulation):
    measures = ["adaptive", "geodesic_inv", "geodesic_mix"]
    callback = SharpnessCallback(
        held_out(),
        2,
        measures,
        {"adaptive": 0.1, "geodesic_inv": 0.05, "geodesic_mix": 0.01},
        iters=2,
    )
    args = arguments(tmp_path, max_steps=5, gradient_accumulation_steps=accumulation)
    trainer = transformers.Trainer(tiny_bert(), args, train_dataset=examples(40))
    callback.attach(trainer)
    trainer.train()
    for measure in measures:
        assert logged_steps(trainer, f"sharpness/{measure}") == [2, 4], measure
    assert trainer.state.global_step == 5
    entry = next(e for e in trainer.state.log_history if e.get("step") == 2)
    assert "loss" in entry  # merged into the training log of that step
    assert [h["step"] for h in callback.monitor.history] == [2, 4]


def test_training_with_the_callback_ends_with_bitwise_the_same_weights(tmp_path):
    runs = []
    for with_callback in (False, True):
        callbacks = [SharpnessCallback(held_out(), 2, rho=0.01, iters=2)] if with_callback else []
        args = arguments(tmp_path / str(with_callback), max_steps=5, logging_steps=1)
        trainer = transformers.Trainer(
            tiny_bert(), args, train_dataset=examples(40), callbacks=callbacks
        )
        trainer.train()
        runs.append((weights(trainer.model), trainer.state.log_history))
    assert_same_weights(runs[0][0], runs[1][0])
    losses = [[e["loss"] for e in log if "loss" in e] for _, log in runs]
    assert losses[0] == losses[1]
    assert logged_steps_of(runs[1][1], "sharpness/geodesic_mix") == [2, 4]
    assert not logged_steps_of(runs[0][1], "sharpness/geodesic_mix")


def logged_steps_of(history, key):
    return [entry["step"] for entry in history if key in entry]


def test_callback_warns_when_reporters_would_miss_the_values():
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback = SharpnessCallback(held_out(), 100, ["adaptive"], iters=1)
    with pytest.warns(UserWarning, match=r"\['tensorboard'\].*attach"):
        callback.on_train_begin(SimpleNamespace(report_to=["tensorboard"]), state, control)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.on_train_begin(SimpleNamespace(report_to=["none"]), state, control)
        callback.attach(SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[])))
        callback.on_train_begin(SimpleNamespace(report_to=["tensorboard"]), state, control)


def test_attach_puts_the_callback_first(tmp_path):
    callback = SharpnessCallback(held_out(), 100, ["adaptive"], iters=1)
    trainer = transformers.Trainer(
        tiny_bert(), arguments(tmp_path), train_dataset=examples(4), callbacks=[callback]
    )
    assert trainer.callback_handler.callbacks[0] is not callback
    callback.attach(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    assert trainer.callback_handler.callbacks.count(callback) == 1


# ------------------------------------------------------------------ GeodesicSAMTrainer
def train_losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def full_loss(model, data):
    """The loss of the whole data set, in eval mode."""
    model.eval()
    with torch.no_grad():
        return model(**transformers.default_data_collator(data)).loss.item()


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory):
    args = arguments(tmp_path_factory.mktemp("plain"), max_steps=16, learning_rate=2e-2)
    trainer = transformers.Trainer(tiny_bert(), args, train_dataset=examples(32))
    trainer.train()
    return weights(trainer.model)


@pytest.mark.parametrize("ball", BALLS)
def test_sam_trainer_trains_and_differs_from_plain_training(tmp_path, ball, plain_weights):
    """16 steps of AdamW with each ball lower the loss of the training set (measured:
    1.099 -> 0.54 geodesic, 1.00 adaptive, 1.05 euclidean), and end elsewhere than the
    same 16 steps without the ascent."""
    data = examples(32)
    before = full_loss(tiny_bert(), data)
    args = arguments(tmp_path, max_steps=16, learning_rate=2e-2, logging_steps=1)
    trainer = GeodesicSAMTrainer(tiny_bert(), args, train_dataset=data, rho=0.05, ball=ball)
    trainer.train()
    assert all(map(math.isfinite, train_losses(trainer)))
    assert full_loss(trainer.model, data) < 0.97 * before
    sam = weights(trainer.model)
    assert [n for n in sam if not torch.equal(sam[n], plain_weights[n])]


def test_sam_trainer_with_accumulation_ascends_on_the_whole_step(tmp_path, monkeypatch):
    """With 2 micro-batches per step, one ascent per optimizer step, after both passes at w."""
    calls = []
    original = gq.optim.SAMAscent.perturb

    def perturb(self, rho):
        calls.append(rho)
        return original(self, rho)

    monkeypatch.setattr(gq.optim.SAMAscent, "perturb", perturb)
    args = arguments(tmp_path, max_steps=3, gradient_accumulation_steps=2)
    trainer = GeodesicSAMTrainer(tiny_bert(), args, train_dataset=examples(48), rho=0.1)
    trainer.train()
    assert calls == [0.1] * 3


def test_sam_trainer_resumes_from_a_checkpoint_identically(tmp_path):
    """On CPU with a fixed seed the resumed run replays the same data order, dropout masks
    (the RNG states saved with the checkpoint) and optimizer state: bitwise equal."""
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, logging_steps=1)
    whole = GeodesicSAMTrainer(
        tiny_bert(), arguments(tmp_path / "whole", **common), train_dataset=examples(48)
    )
    whole.train()
    first = GeodesicSAMTrainer(
        tiny_bert(), arguments(tmp_path / "cut", **common), train_dataset=examples(48)
    )
    first.train()
    resumed = GeodesicSAMTrainer(
        tiny_bert(seed=5), arguments(tmp_path / "cut", **common), train_dataset=examples(48)
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert_same_weights(weights(whole.model), weights(resumed.model))
    assert train_losses(whole)[3:] == train_losses(resumed)[-3:]


def fresh_lora_bert():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS")
    return peft.get_peft_model(tiny_bert(), config)


@pytest.mark.parametrize("ball", BALLS)
def test_fresh_lora_under_the_sam_trainer_never_gets_nan(tmp_path, ball):
    model = fresh_lora_bert()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(float(b.detach().abs().max()) == 0 for b in lora_b)
    args = arguments(tmp_path, max_steps=4, logging_steps=1, label_names=["labels"])
    trainer = GeodesicSAMTrainer(model, args, train_dataset=examples(16), rho=0.05, ball=ball)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gq.optim.ZeroAscentWarning)
        trainer.train()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert all(map(torch.isfinite, torch.tensor(train_losses(trainer))))
    assert any(float(b.detach().abs().max()) > 0 for b in lora_b)  # the adapters did train
    kinds = {g.kind for g in trainer.sam_ascent.plan.groups} - {"adaptive", "euclidean"}
    assert bool(kinds) == (ball == "geodesic"), kinds  # discovered again once B != 0


def test_sam_trainer_argument_errors(tmp_path):
    args = arguments(tmp_path)
    for bad, match in (
        (dict(ball="sphere"), "ball"),
        (dict(rho=0.0), "rho"),
        (dict(metric="x"), "metric"),
    ):
        with pytest.raises(ValueError, match=match):
            GeodesicSAMTrainer(tiny_bert(), args, train_dataset=examples(4), **bad)


def test_sam_trainer_in_bf16_autocast_with_a_callback(tmp_path, monkeypatch):
    """Mixed precision (CPU bf16 autocast): one ascent per step, finite float32 weights;
    a SharpnessCallback given to the SAM trainer is put first and logs at its steps."""
    calls = []
    original = gq.optim.SAMAscent.perturb
    monkeypatch.setattr(
        gq.optim.SAMAscent, "perturb", lambda self, rho: calls.append(rho) or original(self, rho)
    )
    callback = SharpnessCallback(held_out(), 2, ["adaptive"], 0.05, iters=2)
    args = arguments(tmp_path, max_steps=2, bf16=True, logging_steps=1)
    trainer = GeodesicSAMTrainer(
        tiny_bert(), args, train_dataset=examples(8), callbacks=[callback], rho=0.05
    )
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()
    assert calls == [0.05, 0.05]
    assert all(
        p.dtype == torch.float32 and torch.isfinite(p).all() for p in trainer.model.parameters()
    )
    assert logged_steps(trainer, "sharpness/adaptive") == [2]


class NaNLossTrainer(GeodesicSAMTrainer):
    """A loss whose gradients are NaN: the ascent must refuse to write them."""

    def compute_loss(self, model, inputs, **kwargs):
        return super().compute_loss(model, inputs, **kwargs) * torch.tensor(float("nan"))


def test_sam_trainer_raises_on_a_non_finite_ascent_and_leaves_the_weights(tmp_path):
    model = tiny_bert()
    before = weights(model)
    args = arguments(tmp_path, max_steps=2, logging_nan_inf_filter=False)
    trainer = NaNLossTrainer(model, args, train_dataset=examples(8), ball="euclidean")
    with pytest.raises(gq.NonFiniteError, match="no parameter was changed"):
        trainer.train()
    assert_same_weights(weights(model), before)
