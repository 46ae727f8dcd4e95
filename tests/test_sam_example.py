"""The SAM example (SGD, SAM, ASAM, GeodesicSAM on the digits ViT) runs end to end in a
reduced size, and its calibration mode too."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sam_digits.py"


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("sam_digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_help(example, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--quick", "--out", "--seeds", "--threads", "--rho-geodesic", "--calibrate"):
        assert flag in out


def test_quick_run_writes_json_and_figure(example, tmp_path, capsys):
    threads = torch.get_num_threads()
    report = example.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    assert torch.get_num_threads() == threads  # main() restores the thread count

    png = tmp_path / "sam_digits.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((tmp_path / "sam_digits.json").read_text())
    assert written == json.loads(json.dumps(report))
    assert written["figure"] == "sam_digits.png"
    assert written["environment"]["threads"] == 1

    runs = written["runs"]
    assert [r["method"] for r in runs] == ["sgd", "sam", "asam", "geodesic"]  # 1 seed, 1 rho
    assert runs[0]["rho"] is None and all(r["rho"] > 0 for r in runs[1:])
    for run in runs:
        for key in (
            "test_accuracy",
            "test_loss",
            "train_accuracy",
            "train_loss",
            "geodesic_sharpness",
            "adaptive_sharpness",
            "train_seconds",
        ):
            assert math.isfinite(run[key]), (run["method"], key)
        assert 0.0 <= run["test_accuracy"] <= 1.0
        assert run["geodesic_sharpness"] >= 0.0 and run["adaptive_sharpness"] >= 0.0
        assert len(run["epoch_losses"]) == written["settings"]["epochs"]
    # same initialisation and first batches: the first epoch's losses are close
    first = [r["epoch_losses"][0] for r in runs]
    assert max(first) - min(first) < 0.5

    summary = written["summary"]
    assert [(s["method"], s["rho"]) for s in summary] == [(r["method"], r["rho"]) for r in runs]
    for row in summary:
        assert set(row["test_accuracy"]) == {"mean", "std"}
        assert ("test_accuracy_minus_sgd" in row) == (row["method"] != "sgd")
    out = capsys.readouterr().out
    for label in ("SGD", "SAM", "ASAM", "GeodesicSAM"):
        assert label in out
    assert "sam_digits.json" in out

    # --replot redraws the figure and reprints the table from the JSON alone
    again = tmp_path / "replot"
    example.main(["--replot", str(tmp_path / "sam_digits.json"), "--out", str(again)])
    assert (again / "sam_digits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "GeodesicSAM" in capsys.readouterr().out


def test_quick_calibration(example, tmp_path, capsys):
    report = example.main(["--quick", "--calibrate", "--out", str(tmp_path), "--no-progress"])
    written = json.loads((tmp_path / "calibration.json").read_text())
    assert written == json.loads(json.dumps(report))
    rows = written["calibration"]
    assert {r["method"] for r in rows} == {"sam", "asam", "geodesic"}
    for method in ("sam", "asam", "geodesic"):  # a larger radius raises the loss more
        increases = [r["loss_increase"] for r in rows if r["method"] == method and r["epoch"] == 2]
        assert increases[-1] > increases[0]
    assert "L(w') - L(w)" in capsys.readouterr().out


def test_ascent_probe_leaves_the_model_unchanged(example):
    args = example.parse_args(["--quick"])
    model = example.build_model(args, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
    increase = example.ascent_increase(model, "geodesic", 0.05, [batch], args)
    assert math.isfinite(increase)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
