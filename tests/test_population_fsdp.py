"""``geoopt-quotient population --fsdp``: every process measures every model together,
each model sharded over the processes with FSDP2.

Under ``torchrun --standalone --nproc_per_node 2`` (gloo), three tiny float64 BERT
classifiers give the single-process study's per-model values, batch by batch, and the same
measured gaps; process 0 writes one record per model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
pytest.importorskip("torch.distributed.fsdp")

from conftest import save_tiny_bert_classifier  # noqa: E402

from geoopt_quotient.cli import main  # noqa: E402
from geoopt_quotient.experiments.population import MEASURES  # noqa: E402

#: float64 throughout: the sharded run sums the two processes' mean losses (and the
#: ball's norms and Gram matrices) in another order than one process, a relative change
#: of a few eps = 2.2e-16 per loss; 3 Auto-PGD iterations carry it to the value smoothly
#: (differences of about 1e-14 seen), so 1e-10 leaves a margin of 10^4, and is far below
#: the difference between two batches' values (the negative below).
RELATIVE = 1e-10


@pytest.fixture(scope="module")
def population(tmp_path_factory):
    """Three tiny BERT classifiers (2 layers: 2 blocks to wrap) and token-id arrays:
    train (the sharpness examples, 2 batches of 4 rows) and test."""
    directory = tmp_path_factory.mktemp("population-fsdp")
    root = directory / "checkpoints"
    for i in range(3):
        (root / f"bert-{i}").mkdir(parents=True)
        save_tiny_bert_classifier(root / f"bert-{i}", layers=2, initializer_range=0.1 + 0.1 * i)
    generator = np.random.default_rng(0)
    for name in ("train", "test"):  # ids of the tiny vocabulary's words (5 specials first)
        ids = generator.integers(5, 23, size=(8, 6))
        labels = generator.integers(0, 2, size=8)
        np.savez(directory / f"{name}.npz", input_ids=ids, labels=labels)
    argv = ["population", "--checkpoints", str(root), "--dtype", "float64", "--quiet"]
    argv += ["--train", str(directory / "train.npz"), "--test", str(directory / "test.npz")]
    argv += ["--iters", "3", "--batch-size", "4", "--max-examples", "8", "--bootstrap", "50"]
    return argv


def test_torchrun_fsdp_gives_the_single_process_values(population, tmp_path):
    assert main([*population, "--out", str(tmp_path / "one")]) == 0
    # --standalone: torchrun's own rendezvous on a port the system assigns, none probed
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2", "-m", "geoopt_quotient"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [*torchrun, *population, "--fsdp", "--out", str(tmp_path / "two")]
    done = subprocess.run(command, env=env, timeout=300, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    one = json.loads((tmp_path / "one/population.json").read_text())
    two = json.loads((tmp_path / "two/population.json").read_text())
    assert (one["processes"], one["fsdp"], two["processes"], two["fsdp"]) == (1, False, 2, True)
    records = (tmp_path / "two/population-records.jsonl").read_text().splitlines()
    assert len(records) == 3  # one per model, written once
    assert [m["checkpoint"] for m in two["models"]] == ["bert-0", "bert-1", "bert-2"]
    for alone, sharded in zip(one["models"], two["models"]):
        # the sharded model's errors on whole batches: counts, exactly the same
        for key in ("train_error", "test_error", "gap", "parameters"):
            assert sharded[key] == alone[key], key
        assert sharded["plan"]["symmetric_groups"] == alone["plan"]["symmetric_groups"]
        for name in MEASURES:
            got, expected = sharded["measures"][name], alone["measures"][name]
            assert got["per_batch"] == pytest.approx(expected["per_batch"], rel=RELATIVE), name
            assert got["value"] == pytest.approx(expected["value"], rel=RELATIVE), name
            # the negative: the comparison tells the two batches (other rows) apart
            first, second = expected["per_batch"]
            assert first != pytest.approx(second, rel=1e-4), name


def test_fsdp_refuses_model_soups(tmp_path, capsys):
    argv = ["population", "--checkpoints", str(tmp_path), "--format", "model-soups"]
    argv += ["--train-images", str(tmp_path), "--gaps", str(tmp_path / "gaps.csv"), "--fsdp"]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        "error: --fsdp is for --format hf: model-soups CLIP models declare "
        "no transformer blocks to shard"
    )
