"""Progress of long work: a line every 10% when stderr is not a terminal."""

from __future__ import annotations

import io

from geoopt_quotient._progress import LineProgress, progress_bar


def test_line_progress_prints_every_ten_percent_and_at_the_end():
    out = io.StringIO()
    bar = LineProgress(48, "training", "model", file=out)
    for _ in range(48):
        bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("training: 5/48 models (10%)")
    assert lines[-1].startswith("training: 48/48 models (100%)") and "left" not in lines[-1]
    assert all("elapsed" in line for line in lines)
    assert all("about" in line and "left" in line for line in lines[:-1])


def test_line_progress_after_a_resume_and_with_a_postfix():
    out = io.StringIO()
    bar = LineProgress(10, "models", "model", initial=4, file=out)
    bar.set_postfix_str("geodesic_mix")
    bar.update(1)
    bar.update(5)
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "models: 5/10 models",
        "models: 10/10 models",
    ]
    assert all(line.endswith("[geodesic_mix]") for line in lines)


def test_progress_bar_without_a_terminal(capsys):
    """Under pytest stderr is captured, not a terminal: lines when asked, else nothing."""
    with progress_bar(total=4, desc="work", unit="step", show=True) as bar:
        bar.update(4)
    assert "work: 4/4 steps (100%)" in capsys.readouterr().err
    for show in (None, False):
        with progress_bar(total=4, desc="work", unit="step", show=show) as bar:
            bar.update(4)
        assert capsys.readouterr().err == ""
