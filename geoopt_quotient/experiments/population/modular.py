r"""A population of small rotary transformers trained on modular arithmetic, on CPU.

The task (Power et al. 2022, "Grokking"): for a prime :math:`p` and an operation
:math:`\circ`, predict :math:`c = a \circ b \bmod p` from the three tokens
``a b =`` (vocabulary :math:`p + 1`), over all :math:`p^2` pairs. A population seed fixes
one permutation of the pairs; a model with training fraction :math:`f` trains on its
first :math:`\lfloor f p^2 \rfloor` pairs and is tested on the rest. The training sets of
one population are therefore nested, and the first ``max_examples`` pairs (fewer than the
smallest training set) are training examples of every model: the sharpness batches.

Every model is a Hugging Face ``LlamaForCausalLM`` (rotary attention, grouped-query
attention with 4 query and 2 key-value heads, gated SiLU MLP, RMSNorm) with width,
training fraction, weight decay, learning rate and initialisation drawn per model
(:func:`sample_recipe`). It is trained full-batch with AdamW on the cross-entropy of the
answer, the logits restricted to the :math:`p` residues,

.. math::

    L(w) = -\frac1n \sum_{i=1}^{n} \log \operatorname{softmax}(z_w(a_i, b_i))_{c_i},

and saved the first time its training loss reaches each threshold
:math:`\lambda_1 > \lambda_2 > \dots` (:func:`train_run`): every model of the population
at threshold :math:`\lambda_k` has (to one optimiser step) the same training loss, and
they differ in how far they generalise. Training is deterministic (full batch, no
dropout, seeded initialisation) and resumable: a run's state is saved every
``save_every`` steps and at every threshold.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..records import fingerprint

__all__ = [
    "OPERATIONS",
    "ModularTask",
    "PopulationSpec",
    "RotaryRecipe",
    "answer_loss",
    "build_rotary_model",
    "modular_pairs",
    "sample_recipe",
    "sharpness_batches",
    "threshold_name",
    "train_rotary_population",
    "train_run",
]

#: The operations :math:`a \circ b \bmod p` of the task.
OPERATIONS: Dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "add": lambda a, b, p: (a + b) % p,
    "sub": lambda a, b, p: (a - b) % p,
    "mul": lambda a, b, p: (a * b) % p,
    "square_sum": lambda a, b, p: (a * a + a * b + b * b) % p,
}
#: Query and key-value heads of every model (grouped-query attention).
HEADS, KV_HEADS = 4, 2


@dataclass(frozen=True)
class ModularTask:
    r"""The task: :math:`a \circ b \bmod p` for all pairs of residues.

    Attributes
    ----------
    p : int
        The modulus (a prime for the grokking tasks), at least 3.
    operation : str
        The operation's name, a key of :data:`OPERATIONS`.
    """

    p: int = 59
    operation: str = "add"

    def __post_init__(self) -> None:
        if self.operation not in OPERATIONS:
            raise ValueError(f"unknown operation {self.operation!r}; expected {list(OPERATIONS)}")
        if self.p < 3:
            raise ValueError(f"the modulus p must be >= 3, got {self.p}")


def modular_pairs(task: ModularTask, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """All :math:`p^2` examples in the population's order: inputs ``(p², 3)`` and answers.

    Row :math:`i` is ``[a, b, p]`` (``p`` is the token ``=``) and its answer
    :math:`a \\circ b \\bmod p`; the rows are permuted by a generator seeded with ``seed``,
    so that the first :math:`n` rows are the training set of a model with :math:`n`
    training pairs, for every model of the population.

    Parameters
    ----------
    task : ModularTask
        The modulus and the operation.
    seed : int
        The population seed.

    Returns
    -------
    inputs, answers : torch.Tensor
        int64 tensors of shapes ``(p², 3)`` and ``(p²,)``.
    """
    p = task.p
    a, b = (t.reshape(-1) for t in torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij"))
    order = torch.from_numpy(np.random.default_rng([seed, p]).permutation(p * p))
    inputs = torch.stack([a, b, torch.full_like(a, p)], dim=1)[order]
    return inputs, OPERATIONS[task.operation](a, b, p)[order]


@dataclass(frozen=True)
class PopulationSpec:
    """What a population's recipes are drawn from (:func:`sample_recipe`).

    Attributes
    ----------
    task : ModularTask
        The modulus and the operation.
    widths : tuple of int
        Hidden sizes drawn from (each divisible by 4 heads with an even head size).
    layers : tuple of int
        Numbers of layers drawn from.
    fractions : (float, float)
        Training fraction, uniform in this range.
    weight_decays : (float, float)
        AdamW's weight decay, log-uniform in this range.
    learning_rates : (float, float)
        AdamW's learning rate, log-uniform in this range.
    thresholds : tuple of float
        The training losses at which each model is saved, decreasing.
    max_steps : int
        Steps after which a run that has not reached every threshold stops.
    """

    task: ModularTask = ModularTask()
    widths: Tuple[int, ...] = (48, 64, 96)
    layers: Tuple[int, ...] = (1,)
    fractions: Tuple[float, float] = (0.2, 0.6)
    weight_decays: Tuple[float, float] = (0.01, 1.0)
    learning_rates: Tuple[float, float] = (5e-4, 2e-3)
    thresholds: Tuple[float, ...] = (0.03, 0.01)
    max_steps: int = 3000

    def __post_init__(self) -> None:
        if (
            list(self.thresholds) != sorted(self.thresholds, reverse=True)
            or min(self.thresholds) <= 0
        ):
            raise ValueError(f"thresholds must be > 0 and decreasing, got {self.thresholds}")
        for width in self.widths:
            if width % (2 * HEADS):
                raise ValueError(f"width {width}: give a multiple of {2 * HEADS}")


@dataclass(frozen=True)
class RotaryRecipe:
    """One model's architecture and training recipe.

    Attributes
    ----------
    hidden_size, num_layers : int
        Width and depth of the model (4 query and 2 key-value heads, MLP width twice
        the hidden size).
    train_fraction : float
        The share of the :math:`p^2` pairs trained on.
    weight_decay, learning_rate : float
        AdamW's (betas 0.9, 0.98; full batch).
    seed : int
        The initialisation's seed.
    """

    hidden_size: int
    num_layers: int
    train_fraction: float
    weight_decay: float
    learning_rate: float
    seed: int


def _log_uniform(rng: np.random.Generator, bounds: Tuple[float, float]) -> float:
    low, high = bounds
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def sample_recipe(spec: PopulationSpec, seed: int, index: int) -> RotaryRecipe:
    """Model ``index``'s recipe, drawn from a generator seeded by ``(seed, index)``.

    Parameters
    ----------
    spec : PopulationSpec
        The ranges drawn from.
    seed, index : int
        The population seed and the run's index in it.

    Returns
    -------
    RotaryRecipe
        The recipe, the same for the same arguments.
    """
    rng = np.random.default_rng([seed, index, 49])
    return RotaryRecipe(
        hidden_size=int(rng.choice(spec.widths)),
        num_layers=int(rng.choice(spec.layers)),
        train_fraction=float(rng.uniform(*spec.fractions)),
        weight_decay=_log_uniform(rng, spec.weight_decays),
        learning_rate=_log_uniform(rng, spec.learning_rates),
        seed=int(rng.integers(2**31)),
    )


def build_rotary_model(recipe: RotaryRecipe, task: ModularTask) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` for the task (seeded by the recipe).

    Parameters
    ----------
    recipe : RotaryRecipe
        Width, depth and initialisation seed.
    task : ModularTask
        The task (vocabulary: the :math:`p` residues and ``=``).

    Returns
    -------
    transformers.LlamaForCausalLM
        In eval mode, float32.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=task.p + 1,
        hidden_size=recipe.hidden_size,
        intermediate_size=2 * recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=8,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config).eval()


def answer_loss(model: torch.nn.Module, batch: Tuple[Dict[str, torch.Tensor], torch.Tensor]):
    """Cross-entropy of the answer, from the last position's logits over the residues.

    Parameters
    ----------
    model : torch.nn.Module
        A model of the population.
    batch : tuple
        ``({"input_ids": (B, 3)}, answers (B,))``; the residues are the tokens
        ``0 .. p-1`` (``p = input_ids[0, -1]``, the ``=`` token).

    Returns
    -------
    torch.Tensor
        The mean cross-entropy, a float32 scalar.
    """
    inputs, answers = batch
    logits = _answer_logits(model, inputs["input_ids"])
    return torch.nn.functional.cross_entropy(logits.float(), answers)


def _answer_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    p = int(input_ids[0, -1])
    return model(input_ids=input_ids).logits[:, -1, :p]


def _loss_and_accuracy(
    model: torch.nn.Module, inputs: torch.Tensor, answers: torch.Tensor
) -> Tuple[torch.Tensor, float]:
    logits = _answer_logits(model, inputs)
    loss = torch.nn.functional.cross_entropy(logits.float(), answers)
    return loss, float((logits.argmax(-1) == answers).float().mean())


def sharpness_batches(
    task: ModularTask, seed: int, max_examples: int, batch_size: int
) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    """The first ``max_examples`` pairs of the population's order, in batches: training
    examples of every model whose training set is at least that large.

    Parameters
    ----------
    task : ModularTask
        The task.
    seed : int
        The population seed.
    max_examples, batch_size : int
        How many pairs, in batches of how many.

    Returns
    -------
    list of tuple
        ``({"input_ids": ...}, answers)`` per batch, for :func:`answer_loss`.
    """
    inputs, answers = modular_pairs(task, seed)
    inputs, answers = inputs[:max_examples], answers[:max_examples]
    return [
        ({"input_ids": x}, y) for x, y in zip(inputs.split(batch_size), answers.split(batch_size))
    ]


def threshold_name(threshold: float) -> str:
    """The directory name of a threshold's checkpoints, e.g. ``loss-0.01``.

    Parameters
    ----------
    threshold : float
        The training loss.

    Returns
    -------
    str
        ``loss-`` and the threshold in ``%g`` format.
    """
    return f"loss-{threshold:g}"


@dataclass
class _RunState:
    """A run in progress: its step, time spent, and the records of the thresholds reached."""

    step: int = 0
    seconds: float = 0.0
    reached: List[Dict[str, Any]] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.reached = [] if self.reached is None else self.reached


def _run_key(recipe: RotaryRecipe, spec: PopulationSpec, seed: int) -> str:
    return fingerprint({"recipe": asdict(recipe), "spec": asdict(spec), "population_seed": seed})


def _load_state(
    directory: Path, key: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> _RunState:
    """The saved state of the run with fingerprint ``key`` (model and optimizer loaded),
    or a fresh one."""
    path = directory / "state.pt"
    if not path.is_file():
        return _RunState()
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("key") != key:
        return _RunState()
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return _RunState(saved["step"], saved["seconds"], json.loads(saved["reached"]))


def save_run_state(
    directory: Path,
    key: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: _RunState,
) -> None:
    """Write the run's state atomically (a kill leaves the previous state intact)."""
    saved = {
        "key": key,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": state.step,
        "seconds": state.seconds,
        "reached": json.dumps(state.reached),
    }
    partial = directory / "state.pt.partial"
    torch.save(saved, partial)
    partial.replace(directory / "state.pt")


def _save_threshold(
    model: torch.nn.Module,
    directory: Path,
    threshold: float,
    record: Dict[str, Any],
) -> Dict[str, Any]:
    """Save the model as a Hugging Face checkpoint ``directory/loss-T`` with its record."""
    target = directory / threshold_name(threshold)
    model.save_pretrained(target, safe_serialization=True)
    (target / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def train_run(
    recipe: RotaryRecipe,
    spec: PopulationSpec,
    population_seed: int,
    directory: str,
    *,
    resume: bool = False,
    save_every: int = 200,
) -> List[Dict[str, Any]]:
    """Train one model full-batch until its training loss first reaches each threshold.

    At every step the full-batch loss :math:`L(w_t)` is computed at the current weights;
    the first time :math:`L(w_t) \\le \\lambda_k` the weights :math:`w_t` are saved as
    ``directory/loss-λk`` (a Hugging Face checkpoint with ``training.json``: recipe, step,
    train and test loss and accuracy, generalization gaps). The run stops at the last
    threshold or after ``spec.max_steps`` steps.

    Parameters
    ----------
    recipe : RotaryRecipe
        The model and its training.
    spec : PopulationSpec
        The task, thresholds and step limit.
    population_seed : int
        The seed of the population's order of the pairs (:func:`modular_pairs`).
    directory : str
        The run's directory (made if missing).
    resume : bool
        Continue from ``directory/state.pt`` when it belongs to the same recipe (and
        return a finished run's records without training).
    save_every : int
        Steps between saves of the run's state.

    Returns
    -------
    list of dict
        The record of each threshold reached, in order (fewer than the thresholds when
        ``max_steps`` ran out first).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    key = _run_key(recipe, spec, population_seed)
    finished = _finished_run(root, key) if resume else None
    if finished is not None:
        return finished
    inputs, answers = modular_pairs(spec.task, population_seed)
    count = int(recipe.train_fraction * len(answers))
    train, test = (inputs[:count], answers[:count]), (inputs[count:], answers[count:])
    model = build_rotary_model(recipe, spec.task)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=recipe.learning_rate,
        betas=(0.9, 0.98),
        weight_decay=recipe.weight_decay,
    )
    state = _load_state(root, key, model, optimizer) if resume else _RunState()
    start = time.perf_counter() - state.seconds
    while len(state.reached) < len(spec.thresholds) and state.step < spec.max_steps:
        loss, accuracy = _loss_and_accuracy(model, *train)
        threshold = spec.thresholds[len(state.reached)]
        if float(loss.detach()) <= threshold:
            record = _threshold_record(model, recipe, state.step, threshold, test)
            record.update(train_loss=float(loss.detach()), train_accuracy=accuracy)
            record.update(_gaps(record), train_seconds=time.perf_counter() - start)
            state.reached.append(_save_threshold(model, root, threshold, record))
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state.step += 1
        if state.step % save_every == 0:
            state.seconds = time.perf_counter() - start
            save_run_state(root, key, model, optimizer, state)
    state.seconds = time.perf_counter() - start
    summary = {"key": key, "steps": state.step, "seconds": state.seconds, "reached": state.reached}
    (root / "run.json").write_text(json.dumps(summary, indent=1) + "\n")
    (root / "state.pt").unlink(missing_ok=True)
    return state.reached


def _finished_run(root: Path, key: str) -> Optional[List[Dict[str, Any]]]:
    """The records of a finished run with fingerprint ``key`` whose checkpoints are all
    on disk, else None."""
    path = root / "run.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if summary.get("key") != key:
        return None
    reached = summary["reached"]
    if not all((root / threshold_name(r["threshold"]) / "config.json").is_file() for r in reached):
        return None
    return reached


def _threshold_record(
    model: torch.nn.Module,
    recipe: RotaryRecipe,
    step: int,
    threshold: float,
    test: Tuple[torch.Tensor, torch.Tensor],
) -> Dict[str, Any]:
    with torch.no_grad():
        test_loss, test_accuracy = _loss_and_accuracy(model, *test)
    return {
        "recipe": asdict(recipe),
        "threshold": threshold,
        "step": step,
        "test_loss": float(test_loss),
        "test_accuracy": test_accuracy,
    }


def _gaps(record: Mapping[str, Any]) -> Dict[str, float]:
    """Generalization gaps: test - train error (``gap``), test - train loss (``loss_gap``)."""
    return {
        "train_error": 1.0 - record["train_accuracy"],
        "test_error": 1.0 - record["test_accuracy"],
        "gap": record["train_accuracy"] - record["test_accuracy"],
        "loss_gap": record["test_loss"] - record["train_loss"],
    }


def train_rotary_population(
    spec: PopulationSpec,
    seeds: Sequence[int],
    models: int,
    directory: str,
    *,
    resume: bool = False,
    on_model: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> List[Dict[str, Any]]:
    """Train ``models`` runs per population seed into ``directory/seed-S/model-XX``.

    Parameters
    ----------
    spec : PopulationSpec
        The task, the ranges of the recipes, the thresholds.
    seeds : sequence of int
        The population seeds.
    models : int
        Runs per seed (:func:`sample_recipe` of ``(seed, index)``).
    directory : str
        Where the runs go.
    resume : bool
        Keep finished runs and continue interrupted ones (:func:`train_run`).
    on_model : callable, optional
        Receives a summary of each run as it finishes (``population_seed``, ``index``,
        ``records``).

    Returns
    -------
    list of dict
        One record per (run, threshold reached), each with ``name``,
        ``population_seed``, ``index``, ``checkpoint`` (the path of its Hugging Face
        checkpoint) and the fields of :func:`train_run`'s records.
    """
    found = []
    for seed in seeds:
        for index in range(models):
            recipe = sample_recipe(spec, seed, index)
            run = Path(directory) / f"seed-{seed}" / f"model-{index:02d}"
            reached = train_run(recipe, spec, seed, str(run), resume=resume)
            for record in reached:
                checkpoint = run / threshold_name(record["threshold"])
                found.append(
                    {
                        "name": f"s{seed}-m{index:02d}",
                        "population_seed": seed,
                        "index": index,
                        "checkpoint": str(checkpoint),
                        **record,
                    }
                )
            if on_model is not None:
                on_model({"population_seed": seed, "index": index, "records": reached})
    return found
