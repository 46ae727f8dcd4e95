"""The population study: ``reproduce transformers --quick`` end to end, ``population`` on its
checkpoints (given and measured gaps, resume, ablations, text data, two processes), and the
inputs' error messages."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("sklearn")

from conftest import TINY_BERT_WORDS, save_tiny_bert_classifier

from geoopt_quotient.classifiers import InputError, load_arrays
from geoopt_quotient.cli import main
from geoopt_quotient.population import (
    ABLATIONS,
    MEASURES,
    StudySettings,
    find_checkpoints,
    read_gaps,
    tau_table,
)
from geoopt_quotient.population import study as study_module
from geoopt_quotient.sharpness.stats import kendall_tau, kendall_tau_bootstrap

pytestmark = pytest.mark.slow

FAST = ["--iters", "2", "--max-examples", "32", "--batch-size", "16", "--bootstrap", "200"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``reproduce transformers --quick`` run: its directory and JSON document."""
    out = tmp_path_factory.mktemp("transformers")
    assert main(["reproduce", "transformers", "--quick", "--out", str(out), "--quiet"]) == 0
    return out, json.loads((out / "transformers.json").read_text())


def test_reproduce_quick_document(quick):
    out, doc = quick
    assert doc["command"] == "reproduce transformers"
    assert doc["population"]["quick"] and doc["population"]["models"] == 6
    models = doc["models"]
    assert [m["checkpoint"] for m in models] == [f"model-{i:02d}" for i in range(6)]
    for m in models:
        assert set(m["measures"]) == set(MEASURES)
        for value in m["measures"].values():
            assert np.isfinite(value["value"])
            assert value["value"] == pytest.approx(np.mean(value["per_batch"]))
            assert value["perturbed_loss"] >= value["clean_loss"] - 1e-6
        assert m["gap"] == pytest.approx(m["test_error"] - m["train_error"])
        assert {"learning_rate", "weight_decay", "batch_size", "epochs"} <= set(
            m["hyperparameters"]
        )
    # the ViTs' attention symmetries were found: two groups (Q/K and V/O)
    assert len(models[0]["plan"]["symmetric_groups"]) == 2
    # tau is computed from the per-model values, and its interval brackets it
    gaps = [m["gap"] for m in models]
    for name in MEASURES:
        values = [m["measures"][name]["value"] for m in models]
        row = doc["tau"][name]
        assert row["tau"] == pytest.approx(kendall_tau(values, gaps)[0], abs=1e-12)
        assert row["ci_low"] <= row["tau"] <= row["ci_high"]
        assert row["models"] == 6
    assert doc["paper_tau"]["MNLI, 35 BERT-base"]["geodesic_mix"] == 0.38
    assert Path(doc["figure"]).is_file() and (out / "transformers.png").is_file()
    records = (out / "transformers-records.jsonl").read_text().splitlines()
    assert len(records) == 6
    with open(out / "gaps.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["gap"]) for r in rows] == pytest.approx(gaps)
    for name in ("train.npz", "test.npz"):
        assert set(load_arrays(str(out / "data" / name))) == {"pixel_values", "labels"}


def test_population_command_with_given_and_measured_gaps(quick, tmp_path, capsys):
    out, _ = quick
    base = ["population", "--checkpoints", str(out / "checkpoints"), *FAST]
    given = tmp_path / "given"
    argv = [*base, "--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--out", str(given)]) == 0
    printed = capsys.readouterr().out
    assert "Kendall tau" in printed and "geodesic_mix" in printed and "-0.70" in printed
    measured = tmp_path / "measured"
    argv = [*base, "--train", str(out / "data/train.npz"), "--test", str(out / "data/test.npz")]
    assert main([*argv, "--out", str(measured), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    a = json.loads((given / "population.json").read_text())
    b = json.loads((measured / "population.json").read_text())
    assert a["gap_source"] == "given" and b["gap_source"] == "measured"
    for x, y in zip(a["models"], b["models"]):
        assert x["gap"] == pytest.approx(y["gap"], abs=1e-6)  # measured here vs at training
        for name in MEASURES:  # the same batches, seeds and settings give the same values
            assert x["measures"][name]["value"] == y["measures"][name]["value"]
    assert (given / "population.png").is_file()


def test_population_resume_reuses_finished_models(quick, tmp_path, monkeypatch):
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    first = json.loads((tmp_path / "population.json").read_text())

    def fail(*args, **kwargs):
        raise AssertionError("a finished model was measured again")

    monkeypatch.setattr(study_module, "_measure_checkpoint", fail)
    assert main([*argv, "--resume"]) == 0
    again = json.loads((tmp_path / "population.json").read_text())
    assert again["tau"] == first["tau"]
    # other settings do not reuse the records
    with pytest.raises(AssertionError, match="measured again"):
        main([*argv, "--resume", "--seed", "1"])


def test_population_ablations(quick, tmp_path):
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--ablations", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "population.json").read_text())
    assert set(doc["tau"]) == set(MEASURES + ABLATIONS)
    for m in doc["models"]:
        assert set(m["measures"]) == set(MEASURES + ABLATIONS)


def test_population_on_text_checkpoints(tmp_path):
    """Sequence classifiers with tokenizers and JSONL data, gaps measured on train/test."""
    root = tmp_path / "checkpoints"
    for i in range(3):
        (root / f"bert-{i}").mkdir(parents=True)
        save_tiny_bert_classifier(root / f"bert-{i}", layers=1, initializer_range=0.1 + 0.1 * i)
    rows = [" ".join(TINY_BERT_WORDS[j : j + 3]) for j in range(0, 12)]
    for name, chunk in (("train", rows[:6]), ("test", rows[6:])):
        with open(tmp_path / f"{name}.jsonl", "w") as handle:
            for k, text in enumerate(chunk):
                handle.write(json.dumps({"text": text, "label": k % 2}) + "\n")
    argv = ["population", "--checkpoints", str(root), *FAST, "--quiet", "--out", str(tmp_path)]
    argv += ["--train", str(tmp_path / "train.jsonl"), "--test", str(tmp_path / "test.jsonl")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "population.json").read_text())
    assert [m["checkpoint"] for m in doc["models"]] == ["bert-0", "bert-1", "bert-2"]
    assert all(m["class"] == "BertForSequenceClassification" for m in doc["models"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_shards_models_over_two_processes(quick, tmp_path, single_thread):
    """Both runs single-threaded: float32 sums depend on the thread count."""
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command = [*torchrun, "-m", "geoopt_quotient", *argv, "--out", str(tmp_path / "two")]
    subprocess.run(command, check=True, env=env, timeout=300)
    one = json.loads((tmp_path / "one/population.json").read_text())
    two = json.loads((tmp_path / "two/population.json").read_text())
    assert two["processes"] == 2 and one["processes"] == 1
    for x, y in zip(one["models"], two["models"]):
        for name in MEASURES:
            assert y["measures"][name]["value"] == pytest.approx(
                x["measures"][name]["value"], rel=1e-10
            )
    assert len((tmp_path / "two/population-records.jsonl").read_text().splitlines()) == 6


# ---------------------------------------------------------------- inputs and statistics
def test_population_argument_errors(quick, tmp_path, capsys):
    out, _ = quick
    base = ["population", "--checkpoints", str(out / "checkpoints"), "--out", str(tmp_path)]
    cases = [
        ([], "the gaps are needed"),
        (["--gaps", str(out / "gaps.csv")], "--data is required"),
        (["--gaps", "g.csv", "--train", "a.npz", "--test", "b.npz"], "either --gaps or"),
        (["--data", str(tmp_path / "nope.npz"), "--gaps", str(out / "gaps.csv")], "no such file"),
        (["--data", str(out / "data/train.npz"), "--gaps", str(tmp_path / "x.csv")], "--gaps"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(base + extra)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_find_checkpoints_errors(quick, tmp_path):
    out, _ = quick
    assert len(find_checkpoints(str(out / "checkpoints"))) == 6
    with pytest.raises(InputError, match="not a directory"):
        find_checkpoints(str(tmp_path / "missing"))
    with pytest.raises(InputError, match="this is one checkpoint"):
        find_checkpoints(str(out / "checkpoints" / "model-00"))
    with pytest.raises(InputError, match="at least 3"):
        find_checkpoints(str(tmp_path))


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_read_gaps(tmp_path):
    names = ["a", "b"]
    assert read_gaps(write(tmp_path / "g.csv", "checkpoint,gap\na,0.1\nb/,0.2\n"), names) == {
        "a": 0.1,
        "b": 0.2,
    }
    errors = write(tmp_path / "e.csv", "checkpoint,train_error,test_error\na,0.1,0.3\nb,0,0.5\n")
    assert read_gaps(errors, names) == pytest.approx({"a": 0.2, "b": 0.5})
    bad = {
        "name,gap\na,1\n": "expected a header",
        "checkpoint,gap\na,1\n": "no gap for b",
        "checkpoint,gap\na,1\na,2\nb,3\n": "listed twice",
        "checkpoint,gap\na,x\nb,1\n": "line 2: not a number",
        "checkpoint,gap\na,nan\nb,1\n": "not finite",
    }
    for text, message in bad.items():
        with pytest.raises(InputError, match=message):
            read_gaps(write(tmp_path / "bad.csv", text), names)


def test_load_arrays_errors(tmp_path):
    def npz(name, **arrays):
        path = tmp_path / name
        np.savez(path, **arrays)
        return str(path)

    ok = npz("ok.npz", pixel_values=np.zeros((3, 1, 2, 2)), labels=np.arange(3))
    assert load_arrays(ok, max_examples=2)["labels"].tolist() == [0, 1]
    cases = {
        npz("a.npz", pixel_values=np.zeros((3, 2))): "no 'labels' array",
        npz("b.npz", labels=np.arange(3)): "no input arrays",
        npz("c.npz", x=np.zeros((2, 2)), labels=np.arange(3)): "differ in their number of rows",
        npz("d.npz", x=np.array([{"a": 1}] * 3, dtype=object), labels=np.arange(3)): "readable",
        npz("e.npz", x=np.array(["a", "b", "c"]), labels=np.arange(3)): "non-numeric",
    }
    for path, message in cases.items():
        with pytest.raises(InputError, match=message):
            load_arrays(path)


def test_tau_table_and_bootstrap():
    rng = np.random.default_rng(0)
    gaps = rng.normal(size=30)
    values = {
        "aligned": gaps + 0.1 * rng.normal(size=30),
        "reversed": -gaps,
        "noise": rng.normal(size=30),
    }
    table = tau_table(values, gaps, resamples=300)
    assert table["aligned"]["tau"] > 0.8 and table["reversed"]["tau"] == pytest.approx(-1)
    assert table["aligned"]["ci_low"] > 0.5 and table["reversed"]["ci_high"] == pytest.approx(-1)
    assert table["noise"]["ci_low"] < table["noise"]["tau"] < table["noise"]["ci_high"]
    # with 4 models many resamples are all ties: they are left out, not NaN
    tau, low, high = kendall_tau_bootstrap([1, 2, 3, 4], [1, 3, 2, 4], resamples=500)
    assert np.isfinite([tau, low, high]).all() and low <= tau <= high


def test_study_settings_validation():
    with pytest.raises(ValueError, match="rho_mix"):
        StudySettings(rho_mix=0)
    with pytest.raises(ValueError, match="kind"):
        StudySettings(kind="best")
    assert StudySettings(ablations=True).measures == MEASURES + ABLATIONS
