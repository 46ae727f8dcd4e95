"""The population study: ``reproduce transformers --quick`` end to end, ``population`` on its
checkpoints (given and measured gaps, resume, ablations, text data, two processes), the
inputs' error messages (one line for data errors), the warning for small populations and
the figure titles. The end-to-end tests are marked slow; the rest is fast."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("sklearn")

import itertools

from conftest import TINY_BERT_WORDS, save_tiny_bert_classifier

from geoopt_quotient.cli import main
from geoopt_quotient.experiments.classifiers import (
    InputError,
    load_arrays,
    load_examples,
    load_tokenizer,
    make_batches,
    read_config,
)
from geoopt_quotient.experiments.population import (
    ABLATIONS,
    MEASURES,
    MIN_MODELS,
    StudySettings,
    find_checkpoints,
    format_tau_table,
    read_gaps,
    run_population,
    tau_table,
)
from geoopt_quotient.experiments.population import study as study_module
from geoopt_quotient.experiments.population.report import population_rows, read_rows_csv
from geoopt_quotient.sharpness import DEFAULT_RADII
from geoopt_quotient.sharpness.stats import kendall_tau, kendall_tau_bootstrap

slow = pytest.mark.slow

FAST = ["--iters", "2", "--max-examples", "32", "--batch-size", "16", "--bootstrap", "200"]


#: stdout and stderr of the ``quick`` run
QUICK_STREAMS: dict = {}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``reproduce transformers --quick --json -`` run, as a shell runs it: its
    directory and JSON document (stdout and stderr are checked below)."""
    out = tmp_path_factory.mktemp("transformers")
    command = [sys.executable, "-m", "geoopt_quotient", "reproduce", "transformers", "--quick"]
    command += ["--out", str(out), "--json", "-"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    QUICK_STREAMS.update(stdout=result.stdout, stderr=result.stderr)
    return out, json.loads((out / "transformers.json").read_text())


@slow
def test_reproduce_json_to_stdout_prints_nothing_else(quick):
    """``--json -``: stdout is the JSON document, stderr is empty (no loading bars, no
    log messages, no progress bars)."""
    _, doc = quick
    assert QUICK_STREAMS["stderr"] == ""
    assert json.loads(QUICK_STREAMS["stdout"]) == doc


@slow
def test_reproduce_quick_document(quick):
    """Also: 6 models get the small-population warning, and the figure's title gives the
    radii and marks the --quick run."""
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
    warning = "only 6 models (fewer than 8): tau is coarse and its bootstrap interval unreliable"
    assert doc["warning"] == warning
    assert all(row["warning"] == warning for row in doc["tau"].values())
    title = doc["figure_title"]
    assert title.startswith("6 ViTs on 8x8 digits (--quick run")
    assert "radii ρ: adaptive 0.2, inv 0.05, mix 0.01; worst case, 3 Auto-PGD iterations" in title
    assert f"warning: {warning}" in title
    records = (out / "transformers-records.jsonl").read_text().splitlines()
    assert len(records) == 6
    with open(out / "gaps.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["gap"]) for r in rows] == pytest.approx(gaps)
    for name in ("train.npz", "test.npz"):
        assert set(load_arrays(str(out / "data" / name))) == {"pixel_values", "labels"}


@slow
def test_population_command_with_given_and_measured_gaps(quick, tmp_path, capsys):
    out, _ = quick
    base = ["population", "--checkpoints", str(out / "checkpoints"), *FAST]
    given = tmp_path / "given"
    argv = [*base, "--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--out", str(given)]) == 0
    printed = capsys.readouterr().out
    assert "Kendall tau" in printed and "geodesic_mix" in printed and "-0.70" in printed
    rows = [line for line in printed.splitlines() if line.startswith(MEASURES)]
    assert len(rows) == 3 and all(re.search(r"\d\.\d{3} ! +\[", row) for row in rows)
    assert "! only 6 models (fewer than 8)" in printed
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
    # the tables hold the JSON's numbers, exactly
    assert read_rows_csv(given / "population.csv") == population_rows(a)
    assert [r["measure"] for r in read_rows_csv(given / "population-tau.csv")] == list(MEASURES)


@slow
def test_population_resume_reuses_finished_models(quick, tmp_path, monkeypatch):
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    first = json.loads((tmp_path / "population.json").read_text())

    def fail(*args, **kwargs):
        raise AssertionError("a finished model was measured again")

    monkeypatch.setattr(study_module, "measure_checkpoint", fail)
    assert main([*argv, "--resume"]) == 0
    again = json.loads((tmp_path / "population.json").read_text())
    assert again["tau"] == first["tau"]
    # other settings do not reuse the records
    with pytest.raises(AssertionError, match="measured again"):
        main([*argv, "--resume", "--seed", "1"])


@slow
def test_population_ablations(quick, tmp_path):
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--ablations", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "population.json").read_text())
    assert set(doc["tau"]) == set(MEASURES + ABLATIONS)
    for m in doc["models"]:
        assert set(m["measures"]) == set(MEASURES + ABLATIONS)


RECORD_KEYS = {"scale", "rho", "measure", "path", "tau", "ci"}


def untimed(entry):
    """``entry`` (dicts and lists of them) less every wall-clock ``seconds``."""
    if isinstance(entry, dict):
        return {k: untimed(v) for k, v in entry.items() if k != "seconds"}
    if isinstance(entry, list):
        return [untimed(v) for v in entry]
    return entry


def check_tau_by_rho(doc, scales, measures, radii):
    """One record per (scale, measure, path), its radius the scale times the measure's,
    its tau that of the per-model values at that scale against the gaps, inside its CI;
    scale 1 is the document's study; a model's values never decrease with the scale (one
    monotone grid per model and measure)."""
    records = doc["tau_by_rho"]
    assert doc["rho_scales"] == sorted(scales)
    assert all(set(r) == RECORD_KEYS for r in records)
    keys = [(r["scale"], r["measure"], r["path"]) for r in records]
    assert len(set(keys)) == len(keys) == len(scales) * len(measures)
    paths = {"adaptive": "straight", "geodesic_inv": "second_order", "geodesic_mix": "second_order"}
    assert set(keys) == {(s, m, paths[m]) for s in scales for m in measures}
    gaps = [m["gap"] for m in doc["models"]]
    for record in records:
        scale, measure = record["scale"], record["measure"]
        assert record["rho"] == pytest.approx(scale * radii[measure], rel=1e-15)
        values = [m["by_scale"][f"{scale:g}"][measure]["value"] for m in doc["models"]]
        assert record["tau"] == pytest.approx(kendall_tau(values, gaps)[0], abs=1e-12)
        low, high = record["ci"]
        assert low <= record["tau"] <= high
        if scale == 1:
            assert record["tau"] == doc["tau"][measure]["tau"]
            assert values == [m["measures"][measure]["value"] for m in doc["models"]]
    for model in doc["models"]:
        for measure in measures:
            column = [model["by_scale"][f"{s:g}"][measure] for s in sorted(scales)]
            for smaller, larger in itertools.pairwise(column):
                assert larger["value"] >= smaller["value"]
                assert all(b >= a for a, b in zip(smaller["per_batch"], larger["per_batch"]))
    ratios = {(r["scale"], r["measure"]): r["ratio"] for r in doc["sharpness_to_clean_loss"]}
    assert set(ratios) == {(s, m) for s in scales for m in measures}
    for measure in measures:  # a larger ball, a larger worst-case increase
        column = [ratios[s, measure] for s in sorted(scales)]
        assert column == sorted(column) and column[0] > 0


@slow
def test_population_rho_scales_and_resume_after_a_kill(quick, tmp_path, monkeypatch, capsys):
    """--rho-scales: tau per (scale, measure, path), a record per (model, scale), each
    model's scales measured in one call on the monotone grid; a run killed between two
    scales of a model measures that model's grid again (its values depend on every
    radius) and no finished model, and a run without --rho-scales measures its own
    single radius, at most the grid's value at scale 1."""
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--out", str(tmp_path)]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--rho-scales", "2,0.5"]) == 0
    printed = capsys.readouterr().out
    assert "Kendall tau against the radius" in printed and "mean sharpness / mean clean" in printed
    assert "population-tau-by-rho.png" in printed
    first = json.loads((tmp_path / "population.json").read_text())
    defaults = {  # the CLI's defaults: the library's table of default radii
        "adaptive": DEFAULT_RADII["adaptive"],
        "geodesic_inv": DEFAULT_RADII["inv"],
        "geodesic_mix": DEFAULT_RADII["mix"],
    }
    check_tau_by_rho(first, [0.5, 1.0, 2.0], MEASURES, defaults)
    assert Path(first["tau_by_rho_figure"]).is_file()
    records_file = tmp_path / "population-records.jsonl"
    lines = records_file.read_text().splitlines()
    assert len(lines) == 6 * 3
    # the kill: model-00 finished, model-01 at its first scale only
    records_file.write_text("\n".join(lines[:4]) + "\n")
    calls = []
    measure_checkpoint = study_module.measure_checkpoint

    def spy(checkpoint, *args, scales, **kwargs):
        calls.append((Path(checkpoint).name, [scale for scale, _ in scales]))
        return measure_checkpoint(checkpoint, *args, scales=scales, **kwargs)

    monkeypatch.setattr(study_module, "measure_checkpoint", spy)
    assert main([*argv, "--rho-scales", "0.5,2", "--resume", "--quiet"]) == 0
    expected = [(f"model-0{i}", [0.5, 1.0, 2.0]) for i in range(1, 6)]
    assert calls == expected
    again = json.loads((tmp_path / "population.json").read_text())
    assert again["tau_by_rho"] == first["tau_by_rho"]
    assert untimed(again["models"]) == untimed(first["models"])
    # without --rho-scales: the grid's records are not its own (the study differs)
    calls.clear()
    assert main([*argv, "--resume", "--quiet"]) == 0
    assert calls == [(f"model-0{i}", [1.0]) for i in range(6)]
    plain = json.loads((tmp_path / "population.json").read_text())
    assert not {"tau_by_rho", "rho_scales", "sharpness_to_clean_loss"} & set(plain)
    assert all("by_scale" not in m and "scale" not in m for m in plain["models"])
    for alone, on_grid in zip(plain["models"], first["models"]):
        for measure in MEASURES:
            assert alone["measures"][measure]["value"] <= on_grid["measures"][measure]["value"]


@slow
def test_reproduce_transformers_rho_scales(quick, tmp_path, capsys):
    """--rho-scales on 'reproduce transformers --quick', resumed from the quick run:
    its trained models are reused and each model's grid (scales 1 and 2) measured in one
    call; scale 1, the grid's smallest, gives the quick run's values exactly."""
    out, doc = quick
    copy = tmp_path / "transformers"
    shutil.copytree(out, copy)
    argv = ["reproduce", "transformers", "--quick", "--out", str(copy), "--resume"]
    assert main([*argv, "--rho-scales", "2"]) == 0
    printed = capsys.readouterr().out
    assert "tau against the radius" in printed.lower() and "transformers-tau-by-rho.png" in printed
    grid = json.loads((copy / "transformers.json").read_text())
    radii = {"adaptive": 0.2, "geodesic_inv": 0.05, "geodesic_mix": 0.01}
    check_tau_by_rho(grid, [1.0, 2.0], MEASURES, radii)
    assert grid["tau"] == doc["tau"]
    assert (copy / "transformers-tau-by-rho.png").is_file()
    assert len((copy / "transformers-records.jsonl").read_text().splitlines()) == 6 + 6 * 2


def test_measure_radius_and_path():
    """The ball and the path of every measure, ablations included, at a scale."""
    settings = StudySettings(rho_adaptive=0.2, rho_inv=0.05, rho_mix=0.01, ablations=True)
    scaled = study_module.scaled_settings(settings, 3.0)
    assert study_module.scaled_settings(settings, 1.0) is settings
    expected = {
        "adaptive": (0.2, "straight"),
        "geodesic_inv": (0.05, "second_order"),
        "geodesic_mix": (0.01, "second_order"),
        "geodesic_inv_no_norm": (0.2, "second_order"),
        "geodesic_inv_no_curvature": (0.05, "straight"),
        "geodesic_mix_no_norm": (0.2, "second_order"),
        "geodesic_mix_no_curvature": (0.01, "straight"),
    }
    assert set(expected) == set(settings.measures)
    for measure, (rho, path) in expected.items():
        assert study_module.measure_radius(settings, measure) == rho
        assert study_module.measure_radius(scaled, measure) == 3.0 * rho
        assert study_module.measure_path(settings, measure) == path
    assert study_module.study_scales(None) == (1.0,)
    assert study_module.study_scales([3, 0.5]) == (0.5, 1.0, 3.0)
    with pytest.raises(ValueError, match="finite number > 0"):
        study_module.study_scales([0.0])


@pytest.fixture(scope="module")
def text_population(tmp_path_factory):
    """Three tiny BERT sequence classifiers and JSONL train/test data: ``population`` argv."""
    directory = tmp_path_factory.mktemp("text-population")
    root = directory / "checkpoints"
    for i in range(3):
        (root / f"bert-{i}").mkdir(parents=True)
        save_tiny_bert_classifier(root / f"bert-{i}", layers=1, initializer_range=0.1 + 0.1 * i)
    rows = [" ".join(TINY_BERT_WORDS[j : j + 3]) for j in range(0, 12)]
    for name, chunk in (("train", rows[:6]), ("test", rows[6:])):
        with open(directory / f"{name}.jsonl", "w") as handle:
            for k, text in enumerate(chunk):
                handle.write(json.dumps({"text": text, "label": k % 2}) + "\n")
    train, test = str(directory / "train.jsonl"), str(directory / "test.jsonl")
    return ["population", "--checkpoints", str(root), *FAST, "--train", train, "--test", test]


def test_text_population_rows_are_told_apart(text_population):
    """The batches the command builds from the text data: every word a vocabulary id
    (none [UNK]), every row different, both labels in each split, so that a mix-up of
    rows, batches or labels changes what is measured."""
    checkpoints = Path(text_population[text_population.index("--checkpoints") + 1])
    rows = []
    for flag in ("--train", "--test"):
        path = text_population[text_population.index(flag) + 1]
        for checkpoint in sorted(checkpoints.iterdir()):
            tokenizer = load_tokenizer(str(checkpoint))
            examples = load_examples(path, read_config(str(checkpoint)))
            (inputs, labels), *rest = make_batches(examples, tokenizer, 16, 32, "cpu", False)
            assert not rest and set(labels.tolist()) == {0, 1}
            ids = inputs["input_ids"][inputs["attention_mask"].bool()]
            assert tokenizer.unk_token_id not in ids.tolist(), checkpoint
            assert len(set(ids.tolist())) > 5  # more than [CLS], [SEP] and 3 words
        rows += [tuple(row) for row in inputs["input_ids"].tolist()]
    assert len(set(rows)) == len(rows) == 12


@slow
def test_population_on_text_checkpoints(text_population, tmp_path):
    """Sequence classifiers with tokenizers and JSONL data, gaps measured on train/test."""
    assert main([*text_population, "--quiet", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "population.json").read_text())
    assert [m["checkpoint"] for m in doc["models"]] == ["bert-0", "bert-1", "bert-2"]
    assert all(m["class"] == "BertForSequenceClassification" for m in doc["models"])


@slow
def test_population_json_to_stdout_prints_nothing_else(text_population, tmp_path, capfd):
    """``--json -``: the JSON on stdout and nothing on stderr, no transformers loading bars or
    log messages (file descriptors captured, as a shell sees them)."""
    argv = [*text_population, "--out", str(tmp_path), "--json", "-", "--rho-mix", "0.01"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    assert captured.err == ""
    doc = json.loads(captured.out)
    assert doc["settings"]["rho_mix"] == 0.01 and doc["settings"]["rho_inv"] == DEFAULT_RADII["inv"]
    assert doc["threads"] == 1  # the default --threads
    assert doc["warning"].startswith("only 3 models (fewer than 8)")
    adaptive = DEFAULT_RADII["adaptive"]
    assert doc["figure_title"].startswith(
        f"3 checkpoints in checkpoints/\nradii ρ: adaptive {adaptive:g}"
    )
    assert "mix 0.01" in doc["figure_title"] and "warning: only 3 models" in doc["figure_title"]


@slow
def test_torchrun_shards_models_over_two_processes(quick, tmp_path, single_thread):
    """Both runs single-threaded: float32 sums depend on the thread count."""
    out, _ = quick
    argv = ["population", "--checkpoints", str(out / "checkpoints"), *FAST, "--quiet"]
    argv += ["--data", str(out / "data/train.npz"), "--gaps", str(out / "gaps.csv")]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # --standalone: torchrun's own rendezvous on a port the system assigns, none probed
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
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
@pytest.fixture
def fake_population(tmp_path):
    """Three directories that look like checkpoints (a config.json, no weights), data and
    gaps files: enough for everything that is checked before a model is loaded."""
    root = tmp_path / "checkpoints"
    for name in ("a", "b", "c"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "the cat", "label": 0}\n')
    gaps = write(tmp_path / "gaps.csv", "checkpoint,gap\na,0.1\nb,0.2\nc,0.3\n")
    return root, str(data), gaps


def test_population_argument_errors_print_the_usage(fake_population, tmp_path, capsys):
    root, data, gaps = fake_population
    base = ["population", "--checkpoints", str(root), "--out", str(tmp_path / "out")]
    cases = [
        ([], "the gaps are needed"),
        (["--gaps", gaps], "--data is required"),
        (["--gaps", gaps, "--train", data, "--test", data], "either --gaps or"),
        (["--data", data, "--gaps", gaps, "--rho-mix", "0"], "must be a finite number > 0"),
        (["--data", data, "--gaps", gaps, "--threads", "0"], "must be >= 1"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(base + extra)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: geoopt-quotient population") and message in err


def population_data_error(argv, capsys) -> str:
    """The one line that a data error prints: no usage block, exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("geoopt-quotient population: error: ") and "usage:" not in err
    assert err.count("\n") == 1 and err.endswith("\n")
    return err


def test_population_data_errors_are_one_line(fake_population, tmp_path, capsys):
    root, data, gaps = fake_population
    out = ["--out", str(tmp_path / "out")]
    cases = [
        ([str(root / "a"), "--data", data, "--gaps", gaps], "this is one checkpoint"),
        ([str(tmp_path / "nope"), "--data", data, "--gaps", gaps], "not a directory"),
        ([str(tmp_path / "out"), "--data", data, "--gaps", gaps], "needs at least 3"),
        ([str(root), "--data", data, "--gaps", str(tmp_path / "x.csv")], "--gaps"),
        ([str(root), "--data", str(tmp_path / "nope.npz"), "--gaps", gaps], "no such file"),
        ([str(root), "--train", data, "--test", str(tmp_path / "t.jsonl")], "--test"),
    ]
    (tmp_path / "out").mkdir()
    for extra, message in cases:
        assert message in population_data_error(
            ["population", "--checkpoints", *extra, *out], capsys
        )
    # a gaps CSV that does not match the checkpoints
    other = write(tmp_path / "other.csv", "checkpoint,gap\na,0.1\nb,0.2\nx,0.3\n")
    argv = ["population", "--checkpoints", str(root), "--data", data, "--gaps", other, *out]
    assert f"--gaps {other}: no gap for c" in population_data_error(argv, capsys)
    # a data file that is not text
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    argv = ["population", "--checkpoints", str(root), "--data", str(binary), "--gaps", gaps, *out]
    assert f"--data {binary}, line 1: not UTF-8 text" in population_data_error(argv, capsys)


def test_an_error_while_measuring_names_the_model(fake_population, tmp_path, capsys):
    """The checkpoints have no weights: loading the first one fails inside the study, and
    the error carries the model's name (a note, Python 3.11+), also on the CLI's line."""
    root, data, gaps = fake_population
    argv = ["population", "--checkpoints", str(root), "--data", data, "--gaps", gaps]
    err = population_data_error([*argv, "--out", str(tmp_path / "out")], capsys)
    assert f"checkpoint {root / 'a'}: no model.safetensors weights" in err
    if sys.version_info >= (3, 11):
        assert err.rstrip().endswith("(while measuring model 'a')")


def test_run_population_adds_the_model_to_any_error(fake_population, monkeypatch):
    root, data, _ = fake_population

    def fail(directory, *args, **kwargs):
        if directory.endswith("b"):
            raise RuntimeError("out of memory")
        return [{"checkpoint": Path(directory).name, "measures": {}, "plan": {}}]

    monkeypatch.setattr(study_module, "measure_checkpoint", fail)
    checkpoints = [str(root / n) for n in ("a", "b", "c")]
    with pytest.raises(RuntimeError, match="out of memory") as info:
        run_population(checkpoints, data, StudySettings(), gaps={"a": 0, "b": 1, "c": 2})
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == ["while measuring model 'b'"]


@slow
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


def test_small_populations_get_a_warning_beside_tau():
    assert MIN_MODELS == 8
    few = tau_table({"adaptive": [1, 2, 3, 4, 5, 6]}, [6, 5, 4, 3, 2, 1], resamples=200)
    row = few["adaptive"]
    assert row["tau"] == pytest.approx(-1) and (row["ci_low"], row["ci_high"]) == (-1, -1)
    assert row["warning"] == (
        "only 6 models (fewer than 8): tau is coarse and its bootstrap interval unreliable"
    )
    text = format_tau_table(few)
    assert re.search(r"^adaptive +-1\.000 ! +\[-1\.00, -1\.00\]", text, flags=re.M)
    assert text.splitlines()[-1] == f"! {row['warning']}"
    rng = np.random.default_rng(1)
    gaps = rng.normal(size=MIN_MODELS)
    enough = tau_table({"adaptive": gaps + rng.normal(size=MIN_MODELS)}, gaps, resamples=200)
    assert enough["adaptive"]["warning"] is None
    text = format_tau_table(enough)
    assert "!" not in text and len(text.splitlines()) == 3


def test_study_settings_validation():
    with pytest.raises(ValueError, match="rho_mix"):
        StudySettings(rho_mix=0)
    with pytest.raises(ValueError, match="kind"):
        StudySettings(kind="best")
    assert StudySettings(ablations=True).measures == MEASURES + ABLATIONS
