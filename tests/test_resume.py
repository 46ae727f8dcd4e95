"""A killed population run resumes and ends with the same results as an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from geoopt_quotient.experiments.records import RecordFile

ARGS = ["reproduce", "diagonal", "--models", "12", "--dim", "30", "--iters", "15", "--quiet"]


def comparable(document):
    """The summary and the runs, less wall-clock timings and the resume bookkeeping."""
    runs = []
    for run in document["runs"]:
        run = {k: v for k, v in run.items() if k not in ("timings", "versions")}
        run["settings"] = {k: v for k, v in run["settings"].items() if k != "resumed_models"}
        runs.append(run)
    return document["summary"], runs


def run_cli(out_dir, *extra):
    command = [sys.executable, "-m", "geoopt_quotient", *ARGS, "--out", str(out_dir), *extra]
    subprocess.run(command, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    with open(out_dir / "diagonal.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(tmp_path):
    reference = run_cli(tmp_path / "reference")

    out = tmp_path / "killed"
    records = out / "diagonal-records.jsonl"
    command = [sys.executable, "-m", "geoopt_quotient", *ARGS, "--out", str(out)]
    process = subprocess.Popen(command, env=os.environ | {"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if records.exists() and records.read_text().count("\n") >= 1:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    finished = records.read_text().count("\n")
    assert 1 <= finished < 12
    assert not (out / "diagonal.json").exists()

    resumed = run_cli(out, "--resume")
    assert resumed["runs"][0]["settings"]["resumed_models"] == finished
    assert reference["runs"][0]["settings"]["resumed_models"] == 0
    assert comparable(resumed) == comparable(reference)
    assert len(list(RecordFile(records, resume=True))) == 12


def test_record_file_skips_a_line_cut_off_by_a_kill(tmp_path):
    path = tmp_path / "r.jsonl"
    records = RecordFile(path)
    records.append({"model": 0, "value": 1.5})
    with open(path, "a") as f:
        f.write('{"model": 1, "val')
    assert list(RecordFile(path, resume=True)) == [{"model": 0, "value": 1.5}]
    assert list(RecordFile(path, resume=False)) == []


def test_record_appended_after_a_cut_line_is_kept(tmp_path):
    path = tmp_path / "r.jsonl"
    records = RecordFile(path)
    records.append({"model": 0, "value": 1.5})
    with open(path, "a") as f:
        f.write('{"model": 1, "val')  # killed mid-line
    resumed = RecordFile(path, resume=True)
    resumed.append({"model": 1, "value": 2.5})
    resumed.append({"model": 2, "value": 3.5})
    assert [r["model"] for r in RecordFile(path, resume=True)] == [0, 1, 2]


def test_resume_with_another_thread_count_reuses_the_records(tmp_path):
    """``--threads`` is how a run is executed, not what it computes: a run resumed with
    another thread count reuses every model already measured."""
    from geoopt_quotient.cli import main

    argv = ["reproduce", "diagonal", "--models", "4", "--dim", "10", "--iters", "3", "--quiet"]
    argv += ["--out", str(tmp_path)]
    assert main([*argv, "--threads", "1"]) == 0
    first = json.loads((tmp_path / "diagonal.json").read_text())
    assert main([*argv, "--threads", "2", "--resume"]) == 0
    again = json.loads((tmp_path / "diagonal.json").read_text())
    assert again["runs"][0]["settings"]["resumed_models"] == 4
    assert again["arguments"]["threads"] == 2
    assert comparable(again) == comparable(first)
