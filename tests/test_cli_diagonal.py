"""The ``geoopt-quotient reproduce diagonal`` command on a small population."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from geoopt_quotient.cli import build_parser, main
from geoopt_quotient.cli._runtime import DEFAULT_THREADS, THREADS_HELP
from geoopt_quotient.cli.reproduce import diagonal as diagonal_cli

SMALL = ["reproduce", "diagonal", "--models", "8", "--dim", "40", "--iters", "20"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png(path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(8) == PNG_MAGIC


def test_quiet_json_with_two_seeds(tmp_path, capsys):
    out, doc = tmp_path / "out", tmp_path / "result.json"
    status = main([*SMALL, "--seeds", "2", "--out", str(out), "--json", str(doc), "--quiet"])
    assert status == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # --json FILE --quiet prints nothing
    for name in ("diagonal.png", "diagonal-seed0.png", "diagonal-seed1.png"):
        assert _png(out / name)
    assert (out / "diagonal.json").read_text() == doc.read_text()
    document = json.loads(doc.read_text())
    assert document["summary"]["seeds"] == [0, 1]
    assert len(document["runs"]) == 2
    for name in ("adaptive", "inv", "mix"):
        row = document["summary"]["measures"][name]
        assert len(row["per_seed"]) == 2 and all(-1 <= t <= 1 for t in row["per_seed"])
        assert row["std"] >= 0 and row["paper"] is not None
    run = document["runs"][0]
    assert run["settings"]["models"] == 8 and run["data"]["dim"] == 40
    assert run["data"]["n_train"] == 14  # the l1 recovery threshold for s = 4, d = 40
    per_model = run["per_model"]
    for key in ("test_loss", "train_loss", "sharpness_adaptive", "sharpness_inv", "sharpness_mix"):
        assert len(per_model[key]) == 8
    assert all(s >= 0 for s in per_model["sharpness_inv"])
    assert all(per_model["converged"]) and max(per_model["train_loss"]) <= 1e-5
    assert set(run["timings"]) >= {"train", "sharpness", "total"}
    assert "torch" in document["versions"]


def test_table_and_json_to_stdout(tmp_path, capsys):
    assert main([*SMALL, "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    for token in ("adaptive", "inv", "mix", "-0.68", "-0.83", "-0.86", "diagonal.png"):
        assert token in text
    assert main([*SMALL, "--out", str(tmp_path / "b"), "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)  # stdout holds only the JSON
    assert document["summary"]["measures"]["inv"]["std"] == 0.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "1"], "must be >= 2"),
        (["--dim", "1"], "must be >= 2"),
        (["--models", "many"], "expected an integer"),
        (["--rho", "0"], "must be a finite number > 0"),
        (["--rho", "-0.1"], "must be a finite number > 0"),
        (["--rho-mix", "nan"], "must be a finite number > 0"),
        (["--seeds", "0"], "must be >= 1"),
        (["--seed", "-1"], "must be >= 0"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["reproduce", "diagonal", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_subcommands_and_cuda(capsys):
    for argv in ([], ["reproduce"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as info:
            main([*SMALL, "--device", "cuda", "--quiet"])
        assert info.value.code == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_module_help_in_subprocess():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "geoopt_quotient", "reproduce", "diagonal", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for option in (
        "--models",
        "--dim",
        "--seeds",
        "--rho",
        "--out",
        "--device",
        "--json",
        "--quiet",
    ):
        assert option in result.stdout


def test_few_models_warning_and_figure_titles(tmp_path, capsys, monkeypatch):
    """Fewer than 8 models: a warning under the table, in the JSON and in the figure's
    title; the title gives the radius of every measure."""
    titles = []
    scatter = diagonal_cli.sharpness_scatter

    def spy(*args, title=None, **kwargs):
        titles.append(title)
        return scatter(*args, title=title, **kwargs)

    monkeypatch.setattr(diagonal_cli, "sharpness_scatter", spy)
    argv = ["reproduce", "diagonal", "--models", "4", "--dim", "20", "--iters", "3"]
    argv += ["--rho", "0.2", "--rho-mix", "0.05", "--out", str(tmp_path)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "warning: only 4 models (fewer than 8): tau is coarse" in printed
    document = json.loads((tmp_path / "diagonal.json").read_text())
    assert document["warning"] == "only 4 models (fewer than 8): tau is coarse"
    (title,) = titles
    assert "radii ρ: adaptive 0.2, inv 0.2, mix 0.05" in title and "3 Auto-PGD iterations" in title
    assert "warning: only 4 models" in title
    titles.clear()
    assert main([*SMALL, "--out", str(tmp_path / "eight"), "--quiet"]) == 0  # 8 models
    assert "warning" not in titles[0] and "radii ρ: adaptive 0.1, inv 0.1, mix 0.1" in titles[0]
    assert json.loads((tmp_path / "eight" / "diagonal.json").read_text())["warning"] is None


COMPUTING_COMMANDS = {
    ("sharpness",): ["--model", "m", "--data", "d.jsonl"],
    ("population",): ["--checkpoints", "c", "--data", "d.npz", "--gaps", "g.csv"],
    ("reproduce", "diagonal"): [],
    ("reproduce", "transformers"): [],
}


def _option_help(command) -> str:
    """The --help text of ``command``'s --threads option, whitespace removed."""
    parser = build_parser()
    for name in command:  # walk down the sub-command parsers
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    (action,) = [a for a in parser._actions if "--threads" in a.option_strings]
    return "".join(action.help.split())


@pytest.mark.parametrize("command", list(COMPUTING_COMMANDS), ids=" ".join)
def test_threads_option_is_the_same_in_every_command(command, capsys):
    argv = [*command, *COMPUTING_COMMANDS[command]]
    assert build_parser().parse_args(argv).threads == DEFAULT_THREADS == 1
    assert build_parser().parse_args([*argv, "--threads", "4"]).threads == 4
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*argv, "--threads", bad])
        assert info.value.code == 2
    assert _option_help(command) == "".join(THREADS_HELP.split())
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert "--threads N" in capsys.readouterr().out


def test_threads_restored_after_a_run(tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        argv = ["reproduce", "diagonal", "--models", "3", "--dim", "10", "--iters", "2"]
        assert main([*argv, "--threads", "1", "--out", str(tmp_path), "--quiet"]) == 0
        assert torch.get_num_threads() == 2
        document = json.loads((tmp_path / "diagonal.json").read_text())
        assert document["arguments"]["threads"] == 1
    finally:
        torch.set_num_threads(before)
