"""
GeodesicSAM, SAM and ASAM in the Hugging Face Trainer, with sharpness curves
============================================================================

A tiny ``BertForSequenceClassification`` (random weights, nothing is downloaded) is
fine-tuned with the Hugging Face ``Trainer`` on a synthetic sentence task (is a "good"
word more frequent than a "bad" one; 10% of the training labels flipped, so that there is
something to overfit) four times, sharing the initialisation, the data order, AdamW and
its learning-rate schedule:

* ``adamw``: ``transformers.Trainer``;
* ``sam``: ``GeodesicSAMTrainer(..., ball="euclidean")``, SAM (Foret et al. 2021);
* ``asam``: ``GeodesicSAMTrainer(..., ball="adaptive", eps=0.01)``, ASAM (Kwon et al.
  2021);
* ``geodesic``: ``GeodesicSAMTrainer(..., ball="geodesic", metric="mix")``, the ascent on
  the quotient of the attention symmetries.

Every run carries a ``SharpnessCallback`` that measures adaptive sharpness and geodesic
sharpness in the inv and mix metrics on two held-out batches every ``--every`` optimizer
steps, into the Trainer's logs; the figure draws them from ``trainer.state.log_history``
with the training loss, and the table gives the final test accuracy. The radii of the
three balls are on different scales (each ball has its own metric); those of the training
runs are the defaults of ``examples/sam_digits.py``.

It takes a minute or two on a CPU, so the documentation shows this script without
running it; its recorded results are in ``benchmarks/results/trainer_sam/``::

    python examples/trainer_bert_sam.py --out benchmarks/results/trainer_sam
    python examples/trainer_bert_sam.py --out docs/sam \
        --replot benchmarks/results/trainer_sam/trainer_bert_sam.json
    python examples/trainer_bert_sam.py --quick --out /tmp/trainer_sam      # seconds

One seed, one radius per ball: the curves show what the tools report during training,
not which method generalizes better (:doc:`/reproductions/sam` measures that over seeds).
In the recorded run (150 steps, 1 thread) the sharpness of every run rises as it leaves
the flat region of its initialisation; GeodesicSAM at this radius keeps all three
measures lowest and fits slowest (test accuracy 0.77 against 0.94 for AdamW, 0.98 for
SAM, 0.93 for ASAM): its radius is a strong one here.
"""

# sphinx_gallery_thumbnail_path = "sam/trainer_bert_sam.png"

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

from geoopt_quotient.integrations import GeodesicSAMTrainer, SharpnessCallback

GOOD, BAD = (3, 4, 5), (6, 7, 8)  # token ids of "good" and "bad" words; others are filler
MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")
#: Radii of the sharpness measures (each ball in its own metric).
MEASURE_RHO = {"adaptive": 0.05, "geodesic_inv": 0.05, "geodesic_mix": 0.01}
#: Training runs: (name, trainer options).
METHODS = {
    "adamw": None,
    "sam": dict(ball="euclidean", rho=0.05),
    "asam": dict(ball="adaptive", rho=0.25, eps=0.01),
    "geodesic": dict(ball="geodesic", metric="mix", rho=0.05),
}


def sentences(count: int, seed: int, noise: float) -> list:
    """Token sequences of length 16 and their labels: more "good" than "bad" words."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(9, 40, (count, 16), generator=generator)
    words = torch.tensor(GOOD + BAD)[torch.randint(0, 6, (count, 6), generator=generator)]
    places = torch.rand(count, 16, generator=generator).argsort(dim=1)[:, :6]
    tokens.scatter_(1, places, words)
    tokens[:, 0] = 2  # a [CLS]-like first token
    good = torch.isin(tokens, torch.tensor(GOOD)).sum(1)
    labels = (good > torch.isin(tokens, torch.tensor(BAD)).sum(1)).long()
    flip = torch.rand(count, generator=generator) < noise
    labels = torch.where(flip, 1 - labels, labels)
    return [
        {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": y}
        for t, y in zip(tokens, labels)
    ]


def tiny_bert(seed: int) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(config)


def accuracy(model: torch.nn.Module, data: list) -> float:
    model.eval()
    batch = transformers.default_data_collator(data)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return (logits.argmax(-1) == batch["labels"]).float().mean().item()


def train(method: str, args: argparse.Namespace, data: dict, held_out: list) -> dict:
    callback = SharpnessCallback(held_out, args.every, MEASURES, MEASURE_RHO, iters=args.iters)
    options = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        warmup_steps=args.steps // 10,
        lr_scheduler_type="cosine",
        logging_steps=args.every,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    kwargs = dict(train_dataset=data["train"])
    if METHODS[method] is None:
        trainer = transformers.Trainer(tiny_bert(args.seed), options, **kwargs)
    else:
        trainer = GeodesicSAMTrainer(tiny_bert(args.seed), options, **kwargs, **METHODS[method])
    callback.attach(trainer)
    trainer.train()
    logs = trainer.state.log_history
    return {
        "method": method,
        "options": METHODS[method],
        "steps": [e["step"] for e in logs if "loss" in e],
        "loss": [e["loss"] for e in logs if "loss" in e],
        "sharpness": {
            m: [[e["step"], e[f"sharpness/{m}"]] for e in logs if f"sharpness/{m}" in e]
            for m in MEASURES
        },
        "train_accuracy": accuracy(trainer.model, data["train"]),
        "test_accuracy": accuracy(trainer.model, data["test"]),
    }


def figure(document: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.4), layout="constrained")
    axes = fig.subplots(1, 1 + len(MEASURES))
    for run in document["runs"]:
        label = f"{run['method']} (test acc. {run['test_accuracy']:.2f})"
        axes[0].plot(run["steps"], run["loss"], label=label)
        for ax, measure in zip(axes[1:], MEASURES):
            steps, values = zip(*run["sharpness"][measure])
            ax.plot(steps, values, marker="o", markersize=3, label=label)
    axes[0].set(title="training loss (at w)", xlabel="optimizer step")
    for ax, measure in zip(axes[1:], MEASURES):
        ax.set(
            title=f"{measure} sharpness, ρ={MEASURE_RHO[measure]:g}",
            xlabel="optimizer step",
            yscale="log",
        )
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"tiny BERT fine-tuned with the Trainer, seed {document['settings']['seed']}: "
        "sharpness on held-out batches (SharpnessCallback)",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="trainer_sam", help="output directory")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=15, help="measure every N steps")
    parser.add_argument("--iters", type=int, default=10, help="Auto-PGD iterations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke test of seconds")
    parser.add_argument("--replot", metavar="JSON", help="redraw the figure from a result")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        figure(json.loads(Path(args.replot).read_text()), out / "trainer_bert_sam.png")
        return
    if args.quick:
        args.steps, args.every, args.iters = 6, 3, 2
    warnings.filterwarnings("ignore", category=FutureWarning)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    data = {"train": sentences(400, 1, noise=0.1), "test": sentences(1000, 2, noise=0.0)}
    held_out = [transformers.default_data_collator(data["test"][i : i + 32]) for i in (0, 32)]
    runs = [train(method, args, data, held_out) for method in METHODS]
    document = {
        "settings": {**vars(args), "measure_rho": MEASURE_RHO, "threads": 1},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "runs": runs,
    }
    (out / "trainer_bert_sam.json").write_text(json.dumps(document, indent=1) + "\n")
    figure(document, out / "trainer_bert_sam.png")
    for run in runs:
        last = {m: run["sharpness"][m][-1][1] for m in MEASURES}
        print(
            f"{run['method']:>9}: train acc {run['train_accuracy']:.3f}, test acc "
            f"{run['test_accuracy']:.3f}, final sharpness "
            + ", ".join(f"{m} {v:.3g}" for m, v in last.items())
        )


if __name__ == "__main__":
    main()
