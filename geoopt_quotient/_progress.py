"""Progress of long work: a tqdm bar on a terminal, a line every few percent elsewhere.

A bar that redraws itself is useless in a log file or a pipe (and tqdm switches itself off
there), so long commands would say nothing for minutes. :func:`progress_bar` gives a tqdm
bar when stderr is a terminal and otherwise a :class:`LineProgress`, which prints one line
to stderr each time another :data:`EVERY_PERCENT` percent of the work is done.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

from tqdm.auto import tqdm

__all__ = ["EVERY_PERCENT", "LineProgress", "progress_bar", "show_progress"]

#: :class:`LineProgress` prints a line each time this many more percent are done.
EVERY_PERCENT = 10


def show_progress(progress: Optional[bool]) -> bool:
    """Whether to show a progress bar: ``progress``, or when ``None`` whether stderr is a
    terminal."""
    return sys.stderr.isatty() if progress is None else progress


def progress_bar(
    *, total: int, desc: str, unit: str, show: Optional[bool] = None, initial: int = 0, **kwargs
) -> Any:
    """A progress display of ``total`` steps of ``unit``.

    Parameters
    ----------
    total : int
        The number of steps.
    desc, unit : str
        What is done, and what one step is (e.g. ``"training"``, ``"model"``).
    show : bool or None
        ``False``: nothing; ``True``: a tqdm bar on a terminal, else lines
        (:class:`LineProgress`); ``None``: a bar on a terminal, else nothing.
    initial : int
        Steps already done (e.g. by a resumed run).
    **kwargs
        Passed on to :class:`tqdm.tqdm` (``leave``, ``mininterval``...).

    Returns
    -------
    tqdm.tqdm or LineProgress
        Either has ``update``, ``set_postfix``, ``set_postfix_str``, ``close``, ``n`` and
        works as a context manager.
    """
    terminal = sys.stderr.isatty()
    if show is False or (show is None and not terminal):
        return tqdm(total=total, disable=True)
    if terminal:
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, **kwargs)
    return LineProgress(total, desc, unit, initial=initial)


class LineProgress:
    """Prints ``desc: n/total units (p%), elapsed, about ... left`` every few percent.

    Parameters
    ----------
    total : int
        The number of steps.
    desc, unit : str
        What is done, and what one step is.
    initial : int
        Steps already done; the time left is estimated from the steps done here.
    every : int
        Percent of ``total`` between two lines (default :data:`EVERY_PERCENT`).
    file : file-like or None
        Where to print (default: ``sys.stderr`` at each print).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        every: int = EVERY_PERCENT,
        file: Optional[TextIO] = None,
    ):
        self.total, self.desc, self.unit, self.every = max(int(total), 0), desc, unit, every
        self.n = self._start = initial
        self._file, self._postfix = file, ""
        self._began = time.perf_counter()
        self._printed = self._percent(initial) // every

    def _percent(self, n: int) -> int:
        return 100 * n // self.total if self.total else 100

    def update(self, n: int = 1) -> None:
        self.n += n
        level = self._percent(self.n) // self.every
        if level > self._printed or (self.n >= self.total and self._printed < 100 // self.every):
            self._printed = max(level, self._printed)
            self._print()

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = s

    def _print(self) -> None:
        elapsed = time.perf_counter() - self._began
        line = f"{self.desc}: {self.n}/{self.total} {self.unit}s ({self._percent(self.n)}%)"
        line += f", {_duration(elapsed)} elapsed"
        done_here, left = self.n - self._start, self.total - self.n
        if 0 < done_here and left > 0:
            line += f", about {_duration(elapsed / done_here * left)} left"
        if self._postfix:
            line += f" [{self._postfix}]"
        print(line, file=self._file or sys.stderr, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
