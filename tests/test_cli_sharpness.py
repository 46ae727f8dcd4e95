"""``geoopt-quotient sharpness`` on a tiny BERT classifier saved to a temporary directory."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from conftest import TINY_BERT_WORDS, save_tiny_bert_classifier  # noqa: E402

from geoopt_quotient.cli import build_parser, main  # noqa: E402
from geoopt_quotient.cli import sharpness as sharpness_cli  # noqa: E402
from geoopt_quotient.cli._runtime import radii_from_args  # noqa: E402
from geoopt_quotient.experiments.population import StudySettings  # noqa: E402
from geoopt_quotient.sharpness import DEFAULT_RADII  # noqa: E402

WORDS = TINY_BERT_WORDS
TEXTS = [
    ("the cat sat on the mat", None, 0),
    ("a dog ran in the park", None, 1),
    ("the movie was very good", None, 1),
    ("the film is not good", None, 0),
    ("a very bad movie", None, 0),
    ("the dog sat on a mat", None, 1),
    ("the cat ran", None, 1),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny BertForSequenceClassification + BertTokenizerFast, saved with safetensors."""
    directory = save_tiny_bert_classifier(
        tmp_path_factory.mktemp("tiny-bert"), layers=2, initializer_range=0.3
    )
    assert (directory / "model.safetensors").exists()
    return directory


def write_jsonl(path, rows) -> str:
    with open(path, "w") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture
def data(tmp_path):
    rows = [{"text": t, "label": y} for t, _, y in TEXTS]
    rows[2]["label"] = "positive"  # label names from the config work too
    return write_jsonl(tmp_path / "data.jsonl", [rows[0], "", *rows[1:]])


def test_sharpness_command_writes_json(checkpoint, data, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--metric", "both"]
    argv += ["--rho", "0.05", "--iters", "2", "--batch-size", "4", "--max-examples", "6"]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "query-key" in printed and "GLQuotient(17+17, mix)" in printed
    assert "geodesic_inv" in printed and f"wrote {out}" in printed
    assert "note: verified 2 symmetric groups" in printed
    document = json.loads(out.read_text())
    assert document["data"] == {"examples": 6, "batches": 2}
    assert document["model"]["class"] == "BertForSequenceClassification"
    groups = document["plan"]["groups"]
    assert [(g["kind"], g["count"]) for g in groups] == [("query-key", 4), ("value-output", 4)]
    results = document["results"]
    assert set(results) == {"adaptive", "geodesic_mix", "geodesic_inv"}
    for result in results.values():
        assert len(result["per_batch"]) == 2 and result["value"] > 0
        assert result["per_batch"][0] != result["per_batch"][1]  # batches of different rows
        assert result["settings"]["rho"] == 0.05 and result["settings"]["iters"] == 2
    assert results["geodesic_inv"]["settings"]["metric"] == "inv"
    for name in ("geodesic_mix", "geodesic_inv"):  # the estimate only, by default
        assert results[name]["path_gaps"] is None and results[name]["exact_losses"] is None
        assert len(results[name]["estimated_path_gaps"]) == 2
    assert results["adaptive"]["estimated_path_gaps"] is None


def test_path_report_on_request(checkpoint, data, capsys):
    """``--path-report``: the exact geodesic's gaps and losses in the JSON, one more
    forward pass per batch."""
    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--iters", "1"]
    argv += ["--max-examples", "4", "--batch-size", "4", "--path-report", "--json", "-"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)["results"]["geodesic_mix"]
    assert len(result["path_gaps"]) == len(result["exact_losses"]) == 1
    assert result["forward_passes"] == [1 + 1 + 1] and result["backward_passes"] == [1]


def test_json_to_stdout_prints_nothing_else(checkpoint, data, capfd):
    """Only the JSON on stdout, and nothing on stderr: transformers' "Loading weights" bar
    and its log messages are silenced too (file descriptors captured, as a shell sees them)."""
    from transformers.utils import logging

    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--iters", "1"]
    assert main([*argv, "--json", "-"]) == 0
    captured = capfd.readouterr()
    document = json.loads(captured.out)
    assert set(document["results"]) == {"adaptive", "geodesic_mix"}
    assert captured.err == ""
    # transformers' settings are restored after the command
    assert (logging.is_progress_bar_enabled(), logging.get_verbosity()) == (bars, verbosity)


def test_radius_per_measure(checkpoint, data, capsys):
    """--rho-adaptive/--rho-inv/--rho-mix, as in 'population': each ball its radius, --rho
    for those not given, the population study's defaults otherwise."""
    base = ["sharpness", "--model", "m", "--data", "d"]
    defaults = StudySettings()

    def radii(*extra):
        return radii_from_args(build_parser().parse_args([*base, *extra]), defaults)

    assert radii() == {f"rho_{m}": r for m, r in DEFAULT_RADII.items()}
    assert radii("--rho", "0.1", "--rho-mix", "0.01") == {
        "rho_adaptive": 0.1,
        "rho_inv": 0.1,
        "rho_mix": 0.01,
    }
    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--metric", "both"]
    argv += ["--iters", "1", "--max-examples", "4", "--no-verify"]
    argv += ["--rho-adaptive", "0.2", "--rho-inv", "0.03", "--rho-mix", "0.01"]
    assert main([*argv, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["radii"] == {"rho_adaptive": 0.2, "rho_inv": 0.03, "rho_mix": 0.01}
    used = {name: r["settings"]["rho"] for name, r in document["results"].items()}
    assert used == {"adaptive": 0.2, "geodesic_inv": 0.03, "geodesic_mix": 0.01}
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "(rho 0.2," in printed and "(rho 0.03," in printed and "(rho 0.01," in printed


def test_threads_are_applied_and_restored(checkpoint, data, capsys, monkeypatch):
    seen = []
    load = sharpness_cli.load_checkpoint

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return load(*args, **kwargs)

    monkeypatch.setattr(sharpness_cli, "load_checkpoint", spy)
    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--iters", "1", "--quiet"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(argv) == 0  # default: 1 thread
        assert main([*argv, "--threads", "3"]) == 0
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 3]
    assert build_parser().parse_args(["sharpness", "--model", "m", "--data", "d"]).threads == 1
    assert error_of([*argv, "--threads", "0"], capsys, data_error=False)


def error_of(argv, capsys, data_error=True) -> str:
    """stderr of a command that fails with exit status 2.

    A data error is one line, ``geoopt-quotient sharpness: error: ...``, without the
    usage block (the arguments were well formed)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    if data_error:
        assert err.startswith("geoopt-quotient sharpness: error: ")
        assert err.count("\n") == 1 and err.endswith("\n") and "usage:" not in err
    else:
        assert "usage:" in err
    return err


def test_directory_without_safetensors_weights_is_refused(checkpoint, data, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(checkpoint):
        if name != "model.safetensors":
            shutil.copy(checkpoint / name, bare / name)
    (bare / "pytorch_model.bin").write_bytes(b"not loaded")
    err = error_of(["sharpness", "--model", str(bare), "--data", data], capsys)
    assert "no model.safetensors" in err and "pickled weights are never loaded" in err
    os.remove(bare / "config.json")
    err = error_of(["sharpness", "--model", str(bare), "--data", data], capsys)
    assert "no config.json" in err


def test_directory_without_tokenizer_is_refused(checkpoint, data, tmp_path, capsys):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, weights_only / name)
    err = error_of(["sharpness", "--model", str(weights_only), "--data", data], capsys)
    assert "no tokenizer" in err


def test_directory_that_is_no_checkpoint_is_one_line(data, tmp_path, capsys):
    err = error_of(["sharpness", "--model", str(tmp_path), "--data", data], capsys)
    assert f"--model {tmp_path}: no config.json" in err
    err = error_of(["sharpness", "--model", str(tmp_path / "nope"), "--data", data], capsys)
    assert "not a directory" in err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"label": 1}, "line 3: missing field(s) 'text'"),
        ({"text": "the cat"}, "line 3: missing field(s) 'label'"),
        ({"text": "the cat", "label": 2}, "line 3: label 2 is outside [0, 2)"),
        ({"text": "the cat", "label": "neutral"}, "line 3: unknown label 'neutral'"),
        ({"text": "the cat", "label": 0.5}, "line 3: label must be an integer"),
        ({"text": 3, "label": 0}, "line 3: 'text' must be a string"),
        ("{not json", "line 3: not valid JSON"),
        ("[1, 2]", "line 3: expected a JSON object"),
    ],
)
def test_bad_data_lines_are_reported_with_their_number(checkpoint, tmp_path, capsys, line, message):
    good = {"text": "the cat sat", "label": 0}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, line, good])
    err = error_of(["sharpness", "--model", str(checkpoint), "--data", path], capsys)
    assert message in err


def test_missing_data_file_is_reported(checkpoint, tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    err = error_of(["sharpness", "--model", str(checkpoint), "--data", missing], capsys)
    assert f"--data {missing}: no such file" in err


def test_data_that_is_not_text_is_reported(checkpoint, tmp_path, capsys):
    binary = tmp_path / "data.jsonl"
    binary.write_bytes(b'{"text": "the cat", "label": 0}\n\x89PNG\x00\xff\n')
    err = error_of(["sharpness", "--model", str(checkpoint), "--data", str(binary)], capsys)
    assert f"--data {binary}, line 2: not UTF-8 text" in err


def test_library_loader_reports_data_that_is_not_text(checkpoint, tmp_path):
    """The same check in :func:`load_examples` itself, for callers outside the CLI."""
    import transformers

    from geoopt_quotient.experiments.classifiers import InputError, load_examples

    binary = tmp_path / "data.jsonl"
    binary.write_bytes(b'{"text": "the cat", "label": 0}\n\x89PNG\x00\xff\n')
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with pytest.raises(InputError, match=re.escape(f"{binary}, line 2: not UTF-8 text")):
        load_examples(str(binary), config)


@pytest.mark.slow
def test_torchrun_with_two_processes_matches_one_process(checkpoint, data, tmp_path):
    """``torchrun --nproc_per_node 2 -m geoopt_quotient sharpness`` gives each of two gloo
    processes its share of the batches; the values equal a single process's run with the
    same thread settings (float32 reductions depend on the number of threads)."""
    import subprocess
    import sys

    argv = ["sharpness", "--model", str(checkpoint), "--data", data, "--metric", "inv"]
    argv += ["--iters", "2", "--batch-size", "2", "--no-verify", "--quiet"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    single, double = tmp_path / "one.json", tmp_path / "two.json"
    one_process = [sys.executable, "-m", "geoopt_quotient", *argv, "--json", str(single)]
    subprocess.run(one_process, check=True, env=env, timeout=300)  # same threads as workers
    # --standalone: torchrun's own rendezvous on a port the system assigns, none probed
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
    torchrun += ["-m", "geoopt_quotient"]
    subprocess.run([*torchrun, *argv, "--json", str(double)], check=True, env=env, timeout=300)
    one, two = json.loads(single.read_text()), json.loads(double.read_text())
    assert two["processes"] == 2 and one["processes"] == 1
    for name in ("adaptive", "geodesic_inv"):
        assert two["results"][name]["per_batch"] == pytest.approx(
            one["results"][name]["per_batch"], rel=1e-10
        )
        assert two["results"][name]["value"] == pytest.approx(
            one["results"][name]["value"], rel=1e-10
        )


def test_each_process_needs_a_batch():
    """Under torchrun every process measures its share of the batches (every world-th);
    fewer batches than processes stop every process with a data error, before any
    communication; one process measures all batches without a process group."""
    from geoopt_quotient.experiments.classifiers import InputError

    batches = ["b0", "b1"]
    assert sharpness_cli.share_batches(batches, 0, 1) == (batches, None)
    with pytest.raises(InputError, match="2 batches for 3 processes"):
        sharpness_cli.share_batches(batches, 2, 3)
