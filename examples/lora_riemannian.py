"""
LoRA on the GL quotient versus ordinary LoRA
============================================

A 2-layer BERT built from :class:`transformers.BertConfig` (random weights, nothing is
downloaded) is pre-trained on a synthetic sequence regression task A, "how many more
times does token a occur than token b" (MSE), and then adapted to a shifted task B
(the same question for two other tokens) by rank-``r`` adapters on the ``query`` and
``value`` projections plus the regression head:

* quotient: :class:`geoopt_quotient.nn.LoRALinear` (one factor pair on
  :class:`~geoopt_quotient.manifolds.GLQuotient`, mix metric, initial product
  cancelled), trained with :class:`geoopt.optim.RiemannianAdam`;
* euclidean: ordinary LoRA (``B = 0``, ``A`` Kaiming-uniform, ``dW = (alpha/r) B A``)
  trained with :class:`torch.optim.AdamW`.

Both arms start from the same pre-trained model, see the same batches and train the
head with Adam. Writes a PNG with both training-loss curves and the held-out MSE, and
prints the final metrics. On CPU with one thread the default run takes a few minutes,
so the documentation shows this script without running it::

    python examples/lora_riemannian.py --out lora.png
    python examples/lora_riemannian.py --quick --out /tmp/lora.png   # seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import geoopt
import torch
from matplotlib.figure import Figure
from torch import nn
from transformers import BertConfig, BertForSequenceClassification
from transformers.utils import logging as hf_logging

from geoopt_quotient.nn import LoRALinear, wrap_linear_layers

CLS = 1
FIRST_CONTENT_TOKEN = 4
TASK_A = (4, 5)  # target: count(4) - count(5), scaled
TASK_B = (6, 7)  # target: count(6) - count(7), scaled
TARGETS = ("query", "value")


class EuclideanLoRALinear(nn.Module):
    """Ordinary LoRA (Hu et al. 2021): ``base(x) + (alpha / r) x A^T B^T`` with ``B = 0``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.scaling = alpha / rank
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * (x @ self.lora_a.mT @ self.lora_b.mT)


def wrap_euclidean(model: nn.Module, rank: int, alpha: float) -> List[str]:
    """The ordinary-LoRA counterpart of :func:`wrap_linear_layers`."""
    model.requires_grad_(False)
    paths = [
        p
        for p, m in model.named_modules()
        if isinstance(m, nn.Linear) and p.rpartition(".")[2] in TARGETS
    ]
    for path in paths:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attr, EuclideanLoRALinear(getattr(parent, attr), rank, alpha))
    return paths


def make_model(args: argparse.Namespace) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=FIRST_CONTENT_TOKEN + args.content_tokens,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.hidden,
        max_position_embeddings=args.seq_len + 1,
        num_labels=1,  # regression: MSE loss
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def sample(
    task: Sequence[int], n: int, seq_len: int, content_tokens: int, generator: torch.Generator
):
    """Random sequences ``[CLS] t_1 .. t_L`` and targets ``(count(a) - count(b)) / std``.

    With ``K`` equally likely content tokens the difference has variance ``2 L / K``;
    the targets are scaled to unit variance.
    """
    tokens = torch.randint(
        FIRST_CONTENT_TOKEN, FIRST_CONTENT_TOKEN + content_tokens, (n, seq_len), generator=generator
    )
    a, b = task
    std = math.sqrt(2 * seq_len / content_tokens)
    labels = ((tokens == a).sum(1) - (tokens == b).sum(1)).double().div(std).float()
    ids = torch.cat((torch.full((n, 1), CLS), tokens), dim=1)
    return ids, labels


@torch.no_grad()
def evaluate(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    model.eval()
    out = model(input_ids=ids, labels=labels)
    model.train()
    mse = out.loss.item()
    return {"loss": mse, "r2": 1.0 - mse / labels.var().item()}


def pretrain(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr_pretrain)
    generator = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.pretrain_steps):
        ids, labels = sample(TASK_A, args.batch, args.seq_len, args.content_tokens, generator)
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    return model


def finetune(
    pretrained: nn.Module, arm: str, eval_set, args: argparse.Namespace
) -> Dict[str, object]:
    """Adapt a copy of ``pretrained`` to task B with one of the two LoRA arms."""
    torch.manual_seed(args.seed + 2)
    model = copy.deepcopy(pretrained)
    if arm == "quotient":
        wrap_linear_layers(
            model,
            TARGETS,
            rank=args.rank,
            alpha=args.alpha,
            metric=args.metric,
            generator=torch.Generator().manual_seed(args.seed + 3),
        )
    else:
        wrap_euclidean(model, args.rank, args.alpha)
    model.classifier.requires_grad_(True)
    head = list(model.classifier.parameters())
    adapters = [
        p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("classifier")
    ]
    if arm == "quotient":
        assert all(isinstance(p, geoopt.ManifoldParameter) for p in adapters)
        opt = geoopt.optim.RiemannianAdam(
            [{"params": adapters, "lr": args.lr_riemannian}, {"params": head}], lr=args.lr_head
        )
    else:
        opt = torch.optim.AdamW(
            [{"params": adapters, "lr": args.lr_euclidean}, {"params": head}],
            lr=args.lr_head,
            weight_decay=args.weight_decay,
        )
    generator = torch.Generator().manual_seed(args.seed + 4)  # same batches for both arms
    losses: List[float] = []
    evals: List[Dict[str, float]] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels = sample(TASK_B, args.batch, args.seq_len, args.content_tokens, generator)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            evals.append({"step": step, **evaluate(model, *eval_set)})
    seconds = time.perf_counter() - start
    wrapped = [m for m in model.modules() if isinstance(m, LoRALinear)]
    return {
        "losses": losses,
        "evals": evals,
        "seconds": seconds,
        "final": evals[-1],
        "trainable_parameters": sum(p.numel() for p in adapters + head),
        "adapters": len(wrapped) if arm == "quotient" else len(adapters) // 2,
    }


def smooth(values: Sequence[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(results: Dict[str, Dict[str, object]], path: Path, title: str) -> None:
    fig = Figure(figsize=(10, 4))  # not owned by pyplot: no backend, nothing global
    ax_loss, ax_acc = fig.subplots(1, 2)
    colours = {"quotient": "tab:blue", "euclidean": "tab:orange"}
    labels = {
        "quotient": "quotient LoRA + RiemannianAdam",
        "euclidean": "ordinary LoRA + AdamW",
    }
    for arm, res in results.items():
        losses = res["losses"]
        window = max(1, len(losses) // 30)
        ax_loss.plot(losses, color=colours[arm], alpha=0.25, lw=0.8)
        ax_loss.plot(smooth(losses, window), color=colours[arm], label=labels[arm])
        steps = [e["step"] for e in res["evals"]]
        ax_acc.plot(steps, [e["loss"] for e in res["evals"]], "o-", color=colours[arm])
    ax_loss.set(xlabel="step", ylabel="training MSE (task B)", yscale="log")
    ax_loss.legend()
    ax_acc.set(xlabel="step", ylabel="held-out MSE (task B)", yscale="log")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps per arm")
    parser.add_argument("--pretrain-steps", type=int, default=600, help="full training on A")
    parser.add_argument("--out", type=Path, default=Path("lora_riemannian.png"), help="PNG path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="tiny model and few steps (smoke test)"
    )
    parser.add_argument("--rank", type=int, default=4, help="adapter rank r")
    parser.add_argument("--alpha", type=float, default=8.0, help="LoRA scaling alpha / r")
    parser.add_argument("--metric", choices=("mix", "inv"), default="mix", help="quotient metric")
    parser.add_argument("--lr-riemannian", type=float, default=0.3, help="quotient adapters")
    parser.add_argument("--lr-euclidean", type=float, default=1e-2, help="ordinary adapters")
    parser.add_argument("--lr-head", type=float, default=3e-3, help="head, both arms")
    parser.add_argument("--lr-pretrain", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's, euclidean arm")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--content-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 20)
        args.pretrain_steps = min(args.pretrain_steps, 20)
        args.hidden, args.layers, args.batch, args.seq_len = 16, 1, 16, 8
        args.eval_every, args.eval_size = 10, 128
        args.rank = min(args.rank, 2)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Run the comparison; returns the metrics that are also printed."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        # tiny matrices: one thread is fastest, and far faster on a shared machine
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> Dict[str, object]:
    """:func:`main` after argument parsing."""
    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    pretrained = pretrain(args)
    eval_generator = torch.Generator().manual_seed(args.seed + 5)
    eval_a = sample(TASK_A, args.eval_size, args.seq_len, args.content_tokens, eval_generator)
    eval_b = sample(TASK_B, args.eval_size, args.seq_len, args.content_tokens, eval_generator)
    before = {"task_a": evaluate(pretrained, *eval_a), "task_b": evaluate(pretrained, *eval_b)}
    pretrain_seconds = time.perf_counter() - start

    results = {arm: finetune(pretrained, arm, eval_b, args) for arm in ("quotient", "euclidean")}
    title = (
        f"tiny BERT, rank-{args.rank} adapters on {'/'.join(TARGETS)}, "
        f"{args.steps} steps, seed {args.seed}"
    )
    plot(results, args.out, title)

    tail = max(1, args.steps // 10)
    metrics: Dict[str, object] = {
        "pretrain": {**before, "seconds": round(pretrain_seconds, 2)},
        "png": str(args.out),
    }
    for arm, res in results.items():
        metrics[arm] = {
            "initial_train_loss": res["losses"][0],
            "final_train_loss": sum(res["losses"][-tail:]) / tail,
            "eval_loss": res["final"]["loss"],
            "eval_r2": res["final"]["r2"],
            "seconds": round(res["seconds"], 2),
            "trainable_parameters": res["trainable_parameters"],
        }
    print(
        f"pre-trained on A: held-out R^2 on A {before['task_a']['r2']:.3f}, "
        f"on B before adaptation {before['task_b']['r2']:.3f} ({pretrain_seconds:.1f} s)"
    )
    for arm in ("quotient", "euclidean"):
        m = metrics[arm]
        print(
            f"{arm:>9}: train MSE (last {tail} steps) {m['final_train_loss']:.4f}  "
            f"held-out MSE {m['eval_loss']:.4f}  R^2 {m['eval_r2']:.3f}  "
            f"({m['seconds']:.1f} s, {m['trainable_parameters']} trainable)"
        )
    print(f"plot: {args.out}")
    print(json.dumps(metrics))
    return metrics


if __name__ == "__main__":
    main()
